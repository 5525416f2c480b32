"""What the rendered training scripts import: the planned stages of the user's model, on real weights.

The scripts rebuild the model from the user's file, re-trace it on the meta
device with the options recorded in plan.json, check that the pieces are the
ones the plan was made for (same names, same count: a changed model file
fails loudly instead of training a different split), and wrap the planned
piece ranges of the real model as stage modules. Parameters keep their model
paths inside each stage (``h.3.attn.c_attn.weight``).

A torch.export graph is static: devices, dtypes, sizes and constants of the
traced run are baked into it (``arange(16, device=meta)``, dtype asserts,
dropout probabilities). For such a model the scripts trace again on the real
model as it will train (:meth:`PlannedModel.for_run`: its weights and dtype,
dropout as configured, the planned micro-batch, fake inputs so nothing is
computed), move what the graph pins to the tracing device onto the run
device, and check the pieces against plan.json again.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import random
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from planner.model.analyze import torch_dtype
from planner.model.load import ModelFile, load_model_file
from planner.model.losses import choose_loss, loss_function
from planner.model.trace import LayerGraph, Piece, PiecesModule, _free_nodes, _get_path, build_layer_graph
from planner.model_ref import resolve_ref
from planner.records import TrainedLoss


class PlanMismatch(RuntimeError):
    """The model traced at run time does not have the pieces the plan was made for."""


@dataclass
class PlannedModel:
    """The user's model, traced as at planning time, with the plan's stage boundaries."""

    model_file: ModelFile
    layer_graph: LayerGraph
    bounds: list[int]  # piece index where each stage starts, then the piece count
    piece_names: list[str]
    trace_options: dict[str, Any] = field(default_factory=dict)  # leaf_classes, tracer, sub_block_cuts
    micro_batch: int = 1
    #: the micro-batch an fx plan was traced at (its costs' batch): fx graphs hold the batch symbolically, but which
    #: shape values the tracer fixes as constants (and so where pieces may be cut) is read off a trace at this batch
    #: and at twice it, as at planning
    trace_batch: int = 2
    #: the loss plan.json says is trained (None in a plan made before it was recorded: chosen on the first output)
    trained_loss: TrainedLoss | None = None

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    def build(self, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The real model, initialised from ``seed`` (the same weights on every rank)."""
        seed_everything(seed)
        model: nn.Module = self.model_file.call("build_model")
        return model.to(dtype=dtype)

    def for_run(self, model: nn.Module, device: torch.device | str) -> PlannedModel:
        """This plan traced on ``model`` as it will train, for a run on ``device``.

        An export-traced plan, and an fx-traced one whose graph bakes a random
        op's probability (:func:`bakes_random_ops`: ``F.dropout(x, p=self.drop_rate)``
        records 0.2 as a constant, where a dropout module is called by name and
        reads its ``p`` when it runs) or holds tensor constants of the meta
        model (:func:`meta_constants`: torchvision's MaxViT), is traced again on ``model`` (its weights,
        dtype and dropout settings; call after casting it and after
        ``--no-dropout``) at the planned micro-batch (an fx plan: at the batch it
        was traced at and twice it, symbolically, its shapes run in fake mode)
        with fake inputs (no computation), the graph's device arguments and constants moved from the
        weights' device to ``device`` and its metadata asserts dropped (autocast
        changes dtypes the trace saw). The pieces are checked against the plan
        again (:class:`PlanMismatch`). Other fx-traced plans are returned as they are.
        """
        gm = self.layer_graph.gm
        if self.layer_graph.tracer != "export" and not bakes_random_ops(gm) and not meta_constants(gm, model):
            return self
        device = torch.device(device)
        source = next((t.device for t in model.parameters()), torch.device("cpu"))
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
        fx_plan = self.layer_graph.tracer == "fx"
        batches = (self.trace_batch, 2 * self.trace_batch) if fx_plan else (self.micro_batch,)
        with torch.random.fork_rng(devices=[]):
            examples = [self.model_file.inputs_meta(b) for b in batches]
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            inputs = [
                tuple(torch.empty(t.shape, dtype=dtype if t.is_floating_point() and dtype is not None else t.dtype, device=source) for t in example)
                for example in examples
            ]
        if fx_plan:  # traced symbolically on the real model (its constants real: MaxViT's), shapes run in fake mode
            traced = build_layer_graph(model, inputs[0], inputs[1], **(self.trace_options | {"tracer": "fx"}), fake_mode=mode)
        else:
            with mode:
                traced = build_layer_graph(model, inputs[0], None, **self.trace_options)
        lg = impose_pieces(self.layer_graph, traced, self.model_file.path.name)
        retarget(lg, source, device)
        run = dataclasses.replace(self, layer_graph=lg)
        run.check_sendable()
        return run

    def check_sendable(self) -> None:
        """Refuse a stage boundary crossed by a non-tensor value (a shape, an int): stages exchange tensors only.

        The tracer keeps such values inside one piece; a plan whose stage cut
        they cross (an edited or foreign plan.json) is refused here, naming
        the value, instead of failing inside a send.
        """
        lg = self.layer_graph
        for cut in self.bounds[1:-1]:
            for node in lg.boundaries[cut]:
                meta = lg.metas.get(node)
                if meta is not None and not meta.is_tensor_like:
                    raise PlanMismatch(
                        f"value {node.name} crossing the stage boundary before piece {cut} ({self.piece_names[cut]}) is not a "
                        "tensor; stages exchange tensors only. Re-run `planner plan` for this model (its pieces keep such "
                        "values inside one stage)."
                    )

    def stage(self, model: nn.Module, stage: int) -> PiecesModule:
        """The module running planned stage ``stage`` of ``model`` (parameters shared with ``model``)."""
        return self.layer_graph.stage_module(self.bounds[stage], self.bounds[stage + 1], root=model)

    def piece(self, model: nn.Module, index: int) -> PiecesModule:
        """One piece as a module: DeepSpeed's PipelineModule takes the pieces as its layer list."""
        return self.layer_graph.stage_module(index, index + 1, root=model)

    def stage_of_piece(self, index: int) -> int:
        return max(s for s in range(self.num_stages) if self.bounds[s] <= index)

    def tied_parameters(self, model: nn.Module) -> list[tuple[str, list[int]]]:
        """Trainable parameters used by more than one stage, with those stages: their gradients must be summed across
        them. A frozen one (RoFormer's sinusoidal position table, requires_grad False) has no gradient to sum; every
        rank builds it alike from the seed."""
        users: dict[int, tuple[str, set[int]]] = {}
        for s in range(self.num_stages):
            mod = self.stage(model, s)
            for name, p in mod.gm.named_parameters(remove_duplicate=True):
                if p.requires_grad:
                    users.setdefault(id(p), (name, set()))[1].add(s)
        return sorted((name, sorted(st)) for name, st in users.values() if len(st) > 1)

    def example_batch(self, batch_size: int, seed: int) -> tuple[tuple[torch.Tensor, ...], Any]:
        """Deterministic (inputs, target) of ``batch_size`` samples from the model file's example functions."""
        seed_everything(seed)
        inputs = self.model_file.example_inputs(batch_size)
        target = self.model_file.call("example_target", batch_size) if self.model_file.has("example_target") else None
        return tuple(inputs), target

    def loss(self, output: Any, target: Any) -> torch.Tensor:
        """The loss plan.json says is trained (planner.model.losses.choose_loss): the model file's loss_fn, the loss
        the model returns, or the default loss."""
        if self.trained_loss is None:
            self.trained_loss = choose_loss(self.model_file, output)
        return loss_function(self.model_file, self.trained_loss, target)(output)


