"""What a host-issue floor per operator would do to the published runs (a what-if: no profile sets one).

An eager training step issues its operators one by one from the host (Python, PyTorch's dispatcher, the kernel
launch). The GPU runs ahead of the host only while the host stays ahead of it: where a pass issues many short
operators, or where the host waits on the device (Megatron's all-to-all token dispatcher copies the token counts
to the host and synchronises before every MoE layer's dispatch: token_dispatcher.py ``_maybe_dtoh_and_synchronize``,
core_v0.16.1), the pass takes the host's time, not the GPU's. Megatron-Bridge names this "host overhead" as the
compute wall of fine-grained MoE training and captures the router and the dispatcher's preprocessing in CUDA
graphs on its B200 Qwen3-30B-A3B recipe to remove it (docs.nvidia.com/nemo/megatron-bridge, "MoE Training
Optimization" and "CUDA Graphs").

The time model carries it as an optional profile field, ``fixed_costs.host_us`` (planner.solve.timing.host_bound):
each piece's forward takes at least its issued operators x host_us (timing.issued_operators: the traced operators,
each routed grouped GEMM once per local expert, the FP8 casts), its backward likewise. No bundled profile sets it.
Each row below is priced with its layout pinned and the memory check lifted, on the bundled profile with host_us
set to each value. What the table shows: at 5-10 us per operator, a plausible eager figure, the floor binds nowhere
that matters (Qwen3-30B-A3B on B200 moves 1.5 points at 10 us): the pieces' GPU time already covers their operators'
issue, so host issue of the operators the trace records is not what the MoE rows miss. Only at 20-30 us per traced
operator do the Qwen3-30B-A3B rows approach their figures, and then the H100 and the B200 rows disagree (B200 +27%
at 30 us where H100 is still -31%), so no one host figure explains them either; a host-bound step would need several
kernels per traced operator (Transformer Engine's per-expert FP8 quantisation and grouped-GEMM set-up are counted
here as one cast per GEMM input), which would have to be counted from Megatron-Core's own layer, not assumed.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

from bench import published_runs as pr

#: host-issue times tried, microseconds per operator: 0 (the bundled profiles), 5 and 10, the range of one eager
#: operator's framework dispatch and kernel launch (a CUDA kernel launch alone measured 4-6 us:
#: https://susun-blog.com/blog/pegainfer-3-cuda-graph)
HOST_US = (0.0, 5.0, 10.0, 20.0, 30.0)


def priced_step(run: pr.PublishedRun, host_us: float) -> float | None:
    """Seconds per step of the row's pinned layout with the profile's host_us set (memory check lifted); None where refused."""
    from planner import hardware
    from planner.engines import get_engine
    from planner.solve import search
    from planner.solve.settings import Settings

    costs = pr.costs_for(run)
    lay = pr.layout_for(run)
    c = hardware.parse_gpus(f"{run.gpus}x{pr.DEVICE_PROFILE[run.source.device]}")
    cluster = dataclasses.replace(c, groups=tuple(dataclasses.replace(g, device=dataclasses.replace(g.device, host_op_s=host_us * 1e-6)) for g in c.groups))
    opts = Settings.of(engine="megatron", global_batch=run.global_batch, mem_target=pr.UNCHECKED, cp=run.cp, fp8=lay.fp8, **pr._moe_pins(run))
    ev = search.evaluate_layout(search.Context(costs, cluster, opts, get_engine("megatron")), lay, costs.dtype, pr.stage_bounds(run, costs))
    return None if isinstance(ev, search.Rejection) else ev.predicted.step_time_s


def run(rows: Sequence[pr.PublishedRun] | None = None, values: Sequence[float] = HOST_US) -> list[dict]:
    """Per expressible row: its id, source, GPU, published seconds and the signed error at each host_us."""
    out = []
    for r in rows if rows is not None else pr.RUNS_ALL:
        if pr.not_expressible(r):
            continue
        steps = {h: priced_step(r, h) for h in values}
        out.append(
            {
                "id": r.id,
                "source": r.source.key,
                "device": r.source.device,
                "moe": r.model.arch == "moe",
                "published_s": r.step_s,
                "error": {h: (s / r.step_s - 1 if s is not None else None) for h, s in steps.items()},
            }
        )
    return out


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:+.1f}%"


def markdown(rows: Sequence[dict], values: Sequence[float] = HOST_US) -> str:
    head = "| row | GPU | published | " + " | ".join(f"host {h:g} us" for h in values) + " |"
    lines = [head, "|---|---|---:|" + "---:|" * len(values)]
    for r in rows:
        if r["moe"]:
            lines.append(f"| {r['id']} | {r['device']} | {r['published_s']:.2f} s | " + " | ".join(_pct(r["error"][h]) for h in values) + " |")
    dense = [r for r in rows if not r["moe"]]
    moved = {
        h: max((abs(r["error"][h] - r["error"][values[0]]) for r in dense if r["error"][h] is not None and r["error"][values[0]] is not None), default=0.0)
        for h in values
    }
    lines += [
        "",
        f"Dense rows ({len(dense)}): the largest change of any row's error against host 0 us is "
        + ", ".join(f"{100 * moved[h]:.1f} points at {h:g} us" for h in values[1:])
        + ": their passes issue far fewer operators than their GPU time covers.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(run([r for r in pr.RUNS_ALL if "--moe" not in sys.argv or r.model.arch == "moe"])))
