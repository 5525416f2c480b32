"""`planner calibrate`: fit the time model's free parameters to measured runs and write a hardware profile.

A run is a plan directory and what it measured: its smoke.json (`planner smoke`)
or an engine log (Megatron-LM, DeepSpeed; planner.check.run_logs). Each run is
re-priced exactly as the planner prices it (planning.evaluate_pinned: the
layout and stage boundaries that ran, the model traced again, the hardware
profile with candidate parameter values), so the fitted profile predicts what
`planner plan --hardware-profile FILE` will predict.

The fit (:func:`fit_step_times`) works on u = log(parameter) and minimises
sum_i (log predicted_i(u) - log measured_i)^2 over the runs' step times by
Levenberg's damped Gauss-Newton on a finite-difference Jacobian: the damping
keeps every step out of the directions the runs do not see (so parameter
combinations no run identifies stay at the base profile's values), bounds are
enforced by projection, and a parameter pushed against its bound leaves the
active set. A parameter whose share of every run's step
time is under ``SENSITIVITY`` is not identified and keeps the base value. The
diagonal of the resolution matrix V_k V_k^T says which fitted parameters the
runs pin down alone (>= ``RESOLVED``) and which only in combination with others.

Memory (:func:`memory_rows`): where a run recorded each rank's peak allocated
and reserved bytes, the allocator's reserve (reserved / allocated - 1) is
measured, and also as a share of the rank's predicted activation bytes (what
the planner's reserve is charged on); the planner's fragmentation reserve is a
constant (RuntimeOverhead.fragmentation in planner/solve/memory.py, not a
profile field), so the measured values are reported and written to the
profile's notes, not applied.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from planner import hardware
from planner.check.run_logs import RunMeasurement, read_log, read_smoke
from planner.engines import ENGINES, get_spec
from planner.errors import UsageError
from planner.model_ref import ref_exists, resolve_recorded, resolve_ref
from planner.planning import evaluate_pinned
from planner.solve.memory import RuntimeOverhead
from planner.solve.plan import Plan, load_plan
from planner.solve.search import Evaluation
from planner.solve.settings import Settings

SENSITIVITY = 0.01  # d log(step) / d log(parameter) below this in every run: the runs do not identify the parameter
RCOND = 0.05  # singular values below this fraction of the largest are not fitted (ill-determined combinations)
RESOLVED = 0.9  # resolution-matrix diagonal at or above this: the parameter is pinned down on its own
FD_STEP = 1e-3  # finite-difference step in log(parameter)
MAX_ITERATIONS = 100
PLACEHOLDER_EFFICIENCY_MAX = 1000.0  # placeholder profiles (measured_at_runtime): the excess over 1 moves into the peak


@dataclass(frozen=True)
class Param:
    """One fittable profile number: the DeviceProfile attribute, its YAML field, what it scales."""

    attr: str
    field: str
    what: str
    fraction: bool  # an efficiency in (0, 1]


PARAMS = (
    Param("matmul_efficiency", "efficiency.matmul", "matmul (FLOP-bound) rate", True),
    Param("memory_efficiency", "efficiency.memory", "memory-bound operator rate", True),
    Param("intra_bandwidth", "intra_node.bandwidth_gbps_per_direction", "point-to-point bandwidth inside a node", False),
    Param("intra_latency", "intra_node.latency_us", "per-message latency inside a node", False),
    Param("allreduce_efficiency_intra", "efficiency.allreduce_intra", "collective (all-reduce) efficiency inside a node", True),
    Param("inter_bandwidth", "inter_node.bandwidth_gbps_per_direction", "bandwidth between nodes", False),
    Param("inter_latency", "inter_node.latency_us", "per-message latency between nodes", False),
    Param("allreduce_efficiency_inter", "efficiency.allreduce_inter", "collective efficiency between nodes", True),
)
BY_ATTR = {p.attr: p for p in PARAMS}
#: what the time model has no parameter for (so no run can fit it)
NOT_MODELLED = (
    ("per-micro-batch overhead (the time model has none: kernel launches, Python and framework work per micro-batch end up in the fitted compute rates)"),
)


def bounds(p: Param, base: hardware.DeviceProfile) -> tuple[float, float]:
    """(lowest, highest) value of ``p`` in the profile's units (fractions, bytes/s, seconds)."""
    if p.fraction:
        hi = PLACEHOLDER_EFFICIENCY_MAX if base.measured_at_runtime and p.attr in ("matmul_efficiency", "memory_efficiency") else 1.0
        return 0.005, hi
    if p.attr.endswith("latency"):
        return 1e-7, 0.1
    v = getattr(base, p.attr)
    return v / 1e3, v * 1e3


# --------------------------------------------------------------------------- runs


