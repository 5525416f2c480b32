"""What the rendered DeepSpeed script (``train_deepspeed.py``) imports.

The script holds the readable outline of a run; the parts that are the same
for every plan live here:

- :class:`PlannedPipelineModule`: a DeepSpeed ``PipelineModule`` whose layers
  are the planned pieces, cut exactly at the planned stage boundaries (DeepSpeed
  has no argument for explicit boundaries, so ``_partition_layers`` is
  overridden), whose tied parameters (a parameter used by pieces on several
  stages, e.g. GPT-2's ``wte.weight`` / ``lm_head.weight``) have their
  gradients summed across the stages that hold them, and whose activation
  checkpointing (``pipeline.activation_checkpoint_interval > 0``) runs per
  planned unit: one transformer block, or one piece outside the blocks.
- :func:`read_config`: ds_config.json, checked against plan.json's batch
  numbers and adapted to the precision a run actually uses (``--precision
  auto`` trains in fp32 on the CPU).
- :func:`init_distributed`: DeepSpeed's process groups without the C++
  shared-memory op that DeepSpeed otherwise compiles at start-up on the CPU.

Checked against deepspeed 0.19.8 (runtime/pipe/module.py, runtime/pipe/engine.py,
comm/torch.py).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.nn as nn
from deepspeed import comm as dist
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

from planner.engines.deepspeed.rules import precision_config
from planner.runners.contract import PlanChanged, contract_parser, read_plan  # noqa: F401 (the rendered script calls ds.read_plan)
from planner.runtime import PlannedModel

SHM_COMM_OP = "deepspeed_shm_comm"
HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # the dtype DeepSpeed casts parameters to


# ----------------------------------------------------------------------------- start-up


def parse_args(argv: Sequence[str] | None, here: Path) -> argparse.Namespace:
    """The training-script contract's flags, plus ``--ds-config``."""
    p = contract_parser("Pipeline-parallel training with DeepSpeed's PipelineEngine, as planned.", here / "plan.json")
    p.add_argument("--ds-config", default=str(here / "ds_config.json"), help="DeepSpeed config (default: the one beside this script)")
    return p.parse_args(argv)


def read_config(path: str | Path, plan: dict[str, Any], precision: str) -> dict[str, Any]:
    """ds_config.json for a run in ``precision``, refused when its batch numbers differ from plan.json's."""
    cfg = json.loads(Path(path).read_text())
    lay = plan["layout"]
    want = {
        "train_micro_batch_size_per_gpu": lay["micro_batch"],
        "gradient_accumulation_steps": lay["num_microbatches"],
        "train_batch_size": lay["micro_batch"] * lay["num_microbatches"] * lay["dp"],
    }
    bad = {k: (cfg.get(k), v) for k, v in want.items() if cfg.get(k) != v}
    if bad:
        detail = ", ".join(f"{k} = {got!r}, plan says {v!r}" for k, (got, v) in bad.items())
        raise PlanChanged(f"{path} does not match plan.json: {detail}.")
    return precision_config(cfg, precision)


def skip_shm_comm_build() -> None:
    """Keep DeepSpeed from JIT-compiling its CPU shared-memory all-reduce op (47 to 140 s measured on 2 cores).

    ``deepspeed.comm.torch.TorchBackend.__init__`` builds ``deepspeed_shm_comm``
    whenever the accelerator offers it and ``deepspeed.ops.__compatible_ops__``
    marks it compatible, even when torch.distributed is already initialised;
    no environment variable turns it off. The op only speeds up
    ``inference_all_reduce``; training collectives go through torch.distributed
    (gloo). Marking it incompatible (the dict is cached in the module, so the
    edit persists) makes ``build_shm_op`` return None.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False


def init_distributed(device: torch.device) -> None:
    """DeepSpeed's process group: gloo on the CPU (no shm op build), NCCL on GPUs."""
    if device.type == "cpu":
        skip_shm_comm_build()
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        deepspeed.init_distributed(dist_backend="nccl")