#: functions and tensor methods of random ops whose probability or range an fx trace records as a constant
_RANDOM_OPS = re.compile(r"(dropout|bernoulli|rand|normal_|uniform_|exponential_|geometric_|cauchy_|log_normal_|multinomial)")


def bakes_random_ops(gm: fx.GraphModule) -> bool:
    """Whether an fx graph calls a random op as a function or a tensor method (``F.dropout``, ``x.bernoulli_``, timm's
    and torchvision's stochastic depth): its arguments were read off the model when it was traced, so a model whose
    dropout is switched off afterwards (``--no-dropout``) still runs it. Dropout modules, called by name, are not."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and _RANDOM_OPS.search(getattr(node.target, "__name__", "")):
            return True
        if node.op == "call_method" and _RANDOM_OPS.search(str(node.target)):
            return True
    return False


def meta_constants(gm: fx.GraphModule, model: nn.Module) -> list[str]:
    """The tensors an fx graph traced on the meta model holds as constants of its own (``_tensor_constant0``: a tensor
    the tracer met that is no parameter or buffer of the model, as MaxViT's and Swin V2's relative position indices),
    which ``model`` has no path to: they have no data, and a stage holding them cannot be moved or run."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        try:
            _get_path(model, str(node.target))
            continue  # the model's own parameter, buffer or attribute: the stage reads the real one
        except AttributeError:
            value = getattr(gm, str(node.target), None)
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            out.append(str(node.target))
    return out


