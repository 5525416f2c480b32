"""Torch-free records that carry a model's costs from the tracer to the solver.

Everything here is plain data: the solver, renderers and checks import this
module and never torch. All costs are for one micro-batch of ``micro_batch``
samples; FLOPs are floating-point operations (a multiply-add is 2), bytes are
bytes. Costs scale linearly with the micro-batch size (checked in the tests),
so the solver rescales them with :meth:`ModelCosts.scaled`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, TypeVar

_R = TypeVar("_R")


def evolve(record: _R, **changes: Any) -> _R:
    """``dataclasses.replace`` for the frozen records the search copies by the hundred thousand (layers, cuts, tensors,
    layouts): the same new record, built by copying the fields instead of calling ``__init__`` (about five times
    faster). A record with a ``__post_init__`` goes through ``replace``, so its checks still run, as does one whose
    instance holds other than its fields (slots, cached attributes); an unknown field is refused as ``replace`` refuses
    it."""
    cls = type(record)
    fields = getattr(record, "__dict__", None)
    if hasattr(cls, "__post_init__") or fields is None or len(fields) != len(getattr(cls, "__dataclass_fields__", ())):
        return replace(record, **changes)  # type: ignore[type-var]
    for name in changes:
        if name not in fields:
            raise TypeError(f"{cls.__name__}.__init__() got an unexpected keyword argument {name!r}")
    new: _R = object.__new__(cls)
    new.__dict__.update(fields)
    new.__dict__.update(changes)
    return new


@dataclass(frozen=True)
class Layer:
    """One piece of the model between two valid cut points, in execution order.

    Attributes:
        name: module path of the piece (``h.3:attn`` for the attention half of block ``h.3``).
        kind: embedding | attention | mlp | block | norm | head | other.
        block: module path of the repeated block this piece belongs to, or None.
        modules: module paths of the leaf modules the piece calls.
        params: parameters the piece uses (tied parameters counted in every piece that uses them).
        param_bytes: bytes of those parameters in the model's dtype.
        flops_fwd / flops_bwd: FLOPs of one micro-batch forward / backward (both input and weight gradients).
        flops_bwd_weight: the part of ``flops_bwd`` that computes weight gradients (the W pass of zero-bubble schedules).
        saved_bytes: activation bytes saved for backward for one micro-batch (parameters excluded,
            de-duplicated by storage), as the target GPU's kernels keep them (flash attention, byte masks).
        out_bytes: bytes of the tensors this piece produces that later pieces or the loss read.
        mem_bytes_fwd / mem_bytes_bwd: bytes read and written by operators without a FLOP formula
            (element-wise, normalisation, softmax): the memory-bound part of the time model.
        core_flops_fwd / core_bytes_fwd / core_saved_bytes: the attention core (operators touching an
            s x s tensor): what selective recomputation recomputes and no longer stores.
        gemm_saved_bytes: the part of ``saved_bytes`` that only weight GEMMs (linear layers) keep, their inputs for the
            weight gradient: what Transformer Engine's FP8 linear layers keep in FP8 (1 byte per element) instead;
            ``gemm_shared_bytes`` the part a weight GEMM and another operator both keep (an attention output that is also
            the projection's input), which FP8 keeps twice: as it is for the other operator and in FP8 for the GEMM.
        shardable_params: parameters of matmul weights and embeddings that tensor parallelism splits.
        buffer_bytes: non-parameter buffers the piece reads (rotary tables, masks).
        max_op_bytes: largest single operator output (bytes): the transient working set while it runs.
        op_flops_fwd / op_flops_bwd / op_flops_core: FLOPs of each operator with a FLOP formula (matmuls,
            convolutions, attention) in the forward, the backward, and the attention core's forward; and
        op_bytes_fwd / op_bytes_bwd / op_bytes_core: bytes each other operator reads and writes: the
            efficiency model rates each operator by its size; ``op_bytes_*_resid`` are those of operators whose
            output has the shape of the piece's input (the residual stream: norms, residual adds, dropout),
            which tensor parallelism without sequence parallelism replicates on every GPU.
        expert_params / num_experts: parameters of the piece's routed experts (held as per-expert 3-D weights, or
            as a ModuleList of identical expert MLPs) and how many experts hold them; 0 in dense pieces. Expert
            parallelism splits these over ep x etp GPUs instead of tp.
        routed_rows / routed_bytes: token-expert pairs of one micro-batch (tokens x top-k, dropless) and the bytes
            of those rows entering the experts (what each all-to-all dispatch and combine moves).
        expert_op_flops_fwd / expert_op_flops_bwd: FLOPs of each grouped GEMM over the routed rows (all experts'
            rows together; not in ``op_flops_*``): the time model splits them into one GEMM per local expert.
        compute_op_names / compute_op_bytes / compute_op_flops: the forward's compute operators in order (those with a
            FLOP formula, and the reductions ``max`` and ``topk``): the aten name, the bytes of its outputs and its FLOPs.
            An op-level checkpointing policy (torchtitan's selective AC) keeps some of these outputs and recomputes the rest.
    """

    name: str
    kind: str
    params: int
    param_bytes: int
    flops_fwd: float
    flops_bwd: float
    saved_bytes: int
    out_bytes: int
    block: str | None = None
    modules: tuple[str, ...] = ()
    flops_bwd_weight: float = 0.0
    mem_bytes_fwd: float = 0.0
    mem_bytes_bwd: float = 0.0
    core_flops_fwd: float = 0.0
    core_bytes_fwd: float = 0.0
    core_saved_bytes: int = 0
    gemm_saved_bytes: int = 0
    gemm_shared_bytes: int = 0
    shardable_params: int = 0
    buffer_bytes: int = 0
    max_op_bytes: int = 0
    op_flops_fwd: tuple[float, ...] = ()
    op_flops_bwd: tuple[float, ...] = ()
    op_flops_core: tuple[float, ...] = ()
    op_bytes_fwd: tuple[float, ...] = ()
    op_bytes_bwd: tuple[float, ...] = ()
    op_bytes_core: tuple[float, ...] = ()
    op_bytes_fwd_resid: tuple[float, ...] = ()
    op_bytes_bwd_resid: tuple[float, ...] = ()
    #: the memory-bound bytes as torch.compile's inductor fuses them: per fused region (the operators between two
    #: compute operators), the tensors it reads from outside and those it writes that outlive it
    #: (planner.model.cost._Fusion); forward and backward
    fused_bytes_fwd: tuple[float, ...] = ()
    fused_bytes_bwd: tuple[float, ...] = ()
    expert_params: int = 0
    num_experts: int = 0
    routed_rows: float = 0.0
    routed_bytes: float = 0.0
    expert_op_flops_fwd: tuple[float, ...] = ()
    expert_op_flops_bwd: tuple[float, ...] = ()
    compute_op_names: tuple[str, ...] = ()
    compute_op_bytes: tuple[float, ...] = ()
    compute_op_flops: tuple[float, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("modules", "compute_op_names") + _OP_LISTS:
            d[k] = list(d[k])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Layer:
        d = dict(d)
        for k in ("modules", "compute_op_names") + _OP_LISTS:
            d[k] = tuple(d.get(k, ()))
        return cls(**d)


_OP_LISTS = (
    "op_flops_fwd",
    "op_flops_bwd",
    "op_flops_core",
    "op_bytes_fwd",
    "op_bytes_bwd",
    "op_bytes_core",
    "op_bytes_fwd_resid",
    "op_bytes_bwd_resid",
    "fused_bytes_fwd",
    "fused_bytes_bwd",
    "expert_op_flops_fwd",
    "expert_op_flops_bwd",
    "compute_op_bytes",
    "compute_op_flops",
)


#: the fields that name a piece rather than cost it
_NAMING_FIELDS = ("name", "block", "modules")
_COST_FIELDS = tuple(f for f in Layer.__dataclass_fields__ if f not in _NAMING_FIELDS)


def map_layers(layers: Sequence[Layer], fn: Callable[[Layer], Layer], classes: Sequence[int] | None = None) -> tuple[Layer, ...]:
    """``fn`` of every layer, for a ``fn`` that reads only a layer's costs and keeps its name, block and module paths:
    with ``classes`` (:func:`piece_classes` of ``layers`` or of layers ``fn``-like functions made them from), worked
    out once per class and copied to the others with their own names (the same layers)."""
    if classes is None:
        return tuple(fn(l) for l in layers)
    done: dict[int, Layer] = {}
    out = []
    for k, l in enumerate(layers):
        c = classes[k]
        if c not in done:
            done[c] = fn(l)
            out.append(done[c])
        else:
            out.append(evolve(done[c], name=l.name, block=l.block, modules=l.modules))
    return tuple(out)


def piece_classes(layers: Sequence[Layer]) -> tuple[int, ...]:
    """For each piece, the index of the first piece whose costs are the same (every field but its name, block and
    module paths): a model's repeated blocks fall into a few classes, which a pure function of a piece's costs
    (``timing.analytical_times``) works out once each."""
    first: dict[tuple[object, ...], int] = {}
    return tuple(first.setdefault(tuple(l.__dict__[f] for f in _COST_FIELDS), k) for k, l in enumerate(layers))


@dataclass(frozen=True)
class TensorInfo:
    """A tensor crossing a cut: its producer's name, shape, dtype and size in bytes.

    ``batch_dim`` is the dimension that grows with the micro-batch (None for a
    tensor whose size does not depend on it, such as position ids).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    requires_grad: bool = True
    batch_dim: int | None = 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorInfo:
        d = dict(d)
        d["shape"] = tuple(d["shape"])
        return cls(**d)


@dataclass(frozen=True)
class Cut:
    """A valid cut point before layer ``index`` (1 .. n-1).

    ``tensors`` are all values produced before the cut and read after it: the
    residual stream, and every skip connection that jumps over the cut.
    ``bytes`` is what a pipeline stage boundary here sends forward per
    micro-batch; ``grad_bytes`` what comes back (gradients of the float tensors
    that require grad). ``kind`` is ``block`` (between top-level pieces) or
    ``sub`` (inside a repeated block, where only the residual stream crosses).
    """

    index: int
    kind: str
    tensors: tuple[TensorInfo, ...]

    @property
    def bytes(self) -> int:
        return sum(t.bytes for t in self.tensors)

    @property
    def grad_bytes(self) -> int:
        return sum(t.bytes for t in self.tensors if t.requires_grad)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "kind": self.kind,
            "bytes": self.bytes,
            "grad_bytes": self.grad_bytes,
            "tensors": [t.to_dict() for t in self.tensors],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cut:
        return cls(index=d["index"], kind=d["kind"], tensors=tuple(TensorInfo.from_dict(t) for t in d["tensors"]))


@dataclass(frozen=True)
class TiedGroup:
    """A parameter shared by several pieces (a tied embedding and output head)."""

    name: str
    params: int
    layers: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "params": self.params, "layers": list(self.layers)}


