"""From a model file and a cluster to a Plan: load → trace → cost → search → Plan record.

``plan_model`` is what `planner plan` and `planner validate --model` call;
``build_plan`` turns a search result into the schema-versioned Plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner import hardware
from planner.engines import ENGINES, get_engine
from planner.errors import InfeasibleError, UsageError
from planner.hardware import Cluster
from planner.hardware.gpus import MAX_WORLD_SIZE
from planner.model import cache as model_cache
from planner.model.cache import ModelSummary
from planner.records import COUPLED_MIN_MICRO_BATCH, ModelCosts
from planner.solve.memory import GiB
from planner.solve.plan import Alternative, Layout, Plan, RankMemory, StagePlan
from planner.solve.rules import RejectKind
from planner.solve.search import SHOWN_RANKED, Context, Evaluation, Rejection, SearchResult, evaluate_layout, search, with_options
from planner.solve.settings import Settings

if TYPE_CHECKING:  # torch is imported only when a model is analysed: a plan from the cache of analysed models never loads it
    from planner.model.analyze import Analysis


def plan_model(req: Settings, progress: Callable[[str, int, int], None] | None = None) -> tuple[Plan, ModelSummary, SearchResult]:
    """Plan ``req``: returns (Plan, the model's summary, SearchResult). Raises InfeasibleError (exit 1) when nothing fits."""
    engine = get_engine(req.engine)  # unknown engine: a clear error before any work
    cluster = hardware.parse_gpus(
        req.cluster.gpus,
        gpus_per_node=req.cluster.gpus_per_node,
        inter_node_gbps=req.cluster.inter_node_gbps,
        profiles=hardware.available_profiles(req.cluster.hardware_profiles),
    )
    if req.model.dtype == "fp8":  # Transformer Engine FP8: bf16 weights and activations, FP8 GEMMs
        req = req.but(fp8=True)
    asked = (req.model.model_file, req.model.model_args, req.model.cost_micro_batch, "bf16" if req.memory.fp8 else req.model.dtype)
    full: Analysis | None = None
    if req.cluster.profile:  # matching measured pieces reads the traced graph itself: no cache
        full = analyze_model(*asked, list(req.model.leaf), req.model.tracer, sub_block_cuts=True, progress=progress)
        analysis = summary_of(full)
    else:
        analysis = summarize_model(*asked, list(req.model.leaf), req.model.tracer, progress=progress, cache=req.knobs.cache)
    problem = engine.architecture_problem(analysis.costs.architecture, Path(req.model.model_file).name)
    gap = analysis.gaps.get(engine.name)
    if problem and analysis.costs.architecture is None and gap is not None:
        # a transformers model: say why no shape was derived, not that a file lacks a function
        runs_as_is = [s.name for s in ENGINES.values() if s.rules.runs_model_file]
        problem = (
            f"{req.model.model_file}: {engine.name} builds its own model from flags, and no shape for it is derived from its transformers config: {gap}.",
            f"Plan it with {' or '.join(f'--engine {n}' for n in runs_as_is)}, which run the model as transformers builds it.",
        )
    if problem:
        raise UsageError(*problem)
    modules = engine.recompute_module_problems(req.memory.recompute_modules, analysis.costs)
    if modules:
        raise UsageError(
            f"--recompute-modules {','.join(req.memory.recompute_modules)}: {'; '.join(modules)}.", "Drop the modules named, or plan another model."
        )
    loss = analysis.costs.loss
    if loss is not None and loss.coupling and req.pins.micro_batch is None:
        # a micro-batch of one sample makes a batch-coupled loss degenerate (a contrastive loss over one pair is 0)
        req = req.but(micro_batches=tuple(b for b in req.knobs.micro_batches if b >= COUPLED_MIN_MICRO_BATCH))
    measured: dict[str, dict[int, tuple[float, float]]] = {}
    profile_notes: list[str] = []
    if full is not None and req.cluster.profile:
        from planner.model.profile_match import match_profile  # torch: loaded with the model it profiles

        measured, profile_notes = match_profile(req.cluster.profile, full, cluster)
    if req.pins.bounds is not None:
        result = evaluate_pinned(analysis.costs, cluster, req.but(measured=measured))
    else:
        result = search(analysis.costs, cluster, req.but(measured=measured), engine, progress=progress)
    if result.best is None:
        raise InfeasibleError(*_nothing_fits(analysis.costs, cluster, req, result))
    extra = {
        "model_file_sha256": analysis.sha256,
        "tracer_used": analysis.tracer,
    }
    if measured and result.best.layout.tp > 1:
        profile_notes.append(f"the measured times apply to tp = 1; this tp = {result.best.layout.tp} layout is timed analytically")
    experts = max((l.num_experts for l in analysis.costs.layers), default=0)
    if experts and not engine.expert_parallel:
        # an engine that builds the model from its architecture() can plan this one only where a shape was derived for it
        others = _engines_for(analysis.costs, req.engine, lambda e: e.expert_parallel)
        shard = f"; {' or '.join(f'--engine {e.name}' for e in others)} shards them over an expert-parallel group (--ep)" if others else ""
        profile_notes.append(
            f"{engine.name} runs no expert parallelism: every GPU of a stage holds all {experts} experts of each of its MoE "
            f"layers and their optimizer state{shard}"
        )
    plan = build_plan(analysis.costs, cluster, req, result, extra, notes=list(analysis.costs.notes) + profile_notes)
    return plan, analysis, result


def summary_of(analysis: Analysis) -> ModelSummary:
    """What planning reads of ``analysis`` (planner.model.cache.ModelSummary)."""
    gaps: dict[str, str | None] = {}
    if analysis.transformers is not None:
        config, causal = analysis.transformers
        gaps = {s.name: s.rules.architecture_from_config(config, causal, analysis.costs.seq_len)[1] for s in ENGINES.values()}
    return ModelSummary(analysis.costs, analysis.layer_graph.tracer, analysis.model_file.sha256, gaps)


def summarize_model(
    model_file: str | Path,
    model_args: dict[str, Any] | None,
    micro_batch: int,
    dtype: str,
    leaf: list[str],
    tracer: str,
    progress: Callable[[str, int, int], None] | None = None,
    cache: bool = True,
) -> ModelSummary:
    """:func:`analyze_model`'s summary, from the cache of analysed models where it holds one (planner.model.cache),
    else analysed and cached; ``cache`` False (``--no-cache``) neither reads nor writes it."""
    key = None
    if cache and model_cache.enabled():
        key = model_cache.cache_key(str(model_file), dict(model_args or {}), micro_batch, dtype, list(leaf), tracer, True)
    if key is not None:
        hit = model_cache.load(key)
        if hit is not None:
            return hit
    with model_cache.imports_recorded(Path(str(model_file))) as deps:
        summary = summary_of(analyze_model(model_file, model_args, micro_batch, dtype, list(leaf), tracer, sub_block_cuts=True, progress=progress))
    if key is not None:
        model_cache.store(key, summary, deps)
    return summary


def analyze_model(*args: Any, **kwargs: Any) -> Analysis:
    """planner.model.analyze.analyze (same arguments), with the architecture() an engine derives from the model's
    transformers config where the model file gives none: an ``hf:`` spec, or a file that builds a transformers model,
    the same derivation for both. The first engine in the registry that derives a shape gives it, so plan.json records
    the same shape whichever engine plans, and validate and calibrate price what plan prices."""
    from planner.model.analyze import analyze

    analysis = analyze(*args, **kwargs)
    if analysis.costs.architecture is not None or analysis.transformers is None:
        return analysis
    config, causal = analysis.transformers
    seq = analysis.costs.seq_len
    derived = next((a for a, _ in (s.rules.architecture_from_config(config, causal, seq) for s in ENGINES.values()) if a is not None), None)
    return analysis if derived is None else replace(analysis, costs=replace(analysis.costs, architecture=derived))


def evaluate_pinned(costs: ModelCosts, cluster: Cluster, req: Settings) -> SearchResult:
    """Price the one layout and stage split ``req`` pins completely (what `smoke` and `validate` re-price)."""
    need = ("pp", "tp", "dp", "vp", "micro_batch", "global_batch", "schedule", "recompute", "zero")
    given = req.flat()
    missing = [k for k in need if given[k] is None]
    if missing:
        raise UsageError(f"fixed stage boundaries need the whole layout pinned; missing: {', '.join(missing)}.")
    pp, tp, dp, vp, b, gb, zero = (int(given[k]) for k in ("pp", "tp", "dp", "vp", "micro_batch", "global_batch", "zero"))
    base = Layout(
        req.engine,
        pp,
        tp,
        dp,
        vp,
        b,
        gb // (dp * b),
        gb,
        str(req.pins.schedule),
        str(req.memory.recompute),
        zero,
        tp > 1,
        cp=req.pins.cp or 1,
        ep=req.pins.ep or 1,
        etp=req.pins.etp or 1,
        microbatch_group=req.pins.microbatch_group or 0,
        cp_comm=req.pins.cp_comm or get_engine(req.engine).cp_comm_types[0],
    )
    lay = with_options(base, req, get_engine(req.engine))[-1]
    ev = evaluate_layout(Context(costs, cluster, req, get_engine(req.engine)), lay, costs.dtype, bounds=req.pins.bounds)
    if isinstance(ev, Rejection):
        return SearchResult(None, [], [ev], 1, 1, gb)
    return SearchResult(ev, [ev], [], 1, 1, gb)


def _stage_plans(costs: ModelCosts, ev: Evaluation) -> list[StagePlan]:
    t = ev.stage_times
    out = []
    for j, (a, b) in enumerate(zip(ev.bounds, ev.bounds[1:])):
        mem = {k: int(round(v)) for k, v in ev.stage_memory[j].items()}
        out.append(
            StagePlan(
                index=j,
                rank=ev.stage_rank[j],
                pieces=(a, b),
                layers=(costs.layers[a].name, costs.layers[b - 1].name),
                time_fwd_s=t.fwd[j],
                time_bwd_s=t.bwd_input[j] + t.bwd_weight[j],
                time_bwd_weight_s=t.bwd_weight[j],
                time_recompute_s=ev.stage_recompute[j],
                send_fwd_s=t.send_fwd[j] if j < len(t.send_fwd) else 0.0,
                send_bwd_s=t.send_bwd[j] if j < len(t.send_bwd) else 0.0,
                params=int(round(ev.stage_params[j])),
                memory_bytes=mem,
                capacity_bytes=int(ev.capacity[ev.stage_rank[j]]),
                device=ev.devices[ev.stage_rank[j]],
            )
        )
    return out


def build_plan(costs: ModelCosts, cluster: Cluster, req: Settings, result: SearchResult, extra_inputs: dict[str, Any], notes: list[str]) -> Plan:
    """The Plan record for the best layout of ``result`` (torch-free)."""
    best = result.best
    assert best is not None
    alts: list[Alternative] = [Alternative(e.layout, e.predicted) for e in result.ranked[1:SHOWN_RANKED]]
    alts += [Alternative(r.layout, None, r.reason) for r in informative_rejections(result.rejected, 5)]
    devices = sorted({d for d in best.devices})
    dev_info = {}
    for key in devices:
        dev = next(cluster.device_of(r) for r in range(cluster.world_size) if cluster.device_of(r).key == key)
        dev_info[key] = {
            "name": dev.name,
            "memory_bytes": dev.memory_bytes,
            "peak_flops": dict(dev.peak_flops),
            "memory_bandwidth": dev.memory_bandwidth,
            "matmul_efficiency": dev.matmul_efficiency,
            "sustained_matmul": dev.sustained_matmul,
            "matmul_fp8_efficiency": dev.matmul_fp8_efficiency,
            "memory_efficiency": dev.memory_efficiency,
            "intra_bandwidth": dev.intra_bandwidth,
            "inter_bandwidth": dev.inter_bandwidth,
            "sources": dict(dev.sources),
        }
    opts = req
    model = {
        "pieces": [l.name for l in costs.layers],
        "kinds": [l.kind for l in costs.layers],
        "blocks": [l.block for l in costs.layers],
        "params": costs.total_params,
        "seq_len": costs.seq_len,
        "cost_micro_batch": costs.micro_batch,
        "dtype": costs.dtype,
        "flops_fwd_per_sample": sum(l.flops_fwd for l in costs.layers) / costs.micro_batch,
        "architecture": costs.architecture,
        "tied": [g.to_dict() for g in costs.tied],
    }
    if costs.loss is not None:
        model["loss"] = costs.loss.to_dict()
    assumptions = {
        "devices": dev_info,
        "runtime_overhead_bytes": {"context": opts.knobs.overhead.context, "communicator": opts.knobs.overhead.communicator},
        "fragmentation_reserve": opts.knobs.overhead.fragmentation,
        "mem_target": req.memory.mem_target,
        "optimizer": req.memory.optimizer,
        "time_sources": sorted(set(best.time_source)),
        "layouts_considered": result.considered,
        "layouts_priced": result.priced,
    }
    if best.expert_memory:
        assumptions["experts"] = expert_summary(costs, best)
    ranks = [RankMemory(r, {k: int(round(v)) for k, v in best.rank_memory[r].items()}, int(best.capacity[r])) for r in range(len(best.rank_memory))]
    return Plan(
        layout=best.layout,
        stages=_stage_plans(costs, best),
        ranks=ranks,
        predicted=best.predicted,
        alternatives=alts,
        settings=req.but(global_batch=result.global_batch),
        provenance=dict(extra_inputs),
        model=model,
        cluster=cluster.to_dict(),
        assumptions=assumptions,
        notes=notes,
    )


def expert_summary(costs: ModelCosts, ev: Evaluation) -> dict[str, Any]:
    """What plan.json records of a mixture-of-experts layout: the expert count, ep / etp, the expert-data-parallel
    group, and the most loaded rank's expert parameters and their weight, gradient and optimizer bytes."""
    lay = ev.layout
    worst = max(ev.expert_memory, key=lambda x: x["params"])
    return {
        "num_experts": max(l.num_experts for l in costs.layers),
        "moe_pieces": sum(1 for l in costs.layers if l.num_experts),
        "expert_params": sum(l.expert_params for l in costs.layers),
        "ep": lay.ep,
        "etp": lay.etp,
        "expert_data_parallel": lay.mesh.expert_data_parallel,
        "params_per_gpu": worst["params"],
        "bytes_per_gpu": {k: worst[k] for k in ("weights", "grads", "optimizer")},
        "dispatch": expert_dispatch(lay),
    }


def expert_dispatch(lay: Layout) -> str:
    """How the plan's MoE layers move tokens, for plan.json and the summary."""
    if lay.ep == 1:
        return "none: ep 1, each GPU runs every expert of its layers on its own tokens (no all-to-all)"
    if lay.ep_comm_overlap:
        return "alltoall over the ep group, hidden behind another micro-batch's compute (--overlap-moe-expert-parallel-comm)"
    return "alltoall over the ep group, exposed (no --overlap-moe-expert-parallel-comm)"


def informative_rejections(rejected: list[Rejection], k: int) -> list[Rejection]:
    """Up to ``k`` rejections worth showing: the most promising layouts first (lowest step-time bound), one per
    distinct reason, memory rejections before rule violations."""
    seen: set[str] = set()
    out: list[Rejection] = []
    for r in sorted(rejected, key=lambda r: (r.need_bytes is None, r.lower_bound)):
        key = r.reason if r.need_bytes is None else f"{r.layout.pp}/{r.layout.tp}/{r.layout.schedule}"
        if key in seen or r.kind is RejectKind.DOMINATED:
            continue
        seen.add(key)
        out.append(r)
        if len(out) == k:
            break
    return out


def human_count(x: float) -> str:
    """12, 218.4k, 6.74B parameters."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f}{unit}" if unit in ("T", "B") else f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def shortfall(need_bytes: float | None, capacity_bytes: float | None) -> str:
    """How many bytes ``need_bytes`` exceeds ``capacity_bytes`` by, for a message: GiB to one decimal from 0.1 GiB,
    whole MiB (at least 1) below it, where GiB would read "0.0 GiB short"."""
    short = (need_bytes or 0.0) - (capacity_bytes or 0.0)
    return f"{short / GiB:.1f} GiB" if short >= 0.1 * GiB else f"{max(1, round(short / 2**20))} MiB"


def _nothing_fits(costs: ModelCosts, cluster: Cluster, req: Settings, result: SearchResult) -> tuple[str, str]:
    """The message and the smallest change that would fit, for an InfeasibleError."""
    mem_rejects = sorted((r for r in result.rejected if r.kind.is_memory and r.need_bytes is not None), key=lambda r: (r.overflow, r.lower_bound))
    closest = ""
    if mem_rejects:
        r = mem_rejects[0]
        closest = f" The closest layout, {r.layout.short()}, is {shortfall(r.need_bytes, r.capacity_bytes)} short per GPU: {r.reason}."
    elif result.rejected:
        closest = f" For example {result.rejected[0].layout.short()}: {result.rejected[0].reason}."
    if not mem_rejects:
        reasons = sorted({r.reason for r in result.rejected})[:3]
        return (
            f"No layout of {human_count(costs.total_params)} parameters can run on {cluster.spec} ({cluster.world_size} GPUs) "
            f"with engine {req.engine}: " + "; ".join(reasons) + ".",
            "Relax the pins (--pp, --micro-batch, --schedule, ...) or change --global-batch.",
        )
    msg = f"No layout of {human_count(costs.total_params)} parameters fits on {cluster.spec} ({cluster.world_size} GPUs) with engine {req.engine}.{closest}"
    hints = []
    if req.memory.recompute not in (None, "full"):
        if _fits(costs, cluster, req.but(recompute="full")):
            hints.append("--recompute full would fit")
    if req.pins.micro_batch not in (None, 1):
        if _fits(costs, cluster, req.but(micro_batch=1)):
            hints.append("--micro-batch 1 would fit")
    if req.memory.mem_target < 1.0 and _fits(costs, cluster, req.but(mem_target=1.0)):
        hints.append("--mem-target 1.0 would fit (no headroom: risky)")
    more = _smallest_fitting_cluster(costs, cluster, req)
    if more:
        hints.append(f"{more[1]} would fit")
    experts = any(l.num_experts for l in costs.layers)
    engine = get_engine(req.engine)
    sharding = [] if engine.expert_parallel else _engines_for(costs, req.engine, lambda e: e.expert_parallel)
    if not hints and experts:
        # an engine without expert parallelism holds all of a layer's experts on every GPU of a stage
        for other in sharding:
            more = _smallest_fitting_cluster(costs, cluster, req.but(engine=other.name), start=1)
            if more:
                on = "" if more[0] == 1 else f" on {more[1]}"
                hints.append(f"--engine {other.name} (expert parallelism shards the experts){on} would fit")
                break
    if hints:
        hint = "Smallest change that fits: " + "; ".join(hints) + "."
    else:
        # the search already tried full recomputation and micro-batch 1 unless they were pinned to something else
        untried = [
            o for o, pinned in (("--recompute full", req.memory.recompute), ("--micro-batch 1", req.pins.micro_batch)) if pinned not in (None, "full", 1)
        ]
        hint = "Try more GPUs, " + ", ".join([*untried, "or a device with more memory."]) if untried else "Try more GPUs or a device with more memory."
    if not engine.tensor_parallel:
        for other in _engines_for(costs, req.engine, lambda e: e.tensor_parallel and (e.expert_parallel or not experts)):
            if f"--engine {other.name}" not in " ".join(hints):
                adds = (
                    "tensor and expert parallelism, which divide weights, activations and the experts"
                    if experts
                    else "tensor parallelism, which divides weights and activations"
                )
                hint += f" {other.title} (--engine {other.name}) adds {adds}."
                break
    return msg, hint


def _engines_for(costs: ModelCosts, current: str, has: Callable[[Any], bool]) -> list[Any]:
    """The rules of the other engines that have a feature (``has``) and can build this model (an engine that builds it
    from its architecture() needs a shape derived for it)."""
    return [
        s.rules
        for s in ENGINES.values()
        if s.name != current and has(s.rules) and not (s.rules.architecture_problem(costs.architecture, "the model") and costs.architecture is None)
    ]


def _smallest_fitting_cluster(costs: ModelCosts, cluster: Cluster, req: Settings, start: int = 2) -> tuple[int, str] | None:
    """(k, 'N GPUs (spec)') of the smallest k of ``start``, 2 x ``start`` ... 32 such that k times the nodes of a
    one-group ``cluster`` fit a layout (the resolved group: a custom profile, --gpus-per-node and --inter-node-gbps
    included), with the pipeline and data-parallel degrees left to the search; None if none does or the cluster is mixed."""
    if not (cluster.homogeneous and len(cluster.groups) == 1):
        return None
    g = cluster.groups[0]
    k = start
    while k <= 32 and g.size * k <= MAX_WORLD_SIZE:
        spec = f"{g.nodes * k}x{g.gpus_per_node}x{g.device.key}"
        bigger = Cluster(groups=(replace(g, nodes=g.nodes * k),), spec=spec, notes=cluster.notes)
        if _fits(costs, bigger, req.but(pp=None, dp=None)):
            return k, f"{bigger.world_size} GPUs ({spec})"
        k *= 2
    return None


def _fits(costs: ModelCosts, cluster: Cluster, req: Settings) -> bool:
    """Whether any layout fits; only the leanest options are tried (micro-batch 1, full recompute, ZeRO) unless pinned."""
    lean = req.but(
        micro_batch=req.pins.micro_batch or min(req.knobs.micro_batches),
        recompute=req.memory.recompute or "full",
        zero=req.pins.zero if req.pins.zero is not None else max(get_engine(req.engine).zero_levels),
    )
    try:
        return search(costs, cluster, lean.but(top_k=1), get_engine(req.engine)).best is not None
    except UsageError:
        return False