def retarget(lg: LayerGraph, source: torch.device, device: torch.device) -> None:
    """Point a static graph traced on ``source`` at ``device``, in place.

    Device arguments equal to ``source`` (``arange(..., device=cpu)``, ``.to(cpu)``)
    become ``device`` and tensor constants lifted into the graph module move
    there; ``aten._assert_tensor_metadata`` nodes (checks of the traced dtype
    and device, with no users) are removed from the graph and the pieces.
    """
    assert_op = torch.ops.aten._assert_tensor_metadata.default
    gm = lg.gm
    dropped = {n for n in gm.graph.nodes if n.op == "call_function" and n.target is assert_op and not n.users}
    for piece in lg.pieces:
        piece.nodes = [n for n in piece.nodes if n not in dropped]

    def move(value: Any) -> Any:
        return device if isinstance(value, torch.device) and value.type == source.type and value.index == source.index else value

    for node in list(gm.graph.nodes):
        if node in dropped:
            gm.graph.erase_node(node)
            continue
        node.args = fx.node.map_aggregate(node.args, move)
        node.kwargs = fx.node.map_aggregate(node.kwargs, move)
    if device != source:
        params = {id(t) for t in gm.parameters()} | {id(t) for t in gm.buffers()}
        for name in dir(gm):
            value = getattr(gm, name, None)
            if isinstance(value, torch.Tensor) and id(value) not in params and value.device == source:
                setattr(gm, name, value.to(device))
    gm.recompile()


#: names of the nodes a trace has or lacks with its tensors' strides (torch.export records a contiguous() only where
#: the input was not contiguous: a bf16 meta trace and an fp32 one can differ); they place no cut
_LAYOUT_NODE = re.compile(r"contiguous(_\d+)?$")
_NUMBER = re.compile(r"_\d+$")


def align_nodes(a: Sequence[str], b: Sequence[str]) -> dict[int, int]:
    """For node names ``a`` of one graph, the index in ``b`` (another trace of the same model) of each node both have.

    fx numbers the nodes of one op in order (add, add_1, ...), so a node only one trace has (a contiguous() that
    depends on strides, the random ops of a stochastic depth that --no-dropout switches off) shifts the names of
    the later nodes of that op. Names of ops the two graphs have equally many of are matched as they are
    (anchors, in order in both), except the stride-dependent contiguous: the two traces can have equally many of them
    in other places (BigBird's block-sparse attention); between two anchors the nodes are matched by op, in order (the
    longest common subsequence). Raises ValueError when the anchors are not in the same order in both graphs."""
    ca, cb = Counter(_NUMBER.sub("", n) for n in a), Counter(_NUMBER.sub("", n) for n in b)
    where = {n: j for j, n in enumerate(b)}
    anchors = [(i, where[n]) for i, n in enumerate(a) if n in where and ca[_NUMBER.sub("", n)] == cb[_NUMBER.sub("", n)] and not _LAYOUT_NODE.match(n)]
    if any(j1 <= j0 for (_, j0), (_, j1) in zip(anchors, anchors[1:])):
        raise ValueError("the graphs run their nodes in another order")
    out = dict(anchors)
    edges = [(-1, -1), *anchors, (len(a), len(b))]
    for (i0, j0), (i1, j1) in zip(edges, edges[1:]):
        ga, gb = [_NUMBER.sub("", n) for n in a[i0 + 1 : i1]], [_NUMBER.sub("", n) for n in b[j0 + 1 : j1]]
        if ga and gb:
            for m in difflib.SequenceMatcher(None, ga, gb, autojunk=False).get_matching_blocks():
                out.update((i0 + 1 + m.a + k, j0 + 1 + m.b + k) for k in range(m.size))
    return out


