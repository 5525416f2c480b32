"""The memory validation set: measured per-GPU peaks published with their full layouts, predicted by each engine's
plan, error per row and per source, tune and test sources apart.

Rows: torchtitan's H100 benchmark (source T1, bench/data/torchtitan_runs.yaml: the tune source) and the test
sources of bench/data/memory_runs.yaml (Megatron-LM's functional-test golden values, torchtitan's H200 benchmark).
Each row's layout is pinned (Megatron's rows with Megatron's even split of layers over pp x vp stages), every GPU's
memory usable (mem_target 1.0). What is compared is what the source measured:

* ``allocated`` (torch.cuda.max_memory_allocated): the plan's tensors on the measured rank: weights, gradients,
  optimizer state, activations and buffers, without the runtime overhead (CUDA context, NCCL, fragmentation reserve);
* ``reserved`` (reserved_bytes.all.peak): those plus the fragmentation reserve: the rank's total less the CUDA
  context and NCCL's buffers (planner.solve.memory.RuntimeOverhead), which live outside PyTorch's allocator.

The measured rank is the source's (Megatron: the last rank; torchtitan: the maximum over ranks, or rank 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench import torchtitan_runs

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "bench" / "data" / "memory_runs.yaml"
GiB = 2**30


@dataclass(frozen=True)
class Row:
    name: str
    source: str
    split: str
    metric: str  # allocated | reserved
    rank: str  # last | first | max
    engine: str
    gpus: str
    model_file: str
    model_args: dict[str, Any]
    tp: int
    pp: int
    vp: int
    dp: int
    micro_batch: int
    global_batch: int
    zero: int
    recompute: str
    measured_gib: float
    float8: bool = False
    compile: bool = False
    #: measured tokens per second per GPU, where the source gives it (0: not given)
    tps: float = 0.0
    #: Megatron's --account-for-{embedding,loss}-in-pipeline-split: each takes a layer's place in the stage split
    pipeline_split: tuple[str, ...] = ()


def load() -> list[Row]:
    """The test sources' rows (memory_runs.yaml) after the tune source's priced rows (torchtitan_runs.yaml, T1)."""
    doc = yaml.safe_load(DATA.read_text())
    rows: list[Row] = []
    for t in torchtitan_runs.load():
        if torchtitan_runs.not_priced(t):
            continue
        rows.append(
            Row(
                t.name,
                "T1",
                "tune",
                "reserved",
                "max",
                "torchtitan",
                "",
                "",
                {},
                t.tp,
                t.pp,
                1,
                t.dp,
                t.local_batch // t.pp,  # torchtitan 9dec370: as many micro-batches as pipeline stages
                t.local_batch * t.dp,
                3,
                t.ac,
                t.memory_gib,
                t.float8,
                t.compile,
                t.tps,
            )
        )
    for r in doc["rows"]:
        src = doc["sources"][r["source"]]
        model = doc["models"][r["model"]]
        rows.append(
            Row(
                r["name"],
                r["source"],
                src["split"],
                src["metric"],
                src["rank"],
                r["engine"],
                r["gpus"],
                model["file"],
                {**model["args"], **r.get("args", {})},
                r["tp"],
                r["pp"],
                r["vp"],
                r["dp"],
                r["micro_batch"],
                r["global_batch"],
                r["zero"],
                r["recompute"],
                float(r["measured_gib"]),
                bool(r.get("float8", False)),
                bool(r.get("compile", False)),
                float(r.get("tps", 0.0)),
                tuple(r.get("pipeline_split", ())),
            )
        )
    return rows


def even_bounds(costs, layers_per_stage: int, stages: int) -> tuple[int, ...]:
    """Piece boundaries of Megatron's default split: the same number of layers in every (virtual) stage, the pieces
    before the first layer on the first stage and those after the last on the last."""
    starts = [i for i, l in enumerate(costs.layers) if l.block is not None and (i == 0 or costs.layers[i - 1].block != l.block)]
    if len(starts) != layers_per_stage * stages:
        raise ValueError(f"{len(starts)} layers do not split evenly over {stages} stages")
    return (0, *(starts[layers_per_stage * j] for j in range(1, stages)), costs.n)


def evaluate(row: Row):
    """(rank memory dicts, predicted tokens/s per GPU) of the row's layout as it ran, priced by its engine."""
    from dataclasses import replace

    if row.source == "T1":
        from planner.planning import plan_model

        t = next(t for t in torchtitan_runs.load() if t.name == row.name)
        plan = plan_model(torchtitan_runs.settings(t))[0]
        return [r.memory_bytes for r in plan.ranks], plan.predicted.tokens_per_s / plan.layout.world
    from planner import hardware
    from planner.engines import get_engine
    from planner.model.analyze import analyze
    from planner.solve.plan import Layout
    from planner.solve.search import Context, Rejection, evaluate_layout, with_options
    from planner.solve.settings import Settings

    costs = analyze(ROOT / row.model_file, row.model_args, 1, "bf16").costs
    engine = get_engine(row.engine)
    # torchtitan before ChunkedLossWrapper computed the loss over the whole sequence: --loss-chunks 1
    chunks = {"loss_chunks": 1} if get_engine(row.engine).loss_chunks else {}
    opts = Settings.of(engine=row.engine, global_batch=row.global_batch, mem_target=1.0, fp8=row.float8, compile=row.compile, **chunks)
    schedule = "interleaved" if row.vp > 1 else "1f1b"
    m = row.global_batch // (row.micro_batch * row.dp)
    # Megatron's functional tests run no sequence parallelism; torchtitan's tensor parallelism always does
    sp = row.tp > 1 and row.engine != "megatron"
    base = Layout(row.engine, row.pp, row.tp, row.dp, row.vp, row.micro_batch, m, row.global_batch, schedule, row.recompute, row.zero, sp)
    (lay,) = [replace(l, tp_comm_overlap=False) for l in with_options(base, opts, engine)][:1]
    bounds = None
    if row.engine == "megatron" and row.pp > 1 and row.pipeline_split:
        from bench.published_runs import megatron_bounds, megatron_split_args

        a = row.model_args
        layers = int(a["n_layer"])
        split = megatron_split_args(layers, int(a["n_embd"]), int(a["n_head"]), row.pp, row.vp, row.pipeline_split, row.name)
        bounds = megatron_bounds(costs, split, layers, row.name)
    elif row.engine == "megatron" and row.pp > 1:
        layers = int(row.model_args["layers"])
        bounds = even_bounds(costs, layers // (row.pp * row.vp), row.pp * row.vp)
    ev = evaluate_layout(Context(costs, hardware.parse_gpus(row.gpus), opts, engine), lay, costs.dtype, bounds)
    if isinstance(ev, Rejection):
        raise RuntimeError(f"{row.name}: {ev.reason}")
    return ev.rank_memory, ev.predicted.tokens_per_s / lay.world


def predict(row: Row) -> float:
    """Predicted GiB of what the row's source measured, on the rank it measured."""
    return predict_both(row)[0]


def predict_both(row: Row) -> tuple[float, float]:
    """(predicted GiB of what the row's source measured on the rank it measured, predicted tokens/s per GPU)."""
    from planner.solve.memory import RuntimeOverhead

    ranks, tps = evaluate(row)
    mem = {"last": ranks[-1], "first": ranks[0], "max": max(ranks, key=lambda m: m["total"])}[row.rank]
    overhead = RuntimeOverhead()
    if row.metric == "allocated":
        got = sum(mem[k] for k in ("weights", "grads", "optimizer", "activations", "buffers"))
    else:
        got = mem["total"] - overhead.context - overhead.communicator
    return got / GiB, tps


def markdown() -> str:
    lines = [
        "| row | source (split) | engine | layout | measured | predicted GiB | error | tok/s/GPU measured | predicted | error |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    errors: dict[str, list[float]] = {}
    tps_errors: dict[str, list[float]] = {}
    split_of: dict[str, str] = {}
    for row in load():
        layout = f"{row.gpus or 'H100-96GB'} tp {row.tp} pp {row.pp} vp {row.vp} dp {row.dp}, mb {row.micro_batch}, {row.recompute}"
        layout += (", Float8" if row.float8 else "") + (", compile" if row.compile else "")
        got, tps = predict_both(row)
        err = (got - row.measured_gib) / row.measured_gib
        errors.setdefault(row.source, []).append(err)
        split_of[row.source] = row.split
        speed = "| | |"
        if row.tps:
            te = (tps - row.tps) / row.tps
            tps_errors.setdefault(row.source, []).append(te)
            speed = f"{row.tps:,.0f} | {tps:,.0f} | {te:+.1%} |"
        lines.append(
            f"| {row.name} | {row.source} ({row.split}) | {row.engine} | {layout} | {row.measured_gib:.2f} GiB {row.metric} ({row.rank} rank) | {got:.2f} | {err:+.1%} | {speed}"
        )
    lines += ["", "| source | split | rows | mean absolute error | worst |", "|---|---|---:|---:|---:|"]
    for src, errs in errors.items():
        lines.append(f"| {src} | {split_of[src]} | {len(errs)} | {sum(map(abs, errs)) / len(errs):.1%} | {max(errs, key=abs):+.1%} |")
    for split in ("tune", "test"):
        errs = [e for s, es in errors.items() if split_of[s] == split for e in es]
        if errs:
            lines.append(f"| all {split} | {split} | {len(errs)} | {sum(map(abs, errs)) / len(errs):.1%} | {max(errs, key=abs):+.1%} |")
    if tps_errors:
        lines += [
            "",
            "Tokens per second per GPU (torchtitan's rows, as published):",
            "",
            "| source | split | rows | mean absolute error | worst |",
            "|---|---|---:|---:|---:|",
        ]
        for src, errs in tps_errors.items():
            lines.append(f"| {src} | {split_of[src]} | {len(errs)} | {sum(map(abs, errs)) / len(errs):.1%} | {max(errs, key=abs):+.1%} |")
    under = [r.name for r in load() if not math.isnan(r.measured_gib)]
    lines += ["", f"Rows: {len(under)} from {len(errors)} sources."]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
