"""torchtitan's published runs (bench/data/torchtitan_runs.yaml), predicted by the torchtitan engine's plan: the
per-GPU reserved-memory peak and the tokens per second per GPU, row by row, with the error of each priced row and why
the others are not priced (a feature the torchtitan engine does not model yet). Nothing is fitted to these rows.

Predicted reserved memory: the plan's most loaded rank's total less the runtime overhead outside PyTorch's caching
allocator (the CUDA context and NCCL's buffers, planner.solve.memory.RuntimeOverhead), since the source measures
``reserved_bytes.all.peak``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "bench" / "data" / "torchtitan_runs.yaml"
GiB = 2**30


@dataclass(frozen=True)
class Row:
    name: str
    model: dict
    gpus: int
    dp: int
    tp: int
    pp: int
    cp: int
    local_batch: int
    seq: int
    ac: str
    compile: bool
    float8: bool
    async_tp: bool
    tps: float
    memory_gib: float
    schedule: str = "1f1b"


def load() -> list[Row]:
    doc = yaml.safe_load(DATA.read_text())
    rows = []
    for r in doc["rows"]:
        r = dict(r)
        r.pop("source")
        r["model"] = doc["models"][r["model"]]
        rows.append(Row(**r))
    return rows


def not_priced(row: Row) -> str | None:
    """Why the torchtitan engine cannot price ``row`` as it ran (None: it can)."""
    missing = [
        what
        for what, used in (
            # torchtitan 9dec370's Interleaved1F1B took its stages per rank from split points the source does not restate
            ("the interleaved schedule's stages per rank (not published)", row.pp > 1 and row.schedule != "1f1b"),
            ("tensor parallelism without full checkpointing", row.tp > 1 and row.ac != "full"),
        )
        if used
    ]
    return ", ".join(missing) or None


def pipeline_bounds(row: Row, costs) -> tuple[int, ...]:
    """Piece boundaries of torchtitan 9dec370's default split for a 1F1B row: ``generate_split_points`` counts the
    embedding and the output layer as one layer each and gives every stage (layers + 2) / pp of them, so the first
    and last stages hold one transformer layer fewer (405B at pp 8: 15, 16 x 6, 15)."""
    layers = int(row.model["n_layers"])
    per, rest = divmod(layers + 2, row.pp)
    if rest:
        raise ValueError(f"{row.name}: {layers} layers + 2 do not split evenly over {row.pp} stages")
    counts = [per - 1] + [per] * (row.pp - 2) + [per - 1]
    starts = [i for i, l in enumerate(costs.layers) if l.block is not None and (i == 0 or costs.layers[i - 1].block != l.block)]
    bounds, at = [0], 0
    for c in counts[:-1]:
        at += c
        bounds.append(starts[at])
    return (*bounds, costs.n)


def settings(row: Row):
    """The row's layout pinned as a torchtitan plan: FSDP over dp (ZeRO 3), tp with sequence parallelism, the local
    batch as one micro-batch, its checkpointing, torch.compile, Float8 (--dtype fp8) and async TP, the loss over the
    whole sequence (--loss-chunks 1); on the source's H100 96GB part, with every GPU's memory usable (mem_target 1.0)."""
    from planner.solve.settings import Settings

    args = {"preset": "llama-7b", **row.model, "seq_len": row.seq}
    pipeline: dict = {}
    if row.pp > 1:
        from planner.model.analyze import analyze

        # 9dec370: pipeline_parallel_microbatches unset -> the pipeline degree (build_pipeline_schedule), 1F1B
        costs = analyze(ROOT / "examples" / "llama.py", args, 1, "bf16").costs
        pipeline = {"schedule": "1f1b", "vp": 1, "bounds": pipeline_bounds(row, costs)}
    micro = row.local_batch // row.pp if row.pp > 1 else row.local_batch
    return Settings.of(
        model_file=str(ROOT / "examples" / "llama.py"),
        model_args=args,
        gpus=f"{row.gpus}xH100-96GB",
        engine="torchtitan",
        pp=row.pp,
        tp=row.tp,
        cp=row.cp,
        dp=row.dp,
        zero=3,
        micro_batch=micro,
        global_batch=row.local_batch * row.dp,
        recompute=row.ac,
        dtype="fp8" if row.float8 else "bf16",
        compile=row.compile,
        tp_comm_overlap=row.async_tp if row.tp > 1 else None,
        # torchtitan 9dec370 computed the cross-entropy over the whole sequence's logits at once (no ChunkedLossWrapper)
        # and did not compile it (train.py: "TODO: compiling loss function causes CUDA errors, turning off for now";
        # training.compile compiled each TransformerBlock only)
        loss_chunks=1,
        compile_loss=False,
        mem_target=1.0,
        **pipeline,
    )


def predict(row: Row) -> tuple[float, float]:
    """(predicted reserved GiB per GPU, predicted tokens/s per GPU) of a priceable row."""
    from planner.planning import plan_model

    plan = plan_model(settings(row))[0]
    worst = max(plan.ranks, key=lambda r: r.memory_bytes["total"])
    overhead = plan.assumptions["runtime_overhead_bytes"]
    reserved = worst.memory_bytes["total"] - overhead["context"] - overhead["communicator"]
    return reserved / GiB, plan.predicted.tokens_per_s / plan.layout.world


def markdown() -> str:
    lines = [
        "| row | layout | measured GiB | predicted GiB | error | measured tok/s/GPU | predicted | error |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    mem_err, tps_err = [], []
    for row in load():
        layout = f"{row.gpus} GPUs, dp {row.dp} tp {row.tp} pp {row.pp} cp {row.cp}, b {row.local_batch} x {row.seq}, AC {row.ac}"
        why = not_priced(row)
        if why:
            lines.append(f"| {row.name} | {layout} | {row.memory_gib} | not priced: {why} | | {row.tps:,.0f} | | |")
            continue
        mem, tps = predict(row)
        me, te = (mem - row.memory_gib) / row.memory_gib, (tps - row.tps) / row.tps
        mem_err.append(abs(me))
        tps_err.append(abs(te))
        lines.append(f"| {row.name} | {layout} | {row.memory_gib} | {mem:.1f} | {me:+.1%} | {row.tps:,.0f} | {tps:,.0f} | {te:+.1%} |")
    if mem_err:
        lines.append("")
        lines.append(
            f"Priced rows: {len(mem_err)} of {len(load())}; mean absolute error {sum(mem_err) / len(mem_err):.1%} (memory), "
            f"{sum(tps_err) / len(tps_err):.1%} (tokens/s)."
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
