"""Trace a meta-device model into a LayerGraph: pieces in execution order and the cut points between them.

A *piece* is the unit the partitioner places on a stage. Repeated blocks
(children of ModuleList / ModuleDict / Sequential, and classes named with
``--leaf``) are pieces; inside a block, a cut is offered wherever no more
bytes cross than at the block's own input (for a transformer: after the
attention residual add, before the MLP), so attention and MLP become pieces
of their own. Modules before the first block merge into one piece; every
module after the last block (final norm, output head) is a piece of its own.

Every value produced before a cut and read after it crosses that cut, so a
skip connection that jumps over a cut adds to its bytes. Values that depend on
no input (parameters, buffers, constants derived from them) never cross: each
piece that needs them recomputes them.

The same LayerGraph builds the modules that run the pieces
(:meth:`LayerGraph.stage_module`), so the costs, the plan and the rendered
training scripts all use one split.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from planner.errors import UsageError
from planner.model.coupling import meeting_in_shapes
from planner.model.meta_policies import meta_allowed
from planner.records import TensorInfo

CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
_DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.bool: "bool",
    torch.uint8: "uint8",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


# --------------------------------------------------------------------------- blocks


def find_blocks(model: nn.Module, leaf_classes: Iterable[str] = ()) -> list[str]:
    """Module paths of the repeated blocks: custom children of containers, and ``leaf_classes``."""
    leaf_classes = set(leaf_classes)
    blocks: list[str] = []

    def builtin(m: nn.Module) -> bool:
        return type(m).__module__.startswith("torch.nn") and not isinstance(m, CONTAINERS)

    def visit(mod: nn.Module, path: str) -> None:
        for name, child in mod.named_children():
            p = f"{path}.{name}" if path else name
            if type(child).__name__ in leaf_classes or isinstance(mod, CONTAINERS) and not isinstance(child, CONTAINERS) and not builtin(child):
                blocks.append(p)
            else:
                visit(child, p)

    visit(model, "")
    return blocks


def _block_mask_function() -> Callable[..., Any] | None:
    try:
        from torch.nn.attention import flex_attention as fa
    except ImportError:
        return None
    return getattr(fa, "create_block_mask", None)


class _BlockMaskOf:
    """``create_block_mask(mask_mod, ...)`` as one graph call: fx cannot hold a function among a node's arguments,
    so the mask function goes into the call's target. Run at replay on the values given (meta tensors and sizes)."""

    def __init__(self, make: Callable[..., Any], mask_mod: Callable[..., Any]):
        self.make, self.mask_mod = make, mask_mod
        self.__name__ = f"create_block_mask_{getattr(mask_mod, '__name__', 'mask')}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.make(self.mask_mod, *args, **kwargs)


class _Tracer(fx.Tracer):
    """fx tracer that traces into blocks but keeps each block's children (and opaque blocks) as leaves.

    flex attention's ``create_block_mask`` is recorded as one call (_BlockMaskOf), not traced into: its body runs
    torch.func.vmap, whose level bookkeeping a graph cut into pieces cannot replay."""

    def __init__(self, blocks: set[str], opaque: set[str], leaf_classes: set[str]):
        make = _block_mask_function()
        super().__init__(autowrap_functions=(make,) if make is not None else ())
        self._make_block_mask = make
        self.blocks = blocks
        self.opaque = opaque
        self.leaf_classes = leaf_classes

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if qualname in self.opaque or type(m).__name__ in self.leaf_classes and qualname not in self.blocks:
            return True
        if qualname.rpartition(".")[0] in self.blocks:
            return True
        return super().is_leaf_module(m, qualname)

    def create_proxy(self, kind: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *rest: Any, **more: Any) -> Any:
        make = self._make_block_mask
        if kind == "call_function" and make is not None and target is make and args and callable(args[0]):
            target, args = _BlockMaskOf(make, args[0]), args[1:]
        return super().create_proxy(kind, target, args, kwargs, *rest, **more)

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as e:
            if not hasattr(e, "_planner_module"):
                e._planner_module = (self.path_of_module(m), type(m).__name__)  # type: ignore[attr-defined]
            raise


class TraceFailure(Exception):
    """Why one tracer failed: the module it failed in (fx), the user's source line, the original exception."""

    def __init__(self, module: tuple[str, str] | None, where: str, cause: BaseException):
        super().__init__(str(cause))
        self.module = module
        self.where = where
        self.cause = cause


def _where(exc: BaseException) -> str:
    """'file.py line N: code' of the deepest frame outside torch, the user's source line."""
    torch_dir = str(Path(torch.__file__).parent)
    here = str(Path(__file__).parent.parent)
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith((torch_dir, here, "<"))]
    if not frames:
        return "an unknown line"
    f = frames[-1]
    return f"{Path(f.filename).name} line {f.lineno}: {(f.line or '').strip()}"


def _defaults_beyond(model: nn.Module, n_inputs: int, names: tuple[str, ...] = ()) -> dict[str, Any]:
    """forward()'s parameters the inputs do not give, with their defaults (``attn_mask=None``): those after the
    ``n_inputs`` positional ones, or with keyword inputs ``names`` every one not named."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return {}
    named = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    rest = [p for p in named if p.name not in names] if names else named[n_inputs:]
    return {p.name: p.default for p in rest if p.default is not inspect.Parameter.empty}


def _bind_defaults(graph: fx.Graph, defaults: dict[str, Any], n_inputs: int, names: tuple[str, ...] = ()) -> None:
    """Replace the placeholders of arguments the inputs do not give by their default values (fx specialises them)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for ph in placeholders if names else placeholders[n_inputs:]:
        name = str(ph.target).rstrip("_1234567890") if str(ph.target) not in defaults else str(ph.target)
        if name not in defaults or str(ph.target) in names:
            continue
        value = defaults[name]
        for user in list(ph.users):
            user.args = fx.node.map_arg(user.args, _substitute(ph, value))
            user.kwargs = fx.node.map_arg(user.kwargs, _substitute(ph, value))
        graph.erase_node(ph)


