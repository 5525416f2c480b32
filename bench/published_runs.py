"""Prediction against published training runs (bench/data/published_runs.yaml), layouts pinned.

Every row is priced with the same defaults (hardware profile, efficiencies,
overheads): nothing is fitted per row. Each published figure is converted to a
step time the way its source counts (bench/data/published_runs.yaml, `sources`):
* Narayanan et al. 2021 and the 2021 Megatron-LM README table count
  96 B s l h^2 (1 + s/6h + V/16lh) FLOPs per step (four passes: full recomputation);
* the 2024 Megatron-LM README (H100) and the Llama 3 paper: Megatron's
  num_floating_point_operations, 12 B s l h^2 ((1 + g/a + s/h) + ffn/h (x 3/2 gated) + V/2lh);
* NeMo / Megatron-Bridge tables: step = global batch x sequence / (tokens/s/GPU x GPUs);
* Korthikanti et al. 2022 and BLOOM publish the step time itself;
* Zero Bubble (Qi et al. 2024): step = global batch / (samples/s/GPU x GPUs).
Mixture-of-experts rows live in bench/data/published_moe_runs.yaml (their shapes are examples/moe.py presets):
* Megatron-LM's MoE README: num_floating_point_operations of Megatron-Core 0.9 (top-k experts, shared experts);
* Megatron-Bridge tables: tokens/s/GPU, checked against their TFLOP/s by Bridge's flop_utils (MLA, MTP, dense
  first layers, causal attention counted once);
* the DeepSeek-V3 report: H800 GPU-hours per trillion tokens.
Each row's layout carries what the run did: context parallelism, FP8 GEMMs, the overlaps its
source states (or the defaults of its software at that version, marked assumed in the data).
Rows the planner cannot express (a schedule of the source's own that no rendered engine
runs, a device without a profile) are kept and reported as such. Sources are split into a tune set and a
test-only set (bench/NOTES.md says why).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from unittest import mock

import yaml

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "bench" / "data" / "published_runs.yaml"
MOE_DATA = ROOT / "bench" / "data" / "published_moe_runs.yaml"
MOE_MODEL = ROOT / "examples" / "moe.py"

#: planner hardware profile per device name used in the data files
DEVICE_PROFILE = {"A100-80GB": "A100-80GB", "H100-SXM": "H100-SXM", "B200": "B200", "H800": "H800"}


@dataclass(frozen=True)
class Source:
    key: str
    cite: str
    device: str
    split: str  # "tune" or "test"
    flop_formula: str  # megatron2021 | megatron2024 | nemo2407
    flop_text: str
    step_from: str  # tflops | tokens | samples | step_s: which published figure gives the step time
    attention: str  # explicit (s x s scores kept, 2021-22 Megatron) | flash
    overlaps: tuple[str, ...]  # grad_reduce | param_gather | tp_comm | ep_comm: what the source's runs overlapped (stated or its defaults)
    overlaps_text: str  # where the overlaps come from
    precision_text: str = ""  # where the rows' gradient dtype and FP8 primary weights come from (FP8 sources)
    pipeline_text: str = ""  # what the source says of its pipeline schedule and stage split, where it says more than pp


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    arch: str  # gpt | llama | nemotron | moe
    preset: str = ""  # moe: the examples/moe.py preset that builds it
    mtp_layers: int = 0  # moe: multi-token-prediction layers the source counts (not in the model file)


@dataclass(frozen=True)
class PublishedRun:
    id: str
    source: Source
    model: Shape
    gpus: int
    tp: int
    pp: int
    dp: int
    cp: int
    vp: int
    ep: int
    micro_batch: int
    global_batch: int
    recompute: str
    sequence_parallel: bool
    precision: str
    distributed_optimizer: bool
    overlap: tuple[str, ...]
    reported: dict
    assumed: tuple[str, ...]
    step_s: float  # the published figure converted to seconds per step (stored in the data file)
    etp: int = 1  # expert tensor-parallel size (MoE rows)
    dispatcher: str = ""  # MoE token dispatcher: alltoall | flex (DeepEP) | allgather
    main_grads_dtype: str = "fp32"  # dtype of the gradient buffer (bf16: NeMo's grad_sync_dtype, Bridge's grad_reduce_in_fp32 off)
    fp8_param_gather: bool = False  # FP8 primary weights (Megatron --fp8-param-gather, Bridge's fp8_param_gather)
    pipeline_split: tuple[str, ...] = ()  # embedding / loss: each takes a layer's place in the stage split (Megatron's account-for flags)
    recompute_modules: tuple[str, ...] = ()  # Megatron --recompute-modules of a selective row (() : core_attn, the default)
    schedule: str = ""  # a pipeline schedule of the source's own that no rendered engine runs ("" : Megatron's, from vp)

    @property
    def num_microbatches(self) -> float:
        """Micro-batches per step on each data-parallel rank (global batch / (micro-batch x dp))."""
        return self.global_batch / (self.micro_batch * self.dp)

    @property
    def split(self) -> str:
        return self.source.split


def moe_config(m: Shape) -> dict:
    """The examples/moe.py configuration of a MoE shape (its preset at the row's sequence length)."""
    return _moe_module()._config(m.preset, seq_len=m.seq)


@functools.cache
def _moe_module():
    """examples/moe.py, loaded once."""
    spec = importlib.util.spec_from_file_location("planner_example_moe", MOE_MODEL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _moe_shape(name: str, v: dict) -> Shape:
    cfg = _moe_module()._config(v["preset"], seq_len=v["seq"])
    return Shape(
        name,
        cfg["n_layers"],
        cfg["dim"],
        cfg["n_heads"],
        cfg["n_kv_heads"],
        cfg["moe_ffn_dim"],
        cfg["vocab_size"],
        cfg["seq_len"],
        "moe",
        v["preset"],
        v.get("mtp_layers", 0),
    )


def load_moe_runs(path: Path = MOE_DATA) -> list[PublishedRun]:
    """Every row of the mixture-of-experts data file (shapes: examples/moe.py presets)."""
    return load_runs(path)


def load_runs(path: Path = DATA) -> list[PublishedRun]:
    """Every row of the data file, with its source and model shape resolved."""
    d = yaml.safe_load(Path(path).read_text())
    sources = {k: Source(key=k, **{**v, "overlaps": tuple(v["overlaps"])}) for k, v in d["sources"].items()}
    shapes = {k: _moe_shape(k, v) if isinstance(v, dict) else Shape(k, *v[:7], v[7]) for k, v in d["models"].items()}
    out = []
    for r in d["runs"]:
        out.append(
            PublishedRun(
                id=r["id"],
                source=sources[r["source"]],
                model=shapes[r["model"]],
                gpus=r["gpus"],
                tp=r["tp"],
                pp=r["pp"],
                dp=r["dp"],
                cp=r.get("cp", 1),
                vp=r.get("vp", 1),
                ep=r.get("ep", 1),
                micro_batch=r["micro_batch"],
                global_batch=r["global_batch"],
                recompute=r["recompute"],
                sequence_parallel=bool(r.get("sequence_parallel", False)),
                precision=r["precision"],
                distributed_optimizer=bool(r.get("distributed_optimizer", False)),
                overlap=tuple(r.get("overlap", sources[r["source"]].overlaps)),
                reported=dict(r["reported"]),
                assumed=tuple(r.get("assumed", ())),
                step_s=float(r["step_s"]),
                etp=r.get("etp", 1),
                dispatcher=r.get("dispatcher", ""),
                main_grads_dtype=r.get("main_grads_dtype", "fp32"),
                fp8_param_gather=bool(r.get("fp8_param_gather", False)),
                pipeline_split=tuple(r.get("pipeline_split", ())),
                recompute_modules=tuple(r.get("recompute_modules", ())),
                schedule=r.get("schedule", ""),
            )
        )
    return out


# ---- the sources' FLOP formulas (FLOPs per step for the global batch) ----


def flops_megatron2021(m: Shape, batch: int) -> float:
    """Narayanan et al. 2021 eq. 3: 96 B s l h^2 (1 + s/6h + V/16lh), full recomputation counted."""
    s, l, h, V = m.seq, m.layers, m.hidden, m.vocab
    return 96 * batch * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))