def local_device(device: torch.device) -> torch.device:
    """The device this rank runs on: ``cuda:LOCAL_RANK`` on GPUs, the CPU otherwise."""
    if device.type == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def cast_inputs(tensors: Sequence[torch.Tensor], precision: str) -> tuple[torch.Tensor, ...]:
    """Floating-point model inputs in the precision's dtype (DeepSpeed feeds them to its bf16/fp16 weights as they come)."""
    dtype = HALF_DTYPES.get(precision)
    return tuple(t.to(dtype) if dtype is not None and t.is_floating_point() else t for t in tensors)


def cast_parameters(model: nn.Module, precision: str) -> nn.Module:
    """Cast the parameters (not the buffers) to the precision's dtype, as ``deepspeed.initialize`` will.

    DeepSpeed 0.19.8 casts parameters only under bf16/fp16
    (``DeepSpeedEngine._configure_distributed_model``: fp32 buffers such as
    rotary ``inv_freq`` are kept); casting first changes no value and lets a
    torch.export graph be traced in the dtype it runs in.
    """
    dtype = HALF_DTYPES.get(precision)
    if dtype is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.is_floating_point():
                    p.data = p.data.to(dtype)
    return model


# ----------------------------------------------------------------------------- the pipeline module


def scalar_parameters_as_vectors(module: nn.Module) -> list[str]:
    """Give 0-dim parameters (CLIP's logit_scale) the shape [1], in place, for the whole run; returns their names.

    ``DeepSpeedEngine._broadcast_model`` sends each parameter as ``p.data.view(torch.uint8)``, which raises for a 0-dim
    tensor of a wider dtype (deepspeed/runtime/engine.py, 0.19.8), and its optimizers keep the shape they saw, so the
    shape cannot be put back after the engine is built. A [1] weight broadcasts wherever a scalar did; a checkpoint of
    the run holds it as [1]."""
    scalars = [(n, p) for n, p in module.named_parameters() if p.dim() == 0]
    for _, p in scalars:
        p.data = p.data.view(1)
    return [n for n, _ in scalars]


def checkpoint_units(blocks: Sequence[str | None], start: int, stop: int) -> list[tuple[int, int]]:
    """[a, b) piece ranges checkpointed together in pieces [start, stop) under full recompute.

    A unit starts at the stage's first piece and wherever a new block begins or
    a piece lies outside every block, as ``planner.solve.memory.checkpoint_starts``
    counts them: each unit keeps only its input.
    """
    starts = [start] + [k for k in range(start + 1, stop) if blocks[k] is None or blocks[k] != blocks[k - 1]]
    return list(zip(starts, starts[1:] + [stop]))


class _ZeroGradAnchor(torch.autograd.Function):
    """Returns ``out`` unchanged; in backward gives zero gradients to ``extra``.

    DeepSpeed sends back a gradient for every floating-point tensor a stage
    received (``_exec_send_grads`` asserts ``.grad is not None``); a float that
    depends on no parameter (a mask, rotary tables) has no gradient of its
    own, so it is detached for the computation and anchored here instead.
    """

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        ctx.specs = [(e.shape, e.dtype, e.device) for e in extra]
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (grad, *[torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.specs])


class _TiedParam:
    """The stand-in for DeepSpeed's tied module in ``tied_comms`` (the engine calls ``.parameters()`` on it)."""

    def __init__(self, param: nn.Parameter):
        self.param = param

    def parameters(self) -> Iterator[nn.Parameter]:
        return iter([self.param])