def _fx_trace(
    model: nn.Module, blocks: list[str], leaf_classes: set[str], n_inputs: int | None = None, names: tuple[str, ...] = ()
) -> tuple[fx.GraphModule, list[str]]:
    """Trace with fx; blocks whose class cannot be traced into are kept whole (returned as notes).

    forward() arguments the example inputs do not give (beyond the ``n_inputs`` positional ones, or not among the
    keyword inputs ``names``) are traced at their defaults.
    """
    defaults = _defaults_beyond(model, n_inputs, names) if n_inputs is not None else {}
    opaque: set[str] = set()
    notes: list[str] = []
    block_set = set(blocks)
    for _ in range(len(blocks) + 1):
        tracer = _Tracer(block_set, opaque, leaf_classes)
        try:
            graph = tracer.trace(model, concrete_args=dict(defaults) or None)
        except Exception as e:
            path, cls = getattr(e, "_planner_module", (None, None))
            inside = next((b for b in sorted(block_set - opaque, key=len) if path and (path == b or path.startswith(b + "."))), None)
            if inside is None:
                raise TraceFailure(getattr(e, "_planner_module", None), _where(e), e) from e
            same = {b for b in block_set if type(model.get_submodule(b)).__name__ == type(model.get_submodule(inside)).__name__}
            opaque |= same
            notes.append(
                f"blocks of class {type(model.get_submodule(inside)).__name__} could not be traced inside "
                f"({_where(e)}: {type(e).__name__}); they are kept whole, so no cut is offered inside them"
            )
            continue
        if defaults:
            _bind_defaults(graph, defaults, n_inputs or 0, names)
        return fx.GraphModule(model, graph), notes
    raise AssertionError("unreachable")


_REWRITES = {
    torch.ops.aten.scaled_dot_product_attention.default: F.scaled_dot_product_attention,
    torch.ops.aten.dropout.default: F.dropout,
}


@contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """torch.export logs guard failures at WARNING through `logging`; the planner reports its own error instead."""
    logger = logging.getLogger("torch")
    old = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(old)


@contextmanager
def _stderr_kept_aside() -> Iterator[None]:
    """torch.export writes graphs it fails on straight to file descriptor 2 (kilobytes of generated code, from below
    Python's sys.stderr); the planner reports one paragraph instead. What was written is dropped, or shown again when
    PLANNER_DEBUG is set."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    with tempfile.TemporaryFile() as aside:
        os.dup2(aside.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if os.environ.get("PLANNER_DEBUG"):
                aside.seek(0)
                sys.stderr.write(aside.read(1 << 20).decode("utf-8", "replace"))


@contextmanager
def _no_stack_traces() -> Iterator[None]:
    """torch.export records the Python stack of every node it creates (a fifth of its time on a long graph, and the
    source text of every frame in the generated code); the planner reads no node's stack, so none is recorded."""
    import torch.fx.config as fx_config

    saved = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = saved


def _export_trace(model: nn.Module, inputs: tuple[torch.Tensor, ...], names: tuple[str, ...] = ()) -> fx.GraphModule:
    """torch.export's graph of ``model`` on ``inputs`` (positional, or keyword arguments ``names`` in forward()'s order)."""
    args, kwargs = ((), dict(zip(names, inputs))) if names else (inputs, None)
    try:
        with _quiet_torch_logs(), _no_stack_traces(), _stderr_kept_aside():
            ep = torch.export.export(model, args, kwargs, strict=False)
    except Exception as e:
        raise TraceFailure(None, _where(e), e) from e
    gm = ep.module()
    # input-shape guards re-check the example shapes at every call: the planner runs other batch sizes
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and "guard" in str(node.target) and not node.users:
            gm.graph.erase_node(node)
    # Route attention and dropout through their Python APIs so costing sees them as the GPU runs them.
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _REWRITES:
            node.target = _REWRITES[node.target]
        stack = node.meta.get("nn_module_stack")
        if stack:
            node.meta["nn_module_stack"] = {k: (v[0], v[1]) for k, v in stack.items() if v[0]}
    gm.recompile()
    return gm


# --------------------------------------------------------------------------- value metadata


@dataclass(frozen=True)
class ValueMeta:
    """What a graph value is at the traced micro-batch: its tensors (flattened), or a non-tensor."""

    tensors: tuple[tuple[tuple[int, ...], torch.dtype, bool], ...]
    is_tensor_like: bool

    @property
    def bytes(self) -> int:
        return sum(_numel(s) * _itemsize(d) for s, d, _ in self.tensors)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for x in shape:
        n *= int(x)
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _meta_of(value: Any) -> ValueMeta:
    flat, _ = torch.utils._pytree.tree_flatten(value)
    tensors = tuple((tuple(t.shape), t.dtype, bool(t.requires_grad)) for t in flat if isinstance(t, torch.Tensor))
    ok = all(isinstance(t, torch.Tensor) for t in flat) and bool(flat)
    return ValueMeta(tensors, ok)


