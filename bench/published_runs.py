"""Prediction against published training runs (../shared/reference/published-runs.md), layouts pinned.

Every row is priced with the same defaults (hardware profile, efficiencies,
overheads): nothing is fitted per row. Reported throughput is converted to a
step time with the FLOP formula its authors used:
* Narayanan et al. 2021 (C1-C3) count 96 B s l h^2 (1 + s/6h + V/16lh) FLOPs per
  step: four passes (forward, recomputed forward, backward x 2), i.e. with the
  full recomputation those runs used;
* Korthikanti et al. 2022 (C4-C7) report step times directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Run:
    id: str
    preset: str  # examples/gpt2.py preset (explicit attention, as Megatron ran it then)
    gpus: int
    tp: int
    pp: int
    dp: int
    vp: int
    micro_batch: int
    global_batch: int
    recompute: str
    sequence_parallel: bool
    reported_step_s: float | None
    reported_tflops: float | None
    source: str

    def reported_step(self, layers: int, hidden: int, vocab: int, seq: int = 2048) -> float:
        if self.reported_step_s is not None:
            return self.reported_step_s
        flops = 96 * self.global_batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
        return flops / (self.reported_tflops * 1e12 * self.gpus)


NARAYANAN = "Narayanan et al. 2021 (arXiv 2104.04473), Table 2 (comparison with ZeRO-3); micro-batch 1 assumed"
KORTHIKANTI = "Korthikanti et al. 2022 (arXiv 2205.05198), Tables 3-4"

RUNS = (
    Run("C1", "gpt3-175b", 384, 8, 12, 4, 1, 1, 1536, "full", False, None, 153, NARAYANAN),
    Run("C2", "gpt3-175b", 768, 8, 12, 8, 1, 1, 1536, "full", False, None, 149, NARAYANAN),
    Run("C3", "gpt3-175b", 1536, 8, 12, 16, 1, 1, 1536, "full", False, None, 141, NARAYANAN),
    Run("C4", "megatron-22b", 8, 8, 1, 1, 1, 4, 4, "selective", True, 1.10, None, KORTHIKANTI),
    Run("C4-full", "megatron-22b", 8, 8, 1, 1, 1, 4, 4, "full", True, 1.42, None, KORTHIKANTI),
    Run("C5", "gpt3-175b", 64, 8, 8, 1, 3, 1, 64, "selective", True, 13.75, None, KORTHIKANTI),
    Run("C5-full", "gpt3-175b", 64, 8, 8, 1, 3, 1, 64, "full", True, 18.13, None, KORTHIKANTI),
    Run("C6", "mt-nlg-530b", 280, 8, 35, 1, 3, 1, 280, "selective", True, 37.83, None, KORTHIKANTI),
    Run("C6-full", "mt-nlg-530b", 280, 8, 35, 1, 3, 1, 280, "full", True, 49.05, None, KORTHIKANTI),
    Run("C7", "gpt-1t", 512, 8, 64, 1, 1, 1, 512, "selective", True, 71.49, None, KORTHIKANTI),
    Run("C7-full", "gpt-1t", 512, 8, 64, 1, 1, 1, 512, "full", True, 94.42, None, KORTHIKANTI),
)

#: what the closest analytical and simulation models report on comparable sets (published-runs.md, formulas.md)
OTHERS = (
    ("Calculon (SC'23), C4-C7 full and selective, its own validation on a 2-core CPU", "3.65% mean, 8.87% max"),
    ("vTrain (MICRO'24), profiling-driven simulator", "8.4% MAPE on one node, 14.7% on up to 512 A100s"),
)


@dataclass
class Prediction:
    run: Run
    predicted_step_s: float | None
    reported_step_s: float
    peak_memory_bytes: float | None
    capacity_bytes: float
    bubble: float | None
    rejected: str | None = None

    @property
    def error(self) -> float | None:
        if self.predicted_step_s is None:
            return None
        return (self.predicted_step_s - self.reported_step_s) / self.reported_step_s


_COSTS: dict[str, object] = {}


def costs_for(preset: str):
    """ModelCosts of the GPT example at this preset with explicit attention (cached)."""
    if preset not in _COSTS:
        from planner.model.analyze import analyze

        _COSTS[preset] = analyze(ROOT / "examples" / "gpt2.py", {"preset": preset, "attention": "explicit"}, 1, "fp16").costs
    return _COSTS[preset]


def predict(run: Run) -> Prediction:
    """Price one published run with its layout pinned, on A100-80GB nodes of 8 (DGX A100, HDR InfiniBand)."""
    from planner import hardware
    from planner.solve.plan import Layout
    from planner.engines import get_engine
    from planner.solve.search import Context, Rejection, SearchOptions, evaluate_layout

    costs = costs_for(run.preset)
    cluster = hardware.parse_gpus(f"{run.gpus}xA100-80GB")
    schedule = "interleaved" if run.vp > 1 else "1f1b"
    opts = SearchOptions(engine="megatron", global_batch=run.global_batch, mem_target=1.0)
    lay = Layout("megatron", run.pp, run.tp, run.dp, run.vp, run.micro_batch, run.global_batch // (run.dp * run.micro_batch), run.global_batch, schedule, run.recompute, 0, run.sequence_parallel)
    ev = evaluate_layout(Context(costs, cluster, opts, get_engine("megatron")), lay, costs.dtype)
    a = costs.architecture
    reported = run.reported_step(a["num_layers"], a["hidden_size"], a["vocab_size"], a["seq_length"])
    cap = cluster.device_of(0).memory_bytes
    if isinstance(ev, Rejection):
        return Prediction(run, None, reported, ev.need_bytes, cap, None, ev.reason)
    return Prediction(run, ev.predicted.step_time_s, reported, ev.predicted.peak_memory_bytes, cap, ev.predicted.bubble_fraction)


def predict_all() -> list[Prediction]:
    return [predict(r) for r in RUNS]


def markdown(preds: list[Prediction]) -> str:
    """The RESULTS.md section: one row per run, then the mean absolute percentage error."""
    lines = [
        "| run | layout (tp/pp/dp, vp) | recompute | reported step | predicted step | error | predicted peak memory (of 80 GB) |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    errs = []
    for p in preds:
        r = p.run
        lay = f"{r.tp}/{r.pp}/{r.dp}" + (f", vp {r.vp}" if r.vp > 1 else "")
        if p.predicted_step_s is None:
            lines.append(f"| {r.id} | {lay} | {r.recompute} | {p.reported_step_s:.2f} s | rejected: {p.rejected} | | |")
            continue
        errs.append(abs(p.error))
        lines.append(
            f"| {r.id} | {lay} | {r.recompute}{' + SP' if r.sequence_parallel else ''} | {p.reported_step_s:.2f} s | {p.predicted_step_s:.2f} s | "
            f"{p.error * 100:+.1f}% | {p.peak_memory_bytes / 2**30:.1f} GiB |"
        )
    mape = 100 * sum(errs) / len(errs) if errs else math.nan
    lines.append("")
    lines.append(f"Mean absolute percentage error: **{mape:.1f}%** over {len(errs)} runs (max {100 * max(errs):.1f}%).")
    lines.append("")
    lines.append("For comparison: " + "; ".join(f"{name}: {err}" for name, err in OTHERS) + ".")
    return "\n".join(lines)
