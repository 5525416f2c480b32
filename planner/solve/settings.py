"""The settings of a plan: one nested, frozen, typed record, declared once.

Everything `planner plan` is asked, in documented sections (torchtitan's config tree is the model: sections of
documented fields, not Megatron's flat namespace):

* :class:`ModelSettings`: which model, at which precision, traced how;
* :class:`ClusterSettings`: which GPUs, and what overrides their profile;
* :class:`Pins`: the layout dimensions the user fixed (None: searched);
* :class:`MemorySettings`: the memory target and what is kept in memory how (recomputation, optimizer, precision);
* :class:`Overlaps`: which communications overlap which computation (None: the engine's default, or searched);
* :class:`SearchKnobs`: how the search runs. Not a setting of the plan: plan.json does not record them.

Each field is declared here once (:func:`setting`), with its default, its documentation (the CLI's help too) and
its flag. `planner plan`'s options are generated from these fields and build the record once (``planner.cli``), the
search reads its sections, and plan.json's ``inputs`` is its serialised form
(:meth:`Settings.to_inputs`, read back by :meth:`Settings.from_inputs`): one flat mapping, one key per recorded
field. Every field name is unique across the sections, so a flat name (``pp``, ``mem_target``) names one field;
:meth:`Settings.of` and :meth:`Settings.but` take flat names, for callers that set a few fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from planner.errors import UsageError
from planner.records import LossRun
from planner.solve.memory import RuntimeOverhead

DEFAULT_MEM_TARGET = 0.85
#: field metadata of a search knob: how the search runs (or derived from another setting), not recorded in plan.json
KNOB = {"knob": True}


def setting(default: Any = None, help: str = "", *, flag: str | None = None, cli: bool | None = None, knob: bool = False, factory: Any = None) -> Any:
    """A settings field: its default, its documentation (``help``: also the CLI's), its flag on `planner plan`
    (``--`` and the name with dashes unless ``flag`` says otherwise; none where ``cli`` is False, and by default none
    for a knob), and whether it is a knob (``knob``: how the planner runs, not recorded in plan.json)."""
    meta = {"help": help, "flag": flag, "cli": (not knob) if cli is None else cli, "knob": knob}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True, kw_only=True)
class ModelSettings:
    """The model: its file or spec, the arguments passed to it, the precision, how it is traced."""

    model_file: str = setting("", "Model file defining build_model() and example_inputs(), or hf:CONFIG.json, timm:NAME, torchvision:NAME.", flag="MODEL")
    model_args: dict[str, Any] = setting(help="KEY=VALUE passed to the model file's functions (repeatable).", flag="--model-arg", factory=dict)
    dtype: str = setting("bf16", "bf16 | fp16 | fp32 | fp8 (FP8 GEMMs: Megatron's Transformer Engine, torchtitan's Float8 rowwise; H100/H200/B200)")
    cost_micro_batch: int = setting(1, "The micro-batch the pieces are costed at (the search scales the costs from it).", cli=False)
    leaf: tuple[str, ...] = setting((), "Class name to keep as one piece (repeatable).")
    tracer: str = setting("auto", "auto | fx | export")
    compile: bool = setting(
        False, "torch.compile the model's blocks (torchtitan --compile.enable; needed by its async TP): their memory-bound operators priced fused."
    )
    compile_loss: bool | None = setting(
        None, "torch.compile torchtitan's loss too (--compile.components): its fp32 upcast and log-softmax fused; default: with --compile."
    )


@dataclass(frozen=True, kw_only=True)
class ClusterSettings:
    """The GPUs: the cluster spec and what overrides the hardware profiles."""

    gpus: str = setting("", "Cluster, e.g. 8xA100, 64xH100, 4x8xA100-80GB, 8xA100+8xV100.")
    gpus_per_node: int | None = setting(None, "Override the profile's GPUs per node.")
    inter_node_gbps: float | None = setting(None, "Inter-node bandwidth per GPU, Gb/s (as NICs are quoted).")
    hardware_profiles: tuple[str, ...] = setting((), "Extra hardware profile YAML (file or folder).", flag="--hardware-profile")
    profile: str | None = setting(None, "Measured per-layer times from `planner profile`.")


@dataclass(frozen=True, kw_only=True)
class Pins:
    """The layout dimensions the user fixed; None is searched."""

    global_batch: int | None = setting(None, "Samples per optimizer step (default: 8 per GPU).")
    pp: int | None = setting(None, "Pin the pipeline-parallel degree.")
    tp: int | None = setting(None, "Pin the tensor-parallel degree (Megatron, torchtitan).")
    dp: int | None = setting(None, "Pin the data-parallel degree.")
    cp: int | None = setting(None, "Pin the context-parallel degree (Megatron, torchtitan; sequence divisible by 2 x cp).")
    cp_comm: str | None = setting(
        None, "Pin how context parallelism exchanges keys and values: p2p | all_gather | a2a (Megatron), all_gather (torchtitan).", flag="--cp-comm-type"
    )
    vp: int | None = setting(None, "Pin virtual stages per rank (interleaved).")
    ep: int | None = setting(None, "Pin the expert-parallel degree (Megatron, MoE models; divides the experts).")
    etp: int | None = setting(None, "Pin the expert tensor-parallel degree (Megatron, MoE models).")
    micro_batch: int | None = setting(None, "Pin the micro-batch size.")
    schedule: str | None = setting(None, "Pin the schedule: gpipe | 1f1b | interleaved | zb-h1 | zbv.")
    microbatch_group: int | None = setting(
        None, "Pin the interleaved schedule's micro-batches per chunk group (Megatron --microbatch-group-size-per-virtual-pipeline-stage; p to m)."
    )
    zero: int | None = setting(None, "Pin the ZeRO stage (0 or 1 with a pipeline).")
    bounds: tuple[int, ...] | None = setting(None, "Fixed stage boundaries (piece indices); needs every layout dimension pinned.", cli=False)


@dataclass(frozen=True, kw_only=True)
class MemorySettings:
    """How much memory a plan may use and what is kept in it how."""

    mem_target: float = setting(DEFAULT_MEM_TARGET, "Fraction of usable GPU memory a plan may use.")
    recompute: str | None = setting(None, "Pin recomputation: none | selective | full.")
    recompute_modules: tuple[str, ...] = setting(
        (),
        "What selective recomputation recomputes (Megatron --recompute-modules), comma-separated: core_attn (default), mla_up_proj, mlp; pins --recompute selective.",
    )
    optimizer: str = setting("adam", "adam | sgd: optimizer state bytes per parameter.", cli=False)
    main_grads_dtype: str = setting("fp32", "fp32 | bf16: gradients kept and reduced in (Megatron).")
    optimizer_state_dtype: str = setting("fp32", "fp32 | bf16 | fp16: Adam moments (Megatron, zero 1).")
    fp8: bool = setting(False, "FP8 GEMMs at the device's FP8 peak (set from --dtype fp8).", knob=True)
    fp8_param_gather: bool = setting(False, "FP8 primary weights, no bf16 copy (Megatron --fp8-param-gather; needs --dtype fp8 and zero 1).")
    loss_chunks: int = setting(
        0, "Chunks torchtitan's ChunkedLossWrapper splits the sequence into for the output layer and loss (--loss.num_chunks); 0: its default, 8."
    )


@dataclass(frozen=True, kw_only=True)
class Overlaps:
    """Communication overlapped with computation; None: the engine's default, or searched both ways."""

    tp_comm_overlap: bool | None = setting(None, "Pin TP communication overlap (Megatron --tp-comm-overlap, torchtitan's async TP; needs tp > 1).")
    overlap_grad_reduce: bool | None = setting(None, "Pin the gradient-reduce overlap (Megatron).")
    overlap_param_gather: bool | None = setting(None, "Pin the parameter all-gather overlap (Megatron, zero 1).")
    ep_comm_overlap: bool | None = setting(
        None, "Pin the expert-parallel all-to-all overlap (Megatron, ep > 1, vp when pp > 1, no full recompute).", flag="--overlap-moe-expert-parallel-comm"
    )


@dataclass(frozen=True, kw_only=True)
class SearchKnobs:
    """How the planner runs; none changes what the plan is asked, so plan.json records none."""

    cache: bool = setting(True, "Read and write the cache of analysed models (planner.model.cache).", knob=True, cli=True)

    overhead: RuntimeOverhead = setting(RuntimeOverhead(), "Runtime overheads the step time adds.", knob=True)
    micro_batches: tuple[int, ...] = setting((1, 2, 4, 8, 16, 32), "Micro-batch sizes an unpinned search tries.", knob=True)
    virtual_stages: tuple[int, ...] = setting((2, 3, 4, 6, 8), "Virtual stages per rank an unpinned interleaved search tries.", knob=True)
    top_k: int = setting(5, "Layouts ranked.", knob=True)
    measured: dict[str, dict[int, tuple[float, float]]] = setting(
        help="Measured times: device key -> piece -> (fwd, bwd) s at the costed micro-batch.", knob=True, factory=dict
    )
    exhaustive: bool = setting(False, "Price every candidate (no bound pruning): for tests and benchmarks.", knob=True)
    jobs: int = setting(
        0,
        "Processes pricing layouts (0: one per CPU this process may run on, at most MAX_JOBS, or PLANNER_JOBS); the pick and every figure are the same for any value.",
        knob=True,
    )


#: the sections of Settings, by attribute name
SECTIONS: dict[str, type] = {
    "model": ModelSettings,
    "cluster": ClusterSettings,
    "pins": Pins,
    "memory": MemorySettings,
    "overlaps": Overlaps,
    "knobs": SearchKnobs,
}
#: the lists plan.json holds where the record holds tuples
_TUPLES = {f.name for cls in SECTIONS.values() for f in fields(cls) if str(f.type).startswith("tuple")}


def _section_of() -> dict[str, str]:
    owner: dict[str, str] = {}
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            if f.name in owner or f.name == "engine":
                raise TypeError(f"setting {f.name!r} is declared in two sections ({owner.get(f.name, 'engine')}, {section})")
            owner[f.name] = section
    return owner


#: flat field name -> the section that declares it
SECTION_OF = _section_of()


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Everything a plan is asked (see the module docstring): the engine and six sections."""

    engine: str = setting("deepspeed", "The engine the plan is for (planner.engines.ENGINES).")
    model: ModelSettings = ModelSettings()
    cluster: ClusterSettings = ClusterSettings()
    pins: Pins = Pins()
    memory: MemorySettings = MemorySettings()
    overlaps: Overlaps = Overlaps()
    knobs: SearchKnobs = SearchKnobs()

    @classmethod
    def of(cls, **flat: Any) -> Settings:
        """The settings with the fields named (flat names, each declared in one section) and defaults elsewhere."""
        return cls().but(**flat)

    def but(self, **flat: Any) -> Settings:
        """These settings with the fields named (flat names) replaced."""
        unknown = sorted(k for k in flat if k not in SECTION_OF and k != "engine")
        if unknown:
            raise TypeError(f"unknown setting(s): {', '.join(unknown)}")
        changed: dict[str, Any] = {"engine": flat["engine"]} if "engine" in flat else {}
        for section in SECTIONS:
            mine = {k: v for k, v in flat.items() if SECTION_OF.get(k) == section}
            if mine:
                changed[section] = replace(getattr(self, section), **mine)
        return replace(self, **changed)

    @property
    def loss_run(self) -> LossRun:
        """How an engine with its own loss runs it: ``--loss-chunks``, and compiled with ``--compile-loss`` (by
        default with ``--compile``, as torchtitan's compile components default to model and loss)."""
        compiled = self.model.compile_loss if self.model.compile_loss is not None else self.model.compile
        return LossRun(self.memory.loss_chunks, compiled)

    def flat(self) -> dict[str, Any]:
        """Every field by its flat name (the engine first, then the sections in order)."""
        out: dict[str, Any] = {"engine": self.engine}
        for section in SECTIONS:
            part = getattr(self, section)
            out.update({f.name: getattr(part, f.name) for f in fields(part)})
        return out

    @staticmethod
    def recorded() -> tuple[str, ...]:
        """The flat names plan.json records: every field but the search's knobs."""
        return ("engine",) + tuple(f.name for section, cls in SECTIONS.items() if section != "knobs" for f in fields(cls) if not f.metadata.get("knob"))

    def to_inputs(self) -> dict[str, Any]:
        """plan.json's ``inputs``: the recorded fields by flat name, tuples as lists, ``bounds`` only where pinned."""
        full = self.flat()
        d = {k: (list(full[k]) if k in _TUPLES and full[k] is not None else full[k]) for k in self.recorded()}
        if d.get("bounds") is None:
            d.pop("bounds", None)
        d["model_args"] = dict(d["model_args"])
        return d

    @classmethod
    def from_inputs(cls, inputs: dict[str, Any], **overrides: Any) -> Settings:
        """The settings recorded in a plan.json's ``inputs`` (unknown keys ignored), with ``overrides`` applied."""
        values = {k: inputs[k] for k in cls.recorded() if k in inputs}
        for key in _TUPLES:
            if values.get(key) is not None:
                if not isinstance(values[key], (list, tuple)):
                    raise UsageError(f"plan.json's inputs.{key} is {values[key]!r}, not a list.", "Re-plan: `planner plan` writes it.")
                values[key] = tuple(values[key])
        values.update(overrides)
        return cls.of(**values)

    @classmethod
    def pinned_to(cls, inputs: dict[str, Any], layout: Any, bounds: tuple[int, ...] | None, **overrides: Any) -> Settings:
        """The settings recorded in a plan.json's ``inputs`` with every dimension the layout fixes pinned to it (each
        field the layout, a planner.solve.plan.Layout, also has), the stage boundaries ``bounds``, memory target 1.0 (the layout is priced,
        not questioned) and no measured profile; ``overrides`` applied last."""
        shared = {f.name for f in fields(layout)} & (set(SECTION_OF) | {"engine"})
        pins: dict[str, Any] = {name: getattr(layout, name) for name in sorted(shared)}
        pins.update(mem_target=1.0, profile=None, bounds=bounds)
        pins.update(overrides)
        return cls.from_inputs(inputs, **pins)