def _plain(value: Any) -> bool:
    """A Python constant that can be written into a graph: numbers, bools, None, torch.Size, tuples/lists of them."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return True
    return isinstance(value, (tuple, list)) and all(_plain(v) for v in value)


def _propagate(gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...], consts: dict[fx.Node, Any] | None = None) -> dict[fx.Node, ValueMeta]:
    """Run ``gm`` on meta ``inputs``: each node's ValueMeta (and, into ``consts``, the plain non-tensor values)."""
    metas: dict[fx.Node, ValueMeta] = {}

    class Prop(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            try:
                out = super().run_node(n)
            except Exception as e:
                if not hasattr(e, "_planner_node"):
                    e._planner_node = n  # type: ignore[attr-defined]
                raise
            metas[n] = _meta_of(out)
            if consts is not None and not metas[n].is_tensor_like and _plain(out):
                consts[n] = out
            return out

    with torch.device("meta"):
        Prop(gm).run(*inputs)
    return metas


# --------------------------------------------------------------------------- pieces


@dataclass
class Piece:
    """A contiguous run of graph nodes placed on one stage."""

    index: int
    name: str
    kind: str
    block: str | None
    nodes: list[fx.Node]
    modules: tuple[str, ...]


@dataclass
class LayerGraph:
    """A traced model split into pieces, with the values crossing each cut.

    ``boundaries[k]`` lists the values live across cut k (0: the model inputs,
    n: the model outputs). The fx graph is already a DAG in topological order, so the values
    crossing every cut come from one liveness sweep over it (no separate graph library).
    """

    model: nn.Module
    gm: fx.GraphModule
    pieces: list[Piece]
    boundaries: list[list[fx.Node]]
    cut_kinds: list[str]
    metas: dict[fx.Node, ValueMeta]
    tracer: str
    blocks: list[str]
    notes: list[str] = field(default_factory=list)
    batch_dims: dict[fx.Node, int | None] = field(default_factory=dict)
    #: where a value holds two dimensions that grow with the batch (samples meet: planner.model.coupling), else None
    samples_meet: str | None = None
    #: the model output's tensors at twice the traced micro-batch (shape, dtype, requires_grad), where traced so
    output_2x: ValueMeta | None = None
    _free: set[fx.Node] | None = field(default=None, repr=False, compare=False)

    @property
    def n(self) -> int:
        return len(self.pieces)

    def free_nodes(self) -> set[fx.Node]:
        """:func:`_free_nodes` of the traced graph, found once (every stage module asks; the graph does not change)."""
        if self._free is None:
            self._free = _free_nodes(self.gm.graph)
        return self._free

    def cut_tensors(self, k: int) -> tuple[TensorInfo, ...]:
        """Tensors crossing cut k, flattened from the live values."""
        out: list[TensorInfo] = []
        for node in self.boundaries[k]:
            for i, (shape, dtype, rg) in enumerate(self.metas[node].tensors):
                name = node.name if len(self.metas[node].tensors) == 1 else f"{node.name}[{i}]"
                rg = rg and dtype.is_floating_point
                out.append(TensorInfo(name, shape, dtype_name(dtype), _numel(shape) * _itemsize(dtype), rg, self.batch_dims.get(node, 0)))
        return tuple(out)

    def stage_module(self, start: int, stop: int, root: nn.Module | None = None) -> PiecesModule:
        """An nn.Module running pieces [start, stop): takes the values of cut ``start``, returns those of cut ``stop``.

        Parameters and buffers come from ``root`` (default: the traced model) by
        their module paths and are shared, not copied: build the same structure
        on meta for planning and on real weights for training. The last stage
        returns the model's own output structure.
        """
        return PiecesModule(self, start, stop, root)


class PiecesModule(nn.Module):
    """Pieces [start, stop) of a LayerGraph as one module (parameters keep their model paths)."""

    def __init__(self, lg: LayerGraph, start: int, stop: int, root: nn.Module | None = None):
        super().__init__()
        if not 0 <= start < stop <= lg.n:
            raise ValueError(f"bad piece range [{start}, {stop}) for {lg.n} pieces")
        self.start, self.stop = start, stop
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for node in lg.boundaries[start]:
            env[node] = graph.placeholder(node.name)
        free = lg.free_nodes()

        def copy(node: fx.Node) -> fx.Node:
            if node in env:
                return env[node]
            if node not in free:
                raise RuntimeError(f"value {node.name} is not available in pieces [{start}, {stop})")
            for dep in node.all_input_nodes:
                copy(dep)
            env[node] = graph.node_copy(node, lambda x: env[x])
            return env[node]

        for piece in lg.pieces[start:stop]:
            for node in piece.nodes:
                for dep in node.all_input_nodes:
                    copy(dep)
                env[node] = graph.node_copy(node, lambda x: env[x])
        self.out_spec = None
        if stop == lg.n:
            out_node = next(n for n in lg.gm.graph.nodes if n.op == "output")
            graph.output(fx.map_arg(out_node.args[0], lambda x: copy(x)))
            self.returns_model_output = True
            # torch.export graphs return flat outputs; their pytree spec restores the model's own structure
            info = getattr(lg.gm.graph._codegen, "pytree_info", None)
            self.out_spec = getattr(info, "out_spec", None)
        else:
            graph.output(tuple(env[v] for v in lg.boundaries[stop]))
            self.returns_model_output = False
        graph.lint()
        self.gm = fx.GraphModule(_attr_source(lg.gm, graph, root), graph)
        self.num_inputs = len(lg.boundaries[start])

    def forward(self, *args: Any) -> Any:
        if len(args) == 1 and isinstance(args[0], (tuple, list)) and self.num_inputs != 1:
            args = tuple(args[0])
        out = self.gm(*args)
        if self.out_spec is not None:
            return torch.utils._pytree.tree_unflatten(list(out), self.out_spec)
        if not self.returns_model_output and len(out) == 1:
            return out[0]
        return out


def _attr_source(traced: nn.Module, graph: fx.Graph, root: nn.Module | None) -> dict[str, Any] | nn.Module:
    """What the stage graph's get_attr / call_module targets resolve to: ``root``'s objects, else the traced module's."""
    if root is None:
        return traced
    found: dict[str, Any] = {}
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module"):
            target = str(node.target)
            try:
                found[target] = _get_path(root, target)
            except AttributeError:
                found[target] = _get_path(traced, target)  # constants lifted by torch.export
    return found


def idle_modules(model: nn.Module, gm: fx.GraphModule) -> list[tuple[str, int]]:
    """(module path, parameters) of the largest modules of ``model`` none of whose parameters the traced graph ``gm``
    reads (a vision tower when only token ids are given), in module order: the parameters no piece holds."""
    used: set[int] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.users:  # torch.export's graph fetches every parameter, used or not
            value = _get_path(gm, str(node.target))
            if isinstance(value, torch.Tensor):
                used.add(id(value))
        elif node.op == "call_module":
            used.update(id(t) for t in gm.get_submodule(str(node.target)).parameters())
    out: list[tuple[str, int]] = []
    for path, mod in model.named_modules():
        params = list(mod.parameters())
        if not params or any(id(t) in used for t in params):
            continue
        if any(path.startswith(prefix + ".") for prefix, _ in out if prefix):
            continue  # inside a module already listed
        if not path:
            return [("(the whole model)", sum(t.numel() for t in params))]
        out.append((path, sum(t.numel() for t in {id(t): t for t in params}.values())))
    return out


def _get_path(mod: nn.Module, path: str) -> Any:
    obj: Any = mod
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _free_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes that depend on no placeholder: parameters, buffers and what is computed from them alone."""
    free: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "get_attr":
            free.add(node)
        elif node.op in ("call_function", "call_method", "call_module") and all(d in free for d in node.all_input_nodes):
            # a call with no inputs (torch.ones(4)) is free only if it is deterministic; random ones stay put
            if node.all_input_nodes or _deterministic(node):
                free.add(node)
    return free


def _substitute(old: fx.Node, value: Any) -> Callable[[fx.Node], Any]:
    """For fx.node.map_arg: ``value`` in place of ``old``, every other node as it is."""
    return lambda a: value if a is old else a


def _deterministic(node: fx.Node) -> bool:
    name = getattr(node.target, "__name__", str(node.target))
    return not any(r in name for r in ("rand", "normal", "bernoulli", "dropout", "empty"))


def _owner(node: fx.Node, blocks: set[str], containers: set[str]) -> str | None:
    """The piece owner of a node: its block, else its outermost module that is not a container (None: root code)."""
    stack: list[str] = [v[0] for v in node.meta.get("nn_module_stack", {}).values()]
    if node.op == "call_module":
        stack.append(str(node.target))
    for path in stack:
        if path in blocks:
            return path
    for path in stack:
        if path and path not in containers:
            # the outermost non-container module: a top-level child, or a child of a top-level ModuleList
            parts = path.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix not in containers:
                    return prefix
    return None


def _child_of(node: fx.Node, block: str) -> str | None:
    """The direct child of ``block`` that a node runs in, if any."""
    stack: list[str] = [v[0] for v in node.meta.get("nn_module_stack", {}).values()]
    if node.op == "call_module":
        stack.append(str(node.target))
    prefix = block + "."
    for path in stack:
        if path.startswith(prefix):
            return path[len(prefix) :].split(".")[0]
    return None


def _label(children: list[str]) -> tuple[str, str]:
    """Name suffix and kind of a block part from its children's names (largest last)."""
    for c in reversed(children):
        low = c.lower()
        if "attn" in low or "attention" in low:
            return c, "attention"
        if any(k in low for k in ("mlp", "ffn", "feed_forward", "feedforward", "moe", "expert")):
            return c, "mlp"
    return (children[-1] if children else "part"), "block"


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def build_layer_graph(*args: Any, **kwargs: Any) -> LayerGraph:
    """``_build_layer_graph`` (below) with the device checks that refuse meta tensors before operators that run on
    meta lifted (planner.model.meta_policies: flex attention); for the planner's trace and the scripts' alike."""
    with meta_allowed():
        return _build_layer_graph(*args, **kwargs)


def _build_layer_graph(
    model: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    inputs_2x: tuple[torch.Tensor, ...] | None = None,
    leaf_classes: Iterable[str] = (),
    tracer: str = "auto",
    sub_block_cuts: bool = True,
    fake_mode: Any = None,
    input_names: Sequence[str] = (),
) -> LayerGraph:
    """Trace ``model`` (on meta) and split it into pieces with their cut points.

    ``input_names``: the forward() parameters ``inputs`` are given as (keyword inputs, in forward()'s order); empty
    for positional ones. The graph's placeholders are the inputs in that order either way.

    ``inputs_2x`` (the same inputs at twice the micro-batch) identifies which
    dimension of each crossing tensor is the batch dimension. ``fake_mode`` (a
    FakeTensorMode the inputs were made in) runs the shapes through the fx graph
    in it, and the symbolic trace outside it: a model with real weights is traced
    so, and the tensors its forward creates as constants stay real.
    """
    leaf_classes = set(leaf_classes)
    names = tuple(input_names)
    blocks = find_blocks(model, leaf_classes)
    notes: list[str] = []
    fx_error: TraceFailure | None = None
    gm = None
    used = tracer
    if tracer in ("auto", "fx"):
        try:
            gm, notes = _fx_trace(model, blocks, leaf_classes, len(inputs), names)
            used = "fx"
        except TraceFailure as e:
            fx_error = e
            if tracer == "fx":
                raise _trace_error(e, None, model) from e.cause
    if gm is None:
        try:
            # a static graph: it runs at the traced micro-batch size only (costs scale linearly from it;
            # the training scripts re-trace at the planned micro-batch)
            gm = _export_trace(model, inputs, names)
            used = "export"
            if fx_error is not None:
                notes.append(f"torch.fx could not trace the model ({_failure_text(fx_error)}); traced with torch.export instead")
        except TraceFailure as e:
            eager = _eager_failure(model, inputs, names)
            if eager is not None and type(eager) is type(e.cause) and _where(eager) == e.where:
                raise _run_error(eager, model) from eager  # it fails the same way when simply run: no tracer option helps
            raise _trace_error(fx_error, e, model) from e.cause

    consts: dict[fx.Node, Any] = {}
    consts2: dict[fx.Node, Any] = {}
    shapes = fake_mode if fake_mode is not None else contextlib.nullcontext()
    try:
        with shapes:
            metas = _propagate(gm, inputs, consts)
    except Exception as e:
        raise _meta_error(e, model) from e
    batch_dims: dict[fx.Node, int | None] = {}
    if inputs_2x is not None:
        if used == "export":  # a static graph: trace again at twice the batch and match nodes by name
            by_name = {n.name: m for n, m in _propagate(_export_trace(model, inputs_2x, names), inputs_2x).items()}
            metas2: Mapping[fx.Node, ValueMeta | None] = {n: by_name.get(n.name) for n in metas}
        else:
            with shapes:
                metas2 = _propagate(gm, inputs_2x, consts2)
        for node, m in metas.items():
            m2 = metas2.get(node)
            dim = None
            if m2 is not None and m.tensors and m2.tensors:
                s1, s2 = m.tensors[0][0], m2.tensors[0][0]
                diff = [i for i, (a, b) in enumerate(zip(s1, s2)) if a != b]
                dim = diff[0] if diff else None
            batch_dims[node] = dim
        meets = meeting_in_shapes(
            [
                (f"the model's {node.name}", [t[0] for t in m.tensors], [t[0] for t in m2.tensors])
                for node, m in metas.items()
                if (m2 := metas2.get(node)) is not None
            ]
        )
        outs = [n for n in metas if n.op == "output"]
        output_2x = metas2.get(outs[0]) if outs else None

    if used == "fx" and inputs_2x is not None:
        notes += _bake_constants(gm, consts, consts2, set(blocks), model)
    whole = {b for b in blocks if type(model.get_submodule(b)).__name__ in leaf_classes}  # --leaf: one piece each
    lg = _split(model, gm, metas, blocks, used, sub_block_cuts, whole)
    lg.notes = notes + lg.notes
    lg.batch_dims = batch_dims
    if inputs_2x is not None:
        lg.samples_meet, lg.output_2x = meets, output_2x
    return lg


def _bake_constants(gm: fx.GraphModule, consts: dict[fx.Node, Any], consts2: dict[fx.Node, Any], blocks: set[str], model: nn.Module) -> list[str]:
    """Write non-tensor values that do not change with the batch size (``x.shape[-2:]``) into the graph as constants.

    A piece cannot receive a Python value from the stage before it; a value read from the input's shape and
    used pieces later (a segmentation head resizing to the input size) would otherwise hold every piece in
    between together. Values that change with the batch size stay, and the pieces they join are noted.
    """
    containers = {name for name, m in model.named_modules() if name and isinstance(m, CONTAINERS)}
    order = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(order)}
    owners = [_owner(n, blocks, containers) for n in order]
    crossing: list[str] = []
    for node in order:
        if node not in consts or node not in consts2 or node.op == "placeholder" or not node.users:
            continue
        value = consts[node]
        if value != consts2[node] or not node.all_input_nodes:
            continue
        # only values whose reads span another module's code could have a cut between them; and the sizes a block
        # mask is made from (fixed, the mask is made again in every piece that reads it: it depends on no input)
        last = max(index[u] for u in node.users)
        mine = owners[index[node]]
        makes_mask = any(isinstance(u.target, _BlockMaskOf) for u in node.users)
        if not makes_mask and not any(o is not None and o != mine for o in owners[index[node] + 1 : last]):
            continue
        crossing.append(node.name)
        for user in list(node.users):
            user.args = fx.node.map_arg(user.args, _substitute(node, value))
            user.kwargs = fx.node.map_arg(user.kwargs, _substitute(node, value))
    # drop the shape reads nothing uses any more
    for node in reversed(list(gm.graph.nodes)):
        if node.op in ("call_function", "call_method") and not node.users and node in consts:
            gm.graph.erase_node(node)
    gm.recompile()
    if not crossing:
        return []
    return [
        f"non-tensor values used by later pieces ({', '.join(crossing[:4])}) do not depend on the batch size: "
        "they are fixed at the traced input size so that pieces can be cut between where they are read and used"
    ]


