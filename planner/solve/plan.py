"""The Plan record and its JSON form (plan.json, schema-versioned, deterministic).

plan.json is what every later step reads: the renderers, `validate`, `smoke`,
`explain` and the report. Floats are rounded to 6 significant digits so the
file is stable and readable; nothing time- or host-dependent is written.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from planner import __version__
from planner.errors import UsageError
from planner.fileio import loads_json_bounded, read_text_bounded
from planner.solve.mesh import Mesh
from planner.solve.settings import Settings

SCHEMA_VERSION = 1


def _round(x: Any) -> Any:
    if isinstance(x, float):
        if x == 0 or not math.isfinite(x):
            return x
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_round(v) for v in x]
    return x


#: engine name -> how a layout an older planner wrote for that engine reads today (each wing registers its own in its
#: rules module; the solver knows none of them)
LAYOUT_UPGRADES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {}


@dataclass(frozen=True)
class Layout:
    """How the model and the cluster are split: every knob the search turns."""

    engine: str
    pp: int
    tp: int
    dp: int
    vp: int
    micro_batch: int
    num_microbatches: int
    global_batch: int
    schedule: str
    recompute: str
    zero: int
    sequence_parallel: bool = False
    #: context-parallel group size: each sequence is split over cp GPUs (ring attention); world = pp x tp x cp x dp
    cp: int = 1
    #: tensor-parallel collectives overlapped with the GEMMs (Megatron --tp-comm-overlap: needs sequence parallelism)
    tp_comm_overlap: bool = False
    #: gradient reduce(-scatter) overlapped with the last micro-batch's backward (Megatron --overlap-grad-reduce)
    overlap_grad_reduce: bool = False
    #: parameter all-gather of the distributed optimizer overlapped with the next forward (--overlap-param-gather)
    overlap_param_gather: bool = False
    #: dtype of the gradients kept and reduced: "fp32" (the engine's main gradients) or "bf16"
    main_grads_dtype: str = "fp32"
    #: dtype of the Adam moments: "fp32", or "bf16" / "fp16" (Megatron's precision-aware optimizer)
    optimizer_state_dtype: str = "fp32"
    #: Transformer Engine FP8 GEMMs (bf16 weights and activations, FP8 matmuls at the device's FP8 peak)
    fp8: bool = False
    #: FP8 primary weights (Megatron --fp8-param-gather, TransformerConfig.fp8_param): each TE weight is kept only as FP8
    #: (and its FP8 transpose on Hopper), no bf16 copy, and the distributed optimizer all-gathers it in FP8
    fp8_param_gather: bool = False
    #: expert-parallel size (mixture-of-experts models): each MoE layer's experts are split over ep GPUs of the
    #: tp x cp x dp GPUs of a pipeline stage (as Megatron forms its expert groups); 1 for dense models
    ep: int = 1
    #: tensor-parallel size of the experts (Megatron --expert-tensor-parallel-size); ep x etp divides tp x cp x dp
    etp: int = 1
    #: the expert-parallel all-to-alls of one micro-batch overlapped with the computation of another (Megatron
    #: --overlap-moe-expert-parallel-comm: the combined 1F1B schedule; needs ep > 1, vp with pp > 1, no full recompute)
    ep_comm_overlap: bool = False
    #: what selective recomputation recomputes (Megatron --recompute-modules, in the order given); () is the engine's
    #: default, the core attention (Megatron: core_attn)
    recompute_modules: tuple[str, ...] = ()
    #: micro-batches per chunk group of the interleaved schedule (Megatron
    #: --microbatch-group-size-per-virtual-pipeline-stage); 0 is the schedule's default (p when m is a multiple of p)
    microbatch_group: int = 0
    #: how a context-parallel group exchanges keys and values (Megatron --cp-comm-type, Transformer Engine's
    #: DotProductAttention cp_comm_type): "p2p" (ring, overlapped with the attention blocks), "all_gather" (keys and
    #: values gathered before attention, exposed), "a2a" (DeepSpeed-Ulysses: heads scattered, sequence gathered)
    cp_comm: str = "p2p"
    #: torch.compile of the model's blocks (torchtitan --compile.enable): rendered, required by async tensor
    #: parallelism, and priced with the blocks' memory-bound operators fused (planner.solve.timing.compiled_traffic);
    #: their memory as eager
    compile: bool = False

    @property
    def modules_recomputed(self) -> frozenset[str]:
        """The modules selective recomputation recomputes (core_attn when none are named); empty without it."""
        if self.recompute != "selective":
            return frozenset()
        return frozenset(self.recompute_modules or ("core_attn",))

    @property
    def mesh(self) -> Mesh:
        """The parallel axes (planner.solve.mesh): every rank arithmetic of this layout."""
        return Mesh(self.pp, self.dp, self.cp, self.tp, self.ep, self.etp)

    @property
    def world(self) -> int:
        """GPUs the layout uses: pp x tp x cp x dp."""
        return self.mesh.world

    @property
    def overlaps(self) -> tuple[str, ...]:
        """The communication overlaps the layout assumes, by their Megatron flag names."""
        on = (
            ("tp-comm-overlap", self.tp_comm_overlap),
            ("overlap-grad-reduce", self.overlap_grad_reduce),
            ("overlap-param-gather", self.overlap_param_gather),
            ("overlap-moe-expert-parallel-comm", self.ep_comm_overlap),
        )
        return tuple(name for name, flag in on if flag)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Layout:
        upgrade = LAYOUT_UPGRADES.get(str(d.get("engine")))
        if upgrade is not None:
            d = upgrade(d)
        values = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        if "recompute_modules" in values:
            values["recompute_modules"] = tuple(values["recompute_modules"])
        return cls(**values)

    def short(self) -> str:
        v = f" v{self.vp}" if self.vp > 1 else ""
        sp = " +sp" if self.sequence_parallel else ""
        cp = (f" cp{self.cp}" + (f"({self.cp_comm})" if self.cp_comm != "p2p" else "")) if self.cp > 1 else ""
        fp8 = (" fp8" + (" fp8-params" if self.fp8_param_gather else "")) if self.fp8 else ""
        fp8 += " compile" if self.compile else ""
        ep = f" ep{self.ep}" + (f" etp{self.etp}" if self.etp > 1 else "") if self.ep > 1 else ""
        rc = f"({'+'.join(self.recompute_modules)})" if self.recompute_modules and self.recompute == "selective" else ""
        g = f" group{self.microbatch_group}" if self.microbatch_group else ""
        return (
            f"pp{self.pp} tp{self.tp}{cp} dp{self.dp}{ep}{v}{g} {self.schedule} mb{self.micro_batch}x{self.num_microbatches} "
            f"recompute={self.recompute}{rc} zero={self.zero}{sp}{fp8}"
        )


def ep_overlap_allowed(lay: Layout) -> bool:
    """Whether Megatron runs --overlap-moe-expert-parallel-comm for the layout (TransformerConfig.__post_init__,
    core_v0.16.1): expert parallelism (ep > 1), virtual pipeline stages when pp > 1 (the combined 1F1B schedule is
    the interleaved one's, or the one without pipelining), no full recomputation; the all-to-all dispatcher is what
    the renderer writes and the model is bf16 / fp16 (FP8 GEMMs included)."""
    return lay.ep > 1 and (lay.pp == 1 or lay.vp > 1) and lay.recompute != "full"


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage (a virtual chunk when vp > 1) and what it costs on one of its GPUs."""

    index: int
    rank: int  # pipeline rank that runs it
    pieces: tuple[int, int]  # [start, stop) piece indices
    layers: tuple[str, str]  # first and last piece names
    #: forward of one micro-batch, seconds; where the engine waits on its sends (EngineRules.blocking_sends) it holds
    #: the send of its output too, and the input-gradient part of time_bwd_s the send of the input's gradient
    time_fwd_s: float
    time_bwd_s: float  # whole backward of one micro-batch (input + weight gradients), recomputation included
    time_bwd_weight_s: float  # the weight-gradient part of time_bwd_s (the W pass of zero-bubble schedules)
    time_recompute_s: float  # the recomputation part of time_bwd_s (not extra to it)
    send_fwd_s: float  # boundary transfer to the next stage that overlaps the next pass (0 where the pass holds it)
    send_bwd_s: float
    params: int
    memory_bytes: dict[str, int]  # this stage's share: weights, grads, optimizer, activations, buffers, overhead, total
    capacity_bytes: int
    device: str

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["pieces"] = list(self.pieces)
        d["layers"] = list(self.layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StagePlan:
        d = dict(d)
        d["pieces"] = tuple(d["pieces"])
        d["layers"] = tuple(d["layers"])
        return cls(**d)


@dataclass(frozen=True)
class RankMemory:
    """Peak memory of one pipeline rank (all its virtual stages), by component, bytes."""

    rank: int
    memory_bytes: dict[str, int]
    capacity_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Predicted:
    step_time_s: float
    tokens_per_s: float
    samples_per_s: float
    tflops_per_gpu: float  # model FLOPs (3 x forward, recompute excluded) per GPU per second / 1e12
    mfu: float
    bubble_fraction: float
    pipeline_time_s: float  # the schedule's makespan
    dp_comm_exposed_s: float  # data-parallel gradient traffic not hidden behind backward
    optimizer_s: float  # the optimizer step (Adam over the local shard) and, where the engine does it, the gradient-buffer zeroing
    peak_memory_bytes: int  # the most loaded GPU

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Alternative:
    layout: Layout
    predicted: Predicted | None = None
    rejected: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "layout": self.layout.to_dict(),
            "predicted": self.predicted.to_dict() if self.predicted else None,
            "rejected": self.rejected,
        }


@dataclass
class Plan:
    layout: Layout
    stages: list[StagePlan]
    ranks: list[RankMemory]
    predicted: Predicted
    alternatives: list[Alternative]
    #: what the plan was asked (plan.json's ``inputs``: the record's fields)
    settings: Settings
    #: what plan.json's ``inputs`` holds beside the settings: the model file's sha256, the tracer used
    provenance: dict[str, Any]
    model: dict[str, Any]
    cluster: dict[str, Any]
    assumptions: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    @property
    def inputs(self) -> dict[str, Any]:
        """plan.json's ``inputs``: the settings' serialised form and the provenance."""
        return {**self.settings.to_inputs(), **self.provenance}

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = _round(
            {
                "schema_version": SCHEMA_VERSION,
                "planner_version": __version__,
                "layout": self.layout.to_dict(),
                "stages": [s.to_dict() for s in self.stages],
                "ranks": [r.to_dict() for r in self.ranks],
                "predicted": self.predicted.to_dict(),
                "alternatives": [a.to_dict() for a in self.alternatives],
                "inputs": self.inputs,
                "model": self.model,
                "cluster": self.cluster,
                "assumptions": self.assumptions,
                "notes": list(self.notes),
            }
        )
        return doc

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise UsageError(
                f"plan.json has schema_version {version!r}; this planner reads version {SCHEMA_VERSION}.",
                "Re-run `planner plan` with this planner version to regenerate it.",
            )
        inputs = d.get("inputs") or {}
        return cls(
            layout=Layout.from_dict(d["layout"]),
            stages=[StagePlan.from_dict(s) for s in d["stages"]],
            ranks=[RankMemory(**r) for r in d.get("ranks", [])],
            predicted=Predicted(**d["predicted"]),
            alternatives=[
                Alternative(Layout.from_dict(a["layout"]), Predicted(**a["predicted"]) if a.get("predicted") else None, a.get("rejected"))
                for a in d.get("alternatives", [])
            ],
            settings=Settings.from_inputs(inputs),
            provenance={k: v for k, v in inputs.items() if k not in Settings.recorded()},
            model=d.get("model", {}),
            cluster=d.get("cluster", {}),
            assumptions=d.get("assumptions", {}),
            notes=list(d.get("notes", [])),
        )


#: the most stages a plan holds (pipeline ranks x stages per rank): far above any real run, low enough to print
MAX_STAGES = 4096


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read plan.json (a file or a plan directory) with a clear error when it is missing or malformed."""
    p = Path(path)
    if p.is_dir():
        p = p / "plan.json"
    if not p.is_file():
        raise UsageError(f"No plan at {str(p)!r}.", "Run `planner plan MODEL.py --gpus SPEC --out DIR` first.")
    data = loads_json_bounded(read_text_bounded(p, "plan.json"), str(p))
    stages = data.get("stages") if isinstance(data, dict) else None
    if isinstance(stages, list) and len(stages) > MAX_STAGES:
        raise UsageError(f"{p} holds {len(stages):,} stages; a plan has at most {MAX_STAGES:,}.", "It is not a plan the planner wrote; re-plan.")
    try:
        return Plan.from_dict(data)
    except (KeyError, TypeError) as e:
        raise UsageError(f"{p} is not a planner plan (missing or unexpected field {e}).") from e
