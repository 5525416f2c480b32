"""What the rendered torch.distributed.pipelining script (``train_torch.py``) imports.

The script holds the readable outline of a training run; the pieces that are
the same for every plan live here:

- :func:`parse_args`: the training-script contract's flags.
- :func:`init_distributed`: the process groups. Global rank =
  ``(pipeline_rank * dp + dp_index) * tp + tp_index``; one pipeline group per
  data-parallel replica, one data-parallel group per pipeline rank.
- :class:`StageModule` / :class:`PlannedStage`: a planned stage as the module a
  ``PipelineStage`` runs (mixed precision by autocast, optional recomputation
  with ``torch.utils.checkpoint``).
- :func:`make_schedule` and :func:`check_schedule`: the torch schedule class
  named in plan.json, checked action by action against the planner's own IR.
- :class:`GradientSync`: tied-parameter sums across stages, the data-parallel
  average (an explicit all-reduce of every local gradient, not DDP), fp16
  overflow checks.

Gradient scaling: schedules are built with ``scale_grads=False`` and the
gradients divided once by ``num_microbatches * dp`` after the reductions, so a
parameter used by two stages of one rank (a tied embedding under a V schedule)
is scaled once, not once per stage as torch's per-stage scaling would.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import operator
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining._backward import stage_backward_weight
from torch.utils.checkpoint import checkpoint

from planner.runners.contract import PlanChanged, contract_parser, read_plan  # noqa: F401 (the rendered script calls rt.read_plan)
from planner.runners.reference import LossScaler, autocast
from planner.runtime import PlannedModel
from planner.solve.schedules import SCHEDULE_INFO, build_schedule, to_torch_order


class ScheduleMismatch(RuntimeError):
    """torch's schedule (or plan.json) does not run the order the planner planned."""


# ----------------------------------------------------------------------------- arguments


def parse_args(argv: Sequence[str] | None, default_plan: str | Path) -> argparse.Namespace:
    """The training-script contract's flags."""
    return contract_parser("Pipeline-parallel training with torch.distributed.pipelining, as planned.", default_plan).parse_args(argv)


# ----------------------------------------------------------------------------- topology


