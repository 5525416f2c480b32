"""What the search asks of a training engine, and why a layout is rejected: torch-free, engine-free.

The search (planner.solve.search) is written against :class:`EngineRules`; the
engines themselves (planner.engines.*) implement it one floor up, so that the
solver never imports an engine and adding an engine touches no solver code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from planner.records import DEFAULT_LOSS, LossRun

if TYPE_CHECKING:  # only for annotations: no import at run time
    import numpy as np

    from planner.records import ModelCosts, RecomputeWork
    from planner.solve.memory import StateRecipe
    from planner.solve.plan import Layout


class RejectKind(str, Enum):
    """Why a candidate layout cannot run (the search branches on this, never on a message)."""

    RULE = "rule"  # the engine, the schedule or the cluster cannot run it
    DEVICES = "devices"  # a pipeline rank would span two kinds of device
    SPLIT = "split"  # the pieces cannot be cut into that many stages at the engine's cut points
    MEMORY = "memory"  # some rank needs more memory than its budget
    DOMINATED = "dominated"  # needs at least the memory of a layout already found not to fit
    BOUNDED = "bounded"  # fits, and its split cannot step faster than the layouts already ranked (never reported)

    @property
    def is_memory(self) -> bool:
        return self in (RejectKind.MEMORY, RejectKind.DOMINATED)


class EngineRules(Protocol):
    """The engine-specific facts the layout search needs (see planner.engines.base.Engine)."""

    name: str
    title: str
    tensor_parallel: bool
    recompute_modes: tuple[str, ...]
    recompute_modules: tuple[str, ...]
    zero_levels: tuple[int, ...]
    searched_schedules: tuple[str, ...]
    microbatch_groups: bool
    context_parallel: bool
    cp_comm_types: tuple[str, ...]
    expert_parallel: bool
    fp8: bool
    overlaps: tuple[str, ...]
    overlap_needs_compile: bool
    compiles: bool
    loss_chunks: bool
    tp_overlap_buffers: float
    tp_overlap_shard_buffers: float
    fp8_amax_history: int
    zeroes_grad_buffer: bool
    model_io_buffers: bool

    checkpoints_itself: bool

    def selective_applies(self, costs: ModelCosts) -> bool: ...

    def recomputes_attention_core(self, modules: frozenset[str]) -> bool: ...

    def alternative(self, has: Callable[[EngineRules], bool]) -> str:
        """'--engine NAME' of the engines that have a feature, for messages."""
        ...

    def allowed_cuts(self, costs: ModelCosts) -> np.ndarray:
        """(n + 1,) booleans: where this engine can cut between pieces."""
        ...

    def interleaved_groups(self, pp: int, m: int) -> tuple[int, ...]:
        """The micro-batch group sizes an unpinned search tries for the interleaved schedule (0: the default)."""
        ...

    def searches_zero(self, zero: int, dtype: str, dp: int) -> bool:
        """Whether an unpinned search should try ZeRO stage ``zero``."""
        ...

    def layout_problems(self, layout: Layout, costs: ModelCosts) -> list[str]:
        """Why this engine cannot run ``layout`` (empty when it can)."""
        ...

    def fp8_cast_bytes(self, arch: Mapping[str, object], kind: str, tokens: float, tp: int, compiled: bool = False) -> tuple[list[float], list[float]]:
        """Bytes of each FP8 cast kernel of a dense transformer piece on one GPU (forward, backward) as the engine casts."""
        ...

    def state_recipe(self, precision: str, zero: int, optimizer: str, layout: Layout | None = None) -> StateRecipe:
        """Model-state bytes per parameter as this engine allocates them for ``layout``'s precision options."""
        ...

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
        """The sharded ``costs`` with the saved activations of the layers the engine runs (the traced ones unless it
        builds its own; then its expert layers' rows include the expert tensor-parallel all-gather over ``etp``);
        ``modules``: what selective recomputation recomputes; ``loss``: how an engine with its own loss runs it (chunks,
        compiled; engines without one ignore it)."""
        ...

    def recompute_work(self, costs: ModelCosts, tp: int, sequence_parallel: bool, cp: int, modules: frozenset[str]) -> tuple[RecomputeWork, ...] | None:
        """Per piece: the forward selective recomputation of ``modules`` runs again besides the attention core; None: the core alone."""
        ...

    def layer_traffic(self, costs: ModelCosts, tp: int, sequence_parallel: bool, cp: int) -> ModelCosts:
        """The sharded ``costs`` with the memory-bound bytes of the layers the engine runs (the traced ones unless it
        builds its own)."""
        ...

    def default_overlaps(self, tp: int, zero: int, data_parallel: int) -> dict[str, bool]:
        """The overlaps (Layout field names) an unpinned search turns on."""
        ...

    def sends_output_copies(self, schedule: str) -> bool:
        """Whether each stage keeps one more copy of its output per micro-batch in flight."""
        ...

    def blocking_sends(self, layout: Layout) -> bool:
        """Whether a stage's pipeline sends hold its compute stream until they complete (the engine waits on each
        send before its next pass) rather than overlapping its next pass."""
        ...

    def exposed_dp_time(
        self, layout: Layout, reduce_s: float, gather_s: float, backward_s: Sequence[float], forward_s: Sequence[float], params: float
    ) -> float:
        """Seconds of the data-parallel exchange (gradient reduction, parameter all-gather) the step does not hide."""
        ...
