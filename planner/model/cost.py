"""Per-piece costs from one forward and backward on the meta device.

For each piece of a LayerGraph this runs the piece alone on meta tensors and
records its FLOPs (torch's FlopCounterMode), the bytes moved by operators
that have no FLOP formula, the activation bytes autograd saves for backward
(``saved_tensors_hooks``, de-duplicated by storage, parameters and buffers
excluded; the part only weight GEMMs keep is recorded apart, for FP8), and the
share of the backward that computes weight gradients.

Accounting follows the target GPU's kernels, not the CPU's:
* ``F.scaled_dot_product_attention`` runs as the flash kernel
  (``aten._scaled_dot_product_flash_attention``): it saves q, k, v, the
  output and a float32 log-sum-exp per row, never an s x s matrix; its
  backward recomputes the scores (2.5x the forward FLOPs). With an explicit
  ``attn_mask`` it runs as the memory-efficient kernel instead.
* dropout saves a one-byte mask (``aten.native_dropout``), as CUDA does.
* explicit attention written as matmuls (``softmax(q @ k^T) @ v``) is costed
  as written: its s x s tensors are the attention core that selective
  recomputation drops.

Identical pieces (same code, parameter shapes, module settings and input
shapes) are costed once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from planner.errors import UsageError
from planner.model.coupling import batchnorm_layers, loss_split_gap, meeting_in_loss, split_gap_words
from planner.model.experts import expert_parameters, router_parameters
from planner.model.flops import REGISTRY, flop_counter, uncounted_compute
from planner.model.losses import choose_loss, default_loss, floating_outputs, loss_function, tensor_leaves
from planner.model.trace import LayerGraph, dtype_name
from planner.records import Cut, Layer, ModelCosts, TiedGroup

_aten = torch.ops.aten


class GpuKernels(TorchFunctionMode):
    """Route attention and dropout to the kernels a GPU runs, so meta-device costing matches them."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _sdpa(*args, **kwargs)
        if func is F.dropout or func is torch.dropout:
            return _dropout(*args, **kwargs)
        if func is _FLEX_ATTENTION:
            return _flex_attention(*args, **kwargs)
        return func(*args, **kwargs)


#: torch.nn.attention.flex_attention's operator (torch 2.13 torch/_higher_order_ops/flex_attention.py FlexAttentionHOP)
_FLEX_ATTENTION = getattr(torch.ops.higher_order, "flex_attention", None)


def _flex_attention(query, key, value, score_mod, block_mask, scale, kernel_options, *buffers):
    """FlexAttention as a GPU runs it: one fused kernel over (batch, heads, seq, head dim) that keeps the output and
    the log-sum-exp for backward, as flash attention does; costed as scaled_dot_product_attention (no causal or
    block-sparse discount: the block mask's sparsity is data the meta device does not have). Returns (output,
    log-sum-exp, max scores) as FlexAttentionHOP does."""
    out = _sdpa(query, key, value, scale=scale, enable_gqa=key.size(-3) != query.size(-3))
    stats = torch.empty(query.shape[:-1], dtype=torch.float32, device=query.device)
    return out, stats, torch.empty_like(stats)


#: torch functions that multiply an activation by a weight when a parameter is among their arguments (linear layers)
_GEMMS = frozenset({F.linear, torch.addmm, torch.mm, torch.matmul, torch.bmm, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.mm})