@dataclass(frozen=True)
class Topology:
    """Where a global rank sits: rank = (pipe_rank * dp + dp_index) * tp + tp_index."""

    pp: int
    dp: int
    tp: int
    rank: int

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def pipe_rank(self) -> int:
        return self.rank // (self.dp * self.tp)

    @property
    def dp_index(self) -> int:
        return (self.rank // self.tp) % self.dp

    def global_rank(self, pipe_rank: int, dp_index: int, tp_index: int = 0) -> int:
        return (pipe_rank * self.dp + dp_index) * self.tp + tp_index

    def pipeline_groups(self) -> list[list[int]]:
        """Global ranks of each data-parallel replica's pipeline, in pipeline order."""
        return [[self.global_rank(r, d) for r in range(self.pp)] for d in range(self.dp)]

    def data_parallel_groups(self) -> list[list[int]]:
        """Global ranks holding the same pipeline rank, one list per pipeline rank."""
        return [[self.global_rank(r, d) for d in range(self.dp)] for r in range(self.pp)]


@dataclass
class Distributed:
    topo: Topology
    device: torch.device
    pp_group: Any
    dp_group: Any


def init_distributed(plan: dict[str, Any], device: torch.device) -> Distributed:
    """Join the job started by torchrun (RANK, WORLD_SIZE, LOCAL_RANK) and build the pp and dp groups."""
    lay = plan["layout"]
    if int(lay["tp"]) != 1:
        raise ValueError(f"plan.json has tp={lay['tp']}; torch.distributed.pipelining runs without tensor parallelism here")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    topo = Topology(int(lay["pp"]), int(lay["dp"]), 1, rank)
    if world != topo.world_size:
        raise ValueError(f"the plan needs {topo.world_size} processes (pp {topo.pp} x dp {topo.dp}), this job has {world}")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    pp_group, _ = dist.new_subgroups_by_enumeration(topo.pipeline_groups())
    dp_group, _ = dist.new_subgroups_by_enumeration(topo.data_parallel_groups())
    return Distributed(topo, device, pp_group, dp_group)


def local_stage_ids(plan: dict[str, Any], pipe_rank: int) -> list[int]:
    """Global indices of the stages plan.json places on ``pipe_rank``, in model order."""
    return [j for j, s in enumerate(plan["stages"]) if int(s["rank"]) == pipe_rank]


def recompute_mode(plan: dict[str, Any]) -> tuple[bool, str | None]:
    """(checkpoint every piece?, a note to print): ``full`` -> True; ``selective`` has no generic equivalent -> False."""
    mode = plan["layout"].get("recompute", "none")
    if mode == "full":
        return True, None
    if mode == "selective":
        return False, (
            "plan.json asks for selective recomputation, which has no generic torch equivalent "
            "(it is Megatron's attention-only recompute); running without recomputation: activation memory "
            "will be higher than planned."
        )
    return False, None


# ----------------------------------------------------------------------------- stages


class StageModule(nn.Module):
    """One planned stage as a module: takes the values crossing its input cut, returns those of its output cut.

    Mixed precision: the forward runs under autocast (bf16/fp16) over the fp32
    master weights. ``recompute=True`` runs each piece under
    ``torch.utils.checkpoint`` (non-reentrant): only the values crossing the
    cuts between pieces are kept, the rest is recomputed in the backward.
    ``clone_outputs=True`` (zero-bubble schedules) returns copies of the
    tensors crossing the output cut: torch's input-gradient pass detaches a
    stage's outputs in place (``stage_backward_input``), which breaks the later
    weight-gradient pass when an output is also used inside the stage (a skip
    connection read by a later layer of the same stage, or a value passed
    through unchanged); the copy costs one cut's bytes per micro-batch in flight.
    """

    def __init__(
        self,
        planned: PlannedModel,
        model: nn.Module,
        stage: int,
        precision: str,
        device: torch.device,
        recompute: bool = False,
        clone_outputs: bool = False,
    ):
        super().__init__()
        self.stage_index = stage
        self.precision, self.device_type, self.recompute = precision, device.type, recompute
        planned.check_sendable()
        start, stop = planned.bounds[stage], planned.bounds[stage + 1]
        self.piece_range = (start, stop)
        self.num_stages = planned.num_stages
        self.clone_outputs = clone_outputs and stage < planned.num_stages - 1
        self.last_output: FlatOutput | None = None
        body = planned.stage(model, stage)
        self.written_inputs = written_placeholders(body.gm)
        lg = planned.layer_graph
        floats = [any(d.is_floating_point for _, d, _ in m.tensors) if (m := lg.metas.get(n)) is not None else True for n in lg.boundaries[start]]
        #: weights this stage reads on values that come from none of the activations it receives: torch's split backward
        #: cannot reach them, so this stage runs its whole backward in the input-gradient pass (PlannedStage)
        self.weights_off_path = weights_off_the_gradient_path(body.gm, floats) if stage > 0 else []
        if recompute:
            self.pieces = nn.ModuleList(planned.piece(model, i) for i in range(start, stop))
        else:
            self.body = body

    def forward(self, *args: Any) -> Any:
        if self.stage_index > 0:
            # received values are leaves that require grad: one the stage writes in place (ResNet's `hidden += residual`)
            # runs on a copy; the gradients sent back are contiguous (torch sizes its receive buffers from their strides,
            # and gloo and NCCL send contiguous tensors only)
            args = tuple(_received(a, i in self.written_inputs) for i, a in enumerate(args))
        with autocast(self.precision, torch.device(self.device_type)):
            if not self.recompute:
                out = self.body(*args)
            else:
                out = args
                for piece in self.pieces:
                    values = out if isinstance(out, tuple) else (out,)
                    out = checkpoint(piece, *values, use_reentrant=False)
        if self.stage_index == self.num_stages - 1:
            # the model's own output (a ModelOutput, dict, tuple): torch's stages take tensors only, the loss
            # function gets the structure back (LossFunction)
            flat = FlatOutput.of(out)
            self.last_output = flat
            return flat.tensors if flat.spec is not None else out
        # sends need contiguous tensors (a permuted activation is not); zero bubble needs copies (see above)
        outs = out if isinstance(out, tuple) else (out,)
        outs = tuple(_send_ready(t, self.clone_outputs) for t in outs)
        return outs if isinstance(out, tuple) else outs[0]


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g.contiguous()


def _received(t: Any, written: bool) -> Any:
    """A stage input as the stage reads it: its gradient made contiguous, and a copy when the stage writes it."""
    if not isinstance(t, torch.Tensor) or not t.requires_grad:
        return t.clone() if written and isinstance(t, torch.Tensor) else t
    t = _ContiguousGrad.apply(t)
    return t.clone() if written else t


def weights_off_the_gradient_path(gm: torch.fx.GraphModule, differentiable: Sequence[bool]) -> list[str]:
    """Parameters of ``gm`` read by a node that depends on none of its differentiable inputs (``differentiable[i]``:
    placeholder i carries floating-point activations): a text tower fed by token ids beside an image path (CLIP), a
    scale read from a weight alone. torch's split backward (stage_backward_input / stage_backward_weight) finds a
    stage's weights through the nodes on its received activations' paths, and loses or repeats the others' gradients
    (its own code says so for the first stage, whose inputs need no gradient, and runs that one whole)."""
    params = {name for name, _ in gm.named_parameters()}
    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    downstream = {n for n, d in zip(places, differentiable) if d}
    alone: list[str] = []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if any(a in downstream for a in node.all_input_nodes):
            downstream.add(node)
            continue
        reads = [str(a.target) for a in node.all_input_nodes if a.op == "get_attr" and str(a.target) in params]
        if node.op == "call_module":
            reads += [f"{node.target}.{n}" for n, _ in gm.get_submodule(str(node.target)).named_parameters()]
        alone += [r for r in reads if r not in alone]
    return alone


def _no_weight_pass() -> Callable[[], None]:
    """A ``dw_builder`` whose weight pass does nothing: the stage's input-gradient pass ran its whole backward."""
    return lambda: None


#: tensor methods and functions whose result shares the memory of their first argument (a view or the tensor itself)
_VIEW_METHODS = frozenset(
    "view view_as reshape reshape_as flatten unflatten transpose permute squeeze unsqueeze expand expand_as narrow select "
    "t T mT swapaxes swapdims movedim unfold chunk split unbind tensor_split __getitem__ contiguous detach as_strided "
    "diagonal real imag".split()
)
_VIEW_FUNCTIONS = frozenset(
    (torch.flatten, torch.reshape, torch.transpose, torch.permute, torch.squeeze, torch.unsqueeze, torch.narrow, torch.select,
     torch.t, torch.chunk, torch.split, torch.unbind, torch.tensor_split, torch.movedim, torch.swapaxes, torch.swapdims,
     torch.detach, torch.diagonal, operator.getitem)
)  # fmt: skip


def _aliases_first_argument(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Whether ``node``'s result may share memory with its first argument: an aten view (a return the schema aliases
    without writing), a view method or function, or a module that returns its input (nn.Identity: MobileOne's disabled
    squeeze-excitation) or a view of it (nn.Flatten, nn.Unflatten)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return any(r.alias_info is not None and not r.alias_info.is_write for r in target._schema.returns)
    if node.op == "call_method":
        return str(target) in _VIEW_METHODS
    if node.op == "call_function":
        return target in _VIEW_FUNCTIONS
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(target)), (nn.Identity, nn.Flatten, nn.Unflatten))
    return False