_SCALED = (
    "flops_fwd",
    "flops_bwd",
    "flops_bwd_weight",
    "saved_bytes",
    "out_bytes",
    "mem_bytes_fwd",
    "mem_bytes_bwd",
    "core_flops_fwd",
    "core_bytes_fwd",
    "core_saved_bytes",
    "gemm_saved_bytes",
    "gemm_shared_bytes",
    "max_op_bytes",
    "routed_rows",
    "routed_bytes",
)


#: the smallest micro-batch the search gives a batch-coupled loss (planner.model.coupling; one sample: a contrastive
#: loss is 0, its gradient 0)
COUPLED_MIN_MICRO_BATCH = 2


@dataclass(frozen=True)
class LossRun:
    """How an engine that runs its own loss runs it, as a plan sets it (engines without their own loss ignore it):
    ``chunks`` of the sequence the output layer and loss take at a time (0: the engine's default) and whether the loss
    is compiled (torch.compile fuses its fp32 upcast and log-softmax)."""

    chunks: int = 0
    compiled: bool = False


#: the engine's own defaults (no chunks set, not compiled)
DEFAULT_LOSS = LossRun()


@dataclass(frozen=True)
class TrainedLoss:
    """The loss a plan trains (planner.model.losses.choose_loss): ``source`` is ``loss_fn``, ``model output`` or
    ``default``; ``text`` one line for plan.json, the rendered README and the smoke; ``where`` the output's field that
    holds the loss for ``model output`` (``loss``, ``[1]``); ``coupling`` how micro-batching changes it, if it does."""

    source: str
    text: str
    where: str = ""
    #: how the loss couples the samples of a micro-batch (planner.model.coupling), empty where it is a mean over them
    coupling: str = ""

    def to_dict(self) -> dict[str, str]:
        d = {"source": self.source, "text": self.text, "where": self.where}
        return d | {"coupling": self.coupling} if self.coupling else d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainedLoss:
        return cls(str(d["source"]), str(d.get("text", "")), str(d.get("where", "")), str(d.get("coupling", "")))


