"""Layout search: every (pp, tp, dp, micro-batch, schedule, v, recompute, ZeRO) an engine can run, partitioned and simulated.

Mixture-of-experts models on engines with expert parallelism also search (ep, etp) (:func:`expert_layouts`); dense
models keep ep = etp = 1 and no extra candidates.

For a fixed global batch, each candidate layout is priced in four steps:

1. costs for its micro-batch, sharded for its tensor-parallel degree (timing.shard_costs);
2. the partition (rank_memory.solve_split over partition.solve) over the pieces the engine can cut between,
   fastest among the splits whose every pipeline rank fits by rank_memory.rank_need: its stages' static bytes
   plus the simulated peak of the activations its action order keeps alive (the one number the fit check, the
   rejection and plan.json's rank_memory report; exact for one stage per rank, see solve_split for several);
3. the event simulation of the schedule with those stages' times and point-to-point
   transfer times (simulate.simulate), which gives the pipeline's makespan, bubble and
   each rank's activation peak;
4. the data-parallel gradient exchange that the backward cannot hide, and the optimizer step.

Candidates are visited in order of a lower bound on their step time (perfect
balance, no bubble), and the search stops once that bound exceeds the k-th best
step time found: the result is the same as pricing every candidate, in a
fraction of the time. Rejected candidates keep their reason.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from planner.errors import UsageError
from planner.hardware import Cluster, DeviceProfile, memory_time
from planner.records import Layer, ModelCosts, evolve, piece_classes
from planner.solve import partition as part
from planner.solve import rank_memory as rmem
from planner.solve.memory import (
    GiB,
    StateRecipe,
    expert_params_per_gpu,
    expert_range_params,
    fp8_amax_bytes,
    gemm_param_matrix,
    gemm_params,
    range_matrices,
    stage_params,
    transient_matrix,
)
from planner.solve.mesh import cp_comm_problems
from planner.solve.plan import Layout, Predicted, ep_overlap_allowed
from planner.solve.rules import EngineRules, RejectKind
from planner.solve.schedules import build_schedule, interleaved_group_size, normalised_group
from planner.solve.settings import Settings
from planner.solve.simulate import SimResult, StageMemory, StageTimes, simulate
from planner.solve.timing import (
    ATTENTION_KINDS,
    PieceTimes,
    analytical_times,
    attention_core_flops,
    compiled_traffic,
    cp_exchange_exposed,
    expert_dispatch_time,
    fp8_cast_bytes,
    kv_bytes,
    moe_dispatcher_terms,
    moe_fp8_cast_bytes,
    paired_share,
    q_bytes,
    shard_costs,
    split_context,
    tp_collective_time,
    with_measured,
)

RECOMPUTE_MODES = ("none", "selective", "full")
#: context-parallel sizes an unpinned search tries, and the shortest sequence it tries them for (ring attention pays off only
#: when the attention block per rank is long enough to hide the KV exchange; shorter sequences keep cp = 1)
CP_SIZES = (2, 4, 8)
CP_MIN_SEQ = 8192
#: TE userbuffers of --tp-comm-overlap: one (s x b, h) bf16 buffer per overlapped GEMM role (QKV, projection, FC1, FC2
#: forward and their dgrad/wgrad bulk overlaps: 10 in Transformer Engine's default initialize_ub method lists)
TP_OVERLAP_BUFFERS = 10
#: --fp8-amax-history-len the Megatron renderer writes (NeMo's and Megatron's FP8 examples use 1024 with amax algo max)
FP8_AMAX_HISTORY = 1024
#: default global batch: 8 samples per GPU keeps a 1F1B bubble under 1 - 8/(8+1) ~ 11% even at pp = world size
SAMPLES_PER_GPU = 8
#: Adam's optimizer step reads and writes per parameter: fp32 master, grad, m, v (4 x 4 read, 3 x 4 written) + the half weights (2 written)
OPTIMIZER_STEP_BYTES = 30.0


@dataclass
class Evaluation:
    """A priced layout: its partition, per-stage times and memory, per-rank memory, and predictions."""

    layout: Layout
    bounds: tuple[int, ...]
    stage_rank: tuple[int, ...]
    stage_times: StageTimes
    stage_recompute: tuple[float, ...]
    stage_params: tuple[float, ...]
    stage_memory: list[dict[str, float]]
    rank_memory: list[dict[str, float]]
    capacity: list[float]
    devices: list[str]
    sim: SimResult
    predicted: Predicted
    act_per_mb: tuple[float, ...]
    wgrad_per_mb: tuple[float, ...]
    time_source: tuple[str, ...]
    #: per pipeline rank, the routed experts' share of its memory: parameters, and bytes of weights, grads, optimizer
    expert_memory: list[dict[str, float]] = field(default_factory=list)
    #: seconds the search may compare with its cutoff: :func:`step_floor` plus the exposed gradient exchange and the
    #: optimizer step, less the extrapolation slack (never above the predicted step)
    pruning_floor: float = 0.0


@dataclass
class Rejection:
    """A layout that cannot run, why, and (when memory is the reason) how much it needs against what it has."""

    layout: Layout
    reason: str
    kind: RejectKind = RejectKind.RULE
    lower_bound: float = math.inf
    need_bytes: float | None = None
    capacity_bytes: float | None = None
    bounds: tuple[int, ...] | None = None  # the split whose most loaded rank needs need_bytes (memory rejections of a split)

    @property
    def overflow(self) -> float:
        """need / capacity (inf when not a memory rejection)."""
        if self.need_bytes is None or not self.capacity_bytes:
            return math.inf
        return self.need_bytes / self.capacity_bytes


@dataclass
class SearchResult:
    best: Evaluation | None
    ranked: list[Evaluation]
    rejected: list[Rejection]
    considered: int
    priced: int
    global_batch: int


# --------------------------------------------------------------------------- helpers


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def default_global_batch(world: int) -> int:
    return SAMPLES_PER_GPU * world


def expert_rules(lay: Layout, costs: ModelCosts) -> list[str]:
    """What an (ep, etp) breaks: Megatron's expert groups must tile the tp x cp x dp GPUs of a stage, and ep must
    divide the expert count (Megatron-LM core_v0.16 parallel_state.py, arguments.py)."""
    if lay.ep * lay.etp == 1:
        return []
    out = []
    out += lay.mesh.problems()
    experts = model_experts(costs)
    if not experts:
        out.append("the model has no routed experts for expert parallelism")
    elif experts % lay.ep:
        out.append(f"ep = {lay.ep} does not divide the {experts} experts of an MoE layer")
    return out


def _node_rules(tp: int, gpus_per_node: int) -> list[str]:
    if gpus_per_node % tp:
        return [f"tp = {tp} does not fit in a node of {gpus_per_node} GPUs (tensor parallelism stays inside a node)"]
    return []


# --------------------------------------------------------------------------- context


class Context:
    """Caches shared by the candidates of one search: scaled and sharded costs, piece times, memory prefix sums."""

    def __init__(self, costs: ModelCosts, cluster: Cluster, opts: Settings, engine: EngineRules):
        if engine.name != opts.engine:
            raise ValueError(f"search options are for engine {opts.engine!r}, the rules given are {engine.name!r}'s")
        self.costs = costs
        self.cluster = cluster
        self.opts = opts
        self.engine = engine
        self.allowed = engine.allowed_cuts(costs)
        self.min_gpus_per_node = min(g.gpus_per_node for g in cluster.groups)
        self._sharded: dict[tuple[int, int, bool, int], ModelCosts] = {}
        self._timed: dict[tuple[int, int, bool, int], ModelCosts] = {}
        #: the model's pieces by their costs (records.piece_classes), which scaling, sharding and splitting keep
        self.classes = piece_classes(self.costs.layers)
        self._classes: dict[tuple[int, int, bool, int, bool], tuple[ModelCosts, tuple[int, ...]]] = {}
        self._times: dict[tuple[object, ...], PieceTimes] = {}
        self._memory: dict[tuple[int, int, str, bool, int, bool, int, int, frozenset[str]], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        self._transient: dict[tuple[int, int, str, bool, int, bool, int, int, frozenset[str]], np.ndarray] = {}
        self._cuts: dict[tuple[int, int, bool, int], tuple[np.ndarray, np.ndarray]] = {}
        self._prefix: dict[int, tuple[PieceTimes, np.ndarray]] = {}
        self._p2p: dict[tuple[int, int, int, int, bool, bool, int], np.ndarray] = {}
        self._gemm: dict[tuple[int, int, int], np.ndarray] = {}
        self._scaled: dict[int, ModelCosts] = {}
        self._dispatches: dict[tuple[float, int, int, int], float] = {}
        self._cp_exchanges: dict[tuple[int, int, int, int, str], tuple[float, float]] = {}
        self._cp_transient: dict[tuple[int, int, int], np.ndarray] = {}
        self._terms: dict[tuple[object, ...], tuple[float, float]] = {}
        self._sum_max: dict[int, tuple[PieceTimes, float, float]] = {}
        self._coll: dict[tuple[int, int, int, bool, int], tuple[tuple[float, ...], float]] = {}
        self._sims: dict[tuple[object, ...], SimResult] = {}
        self._experts: dict[tuple[int, int, bool, int], bool] = {}
        self._devices: dict[tuple[int, int], tuple[tuple[DeviceProfile, ...], str | None]] = {}
        self._sends: dict[tuple[object, ...], tuple[list[np.ndarray], list[np.ndarray]]] = {}

    def sharded(self, b: int, tp: int, sp: bool = True, cp: int = 1) -> ModelCosts:
        key = (b, tp, sp and tp > 1, cp)
        if key not in self._sharded:
            self._sharded[key] = split_context(shard_costs(self.scaled(b), tp, sp and tp > 1, self.classes), cp, self.classes)
        return self._sharded[key]

    def timed(self, b: int, tp: int, sp: bool = True, cp: int = 1) -> ModelCosts:
        """The sharded costs with the memory-bound bytes of the layers the engine runs (``layer_traffic``)."""
        key = (b, tp, sp and tp > 1, cp)
        if key not in self._timed:
            self._timed[key] = self.engine.layer_traffic(self.sharded(b, tp, sp, cp), tp, sp and tp > 1, cp)
        return self._timed[key]

    def _timed_classes(self, b: int, tp: int, sp: bool, cp: int, compiled: bool) -> tuple[ModelCosts, tuple[int, ...]]:
        """:meth:`timed` (as torch.compile fuses it where ``compiled``) and its pieces' classes (records.piece_classes)."""
        key = (b, tp, sp and tp > 1, cp, compiled)
        if key not in self._classes:
            timed = self.timed(b, tp, sp, cp)
            if compiled:
                timed = compiled_traffic(timed, self.opts.loss_run.compiled)
            self._classes[key] = (timed, piece_classes(timed.layers))
        return self._classes[key]

    def has_expert_params(self, b: int, tp: int, sp: bool = True, cp: int = 1) -> bool:
        """Whether a piece of :meth:`sharded` holds routed-expert parameters."""
        key = (b, tp, sp and tp > 1, cp)
        if key not in self._experts:
            self._experts[key] = any(l.expert_params for l in self.sharded(b, tp, sp, cp).layers)
        return self._experts[key]

    def memory(
        self, b: int, tp: int, recompute: str, sp: bool = True, cp: int = 1, fp8: bool = False, ep: int = 1, etp: int = 1, modules: frozenset[str] = frozenset()
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(parameters, other static bytes, activation bytes per micro-batch, pending-W bytes) per piece range
        (``fp8``: the saved GEMM inputs as Transformer Engine's FP8 linear layers keep them; ``ep``/``etp``: experts
        split over the expert groups), with the saved activations of the layers the engine runs (``layer_activations``);
        for traced layers, the input rows the grouped GEMMs keep all-gathered over etp (:func:`expert_saved_extra`).
        ``modules``: what selective recomputation recomputes (Layout.modules_recomputed)."""
        key = (b, tp, recompute, sp, cp, fp8, ep, etp, modules)
        if key not in self._memory:
            sharded = self.sharded(b, tp, sp, cp)
            costs = self.engine.layer_activations(sharded, tp, sp and tp > 1, cp, recompute, etp, modules, self.opts.loss_run)
            policy = "none" if self.engine.checkpoints_itself else recompute  # the engine applied its own checkpointing
            trans = transient_matrix(costs, policy, fp8, self.engine.model_io_buffers)
            params, other, act, wgrad = range_matrices(costs, tp, policy, fp8, ep=ep, etp=etp, transient=trans)
            if costs is sharded:
                act = act + expert_saved_extra(sharded, tp if sp and tp > 1 else 1, etp, recompute)
            self._memory[key] = (params, other, act, wgrad)
            self._transient[key] = trans
        return self._memory[key]

    def transient(
        self, b: int, tp: int, recompute: str, sp: bool = True, cp: int = 1, fp8: bool = False, ep: int = 1, etp: int = 1, modules: frozenset[str] = frozenset()
    ) -> np.ndarray:
        """The part of :meth:`memory`'s other static bytes a stage allocates and frees while it runs (point-to-point
        buffers and working set, :func:`planner.solve.memory.transient_matrix`) per piece range."""
        self.memory(b, tp, recompute, sp, cp, fp8, ep, etp, modules)
        return self._transient[(b, tp, recompute, sp, cp, fp8, ep, etp, modules)]

    def gemm_params(self, tp: int, ep: int = 1, etp: int = 1) -> np.ndarray:
        """Parameters of the FP8 GEMM weights (transformer blocks' linear layers) per piece range, per GPU."""
        key = (tp, ep, etp)
        if key not in self._gemm:
            self._gemm[key] = gemm_param_matrix(self.costs, tp, ep, etp)
        return self._gemm[key]

    def cut_bytes(self, b: int, tp: int, sp: bool = True, cp: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Bytes sent forward and backward across each cut, per micro-batch, per GPU."""
        key = (b, tp, sp, cp)
        if key not in self._cuts:
            c = self.sharded(b, tp, sp, cp).cuts
            self._cuts[key] = (np.array([x.bytes for x in c], dtype=float), np.array([x.grad_bytes for x in c], dtype=float))
        return self._cuts[key]

    def p2p(self, b: int, tp: int, src: int, dst: int, forward: bool, sp: bool = True, cp: int = 1) -> np.ndarray:
        """Seconds to send each cut's forward (or gradient) bytes from global rank src to dst, with the device's
        per-message pipeline synchronisation cost."""
        key = (b, tp, src, dst, forward, sp, cp)
        if key not in self._p2p:
            fwd, bwd = self.cut_bytes(b, tp, sp, cp)
            sync = fixed_costs(self.cluster.device_of(src))[1]
            self._p2p[key] = _p2p(self.cluster, fwd if forward else bwd, src, dst, sync)
        return self._p2p[key]

    def rank_devices(self, p: int, block: int) -> tuple[tuple[DeviceProfile, ...], str | None]:
        """The device of each of ``p`` pipeline ranks of ``block`` consecutive GPUs, and why they cannot run (a rank
        spanning two kinds of device; None when they can)."""
        key = (p, block)
        if key not in self._devices:
            devices: list[DeviceProfile] = []
            span = None
            for r in range(p):
                d0, d1 = self.cluster.device_of(r * block), self.cluster.device_of((r + 1) * block - 1)
                if d0.key != d1.key:
                    span = f"pipeline rank {r} would span {d0.key} and {d1.key} GPUs (a stage must run on one kind of device)"
                    break
                devices.append(d0)
            self._devices[key] = (tuple(devices), span)
        return self._devices[key]

    def boundary_sends(self, b: int, tp: int, sp: bool, cp: int, block: int, stage_rank: tuple[int, ...]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per stage boundary, seconds to send each cut's activations forward and its gradients back (:meth:`p2p`)
        between the ranks of ``stage_rank`` (pipeline ranks of ``block`` GPUs). Shared by the layouts with the same
        micro-batch, tp, cp and stage placement; read only."""
        key = (b, tp, sp, cp, block, stage_rank)
        if key not in self._sends:
            send_f: list[np.ndarray] = []
            send_b: list[np.ndarray] = []
            for j in range(len(stage_rank) - 1):
                a, c = stage_rank[j] * block, stage_rank[j + 1] * block
                send_f.append(self.p2p(b, tp, a, c, forward=True, sp=sp, cp=cp))
                send_b.append(self.p2p(b, tp, c, a, forward=False, sp=sp, cp=cp))
            self._sends[key] = (send_f, send_b)
        return self._sends[key]

    def prefix(self, t: PieceTimes) -> np.ndarray:
        key = id(t)
        if key not in self._prefix:
            self._prefix[key] = (t, np.concatenate([[0.0], np.cumsum(t.total)]))
        return self._prefix[key][1]

    def scaled(self, b: int) -> ModelCosts:
        """The model's costs at micro-batch ``b``."""
        if b not in self._scaled:
            self._scaled[b] = self.costs.scaled(b, self.classes)
        return self._scaled[b]

    def _collectives(self, b: int, tp: int, first_rank: int, sp: bool, cp: int) -> tuple[tuple[float, ...], float]:
        """(tensor-parallel collective seconds per cut, ring-attention KV step seconds) for a stage starting at
        ``first_rank``: the same for every recompute mode, overlap and (ep, etp), so computed once."""
        key = (b, tp, first_rank, sp, cp)
        if key not in self._coll:
            coll: tuple[float, ...] = ()
            if tp > 1:
                ranks = list(range(first_rank, first_rank + tp))
                by_bytes: dict[float, float] = {}  # the residual stream's cuts mostly carry the same bytes
                for c in self.scaled(b).cuts[:-1]:
                    if c.bytes / cp not in by_bytes:
                        by_bytes[c.bytes / cp] = tp_collective_time(self.cluster, c.bytes / cp, ranks, sp)
                coll = tuple(by_bytes[c.bytes / cp] for c in self.scaled(b).cuts[:-1])
            step = 0.0
            if cp > 1:
                ring = [first_rank + k * tp for k in range(cp)]
                nbytes = kv_bytes(self.scaled(b), tp, cp)
                step = max(self.cluster.p2p_latency(x, y) + nbytes / self.cluster.p2p_bandwidth(x, y) for x, y in zip(ring, ring[1:] + ring[:1]))
            self._coll[key] = (coll, step)
        return self._coll[key]

    def _cp_exchange(self, b: int, tp: int, first_rank: int, cp: int, comm: str) -> tuple[float, float]:
        """(forward, backward) seconds of a context-parallel exchange that attention waits for
        (:func:`cp_exchange_exposed`), over the cp GPUs tp apart from ``first_rank`` (the ring's GPUs)."""
        key = (b, tp, first_rank, cp, comm)
        if key not in self._cp_exchanges:
            ranks = [first_rank + k * tp for k in range(cp)]
            scaled = self.scaled(b)
            self._cp_exchanges[key] = cp_exchange_exposed(self.cluster, comm, q_bytes(scaled, tp, cp), kv_bytes(scaled, tp, cp), ranks)
        return self._cp_exchanges[key]

    def _fused_core(self, b: int, tp: int, cp: int) -> list[float] | None:
        """Per piece, the forward FLOPs of an attention core the cost meter saw no score tensor of (a fused kernel),
        on one GPU at micro-batch ``b`` (:func:`attention_core_flops`, s / cp x b queries); None without an architecture."""
        arch = self.costs.architecture
        if not arch or not self.costs.seq_len:
            return None
        tokens = self.costs.seq_len / cp * b
        return [0.0 if l.core_flops_fwd > 0 else attention_core_flops(arch, l.kind, self.costs.seq_len, tokens, tp)[0] for l in self.costs.layers]

    def cp_gather_transient(self, b: int, tp: int, cp: int) -> np.ndarray:
        """Bytes per piece range that the all-gather exchange adds to a stage's working set (none where the range has no
        attention piece): backward holds the gathered keys and values and their gradients, cp x the rank's key + value
        block each (Transformer Engine AttnFuncWithCPAndKVAllGather.backward: k_ag, v_ag, and dk, dv of cp x the local
        length), of which the local block is already among the saved activations."""
        key = (b, tp, cp)
        if key not in self._cp_transient:
            extra = (2 * cp - 1) * kv_bytes(self.scaled(b), tp, cp)
            attn = np.concatenate([[0], np.cumsum([1 if l.core_flops_fwd > 0 or l.kind in ATTENTION_KINDS else 0 for l in self.costs.layers])])
            self._cp_transient[key] = np.where(attn[None, :] - attn[:, None] > 0, extra, 0.0)
        return self._cp_transient[key]

    def _dispatch(self, nbytes: float, first_rank: int, ep: int, etp: int) -> float:
        """Seconds of one token dispatch of ``nbytes`` per GPU (:func:`expert_dispatch_time`), shared by the pieces
        and candidates that route the same bytes from the same ranks."""
        key = (nbytes, first_rank, ep, etp)
        if key not in self._dispatches:
            self._dispatches[key] = expert_dispatch_time(self.cluster, nbytes, first_rank, ep, etp)
        return self._dispatches[key]

    def _dispatcher_terms(self, l: Layer, split: int, first_rank: int, ep: int, etp: int) -> tuple[float, float]:
        """The token dispatcher's own (forward, backward) seconds of a piece (:func:`moe_dispatcher_terms`; (0, 0) for
        a dense piece), shared by the pieces and candidates that route the same rows from the same ranks."""
        if not l.num_experts:
            return 0.0, 0.0
        dev = self.cluster.device_of(first_rank)
        key = (l.routed_rows / split, l.routed_bytes / split, l.num_experts, first_rank, ep, etp, dev.key)
        if key not in self._terms:
            self._terms[key] = moe_dispatcher_terms(
                self.cluster, dev, l.routed_rows / split, l.routed_bytes / split, l.num_experts, first_rank, ep, etp, fixed_costs(dev)[0]
            )
        return self._terms[key]

    def simulated(self, name: str, p: int, m: int, v: int, times: StageTimes, mem: StageMemory, group: int = 0) -> SimResult:
        """:func:`_simulate_extrapolated`, once per schedule, stage times and stage bytes: layouts that differ only in
        what the pipeline does not see (ZeRO level, optimizer state, overlaps of the gradient exchange) and got the
        same split simulate the same step. Each caller gets its own copy of the lists."""
        stages = (times.fwd, times.bwd_input, times.bwd_weight, times.send_fwd, times.send_bwd, mem.activation, mem.wgrad_pending)
        key = (name, p, m, v, group, *(tuple(x) for x in stages))
        if key not in self._sims:
            self._sims[key] = _simulate_extrapolated(name, p, m, v, times, mem, group)
        r = self._sims[key]
        return replace(
            r,
            busy=list(r.busy),
            peak_inflight=list(r.peak_inflight),
            peak_inflight_by_stage=list(r.peak_inflight_by_stage),
            peak_bytes=None if r.peak_bytes is None else list(r.peak_bytes),
            timeline=list(r.timeline),
            peak_pending_w=list(r.peak_pending_w),
        )

    def sum_and_max(self, t: PieceTimes) -> tuple[float, float]:
        """(sum, largest) of the pieces' total times, computed once per :class:`PieceTimes`."""
        key = id(t)
        if key not in self._sum_max:
            tot = t.total
            self._sum_max[key] = (t, sum(tot), max(tot))
        _, total, largest = self._sum_max[key]
        return total, largest

    def times(
        self,
        b: int,
        tp: int,
        recompute: str,
        first_rank: int,
        dtype: str,
        sp: bool = True,
        cp: int = 1,
        tp_overlap: bool = False,
        fp8: bool = False,
        ep: int = 1,
        etp: int = 1,
        ep_overlap: float = 0.0,
        modules: frozenset[str] = frozenset(),
        cp_comm: str = "p2p",
        compiled: bool = False,
    ) -> PieceTimes:
        """Per-piece times of one micro-batch on the device of ``first_rank``; ``compiled``: the blocks run as
        torch.compile fuses their memory-bound operators (timing.compiled_traffic; the loss too where the settings
        compile it)."""
        dev = self.cluster.device_of(first_rank)
        cp_comm = cp_comm if cp > 1 else "p2p"
        key = (b, tp, recompute, dev.key, sp, cp, tp_overlap, fp8, ep, etp, ep_overlap, modules, cp_comm, compiled)
        if key not in self._times:
            sharded = self.sharded(b, tp, sp, cp)
            timed, classes = self._timed_classes(b, tp, sp, cp, compiled)
            coll, step = self._collectives(b, tp, first_rank, sp, cp)
            kernel = fixed_costs(dev)[0]
            split = tp if sp and tp > 1 else 1  # tokens per GPU entering the MoE layers: 1/tp with sequence parallelism
            dispatch = [self._dispatch(l.routed_bytes / split, first_rank, ep, etp) if l.num_experts else 0.0 for l in sharded.layers]
            experts = (ep, split, dispatch)
            casts, kept = fp8_casts(self.costs, b, tp, cp, split, etp, self.engine, compiled) if fp8 else (None, None)
            coll_t = list(coll) if coll else 0.0
            terms = [self._dispatcher_terms(l, split, first_rank, ep, etp) for l in sharded.layers] if any(l.num_experts for l in sharded.layers) else None
            work = self.engine.recompute_work(sharded, tp, sp and tp > 1, cp, modules) if recompute == "selective" and modules else None
            t = analytical_times(
                timed,
                dev,
                dtype,
                recompute,
                tp,
                coll_t,
                tp_overlap,
                "fp8" if fp8 else None,
                kernel,
                cp,
                step,
                experts,
                casts,
                kept,
                terms,
                ep_overlap,
                work,
                self.engine.recomputes_attention_core(modules),
                dev.host_op_s,
                None if cp_comm == "p2p" else self._cp_exchange(b, tp, first_rank, cp, cp_comm),
                self._fused_core(b, tp, cp) if cp > 1 and cp_comm == "p2p" else None,
                classes,
            )
            measured = self.opts.knobs.measured.get(dev.key)
            if measured and tp == 1 and cp == 1 and not fp8 and ep * etp == 1:
                f = b / self.costs.micro_batch
                t = with_measured(t, {k: (fw * f, bw * f) for k, (fw, bw) in measured.items()}, recompute)
            self._times[key] = t
        return self._times[key]


def fp8_casts(
    costs: ModelCosts, b: int, tp: int, cp: int, split: int = 1, etp: int = 1, engine: EngineRules | None = None, compiled: bool = False
) -> tuple[list[tuple[list[float], list[float]]] | None, list[tuple[float, float]] | None]:
    """Per piece at micro-batch ``b`` on one GPU (s / cp x b tokens): the bytes of each FP8 cast the engine runs
    (``engine.fp8_cast_bytes``; without an engine Transformer Engine's, timing.fp8_cast_bytes; MoE pieces
    timing.moe_fp8_cast_bytes over the 1/``split`` of the routed rows a GPU routes, expert tensor parallelism ``etp``)
    and the attention-core FLOPs that stay in bf16 (timing.attention_core_flops); (None, None) without the model's
    architecture."""
    arch = costs.architecture
    if not arch or not costs.seq_len:
        return None, None
    tokens = costs.seq_len / cp * b
    f = b / costs.micro_batch / cp / split

    def dense(arch: Mapping[str, object], kind: str, tokens: float, tp: int) -> tuple[list[float], list[float]]:
        return engine.fp8_cast_bytes(arch, kind, tokens, tp, compiled) if engine is not None else fp8_cast_bytes(arch, kind, tokens, tp)

    casts = [moe_fp8_cast_bytes(arch, l.kind, tokens, tp, l.routed_rows * f, etp) if l.num_experts else dense(arch, l.kind, tokens, tp) for l in costs.layers]
    kept = [attention_core_flops(arch, l.kind, costs.seq_len, tokens, tp) for l in costs.layers]
    return casts, kept


def fixed_costs(device: DeviceProfile) -> tuple[float, float]:
    """(least seconds one operator takes, seconds of synchronisation per pipeline send/recv) from the device profile."""
    return device.kernel_floor_s, device.p2p_sync_s


# --------------------------------------------------------------------------- candidates


def enumerate_layouts(costs: ModelCosts, cluster: Cluster, opts: Settings, engine: EngineRules, global_batch: int) -> tuple[list[Layout], list[Rejection]]:
    """All layouts the engine could run for this cluster and global batch (pins applied), and the pinned ones it cannot."""
    world = cluster.world_size
    rules = engine
    gpn = min(g.gpus_per_node for g in cluster.groups)
    if opts.memory.fp8 and not engine.fp8:
        raise UsageError(
            f"engine {engine.name} has no FP8 training (FP8 GEMMs).",
            f"Use {engine.alternative(lambda e: e.fp8)} for --dtype fp8, or --dtype bf16.",
        )
    if opts.memory.loss_chunks and not engine.loss_chunks:
        raise UsageError(
            f"engine {engine.name} has no chunked loss (--loss-chunks).", f"Use {engine.alternative(lambda e: e.loss_chunks)} for --loss-chunks, or drop it."
        )
    if (opts.model.compile or opts.model.compile_loss) and not engine.compiles:
        raise UsageError(
            f"engine {engine.name} has no torch.compile option (--compile).", f"Use {engine.alternative(lambda e: e.compiles)} for --compile, or drop it."
        )
    if opts.memory.fp8:
        fp8_problems(cluster)
    if (opts.pins.cp or 1) > 1 and not engine.context_parallel:
        raise UsageError(
            f"engine {engine.name} runs no context parallelism (--cp {opts.pins.cp}).",
            f"Use {engine.alternative(lambda e: e.context_parallel)} for --cp > 1, or drop --cp.",
        )
    tps = [opts.pins.tp] if opts.pins.tp else [t for t in divisors(gpn) if t == 1 or rules.tensor_parallel]
    selective = rules.selective_applies(costs)
    recomputes = [opts.memory.recompute] if opts.memory.recompute else [r for r in rules.recompute_modes if r != "selective" or selective]
    zeros = [opts.pins.zero] if opts.pins.zero is not None else list(rules.zero_levels)
    schedules = [opts.pins.schedule] if opts.pins.schedule else list(engine.searched_schedules)
    if opts.pins.microbatch_group is not None and opts.pins.microbatch_group < 0:
        raise UsageError(f"--microbatch-group must be at least 1, got {opts.pins.microbatch_group}.", "Give the micro-batches per chunk group, at least --pp.")
    if opts.pins.microbatch_group:
        if opts.pins.schedule and opts.pins.schedule != "interleaved":
            raise UsageError(
                f"--microbatch-group applies to the interleaved schedule, not {opts.pins.schedule!r}.",
                "Use --schedule interleaved, or drop --microbatch-group.",
            )
        if not engine.microbatch_groups:
            raise UsageError(
                f"engine {engine.name} runs its schedule's own micro-batch group size (--microbatch-group {opts.pins.microbatch_group}).",
                f"Use {engine.alternative(lambda e: e.microbatch_groups)}, or drop --microbatch-group.",
            )
        schedules = ["interleaved"]
    if opts.pins.cp is not None and opts.pins.cp < 1:
        raise UsageError(f"--cp must be at least 1, got {opts.pins.cp}.", "Use --cp 1 (no context parallelism) or a divisor of the GPUs left after tp.")
    if opts.pins.cp:
        cps = [opts.pins.cp]
    else:
        long_seq = (costs.seq_len or 0) >= CP_MIN_SEQ
        cps = [1] + [c for c in CP_SIZES if engine.context_parallel and long_seq and (costs.seq_len or 0) % (2 * c) == 0]
    experts = expert_pin_problems(costs, opts, engine)
    experts = experts if engine.expert_parallel else 0  # the other engines run ep = etp = 1 only
    out: list[Layout] = []
    rejected: list[Rejection] = []
    n = costs.n
    for tp in tps:
        for cp in cps:
            model = tp * cp
            cp_comms = context_exchanges(cp, tp, costs, opts, engine)
            for pp in [opts.pins.pp] if opts.pins.pp else divisors(world // model) if world % model == 0 else []:
                if world % (model * pp):
                    continue
                dp = world // (model * pp)
                if opts.pins.dp and dp != opts.pins.dp:
                    continue
                for b in [opts.pins.micro_batch] if opts.pins.micro_batch else opts.knobs.micro_batches:
                    if global_batch % (dp * b):
                        continue
                    m = global_batch // (dp * b)
                    for sched in schedules if pp > 1 else [opts.pins.schedule or "1f1b"]:
                        if sched in ("interleaved", "interleaved-zb", "looped-bfs"):
                            vs = [opts.pins.vp] if opts.pins.vp else [v for v in opts.knobs.virtual_stages if pp * v <= n]
                        elif sched in ("zbv", "dualpipev"):
                            vs = [2]
                        else:
                            vs = [1]
                        if opts.pins.vp and opts.pins.vp not in vs:
                            continue
                        for v in vs:
                            if pp * v > n or (pp == 1 and v > 1) or (pp == 1 and sched not in ("1f1b", "gpipe")):
                                continue
                            for rc in recomputes:
                                for z in zeros:
                                    if opts.pins.zero is None and not engine.searches_zero(z, costs.dtype, dp):
                                        continue
                                    for group in microbatch_groups(sched, pp, m, opts, engine):
                                        for comm in cp_comms:
                                            base = Layout(
                                                engine.name,
                                                pp,
                                                tp,
                                                dp,
                                                v,
                                                b,
                                                m,
                                                global_batch,
                                                sched,
                                                rc,
                                                z,
                                                tp > 1,
                                                cp=cp,
                                                microbatch_group=group,
                                                cp_comm=comm,
                                            )
                                            for ep, etp in expert_layouts(experts, tp, cp, dp, opts):
                                                out += with_options(evolve(base, ep=ep, etp=etp), opts, engine)
    if not out:
        raise UsageError(_no_layout_message(world, opts, global_batch, costs), "Relax a pin, or change --global-batch or --gpus.")
    return out, rejected


def context_exchanges(cp: int, tp: int, costs: ModelCosts, opts: Settings, engine: EngineRules) -> tuple[str, ...]:
    """The context-parallel exchanges to try at cp x tp: the pinned one (then cp > 1 only: cp 1 exchanges nothing),
    else the engine's types that run there (:func:`planner.engines.base.cp_comm_problems`), else its default."""
    if opts.pins.cp_comm:
        return (opts.pins.cp_comm,) if cp > 1 else ()
    if cp == 1:
        return engine.cp_comm_types[:1]
    return tuple(c for c in engine.cp_comm_types if not cp_comm_problems(c, cp, tp, costs.architecture))


def microbatch_groups(sched: str, pp: int, m: int, opts: Settings, engine: EngineRules) -> tuple[int, ...]:
    """The interleaved micro-batch group sizes to try: ``opts.pins.microbatch_group`` None lets the engine choose, 0 pins the
    schedule's default, a size pins that size (0 when it equals the default); (0,) for the other schedules and without
    pipelining, none of those when a size is pinned."""
    pinned = opts.pins.microbatch_group
    if sched != "interleaved" or pp == 1:
        return () if pinned else (0,)  # a pinned group plans interleaved layouts only
    if pinned is None:
        return engine.interleaved_groups(pp, m)
    return (normalised_group(sched, pp, m, pinned),)


def model_experts(costs: ModelCosts) -> int:
    """The number of routed experts per MoE layer (the most of any piece); 0 for a dense model."""
    return max((l.num_experts for l in costs.layers), default=0)


def expert_pin_problems(costs: ModelCosts, opts: Settings, engine: EngineRules) -> int:
    """The model's expert count, after checking ``--ep`` / ``--etp`` against the model and the engine (UsageError)."""
    experts = model_experts(costs)
    for flag, value in (("--ep", opts.pins.ep), ("--etp", opts.pins.etp)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}.", f"Use {flag} 1 (no expert parallelism) or a divisor of tp x cp x dp.")
    wants = (opts.pins.ep or 1) > 1 or (opts.pins.etp or 1) > 1
    if wants and not experts:
        raise UsageError(
            f"--ep {opts.pins.ep or 1} / --etp {opts.pins.etp or 1}: the model has no routed experts to split.",
            "Drop --ep and --etp for a dense model (expert parallelism applies to mixture-of-experts layers).",
        )
    if wants and not engine.expert_parallel:
        raise UsageError(
            f"engine {engine.name} runs no expert parallelism (--ep {opts.pins.ep or 1}, --etp {opts.pins.etp or 1}).",
            f"Use {engine.alternative(lambda e: e.expert_parallel)}, or drop --ep/--etp.",
        )
    if opts.pins.ep and experts and experts % opts.pins.ep:
        raise UsageError(
            f"--ep {opts.pins.ep} does not divide the model's {experts} experts per MoE layer.", "Pick --ep among the divisors of the expert count."
        )
    if opts.overlaps.ep_comm_overlap:
        flag = "--overlap-moe-expert-parallel-comm"
        if "overlap-moe-expert-parallel-comm" not in engine.overlaps:
            raise UsageError(
                f"engine {engine.name} has no {flag}.", f"Use {engine.alternative(lambda e: 'overlap-moe-expert-parallel-comm' in e.overlaps)}, or drop {flag}."
            )
        if not experts or opts.pins.ep == 1:
            why = "the model has no routed experts" if not experts else "--ep 1 runs no expert-parallel all-to-all"
            raise UsageError(f"{flag}: {why} to overlap.", f"Drop {flag}, or plan a mixture-of-experts model with ep > 1.")
    return experts


def expert_layouts(experts: int, tp: int, cp: int, dp: int, opts: Settings) -> list[tuple[int, int]]:
    """(ep, etp) pairs for a stage of tp x cp x dp GPUs: ep over the divisors of the expert count and etp in
    {1, tp} (or as pinned), such that ep x etp divides tp x cp x dp (Megatron-LM core_v0.16 parallel_state.py:
    world % (etp x ep x pp) == 0; arguments.py: num_experts % ep == 0). A dense model gets only (1, 1)."""
    if not experts:
        return [(1, 1)]
    gpus = tp * cp * dp
    etps = [opts.pins.etp] if opts.pins.etp else sorted({1, tp})
    eps = [opts.pins.ep] if opts.pins.ep else [e for e in divisors(gpus) if experts % e == 0]
    return [(e, t) for e in eps for t in etps if gpus % (e * t) == 0]


def with_options(base: Layout, opts: Settings, engine: EngineRules) -> list[Layout]:
    """``base`` with the precision options and overlaps: pinned ones as given, the others as the engine defaults them;
    ``--tp-comm-overlap`` searched both ways where the engine has it and tp > 1."""
    defaults = engine.default_overlaps(base.tp, base.zero, base.dp * base.cp)
    grad = opts.overlaps.overlap_grad_reduce if opts.overlaps.overlap_grad_reduce is not None else defaults.get("overlap_grad_reduce", False)
    gather = opts.overlaps.overlap_param_gather if opts.overlaps.overlap_param_gather is not None else defaults.get("overlap_param_gather", False) and grad
    if opts.overlaps.tp_comm_overlap is not None:
        tpo = [opts.overlaps.tp_comm_overlap]
    else:
        compiled = opts.model.compile or not engine.overlap_needs_compile
        tpo = [False, True] if "tp-comm-overlap" in engine.overlaps and base.tp > 1 and base.sequence_parallel and compiled else [False]
    if opts.overlaps.ep_comm_overlap is not None:
        epo = [opts.overlaps.ep_comm_overlap]
    else:
        epo = [False, True] if "overlap-moe-expert-parallel-comm" in engine.overlaps and ep_overlap_allowed(base) else [False]
    return [
        evolve(
            base,
            tp_comm_overlap=t,
            ep_comm_overlap=e,
            overlap_grad_reduce=grad,
            overlap_param_gather=gather,
            main_grads_dtype=opts.memory.main_grads_dtype,
            optimizer_state_dtype=opts.memory.optimizer_state_dtype,
            fp8=opts.memory.fp8,
            fp8_param_gather=opts.memory.fp8_param_gather,
            compile=opts.model.compile,
            recompute_modules=opts.memory.recompute_modules if base.recompute == "selective" else (),
        )
        for t in tpo
        for e in epo
    ]


def fp8_problems(cluster: Cluster) -> None:
    """A UsageError when a device of ``cluster`` has no FP8 tensor cores (no fp8 peak in its profile)."""
    lacking = sorted({g.device.name for g in cluster.groups if "fp8" not in g.device.peak_flops})
    if lacking:
        raise UsageError(
            f"--dtype fp8 needs FP8 tensor cores, and {', '.join(lacking)} has none (its profile lists no fp8 peak).",
            "Use --dtype bf16 on this cluster, or plan for H100, H200 or B200 GPUs.",
        )


def _no_layout_message(world: int, opts: Settings, gb: int, costs: ModelCosts) -> str:
    pins = {
        k: getattr(opts.pins, k)
        for k in ("pp", "tp", "cp", "cp_comm", "dp", "vp", "ep", "etp", "micro_batch", "schedule", "microbatch_group")
        if getattr(opts.pins, k)
    }
    bits = [f"{world} GPUs", f"global batch {gb}"] + [f"{k}={v}" for k, v in pins.items()]
    why = []
    degrees = {k: v for k, v in pins.items() if k in ("pp", "tp", "cp", "dp")}
    if degrees and world % math.prod(degrees.values()):
        why.append(f"{world} is not divisible by {' x '.join(degrees)} = {math.prod(degrees.values())}")
    if opts.pins.cp_comm and opts.pins.cp == 1:
        why.append("--cp-comm-type plans context parallelism only, and --cp 1 exchanges nothing")
    elif opts.pins.cp_comm and not opts.pins.cp and (costs.seq_len or 0) < CP_MIN_SEQ:
        why.append(f"--cp-comm-type plans context parallelism only, tried from {CP_MIN_SEQ} tokens (the model has {costs.seq_len}; pin --cp)")
    if opts.pins.pp and opts.pins.pp > costs.n:
        why.append(f"the model has only {costs.n} pieces to place on {opts.pins.pp} stages")
    if opts.pins.micro_batch and opts.pins.dp and gb % (opts.pins.dp * opts.pins.micro_batch):
        why.append(f"global batch {gb} is not divisible by dp x micro-batch = {opts.pins.dp * opts.pins.micro_batch}")
    return f"No layout matches {', '.join(bits)}" + (f": {'; '.join(why)}." if why else " (no pp x tp x dp split divides the batch into whole micro-batches).")


def lower_bound(ctx: Context, lay: Layout, dtype: str) -> float:
    """A step time no partition or schedule of ``lay`` can beat: m x max(total / pp, largest piece) on its fastest device."""
    best = math.inf
    firsts = [0] if ctx.cluster.homogeneous else lay.mesh.firsts()
    seen = set()
    for first in firsts:
        key = ctx.cluster.device_of(first).key
        if key in seen:
            continue
        seen.add(key)
        t = ctx.times(
            lay.micro_batch,
            lay.tp,
            lay.recompute,
            first,
            dtype,
            lay.sequence_parallel,
            lay.cp,
            lay.tp_comm_overlap,
            lay.fp8,
            lay.ep,
            lay.etp,
            ep_paired(lay),
            lay.modules_recomputed,
            lay.cp_comm,
            lay.compile,
        )
        total, largest = ctx.sum_and_max(t)
        best = min(best, lay.num_microbatches * max(total / lay.pp, largest))
    return best


# --------------------------------------------------------------------------- pricing one layout


def evaluate_layout(
    ctx: Context, lay: Layout, dtype: str, bounds: Sequence[int] | None = None, explain: bool = True, cutoff: float = math.inf
) -> Evaluation | Rejection:
    """Price ``lay`` (:func:`price_layout`) and check that every rank fits its memory target (:func:`memory_rejection`)."""
    ev = price_layout(ctx, lay, dtype, bounds, explain, cutoff)
    if isinstance(ev, Rejection):
        return ev
    return memory_rejection(ev, ctx.opts.memory.mem_target) or ev


def memory_rejection(ev: Evaluation, mem_target: float) -> Rejection | None:
    """The rejection of a priced layout whose most loaded rank exceeds ``mem_target`` of its memory; None when all fit."""
    over = [(r, mem["total"], cap) for r, (mem, cap) in enumerate(zip(ev.rank_memory, ev.capacity)) if mem["total"] > cap * mem_target]
    if not over:
        return None
    r, need, cap = max(over, key=lambda x: x[1] / x[2])
    return Rejection(
        ev.layout,
        f"pipeline rank {r} needs {need / GiB:.1f} GiB of {cap / GiB:.1f} GiB ({mem_target:.0%} target: {cap * mem_target / GiB:.1f} GiB)",
        RejectKind.MEMORY,
        need_bytes=need,
        capacity_bytes=cap * mem_target,
        bounds=ev.bounds,
    )


def price_layout(
    ctx: Context, lay: Layout, dtype: str, bounds: Sequence[int] | None = None, explain: bool = True, cutoff: float = math.inf
) -> Evaluation | Rejection:
    """Partition ``lay`` (or take ``bounds``), simulate its schedule, and compute each rank's memory.

    Without ``bounds`` the partition keeps every stage within the memory target; with ``bounds`` the
    memory is computed and not judged (see :func:`memory_rejection`). Rejections here are rule, device
    and split problems, and (without ``bounds``) partitions that cannot fit.
    ``explain=False`` skips the second partition that names the overflowing stage of a rejected layout.
    A layout that fits and whose :func:`step_floor` (plus its exposed gradient exchange and optimizer step) exceeds
    ``cutoff`` seconds is a :attr:`RejectKind.BOUNDED` rejection, priced no further: its schedule is not simulated.
    """
    costs, cluster, opts = ctx.costs, ctx.cluster, ctx.opts
    problems = ctx.engine.layout_problems(lay, costs) + _node_rules(lay.tp, ctx.min_gpus_per_node) + expert_rules(lay, costs)
    if problems:
        return Rejection(lay, "; ".join(problems), RejectKind.RULE)
    p, v, tp, b, m, cp = lay.pp, lay.vp, lay.tp, lay.micro_batch, lay.num_microbatches, lay.cp
    S = p * v
    mesh = lay.mesh
    found, span = ctx.rank_devices(p, mesh.block)
    if span is not None:
        return Rejection(lay, span, RejectKind.DEVICES)
    devices = list(found)
    group = lay.microbatch_group
    m_order = (m if group else min(m, _peak_m(lay.schedule, p, m))) if p > 1 else 1
    sched = build_schedule(lay.schedule, p, m_order, v, group) if p > 1 else build_schedule("1f1b", 1, 1, 1)
    stage_rank = tuple(sched.stage_to_rank)
    sp = lay.sequence_parallel
    sharded = ctx.sharded(b, tp, sp, cp)
    n = costs.n

    # memory: static bytes (state, buffers, working set) and activation bytes per micro-batch, as (n+1)^2 matrices
    recipe = ctx.engine.state_recipe(costs.dtype, lay.zero, opts.memory.optimizer, lay)
    w, g, o = recipe.per_param(mesh.replicas)  # gradients are reduced and optimizer state sharded over dp x cp
    per_param = w + g + o
    ep, etp = lay.ep, lay.etp
    # Megatron's expert-data-parallel group; engines without expert parallelism treat experts as dense weights
    edp = mesh.expert_data_parallel if ctx.engine.expert_parallel else mesh.replicas
    we, ge, oe = recipe.per_param(edp)  # expert gradients and optimizer state: over the expert-data-parallel group
    params_m, other_m, act, wgrad = ctx.memory(b, tp, lay.recompute, sp, cp, lay.fp8, ep, etp, lay.modules_recomputed)
    trans_m = ctx.transient(b, tp, lay.recompute, sp, cp, lay.fp8, ep, etp, lay.modules_recomputed)
    experts_m = expert_range_params(sharded, ep, etp) if ep * etp > 1 or ctx.has_expert_params(b, tp, sp, cp) else None
    # held for the whole step: model state and the pieces' buffers; the transient bytes (trans_m) count once per rank
    static = params_m * per_param + (other_m - trans_m)
    if lay.cp > 1 and lay.cp_comm == "all_gather":  # the gathered keys and values, allocated and freed per attention piece
        trans_m = trans_m + ctx.cp_gather_transient(b, tp, cp)
    if recipe.fp8_gemm_bytes:  # TE's FP8 copies of the transformer blocks' GEMM weights
        static = static + ctx.gemm_params(tp, ep, etp) * recipe.fp8_gemm_bytes
    if experts_m is not None:
        static = static + experts_m * (we + ge + oe - per_param)
    if ctx.engine.sends_output_copies(lay.schedule):
        act = act + ctx.cut_bytes(b, tp, sp, cp)[0][None, :]
    frag = 1.0 + opts.knobs.overhead.fragmentation
    # the fragmentation reserve is charged on what is allocated and freed every micro-batch (the working set and the
    # point-to-point buffers, trans_m, here; the activations by the rank problem), never on the model state
    held_trans = trans_m * frag
    fixed = (
        opts.knobs.overhead.context
        + opts.knobs.overhead.communicator
        + feature_buffers(costs, lay, ctx.engine.tp_overlap_buffers, ctx.engine.fp8_amax_history, ctx.engine.tp_overlap_shard_buffers)
        + dispatch_buffer_bytes(sharded, lay)
    )
    points = rmem.order_points(sched.name, p, m if group else _points_m(sched.name, p, m), v, group) if p > 1 else rmem.order_points(sched.name, 1, 1, 1)
    if lay.ep_comm_overlap:
        points = one_more_in_flight(points)
    rp = rmem.RankProblem(
        static, act, wgrad, stage_rank, points, frag, (fixed,) * p, tuple(d.memory_bytes * opts.memory.mem_target for d in devices), held_trans
    )
    held = rmem.stage_held(points, S)
    # necessary condition, cheap: the ranks' needs summed (a lower bound for any split) must fit in their capacities summed
    total = rmem.lower_bound_total(rp, n)
    if bounds is None and total > sum(rp.capacity):
        cap = sum(d.memory_bytes for d in devices) / p
        return Rejection(
            lay,
            f"needs at least {total / p / GiB:.1f} GiB per GPU on average over its {p} pipeline ranks whatever the split (a lower bound), "
            f"of {cap / GiB:.1f} GiB ({opts.memory.mem_target:.0%} target: {cap * opts.memory.mem_target / GiB:.1f} GiB)",
            kind=RejectKind.MEMORY,
            need_bytes=total / p,
            capacity_bytes=cap * opts.memory.mem_target,
        )
    if bounds is None and not part.cuttable(ctx.allowed, S):  # what solve_split would answer, before the times are gathered
        return Rejection(lay, f"{n} pieces cannot be cut into {S} stages at the cut points this engine can use", RejectKind.SPLIT)

    # piece times per device class, and their prefix sums (seconds per micro-batch)
    classes: dict[str, int] = {}
    times_by_class: list[PieceTimes] = []
    for r in range(p):
        key = devices[r].key
        if key not in classes:
            classes[key] = len(classes)
            times_by_class.append(
                ctx.times(
                    b,
                    tp,
                    lay.recompute,
                    mesh.first_gpu(r),
                    dtype,
                    sp,
                    cp,
                    lay.tp_comm_overlap,
                    lay.fp8,
                    lay.ep,
                    lay.etp,
                    ep_paired(lay),
                    lay.modules_recomputed,
                    lay.cp_comm,
                    lay.compile,
                )
            )
    compute = [ctx.prefix(t) for t in times_by_class]
    stage_device = [classes[devices[stage_rank[j]].key] for j in range(S)]

    # boundary transfers: forward activations and backward gradients over the link between neighbouring stages
    send_f, send_b = ctx.boundary_sends(b, tp, sp, cp, mesh.block, stage_rank)
    zero = np.zeros(n + 1)
    comm_in = [zero] + [send_f[j - 1] + send_b[j - 1] for j in range(1, S)]
    comm_out = [send_f[j] + send_b[j] for j in range(S - 1)] + [zero]

    pb = part.PartitionProblem(
        compute=compute,
        stage_device=stage_device,
        comm_in=comm_in,
        comm_out=comm_out,
        static_mem=static + held_trans,
        act_mem=act * frag,
        held=held,
        capacity=[math.inf] * S,
        allowed=ctx.allowed,
    )
    if bounds is None:
        res = rmem.solve_split(pb, rp, explain=explain)
        if res.bounds is None:
            if not res.cuttable:
                return Rejection(lay, f"{n} pieces cannot be cut into {S} stages at the cut points this engine can use", RejectKind.SPLIT)
            if res.closest is None:  # explain=False: the least-overflowing split was not looked for
                return Rejection(lay, "no split of the pieces fits every rank's memory", RejectKind.MEMORY)
            reason, need_b, cap_b = _memory_reason(rp, res, devices, opts, v)
            return Rejection(lay, reason, RejectKind.MEMORY, need_bytes=need_b, capacity_bytes=cap_b, bounds=res.closest)
        bounds = res.bounds
    else:
        bounds = tuple(bounds)
        if len(bounds) != S + 1 or bounds[0] != 0 or bounds[-1] != n or any(a >= c for a, c in zip(bounds, bounds[1:])):
            return Rejection(lay, f"stage boundaries {list(bounds)} do not split {n} pieces into {S} stages", RejectKind.SPLIT)

    # simulate the schedule with these stages
    rng = list(zip(bounds, bounds[1:]))
    tclass = [times_by_class[stage_device[j]] for j in range(S)]
    F = [sum(tclass[j].fwd[a:c]) for j, (a, c) in enumerate(rng)]
    I = [sum(tclass[j].bwd_input[a:c]) + sum(tclass[j].recompute[a:c]) for j, (a, c) in enumerate(rng)]
    W = [sum(tclass[j].bwd_weight[a:c]) for j, (a, c) in enumerate(rng)]
    R = tuple(sum(tclass[j].recompute[a:c]) for j, (a, c) in enumerate(rng))
    sf = [float(send_f[j][bounds[j + 1]]) for j in range(S - 1)]
    sb = [float(send_b[j][bounds[j + 1]]) for j in range(S - 1)]
    times = StageTimes(F, I, W, sf, sb)
    if v == 1 and ctx.engine.blocking_sends(lay):
        times = times.blocking()
    act_mb = tuple(float(act[a, c]) for a, c in rng)
    wg_mb = tuple(float(wgrad[a, c]) for a, c in rng)

    # per-stage and per-rank memory
    stage_mem = []
    params = []
    gemm: list[float] = []
    expert_prm = []
    for j, (a, c) in enumerate(rng):
        prm = stage_params(sharded, a, c, tp, ep, etp)
        ex = expert_params_per_gpu(sharded, a, c, ep, etp)
        params.append(prm)
        expert_prm.append(ex)
        gemm.append(gemm_params(sharded, a, c, tp, ep, etp))
        st = float(static[a, c])
        dense = prm - ex
        copies = gemm[j] * recipe.fp8_gemm_bytes
        state = dense * per_param + ex * (we + ge + oe) + copies
        stage_mem.append(
            {
                "weights": dense * w + ex * we + copies,
                "grads": dense * g + ex * ge,
                "optimizer": dense * o + ex * oe,
                "buffers": st - state + float(trans_m[a, c]),
                "activations": held[j] * act_mb[j],
            }
        )
    need = rmem.rank_need(rp, bounds)  # the same answer the fit check and the rejections read
    rank_mem = []
    expert_mem: list[dict[str, float]] = []
    for r in range(p):
        js = [j for j in range(S) if stage_rank[j] == r]
        comp = {k: sum(stage_mem[j][k] for j in js) for k in ("weights", "grads", "optimizer", "buffers")}
        # one stage's transient bytes at a time (rank_need): the buffers held for the step, + the largest working set
        trans = [float(trans_m[rng[j]]) for j in js]
        comp["buffers"] += max(trans, default=0.0) - sum(trans)
        ex = sum(expert_prm[j] for j in js)
        expert_mem.append({"params": ex, "weights": ex * we, "grads": ex * ge, "optimizer": ex * oe})
        comp["activations"] = need.peak[r]
        comp["overhead"] = need.total[r] - sum(comp.values())
        comp["total"] = need.total[r]
        rank_mem.append(comp)
    for j, (a, c) in enumerate(rng):
        tensors = sum(stage_mem[j].values())
        stage_mem[j]["overhead"] = fixed / v + opts.knobs.overhead.fragmentation * (stage_mem[j]["activations"] + float(trans_m[a, c]))
        stage_mem[j]["total"] = tensors + stage_mem[j]["overhead"]
    # data-parallel gradient exchange (over dp x cp: context-parallel ranks hold the same weights) and optimizer step
    dp_exposed, opt_time = 0.0, 0.0
    replicas = mesh.replicas
    for r in range(p):
        # experts are reduced apart only where the engine has expert groups (elsewhere they are dense weights)
        ex = sum(expert_prm[j] for j in range(S) if stage_rank[j] == r) if ctx.engine.expert_parallel else 0.0
        prm = sum(params[j] for j in range(S) if stage_rank[j] == r) - ex  # dense: reduced over dp x cp
        dev = devices[r]
        ranks = mesh.grad_group(mesh.first_gpu(r))
        # experts: reduced over the expert-data-parallel group (expert rank order tp-ep-dp: etp x ep ranks apart)
        eranks = mesh.expert_data_group(mesh.first_gpu(r)) if ctx.engine.expert_parallel else ranks
        if replicas > 1 or (ex > 0 and edp > 1):
            # FP8 primary weights are all-gathered in their FP8 bytes (the blocks' GEMM weights, experts among them)
            fp8w = sum(gemm[j] for j in range(S) if stage_rank[j] == r) if recipe.fp8_gemm_gather_bytes is not None else 0.0
            reduce, gather = _dp_exchange(cluster, recipe, prm, ranks, max(0.0, fp8w - ex))
            e_reduce, e_gather = _dp_exchange(cluster, recipe, ex, eranks, ex if fp8w else 0.0) if ex > 0 else (0.0, 0.0)
            mine = [j for j in range(S) if stage_rank[j] == r]
            exposed = ctx.engine.exposed_dp_time(lay, reduce + e_reduce, gather + e_gather, [I[j] + W[j] for j in mine], [F[j] for j in mine], prm + ex)
            dp_exposed = max(dp_exposed, exposed)
        local = prm / (replicas if recipe.shard_optimizer else 1) + ex / (edp if recipe.shard_optimizer else 1)
        zeroed = (prm + ex) * recipe.grad_bytes if ctx.engine.zeroes_grad_buffer else 0.0  # the whole gradient buffer, unsharded
        opt_time = max(opt_time, memory_time(local * OPTIMIZER_STEP_BYTES + zeroed, dev))
    floor = (step_floor(times, stage_rank, m) + dp_exposed + opt_time) * (1.0 - _extrapolation_slack(sched.name, p, m, v, group))
    if floor > cutoff:
        return Rejection(lay, f"takes at least {floor:.4g} s a step with this split, more than the layouts ranked", RejectKind.BOUNDED)
    sim = ctx.simulated(sched.name, p, m, v, times, StageMemory(act_mb, wg_mb), group)
    step = sim.step_time + dp_exposed + opt_time
    predicted = _predicted(ctx, lay, step, sim, dp_exposed, opt_time, max(rm["total"] for rm in rank_mem), devices)
    return Evaluation(
        layout=lay,
        bounds=tuple(bounds),
        stage_rank=stage_rank,
        stage_times=times,
        stage_recompute=R,
        stage_params=tuple(params),
        stage_memory=stage_mem,
        rank_memory=rank_mem,
        capacity=[d.memory_bytes for d in devices],
        devices=[d.key for d in devices],
        sim=sim,
        predicted=predicted,
        act_per_mb=act_mb,
        wgrad_per_mb=wg_mb,
        time_source=tuple(times_by_class[0].source),
        expert_memory=expert_mem if any(x["params"] for x in expert_mem) else [],
        pruning_floor=floor,
    )


def _dp_exchange(cluster: Cluster, recipe: StateRecipe, prm: float, ranks: Sequence[int], fp8_prm: float = 0.0) -> tuple[float, float]:
    """(gradient reduce, parameter gather) seconds of ``prm`` parameters over ``ranks``: reduce-scatter + all-gather
    with a sharded optimizer, else one all-reduce. ``fp8_prm`` of them are FP8 primary weights, gathered in
    ``recipe.fp8_gemm_gather_bytes`` each."""
    if len(ranks) <= 1 or prm <= 0:
        return 0.0, 0.0
    if recipe.shard_optimizer:
        fp8_prm = min(fp8_prm, prm) if recipe.fp8_gemm_gather_bytes is not None else 0.0
        gathered = (prm - fp8_prm) * recipe.weight_bytes + fp8_prm * (recipe.fp8_gemm_gather_bytes or 0.0)
        return cluster.reduce_scatter_time(prm * recipe.grad_bytes, ranks), cluster.all_gather_time(gathered, ranks)
    return cluster.allreduce_time(prm * recipe.grad_bytes, ranks), 0.0


def expert_saved_extra(sharded: ModelCosts, split: int, etp: int, recompute: str) -> np.ndarray:
    """Activation bytes per micro-batch that expert tensor parallelism adds per piece range, as an (n+1)^2 matrix:
    the grouped GEMMs keep their input rows all-gathered over etp GPUs (etp x the 1/split of the routed rows the
    trace saves per GPU); 0 with etp 1 or under full recomputation (the block keeps only its input)."""
    n = sharded.n
    if etp <= 1 or recompute == "full":
        return np.zeros((n + 1, n + 1))
    extra = [l.routed_bytes / split * (etp - 1) if l.num_experts else 0.0 for l in sharded.layers]
    X = np.concatenate([[0.0], np.cumsum(extra)])
    return np.asarray(X[None, :] - X[:, None], dtype=float)


def dispatch_buffer_bytes(sharded: ModelCosts, lay: Layout) -> float:
    """Bytes of the token-dispatch buffers while an MoE layer runs with expert parallelism: the permuted rows a GPU
    sends and the rows it receives (each routed_bytes / split, x etp after the expert-TP all-gather), the largest
    MoE layer's; 0 without ep or etp (the rows are then the traced tensors themselves)."""
    if lay.ep * lay.etp <= 1:
        return 0.0
    split = lay.tp if lay.sequence_parallel and lay.tp > 1 else 1
    rows = max((l.routed_bytes for l in sharded.layers if l.num_experts), default=0.0) / split
    return rows * (1 + lay.etp)


def feature_buffers(
    costs: ModelCosts, lay: Layout, overlap_buffers: float = TP_OVERLAP_BUFFERS, amax_history: int = FP8_AMAX_HISTORY, shard_buffers: float = 0.0
) -> float:
    """Bytes per GPU of the buffers the layout's features allocate: the tensor-parallel overlap's buffers
    (``overlap_buffers`` x (s / cp x b) x h x 2 bytes, Megatron's TE userbuffers: :data:`TP_OVERLAP_BUFFERS`; and
    ``shard_buffers`` of one rank's sequence shard, 1 / tp of that) and an FP8 delayed-scaling state of
    ``amax_history`` entries for the transformer layers one pipeline rank holds (at most ceil(layers / pp)); the
    engine says each (EngineRules.tp_overlap_buffers, tp_overlap_shard_buffers, fp8_amax_history)."""
    arch = costs.architecture or {}
    out = 0.0
    if lay.tp_comm_overlap and arch and costs.seq_len:
        out += (overlap_buffers + shard_buffers / lay.tp) * costs.seq_len / lay.cp * lay.micro_batch * arch["hidden_size"] * 2.0
    if lay.fp8 and amax_history:
        blocks = len({l.block for l in costs.layers if l.block is not None})
        out += fp8_amax_bytes(-(-blocks // lay.pp), amax_history)
    return out


def _p2p(cluster: Cluster, nbytes: np.ndarray, a: int, b: int, sync_s: float = 0.0) -> np.ndarray:
    """Seconds to send each of ``nbytes`` from rank a to rank b: latency + synchronisation + bytes / bandwidth; 0 on the
    same rank or for no bytes."""
    if a == b:
        return np.zeros_like(nbytes)
    lat, bw = cluster.p2p_latency(a, b) + sync_s, cluster.p2p_bandwidth(a, b)
    return np.where(nbytes > 0, lat + nbytes / bw, 0.0)


def _peak_m(name: str, p: int, m: int) -> int:
    """Micro-batches enough for the held-count peaks to saturate (they depend on the order only: 1F1B's by m = p,
    interleaved's by one group of p per chunk, ZB-V's by 2p - 1), so 2p stands for any larger m."""
    return m if m <= 2 * p else _valid_m(name, p, 2 * p)


def _valid_m(name: str, p: int, target: int) -> int:
    return max(p, (target // p) * p)


def _points_m(name: str, p: int, m: int) -> int:
    """Micro-batches whose action order has the same count points as ``m``'s (tested on every schedule): the
    shortened step of :func:`_peak_m` where the counts saturate, all ``m`` where they keep growing with it (GPipe and
    looped BFS hold every micro-batch; interleaved rounds with ``m`` not a multiple of ``p`` change with ``m``)."""
    if name in ("gpipe", "looped-bfs") or (name in ("interleaved", "interleaved-zb") and m % p):
        return m
    return min(m, _peak_m(name, p, m))


def ep_paired(lay: Layout) -> float:
    """The share of passes --overlap-moe-expert-parallel-comm pairs for ``lay`` (timing.paired_share; 0 without it)."""
    if not lay.ep_comm_overlap:
        return 0.0
    g = lay.microbatch_group or interleaved_group_size(lay.pp, lay.num_microbatches)
    return paired_share(lay.pp, lay.vp, lay.num_microbatches, g if lay.pp > 1 else 1)


def one_more_in_flight(points: tuple[rmem.RankPoints, ...]) -> tuple[rmem.RankPoints, ...]:
    """The count points of an order that runs one forward more before its backwards, on any of the rank's stages:
    Megatron's --overlap-moe-expert-parallel-comm (core_v0.16.1 combined_1f1b.py) pairs the forward of micro-batch
    i + 1 with the backward of micro-batch i (without pipelining: phase k runs backward k and forward k + 1; interleaved:
    one warm-up forward more, schedules.py ``num_warmup_microbatches + 1``). Each point gains one held micro-batch on one
    stage, every stage tried: a bound (the combined phase frees the backward's layers while the forward's accumulate).
    Made once per ``points`` table (rank_memory.derived), so what the rank problem works out from a table once is
    worked out once for this one too."""

    def make() -> tuple[rmem.RankPoints, ...]:
        out = []
        for pts in points:
            k = len(pts.stages)
            held = np.concatenate([pts.held + np.eye(k)[i] for i in range(k)])
            out.append(rmem.RankPoints(pts.stages, held, np.concatenate([pts.pending] * k)))
        return tuple(out)

    return rmem.derived("one more in flight", points, make)


#: above this many actions (m x p x v) the simulation is extrapolated (:func:`_simulate_extrapolated`)
EXTRAPOLATE_ACTIONS = 20000
#: the micro-batch counts, in multiples of p, whose simulations the step is extrapolated from
EXTRAPOLATE_AT = (4, 8)


def _extrapolated_from(name: str, p: int, m: int, v: int, group: int = 0) -> tuple[int, int]:
    """The two micro-batch counts :func:`_simulate_extrapolated` extends a step from, (0, 0) where it simulates all ``m``."""
    if group:  # whole groups of the explicit size: every group full, as in the long run of the step
        m1, m2 = (group * -(-k * p // group) for k in EXTRAPOLATE_AT)
    else:
        m1, m2 = (_valid_m(name, p, k * p) for k in EXTRAPOLATE_AT)
    if p == 1 or m * p * v <= EXTRAPOLATE_ACTIONS or name == "gpipe" and m <= 4096 or m2 >= m:
        return 0, 0
    return m1, m2


#: how far below the simulated step an extrapolated one may come out (relative): the step floor prunes a layout only
#: when it exceeds the cutoff by more. The documented extrapolation errors are 0.054% on searched layouts and 0.8% on
#: random stage times (:func:`_simulate_extrapolated`); 2% covers both with room
EXTRAPOLATION_SLACK = 0.02


def _extrapolation_slack(name: str, p: int, m: int, v: int, group: int = 0) -> float:
    """:data:`EXTRAPOLATION_SLACK` where the step is extrapolated, else a float round-off margin."""
    return EXTRAPOLATION_SLACK if _extrapolated_from(name, p, m, v, group)[1] else 1e-9


def step_floor(times: StageTimes, stage_rank: Sequence[int], m: int) -> float:
    """Seconds no schedule of these stages can beat: for each rank, the forward chain it waits for before its first
    action plus all its work, the largest over ranks.

    Rank r's first action is a forward of one of its stages, and the forward of stage s needs the forward of stage
    s - 1 (plus its send when that stage is on another rank), so r starts no earlier than the forwards (and sends) of
    every stage below its lowest; its actions then run one at a time on its one compute stream: ``m`` forwards and
    ``m`` backwards (input and weight parts) of each of its stages. The simulator (planner.solve.simulate) obeys both
    rules, so its step is at least this for every schedule."""
    S = len(stage_rank)
    head, lowest = [0.0] * S, dict[int, int]()
    for s in range(1, S):
        cross = stage_rank[s - 1] != stage_rank[s]
        head[s] = head[s - 1] + times.fwd[s - 1] + (times.send_fwd[s - 1] if cross else 0.0)
    work: dict[int, float] = {}
    for s, r in enumerate(stage_rank):
        lowest.setdefault(r, s)
        work[r] = work.get(r, 0.0) + m * (times.fwd[s] + times.bwd_input[s] + times.bwd_weight[s])
    return max(head[lowest[r]] + work[r] for r in work)


def _simulate_extrapolated(name: str, p: int, m: int, v: int, times: StageTimes, mem: StageMemory, group: int = 0) -> SimResult:
    """Simulate; for many micro-batches (m x p x v above :data:`EXTRAPOLATE_ACTIONS`), simulate :data:`EXTRAPOLATE_AT`
    x p micro-batches and extend the difference linearly.

    Not exact: with unequal stage times and send delays a schedule's step grows linearly in m only once its transient
    has died out, which takes longer than the pipeline's fill. Against the full simulation, on the 86 layouts with
    m > 8p that a Llama 70B search on 1024 H100 and a 7B search on 64 price, extrapolating from 2p and 4p erred by up
    to 3.5% (interleaved, p 2, v 3) and from 4p and 8p by up to 0.054%; on random stage times, 2.4% and 0.8%
    (tests/solve/test_search.py; bench/NOTES.md)."""
    m1, m2 = _extrapolated_from(name, p, m, v, group)
    if not m2:
        return simulate(build_schedule(name, p, m, v, group), times, mem, timeline=False)
    r1 = simulate(build_schedule(name, p, m1, v, group), times, mem, timeline=False)
    r2 = simulate(build_schedule(name, p, m2, v, group), times, mem, timeline=False)
    period = (r2.step_time - r1.step_time) / (m2 - m1)
    step = r2.step_time + (m - m2) * period
    busy = [b2 + (b2 - b1) / (m2 - m1) * (m - m2) for b1, b2 in zip(r1.busy, r2.busy)]
    bubble = 1.0 - sum(busy) / (p * step) if step > 0 else 0.0
    return replace(r2, step_time=step, busy=busy, bubble_fraction=bubble)


def _memory_reason(rp: rmem.RankProblem, res: rmem.SplitResult, devices: Sequence[DeviceProfile], opts: Settings, v: int) -> tuple[str, float, float]:
    """Why no split fits: the rank that overflows most in the split that overflows least (reason, need, capacity at the target).

    The need is :func:`rank_memory.rank_need` of ``res.closest``, the number plan.json would report for it."""
    assert res.closest is not None
    need = rmem.rank_need(rp, res.closest)
    _, worst = need.overflow(rp.capacity)
    total, cap = need.total[worst], devices[worst].memory_bytes
    stages = [j for j, r in enumerate(rp.stage_rank) if r == worst]
    what = f"stage {worst}" if v == 1 else f"pipeline rank {worst} (stages {', '.join(str(j) for j in stages)})"
    if len(rp.stage_rank) == 1:
        split = ""
    elif res.proven:
        split = " with the split that overflows least (no split fits)"
    elif res.none_fits_proven:
        split = " with the least-overflowing split found (no split fits; this one is not proven to overflow least)"
    else:
        split = " with the least-overflowing split found (the split search stopped at its node limit, so a split that fits may exist)"
    reason = f"{what} needs {total / GiB:.1f} GiB of {cap / GiB:.1f} GiB ({opts.memory.mem_target:.0%} target: {rp.capacity[worst] / GiB:.1f} GiB){split}"
    return reason, total, rp.capacity[worst]


def model_flops_per_step(costs: ModelCosts, global_batch: int) -> float:
    """Model FLOPs of one step: 3 x forward FLOPs of every sample (backward = 2 x forward; recompute excluded), Megatron's convention."""
    fwd = sum(l.flops_fwd for l in costs.layers)
    return 3.0 * fwd * global_batch / costs.micro_batch


def _predicted(
    ctx: Context, lay: Layout, step: float, sim: SimResult, dp_exposed: float, opt_time: float, peak: float, devices: Sequence[DeviceProfile]
) -> Predicted:
    costs = ctx.costs
    world = lay.world
    flops = model_flops_per_step(costs, lay.global_batch)
    per_gpu = flops / step / world
    peak_flops = sum(d.flops(costs.dtype) for d in devices) / len(devices)
    return Predicted(
        step_time_s=step,
        tokens_per_s=lay.global_batch * costs.tokens_per_sample / step,
        samples_per_s=lay.global_batch / step,
        tflops_per_gpu=per_gpu / 1e12,
        mfu=per_gpu / peak_flops,
        bubble_fraction=sim.bubble_fraction,
        pipeline_time_s=sim.step_time,
        dp_comm_exposed_s=dp_exposed,
        optimizer_s=opt_time,
        peak_memory_bytes=int(peak),
    )


# --------------------------------------------------------------------------- the search


def search(costs: ModelCosts, cluster: Cluster, opts: Settings, engine: EngineRules, progress: Callable[[str, int, int], None] | None = None) -> SearchResult:
    """Find the fastest layouts for ``costs`` on ``cluster`` that ``engine`` can run (see the module docstring)."""
    if not 0 < opts.memory.mem_target <= 1:
        raise UsageError(f"--mem-target must be in (0, 1], got {opts.memory.mem_target}.")
    world = cluster.world_size
    gb = opts.pins.global_batch or default_global_batch(world)
    ctx = Context(costs, cluster, opts, engine)
    layouts, rejected = enumerate_layouts(costs, cluster, opts, engine, gb)
    dtype = costs.dtype
    bounded = sorted(((lower_bound(ctx, lay, dtype), i, lay) for i, lay in enumerate(layouts)), key=lambda x: (x[0], x[1]))
    ranked: list[Evaluation] = []
    priced = 0
    no_fit: dict[tuple[object, ...], list[Rejection]] = {}  # memory rejections by _dominance_group
    pool = _Pricer(ctx, dtype, _jobs(opts.knobs.jobs) if len(bounded) >= PARALLEL_MIN_LAYOUTS else 1)
    kept = max(opts.knobs.top_k, SHOWN_RANKED)
    try:
        for i, (lb, _, lay) in enumerate(bounded):
            if progress:
                progress("search", i + 1, len(bounded))
            if not opts.knobs.exhaustive and len(ranked) >= kept and lb > ranked[kept - 1].predicted.step_time_s:
                break
            lighter = None if opts.knobs.exhaustive else next((x for x in no_fit.get(_dominance_group(lay), ()) if _needs_no_less_memory(lay, x.layout)), None)
            if lighter is not None:
                reason = f"needs at least the memory of {lighter.layout.short()}, which does not fit"
                rejected.append(Rejection(lay, reason, RejectKind.DOMINATED, lb, lighter.need_bytes, lighter.capacity_bytes))
                continue
            explain = len(rejected) < 4 * opts.knobs.top_k
            # a layout slower than the kept'th ranked one can change no ranked layout a plan shows, nor any rejection
            cutoff = ranked[kept - 1].predicted.step_time_s if len(ranked) >= kept and not opts.knobs.exhaustive else math.inf
            pool.ahead(bounded, i, explain, cutoff)
            res = pool.result(i, lay, explain, cutoff)
            priced += 1
            # what pricing in this process would answer, whatever cutoff a process pricing ahead had (the same pick,
            # ranking and rejections for any number of processes)
            if res.kind is RejectKind.BOUNDED if isinstance(res, Rejection) else res.pruning_floor > cutoff:
                continue
            if isinstance(res, Rejection):
                res.lower_bound = lb
                rejected.append(res)
                if res.kind is RejectKind.MEMORY:
                    no_fit.setdefault(_dominance_group(lay), []).append(res)
                continue
            ranked.append(res)
            ranked.sort(key=lambda e: (e.predicted.step_time_s, _layout_key(e.layout)))
    finally:
        pool.close()
    if progress:
        progress("search", len(bounded), len(bounded))
    return SearchResult(ranked[0] if ranked else None, ranked, rejected, len(layouts), priced, gb)


#: the ranked layouts a plan shows (the pick and its alternatives, planner.planning.build_plan): the search keeps at
#: least these exact
SHOWN_RANKED = 6

#: the most processes a search prices layouts in, the fewest candidates worth starting them for, and the seconds a
#: search prices in this process first (a small search ends before it; the processes then start with its caches warm)
MAX_JOBS = 8
PARALLEL_MIN_LAYOUTS = 48
PARALLEL_AFTER_S = 1.0
#: candidates priced ahead per process: what the sequential loop would price next, in its order
AHEAD_PER_JOB = 4


def _jobs(asked: int) -> int:
    """Processes to price in: ``asked``, else PLANNER_JOBS, else the CPUs this process may run on (at most MAX_JOBS);
    1 where fork is not available."""
    import multiprocessing
    import os

    if "fork" not in multiprocessing.get_all_start_methods():
        return 1
    if asked > 0:
        return min(asked, MAX_JOBS)
    env = os.environ.get("PLANNER_JOBS", "")
    if env.isdigit() and int(env) > 0:
        return min(int(env), MAX_JOBS)
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_JOBS))


#: the search context forked pricing processes read (set in the parent just before the fork; never pickled)
_FORKED: tuple[Context, str] | None = None


def _forked_start() -> None:
    """A pricing process ends quietly when the search terminates it (not through the CLI's SIGTERM handler)."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _price_forked(job: tuple[Layout, bool, float]) -> Evaluation | Rejection:
    assert _FORKED is not None
    ctx, dtype = _FORKED
    return evaluate_layout(ctx, job[0], dtype, explain=job[1], cutoff=job[2])


class _Pricer:
    """Prices the search's candidates in order, speculatively ahead in forked processes when ``jobs`` > 1.

    Pricing is a pure function of (context, layout, explain), so a result priced ahead is the one the sequential loop
    would compute; the loop still decides, in its order, which candidates are priced (bound, dominance) and uses only
    those results, so the pick, the ranking and every rejection are the same for any number of processes. A candidate
    priced ahead with ``explain`` True where the loop then asks False (more rejections arrived meanwhile) is priced
    again in this process: the two differ in the rejection's wording only."""

    def __init__(self, ctx: Context, dtype: str, jobs: int):
        self.ctx, self.dtype, self.jobs = ctx, dtype, jobs
        self.pool: Any = None
        self.pending: dict[int, tuple[bool, Any]] = {}
        self.next_ahead = 0
        self.started = time.perf_counter()

    def ahead(self, bounded: Sequence[tuple[float, int, Layout]], i: int, explain: bool, cutoff: float) -> None:
        if self.jobs <= 1:
            return
        if self.pool is None:
            if time.perf_counter() - self.started < PARALLEL_AFTER_S:
                return
            import multiprocessing

            global _FORKED
            _FORKED = (self.ctx, self.dtype)
            # the parent's objects move to the collector's permanent generation before the fork: a child's collections
            # then never walk (and so never copy, page by page) the planner's whole heap - the traced model included
            gc.freeze()
            try:
                self.pool = multiprocessing.get_context("fork").Pool(self.jobs, initializer=_forked_start)
            finally:
                _FORKED = None
                gc.unfreeze()
        self.next_ahead = max(self.next_ahead, i)
        while self.next_ahead < min(len(bounded), i + self.jobs * AHEAD_PER_JOB):
            k = self.next_ahead
            self.pending[k] = (explain, self.pool.apply_async(_price_forked, ((bounded[k][2], explain, cutoff),)))
            self.next_ahead += 1

    def result(self, i: int, lay: Layout, explain: bool, cutoff: float) -> Evaluation | Rejection:
        got = self.pending.pop(i, None)
        if got is not None:
            was, handle = got
            res: Evaluation | Rejection = handle.get()
            # priced ahead under a cutoff no lower than this one (the ranked only get faster): BOUNDED still holds
            if was == explain or not isinstance(res, Rejection) or res.kind is RejectKind.BOUNDED:
                return res
        return evaluate_layout(self.ctx, lay, self.dtype, explain=explain, cutoff=cutoff)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
            self.pool = None


_RECOMPUTE_MEMORY = {"full": 0, "selective": 1, "none": 2}
#: the context-parallel exchanges by the memory they add: the ring and the all-to-all none (their tensors are the
#: rank's own blocks), the all-gather its gathered keys and values (Context.cp_gather_transient)
_CP_COMM_MEMORY = {"p2p": 0, "a2a": 0, "all_gather": 1}


def _dominance_group(lay: Layout) -> tuple[object, ...]:
    """The fields :func:`_needs_no_less_memory` requires equal: only layouts of one group can dominate each other."""
    return (lay.pp, lay.tp, lay.dp, lay.vp, lay.ep, lay.etp, lay.schedule, lay.microbatch_group, lay.cp)


def _needs_no_less_memory(lay: Layout, other: Layout) -> bool:
    """Whether ``lay`` needs at least ``other``'s memory on every rank: the same split of the cluster and schedule,
    a micro-batch at least as large, recompute keeping at least as much, no more optimizer sharding, every overlap
    the other has (--tp-comm-overlap allocates buffers; --overlap-moe-expert-parallel-comm runs a micro-batch more in
    flight), and a context-parallel exchange holding no less (:data:`_CP_COMM_MEMORY`).

    Holds because activations grow with the micro-batch while held counts depend on the schedule's order
    (GPipe: micro-batch x count is the global batch share, constant), and model state does not shrink.
    """
    return (
        lay.pp == other.pp
        and lay.tp == other.tp
        and lay.dp == other.dp
        and lay.vp == other.vp
        and lay.ep == other.ep
        and lay.etp == other.etp
        and lay.schedule == other.schedule
        and lay.microbatch_group == other.microbatch_group
        and _CP_COMM_MEMORY[lay.cp_comm] >= _CP_COMM_MEMORY[other.cp_comm]
        and lay.micro_batch >= other.micro_batch
        and _RECOMPUTE_MEMORY[lay.recompute] >= _RECOMPUTE_MEMORY[other.recompute]
        and lay.zero <= other.zero
        and lay.tp_comm_overlap >= other.tp_comm_overlap  # its userbuffers (feature_buffer_bytes) only add memory
        and lay.ep_comm_overlap >= other.ep_comm_overlap
        and lay.num_microbatches >= lay.pp
    )


def _layout_key(lay: Layout) -> tuple[int, int, int, int, int, str, int, int, int, bool, str]:
    """Deterministic tie-break: fewer stages, less tensor parallelism, no recompute, smaller micro-batch, less
    expert parallelism, the ring before the other context-parallel exchanges."""
    return (
        lay.pp,
        lay.tp,
        lay.vp,
        RECOMPUTE_MODES.index(lay.recompute),
        lay.micro_batch,
        lay.schedule,
        lay.zero,
        lay.ep,
        lay.etp,
        lay.cp_comm != "p2p",
        lay.cp_comm,
    )