def written_placeholders(gm: torch.fx.GraphModule) -> frozenset[int]:
    """Positions of the inputs of ``gm`` an operator writes in place, directly or through a view or alias of them
    (nn.Identity, ``x.view(...)``): an aten overload whose schema marks the argument written (``add_``, ``relu_``), an
    in-place tensor method, or ``inplace=True``."""
    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    alias_of: dict[torch.fx.Node, int] = {p: i for i, p in enumerate(places)}
    out: set[int] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        written: list[Any] = []
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            for i, a in enumerate(target._schema.arguments):
                if a.alias_info is not None and a.alias_info.is_write:
                    written.append(node.args[i] if i < len(node.args) else node.kwargs.get(a.name))
        elif node.op == "call_method" and isinstance(target, str) and target.endswith("_") and not target.startswith("_"):
            written.append(node.args[0])
        elif node.kwargs.get("inplace") is True or (node.op == "call_module" and getattr(gm.get_submodule(str(target)), "inplace", False) is True):
            written.append(node.args[0] if node.args else None)
        out.update(alias_of[w] for w in written if isinstance(w, torch.fx.Node) and w in alias_of)
        first = node.args[0] if node.args else None
        if isinstance(first, torch.fx.Node) and first in alias_of and _aliases_first_argument(gm, node):
            alias_of[node] = alias_of[first]
    return frozenset(out)


