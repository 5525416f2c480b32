"""Per-micro-batch pass times against those a schedule paper profiled on the GPU (bench/data/published_runs.yaml,
``profiled_passes``: Zero Bubble's Table 6).

Zero Bubble (Qi et al., ICLR 2024) records, for each of its Table 3 layouts (pure pipelines of GPT-like 1.5B-28.3B models on
A100 SXM 80GB, sequence 1024), the time of one stage's forward (T_F), input-gradient (T_B) and weight-gradient (T_W)
pass for one micro-batch, and of one exchange between neighbouring stages (T_comm). These are measurements of the pieces
the planner's step is built from, not of a step, so they check the per-micro-batch compute apart from the pipeline's
bubble, its exchanges and its optimizer step. Each is set against the planner's times for the same model and micro-batch
(bench.published_runs' model file, Megatron's engine, a stage of full layers: the paper's first and last stages have
one layer fewer), and against its price of one exchange (latency + bytes / bandwidth between the two GPUs of a node).
Nothing is fitted to these figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from bench import published_runs as pr

DATA = pr.DATA


@dataclass(frozen=True)
class Profiled:
    source: str
    model: str
    gpus: int
    micro_batch: int
    microbatches: int
    f_ms: float
    b_ms: float
    w_ms: float
    comm_ms: float


def load(path: Path = DATA) -> list[Profiled]:
    return [Profiled(**r) for r in yaml.safe_load(Path(path).read_text()).get("profiled_passes", [])]


@dataclass(frozen=True)
class Compared:
    row: Profiled
    f_ms: float
    b_ms: float
    w_ms: float
    comm_ms: float

    @property
    def total_error(self) -> float:
        """Relative error of F + B + W (one micro-batch through one stage, forward and backward)."""
        r = self.row
        return (self.f_ms + self.b_ms + self.w_ms) / (r.f_ms + r.b_ms + r.w_ms) - 1.0


def compare(row: Profiled) -> Compared:
    """The planner's pass times (ms) of the first stage of full layers (stage 1 of Megatron's split with the embedding
    and the loss each in a layer's place), and of one exchange of that stage's output to the next, on the same GPU."""
    from planner import hardware
    from planner.engines import get_engine
    from planner.solve.search import Context
    from planner.solve.settings import Settings

    run = next(
        r for r in pr.RUNS_ALL if r.source.key == row.source and r.model.name == row.model and r.micro_batch == row.micro_batch and r.vp == 1 and not r.schedule
    )
    costs = pr.costs_for(run)
    cluster = hardware.parse_gpus(f"{row.gpus}x{pr.DEVICE_PROFILE[run.source.device]}")
    ctx = Context(costs, cluster, Settings.of(engine="megatron", global_batch=row.micro_batch * row.microbatches), get_engine("megatron"))
    times = ctx.times(row.micro_batch, 1, "none", 0, costs.dtype, True, 1)
    bounds = pr.megatron_bounds(
        costs, pr.megatron_split_args(run.model.layers, run.model.hidden, run.model.heads, row.gpus, 1, ("embedding", "loss")), run.model.layers
    )
    lo, hi = bounds[1], bounds[2]
    sent = ctx.sharded(row.micro_batch, 1, True, 1).cuts[hi].bytes
    comm = cluster.p2p_time(sent, 1, 2) + cluster.device_of(1).p2p_sync_s
    ms = 1e3
    return Compared(row, sum(times.fwd[lo:hi]) * ms, sum(times.bwd_input[lo:hi]) * ms, sum(times.bwd_weight[lo:hi]) * ms, comm * ms)


def run_all() -> list[Compared]:
    return [compare(r) for r in load()]


def markdown(rows: list[Compared]) -> str:
    def cell(pred: float, pub: float) -> str:
        return f"{pred:.2f} / {pub:.2f} ({100 * (pred / pub - 1):+.1f}%)"

    out = [
        "| model | GPUs | micro-batch x count | T_F: predicted / profiled ms | T_B | T_W | F + B + W error | T_comm |",
        "|---|---:|---|---|---|---|---:|---|",
    ]
    for c in rows:
        r = c.row
        out.append(
            f"| {r.model} | {r.gpus} | {r.micro_batch} x {r.microbatches} | {cell(c.f_ms, r.f_ms)} | {cell(c.b_ms, r.b_ms)} | {cell(c.w_ms, r.w_ms)} | "
            f"{100 * c.total_error:+.1f}% | {cell(c.comm_ms, r.comm_ms)} |"
        )
    errs = [abs(c.total_error) for c in rows]
    if errs:
        out += ["", f"F + B + W over {len(rows)} profiled rows: mean absolute error {100 * sum(errs) / len(errs):.1f}%, worst {100 * max(errs):.1f}%."]
    return "\n".join(out)


if __name__ == "__main__":
    print(markdown(run_all()))