class PlannedPipelineModule(PipelineModule):
    """A ``PipelineModule`` over the planned pieces with the planned stage boundaries.

    Args:
        layers: every piece of the model in order (``planned.piece(model, i)``).
        bounds: piece index where each stage starts, then the piece count (``planned.bounds``).
        topology: DeepSpeed's ``PipeDataParallelTopology(num_pp, num_dp)``.
        tied: ``(name, stages, parameter)`` for each parameter used on several
            stages; ``parameter`` is this rank's copy (the same object the local
            pieces hold).
        units: [a, b) piece ranges to checkpoint together when activation
            checkpointing is on (:func:`checkpoint_units`); default one per piece.
        no_grad_inputs / no_grad_outputs: per stage, positions (in the flat
            tuple crossing its input / output cut) of floating-point tensors that
            depend on no parameter: inputs are detached and given zero
            gradients, outputs are made to require grad so DeepSpeed can run
            backward through them.
        **kwargs: passed to ``PipelineModule`` (loss_fn, activation_checkpoint_interval, ...).
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        bounds: Sequence[int],
        topology: PipeDataParallelTopology,
        tied: Sequence[tuple[str, Sequence[int], nn.Parameter]] = (),
        units: Sequence[tuple[int, int]] | None = None,
        no_grad_inputs: Sequence[Sequence[int]] | None = None,
        no_grad_outputs: Sequence[Sequence[int]] | None = None,
        **kwargs: Any,
    ):
        # Read by _partition_layers and _index_tied_modules, which PipelineModule.__init__ calls.
        object.__setattr__(self, "_planned_bounds", [int(b) for b in bounds])
        object.__setattr__(self, "_planned_tied", [(n, sorted(set(int(s) for s in st)), p) for n, st, p in tied])
        kwargs.setdefault("activation_checkpoint_func", ds_checkpointing.non_reentrant_checkpoint)
        super().__init__(layers=list(layers), topology=topology, **kwargs)
        # PipelineModule keeps its whole layer list; drop the other stages' pieces so their weights can be freed.
        self._layer_specs: list[Any] = [x if self._local_start <= i < self._local_stop else None for i, x in enumerate(self._layer_specs)]
        stage = self.stage_id
        self._units = [(a - self._local_start, b - self._local_start) for a, b in (units or []) if self._local_start <= a < self._local_stop]
        self._no_grad_in = list((no_grad_inputs or [[]] * self.num_stages)[stage]) if stage > 0 else []
        self._no_grad_out = list((no_grad_outputs or [[]] * self.num_stages)[stage]) if stage < self.num_stages - 1 else []

    # -- partitioning: exactly the planned boundaries

    def _partition_layers(self, method: str = "planned") -> None:
        parts = self._planned_bounds
        n = len(self._layer_specs)
        if len(parts) != self.num_stages + 1 or parts[0] != 0 or parts[-1] != n or any(b <= a for a, b in zip(parts, parts[1:])):
            raise ValueError(f"planned stage bounds {parts} do not split {n} pieces into {self.num_stages} non-empty stages")
        self.parts = list(parts)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=parts[stage], stop=parts[stage + 1])

    # -- tied parameters: our copies, one per stage that uses them

    def _index_tied_modules(self) -> dict[str, dict[str, Any]]:
        """One process group per tied parameter and data-parallel replica, over the stages holding it.

        Every rank creates every group in the same order (``dist.new_group`` is
        collective). As DeepSpeed does for ``TiedLayerSpec``, the copies on all
        but the first rank of a group are marked ``ds_pipe_replicated`` so the
        gradient norm (clipping) counts the parameter once.
        """
        comms: dict[str, dict[str, Any]] = {}
        local = {id(p) for p in self.parameters()}
        for name, stages, param in self._planned_tied:
            if len(stages) < 2:
                continue
            for dp in range(self._grid.data_parallel_size):
                ranks = [self._grid.stage_to_global(stage_id=s, data=dp) for s in stages]
                group = dist.new_group(ranks=ranks)
                if self.global_rank not in ranks:
                    continue
                if id(param) not in local:
                    raise RuntimeError(f"tied parameter {name} is planned on stages {stages} but stage {self.stage_id} does not hold it")
                comms[name] = {"ranks": ranks, "group": group, "weight_attr": [name], "module": _TiedParam(param)}
                if self.global_rank != ranks[0]:
                    param.ds_pipe_replicated = True
        object.__setattr__(self, "_planned_tied", [])  # the comms hold the local copies; release the others
        return comms

    def get_tied_weights_and_groups(self) -> list[tuple[nn.Parameter, Any]]:
        """(parameter, group) pairs whose gradients PipelineEngine sums in ``_exec_reduce_tied_grads``."""
        return [(comm["module"].param, comm["group"]) for _, comm in sorted(self.tied_comms.items())]

    def allreduce_tied_weight_gradients(self) -> None:
        for param, group in self.get_tied_weights_and_groups():
            if param.grad is not None:
                dist.all_reduce(param.grad, group=group)

    def _synchronize_tied_weights(self) -> None:
        """Start every copy from the first holder's values (they are equal already: same seed)."""
        with torch.no_grad():  # a broadcast into a parameter must not enter its autograd history
            for _, comm in sorted(self.tied_comms.items()):
                dist.broadcast(comm["module"].param.data, src=min(comm["ranks"]), group=comm["group"])

    # -- forward: boundary tensors and checkpointing per planned unit

    def forward(self, forward_input: Any) -> Any:
        anchored: list[torch.Tensor] = []
        if self._no_grad_in:
            xs = list(forward_input) if isinstance(forward_input, tuple) else [forward_input]
            for i in self._no_grad_in:
                anchored.append(xs[i])
                xs[i] = xs[i].detach()
            forward_input = tuple(xs) if isinstance(forward_input, tuple) else xs[0]
        if self.activation_checkpoint_interval > 0 and self._units:
            out = self._checkpointed_forward(forward_input)
        else:
            out = super().forward(forward_input)
        if isinstance(out, list):
            out = tuple(out)
        if self.stage_id < self.num_stages - 1:  # sends need contiguous tensors (a permuted activation is not)
            out = tuple(_contiguous(t) for t in out) if isinstance(out, tuple) else _contiguous(out)
        if self._no_grad_out:
            outs = list(out) if isinstance(out, tuple) else [out]
            for i in self._no_grad_out:
                if outs[i].is_floating_point() and not outs[i].requires_grad:
                    outs[i] = outs[i].detach().requires_grad_()
            out = tuple(outs) if isinstance(out, tuple) else outs[0]
        if anchored:
            out = _anchor(out, anchored)
        return out

    def _checkpointed_forward(self, x: Any) -> Any:
        self.micro_offset += 1
        for a, b in self._units:
            funcs = self.forward_funcs[a:b]
            x = self.activation_checkpoint_func(_run_layers(funcs), *(x if isinstance(x, tuple) else (x,)))
        return x