def _send_ready(t: Any, clone: bool) -> Any:
    """A tensor as a stage sends it: contiguous, and a copy of its own when ``clone``."""
    if not isinstance(t, torch.Tensor):
        return t
    if clone:
        return t.clone(memory_format=torch.contiguous_format)
    return t.contiguous()


@dataclass
class FlatOutput:
    """The last stage's output as the tensors torch's PipelineStage accepts, and how to rebuild the model's own.

    ``spec`` is None when the output already is a tensor or a tuple of tensors;
    otherwise (a ModelOutput, a dict, nested or with non-tensor leaves) it is
    the pytree spec, ``leaves`` the flat leaves with tensors at ``positions``.
    """

    tensors: tuple[torch.Tensor, ...]
    spec: Any = None
    leaves: tuple[Any, ...] = ()
    positions: tuple[int, ...] = ()

    @classmethod
    def of(cls, out: Any) -> FlatOutput:
        if isinstance(out, torch.Tensor):
            return cls((out,))
        if type(out) is tuple and all(isinstance(t, torch.Tensor) for t in out):
            return cls(out)
        leaves, spec = torch.utils._pytree.tree_flatten(out)
        positions = tuple(i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor))
        return cls(tuple(leaves[i] for i in positions), spec, tuple(leaves), positions)

    def rebuild(self, tensors: Any) -> Any:
        """The model's output structure around ``tensors`` (what the stage returned); unchanged when ``spec`` is None."""
        if self.spec is None:
            return tensors
        leaves = list(self.leaves)
        for i, t in zip(self.positions, tensors if isinstance(tensors, (tuple, list)) else (tensors,)):
            leaves[i] = t
        return torch.utils._pytree.tree_unflatten(leaves, self.spec)


def splits_backward(schedule: str) -> bool:
    """True for schedules that split the backward into input- and weight-gradient passes (zero bubble)."""
    return SCHEDULE_INFO[schedule].split_backward