def flops_megatron2024(m: Shape, batch: int) -> float:
    """Megatron-LM num_floating_point_operations (2024): GQA and gated MLPs, no recomputation."""
    s, l, h, V = m.seq, m.layers, m.hidden, m.vocab
    gated = 1.5 if m.arch == "llama" else 1.0
    attention = 1 + m.kv_heads / m.heads + s / h
    mlp = m.ffn / h * gated
    logit = V / (2 * l * h)
    return 12 * batch * s * l * h**2 * (attention + mlp + logit)


#: vocabulary NeMo 24.07's perf_metrics.py uses per model family (LLM_VOCAB_SIZE_MAP)
NEMO_VOCAB = {"gpt": 51200, "llama2": 32000, "llama3": 128256, "nemotron": 256000}


def flops_nemo2407(m: Shape, batch: int) -> float:
    """NeMo 24.07 FLOPsMeasurementCallback formulas (gpt3, llama2/llama3, nemotron families)."""
    s, l, h = m.seq, m.layers, m.hidden
    if m.arch == "gpt":
        return (24 * batch * s * h * h + 4 * batch * s * s * h) * (3 * l) + 6 * batch * s * h * NEMO_VOCAB["gpt"]
    if m.arch == "llama":
        V, ffn_coeff = m.vocab, 18
    else:
        V, ffn_coeff = NEMO_VOCAB["nemotron"], 12
    return batch * s * l * h * h * (12 + 12 * m.kv_heads / m.heads + ffn_coeff * m.ffn / h + 12 * s / h + 6 * V / (l * h))


def flops_bridge2602(m: Shape, batch: int) -> float:
    """Megatron-Bridge 26.02 tables (llama3): NeMo's llama3 formula with causal attention counted once (6 s/h)."""
    s, l, h = m.seq, m.layers, m.hidden
    return batch * s * l * h * h * (12 + 12 * m.kv_heads / m.heads + 18 * m.ffn / h + 6 * s / h + 6 * m.vocab / (l * h))