@dataclass
class Run:
    """A measured run, ready to re-price: the pinned request that reproduces it and its traced costs."""

    name: str
    plan_dir: str
    request: Settings
    costs: Any  # ModelCosts
    device_key: str
    profiles: dict[str, hardware.DeviceProfile]
    measurement: RunMeasurement
    step_time_s: float  # measured, seconds
    notes: list[str] = field(default_factory=list)

    def price(self, device: hardware.DeviceProfile) -> Evaluation:
        """The planner's evaluation of this run's layout with ``device`` standing for the run's device."""
        profiles = {**self.profiles, self.device_key: replace(device, key=self.device_key)}
        req = self.request
        cluster = hardware.parse_gpus(req.cluster.gpus, gpus_per_node=req.cluster.gpus_per_node, inter_node_gbps=req.cluster.inter_node_gbps, profiles=profiles)
        res = evaluate_pinned(self.costs, cluster, req)
        if res.best is None:
            reason = res.rejected[0].reason if res.rejected else "no reason recorded"
            raise UsageError(
                f"run {self.name}: the planner cannot price the layout that ran ({reason}).", "Check that the plan directory is the one the run used."
            )
        return res.best


def _model_path(plan: Plan, plan_dir: Path) -> str:
    """The model plan.json names (recorded relative to the plan directory), or as recorded by an older plan."""
    recorded = str(plan.settings.model.model_file)
    here = resolve_ref(recorded, plan_dir)
    return here if ref_exists(here) else recorded


def _mismatch(plan_dir: Path, what: str, source: str) -> UsageError:
    return UsageError(
        f"{source} does not belong to the plan in {plan_dir}: {what}.",
        "Pair each log with the plan directory that produced the run (the one whose configs were launched).",
    )


def _bounds_from_stats(rows: list[dict[str, Any]]) -> tuple[int, ...] | None:
    """Stage boundaries from smoke.json's per-rank ``pieces`` ([[a, b], ...] per rank, or [a, b])."""
    spans = set()
    for row in rows:
        pieces = row.get("pieces") if isinstance(row, dict) else None
        if not pieces:
            continue
        items = pieces if isinstance(pieces[0], (list, tuple)) else [pieces]
        spans.update((int(a), int(b)) for a, b in items)
    if not spans:
        return None
    spans = sorted(spans)
    if any(b0 != a1 for (_, b0), (a1, _) in itertools.pairwise(spans)) or spans[0][0] != 0:
        return None
    return tuple([a for a, _ in spans] + [spans[-1][1]])


def _smoke_model_args(doc: dict[str, Any]) -> dict[str, Any]:
    """The --model-arg values a smoke run scaled the model with: ``model_args`` when recorded, else its note."""
    from planner.model.args import parse_model_args

    if isinstance(doc.get("model_args"), dict):
        return dict(doc["model_args"])
    for note in doc.get("scale_down") or []:
        if note.startswith("model arguments "):
            pairs = [part.split(" -> ", 1) for part in note[len("model arguments ") :].split(", ")]
            if not all(len(p) == 2 for p in pairs):
                raise UsageError(
                    f"cannot read the scaled model arguments of the smoke run from its note {note!r}.",
                    "Re-run `planner smoke` without --model-arg, or calibrate from an engine log.",
                )
            return parse_model_args([f"{old.split('=', 1)[0]}={new}" for old, new in pairs])
    return {}


class _Analyses:
    """Trace each distinct model configuration once."""

    def __init__(self):
        self._cache: dict[tuple[Any, ...], Any] = {}

    def get(self, req: Settings):
        from planner.planning import summarize_model

        key = (
            req.model.model_file,
            repr(sorted(req.model.model_args.items())),
            req.model.cost_micro_batch,
            req.model.dtype,
            tuple(req.model.leaf),
            req.model.tracer,
        )
        if key not in self._cache:
            self._cache[key] = summarize_model(
                req.model.model_file,
                req.model.model_args,
                req.model.cost_micro_batch,
                req.model.dtype,
                list(req.model.leaf),
                req.model.tracer,
                cache=req.knobs.cache,
            )
        return self._cache[key]


def _finish_run(name: str, plan_dir: Path, plan: Plan, req: Settings, m: RunMeasurement, analyses: _Analyses, notes: list[str]) -> Run:
    a = analyses.get(req)
    want = plan.provenance.get("model_file_sha256")
    if want and a.sha256 != want:
        raise _mismatch(
            plan_dir,
            f"the model file {req.model.model_file} changed since the plan was made (sha256 {a.sha256[:12]}..., plan.json recorded {want[:12]}...)",
            m.source,
        )
    profiles = hardware.available_profiles(req.cluster.hardware_profiles)
    cluster = hardware.parse_gpus(req.cluster.gpus, gpus_per_node=req.cluster.gpus_per_node, inter_node_gbps=req.cluster.inter_node_gbps, profiles=profiles)
    keys = {g.device.key for g in cluster.groups}
    if len(keys) != 1:
        raise UsageError(
            f"run {name} ran on several kinds of device ({', '.join(sorted(keys))}); a profile describes one.",
            "Calibrate each device from runs on that device alone.",
        )
    return Run(name, str(plan_dir), req, a.costs, keys.pop(), profiles, m, m.step_time(req.pins.global_batch), notes)