@dataclass(frozen=True)
class ModelCosts:
    """Per-layer costs of a model for one micro-batch, plus its cut points.

    ``cuts[k]`` describes the boundary before ``layers[k]`` for k in 1..n-1;
    ``cuts[0]`` is the model input and ``cuts[n]`` its output (kept so that
    stage-boundary bytes can be indexed uniformly).
    """

    layers: tuple[Layer, ...]
    cuts: tuple[Cut, ...]
    micro_batch: int
    dtype: str
    seq_len: int | None = None
    tied: tuple[TiedGroup, ...] = ()
    architecture: dict[str, Any] | None = None
    notes: tuple[str, ...] = ()
    loss: TrainedLoss | None = None  # the loss the last piece was costed with, which the scripts train

    def __post_init__(self) -> None:
        if len(self.cuts) != len(self.layers) + 1:
            raise ValueError(f"need {len(self.layers) + 1} cuts for {len(self.layers)} layers, got {len(self.cuts)}")

    @property
    def n(self) -> int:
        return len(self.layers)

    @property
    def total_params(self) -> int:
        """Distinct parameters (a tied weight counted once)."""
        dup = sum(g.params * (len(g.layers) - 1) for g in self.tied)
        return sum(layer.params for layer in self.layers) - dup

    @property
    def tokens_per_sample(self) -> int:
        return self.seq_len or 1

    def scaled(self, micro_batch: int, classes: Sequence[int] | None = None) -> ModelCosts:
        """The same model's costs for another micro-batch size (linear in the batch).

        Exact for FLOPs and for activations that grow with the batch; the few saved tensors that
        do not (position ids, masks: hundreds of bytes) are scaled too. ``classes``: :func:`map_layers`.
        """
        if micro_batch == self.micro_batch:
            return self
        f = micro_batch / self.micro_batch
        layers = map_layers(self.layers, lambda layer: scale_layer(layer, f), classes)
        cuts = tuple(evolve(c, tensors=tuple(_scale_tensor(t, f) for t in c.tensors)) for c in self.cuts)
        return replace(self, layers=layers, cuts=cuts, micro_batch=micro_batch)

    def to_dict(self) -> dict[str, Any]:
        return {
            "micro_batch": self.micro_batch,
            "dtype": self.dtype,
            "seq_len": self.seq_len,
            "layers": [layer.to_dict() for layer in self.layers],
            "cuts": [c.to_dict() for c in self.cuts],
            "tied": [g.to_dict() for g in self.tied],
            "architecture": self.architecture,
            "notes": list(self.notes),
            "loss": self.loss.to_dict() if self.loss is not None else None,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelCosts:
        return cls(
            layers=tuple(Layer.from_dict(x) for x in d["layers"]),
            cuts=tuple(Cut.from_dict(x) for x in d["cuts"]),
            micro_batch=d["micro_batch"],
            dtype=d["dtype"],
            seq_len=d.get("seq_len"),
            tied=tuple(TiedGroup(g["name"], g["params"], tuple(g["layers"])) for g in d.get("tied", [])),
            architecture=d.get("architecture"),
            notes=tuple(d.get("notes", ())),
            loss=TrainedLoss.from_dict(d["loss"]) if d.get("loss") else None,
        )


def scale_layer(layer: Layer, f: float) -> Layer:
    """A layer's per-micro-batch costs multiplied by ``f`` (parameters unchanged)."""
    values = {k: type(getattr(layer, k))(getattr(layer, k) * f) for k in _SCALED}
    values.update({k: tuple(x * f for x in getattr(layer, k)) for k in _OP_LISTS})
    return evolve(layer, **values)


def _scale_tensor(t: TensorInfo, f: float) -> TensorInfo:
    if t.batch_dim is None:
        return t
    shape = list(t.shape)
    shape[t.batch_dim] = int(round(shape[t.batch_dim] * f))
    return evolve(t, shape=tuple(shape), bytes=int(round(t.bytes * f)))


@dataclass(frozen=True)
class RecomputeWork:
    """The forward a recomputed module runs again on one GPU per micro-batch: each GEMM's FLOPs, each memory-bound
    kernel's bytes, and its tensor-parallel collectives in units of the piece's residual-stream collective."""

    gemm_flops: tuple[float, ...] = ()
    kernel_bytes: tuple[float, ...] = ()
    collectives: float = 0.0

    def __add__(self, other: RecomputeWork) -> RecomputeWork:
        return RecomputeWork(self.gemm_flops + other.gemm_flops, self.kernel_bytes + other.kernel_bytes, self.collectives + other.collectives)