class PlannedStage(PipelineStage):
    """A ``PipelineStage`` whose start-up shape inference leaves no trace in the model.

    On the first step torch runs each stage once on placeholder inputs to learn
    the shapes it will send and receive (under a forked RNG). Here those
    placeholders are zeros, not uninitialised memory (integer indices stay in
    range, no NaNs), and the stage's buffers (BatchNorm running statistics)
    are put back afterwards, so training starts from the state a
    single-process run has. (Overrides private hooks of torch 2.13's
    PipelineStage; on a torch without them the stage behaves as torch's own.)
    """

    _saved_buffers: dict[tuple[str, str], tuple[nn.Module, torch.Tensor, torch.Tensor]] | None = None

    def __init__(self, submodule: nn.Module, *args: Any, **kwargs: Any):
        # a stage whose weights torch's split backward cannot all reach (StageModule.weights_off_path) runs its whole
        # backward when a zero-bubble schedule asks for the input gradients, and nothing in the weight pass
        # (PipelineStage's dw_builder); its gradients are then exact, at the cost of that stage's bubble
        if getattr(submodule, "weights_off_path", None) and kwargs.get("dw_builder") is None:
            kwargs["dw_builder"] = _no_weight_pass
        super().__init__(submodule, *args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict[str, Any], last_backward: bool = False) -> Any:
        """torch's weight pass, keeping the autograd graph until the pass ends. torch computes the weight gradients one
        parameter group at a time and frees the graph after each; where two groups' paths to their weights share
        nodes (EfficientViT's attention biases, CoaT's shared position encodings, both under zero-bubble schedules)
        the second group then found the first's saved tensors freed ("Trying to backward through the graph a second
        time"). The graph goes with the pass's parameter groups once it returns. (No DDP here: the gradients are
        reduced by GradientSync.)"""
        if backward_type == "weight" and not isinstance(self.submod, torch.nn.parallel.DistributedDataParallel):
            return stage_backward_weight(self.submod.parameters(), bwd_kwargs["param_groups"], retain_graph=True), None
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)

    def _to_tensor(self, arg: Any) -> torch.Tensor:
        t = super()._to_tensor(arg)
        if not isinstance(arg, torch.Tensor):
            with torch.no_grad():
                t.zero_()
        return t

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        self._saved_buffers = {}
        for path, owner in self.submod.named_modules():
            for name, b in owner._buffers.items():
                if b is not None:
                    self._saved_buffers[(path, name)] = (owner, b, b.detach().clone())
        return super()._forward_metadata_inference(*args, **kwargs)

    def _post_metadata_inference_cleanup(self) -> None:
        """Put every buffer back as it was before the shape inference: its values, and the tensor itself where the
        model replaced it (ConViT's attention computes its relative position indices on its first call and assigns
        them to a buffer; writing the initial (1, 1, 1, 3) zeros into the new (1, N, N, 3) tensor left zeros of the
        right shape, never recomputed, and the run 4.7e-4 off one process)."""
        super()._post_metadata_inference_cleanup()
        saved, self._saved_buffers = self._saved_buffers, None
        if not saved:
            return
        with torch.no_grad():  # after the inference backward: nothing saved for autograd still needs these
            for (_, name), (owner, tensor, values) in saved.items():
                if owner._buffers.get(name) is not tensor:
                    owner._buffers[name] = tensor
                if not torch.equal(tensor, values):
                    tensor.copy_(values)


def place_on_device(model: nn.Module, modules: Sequence[nn.Module], device: torch.device) -> None:
    """Move this rank's stages to ``device`` and release the weights of every other stage.

    Parameters keep their identity (``Module.to`` moves them in place), so a
    weight shared by two local stages stays one parameter.
    """
    local = {id(p) for m in modules for p in m.parameters()}
    for m in modules:
        m.to(device)
    with torch.no_grad():
        for p in model.parameters():
            if id(p) not in local:
                p.data = torch.empty(0, dtype=p.dtype)