def run_from_smoke(plan_dir: str | Path, analyses: _Analyses | None = None) -> Run:
    """The run recorded in PLAN_DIR/smoke.json: the (possibly scaled-down) plan that ran, re-pinned to its stage boundaries."""
    from planner.check.smoke import scaled_request

    plan_dir = Path(plan_dir)
    plan = load_plan(plan_dir)
    m = read_smoke(plan_dir / "smoke.json")
    doc = m.smoke
    if doc.get("engine") and doc["engine"] != plan.layout.engine:
        raise _mismatch(plan_dir, f"smoke.json ran engine {doc['engine']}, the plan is for {plan.layout.engine}", m.source)
    device = str(doc.get("device") or "cpu")
    req, _ = scaled_request(plan, plan_dir, int(doc.get("ranks") or plan.layout.pp * plan.layout.dp), device, _smoke_model_args(doc))
    ran = doc.get("layout") or {}
    for key in ("pp", "dp", "tp", "vp", "micro_batch", "schedule", "recompute", "zero", "global_batch"):
        if key in ran and ran[key] != req.flat()[key]:
            raise _mismatch(
                plan_dir, f"smoke.json ran {key} = {ran[key]}, the plan scales to {req.flat()[key]} (was the plan changed after the run?)", m.source
            )
    rows = doc.get("per_rank") or doc.get("ranks_stats") or []
    bounds_ran = _bounds_from_stats(rows) or req.pins.bounds
    notes = []
    if bounds_ran is None:
        notes.append("stage boundaries not recorded: re-split by the planner with the base profile")
    req = req.but(bounds=bounds_ran, mem_target=1.0, profile=None)
    analyses = analyses or _Analyses()
    run = _finish_run(f"{plan_dir.name} (smoke)", plan_dir, plan, req, m, analyses, notes)
    recorded = (doc.get("predicted") or {}).get("step_time_s")
    if recorded:
        again = run.price(run.profiles[run.device_key]).predicted.step_time_s
        if abs(again - recorded) > 1e-4 * recorded:
            raise _mismatch(
                plan_dir,
                f"re-pricing the layout that ran gives {again:.6g} s, smoke.json recorded {recorded:.6g} s "
                "(the plan, the model file or the hardware profile changed since the run)",
                m.source,
            )
    return run


def _plan_request(plan: Plan, plan_dir: Path) -> Settings:
    bounds_ = tuple([s.pieces[0] for s in plan.stages] + [plan.stages[-1].pieces[1]])
    profiles = resolve_recorded(plan.settings.cluster.hardware_profiles or (), plan_dir)
    return Settings.pinned_to(plan.inputs, plan.layout, bounds_, model_file=_model_path(plan, plan_dir), hardware_profiles=profiles)


_MEGATRON_LAYOUT = (
    ("pipeline_model_parallel_size", "pp"),
    ("tensor_model_parallel_size", "tp"),
    ("data_parallel_size", "dp"),
    ("micro_batch_size", "micro_batch"),
)
_MEGATRON_MODEL = (("num_layers", "num_layers"), ("hidden_size", "hidden_size"), ("num_attention_heads", "num_attention_heads"), ("seq_length", "seq_len"))


def check_log_matches(plan: Plan, plan_dir: Path, m: RunMeasurement) -> None:
    """Refuse a log whose engine, layout or model differs from the plan's."""
    lay = plan.layout
    if m.kind != lay.engine:
        raise _mismatch(plan_dir, f"it is a {m.kind} log and the plan is for {lay.engine}", m.source)
    if m.global_batch is not None:
        tolerance = get_spec(m.kind).part("logs").GLOBAL_BATCH_TOLERANCE if m.kind in ENGINES and get_spec(m.kind).has("logs") else 0.0
        close = abs(m.global_batch - lay.global_batch) <= tolerance * lay.global_batch
        if not close:
            raise _mismatch(plan_dir, f"the log's global batch is {m.global_batch}, the plan's {lay.global_batch}", m.source)
    if m.micro_batch is not None and m.micro_batch != lay.micro_batch:
        raise _mismatch(plan_dir, f"the log's micro-batch size is {m.micro_batch}, the plan's {lay.micro_batch}", m.source)
    if m.num_microbatches is not None and m.num_microbatches != lay.num_microbatches:
        raise _mismatch(plan_dir, f"the log runs {m.num_microbatches} micro-batches per step, the plan {lay.num_microbatches}", m.source)
    if m.stage_pieces:
        planned = {s.index: tuple(s.pieces) for s in plan.stages}
        for stage, span in sorted(m.stage_pieces.items()):
            if planned.get(stage) != span:
                raise _mismatch(plan_dir, f"the log's stage {stage} holds pieces [{span[0]}, {span[1]}), the plan's {list(planned.get(stage, ()))}", m.source)
    for arg, key in _MEGATRON_LAYOUT:
        if arg in m.arguments and str(getattr(lay, key)) != m.arguments[arg]:
            raise _mismatch(plan_dir, f"the log's {arg} is {m.arguments[arg]}, the plan's {key} is {getattr(lay, key)}", m.source)
    arch = plan.model.get("architecture") or {}
    for arg, key in _MEGATRON_MODEL:
        have = arch.get(key, plan.model.get(key))
        if arg in m.arguments and have is not None and str(have) != m.arguments[arg]:
            raise _mismatch(plan_dir, f"the log's model has {arg} = {m.arguments[arg]}, the plan's {have} (a different model)", m.source)