def _first_line(e: BaseException) -> str:
    """The first line of ``e``'s message ('' when it has none)."""
    return str(e).strip().splitlines()[0] if str(e).strip() else ""


def _error_text(e: BaseException) -> str:
    """``e``'s first line and its cause, lower-cased: what the error classifiers below read."""
    return f"{_first_line(e)} {e.__cause__ or ''}".lower()


def _reads_values(e: BaseException) -> bool:
    """Whether ``e`` is the meta device refusing to give a tensor's values (.item(), a data-dependent branch)."""
    text = _error_text(e)
    return any(k in text for k in ("meta tensor", "data-dependent", "item()", "cannot copy out", "not implemented for 'meta'"))


def _meta_error(e: BaseException, model: nn.Module) -> UsageError:
    """A clear error for a model that cannot run on the meta device, naming the module and the source line."""
    node = getattr(e, "_planner_node", None)
    where = _where(e)
    mod = ""
    if node is not None:
        stack: list[str] = [v[0] for v in node.meta.get("nn_module_stack", {}).values()]
        path = str(node.target) if node.op == "call_module" else (stack[-1] if stack else "")
        if path:
            try:
                mod = f" in module {path} ({type(model.get_submodule(path)).__name__})"
            except AttributeError:
                mod = f" in module {path}"
        if where == "an unknown line":  # the traced graph ran, not the source: name the call that failed
            target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
            where = f"its call {target}() (traced graph node {node.name})"
    first = _first_line(e).rstrip(":")
    if _reads_values(e):
        return UsageError(
            f"The model reads tensor values{mod} at {where}; the planner runs models on the meta device, "
            f"where values are not known ({type(e).__name__}: {first}).",
            "Make the branch independent of tensor values (torch.where, masking, or a decision from shapes or "
            "constructor arguments); --leaf and --tracer export cannot help with a value-dependent branch.",
        )
    if _model_code_error(e):
        return UsageError(
            f"The model's forward() raised {type(e).__name__}{mod} at {where}: {first}.",
            "The failure is in the model's code with these arguments, not in tracing or the meta device: fix the code there "
            "or the arguments it reads (a library model's config fields: --model-arg KEY=VALUE).",
        )
    return UsageError(
        f"Running the model on the meta device failed{mod} at {where}: {type(e).__name__}: {first}.",
        "The model must run on torch.device('meta'): create tensors with device=x.device rather than an explicit "
        "'cpu'/'cuda', and avoid .item(), .tolist() and numpy conversions in forward().",
    )