class _WeightGemms(TorchFunctionMode):
    """Counts how deep the run is inside a call that multiplies by a weight parameter, so that the tensors autograd
    saves inside it (the GEMM's input, for the weight gradient) can be told apart from those other operators save."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        gemm = func in _GEMMS and any(isinstance(t, nn.Parameter) for t in tensor_leaves((args, kwargs)))
        self.depth += gemm
        try:
            return func(*args, **kwargs)
        finally:
            self.depth -= gemm


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if enable_gqa and key.size(-3) != query.size(-3):
        rep = query.size(-3) // key.size(-3)
        key, value = key.repeat_interleave(rep, dim=-3), value.repeat_interleave(rep, dim=-3)
    if query.dim() != 4:
        # F.scaled_dot_product_attention takes any leading (batch) dims: windowed attention passes five (timm's Hiera,
        # NesT, Twins), a single head three; the fused kernels (and torch's FLOP formulas) take (batch, heads, s, d)
        return _sdpa_flattened(query, key, value, attn_mask, dropout_p, is_causal, scale)
    if attn_mask is not None:
        bias = attn_mask
        if bias.dtype == torch.bool:
            bias = torch.zeros(bias.shape, dtype=query.dtype, device=query.device).masked_fill(~bias, float("-inf"))
        out = _aten._scaled_dot_product_efficient_attention(
            query, key, value, bias.expand(query.size(0), query.size(1), query.size(2), key.size(2)), True, dropout_p, is_causal, scale=scale
        )
        return out[0]
    if value.size(-1) != query.size(-1):
        # a value head narrower than the query/key head (multi-latent attention: 128 vs 192): the fused kernels that
        # take it (cuDNN / FlashAttention-3 via Transformer Engine) save what flash saves; torch's flash op assumes
        # equal heads, its memory-efficient op does not
        out = _aten._scaled_dot_product_efficient_attention(query, key, value, None, True, dropout_p, is_causal, scale=scale)
        return out[0]
    out = _aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False, scale=scale)
    return out[0]


def _sdpa_flattened(query, key, value, attn_mask, dropout_p, is_causal, scale):
    """SDPA over inputs with other than four dims, as one (n, 1, s, d) attention: the same FLOPs and saved bytes."""
    lead = torch.broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2])

    def to4(t: torch.Tensor) -> torch.Tensor:
        return t.expand(*lead, *t.shape[-2:]).reshape(-1, 1, *t.shape[-2:])

    if attn_mask is not None:
        attn_mask = attn_mask.expand(*lead, query.size(-2), key.size(-2)).reshape(-1, 1, query.size(-2), key.size(-2))
    out = _sdpa(to4(query), to4(key), to4(value), attn_mask, dropout_p, is_causal, scale)
    return out.reshape(*lead, query.size(-2), value.size(-1))


def _dropout(input, p=0.5, training=True, inplace=False):
    if not training or p == 0.0:
        return input
    return _aten.native_dropout(input, p, True)[0]


def _is_scores(t: torch.Tensor, s: int, batch: int) -> bool:
    """An attention-score tensor: (..., s, s) with more than ``batch`` s x s matrices (several heads).

    The head count tells it from a (batch, s, hidden) activation when hidden == s.
    """
    return t.dim() >= 3 and t.shape[-1] == s and t.shape[-2] == s and t.numel() // (s * s) > batch


def _tensor_bytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class _Fusion:
    """The memory-bound traffic left when torch.compile's inductor fuses the memory-bound operators between two compute
    operators (its vertical fusion; a row reduction such as a norm's fuses with its pointwise neighbours too).

    Within a region (closed by each compute operator) an operator reads a tensor another one of the region wrote for
    free (it stays in registers), and an outside tensor once. A tensor the region produces is written to memory when a
    compute operator reads it, when any operator reads it after the region closed, or when nothing in the piece reads
    it (an output, or saved); one only the region's own operators read is never written. Bytes per region, in order."""

    def __init__(self) -> None:
        # storage -> [weak reference to the tensor, bytes, read in region]: weak, so that the meter keeps no tensor
        # alive (storages freed as they would be; a key whose tensor is gone names a new storage)
        self.pending: dict[int, list[Any]] = {}
        self.closed: dict[int, list[Any]] = {}  # produced in a closed region and not written
        self.read: set[int] = set()
        self.region = 0.0
        self.regions: list[float] = []

    @staticmethod
    def _live(table: dict[int, list[Any]], k: int) -> bool:
        entry = table.get(k)
        if entry is not None and entry[0]() is None:
            del table[k]
            return False
        return entry is not None

    def _read(self, t: torch.Tensor) -> None:
        k = _storage_key(t)
        if self._live(self.pending, k):
            self.pending[k][2] = True
            return
        if self._live(self.closed, k):  # it outlived its region: written there, read here
            self.region += self.closed.pop(k)[1]
        if k not in self.read:
            self.read.add(k)
            self.region += _tensor_bytes(t)

    def memory_bound(self, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        for t in ins:
            self._read(t)
        for t in outs:
            self.pending[_storage_key(t)] = [weakref.ref(t), _tensor_bytes(t), False]

    def compute(self, ins: list[torch.Tensor]) -> None:
        for t in ins:
            k = _storage_key(t)
            if self._live(self.pending, k):
                self.region += self.pending.pop(k)[1]
            elif self._live(self.closed, k):
                self.region += self.closed.pop(k)[1]
        self._close()

    def _close(self) -> None:
        for k, (ref, nbytes, was_read) in self.pending.items():
            if was_read:
                self.closed[k] = [ref, nbytes, was_read]
            else:
                self.region += nbytes  # nothing in the region read it: it is needed later (or freed unread)
        self.pending.clear()
        self.read.clear()
        if self.region:
            self.regions.append(self.region)
        self.region = 0.0

    def finish(self) -> tuple[float, ...]:
        self._close()
        return tuple(self.regions)


class _OpMeter(TorchDispatchMode):
    """Counts, per operator call: bytes moved by operators without a FLOP formula, attention-core work, largest output."""

    def __init__(self, seq_len: int | None, batch: int, resid_shape: tuple[int, ...] | None = None):
        super().__init__()
        self.seq_len = seq_len
        self.batch = batch
        self.resid_shape = resid_shape
        self.mem_bytes = 0.0
        self.core_flops = 0.0
        self.core_bytes = 0.0
        self.max_out = 0
        self.op_flops: list[float] = []
        self.core_op_flops: list[float] = []
        self.op_bytes: list[float] = []
        self.resid_op_bytes: list[float] = []
        self.core_op_bytes: list[float] = []
        self.uncounted: set[str] = set()
        self.expert_op_flops: list[float] = []
        self.routed_rows = 0.0
        self.routed_bytes = 0.0
        #: the compute operators in order: (aten name, output bytes, FLOPs) (Layer.compute_op_*)
        self.compute_ops: list[tuple[str, float, float]] = []
        self.fusion = _Fusion()

    def _is_core(self, tensors: list[torch.Tensor]) -> bool:
        s = self.seq_len
        return bool(s and s > 1 and any(_is_scores(t, s, self.batch) for t in tensors))

    #: higher-order operators (flex attention) reach __torch_dispatch__ whole: torch's formulas count them
    supports_higher_order_operators = True

    def _higher_order(self, func, args, kwargs):  # type: ignore[no-untyped-def]
        """A higher-order operator (one GpuKernels does not route), run whole below this mode: FLOPs from torch's
        formula where it has one, else named as uncounted."""
        out = func(*args, **kwargs)
        outs = tensor_leaves(out)
        formula = REGISTRY.get(func)
        name = str(getattr(func, "_name", func))
        if formula is None:
            self.uncounted.add(name)
            return out
        flops = float(formula(*args, **kwargs, out_val=out))
        self.op_flops.append(flops)
        self.compute_ops.append((name, float(sum(_tensor_bytes(t) for t in outs)), flops))
        self.max_out = max(self.max_out, sum(_tensor_bytes(t) for t in outs))
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return self._higher_order(func, args, kwargs)
        out = func(*args, **kwargs)
        ins = tensor_leaves((args, kwargs))
        outs = tensor_leaves(out)
        core = self._is_core(ins + outs)
        packet = func.overloadpacket
        if packet is _aten._grouped_mm or packet in REGISTRY:
            self.fusion.compute(ins)
        elif not func.is_view and func not in _NO_TRAFFIC:
            self.fusion.memory_bound(ins, outs)
        if packet is _aten._grouped_mm:
            # routed experts: kept apart, the time model splits them into one GEMM per local expert
            self.expert_op_flops.append(float(REGISTRY[packet](*args, **kwargs, out_val=out)))
            rows = ins[0] if ins else None
            width = self.resid_shape[-1] if self.resid_shape else None
            if rows is not None and rows.dim() == 2 and len(ins) > 1 and ins[1].dim() == 3 and rows.shape[1] == width:
                # the 2-D x 3-D forward GEMM reading the dispatched rows (tokens x top-k, the residual width wide)
                self.routed_rows = max(self.routed_rows, float(rows.shape[0]))
                self.routed_bytes = max(self.routed_bytes, float(_tensor_bytes(rows)))
        elif packet in REGISTRY:
            flops = float(REGISTRY[packet](*args, **kwargs, out_val=out))
            self.op_flops.append(flops)
            self.compute_ops.append((str(packet).split(".")[-1], float(sum(_tensor_bytes(t) for t in outs)), flops))
            if core:
                self.core_flops += flops
                self.core_op_flops.append(flops)
        elif not func.is_view and func not in _NO_TRAFFIC:
            if packet in _RECORDED_REDUCTIONS:  # kept by op-level checkpointing policies (amax for FP8 scales, MoE routing)
                self.compute_ops.append((str(packet).split(".")[-1], float(sum(_tensor_bytes(t) for t in outs)), 0.0))
            if uncounted_compute(func, ins):
                self.uncounted.add(str(packet))
            moved = sum(_tensor_bytes(t) for t in ins) + sum(_tensor_bytes(t) for t in outs)
            self.mem_bytes += moved
            if moved:
                if self.resid_shape is not None and any(tuple(t.shape) == self.resid_shape for t in outs):
                    self.resid_op_bytes.append(float(moved))
                else:
                    self.op_bytes.append(float(moved))
            if core:
                self.core_bytes += moved
                self.core_op_bytes.append(float(moved))
        self.max_out = max(self.max_out, sum(_tensor_bytes(t) for t in outs))
        return out


#: reductions an op-level checkpointing policy may keep (torchtitan's selective AC saves aten.max and aten.topk)
_RECORDED_REDUCTIONS = {_aten.max, _aten.topk}

_NO_TRAFFIC = {
    _aten.detach.default,
    _aten.empty.memory_format,
    _aten.empty_like.default,
    _aten.zeros.default,
    _aten.ones_like.default,
    _aten.zeros_like.default,
    _aten.lift_fresh.default,
    _aten.sym_size.int,
    _aten.sym_numel.default,
}


@dataclass
class PieceCost:
    flops_fwd: float
    flops_bwd: float
    flops_bwd_input: float
    saved_bytes: int
    mem_bytes_fwd: float
    mem_bytes_bwd: float
    core_flops_fwd: float
    core_bytes_fwd: float
    core_saved_bytes: int
    max_op_bytes: int
    gemm_saved_bytes: int  # saved bytes only weight GEMMs keep (their inputs)
    gemm_shared_bytes: int  # saved bytes a weight GEMM and another operator both keep
    op_flops_fwd: tuple[float, ...]
    op_flops_bwd: tuple[float, ...]
    op_flops_core: tuple[float, ...]
    op_bytes_fwd: tuple[float, ...]
    op_bytes_bwd: tuple[float, ...]
    op_bytes_core: tuple[float, ...]
    op_bytes_fwd_resid: tuple[float, ...]
    op_bytes_bwd_resid: tuple[float, ...]
    fused_bytes_fwd: tuple[float, ...] = ()
    fused_bytes_bwd: tuple[float, ...] = ()
    uncounted_ops: tuple[str, ...] = ()
    expert_op_flops_fwd: tuple[float, ...] = ()
    expert_op_flops_bwd: tuple[float, ...] = ()
    compute_ops: tuple[tuple[str, float, float], ...] = ()
    routed_rows: float = 0.0
    routed_bytes: float = 0.0


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def cost_piece(
    module: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    seq_len: int | None,
    batch: int,
    loss: Callable[[Any], torch.Tensor] | None = None,
) -> tuple[PieceCost, Any]:
    """Run ``module`` forward and backward on meta ``inputs``; returns its costs and (detached) outputs.

    ``loss`` maps the outputs to a scalar (the last piece's loss function); other pieces
    back-propagate a gradient of ones into every output that requires grad.
    """
    excluded = {_storage_key(p) for p in module.parameters()} | {_storage_key(b) for b in module.buffers()}
    tmap = torch.utils._pytree.tree_map_only
    # values between pieces may be tuples, dicts or ModelOutputs of tensors: every tensor in them is an input
    leaf_inputs = tmap(torch.Tensor, lambda t: t.detach().requires_grad_(t.requires_grad and t.is_floating_point()), tuple(inputs))
    # the piece may update an input in place (a ReLU(inplace=True) right after a cut): autograd refuses that on a
    # leaf, so the piece gets a copy (made before the meters start: it is no work of the piece's)
    with torch.device("meta"):
        run_inputs = tmap(torch.Tensor, lambda t: t.clone() if t.requires_grad else t, leaf_inputs)
    saved: dict[int, int] = {}
    core_saved: dict[int, int] = {}
    refs: list[torch.Tensor] = []
    s = seq_len
    gemms = _WeightGemms()
    by_gemm: set[int] = set()  # storages a weight GEMM saved ...
    by_other: set[int] = set()  # ... and those any other operator saved

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        (by_gemm if gemms.depth else by_other).add(key)
        if key not in excluded and key not in saved:
            saved[key] = t.untyped_storage().nbytes()
            if s and s > 1 and _is_scores(t, s, batch):
                core_saved[key] = saved[key]
            refs.append(t)
        return t

    floats = floating_outputs(inputs)
    resid = tuple(floats[0].shape) if floats else None
    fwd_meter = _OpMeter(seq_len, batch, resid)
    with torch.device("meta"), GpuKernels(), gemms, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with flop_counter() as fc_fwd, fwd_meter:
            out = module(*run_inputs)
            target = loss(out) if loss is not None else None
    flops_fwd = float(fc_fwd.get_total_flops())

    outs = [t for t in tensor_leaves(out) if t.requires_grad]
    if target is not None:
        roots, grads = ([target], [torch.ones_like(target)]) if target.requires_grad else ([], [])
    else:
        roots, grads = outs, [torch.ones_like(t) for t in outs]
    grad_inputs = [t for t in tensor_leaves(leaf_inputs) if t.requires_grad]
    flops_bwd_input = 0.0
    flops_bwd = 0.0
    bwd_meter = _OpMeter(seq_len, batch, resid)
    if roots:
        with torch.device("meta"):
            if grad_inputs:
                with flop_counter() as fc_in:
                    torch.autograd.grad(roots, grad_inputs, grads, retain_graph=True, allow_unused=True)
                flops_bwd_input = float(fc_in.get_total_flops())
            with flop_counter() as fc_bwd, bwd_meter:
                torch.autograd.backward(roots, grads)
            flops_bwd = float(fc_bwd.get_total_flops())
    for p in module.parameters():
        p.grad = None
    cost = PieceCost(
        flops_fwd=flops_fwd,
        flops_bwd=flops_bwd,
        flops_bwd_input=min(flops_bwd_input, flops_bwd),
        saved_bytes=sum(saved.values()),
        mem_bytes_fwd=fwd_meter.mem_bytes,
        mem_bytes_bwd=bwd_meter.mem_bytes,
        core_flops_fwd=fwd_meter.core_flops,
        core_bytes_fwd=fwd_meter.core_bytes,
        core_saved_bytes=sum(core_saved.values()),
        max_op_bytes=max(fwd_meter.max_out, bwd_meter.max_out),
        gemm_saved_bytes=sum(saved[k] for k in by_gemm - by_other if k in saved),
        gemm_shared_bytes=sum(saved[k] for k in by_gemm & by_other if k in saved),
        op_flops_fwd=tuple(fwd_meter.op_flops),
        op_flops_bwd=tuple(bwd_meter.op_flops),
        op_flops_core=tuple(fwd_meter.core_op_flops),
        op_bytes_fwd=tuple(fwd_meter.op_bytes),
        op_bytes_bwd=tuple(bwd_meter.op_bytes),
        op_bytes_core=tuple(fwd_meter.core_op_bytes),
        op_bytes_fwd_resid=tuple(fwd_meter.resid_op_bytes),
        op_bytes_bwd_resid=tuple(bwd_meter.resid_op_bytes),
        fused_bytes_fwd=fwd_meter.fusion.finish(),
        fused_bytes_bwd=bwd_meter.fusion.finish(),
        uncounted_ops=tuple(sorted(fwd_meter.uncounted | bwd_meter.uncounted)),
        expert_op_flops_fwd=tuple(fwd_meter.expert_op_flops),
        expert_op_flops_bwd=tuple(bwd_meter.expert_op_flops),
        compute_ops=tuple(fwd_meter.compute_ops),
        routed_rows=fwd_meter.routed_rows,
        routed_bytes=fwd_meter.routed_bytes,
    )
    detached = torch.utils._pytree.tree_map(lambda t: t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t, out)
    return cost, detached


def piece_structure(mod, block: str | None) -> tuple[Any, ...]:
    """Structure of one piece module with its block's path removed: graph ops (values entering the piece by
    position), the nodes each reads and the constants each takes, module classes and their scalar settings, parameter and buffer shapes and dtypes.

    Equal for the pieces of repeated blocks, so they are costed (and profiled) once.
    """

    def norm(name: str) -> str:
        if block and (name == block or name.startswith(block + ".")):
            return "#" + name[len(block) :]
        return name

    gm = mod.gm
    ops, k = [], 0
    index: dict[Any, int] = {}
    for node in gm.graph.nodes:
        index[node] = len(index)
        if node.op == "placeholder":
            ops.append(("placeholder", k))
            k += 1
            continue
        target = node.target if isinstance(node.target, str) else getattr(node.target, "__qualname__", repr(node.target))
        # the wiring too: which earlier nodes each one reads, in order (the output's values included), so pieces with the
        # same ops that pass their values on in another order are not taken for one another
        reads: list[int] = []
        torch.fx.node.map_arg((node.args, node.kwargs), lambda a: reads.append(index[a]) or a)
        # and the constants among the arguments: a reshape into windows of 7 and one into windows of 8 differ
        consts = repr(torch.fx.node.map_arg((node.args, sorted(node.kwargs.items())), lambda a: None))
        ops.append((node.op, norm(str(target)), len(node.args), tuple(sorted(node.kwargs)), tuple(reads), consts))
    mods = []
    for name, m in gm.named_modules():
        settings = tuple(sorted((k, v) for k, v in vars(m).items() if not k.startswith("_") and isinstance(v, (int, float, bool, str, type(None)))))
        mods.append((norm(name), type(m).__qualname__, settings))
    params = tuple((norm(n), tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in gm.named_parameters())
    buffers = tuple((norm(n), tuple(b.shape), str(b.dtype)) for n, b in gm.named_buffers())
    return tuple(ops), tuple(mods), params, buffers


def _signature(module: nn.Module, inputs: tuple[torch.Tensor, ...], block: str | None) -> tuple[Any, ...]:
    """A piece's structure plus the shapes, dtypes and grad flags of its inputs: equal pieces cost the same."""
    flat, spec = torch.utils._pytree.tree_flatten(tuple(inputs))
    ins = (str(spec), tuple((tuple(t.shape), t.dtype, t.requires_grad) if isinstance(t, torch.Tensor) else repr(t) for t in flat))
    return (piece_structure(module, block), ins)


class _LastPieceLoss:
    """The last piece's loss on the meta device: which loss (choose_loss, decided on the piece's first output) and the
    scalar it gives; ``choice`` is read after costing."""

    def __init__(self, model_file, batch_size: int):
        self.model_file, self.choice = model_file, None
        self.batch_size = batch_size
        self.output: Any = None  # the last piece's first output, at batch_size samples
        self.target = self._target(batch_size)

    def _target(self, batch_size: int) -> Any:
        if self.model_file is None or not self.model_file.has("example_target"):
            return None
        with torch.device("meta"):
            target = self.model_file.call("example_target", batch_size)
        return torch.utils._pytree.tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, target)

    def __call__(self, output: Any) -> torch.Tensor:
        if self.model_file is None:
            return default_loss(output)
        if self.choice is None:
            self.choice = choose_loss(self.model_file, output)
            self.output = output
        return loss_function(self.model_file, self.choice, self.target)(output)

    def coupling(self, lg: LayerGraph) -> str:
        """How the trained loss couples the samples of a micro-batch (planner.model.coupling), in words; empty where
        it is a mean over samples that never meet. BatchNorm is said in the plan's notes, not here."""
        found = [lg.samples_meet] if lg.samples_meet else []
        if self.choice is not None and self.choice.source == "loss_fn" and self.output is not None and lg.output_2x is not None:
            fn = self.model_file.funcs["loss_fn"]
            leaves = tensor_leaves(self.output)
            shapes = [s for s, _, _ in lg.output_2x.tensors]
            if len(shapes) == len(leaves):
                it = iter(shapes)
                output_2x = torch.utils._pytree.tree_map(
                    lambda t: torch.empty(next(it), dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t, self.output
                )
                target_2x = self._target(2 * self.batch_size)
                meets = meeting_in_loss(lambda: fn(self.output, self.target), lambda: fn(output_2x, target_2x))
                if meets and not found:
                    found.append(meets)
                gap = loss_split_gap(fn, self.output, output_2x, self.target, target_2x)
                words = split_gap_words(*gap) if gap else None
                if words and not meets and not found:
                    found.append(words)
        return found[0] if found else ""


def cost_layers(
    lg: LayerGraph,
    inputs: tuple[torch.Tensor, ...],
    micro_batch: int,
    dtype: torch.dtype,
    seq_len: int | None = None,
    model_file=None,
    architecture: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ModelCosts:
    """Cost every piece of ``lg`` for one micro-batch; identical pieces are costed once.

    The loss (planner.model.losses.choose_loss: the model file's ``loss_fn``, the loss the model returns, else the
    default loss) is costed with the last piece, which is where it runs in a pipeline, and recorded in the costs.
    """
    layers: list[Layer] = []
    cache: dict[tuple[Any, ...], tuple[PieceCost, Any]] = {}
    placeholders = [n for n in lg.gm.graph.nodes if n.op == "placeholder"]
    values: dict[Any, Any] = dict(zip(placeholders, inputs))
    missing = [n.name for n in lg.boundaries[0] if n not in values]
    if missing:
        raise UsageError(
            f"The model reads forward() argument(s) {', '.join(missing)} that example_inputs() does not give.",
            "Return every tensor forward() uses from example_inputs(), in forward()'s order.",
        )
    uncounted: dict[str, list[str]] = {}
    param_owner: dict[int, list[int]] = {}
    param_info: dict[int, tuple[str, int]] = {}
    experts = expert_parameters(lg.model)
    routers = router_parameters(lg.model)
    loss = _LastPieceLoss(model_file, micro_batch)
    for i, piece in enumerate(lg.pieces):
        mod = lg.stage_module(i, i + 1)
        args = tuple(values[v] for v in lg.boundaries[i])
        sig = _signature(mod, args, piece.block) + ((i == lg.n - 1),)
        hit = cache.get(sig)
        if hit is None:
            cost, out = cost_piece(mod, args, seq_len, micro_batch, loss if i == lg.n - 1 else None)
            cache[sig] = (cost, out)
        else:
            cost, out_cached = hit
            out = out_cached
        if i < lg.n - 1:
            # a piece passing one value returns it bare, even when that value is itself a tuple
            outs = out if len(lg.boundaries[i + 1]) != 1 else (out,)
            for node, t in zip(lg.boundaries[i + 1], outs):
                values[node] = t
        for op in cost.uncounted_ops:
            uncounted.setdefault(op, []).append(piece.name)
        params = {id(p): (n, p) for n, p in mod.gm.named_parameters(remove_duplicate=True)}
        for pid, (n, p) in params.items():
            param_owner.setdefault(pid, []).append(i)
            param_info[pid] = (n, p.numel())
        n_params = sum(p.numel() for _, p in params.values())
        mine = [(experts[n], p.numel()) for n, p in params.values() if n in experts]
        expert_ids = {pid for pid, (n, _) in params.items() if n in experts or n in routers}
        shardable = sum(
            p.numel()
            for name, m in mod.gm.named_modules()
            if isinstance(m, (nn.Linear, nn.Embedding))
            for p in m.parameters(recurse=False)
            if id(p) not in expert_ids  # experts are split by expert parallelism, routers kept whole: neither by tp
        )
        if not any(True for _ in mod.gm.modules() if isinstance(_, (nn.Linear, nn.Embedding))):
            shardable = 0
        out_bytes = sum(t.bytes for t in lg.cut_tensors(i + 1) if t.name in {v.name for v in piece.nodes})
        layers.append(
            Layer(
                name=piece.name,
                kind=piece.kind,
                params=n_params,
                param_bytes=sum(p.numel() * p.element_size() for _, p in params.values()),
                flops_fwd=cost.flops_fwd,
                flops_bwd=cost.flops_bwd,
                saved_bytes=cost.saved_bytes,
                out_bytes=out_bytes if i < lg.n - 1 else sum(t.bytes for t in lg.cut_tensors(lg.n)),
                block=piece.block,
                modules=piece.modules,
                flops_bwd_weight=max(cost.flops_bwd - cost.flops_bwd_input, 0.0),
                mem_bytes_fwd=cost.mem_bytes_fwd,
                mem_bytes_bwd=cost.mem_bytes_bwd,
                core_flops_fwd=cost.core_flops_fwd,
                core_bytes_fwd=cost.core_bytes_fwd,
                core_saved_bytes=cost.core_saved_bytes,
                gemm_saved_bytes=cost.gemm_saved_bytes,
                gemm_shared_bytes=cost.gemm_shared_bytes,
                shardable_params=min(shardable, n_params),
                buffer_bytes=sum(b.numel() * b.element_size() for b in mod.buffers()),
                max_op_bytes=cost.max_op_bytes,
                op_flops_fwd=cost.op_flops_fwd,
                op_flops_bwd=cost.op_flops_bwd,
                op_flops_core=cost.op_flops_core,
                op_bytes_fwd=cost.op_bytes_fwd,
                op_bytes_bwd=cost.op_bytes_bwd,
                op_bytes_core=cost.op_bytes_core,
                op_bytes_fwd_resid=cost.op_bytes_fwd_resid,
                op_bytes_bwd_resid=cost.op_bytes_bwd_resid,
                fused_bytes_fwd=cost.fused_bytes_fwd,
                fused_bytes_bwd=cost.fused_bytes_bwd,
                expert_params=sum(k for _, k in mine),
                num_experts=max((e for e, _ in mine), default=0),
                routed_rows=cost.routed_rows,
                routed_bytes=cost.routed_bytes,
                expert_op_flops_fwd=cost.expert_op_flops_fwd,
                expert_op_flops_bwd=cost.expert_op_flops_bwd,
                compute_op_names=tuple(name for name, _, _ in cost.compute_ops),
                compute_op_bytes=tuple(b for _, b, _ in cost.compute_ops),
                compute_op_flops=tuple(f for _, _, f in cost.compute_ops),
            )
        )
        if progress:
            progress(i + 1, lg.n)
    tied = tuple(TiedGroup(param_info[pid][0], param_info[pid][1], tuple(owners)) for pid, owners in param_owner.items() if len(owners) > 1)
    coupling = loss.coupling(lg)
    batchnorm = batchnorm_layers(lg.model)
    coupled_notes = []
    if coupling:
        coupled_notes.append(
            f"the loss couples the samples of a batch ({coupling}): a pipeline computes it per micro-batch, so the "
            "micro-batch size is part of the objective; the search keeps it at 2 or more, --micro-batch pins it, and the "
            "smoke compares against a single process run on the same micro-batches"
        )
    if batchnorm:
        shown = ", ".join(batchnorm[:3]) + (f" and {len(batchnorm) - 3} more" if len(batchnorm) > 3 else "")
        coupled_notes.append(f"BatchNorm ({shown}) normalises over each micro-batch, not the global batch: micro-batching changes its statistics")
    cuts = tuple(Cut(k, lg.cut_kinds[k], lg.cut_tensors(k)) for k in range(lg.n + 1))
    return ModelCosts(
        layers=tuple(layers),
        cuts=cuts,
        micro_batch=micro_batch,
        dtype=dtype_name(dtype),
        seq_len=seq_len,
        tied=tied,
        architecture=architecture,
        loss=replace(loss.choice, coupling=coupling) if loss.choice is not None and coupling else loss.choice,
        notes=tuple(lg.notes)
        + tuple(coupled_notes)
        + tuple(
            f"{op} (in {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) has no FLOP formula: its arithmetic is "
            "not counted, only its memory traffic; the compute time of these pieces is underestimated"
            for op, names in sorted(uncounted.items())
        ),
    )