def impose_pieces(planned: LayerGraph, traced: LayerGraph, model_name: str) -> LayerGraph:
    """``traced``'s graph cut where ``planned`` was cut: the plan's pieces on a graph traced at run time.

    The tracer's sub-block cuts depend on byte counts, so a trace in another
    dtype can offer other cuts; the plan's own must run. Cut k is placed
    before the first node of planned piece k that the run-time graph has
    (nodes matched by :func:`align_nodes`: the graphs come from one model, but
    a few nodes may exist in one of them only, such as a stride-dependent
    ``contiguous`` or the random ops of a stochastic depth --no-dropout turns
    off; a piece of such nodes alone is empty at run time); every computing
    node of the run-time graph belongs to the piece whose cut precedes it, and
    the values crossing each cut are recomputed from the run-time graph (the
    same on every rank). Raises :class:`PlanMismatch` when the two graphs do
    not run their nodes in one order.
    """
    graph = traced.gm.graph
    free = _free_nodes(graph)
    compute = [n for n in graph.nodes if n.op not in ("placeholder", "output") and n not in free]
    pos = {n: i for i, n in enumerate(compute)}
    planned_free = _free_nodes(planned.gm.graph)
    names = [(k, n.name) for k, p in enumerate(planned.pieces) for n in p.nodes if n not in planned_free]
    try:
        match = align_nodes([n for _, n in names], [n.name for n in compute])
    except ValueError as e:
        raise PlanMismatch(f"{model_name}: {e} at run time than at planning; the model changed since planning. Re-run `planner plan` for this model.") from None
    firsts: list[int | None] = [None] * len(planned.pieces)
    for i, (k, name) in enumerate(names):
        if firsts[k] is None and i in match and not _LAYOUT_NODE.match(name):
            firsts[k] = match[i]
    # a piece none of whose nodes the run-time graph has is empty: its cut falls where the next placed piece starts
    starts, nxt = [0] * len(firsts), len(compute)
    for k in range(len(firsts) - 1, -1, -1):
        at = firsts[k]
        nxt = at if at is not None else nxt
        starts[k] = nxt
    starts[0] = 0
    bounds = starts + [len(compute)]
    pieces = [Piece(p.index, p.name, p.kind, p.block, compute[a:b], p.modules) for p, a, b in zip(planned.pieces, bounds, bounds[1:])]
    out_node = next(n for n in graph.nodes if n.op == "output")
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    end = len(compute)

    def last_use(v: fx.Node) -> int:
        """Index of the last computing node reading ``v`` (directly or through free nodes); ``end`` for the output."""
        uses = [-1]
        for u in v.users:
            if u is out_node:
                uses.append(end)
            elif u in free:
                uses.append(last_use(u))
            else:
                uses.append(pos[u])
        return max(uses)

    produced = {v: (pos[v] if v in pos else -1) for v in placeholders + compute}
    used_until = {v: last_use(v) for v in produced}
    boundaries = [[v for v in produced if produced[v] < k <= used_until[v]] for k in bounds[:-1]]
    boundaries[0] = [v for v in placeholders if used_until[v] >= 0]
    boundaries.append([v for v in out_node.all_input_nodes if v not in free])
    return dataclasses.replace(traced, pieces=pieces, boundaries=boundaries, cut_kinds=list(planned.cut_kinds), blocks=list(planned.blocks))