def _failure_text(f: TraceFailure) -> str:
    """'ExcType at file.py line N: first line of the message' (the location only when a user frame is known)."""
    exc: BaseException | None = f.cause
    while exc is not None and not str(exc).strip() and exc.__cause__ is not None:
        exc = exc.__cause__  # torch.export re-raises some failures with an empty message
    exc = exc or f.cause
    lines = [x for x in str(exc).strip().splitlines() if x.strip()]
    first = lines[0].strip() if lines else ""
    if len(first) > 300:
        first = first[:297] + "..."
    at = f" (at {f.where})" if f.where != "an unknown line" else ""
    return f"{type(exc).__name__}" + (f": {first}" if first else "") + at


#: Python errors that, raised in a model's own code while torch.export runs its forward, are the model failing on its
#: arguments rather than a tracing limitation
MODEL_CODE_ERRORS = (TypeError, ValueError, AttributeError, KeyError, IndexError, ZeroDivisionError)
#: torch's RuntimeError texts for shapes that do not agree (view/reshape, matmul, broadcasting, cat, conv channels,
#: a dimension index): the model's own arithmetic, the same on any device
SHAPE_ERROR_TEXTS = (
    "is invalid for input of size",
    "shapes cannot be multiplied",
    "must match the size of tensor",
    "sizes of tensors must match",
    "size mismatch",
    "dimension out of range",
    "given groups=",
    "attempting to broadcast a dimension",
    "should be broadcastable",
)