def _run_layers(funcs: Sequence[Callable[[Any], Any]]) -> Callable[..., Any]:
    def run(*inputs: Any) -> Any:
        x = inputs[0] if len(inputs) == 1 else inputs
        for f in funcs:
            x = f(x)
        return x

    return run


def _contiguous(t: Any) -> Any:
    return t.contiguous() if isinstance(t, torch.Tensor) else t


def _anchor(out: Any, extra: list[torch.Tensor]) -> Any:
    """``out`` with zero-gradient edges to ``extra`` attached to its first floating-point tensor that requires grad."""
    leaves, spec = torch.utils._pytree.tree_flatten(out)
    for i, t in enumerate(leaves):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad:
            leaves[i] = _ZeroGradAnchor.apply(t, *extra)
            return torch.utils._pytree.tree_unflatten(leaves, spec)
    raise RuntimeError("no output of this stage requires grad; cannot return gradients for its floating-point inputs")


# ----------------------------------------------------------------------------- from the plan


def no_grad_floats(planned: PlannedModel) -> tuple[list[list[int]], list[list[int]]]:
    """Per stage, positions of floating-point tensors crossing its input / output cut that need no gradient."""

    def at(cut: int) -> list[int]:
        tensors = planned.layer_graph.cut_tensors(cut)
        return [i for i, t in enumerate(tensors) if _is_float(t.dtype) and not t.requires_grad]

    ins = [at(planned.bounds[s]) for s in range(planned.num_stages)]
    outs = [at(planned.bounds[s + 1]) for s in range(planned.num_stages)]
    return ins, outs


def _is_float(dtype_name: str) -> bool:
    """Whether a dtype name from ``planner.model.trace.dtype_name`` (fp32, bf16, float8_e4m3fn, ...) is floating point."""
    return dtype_name in ("fp64", "fp32", "fp16", "bf16") or dtype_name.startswith(("float", "bfloat"))