def run_from_log(log: str | Path, plan_dir: str | Path, analyses: _Analyses | None = None) -> Run:
    """A run measured by an engine's log, paired with the plan directory whose configs were launched."""
    plan_dir = Path(plan_dir)
    plan = load_plan(plan_dir)
    m = read_log(log)
    check_log_matches(plan, plan_dir, m)
    req = _plan_request(plan, plan_dir)
    return _finish_run(f"{plan_dir.name} ({Path(log).name})", plan_dir, plan, req, m, analyses or _Analyses(), [])


# --------------------------------------------------------------------------- the fit


@dataclass
class Fit:
    """The fitted device and what the fit says about each parameter."""

    base: hardware.DeviceProfile
    device: hardware.DeviceProfile
    status: dict[str, str]  # attr -> "fitted" | "at bound" | "jointly: a, b" | "poorly determined" | "not identified"
    sensitivity: dict[str, float]  # attr -> max over runs of |d log step / d log param| at the base
    iterations: int


def _with(base: hardware.DeviceProfile, attrs: Sequence[str], u: np.ndarray) -> hardware.DeviceProfile:
    return replace(base, **{a: float(math.exp(x)) for a, x in zip(attrs, u)})


def _log_steps(runs: Sequence[Run], dev: hardware.DeviceProfile) -> np.ndarray:
    return np.array([math.log(r.price(dev).predicted.step_time_s) for r in runs])


def _jacobian(runs, base, attrs, u, idx, f0) -> np.ndarray:
    J = np.zeros((len(runs), len(idx)))
    for k, j in enumerate(idx):
        du = u.copy()
        du[j] += FD_STEP
        J[:, k] = (_log_steps(runs, _with(base, attrs, du)) - f0) / FD_STEP
    return J


def _levenberg(runs, base, attrs, u, lo, hi, sensitive, y) -> tuple[np.ndarray, np.ndarray, float, set[int], int]:
    """Levenberg's damped Gauss-Newton from ``u`` over the ``sensitive`` parameters: (u, log steps, cost, at bound, iterations)."""
    active = list(sensitive)
    at_bound: set[int] = set()
    f = _log_steps(runs, _with(base, attrs, u))
    r = f - y
    cost = float(r @ r)
    mu, it = 1e-3, 0
    J = _jacobian(runs, base, attrs, u, active, f)
    for it in range(1, MAX_ITERATIONS + 1):
        if not active or cost < 1e-20:
            break
        A, g = J.T @ J, J.T @ r
        scale = max(float(np.max(np.diag(A))), 1e-12)
        un, fn, new_cost = u, f, cost
        while mu < 1e8:  # damp until the step lowers the cost (no movement along directions the runs do not see)
            step = -np.linalg.solve(A + mu * scale * np.eye(len(active)), g)
            un = u.copy()
            un[active] = np.clip(u[active] + step, lo[active], hi[active])
            fn = _log_steps(runs, _with(base, attrs, un))
            new_cost = float((fn - y) @ (fn - y))
            if new_cost < cost:
                break
            mu *= 4.0
        if new_cost >= cost:
            break
        done = cost - new_cost <= 1e-12 * cost
        u, f, r, cost = un, fn, fn - y, new_cost
        mu = max(mu / 3.0, 1e-9)
        for k, j in enumerate(list(active)):  # a parameter the fit pushes against its bound stays there
            if (u[j] <= lo[j] + 1e-9 and g[k] > 0) or (u[j] >= hi[j] - 1e-9 and g[k] < 0):
                active.remove(j)
                at_bound.add(j)
        if done or not active:
            break
        J = _jacobian(runs, base, attrs, u, active, f)
    return u, f, cost, at_bound, it