def flops_megatron_moe(m: Shape, batch: int, tp: int = 1) -> float:
    """Megatron-Core 0.9 num_floating_point_operations (training.py) for a MoE GPT with every layer MoE:
    12 B s l h^2 ((1 + g/a + s/h) q/h + ffn/h x topk x 3/2 + shared/h x 3/2 + V/(2 l h)), V padded to 128 x tp."""
    c = moe_config(m)
    s, l, h = m.seq, m.layers, m.hidden
    q = c["n_heads"] * c["head_dim"]
    attention = (1 + c["n_kv_heads"] / c["n_heads"] + s / h) * q / h
    mlp = c["moe_ffn_dim"] / h * c["top_k"] * 1.5 + c["n_shared_experts"] * c["shared_ffn_dim"] / h * 1.5
    return 12 * batch * s * l * h * h * (attention + mlp + _padded_vocab(c["vocab_size"], tp) / (2 * l * h))


def _padded_vocab(vocab: int, tp: int, multiple: int = 128) -> int:
    """Megatron's padded vocabulary: a multiple of 128 x tp."""
    step = multiple * tp
    return -(-vocab // step) * step


def flops_bridge_moe(m: Shape, batch: int, tp: int = 1) -> float:
    """Megatron-Bridge flop_utils.transformer_flops (3 passes): dense and MoE layers (routed top-k + shared), GQA or
    MLA projections, causal core attention counted once, multi-token-prediction layers, logits on the padded vocabulary."""
    c = moe_config(m)
    s, h, L, mtp = m.seq, m.hidden, m.layers, m.mtp_layers
    moe_mask = [_moe_module().is_moe_layer(i, c["first_k_dense"], c["moe_layer_freq"]) for i in range(L)]
    n_moe = sum(moe_mask) + (mtp if moe_mask[-1] else 0)
    n_dense = L + mtp - n_moe
    layers = L + mtp
    H = c["n_heads"]
    if c["attention"] == "mla":
        qk, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        q_rank, kv_rank = c["q_lora_rank"], c["kv_lora_rank"]
        q_term = q_rank * (h + H * (qk + rope) + 1) if q_rank else h * H * (qk + rope)
        per_layer = q_term + kv_rank * (h + H * (qk + v) + 1) + h * rope + H * v * h + s * H * (qk + rope) / 2 + s * H * v / 2
    else:
        q, kv = H * c["head_dim"], c["n_kv_heads"] * c["head_dim"]
        per_layer = h * (q + 2 * kv) + q * h + q * s
    attention = 6 * layers * per_layer
    mlp = 6 * h * 3 * (c["ffn_dim"] * n_dense + (c["moe_ffn_dim"] * c["top_k"] + c["n_shared_experts"] * c["shared_ffn_dim"]) * n_moe)
    mtp_proj = 6 * mtp * (3 * h + 2 * h * h)
    logits = 6 * h * _padded_vocab(m.vocab, tp) * (mtp + 1)
    return batch * s * (mlp + attention + mtp_proj + logits)


FLOP_FORMULAS = {
    "megatron2021": flops_megatron2021,
    "megatron2024": flops_megatron2024,
    "nemo2407": flops_nemo2407,
    "bridge2602": flops_bridge2602,
    "megatron_moe09": flops_megatron_moe,
    "bridge_moe": flops_bridge_moe,
}


def step_flops(run: PublishedRun) -> float:
    """FLOPs per step as the run's source counts them (the MoE formulas pad the vocabulary to 128 x tp)."""
    if run.source.flop_formula in ("bridge_moe", "megatron_moe09"):
        return FLOP_FORMULAS[run.source.flop_formula](run.model, run.global_batch, run.tp)
    return FLOP_FORMULAS[run.source.flop_formula](run.model, run.global_batch)


def converted_step_s(run: PublishedRun) -> float:
    """The published figure as seconds per step, by the source's own counting."""
    rep, how = run.reported, run.source.step_from
    if how == "step_s":
        return float(rep["step_s"])
    if how == "tokens":
        return run.global_batch * run.model.seq / (rep["tokens"] * run.gpus)
    if how == "samples":  # samples (sequences) per GPU per second
        return run.global_batch / (rep["samples"] * run.gpus)
    if how == "tflops":
        return step_flops(run) / (rep["tflops"] * 1e12 * run.gpus)
    if how == "gpu_hours":  # GPU-hours per trillion tokens -> tokens/s/GPU
        tokens_per_gpu_s = 1e12 / (rep["gpu_hours_per_trillion_tokens"] * 3600)
        return run.global_batch * run.model.seq / (tokens_per_gpu_s * run.gpus)
    raise ValueError(f"{run.id}: unknown step_from {how!r}")


# ---- what the planner can express today ----


def _has_field(cls, name: str) -> bool:
    return name in {f.name for f in fields(cls)}


def _planner_has_ep() -> bool:
    """Whether the planner's Layout has expert parallelism (field ``ep``)."""
    from planner.solve.plan import Layout

    return _has_field(Layout, "ep")


def not_expressible(run: PublishedRun) -> str | None:
    """Why the planner cannot price this row today (None when it can)."""
    needs = []
    if run.source.device not in DEVICE_PROFILE:
        needs.append(f"a hardware profile for the {run.source.device}")
    if run.ep > 1 and not _planner_has_ep():
        needs.append(f"expert parallelism (ep {run.ep})")
    if run.model.arch == "gpt" and run.model.ffn != 4 * run.model.hidden:
        needs.append("a GPT model file with ffn != 4h")
    if run.schedule:
        needs.append(f"the source's own pipeline schedule {run.schedule}, which no rendered engine runs")
    return "needs " + ", ".join(needs) if needs else None


def model_file(run: PublishedRun) -> tuple[Path, dict]:
    """The example model file and --model-arg values that build this row's shape."""
    m = run.model
    if m.arch == "moe":
        return MOE_MODEL, {"preset": m.preset, "seq_len": m.seq}
    if m.arch == "gpt":
        args = {"preset": "gpt2", "n_layer": m.layers, "n_embd": m.hidden, "n_head": m.heads, "seq_len": m.seq, "vocab_size": m.vocab}
        args["attention"] = "explicit" if run.source.attention == "explicit" else "sdpa"
        return ROOT / "examples" / "gpt2.py", args
    args = {
        "preset": "llama-7b",
        "n_layers": m.layers,
        "dim": m.hidden,
        "n_heads": m.heads,
        "n_kv_heads": m.kv_heads,
        "ffn_dim": m.ffn,
        "seq_len": m.seq,
        "vocab_size": m.vocab,
    }
    if m.arch == "nemotron":  # Nemotron-4: the Llama layout with an ungated squared-ReLU MLP
        args["activation"] = "squared_relu"
    return ROOT / "examples" / "llama.py", args


def _moe_pins(run: PublishedRun) -> dict:
    """ep and etp pinned in the search settings."""
    return {"ep": run.ep, "etp": run.etp}


def layout_for(run: PublishedRun, recompute: str | None = None, fp8: bool | None = None):
    """The row's Megatron Layout: its parallel sizes, schedule, recomputation, FP8 (with FP8 primary weights where the
    row ran them), gradient dtype and the overlaps its source ran (``ep_comm``: --overlap-moe-expert-parallel-comm), each
    overlap kept only where Megatron's validate_args allows it for this layout."""
    from planner.solve.plan import Layout

    zero = 1 if run.distributed_optimizer else 0
    grad_reduce = "grad_reduce" in run.overlap and (run.dp * run.cp > 1 or zero >= 1)
    moe = {k: v for k, v in (("ep", run.ep), ("etp", run.etp)) if _has_field(Layout, k)}  # once the Layout has them
    fp8_on = run.precision in ("fp8", "mxfp8") if fp8 is None else fp8
    rc = recompute or run.recompute
    lay = Layout(
        "megatron",
        run.pp,
        run.tp,
        run.dp,
        run.vp,
        run.micro_batch,
        run.global_batch // (run.dp * run.micro_batch),
        run.global_batch,
        "interleaved" if run.vp > 1 else "1f1b",
        rc,
        zero,
        run.sequence_parallel,
        cp=run.cp,
        tp_comm_overlap="tp_comm" in run.overlap and run.tp > 1 and run.sequence_parallel,
        overlap_grad_reduce=grad_reduce,
        overlap_param_gather="param_gather" in run.overlap and grad_reduce and zero >= 1,
        fp8=fp8_on,
        main_grads_dtype=run.main_grads_dtype,
        fp8_param_gather=run.fp8_param_gather and fp8_on,
        recompute_modules=run.recompute_modules if rc == "selective" else (),
        **moe,
    )
    if "ep_comm" in run.overlap and _has_field(Layout, "ep_comm_overlap"):
        # --overlap-moe-expert-parallel-comm (Bridge's overlap_moe_expert_parallel_comm / moe_a2a_overlap), where
        # Megatron allows it for this layout
        from planner.solve.plan import ep_overlap_allowed

        lay = replace(lay, ep_comm_overlap=ep_overlap_allowed(lay))
    return lay


def split_args(run: PublishedRun):
    """Megatron flags for the row's stage split (layers, heads, pp, vp and the account-for flags of ``pipeline_split``)."""
    m = run.model
    return megatron_split_args(m.layers, m.hidden, m.heads, run.pp, run.vp, run.pipeline_split, run.id)


def megatron_split_args(layers: int, hidden: int, heads: int, pp: int, vp: int, pipeline_split: tuple[str, ...], name: str = ""):
    """Megatron flags for a stage split: layers, heads, pp, vp and --account-for-{embedding,loss}-in-pipeline-split
    for each of ``pipeline_split``."""
    from planner.engines.megatron.flags import Flag, MegatronArgs

    unknown = set(pipeline_split) - {"embedding", "loss"}
    if unknown:
        raise ValueError(f"{name}: pipeline_split takes embedding and loss, not {sorted(unknown)}")
    flags = [("--num-layers", str(layers)), ("--hidden-size", str(hidden)), ("--num-attention-heads", str(heads))]
    flags.append(("--pipeline-model-parallel-size", str(pp)))
    if vp > 1:
        flags.append(("--num-virtual-stages-per-pipeline-rank", str(vp)))
    flags += [(f"--account-for-{what}-in-pipeline-split", None) for what in pipeline_split]
    return MegatronArgs("args", tuple(Flag(n, () if v is None else (v,), k + 1) for k, (n, v) in enumerate(flags)))


def stage_bounds(run: PublishedRun, costs) -> tuple[int, ...] | None:
    """Piece boundaries of the row's stages when its source split them unevenly (``pipeline_split``), else None
    (the planner's partition chooses): :func:`megatron_bounds`."""
    if not run.pipeline_split:
        return None
    return megatron_bounds(costs, split_args(run), run.model.layers, run.id)


def megatron_bounds(costs, args, layers: int, name: str = "") -> tuple[int, ...]:
    """Piece boundaries of Megatron's stages for the split flags ``args`` (:func:`megatron_split_args`). Layers per
    stage are Megatron's for --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split
    (planner.engines.megatron.layout.stage_layers; tests/bench/test_published_runs.py checks them against
    megatron-core's get_num_layers_to_build); the pieces before the first block go to stage 0, those after the last
    block to the last stage."""
    from planner.engines.megatron.layout import stage_layers

    counts = stage_layers(args)
    if counts is None:
        raise ValueError(f"{name}: Megatron cannot split {layers} layers as {args}")
    starts = [i for i, l in enumerate(costs.layers) if l.block is not None and (i == 0 or costs.layers[i - 1].block != l.block)]
    if len(starts) != layers:
        raise ValueError(f"{name}: the model file has {len(starts)} blocks, the row {layers} layers")
    after_blocks = max(i for i, l in enumerate(costs.layers) if l.block is not None) + 1
    bounds, layer = [0], 0
    for k in counts[:-1]:
        layer += k
        bounds.append(starts[layer] if layer < len(starts) else after_blocks)
    bounds.append(costs.n)
    return tuple(bounds)


# ---- prediction ----


@dataclass
class Prediction:
    run: PublishedRun
    predicted_step_s: float | None
    reported_step_s: float
    peak_memory_bytes: float | None  # at --mem-target 1.0 (the rejected layout's need when it does not fit)
    capacity_bytes: float
    bubble: float | None
    rejected: str | None = None  # rejected at --mem-target 1.0
    rejected_default: str | None = None  # rejected at the default --mem-target
    skipped: str | None = None  # not expressible today
    simulated_peak_bytes: float | None = None  # a rejected layout's most loaded rank, simulated with the memory check lifted
    notes: list[str] = field(default_factory=list)

    @property
    def error(self) -> float | None:
        if self.predicted_step_s is None:
            return None
        return (self.predicted_step_s - self.reported_step_s) / self.reported_step_s


_COSTS: dict[tuple, object] = {}


def costs_for(run: PublishedRun):
    """ModelCosts of the row's shape, traced once per shape, attention kind and dtype (cached)."""
    from planner.model.analyze import analyze

    path, args = model_file(run)
    dtype = "fp16" if run.precision == "fp16" else "bf16"
    key = (str(path), tuple(sorted(args.items())), dtype)
    if key not in _COSTS:
        _COSTS[key] = analyze(path, args, 1, dtype).costs
    return _COSTS[key]


def predict(run: PublishedRun) -> Prediction:
    """Price one published run with its layout pinned (engine megatron), at --mem-target 1.0 and the default."""
    from planner import hardware
    from planner.engines import get_engine
    from planner.solve.search import (
        Context,
        Rejection,
        evaluate_layout,
    )
    from planner.solve.settings import DEFAULT_MEM_TARGET, Settings

    why = not_expressible(run)
    if why:
        return Prediction(run, None, run.step_s, None, math.nan, None, skipped=why)
    cluster = hardware.parse_gpus(f"{run.gpus}x{DEVICE_PROFILE[run.source.device]}")
    cap = cluster.device_of(0).memory_bytes
    costs = costs_for(run)
    lay = layout_for(run)
    results = {}
    bounds = stage_bounds(run, costs)
    for target in (1.0, DEFAULT_MEM_TARGET, UNCHECKED):
        opts = Settings.of(engine="megatron", global_batch=run.global_batch, mem_target=target, cp=run.cp, fp8=lay.fp8, **_moe_pins(run))
        results[target] = evaluate_layout(Context(costs, cluster, opts, get_engine("megatron")), lay, costs.dtype, bounds)
    ev, ev_default = results[1.0], results[DEFAULT_MEM_TARGET]
    rejected_default = ev_default.reason if isinstance(ev_default, Rejection) else None
    if isinstance(ev, Rejection):
        free = results[UNCHECKED]
        simulated = None if isinstance(free, Rejection) else max(mem["total"] for mem in free.rank_memory)
        return Prediction(run, None, run.step_s, ev.need_bytes, cap, None, ev.reason, rejected_default, simulated_peak_bytes=simulated)
    return Prediction(run, ev.predicted.step_time_s, run.step_s, ev.predicted.peak_memory_bytes, cap, ev.predicted.bubble_fraction, None, rejected_default)


#: a memory target no layout reaches: prices a layout with the memory check lifted (its simulated per-rank peak)
UNCHECKED = 100.0

RUNS_ALL = tuple(load_runs()) + tuple(load_moe_runs())
#: the 2021-22 Megatron runs the time model was built against (C1-C7), kept with their own accuracy test
RUNS = tuple(r for r in RUNS_ALL if r.id.startswith("C"))


def predict_all() -> list[Prediction]:
    return [predict(r) for r in RUNS_ALL]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def markdown(preds: list[Prediction]) -> str:
    """The RESULTS.md section: one row per run, then the error per source and per split."""
    lines = [
        "| run | source (split) | GPUs | layout tp/pp/dp/cp, vp | mb/gbs | recompute | published | published step | predicted step | error | peak (mem-target 1.0) | fits at 0.85 |",
        "|---|---|---:|---|---|---|---|---:|---:|---:|---:|---|",
    ]
    for p in preds:
        r = p.run
        lay = f"{r.tp}/{r.pp}/{r.dp}/{r.cp}" + (f", vp {r.vp}" if r.vp > 1 else "") + (f", ep {r.ep}" if r.ep > 1 else "")
        pub = ", ".join(f"{k} {v}" for k, v in r.reported.items())
        head = f"| {r.id} | {r.source.key} ({r.split}) | {r.gpus} {r.source.device} | {lay} | {r.micro_batch}/{r.global_batch} | {r.recompute}{' + SP' if r.sequence_parallel else ''} | {pub} ({r.precision}) | {p.reported_step_s:.3g} s |"
        if p.skipped:
            lines.append(f"{head} not expressible: {p.skipped} | | | |")
        elif p.predicted_step_s is None:
            sim = f" (simulated rank peak {p.simulated_peak_bytes / 2**30:.1f} GiB)" if p.simulated_peak_bytes else ""
            lines.append(f"{head} out of memory: {p.rejected} | | {p.peak_memory_bytes / 2**30:.1f} GiB needed{sim} | no |")
        else:
            fits = "yes" if p.rejected_default is None else "no"
            lines.append(f"{head} {p.predicted_step_s:.3g} s | {p.error * 100:+.1f}% | {p.peak_memory_bytes / 2**30:.1f} GiB | {fits} |")
    lines += [
        "",
        "| group | rows | priced | not expressible | out of memory at 1.0 | mean abs. error | worst row | mean signed error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    groups: dict[str, list[Prediction]] = {}
    for p in preds:
        groups.setdefault(f"{p.run.source.key} ({p.run.split})", []).append(p)
    for split in ("tune", "test"):
        groups[f"**all {split}**"] = [p for p in preds if p.run.split == split]
    groups["**all**"] = list(preds)
    # issue 14's set is the dense runs; the mixture-of-experts runs (bench/data/published_moe_runs.yaml) are issue 17's
    dense = [p for p in preds if p.run.model.arch != "moe"]
    groups["**dense test**"] = [p for p in dense if p.run.split == "test"]
    groups["**dense (tune + test)**"] = dense
    groups["**mixture-of-experts test**"] = [p for p in preds if p.run.model.arch == "moe" and p.run.split == "test"]
    for name, ps in groups.items():
        priced = [p for p in ps if p.error is not None]
        errs = [p.error for p in priced]
        skipped = sum(1 for p in ps if p.skipped)
        oom = sum(1 for p in ps if not p.skipped and p.predicted_step_s is None)
        worst = max(priced, key=lambda p: abs(p.error)) if priced else None
        stats = f"{100 * _mean([abs(e) for e in errs]):.1f}% | {worst.run.id} {100 * worst.error:+.1f}% | {100 * _mean(errs):+.1f}%" if worst else "| |"
        lines.append(f"| {name} | {len(ps)} | {len(errs)} | {skipped} | {oom} | {stats} |")
    refused = [p for p in preds if not p.skipped and p.predicted_step_s is None]
    lines.append("")
    lines.append(
        "Every expressible published layout predicted to fit at --mem-target 1.0: "
        + ("yes." if not refused else f"no, {len(refused)} refused: " + ", ".join(f"{p.run.id} ({p.peak_memory_bytes / 2**30:.1f} GiB)" for p in refused) + ".")
    )
    lines.append("")
    lines.append(
        "For comparison: Calculon (SC'23) reports 3.65% mean, 8.87% max on C4-C7 (full and selective); vTrain (MICRO'24) "
        "8.4% MAPE on one node, 14.7% on up to 512 A100s."
    )
    return "\n".join(lines)


# ---- diagnosis: what each priced row's prediction is made of, and counterfactuals ----


def _evaluate(run: PublishedRun, recompute: str | None = None, fp8: bool | None = None, tp_comm: bool = True, mem_target: float = 1.0):
    """evaluate_layout at ``mem_target`` (--mem-target 1.0; :data:`UNCHECKED` lifts the memory check) with optional changes:
    another recomputation, bf16 GEMMs in place of FP8, TP collectives free."""
    from planner import hardware
    from planner.engines import get_engine
    from planner.solve import search
    from planner.solve.settings import Settings

    costs = costs_for(run)
    cluster = hardware.parse_gpus(f"{run.gpus}x{DEVICE_PROFILE[run.source.device]}")
    lay = layout_for(run, recompute, fp8)
    opts = Settings.of(engine="megatron", global_batch=run.global_batch, mem_target=mem_target, cp=run.cp, fp8=lay.fp8, **_moe_pins(run))
    ctx = search.Context(costs, cluster, opts, get_engine("megatron"))
    bounds = stage_bounds(run, costs)
    if tp_comm:
        return search.evaluate_layout(ctx, lay, costs.dtype, bounds)
    with mock.patch.object(search, "tp_collective_time", lambda *a, **k: 0.0):
        return search.evaluate_layout(ctx, lay, costs.dtype, bounds)


def diagnose(run: PublishedRun) -> dict:
    """Break one row's prediction down (seconds): the schedule's makespan, its bubble, exposed data-parallel traffic, the
    optimizer step, and the step with tensor-parallel collectives free (what the TP overlap left exposed).
    FP8 rows are also priced with bf16 GEMMs (the speed-up the FP8 model credits); out-of-memory rows are re-priced
    with recomputation."""
    from planner.solve.search import Rejection

    out: dict = {"id": run.id, "published": run.step_s}
    if not_expressible(run):
        return out
    ev = _evaluate(run)
    if isinstance(ev, Rejection):
        free = _evaluate(run, mem_target=UNCHECKED)  # the same layout priced with the memory check lifted
        if not isinstance(free, Rejection):
            out.update(unchecked_step=free.predicted.step_time_s, unchecked_bubble=free.predicted.bubble_fraction)
        for rc in ("selective", "full"):
            alt = _evaluate(run, recompute=rc)
            out[f"{rc}_step"] = None if isinstance(alt, Rejection) else alt.predicted.step_time_s
            out[f"{rc}_peak_gib"] = (alt.need_bytes if isinstance(alt, Rejection) else alt.predicted.peak_memory_bytes) / 2**30
        return out
    pr = ev.predicted
    out.update(step=pr.step_time_s, makespan=pr.pipeline_time_s, bubble=pr.bubble_fraction, dp_exposed=pr.dp_comm_exposed_s, optimizer=pr.optimizer_s)
    if run.tp > 1:
        free = _evaluate(run, tp_comm=False)
        out["tp_comm"] = pr.step_time_s - free.predicted.step_time_s
    if run.precision == "fp8":
        bf16 = _evaluate(run, fp8=False)
        out["bf16_step"] = None if isinstance(bf16, Rejection) else bf16.predicted.step_time_s
    out["microbatches"] = run.num_microbatches
    return out


def diagnosis_markdown(rows: list[dict]) -> str:
    lines = [
        "| run | published | predicted | error | bubble | DP exposed | optimizer | TP collectives on the critical path | error with TP free | published / (predicted - DP exposed) | other |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for d in rows:
        pub = d["published"]
        if "step" in d:
            tp = d.get("tp_comm", 0.0)
            fp8 = ""
            if "bf16_step" in d:
                fp8 = "; with bf16 GEMMs " + (f"{d['bf16_step']:.3g} s (FP8 credited {d['bf16_step'] / d['step']:.2f}x)" if d["bf16_step"] else "out of memory")
            lines.append(
                f"| {d['id']} | {pub:.3g} s | {d['step']:.3g} s | {100 * (d['step'] - pub) / pub:+.1f}% | {100 * d['bubble']:.1f}% | {d['dp_exposed']:.3f} s | {d['optimizer']:.3f} s | "
                f"{tp:.3g} s ({100 * tp / d['step']:.0f}%) | {100 * (d['step'] - tp - pub) / pub:+.1f}% | {pub / (d['step'] - d['dp_exposed']):.2f} | {d['microbatches']:.0f} micro-batches, "
                f"(published - predicted) / micro-batch = {1000 * (pub - d['step']) / d['microbatches']:+.0f} ms{fp8} |"
            )
        elif "selective_step" in d:
            bits = [
                f"{rc}: "
                + (
                    f"{d[rc + '_step']:.3g} s ({100 * (d[rc + '_step'] - pub) / pub:+.1f}%), peak {d[rc + '_peak_gib']:.1f} GiB"
                    if d[rc + "_step"]
                    else f"out of memory ({d[rc + '_peak_gib']:.1f} GiB)"
                )
                for rc in ("selective", "full")
            ]
            free = ""
            if "unchecked_step" in d:
                u = d["unchecked_step"]
                free = f"memory check lifted: {u:.3g} s ({100 * (u - pub) / pub:+.1f}%, bubble {100 * d['unchecked_bubble']:.1f}%); "
            lines.append(f"| {d['id']} | {pub:.3g} s | out of memory | | | | | | | | {free}re-priced with recomputation: {'; '.join(bits)} |")
    return "\n".join(lines)


def moe_breakdown(run: PublishedRun) -> dict:
    """One MoE row priced with its layout and the memory check lifted, and one GPU's share of a micro-batch (forward +
    backward over all stages, milliseconds) split into dense GEMMs, routed-expert GEMMs, memory-bound operators, the
    token dispatch (4 all-to-alls per MoE layer), the dispatcher's own work around it (timing.moe_dispatcher_terms:
    permutation 2, the probabilities' all-to-all, the token-count all-gather, the host synchronisation) and, in FP8
    rows, the Transformer Engine cast kernels (MoE pieces: the routed and shared experts' GEMM inputs)."""
    from planner import hardware
    from planner.engines import get_engine
    from planner.solve import search
    from planner.solve.plan import ep_overlap_allowed
    from planner.solve.settings import Settings
    from planner.solve.timing import bytes_time, expert_dispatch_time, expert_gemm_time, moe_dispatcher_terms, ops_time

    costs = costs_for(run)
    cluster = hardware.parse_gpus(f"{run.gpus}x{DEVICE_PROFILE[run.source.device]}")
    lay = layout_for(run)
    opts = Settings.of(engine="megatron", global_batch=run.global_batch, mem_target=UNCHECKED, cp=run.cp, fp8=lay.fp8, **_moe_pins(run))
    ctx = search.Context(costs, cluster, opts, get_engine("megatron"))
    ev = search.evaluate_layout(ctx, lay, costs.dtype)
    split = lay.tp if lay.sequence_parallel and lay.tp > 1 else 1
    dev, mm = cluster.device_of(0), "fp8" if lay.fp8 else "bf16"
    layers = ctx.sharded(lay.micro_batch, lay.tp, lay.sequence_parallel, lay.cp).layers
    ms = {
        "dense_gemm": sum(ops_time(l.op_flops_fwd, l.flops_fwd, dev, mm) + ops_time(l.op_flops_bwd, l.flops_bwd, dev, mm) for l in layers),
        "expert_gemm": sum(
            expert_gemm_time(l.expert_op_flops_fwd, l.num_experts, lay.ep, split, dev, mm)
            + expert_gemm_time(l.expert_op_flops_bwd, l.num_experts, lay.ep, split, dev, mm)
            for l in layers
        ),
        "memory_bound": sum(
            bytes_time(l.op_bytes_fwd + l.op_bytes_fwd_resid, l.mem_bytes_fwd, dev) + bytes_time(l.op_bytes_bwd + l.op_bytes_bwd_resid, l.mem_bytes_bwd, dev)
            for l in layers
        ),
        "dispatch": sum(4 * expert_dispatch_time(cluster, l.routed_bytes / split, 0, lay.ep, lay.etp) for l in layers if l.num_experts),
        "dispatcher_terms": sum(
            sum(moe_dispatcher_terms(cluster, dev, l.routed_rows / split, l.routed_bytes / split, l.num_experts, 0, lay.ep, lay.etp))
            for l in layers
            if l.num_experts
        ),
    }
    if lay.fp8:
        casts, _ = search.fp8_casts(costs, lay.micro_batch, lay.tp, lay.cp, split, lay.etp, get_engine(lay.engine))
        ms["fp8_casts"] = sum(bytes_time(tuple(f) + tuple(b), 0.0, dev) for f, b in casts or [] if f or b)
    priced = not isinstance(ev, search.Rejection)
    # the row's layout with --overlap-moe-expert-parallel-comm on and off, where Megatron allows it (the row's own
    # setting is one of the two: its `overlap` names ep_comm where its source's recipe runs the overlap)
    over = search.evaluate_layout(ctx, replace(lay, ep_comm_overlap=True), costs.dtype) if ep_overlap_allowed(lay) else None
    under = search.evaluate_layout(ctx, replace(lay, ep_comm_overlap=False), costs.dtype) if lay.ep_comm_overlap else ev
    return {
        "id": run.id,
        "published_s": run.step_s,
        "predicted_s": ev.predicted.step_time_s if priced else None,
        "peak_gib": max(r["total"] for r in ev.rank_memory) / 2**30 if priced else None,
        "ep_comm_overlap": lay.ep_comm_overlap,
        "with_ep_overlap_s": over.predicted.step_time_s if over is not None and not isinstance(over, search.Rejection) else None,
        "without_ep_overlap_s": under.predicted.step_time_s if not isinstance(under, search.Rejection) else None,
        **{k: v * 1e3 for k, v in ms.items()},
    }


if __name__ == "__main__":
    if "--moe" in sys.argv:
        for r in RUNS_ALL:
            if r.model.arch == "moe" and not not_expressible(r):
                print(moe_breakdown(r))
    elif "--diagnose" in sys.argv:
        print(diagnosis_markdown([diagnose(r) for r in RUNS_ALL]))
    else:
        print(markdown(predict_all()))