def _model_code_error(e: BaseException) -> bool:
    """Whether ``e`` is the model's own code failing on its arguments (a plain Python error, or torch refusing shapes
    that do not agree) rather than the meta device or a tracer: then neither the meta-device nor the tracing advice fits."""
    if "meta" in _error_text(e):
        return False
    if isinstance(e, MODEL_CODE_ERRORS):
        return True
    first = _first_line(e).lower()
    return isinstance(e, RuntimeError) and not isinstance(e, NotImplementedError) and any(k in first for k in SHAPE_ERROR_TEXTS)


def call_model(model: nn.Module, inputs: Sequence[Any], names: Sequence[str] = ()) -> Any:
    """``model`` run on ``inputs``: positional, or keyword arguments ``names`` (ModelFile.input_names)."""
    return model(**dict(zip(names, inputs))) if names else model(*inputs)


def _eager_failure(model: nn.Module, inputs: tuple[torch.Tensor, ...], names: tuple[str, ...] = ()) -> BaseException | None:
    """The exception the model raises when its forward simply runs on ``inputs`` (meta tensors, no tracer), or None."""
    try:
        with torch.no_grad(), _quiet_torch_logs():
            call_model(model, inputs, names)
    except Exception as e:
        return e
    return None


def _run_error(e: BaseException, model: nn.Module) -> UsageError:
    """The error for a model whose forward raises when run as is: a value read on the meta device (:func:`_meta_error`),
    or its own code failing on its arguments, which no tracer option changes."""
    if _reads_values(e):
        return _meta_error(e, model)
    first = next((x.strip() for x in str(e).splitlines() if x.strip()), "")
    return UsageError(
        f"The model's forward() raises {type(e).__name__} when run as is, before any tracing" + (f" ({first})" if first else "") + f", at {_where(e)}.",
        "The failure is in the model's code with these arguments, so neither tracer nor --leaf can help: fix the line "
        "above or the arguments it reads (a library model's config fields: --model-arg KEY=VALUE).",
    )


def _is_branch(cause: str) -> bool:
    """Whether a tracer's error says the code branched on a tensor's value."""
    return "control flow" in cause or "data-dependent" in cause.lower()