def fit_step_times(runs: Sequence[Run], base: hardware.DeviceProfile) -> Fit:
    """Fit the profile parameters the runs' step times identify (see the module docstring)."""
    if not runs:
        raise UsageError("no runs to calibrate from.", "Pass plan directories with a smoke.json, or --log FILE PLAN_DIR pairs.")
    attrs = [p.attr for p in PARAMS]
    lo = np.log([bounds(p, base)[0] for p in PARAMS])
    hi = np.log([bounds(p, base)[1] for p in PARAMS])
    u0 = np.log([getattr(base, a) for a in attrs])
    u = np.clip(u0, lo, hi)
    y = np.log([r.step_time_s for r in runs])
    f = _log_steps(runs, _with(base, attrs, u))
    J0 = _jacobian(runs, base, attrs, u, list(range(len(attrs))), f)
    sens = {a: float(np.max(np.abs(J0[:, j]))) for j, a in enumerate(attrs)}
    sensitive = [j for j, a in enumerate(attrs) if sens[a] >= SENSITIVITY]
    if not sensitive:
        raise UsageError(
            "too few runs to identify anything: no profile parameter changes the predicted step time of these runs by 1% or more.",
            "Calibrate from runs that train a model (at least two steps each).",
        )
    # the pipeline's critical path makes the cost non-convex (a transfer hidden behind compute in one regime is
    # exposed in another): start from the base and from each sensitive parameter 10x lower and higher, keep the
    # lowest cost, and among equal costs the point nearest the base (nothing moves that need not)
    starts = [u] + [np.where(np.arange(len(u)) == j, np.clip(u + d, lo, hi), u) for j in sensitive for d in (-math.log(10), math.log(10))]
    best = None
    for u_start in starts:
        got = _levenberg(runs, base, attrs, u_start, lo, hi, sensitive, y)
        if (
            best is None
            or got[2] < best[2] * (1 - 1e-6) - 1e-14
            or (got[2] <= best[2] * (1 + 1e-6) + 1e-14 and np.linalg.norm(got[0] - u) < np.linalg.norm(best[0] - u))
        ):
            best = got
    u, f, _, at_bound, it = best
    status: dict[str, str] = {a: "not identified" for a in attrs}
    for j in at_bound:
        status[attrs[j]] = "at bound"
    free = [j for j in sensitive if j not in at_bound]
    if free:
        J = _jacobian(runs, base, attrs, u, free, f)
        _, s, Vt = np.linalg.svd(J, full_matrices=False)
        keep = s >= RCOND * s[0] if s.size and s[0] > 0 else np.zeros(0, bool)
        V = Vt[keep]
        R = V.T @ V
        for k, j in enumerate(free):
            if R[k, k] >= RESOLVED:
                status[attrs[j]] = "fitted"
            else:
                partners = [attrs[free[q]] for q in range(len(free)) if q != k and abs(R[k, q]) >= 0.05]
                status[attrs[j]] = "jointly: " + ", ".join(partners) if partners else "poorly determined"
    # parameters outside the sensitive set never moved: they keep exactly the base value (no exp(log(x)) round-off)
    device = replace(_with(base, attrs, u), **{a: getattr(base, a) for a in attrs if status[a] == "not identified"})
    return Fit(base, device, status, sens, it)


# --------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class MemoryRow:
    """Peak memory of one pipeline rank of one run (bytes); ``None`` where the run did not record it."""

    run: str
    pipe_rank: int
    measured_allocated: int | None
    measured_reserved: int | None
    predicted_tensors: float  # what the planner says the rank allocates (its total less the runtime reserve)
    predicted_total: float  # with the context, communicator and fragmentation reserves
    predicted_activations: float = 0.0  # the rank's simulated activation peak (what the fragmentation reserve is charged on)


