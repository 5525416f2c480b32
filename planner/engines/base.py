"""The interface every training engine implements, and the rules engines share.

An engine is one module (planner/engines/<name>.py) with one :class:`Engine`
instance: the schedules it runs, the ZeRO stages and recomputation modes it
has, where it can cut a model, how it lays out model state in memory, how much
of the data-parallel exchange its backward hides, and its run-time rules for a
layout. The search, ``validate`` and the renderers all ask the engine; none of
them branches on an engine's name. Its renderer lives in planner/render/<name>.py
(the floor above), registered under the same name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from planner.records import DEFAULT_LOSS, LossRun, ModelCosts, RecomputeWork
from planner.solve.memory import StateRecipe
from planner.solve.mesh import cp_comm_problems
from planner.solve.plan import Layout
from planner.solve.schedules import SCHEDULE_INFO, schedule_constraints
from planner.solve.timing import fp8_cast_bytes


def repeated_layers(blocks: Sequence[str | None]) -> list[str | None]:
    """Each piece's block (``blocks``: module paths, None outside any block) where that block is one of the model's
    repeated layers, else None. The layers are the blocks of the parent module that holds the most blocks (the first
    such parent on a tie): ``transformer.h.0 .. h.11`` of a nanoGPT file, not its custom final norm ``transformer.ln_f``
    (a block of the ``transformer`` container too). A model whose blocks share one parent keeps them all."""
    order = list(dict.fromkeys(b for b in blocks if b is not None))
    if not order:
        return list(blocks)
    parents = [b.rpartition(".")[0] for b in order]
    counts = {p: parents.count(p) for p in dict.fromkeys(parents)}
    layer_parent = max(counts, key=lambda p: counts[p])  # max keeps the first of equals
    return [b if b is not None and b.rpartition(".")[0] == layer_parent else None for b in blocks]


def whole_block_cuts(costs: ModelCosts) -> np.ndarray:
    """(n + 1,) booleans: cuts only between whole repeated layers (:func:`repeated_layers`), the pieces before the
    first layer (embedding) kept with it and those after the last layer (final norm, output layer, loss) kept with it,
    so the first and last stages always hold a layer. Every cut is allowed when the model has no blocks."""
    n = costs.n
    allowed = np.ones(n + 1, dtype=bool)
    layers = repeated_layers([layer.block for layer in costs.layers])
    at = [i for i, b in enumerate(layers) if b is not None]
    if not at:
        return allowed
    first, last = at[0], at[-1]
    for k in range(1, n):
        whole = layers[k] is None or layers[k] != layers[k - 1]
        allowed[k] = whole and first < k <= last
    return allowed


class Engine(ABC):
    """One training engine (see the module docstring); implements planner.solve.rules.EngineRules."""

    name: str = ""
    #: the engine as its users know it (messages: "a Megatron-LM option")
    title: str = ""
    description: str = ""
    #: schedules the engine runs (keys of planner.solve.schedules.SCHEDULE_INFO)
    schedules: tuple[str, ...] = ("1f1b",)
    #: the subset the search tries when --schedule is not pinned
    searched_schedules: tuple[str, ...] = ("1f1b",)
    #: whether the interleaved schedule takes an explicit micro-batch group size (Layout.microbatch_group)
    microbatch_groups: bool = False
    zero_levels: tuple[int, ...] = (0,)
    tensor_parallel: bool = False
    #: whether stages may be cut inside a repeated block (False: only between whole blocks)
    sub_block_cuts: bool = True
    recompute_modes: tuple[str, ...] = ("none", "full")
    #: modules selective recomputation can be told to recompute and the planner models (Megatron --recompute-modules);
    #: () : the core attention only
    recompute_modules: tuple[str, ...] = ()
    #: every module name the engine's own option accepts (those not in recompute_modules are refused as not modelled)
    recompute_module_names: tuple[str, ...] = ()
    #: context parallelism (the sequence split over cp GPUs with ring attention)
    context_parallel: bool = False
    #: how its context parallelism can exchange keys and values (Layout.cp_comm), the engine's default first
    cp_comm_types: tuple[str, ...] = ("p2p",)
    #: the communication overlaps the engine can run (Layout fields: tp_comm_overlap, overlap_grad_reduce, overlap_param_gather)
    overlaps: tuple[str, ...] = ()
    #: whether optimizer-state and main-gradient dtypes other than the engine's default can be asked for
    precision_options: bool = False
    #: FP8 GEMMs (Megatron: Transformer Engine; torchtitan: torchao Float8Linear, rowwise)
    fp8: bool = False
    #: FP8 primary weights: each FP8 GEMM's weight kept only in FP8 and all-gathered so (Megatron --fp8-param-gather)
    fp8_primary_weights: bool = False
    #: torch.compile of the model (Layout.compile), and whether tensor-parallel overlap needs it (torchtitan's async TP)
    compiles: bool = False
    #: whether the engine's loss runs in chunks of the sequence a plan can set (Settings.memory.loss_chunks)
    loss_chunks: bool = False
    overlap_needs_compile: bool = False
    #: buffers of (s / cp x b) x h bf16 elements its tensor-parallel overlap allocates (planner.solve.search.feature_buffers)
    tp_overlap_buffers: float = 0.0
    #: and buffers of one rank's sequence shard (1 / tp of those)
    tp_overlap_shard_buffers: float = 0.0
    #: entries of the FP8 delayed-scaling amax history per tensor (0: dynamic scaling keeps no history)
    fp8_amax_history: int = 0
    #: expert parallelism for mixture-of-experts layers (Layout.ep > 1, Layout.etp > 1)
    expert_parallel: bool = False
    #: why an engine without expert parallelism has none, and what to use instead (its layout refusal)
    no_expert_parallel: str = "ep and etp must be 1"
    #: whether each step begins by zeroing a persistent main-gradient buffer that holds every local gradient (a memory-bound
    #: write of all the GPU's parameters x the main-gradient bytes, on the critical path before the first forward)
    zeroes_grad_buffer: bool = False
    #: whether the model's input and output (cuts 0 and n) take a pair of buffers on the first and last stage as the
    #: stage boundaries do: the user's loss_fn runs on the last stage's output, which stays alive with its gradient
    #: through the loss (torch.distributed.pipelining, DeepSpeed). False where the loss is computed inside the model and
    #: the last stage sends nothing (Megatron's GPTModel); its working set is then the engine's (``layer_activations``)
    model_io_buffers: bool = True
    #: whether :meth:`layer_activations` returns the bytes the engine's own checkpointing keeps under every recompute
    #: mode (and the rebuilt unit in each piece's working set), so the memory model applies no recompute mode of its own
    checkpoints_itself: bool = False
    #: the loss the engine trains where it builds the model itself from flags (Megatron, torchtitan); "" where it runs
    #: the model file's model and trains the loss the plan records (planner.model.losses.choose_loss)
    own_loss: str = ""
    #: what to try when a layout does not fit: activation recomputation and sharding the optimizer, in this engine's words
    recompute_hint: str = "activation recomputation"
    sharding_hint: str = "the distributed optimizer"

    def alternative(self, has: Callable[[Engine], bool]) -> str:
        """'--engine NAME' of each engine that has a feature (``has`` its test on an engine's rules), for a message
        naming what to use instead; the registry is asked at message time (it imports every wing)."""
        from planner.engines import ENGINES

        names = [spec.name for spec in ENGINES.values() if has(spec.rules)]
        return " or ".join(f"--engine {n}" for n in names) if names else "no engine of the planner"

    @property
    def runs_model_file(self) -> bool:
        """Whether the engine's scripts run the model file's own model (not one it builds itself from flags)."""
        return not self.own_loss

    def trained_loss(self, recorded: str) -> str:
        """One line on the loss this engine's scripts train, given the loss the plan recorded for the model file."""
        return self.own_loss or recorded

    # ------------------------------------------------------------------ memory and time

    @abstractmethod
    def state_recipe(self, precision: str, zero: int, optimizer: str = "adam", layout: Layout | None = None) -> StateRecipe:
        """Model-state bytes per parameter as this engine allocates them (``layout``: its precision options)."""

    def exposed_dp_time(
        self, layout: Layout, reduce_s: float, gather_s: float, backward_s: Sequence[float], forward_s: Sequence[float], params: float
    ) -> float:
        """Seconds of the data-parallel exchange not hidden: the gradient reduction ``reduce_s`` and the parameter
        all-gather ``gather_s`` (0 without a sharded optimizer) both exposed unless the engine overlaps them."""
        return reduce_s + gather_s

    def layer_activations(
        self,
        costs: ModelCosts,
        tp: int,
        sequence_parallel: bool,
        cp: int,
        recompute: str,
        etp: int = 1,
        modules: frozenset[str] = frozenset(),
        loss: LossRun = DEFAULT_LOSS,
    ) -> ModelCosts:
        """``costs`` (already scaled to the micro-batch and sharded over tp and cp; ``etp`` the expert tensor-parallel
        size) with the saved activations of the layers this engine runs: as traced, since the engine runs the user's
        module as it is. An engine that returns other costs has priced its expert layers' rows itself (etp included).
        ``modules``: what selective recomputation recomputes (Layout.modules_recomputed; only engines with
        :attr:`recompute_modules` take others than core_attn)."""
        return costs

    def recompute_work(self, costs: ModelCosts, tp: int, sequence_parallel: bool, cp: int, modules: frozenset[str]) -> tuple[RecomputeWork, ...] | None:
        """Per piece of the sharded ``costs``: the forward selective recomputation of ``modules`` runs again besides the
        traced attention core (``op_flops_core``, recomputed when core_attn is among them); None: the core alone."""
        return None

    def fp8_cast_bytes(self, arch: Mapping[str, object], kind: str, tokens: float, tp: int, compiled: bool = False) -> tuple[list[float], list[float]]:
        """Bytes of each FP8 cast kernel of a dense piece (forward, backward): Transformer Engine's
        (planner.solve.timing.fp8_cast_bytes; ``compiled`` changes nothing: TE's casts are its own kernels)."""
        return fp8_cast_bytes(arch, kind, tokens, tp)

    def layer_traffic(self, costs: ModelCosts, tp: int, sequence_parallel: bool, cp: int) -> ModelCosts:
        """``costs`` (already scaled and sharded over tp and cp) with the memory-bound bytes of the layers this engine
        runs: as traced, since the engine runs the user's module as it is."""
        return costs

    def default_overlaps(self, tp: int, zero: int, data_parallel: int) -> dict[str, bool]:
        """The overlaps an unpinned search turns on for a layout (none unless the engine has them)."""
        return {}

    def sends_output_copies(self, schedule: str) -> bool:
        return False

    def blocking_sends(self, layout: Layout) -> bool:
        """Sends overlap the stage's next pass: the link delays only the stage that receives."""
        return False

    def selective_applies(self, costs: ModelCosts) -> bool:
        """Whether selective recomputation changes anything for this model (the attention core's saved s x s tensors)."""
        return any(l.core_saved_bytes > 0 for l in costs.layers)

    def recomputes_attention_core(self, modules: frozenset[str]) -> bool:
        """Whether selective recomputation runs the attention core again (Megatron's core_attn, the default module)."""
        return not modules or "core_attn" in modules

    def searches_zero(self, zero: int, dtype: str, dp: int) -> bool:
        """Unpinned search: ZeRO > 0 only when there is a data-parallel group to shard over."""
        return zero == 0 or dp > 1

    # ------------------------------------------------------------------ where it can cut

    def allowed_cuts(self, costs: ModelCosts) -> np.ndarray:
        """(n + 1,) booleans: every cut point of ours is expressible."""
        return np.ones(costs.n + 1, dtype=bool)

    # ------------------------------------------------------------------ rules

    def runtime_schedule_problems(self, schedule: str, pp: int, m: int, v: int, group: int = 0) -> list[str]:
        """What the engine itself refuses for ``schedule`` with pp ranks, m micro-batches, v stages per rank and an
        explicit interleaved micro-batch group size ``group`` (0: the schedule's default)."""
        problems = schedule_constraints(schedule, pp, m, v, group)
        if schedule in SCHEDULE_INFO and schedule not in self.schedules:
            problems.append(f"engine {self.name} does not run schedule {schedule!r} (it runs: {', '.join(self.schedules)})")
        if group and not self.microbatch_groups:
            problems.append(
                f"{self.name} runs its schedule's own micro-batch group size (no --microbatch-group; use {self.alternative(lambda e: e.microbatch_groups)})"
            )
        return problems

    def interleaved_groups(self, pp: int, m: int) -> tuple[int, ...]:
        """The micro-batch group sizes an unpinned search tries for the interleaved schedule (0: the default)."""
        return (0,)

    def schedule_problems(self, schedule: str, pp: int, m: int, v: int, group: int = 0) -> list[str]:
        """The engine's refusals, plus the planner's own rule: never fewer micro-batches than stages (except GPipe)."""
        problems = self.runtime_schedule_problems(schedule, pp, m, v, group)
        if m < pp and schedule != "gpipe":
            problems.append(f"{m} micro-batches cannot fill {pp} pipeline stages: each step would idle most ranks (need at least {pp})")
        return problems

    def zero_problems(self, zero: int, pp: int) -> list[str]:
        if zero not in self.zero_levels:
            return [f"{self.name} runs ZeRO stages {', '.join(map(str, self.zero_levels))} with a pipeline, not {zero}"]
        return []

    def tensor_parallel_problems(self, costs: ModelCosts, tp: int) -> list[str]:
        if tp > 1 and not self.tensor_parallel:
            return [f"{self.name} runs no tensor parallelism of its own (tp must be 1; use {self.alternative(lambda e: e.tensor_parallel)} for tp > 1)"]
        return []

    def recompute_problems(self, recompute: str) -> list[str]:
        if recompute not in self.recompute_modes:
            return [f"{self.name} has no {recompute} recomputation (it runs {', '.join(self.recompute_modes)})"]
        return []

    def feature_problems(self, layout: Layout, costs: ModelCosts) -> list[str]:
        """The context parallelism, overlaps, precision options and FP8 ``layout`` asks for that this engine lacks."""
        out = []
        if layout.cp > 1 and not self.context_parallel:
            out.append(f"{self.name} runs no context parallelism (cp must be 1; use {self.alternative(lambda e: e.context_parallel)} for cp > 1)")
        if layout.cp > 1 and layout.cp_comm not in self.cp_comm_types:  # with cp 1 nothing is exchanged
            out.append(f"{self.name} has no --cp-comm-type {layout.cp_comm} (it runs: {', '.join(self.cp_comm_types)})")
        elif layout.cp > 1:
            out += cp_comm_problems(layout.cp_comm, layout.cp, layout.tp, costs.architecture)
        for name in layout.overlaps:
            if name not in self.overlaps:
                out.append(f"{self.name} has no --{name} (it overlaps: {', '.join(self.overlaps) or 'nothing'})")
        if (layout.main_grads_dtype != "fp32" or layout.optimizer_state_dtype != "fp32") and not self.precision_options:
            out.append(
                f"{self.name} keeps its own gradient and optimizer-state dtypes (no bf16 main gradients or optimizer states; use {self.alternative(lambda e: e.precision_options)})"
            )
        if layout.compile and not self.compiles:
            out.append(f"{self.name} has no torch.compile option (use {self.alternative(lambda e: e.compiles)})")
        if layout.tp_comm_overlap and self.overlap_needs_compile and not layout.compile:
            out.append(f"{self.name}'s tensor-parallel overlap (async TP) needs torch.compile of the model (--compile)")
        if layout.fp8 and not self.fp8:
            out.append(f"{self.name} has no FP8 training (FP8 GEMMs: use {self.alternative(lambda e: e.fp8)})")
        if (layout.ep > 1 or layout.etp > 1) and not self.expert_parallel:
            out.append(f"{self.name} runs no expert parallelism ({self.no_expert_parallel}; use {self.alternative(lambda e: e.expert_parallel)} for ep > 1)")
        return out

    def layout_problems(self, layout: Layout, costs: ModelCosts) -> list[str]:
        """Every rule ``layout`` breaks on this engine (empty when it can run)."""
        out = self.schedule_problems(layout.schedule, layout.pp, layout.num_microbatches, layout.vp, layout.microbatch_group) if layout.pp > 1 else []
        out += self.zero_problems(layout.zero, layout.pp)
        out += self.recompute_problems(layout.recompute)
        if layout.recompute_modules and layout.recompute != "selective":
            out.append("recompute modules (--recompute-modules) apply to selective recomputation only")
        elif layout.recompute_modules:
            out += self.recompute_module_problems(layout.recompute_modules, costs)
        out += self.tensor_parallel_problems(costs, layout.tp)
        out += self.feature_problems(layout, costs)
        return out

    def recompute_module_problems(self, modules: tuple[str, ...], costs: ModelCosts) -> list[str]:
        """Why selective recomputation cannot recompute ``modules`` of this model on this engine (empty when it can)."""
        if modules and not self.recompute_modules:
            return [
                f"{self.name} recomputes the attention core only under selective recomputation (no --recompute-modules; use {self.alternative(lambda e: bool(e.recompute_modules))})"
            ]
        return []

    def architecture_from_config(self, config: Any, causal: bool, seq_len: int | None) -> tuple[dict[str, Any] | None, str | None]:
        """(architecture() derived from a transformers ``config`` for an engine that builds its own model from a shape,
        why none is) ; (None, None) for an engine that runs the model as it is."""
        return None, None

    def architecture_problem(self, arch: dict[str, Any] | None, model: str) -> tuple[str, str] | None:
        """(message, hint) when the engine cannot build this model from its architecture(); None when it can."""
        return None