def _trace_error(fx_err: TraceFailure | None, export_err: TraceFailure | None, model: nn.Module) -> UsageError:
    """The error for a model neither tracer could trace: each tracer's real cause, and only hints not yet tried."""
    main = fx_err or export_err
    assert main is not None
    if fx_err is not None and fx_err.module:
        path, cls = fx_err.module
        mod = f"module {path or '(root)'} ({cls})"
    else:
        path, cls = None, None
        mod = f"the model ({type(model).__name__})"
    parts = []
    if fx_err is not None:
        parts.append(f"torch.fx: {_failure_text(fx_err)}")
    if export_err is not None:
        parts.append(f"torch.export: {_failure_text(export_err)}")
    msg = f"Cannot trace {mod}. " + "; ".join(parts) + "."
    causes = " ".join(str(f.cause) for f in (fx_err, export_err) if f is not None)
    branch = _is_branch(causes)
    if branch:
        msg += " Its forward() branches on tensor values, which a static trace cannot follow."
    hints = []
    if "register a pytree" in causes or "not a known type" in causes:
        hints.append(
            "the forward returns an object torch.export cannot return: return tensors (or tuples, dicts or dataclasses "
            "of tensors), or turn off the inference-only switch that returns it"
        )
    if path:
        hints.append(f"make that module a single piece with --leaf {cls}")
    elif branch and fx_err is not None and _is_branch(str(fx_err.cause)):
        # torch.fx stopped at the branch itself: a leaf module around it keeps fx going (torch.export has no leaves)
        hints.append("move the branch into a submodule and name its class with --leaf")
    if export_err is None:
        hints.append("try --tracer export")
    if export_err is not None and _model_code_error(export_err.cause) and export_err.where != "an unknown line":
        # torch.export runs forward() as Python: a plain Python error there is the model's code failing on its arguments
        hints.append(
            f"the model's own code raised {type(export_err.cause).__name__} at {export_err.where.partition(':')[0]} while "
            "torch.export ran its forward(), so no tracer option helps: check the arguments that line reads (a library "
            "model's config fields: --model-arg KEY=VALUE)"
        )
    elif "same device" in causes or "expected device" in causes:
        hints.append(
            "the model makes a tensor on an explicit device ('cpu'/'cuda') where the planner runs it on the meta device: "
            "create tensors with device=x.device (or register them as buffers)"
        )
    else:
        hints.append("rewrite branches on tensor values with torch.where so they do not depend on the values")
    hint = "; ".join(hints)
    return UsageError(msg, hint[0].upper() + hint[1:] + ".")


def _split(
    model: nn.Module,
    gm: fx.GraphModule,
    metas: dict[fx.Node, ValueMeta],
    blocks: list[str],
    tracer: str,
    sub_block_cuts: bool,
    whole: set[str] = frozenset(),  # type: ignore[assignment]
) -> LayerGraph:
    graph = gm.graph
    free = _free_nodes(graph)
    block_set = set(blocks)
    containers = {name for name, m in model.named_modules() if name and isinstance(m, CONTAINERS)}
    compute = [n for n in graph.nodes if n.op not in ("placeholder", "output") and n not in free]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    out_node = next(n for n in graph.nodes if n.op == "output")

    # 1. runs of nodes by owner (root-level code joins the previous run, or the next one at the start)
    owners = [_owner(n, block_set, containers) for n in compute]
    runs: list[list[Any]] = []  # [owner, nodes]
    pending: list[fx.Node] = []
    for node, own in zip(compute, owners):
        if own is None:
            if runs:
                runs[-1][1].append(node)
            else:
                pending.append(node)
            continue
        if runs and runs[-1][0] == own:
            runs[-1][1].append(node)
        else:
            runs.append([own, pending + [node]])
            pending = []
    if pending:
        runs.append(["(root)", pending])
    if not runs:
        raise UsageError("The traced model has no operations.", "Check that forward() uses its inputs.")

    # value positions: producing node index and last consumer index (output = len(compute))
    pos = {n: i for i, n in enumerate(compute)}
    for p in placeholders:
        pos[p] = -1
    last_use: dict[fx.Node, int] = {}
    for n in list(placeholders) + compute:
        uses = [pos.get(u, len(compute)) if u is not out_node else len(compute) for u in n.users if u not in free]
        # a free node using a value keeps it alive until the free node's own users
        for u in n.users:
            if u in free:
                uses.extend(_free_last_use(u, pos, out_node, free, len(compute)))
        last_use[n] = max(uses) if uses else pos[n]

    # live values before each compute node, by one sweep (values in production order)
    live_at: list[list[fx.Node]] = []
    live: dict[fx.Node, None] = {p: None for p in placeholders if last_use[p] >= 0}
    for j in range(len(compute) + 1):
        if j > 0:
            live[compute[j - 1]] = None
        for v in [v for v in live if last_use[v] < j]:
            del live[v]
        live_at.append(list(live))

    def crossing(j: int) -> list[fx.Node]:
        """Values live across the point before compute[j], in production order."""
        return live_at[j]

    def crossing_bytes(j: int) -> int:
        return sum(metas[v].bytes for v in live_at[j] if v in metas)

    # 2. pieces
    first_block = next((i for i, r in enumerate(runs) if r[0] in block_set), None)
    pieces_spec: list[tuple[str, str, str | None, list[fx.Node]]] = []  # name, kind, block, nodes
    start_run = 0
    if first_block is not None and first_block > 0:
        nodes = [n for r in runs[:first_block] for n in r[1]]
        names = [r[0] for r in runs[:first_block] if r[0] != "(root)"]
        kind = "embedding" if any(isinstance(model.get_submodule(r), nn.Embedding) for r in names if _has(model, r)) else "stem"
        pieces_spec.append(("+".join(names) if len(names) <= 4 else f"{names[0]}+..+{names[-1]}", kind, None, nodes))
        start_run = first_block
    last_block = max((i for i, r in enumerate(runs) if r[0] in block_set), default=None)
    for ri in range(start_run, len(runs)):
        own, nodes = runs[ri]
        if own in block_set:
            parts = _block_parts(nodes, own, pos, crossing, crossing_bytes, metas) if sub_block_cuts and own not in whole else [nodes]
            if len(parts) == 1:
                pieces_spec.append((own, "block", own, nodes))
            else:
                used_labels: set[str] = set()
                for part in parts:
                    kids = [c for c in dict.fromkeys(_child_of(n, own) for n in part) if c]
                    kids.sort(key=lambda c: _param_count(model.get_submodule(f"{own}.{c}")) if _has(model, f"{own}.{c}") else 0)
                    label, kind = _label(kids)
                    while label in used_labels:
                        label += "'"
                    used_labels.add(label)
                    pieces_spec.append((f"{own}:{label}", kind, own, part))
        else:
            kind = "other"
            if _has(model, own):
                mod = model.get_submodule(own)
                cls = type(mod).__name__.lower()
                if "norm" in cls:
                    kind = "norm"
                elif isinstance(mod, nn.Embedding):
                    kind = "embedding"
                elif "pool" in cls:
                    kind = "pool"
            pieces_spec.append((own, kind, None, nodes))
    # the last piece with parameters after the last block is the output head
    if last_block is not None:
        for i in range(len(pieces_spec) - 1, -1, -1):
            name, kind, blk, nodes = pieces_spec[i]
            if blk is None and _has(model, name) and _param_count(model.get_submodule(name)) > 0 and kind not in ("norm",):
                pieces_spec[i] = (name, "head", blk, nodes)
                break

    # 3. merge pieces across cuts that a non-tensor value would have to cross
    merged: list[tuple[str, str, str | None, list[fx.Node]]] = []
    merge_notes: dict[str, list[str]] = {}
    for spec in pieces_spec:
        if merged:
            j = pos[spec[3][0]]
            blocking = [v.name for v in crossing(j) if v in metas and not metas[v].is_tensor_like]
            if blocking:
                merge_notes.setdefault(", ".join(blocking[:3]), []).append(spec[0])
                name, kind, blk, nodes = merged[-1]
                merged[-1] = (name, kind, blk if blk == spec[2] else None, nodes + spec[3])
                continue
        merged.append(spec)

    names_seen: dict[str, int] = {}
    pieces: list[Piece] = []
    for i, (name, kind, blk, nodes) in enumerate(merged):
        if name in names_seen:
            names_seen[name] += 1
            name = f"{name}#{names_seen[name]}"
        else:
            names_seen[name] = 1
        mods = tuple(dict.fromkeys(str(n.target) for n in nodes if n.op == "call_module")) or tuple(
            dict.fromkeys(v[0] for n in nodes for v in list(n.meta.get("nn_module_stack", {}).values())[-1:] if v[0])
        )
        pieces.append(Piece(i, name, kind, blk, nodes, mods))

    # 4. boundaries
    starts = [pos[p.nodes[0]] for p in pieces] + [len(compute)]
    boundaries = [crossing(j) for j in starts[:-1]]
    out_values = [v for v in out_node.all_input_nodes if v not in free]
    boundaries.append(out_values)
    kinds = (
        ["input"] + ["sub" if pieces[k].block is not None and pieces[k].block == pieces[k - 1].block else "block" for k in range(1, len(pieces))] + ["output"]
    )

    notes = [
        f"no cut before {', '.join(names[:3])}{' ...' if len(names) > 3 else ''} ({len(names)} piece(s) joined to the one "
        f"before): the non-tensor value(s) {vals} would cross it, and they change with the batch size"
        for vals, names in merge_notes.items()
    ]
    return LayerGraph(model, gm, pieces, boundaries, kinds, metas, tracer, blocks, notes)