def _check_pieces(names: list[str], expected: list[str], model_name: str) -> None:
    if names == expected:
        return
    diff = next((i for i, (a, b) in enumerate(zip(names, expected)) if a != b), min(len(names), len(expected)))
    raise PlanMismatch(
        f"{model_name} now traces into {len(names)} pieces, the plan was made for {len(expected)}; "
        f"first difference at piece {diff}: {names[diff] if diff < len(names) else '(none)'} vs "
        f"{expected[diff] if diff < len(expected) else '(none)'}. Re-run `planner plan` for this model."
    )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def load_planned_model(plan: dict[str, Any] | str | Path, model_path: str | Path | None = None) -> PlannedModel:
    """Trace the user's model as recorded in ``plan`` (a plan.json dict or path) and check its pieces.

    Without ``model_path`` the model is the one plan.json names, relative to the plan's directory (as the planner
    records it); a plan given as a dict is resolved against the working directory."""
    base = Path.cwd()
    if isinstance(plan, dict):
        doc = plan
    else:
        p = Path(plan)
        doc = json.loads((p / "plan.json" if p.is_dir() else p).read_text())
        base = p if p.is_dir() else p.parent
    inputs = doc["inputs"]
    path = Path(model_path) if model_path else Path(resolve_ref(str(inputs["model_file"]), base))
    mf = load_model_file(path, inputs.get("model_args", {}))
    dtype = torch_dtype(inputs.get("dtype", "bf16"))
    meta = mf.build_meta(dtype)
    tracer = inputs.get("tracer_used", inputs.get("tracer", "auto"))
    # An fx graph is traced as at planning: at the batch its costs were traced at (two samples or more where the model
    # has BatchNorm, which refuses one in training mode) and at twice it, which tells the shape values fixed as
    # constants (a stage cannot receive a Python value; without them CSPNeXt's, XCiT's, FastViT's and LCNetV2's pieces
    # differed from the plan's). torch.export graphs are static: one is traced at the micro-batch the scripts run,
    # whose graph PlannedModel.for_run aligns with best; where its sub-block cuts differ from the plan's (Funnel's
    # tail), at the batch the plan was traced at, whose pieces are the plan's, and for_run places them on the run's graph
    micro_batch = int(doc["layout"]["micro_batch"])
    planned_batch = int(doc["model"].get("cost_micro_batch") or inputs.get("cost_micro_batch") or micro_batch)
    expected = list(doc["model"]["pieces"])
    options = {"leaf_classes": inputs.get("leaf", []), "tracer": tracer, "sub_block_cuts": inputs.get("sub_block_cuts", True)}
    mf.inputs_meta(planned_batch, dtype)  # tells whether the inputs are keyword ones (ModelFile.input_names)
    options["input_names"] = mf.input_names
    if tracer == "export":
        lg = build_layer_graph(meta, mf.inputs_meta(micro_batch, dtype), None, **options)
    else:
        lg = build_layer_graph(meta, mf.inputs_meta(planned_batch, dtype), mf.inputs_meta(2 * planned_batch, dtype), **options)
    names = [p.name for p in lg.pieces]
    if tracer == "export" and names != expected and planned_batch != micro_batch:
        at_plan = build_layer_graph(meta, mf.inputs_meta(planned_batch, dtype), None, **options)
        if [p.name for p in at_plan.pieces] == expected:
            lg, names = at_plan, expected
    _check_pieces(names, expected, path.name)
    bounds: list[int] = [s["pieces"][0] for s in doc["stages"]] + [doc["stages"][-1]["pieces"][1]]
    recorded = doc["model"].get("loss")
    trained = TrainedLoss.from_dict(recorded) if isinstance(recorded, dict) and "source" in recorded else None
    return PlannedModel(mf, lg, bounds, names, options, micro_batch, planned_batch, trained)