def check_boundaries(planned: PlannedModel) -> None:
    """Refuse stage boundaries DeepSpeed cannot pass: it sends one tensor or a flat tuple of tensors between stages."""
    lg = planned.layer_graph
    for cut in planned.bounds[1:-1]:
        for node in lg.boundaries[cut]:
            meta = lg.metas.get(node)
            if meta is not None and len(meta.tensors) != 1:
                raise ValueError(
                    f"value {node.name} crossing the stage boundary before piece {cut} ({planned.piece_names[cut]}) holds "
                    f"{len(meta.tensors)} tensors; DeepSpeed passes only tensors or flat tuples of tensors between stages"
                )


def build_pipeline_module(
    planned: PlannedModel,
    model: nn.Module,
    dp: int,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    activation_checkpoint_interval: int = 0,
) -> PlannedPipelineModule:
    """The planned pipeline of ``model`` (built identically on every rank) for this process's stage.

    ``model``'s other stages' weights are referenced only through ``model`` afterwards: drop it to free them.
    """
    planned.check_sendable()
    check_boundaries(planned)
    pieces = [planned.piece(model, i) for i in range(planned.layer_graph.n)]
    tied = [(name, stages, model.get_parameter(name)) for name, stages in planned.tied_parameters(model)]
    blocks = [p.block for p in planned.layer_graph.pieces]
    units = [u for s in range(planned.num_stages) for u in checkpoint_units(blocks, planned.bounds[s], planned.bounds[s + 1])]
    ins, outs = no_grad_floats(planned)
    return PlannedPipelineModule(
        pieces,
        planned.bounds,
        PipeDataParallelTopology(num_pp=planned.num_stages, num_dp=dp),
        tied=tied,
        units=units,
        no_grad_inputs=ins,
        no_grad_outputs=outs,
        loss_fn=loss_fn,
        activation_checkpoint_interval=activation_checkpoint_interval,
        partition_method="planned",
    )


# ----------------------------------------------------------------------------- outputs


class StepTimer:
    """Wall-clock time of each step in seconds (synchronising CUDA first)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: list[float] = []

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self._sync()
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        self._sync()
        self.times.append(time.perf_counter() - self._t0)
        return self.times[-1]


class ForwardCounter:
    """Counts forward calls of the local pieces (twice per micro-batch when activations are recomputed)."""

    def __init__(self, module: PlannedPipelineModule):
        self.calls = 0
        self._handles = [m.register_forward_pre_hook(self._hook) for m in module.forward_funcs if isinstance(m, nn.Module)]

    def _hook(self, *_: Any) -> None:
        self.calls += 1


def write_json(path: str | Path, data: Any) -> None:
    """Write ``data`` as JSON via a temporary file and a rename (no half-written file on failure)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def grad_norm(engine: Any) -> float | None:
    """The global gradient norm (before clipping) of the last step, where DeepSpeed's optimizer wrapper records it.

    BF16_Optimizer and the ZeRO optimizers record it (tied copies counted once);
    with a bare torch optimizer (fp32, ZeRO 0) DeepSpeed discards it: None.
    """
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


def stats(
    engine: Any,
    module: PlannedPipelineModule,
    times: Sequence[float],
    device: torch.device,
    forward_calls: int,
    precision: str,
    grad_norms: Sequence[float | None] = (),
) -> dict[str, Any]:
    """This rank's stats record (the contract's keys, plus what DeepSpeed actually ran)."""
    return {
        "rank": module.global_rank,
        "stage": module.stage_id,
        "stages": [module.stage_id],
        "data_parallel_rank": module._grid.data_parallel_id,
        "pieces": [module._local_start, module._local_stop],
        "step_times_s": [round(t, 6) for t in times],
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "precision": precision,
        "activation_checkpoint_interval": module.activation_checkpoint_interval,
        "forward_calls": forward_calls,
        "grad_norms": list(grad_norms),
        "optimizer": type(engine.optimizer).__name__,
        "grad_accum_dtype": str(engine.get_data_types()[1]).replace("torch.", ""),
    }