def memory_rows(runs: Sequence[Run], evs: Sequence[Evaluation]) -> list[MemoryRow]:
    """Measured against predicted peak memory, per pipeline rank (global rank r is pipeline rank r // (tp x dp))."""
    rows = []
    for run, ev in zip(runs, evs):
        lay = ev.layout
        per = max(lay.tp * lay.dp, 1)
        alloc: dict[int, int] = {}
        res: dict[int, int] = {}
        for rank, b in run.measurement.peak_allocated.items():
            alloc[rank // per] = max(alloc.get(rank // per, 0), b)
        for rank, b in run.measurement.peak_reserved.items():
            res[rank // per] = max(res.get(rank // per, 0), b)
        for pr in sorted(set(alloc) | set(res)):
            if pr >= len(ev.rank_memory):
                continue
            mem = ev.rank_memory[pr]
            rows.append(MemoryRow(run.name, pr, alloc.get(pr), res.get(pr), mem["total"] - mem["overhead"], mem["total"], mem["activations"]))
    return rows


def measured_fragmentation(rows: Sequence[MemoryRow]) -> float | None:
    """The caching allocator's reserve, median over ranks of reserved / allocated - 1 (None without both)."""
    ratios = [r.measured_reserved / r.measured_allocated - 1.0 for r in rows if r.measured_reserved and r.measured_allocated]
    return max(0.0, statistics.median(ratios)) if ratios else None


def measured_reserve_of_activations(rows: Sequence[MemoryRow]) -> float | None:
    """The caching allocator's reserve as a share of the predicted activations, median over ranks of
    (reserved - allocated) / activations (None without both measurements or without activations)."""
    ratios = [
        (r.measured_reserved - r.measured_allocated) / r.predicted_activations
        for r in rows
        if r.measured_reserved and r.measured_allocated and r.predicted_activations > 0
    ]
    return max(0.0, statistics.median(ratios)) if ratios else None


# --------------------------------------------------------------------------- the profile


def _round(x: float) -> float:
    return float(f"{x:.4g}")


def profile_document(name: str, fit: Fit, runs: Sequence[Run], dtypes: Sequence[str]) -> dict[str, Any]:
    """The hardware-profile mapping (planner/hardware.py schema) for the fitted device.

    Fitted efficiencies above 1 (allowed only for placeholder profiles) are written as 1 with the excess
    moved into the peak (matmul, for the runs' dtypes; the other dtypes keep their achieved rate) or the
    memory bandwidth.
    """
    b, d = fit.base, fit.device
    mm_eff, mem_eff = d.matmul_efficiency, d.memory_efficiency
    mm_out, mem_out = min(mm_eff, 1.0), min(mem_eff, 1.0)
    peaks = {}
    for dt, fl in b.peak_flops.items():
        rate = fl * (mm_eff if dt in dtypes else b.matmul_efficiency)  # achieved large-GEMM FLOP/s
        peaks[dt] = _round(rate / mm_out / 1e12)
    bandwidth = _round(b.memory_bandwidth * mem_eff / mem_out / 1e9)
    run_list = "; ".join(f"{r.name}: {r.measurement.source}" for r in runs)
    sources = dict(b.sources)
    fitted = [p for p in PARAMS if fit.status[p.attr] != "not identified"]
    for p in fitted:
        v0, v1 = getattr(b, p.attr), getattr(d, p.attr)
        how = {"fitted": "fitted", "at bound": "fitted (held at its bound)"}.get(
            fit.status[p.attr], f"fitted {fit.status[p.attr].replace('jointly: ', 'jointly with ')} (the runs fix only their combination)"
        )
        sources[p.field] = (
            f"{how} by `planner calibrate` to the step times of {len(runs)} run(s) [{run_list}]: {_unit(p, v1)} (base profile {b.key}: {_unit(p, v0)})."
        )
    if mm_eff > 1.0:
        for dt in dtypes:
            if dt in b.peak_flops:
                sources[f"peak_tflops.{dt}"] = (
                    f"achieved large-GEMM rate fitted by `planner calibrate` ({_round(b.peak_flops[dt] * mm_eff / 1e12)} TFLOP/s "
                    f"= placeholder peak x fitted efficiency {mm_eff:.4g}), written with efficiency.matmul 1.0"
                )
        for dt in b.peak_flops:
            if f"peak_tflops.{dt}" not in sources:
                sources[f"peak_tflops.{dt}"] = (
                    sources.get("peak_tflops") or ""
                ) + f" (rescaled so its achieved rate is unchanged with efficiency.matmul {mm_out:g})"
    if mem_eff > 1.0:
        sources["memory_bandwidth_gbps"] = (
            f"achieved rate fitted by `planner calibrate` (placeholder {b.memory_bandwidth / 1e9:g} GB/s x fitted efficiency "
            f"{mem_eff:.4g}), written with efficiency.memory 1.0"
        )

    def eff(attr: str, out: float | None = None) -> float:
        return _round(out if out is not None else getattr(d, attr))

    return {
        "schema": hardware.SCHEMA_VERSION,
        "name": name,
        "aliases": [],
        "memory_gib": b.marketed_memory_gib,
        "usable_memory_bytes": b.memory_bytes,
        "peak_tflops": peaks,
        "memory_bandwidth_gbps": bandwidth,
        "intra_node": {
            "topology": b.intra_topology,
            "bandwidth_gbps_per_direction": _round(d.intra_bandwidth / 1e9),
            "latency_us": _round(d.intra_latency * 1e6),
        },
        "pcie_gbps_per_direction": _round(b.pcie_bandwidth / 1e9),
        "inter_node": {
            "bandwidth_gbps_per_direction": _round(d.inter_bandwidth / 1e9),
            "latency_us": _round(d.inter_latency * 1e6),
            "fabric": b.inter_fabric or f"as in the base profile {b.key}",
        },
        "gpus_per_node": b.gpus_per_node,
        "efficiency": {
            "matmul": eff("matmul_efficiency", mm_out),
            "memory": eff("memory_efficiency", mem_out),
            "allreduce_intra": eff("allreduce_efficiency_intra"),
            "allreduce_inter": eff("allreduce_efficiency_inter"),
            **kept_efficiency(b),
        },
        **({"fixed_costs": fixed_costs_of(b)} if b.kernel_floor_s or b.p2p_sync_s or b.host_op_s else {}),
        "sources": sources,
    }


def fixed_costs_of(base: hardware.DeviceProfile) -> dict[str, float]:
    """The base profile's fixed costs as its ``fixed_costs`` mapping (microseconds; host_us only where set)."""
    out = {"kernel_us": base.kernel_floor_s * 1e6, "p2p_sync_us": base.p2p_sync_s * 1e6}
    return out | ({"host_us": base.host_op_s * 1e6} if base.host_op_s else {})


def kept_efficiency(base: hardware.DeviceProfile) -> dict[str, Any]:
    """The base profile's efficiency fields the fit does not touch and the time model reads: its size curves (where not
    the defaults), FP8 GEMM ceiling and curve, and sustained fraction (where not 1), so the written profile prices as
    the fitted device did."""
    out: dict[str, Any] = {}
    for key, curve, default in (
        ("matmul_size_scale", base.matmul_size_scale, hardware.MATMUL_SIZE_SCALE),
        ("memory_size_scale", base.memory_size_scale, hardware.MEMORY_SIZE_SCALE),
        ("matmul_fp8_size_scale", base.matmul_fp8_size_scale, ()),
    ):
        if tuple(curve) != tuple(default):
            out[key] = [[float(x), float(y)] for x, y in curve]
    if base.matmul_fp8_efficiency > 0:
        out["matmul_fp8"] = base.matmul_fp8_efficiency
    if base.sustained_matmul != 1.0:
        out["sustained"] = base.sustained_matmul
    return out


def _unit(p: Param, v: float) -> str:
    if p.fraction:
        return f"{v:.4g}"
    if p.attr.endswith("latency"):
        return f"{v * 1e6:.4g} us"
    return f"{v / 1e9:.4g} GB/s"


# --------------------------------------------------------------------------- the command


@dataclass(frozen=True)
class RunRow:
    """One run's step time: measured, and predicted by the base and by the calibrated profile (seconds)."""

    run: str
    layout: str
    source: str
    measured_s: float
    before_s: float
    after_s: float


@dataclass
class Calibration:
    """What `planner calibrate` did: the profile text, the fit, and the before/after tables."""

    name: str
    path: str
    text: str
    fit: Fit
    rows: list[RunRow]
    memory: list[MemoryRow]
    fragmentation: float | None
    kept: list[str]  # parameters not identified, with why
    not_modelled: list[str]  # what the time model has no parameter for
    notes: list[str]


def parse_run_args(items: Sequence[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """Split RUN... [--log FILE PLAN_DIR]... into plan directories and (log, plan directory) pairs, in order."""
    runs, logs = [], []
    i = 0
    while i < len(items):
        a = items[i]
        if a == "--log":
            if len(items) - i < 3:
                raise UsageError(
                    "--log needs two values: the log file and the plan directory of that run.",
                    "Write --log train.log plans/llama-7b (repeat --log for more runs).",
                )
            logs.append((items[i + 1], items[i + 2]))
            i += 3
            continue
        if a.startswith("--"):
            from planner.errors import did_you_mean

            raise UsageError(
                f"unknown option {a!r}.{did_you_mean(a, ['--log', '--name', '--out', '--base'])}",
                "planner calibrate RUN_DIR... [--log FILE PLAN_DIR]... --name NAME --out FILE.yaml [--base PROFILE]",
            )
        runs.append(a)
        i += 1
    return runs, logs


def calibrate(
    run_dirs: Sequence[str], logs: Sequence[tuple[str, str]], name: str, out: str | Path, base: str | None = None, hardware_profiles: Sequence[str] = ()
) -> Calibration:
    """Fit a hardware profile named ``name`` to the runs and write it to ``out`` (atomically)."""
    from planner.fileio import write_text_atomic

    out = Path(out)
    if out.suffix not in (".yaml", ".yml"):
        raise UsageError(f"--out {out} must be a .yaml file (its stem is the profile key).", f"For example --out {name}.yaml.")
    if not name.strip():
        raise UsageError("--name must not be empty.", "For example --name a100-ourcluster.")
    if not run_dirs and not logs:
        raise UsageError("too few runs to identify anything: no run given.", "Pass plan directories with a smoke.json, or --log FILE PLAN_DIR pairs.")
    analyses = _Analyses()
    runs = [run_from_smoke(d, analyses) for d in run_dirs] + [run_from_log(f, d, analyses) for f, d in logs]
    keys = sorted({r.device_key for r in runs})
    if len(keys) > 1:
        raise UsageError(f"the runs ran on different devices ({', '.join(keys)}); a profile describes one device.", "Calibrate each device from its own runs.")
    profiles = hardware.available_profiles(hardware_profiles)
    if base is not None:
        base_dev, _ = hardware.resolve_device(base, profiles)
    else:
        base_dev = runs[0].profiles[keys[0]]
    before_evs = [r.price(base_dev) for r in runs]
    fit = fit_step_times(runs, base_dev)
    dtypes = sorted({hardware.normalize_dtype(r.costs.dtype) for r in runs})
    doc = profile_document(name, fit, runs, dtypes)
    written = hardware.profile_from_dict(yaml.safe_load(yaml.safe_dump(doc, sort_keys=False)), out)
    after_evs = [r.price(written) for r in runs]
    rows = [
        RunRow(r.name, e.layout.short(), r.measurement.source, r.step_time_s, b.predicted.step_time_s, e.predicted.step_time_s)
        for r, b, e in zip(runs, before_evs, after_evs)
    ]
    mem = memory_rows(runs, before_evs)
    frag = measured_fragmentation(mem)
    of_act = measured_reserve_of_activations(mem)
    kept = [f"{p.field} ({p.what}): no run's step time depends on it by {SENSITIVITY:.0%} or more" for p in PARAMS if fit.status[p.attr] == "not identified"]
    notes = [n for r in runs for n in (f"{r.name}: {x}" for x in r.notes)]
    if frag is None:
        kept.append("memory reserve: no run recorded both peak allocated and peak reserved memory")
    else:
        notes.append(
            f"measured allocator reserve {frag:.1%} of allocated bytes (reserved / allocated - 1, median over ranks); "
            + (f"{of_act:.1%} of the predicted activation bytes, " if of_act is not None else "")
            + f"against the planner's {RuntimeOverhead().fragmentation:.0%} of the transient bytes (activations, working set, buffers) "
            "(RuntimeOverhead.fragmentation, not a profile field: reported, not applied)"
        )
    doc["notes"] = _notes_text(fit, rows, kept, notes)
    text = _header(name, out, rows, mem, fit) + yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=10_000)
    hardware.profile_from_dict(yaml.safe_load(text), out)  # the schema check, before anything is written
    _check_name_resolves(name, out, text, hardware_profiles)
    write_text_atomic(out, text)
    return Calibration(name, str(out), text, fit, rows, mem, frag, kept, list(NOT_MODELLED), notes)


def _check_name_resolves(name: str, out: Path, text: str, extra: Sequence[str]) -> None:
    """`--gpus 8xNAME` must find this profile, not a bundled one with that name or alias."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / out.name
        f.write_text(text, encoding="utf-8")
        profiles = hardware.available_profiles([*extra, str(f)])
        try:
            dev, _ = hardware.resolve_device(name, profiles)
        except UsageError as e:
            raise UsageError(f"--name {name!r} would be ambiguous: {e.message}", f"Choose another name, or name the file {name}.yaml.") from None
        if dev.key != out.stem:
            raise UsageError(
                f"--name {name!r} already means the profile {dev.key}: `--gpus 8x{name}` would not find the calibrated one.",
                f"Choose another name, or name the file {name}.yaml (the file stem is the key).",
            )


def _notes_text(fit: Fit, rows: Sequence[RunRow], kept: Sequence[str], notes: Sequence[str]) -> str:
    fitted = [f"{BY_ATTR[a].field} {fit.status[a]}" for a in fit.status if fit.status[a] != "not identified"]
    res = ", ".join(f"{r.run} {r.after_s / r.measured_s - 1:+.1%}" for r in rows)
    parts = [
        f"Calibrated by `planner calibrate` from {len(rows)} run(s) on base profile {fit.base.key}.",
        "Fitted: " + "; ".join(fitted) + ".",
        f"Step-time residuals after the fit (predicted / measured - 1): {res}.",
        "Kept at the base profile's values: " + "; ".join(kept) + ".",
        "Not in the time model, so not fitted: " + "; ".join(NOT_MODELLED) + ".",
    ]
    parts += list(notes)
    return " ".join(parts)


def _header(name: str, out: Path, rows: Sequence[RunRow], mem: Sequence[MemoryRow], fit: Fit) -> str:
    lines = [
        f"# Hardware profile {name}, calibrated by `planner calibrate` from measured runs (base profile {fit.base.key}).",
        f"# Use it with: planner plan MODEL.py --hardware-profile {out.name} --gpus 8x{name}",
        "# step time per run: measured | predicted by the base profile | predicted by this profile",
    ]
    for r in rows:
        lines.append(
            f"#   {r.run} ({r.layout}): {r.measured_s:.4g} s | {r.before_s:.4g} s ({r.before_s / r.measured_s - 1:+.1%}) | "
            f"{r.after_s:.4g} s ({r.after_s / r.measured_s - 1:+.1%})"
        )
    if mem:
        lines.append("# peak memory per pipeline rank: measured allocated / reserved | predicted tensors / with the runtime reserve (GiB)")
        for m in mem:
            a = f"{m.measured_allocated / 2**30:.2f}" if m.measured_allocated else "-"
            rs = f"{m.measured_reserved / 2**30:.2f}" if m.measured_reserved else "-"
            lines.append(f"#   {m.run} rank {m.pipe_rank}: {a} / {rs} | {m.predicted_tensors / 2**30:.2f} / {m.predicted_total / 2**30:.2f}")
    return "\n".join(lines) + "\n"