def unique_parameters(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    """Trainable parameters of the local stages, each once, in a deterministic order."""
    seen: set[int] = set()
    out: list[nn.Parameter] = []
    for m in modules:
        for p in m.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


# ----------------------------------------------------------------------------- schedule


def schedule_class(name: str) -> type[Any]:
    """The torch schedule class that runs planner schedule ``name`` (planner.solve.schedules.SCHEDULE_INFO)."""
    info = SCHEDULE_INFO.get(name)
    if info is None or info.torch_class is None:
        raise ScheduleMismatch(f"schedule {name!r} is not run by torch.distributed.pipelining")
    cls: type[Any] = getattr(torch_schedules, info.torch_class)
    return cls


class LossFunction:
    """The model file's loss for the schedule: optional target, times the fp16 loss scale.

    ``last`` is the local StageModule of the last stage, if any: its flattened
    output is rebuilt into the model's own structure (a ModelOutput's
    ``.logits``) before the model file's loss_fn sees it.
    """

    def __init__(self, planned: PlannedModel, has_target: bool, scaler: LossScaler, last: StageModule | None = None):
        self.planned, self.has_target, self.scaler, self.last = planned, has_target, scaler, last

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        if self.last is not None and self.last.last_output is not None:
            output = self.last.last_output.rebuild(output)
        loss = self.planned.loss(output, target if self.has_target else None)
        return loss * self.scaler.scale if self.scaler.enabled else loss


def make_schedule(name: str, stages: Sequence[PipelineStage], num_microbatches: int, loss_fn: Callable[..., torch.Tensor]) -> Any:
    """The torch schedule object over this rank's stages (gradients left unscaled: see the module docstring)."""
    cls = schedule_class(name)
    if issubclass(cls, torch_schedules.PipelineScheduleSingle):
        if len(stages) != 1:
            raise ScheduleMismatch(f"{cls.__name__} runs one stage per rank, plan.json puts {len(stages)} on this rank")
        return cls(stages[0], n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(list(stages), n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=False)


def torch_compute_order(order: dict[int, list[Any]] | None, rank: int) -> list[str]:
    """One rank's compute actions of a torch ``pipeline_order`` spelled like ``3F0`` (overlapped pairs split)."""
    row: list[str] = []
    for a in (order or {}).get(rank, []):
        if a is None:
            continue
        if getattr(a, "sub_actions", None):
            row += [str(x) for x in a.sub_actions]
        elif a.is_compute_op:
            row.append(str(a))
    return row


def _shift_forwards(actions: list[str]) -> list[str]:
    out = []
    for a in actions:
        stage, kind, mb = _split_action(a)
        out.append(f"{stage}{kind}{mb + 1}" if kind == "F" else a)
    return out


def _split_action(a: str) -> tuple[int, str, int]:
    i = next(k for k, c in enumerate(a) if not c.isdigit())
    return int(a[:i]), a[i], int(a[i + 1 :])


def check_schedule(schedule: Any, stages: Sequence[PipelineStage], plan: dict[str, Any]) -> dict[int, list[str]]:
    """Compare torch's schedule with the planner's IR; raise ScheduleMismatch on any difference.

    Checks: plan.json's stage placement equals the IR's; the placement torch
    uses for communication equals it; every pipeline rank's compute actions in
    torch's ``pipeline_order`` (all ranks are in it, so every rank reaches the
    same verdict) equal the IR's, action by action. torch 2.13's Schedule1F1B
    numbers the last rank's forwards from 1 in ``pipeline_order`` only (its
    runtime runs 0..m-1, as tests/solve/test_schedules.py checks); that shift is
    accepted there. Returns the planned actions per rank.
    """
    lay = plan["layout"]
    pp, m, vp = int(lay["pp"]), int(lay["num_microbatches"]), int(lay["vp"])
    ir = build_schedule(lay["schedule"], pp, m, vp, int(lay.get("microbatch_group", 0)))
    ranks = [int(s["rank"]) for s in plan["stages"]]
    if ranks != list(ir.stage_to_rank):
        raise ScheduleMismatch(
            f"plan.json places stages on pipeline ranks {ranks}, but schedule {lay['schedule']!r} with pp={pp}, vp={vp} places them on {list(ir.stage_to_rank)}"
        )
    for st in stages:
        torch_map = [st.stage_index_to_group_rank[j] for j in range(st.num_stages)]
        if torch_map != ranks:
            raise ScheduleMismatch(f"torch's {type(schedule).__name__} places stages on ranks {torch_map}, the plan on {ranks}")
    planned = to_torch_order(ir)
    order = getattr(schedule, "pipeline_order", None)
    for rank in range(pp):
        expected, actual = planned[rank], torch_compute_order(order, rank)
        if actual == expected:
            continue
        if type(schedule) is torch_schedules.Schedule1F1B and rank == pp - 1 and actual == _shift_forwards(expected):
            continue
        first = next((i for i, (a, b) in enumerate(zip(actual, expected)) if a != b), min(len(actual), len(expected)))
        raise ScheduleMismatch(
            f"torch's {type(schedule).__name__} would run on pipeline rank {rank}: {' '.join(actual) or '(nothing)'}; "
            f"the plan ({lay['schedule']}, pp={pp}, m={m}, vp={vp}) runs: {' '.join(expected)} "
            f"(first difference at action {first}). Refusing to train a schedule that was not planned."
        )
    return planned


# ----------------------------------------------------------------------------- gradients


class GradientSync:
    """After a schedule step: sum tied-parameter gradients across the ranks holding them, average over dp.

    Tied parameters (``PlannedModel.tied_parameters``): stages on one rank
    share the parameter object, so their gradients already add up; across
    pipeline ranks each rank holds a copy and the copies' gradients are summed
    by an all-reduce within the data-parallel replica. Then every local
    gradient is summed over the data-parallel group (one flattened all-reduce)
    and divided by ``num_microbatches * dp * loss_scale``.
    """

    def __init__(self, planned: PlannedModel, model: nn.Module, plan: dict[str, Any], env: Distributed, params: Sequence[nn.Parameter]):
        self.env, self.params = env, list(params)
        lay = plan["layout"]
        self.divisor = int(lay["num_microbatches"]) * env.topo.dp
        stage_rank = [int(s["rank"]) for s in plan["stages"]]
        self.tied: list[tuple[str, nn.Parameter, Any]] = []
        self.tied_names: list[tuple[str, list[int]]] = []
        for name, users in planned.tied_parameters(model):
            ranks = sorted({stage_rank[s] for s in users})
            self.tied_names.append((name, ranks))
            if len(ranks) < 2:
                continue  # one rank holds every user: one parameter object, gradients already summed
            lists = [[env.topo.global_rank(r, d) for r in ranks] for d in range(env.topo.dp)]
            group, _ = dist.new_subgroups_by_enumeration(lists)  # every rank takes part in creating groups
            if env.topo.pipe_rank in ranks:
                self.tied.append((name, model.get_parameter(name), group))

    def reduce(self, loss_scale: float = 1.0) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for _, p, group in self.tied:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
        grads = [cast(torch.Tensor, p.grad) for p in self.params]  # every one set above
        if self.env.topo.dp > 1 and grads:
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.env.dp_group)
            for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)
        for g in grads:
            g.div_(self.divisor * loss_scale)

    def found_inf(self) -> bool:
        """True if any rank's gradients hold inf/NaN (fp16 overflow): every rank then skips the step."""
        flag = torch.tensor([0.0 if all(torch.isfinite(cast(torch.Tensor, p.grad)).all() for p in self.params) else 1.0], device=self.env.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def step_loss(losses: list[torch.Tensor], env: Distributed, loss_scale: float) -> float:
    """Mean loss over the global batch from the micro-batch losses of one replica (ranks holding the last stage)."""
    local = sum(float(l.detach()) for l in losses) / (len(losses) * loss_scale)
    if env.topo.dp == 1:
        return local
    t = torch.tensor([local], dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=env.dp_group)
    return float(t.item()) / env.topo.dp


# ----------------------------------------------------------------------------- outputs


def run_main(main: Callable[[], int]) -> int:
    """Run the script's ``main``: a plan that does not fit the script or the model exits 2 with one clear line."""
    from planner.errors import PlannerError
    from planner.runtime import PlanMismatch

    try:
        return main()
    except (PlanChanged, ScheduleMismatch, PlanMismatch, PlannerError) as e:
        rank = os.environ.get("RANK", "0")
        print(f"error (rank {rank}): {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 2


class StepTimer:
    """Wall-clock time of each step (the device synchronised at both ends), seconds."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: list[float] = []

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        self._sync()
        t0 = time.perf_counter()
        yield
        self._sync()
        self.times.append(time.perf_counter() - t0)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def device_name(device: torch.device) -> str:
    """The device's name as the driver reports it (``NVIDIA H100 80GB HBM3``), or ``cpu``."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def write_stats(pattern: str, env: Distributed, stage_ids: Sequence[int], plan: dict[str, Any], times: Sequence[float]) -> None:
    """The contract's per-rank stats file (``{rank}`` in ``pattern`` replaced by the global rank)."""
    cuda = env.device.type == "cuda"
    write_json(
        pattern.replace("{rank}", str(env.topo.rank)),
        {
            "rank": env.topo.rank,
            "pipe_rank": env.topo.pipe_rank,
            "dp_index": env.topo.dp_index,
            "stages": list(stage_ids),
            "pieces": [list(plan["stages"][j]["pieces"]) for j in stage_ids],
            "step_times_s": [round(t, 6) for t in times],
            "peak_memory_bytes": torch.cuda.max_memory_allocated(env.device) if cuda else None,
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(env.device) if cuda else None,
            "device_name": device_name(env.device),
        },
    )