def _has(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
        return True
    except AttributeError:
        return False


def _free_last_use(u: fx.Node, pos: dict[fx.Node, int], out_node: fx.Node, free: set[fx.Node], end: int) -> list[int]:
    uses = []
    for w in u.users:
        if w is out_node:
            uses.append(end)
        elif w in free:
            uses.extend(_free_last_use(w, pos, out_node, free, end))
        else:
            uses.append(pos[w])
    return uses


#: operators torch.export records that check the traced values and compute nothing
_CHECK_OPS = (torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten._assert_scalar.default)


def _is_check(node: fx.Node) -> bool:
    """Whether ``node`` is a check with no users (:data:`_CHECK_OPS`)."""
    return node.op == "call_function" and node.target in _CHECK_OPS and not node.users


def _block_parts(
    nodes: list[fx.Node],
    block: str,
    pos: dict[fx.Node, int],
    crossing: Callable[[int], list[fx.Node]],
    crossing_bytes: Callable[[int], int],
    metas: dict[fx.Node, ValueMeta],
) -> list[list[fx.Node]]:
    """Split a block's nodes where no more bytes cross than at the block's input.

    A cut is placed before a node when the part before it already runs one of
    the block's child modules, a child module still follows, and the values
    crossing there are tensors no larger in total than the block's input.
    """
    limit = crossing_bytes(pos[nodes[0]])
    # a check torch.export records (the dtype assert of a ``.to()``) runs no child: a part of checks alone would be a
    # piece with no operation (every HF Llama layer had two, "input_layernorm" and "post_attention_layernorm", whose
    # norms ran in the next piece) and a stage of such pieces none at all
    kids = [None if _is_check(n) else _child_of(n, block) for n in nodes]
    child_after = [False] * (len(nodes) + 1)
    for i in range(len(nodes) - 1, -1, -1):
        child_after[i] = child_after[i + 1] or kids[i] is not None
    parts: list[list[fx.Node]] = [[]]
    child_in_part = False
    for i, node in enumerate(nodes):
        if i > 0 and child_in_part and child_after[i]:
            j = pos[node]
            if crossing_bytes(j) <= limit and all(metas[v].is_tensor_like for v in crossing(j) if v in metas):
                parts.append([])
                child_in_part = False
        parts[-1].append(node)
        child_in_part = child_in_part or kids[i] is not None
    return [p for p in parts if p]
