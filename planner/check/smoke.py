"""`planner smoke DIR`: run a rendered plan for real, at a scale this machine can run, and check it.

The run keeps the plan's structure: engine, schedule, virtual stages, micro-batch
size and micro-batch count, and (when the ranks allow) the pipeline depth and the
exact stage boundaries. What has to shrink is shrunk explicitly, printed and
recorded in smoke.json: fewer data-parallel replicas first, then fewer pipeline
stages (the planner then re-splits the pieces), fp32 ranks on CPU (exact
comparison; the plan keeps its own dtype, whose trace its stage boundaries
index), and model arguments given with --model-arg (a smaller hidden size or
sequence). The scaled plan is rendered with the same renderer into DIR/smoke/
and launched with torchrun on this machine (gloo on CPU, NCCL on GPUs).

Checks: every rank exits 0 within the timeout (on a timeout or a crash the whole
process group is killed, and the failing rank and the tail of its log are
shown; a rank killed by a signal is named from torchrun's root cause, with the
stack Python's fault handler wrote for it); every loss is finite; the losses
equal a single-process, non-pipelined run of the same model, seed and data
(planner.runners.reference) within a relative tolerance (1e-5 in fp32): the
proof that the partition and the schedule compute the same thing. On GPUs, each rank's measured peak memory and step time
are compared with the plan's prediction.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from planner.engines import get_spec
from planner.errors import InfeasibleError, UsageError
from planner.fileio import dumps_json, write_text_atomic
from planner.model_ref import ref_exists, resolve_recorded, resolve_ref
from planner.report import trained_loss_text
from planner.solve.plan import Plan, load_plan

MAX_CPU_RANKS = 4
RANK_THREADS = 1  # OMP_NUM_THREADS of every rank; the reference runs with as many torch threads
WARMUP_STEPS = 1  # steps left out of per_rank step times (start-up, allocator growth, shape inference)
# what a rank prints when another rank died first: never the cause
SECONDARY_ERRORS = (
    "connection closed by peer",
    "connection reset by peer",
    "remote worker crashing",
    "broken pipe",
    "signal 15",
    "sigterm",
    "socket timeout",
    "timed out",
)


@dataclass
class Check:
    name: str
    ok: bool
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SmokeResult:
    plan_dir: str
    engine: str
    device: str
    ranks: int
    steps: int
    scale_down: list[str]
    layout: dict[str, Any]
    checks: list[Check] = field(default_factory=list)
    losses: list[float] | None = None
    reference_losses: list[float] | None = None
    max_relative_difference: float | None = None
    ranks_stats: list[dict[str, Any]] = field(default_factory=list)
    per_rank: list[dict[str, Any]] = field(default_factory=list)  # rank, step_times_s (after warm-up), peak bytes
    environment: dict[str, Any] = field(default_factory=dict)  # device_name, world_size, versions, threads
    predicted: dict[str, Any] = field(default_factory=dict)
    trained: bool = True
    #: which loss the run trained (the engine's own, or the loss plan.json records for the model file)
    loss: str = ""
    wall_s: float = 0.0
    kept: str | None = None  # where the scaled plan and its logs were kept (--keep)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        d["checks"] = [c.to_dict() for c in self.checks]
        return d


# --------------------------------------------------------------------------- scale-down


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return 0


def scaled_request(plan: Plan, plan_dir: Path, ranks: int, device: str, model_args: dict[str, Any]):
    """The Settings that reproduces ``plan`` on ``ranks`` local ranks, and the notes saying what changed."""
    from planner.solve.settings import Settings

    lay = plan.layout
    notes: list[str] = []
    inputs = dict(plan.inputs)
    model_file = resolve_ref(str(inputs["model_file"]), plan_dir)
    if not ref_exists(model_file):
        model_file = resolve_ref(str(inputs["model_file"]), Path.cwd())  # recorded relative to where `planner plan` ran
    if lay.tp > 1:
        raise UsageError(f"smoke runs tp = 1 plans only (this one has tp = {lay.tp}): tensor parallelism runs inside Megatron-LM.")
    pp, dp = lay.pp, lay.dp
    if pp * dp > ranks:
        if pp <= ranks and ranks % pp == 0:
            dp = ranks // pp
        else:
            dp = 1
            pp = _largest_pp(lay, ranks)
        if dp != lay.dp:
            notes.append(f"data-parallel replicas {lay.dp} -> {dp}")
        if pp != lay.pp:
            notes.append(f"pipeline stages {lay.pp} -> {pp} per rank set (the planner re-splits the pieces over {pp} ranks)")
    world = pp * dp
    gb = lay.micro_batch * lay.num_microbatches * dp
    if gb != lay.global_batch:
        notes.append(f"global batch {lay.global_batch} -> {gb} (same micro-batch {lay.micro_batch} x {lay.num_microbatches} micro-batches per replica)")
    # The scaled plan is traced in the plan's dtype and its ranks run in fp32 on CPU (the scripts' --precision, as for
    # the committed files): the tracer's sub-block cuts depend on byte counts (RMSNorm's fp32 upcast splits only an
    # fp32 trace), so a trace in fp32 has other pieces, and the plan's stage boundaries would not fit them.
    dtype = plan.settings.model.dtype
    if device == "cpu" and dtype != "fp32":
        notes.append(f"precision {dtype} -> fp32 (CPU; exact comparison with the single-process run)")
        dtype = "bf16" if dtype == "fp8" else dtype  # FP8 GEMMs are a GPU's; their plan traces in bf16
    args = dict(inputs.get("model_args") or {})
    if model_args:
        notes.append("model arguments " + ", ".join(f"{k}={args.get(k, '(default)')} -> {v}" for k, v in sorted(model_args.items())))
        args.update(model_args)
    bounds = None
    if pp == lay.pp:
        bounds = tuple([s.pieces[0] for s in plan.stages] + [plan.stages[-1].pieces[1]])
    gpus = f"{world}xcpu" if device == "cpu" else f"{world}x{plan.stages[0].device}"
    if gpus.lower() != str(plan.settings.cluster.gpus).lower():
        notes.append(f"cluster {plan.settings.cluster.gpus} -> {gpus} (this machine)")
    req = Settings.pinned_to(
        inputs,
        lay,
        bounds,
        model_file=str(model_file),
        model_args=args,
        hardware_profiles=resolve_recorded(inputs.get("hardware_profiles") or (), plan_dir),
        gpus=gpus,
        gpus_per_node=None,
        inter_node_gbps=None,
        dtype=dtype,
        global_batch=gb,
        pp=pp,
        tp=1,
        dp=dp,
        fp8=lay.fp8 and device != "cpu",
    )
    return req, notes


def _largest_pp(lay, ranks: int) -> int:
    for pp in range(min(lay.pp, ranks), 0, -1):
        if lay.schedule == "zbv" or lay.vp > 1 or pp > 1:
            return pp
    return 1


# --------------------------------------------------------------------------- running


def _rank_logs(log_dir: Path) -> dict[int, str]:
    """Per-rank output written by torchrun --log-dir --redirects 3 (stdout + stderr)."""
    out: dict[int, str] = {}
    for f in sorted(log_dir.rglob("std*.log")):
        try:
            rank = int(f.parent.name)
        except ValueError:
            continue
        out[rank] = out.get(rank, "") + f.read_text(errors="replace")
    return out


def _log_times(log_dir: Path) -> dict[int, float]:
    """When each rank last wrote to its log (the latest mtime of its stdout/stderr), seconds since the epoch."""
    out: dict[int, float] = {}
    for f in log_dir.rglob("std*.log"):
        try:
            rank = int(f.parent.name)
            out[rank] = max(out.get(rank, 0.0), f.stat().st_mtime)
        except (ValueError, OSError):
            continue
    return out


def _unprefixed(text: str) -> list[str]:
    """A rank log's lines without the ``[rankN]: `` prefix torchrun's --redirects put on them."""
    return [ln.split("]: ", 1)[1] if ln.startswith("[rank") and "]: " in ln else ln for ln in text.splitlines()]


def _fault_stack(text: str, lines: int = 15) -> str | None:
    """The Python stack faulthandler wrote into a rank's log when the rank crashed in native code (innermost call
    first: the head of it, not the log's tail, says where), its first ``lines`` frames; None if there is none."""
    plain = _unprefixed(text)
    start = next((i for i, ln in enumerate(plain) if ln.startswith("Fatal Python error")), None)
    if start is None:
        return None
    # faulthandler writes every thread's stack; the one that crashed is the "Current thread"
    current = next((i for i in range(start, len(plain)) if plain[i].startswith("Current thread")), start)
    frames = []
    for ln in plain[current + 1 :]:
        if not ln.strip().startswith("File "):
            break
        frames.append(ln)
    return "\n".join([plain[start], *frames[:lines]])


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _error_of(text: str) -> str | None:
    """The error a rank's log ends with: the last exception line of a traceback, or the scripts' ``error (rank N): ...``."""
    lines = _unprefixed(text)
    for i in range(len(lines) - 1, -1, -1):
        ln = lines[i].strip()
        if ln.startswith("error (rank"):
            return ln
        if "Traceback (most recent call last)" in ln:
            # the exception line is the first unindented line after the traceback's frames
            for follow in lines[i + 1 :]:
                if follow and not follow.startswith(" "):
                    return follow.strip()
            return ln
    return None


def failing_rank(logs: dict[int, str], finished_at: dict[int, float]) -> tuple[int, str | None]:
    """The rank whose error caused the failure, and that error.

    A rank that failed because another one died first reports a closed or
    reset connection (gloo, NCCL) or a termination signal; those are passed
    over for a real exception. Among real exceptions the earliest log wins (the
    time its log was last written, ``finished_at``), then the lowest rank. Without
    a real exception, the worker torchrun names as the root cause (one killed by
    a signal raises none); (-1, None) when there is none either.
    """
    found = []
    for rank, text in logs.items():
        if rank < 0:
            continue
        err = _error_of(text)
        if err is None:
            continue
        secondary = any(k in err.lower() for k in SECONDARY_ERRORS)
        found.append((secondary, finished_at.get(rank, 0.0), rank, err))
    if not found or all(secondary for secondary, *_ in found):
        # no rank raised a real error: one that died by a signal left none, and torchrun names it
        rank, err = torchrun_root_cause(logs.get(-1, ""))
        if rank >= 0 or not found:
            return rank, err
    _, _, rank, err = min(found)
    return rank, err


#: the "Root Cause (first observed failure)" entry torch.distributed.elastic prints when a worker fails
_ROOT_CAUSE = re.compile(
    r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)[^\n]*?(?:\((SIG[A-Z]+)\))?\s*$",
    re.S | re.M,
)


def torchrun_root_cause(text: str) -> tuple[int, str | None]:
    """(rank, why) of the worker torchrun names as the root cause of a failure, for a worker that died without a
    Python error (a signal: a crash in native code, or the kernel's OOM killer); (-1, None) if torchrun names none."""
    m = _ROOT_CAUSE.search(text)
    if m is None:
        return -1, None
    rank, code, signal_name = int(m[1]), int(m[2]), m[3]
    if code < 0:
        return rank, f"killed by {signal_name or f'signal {-code}'} without a Python error (torchrun's root cause: exit code {code})"
    return rank, f"exited {code} without a Python error in its log (torchrun's root cause)"


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped does not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _kill_group(proc: subprocess.Popen[Any]) -> bool:
    """Stop the launcher and every worker it started; True when nothing of them is left running."""
    pids = [proc.pid] + _descendants(proc.pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.killpg(os.getpgid(pid), sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            proc.poll()
            if not any(_alive(p) for p in pids):
                return True
            time.sleep(0.1)
    proc.poll()
    return not any(_alive(p) for p in pids)


def launch(
    run_dir: Path, script: str, ranks: int, args: list[str], env: dict[str, str], timeout: float, log_dir: Path
) -> tuple[int | None, dict[int, str], bool]:
    """Run ``script`` in ``run_dir`` with torchrun on ``ranks`` local processes, logs in ``log_dir``;
    returns (exit code, or None on timeout; per-rank logs; whether nothing was left running)."""
    shutil.rmtree(log_dir, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(ranks),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        "--log-dir",
        str(log_dir),
        "--redirects",
        "3",
        script,
        *args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": str(RANK_THREADS), "PYTHONUNBUFFERED": "1", **env}
    proc = subprocess.Popen(cmd, cwd=run_dir, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
        clean = True
    except subprocess.TimeoutExpired:
        code = None
        clean = _kill_group(proc)
        out = b""
    logs = _rank_logs(log_dir)
    if out:
        logs[-1] = out.decode(errors="replace")
    return code, logs, clean


# --------------------------------------------------------------------------- the smoke run


def smoke(
    plan_dir: str | Path,
    steps: int = 3,
    ranks: int | None = None,
    timeout: float = 600.0,
    device: str = "auto",
    model_args: dict[str, Any] | None = None,
    tolerance: float = 1e-5,
    megatron_path: str | None = None,
    seed: int = 0,
    keep: bool = False,
) -> SmokeResult:
    """Run the plan in ``plan_dir`` (see the module docstring); writes plan_dir/smoke.json and returns the result."""
    plan_dir = Path(plan_dir)
    plan = load_plan(plan_dir)
    engine = plan.layout.engine
    cuda = _cuda_count()
    if device == "auto":
        device = "cuda" if cuda else "cpu"
    if device == "cuda" and not cuda:
        raise UsageError("--device cuda, but no CUDA device is visible.", "Run with --device cpu (gloo) or on a GPU machine.")
    spec = get_spec(engine)
    if not spec.has("smoke"):
        raise UsageError(f"planner smoke does not run {engine} plans: {spec.lacks['smoke']}.", "Check the plan with `planner validate` instead.")
    part = spec.part("smoke")
    if hasattr(part, "run"):  # an engine whose smoke is its own (Megatron: its argument checks; CUDA only to train)
        result = part.run(plan, plan_dir, device, megatron_path, timeout)
        write_text_atomic(plan_dir / "smoke.json", dumps_json(result.to_dict()))
        return result
    world = plan.layout.pp * plan.layout.dp * plan.layout.tp
    limit = cuda if device == "cuda" else MAX_CPU_RANKS
    ranks = ranks or min(world, limit)
    if ranks < 1:
        raise UsageError("--ranks must be at least 1.")
    if device == "cuda" and ranks > cuda:
        raise UsageError(f"--ranks {ranks} but only {cuda} CUDA devices are visible.")
    req, notes = scaled_request(plan, plan_dir, ranks, device, dict(model_args or {}))
    from planner.planning import plan_model
    from planner.render import write_plan_dir

    work = Path(tempfile.mkdtemp(prefix="planner-smoke-"))
    try:
        layout_kept = req.pins.pp == plan.layout.pp and req.pins.dp == plan.layout.dp and not model_args
        if layout_kept and (plan_dir / part.SCRIPT).is_file():
            # the committed files themselves run (precision is a flag of the scripts)
            small, run_dir = plan, plan_dir
        else:
            try:
                small, _, _ = plan_model(req)
            except InfeasibleError as e:
                raise UsageError(
                    f"The scaled-down plan does not fit this machine: {e.message}", "Shrink the model with --model-arg (e.g. a smaller hidden size)."
                ) from e
            run_dir = work / "plan"
            write_plan_dir(run_dir, small, command="planner smoke " + str(plan_dir))
            notes.append("ran a re-rendered copy of the scaled plan (the committed scripts need the plan's own cluster)")
        result = _run(plan_dir, small, req, notes, run_dir, work, engine, device, steps, seed, timeout, tolerance)
        if keep:
            result.kept = str(work)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    write_text_atomic(plan_dir / "smoke.json", dumps_json(result.to_dict()))
    return result


def _run(
    plan_dir: Path,
    small: Plan,
    req,
    notes: list[str],
    run_dir: Path,
    work: Path,
    engine: str,
    device: str,
    steps: int,
    seed: int,
    timeout: float,
    tolerance: float,
) -> SmokeResult:
    """Launch the plan in ``run_dir`` (outputs and logs go to ``work``) and check it (see the module docstring)."""
    lay = small.layout
    ranks_used = lay.pp * lay.dp
    result = SmokeResult(
        plan_dir=str(plan_dir),
        engine=engine,
        device=device,
        ranks=ranks_used,
        steps=steps,
        scale_down=notes,
        loss=trained_loss_text(small),
        layout=lay.to_dict(),
        predicted={"step_time_s": small.predicted.step_time_s, "ranks": [r.to_dict() for r in small.ranks]},
    )
    # a rank that crashes in native code (SIGSEGV, SIGABRT) dumps its Python stack into its log
    env = {"PYTHONFAULTHANDLER": "1"}
    part = get_spec(engine).part("smoke")
    if device == "cpu":
        env.update(part.ENV_CPU)
    args = [
        "--plan",
        "plan.json",
        "--model",
        resolve_ref(req.model.model_file, Path.cwd()),
        "--steps",
        str(steps),
        "--seed",
        str(seed),
        "--device",
        device,
        "--precision",
        "fp32" if device == "cpu" else "auto",
        "--no-dropout",
        "--losses-out",
        str(work / "losses.json"),
        "--stats-out",
        str(work / "stats-{rank}.json"),
    ]
    start = time.monotonic()
    code, logs, clean = launch(run_dir, part.SCRIPT, ranks_used, args, env, timeout, work / "logs")
    result.wall_s = time.monotonic() - start
    finished = {int(f.stem.split("-")[1]) for f in work.glob("stats-*.json")}
    if code is None:
        hung = sorted(set(range(ranks_used)) - finished)
        detail = f"no result within {timeout:.0f} s; ranks {hung or 'all'} did not finish; process group killed" + (
            "" if clean else " (some processes survived)"
        )
        for r in hung[:2]:
            detail += f"\n--- rank {r} log (tail) ---\n{_tail(logs.get(r) or '(no output)')}"
        result.checks.append(Check("ranks exit 0 within the timeout", False, detail))
    elif code != 0:
        r, err = failing_rank(logs, _log_times(work / "logs"))
        detail = f"torchrun exited {code}; failing rank {r if r >= 0 else '(unknown)'}"
        if err:
            detail += f": {err}"
        fault = _fault_stack(logs.get(r, ""))
        if fault:
            detail += f"\n--- rank {r} crashed in (Python's fault handler, innermost call first) ---\n{fault}"
        elif logs.get(r):
            detail += f"\n--- rank {r} log (tail) ---\n{_tail(logs[r])}"
        else:
            detail += f"\n--- torchrun log (tail) ---\n{_tail(logs.get(-1) or '(no output)')}"
        result.checks.append(Check("ranks exit 0 within the timeout", False, detail))
    else:
        result.checks.append(Check("ranks exit 0 within the timeout", True, f"{ranks_used} ranks finished in {result.wall_s:.1f} s"))
    if code == 0:
        _loss_checks(result, work, small, req, steps, seed, device, tolerance)
        _stats_checks(result, work, small, device)
    return result


def _loss_checks(result: SmokeResult, work: Path, small: Plan, req, steps: int, seed: int, device: str, tolerance: float) -> None:
    losses_file = work / "losses.json"
    if not losses_file.is_file():
        result.checks.append(Check("losses written", False, "the rank holding the last stage wrote no losses.json"))
        return
    losses = [float(x) for x in json.loads(losses_file.read_text())["losses"]]
    result.losses = losses
    finite = all(math.isfinite(x) for x in losses) and len(losses) == steps
    result.checks.append(Check("every loss finite", finite, f"{len(losses)} steps: " + ", ".join(f"{x:.6g}" for x in losses)))
    _, ref = reference_run(small, req.model.model_file, steps, seed, device)
    result.reference_losses = ref
    diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref)]
    result.max_relative_difference = max(diffs) if diffs else None
    tol = tolerance if device == "cpu" else max(tolerance, 2e-2)
    ok = bool(diffs) and len(diffs) == len(ref) and max(diffs) <= tol
    result.checks.append(
        Check(
            "losses equal a single-process run",
            ok,
            f"max relative difference {max(diffs) if diffs else float('nan'):.2e} (tolerance {tol:.0e}; reference " + ", ".join(f"{x:.6g}" for x in ref) + ")",
        )
    )


def reference_run(small: Plan, model_file: str, steps: int, seed: int, device: str):
    """(the traced model, its per-step losses) of the single-process reference, run with the ranks' thread count."""
    from planner.runners.reference import reference_losses
    from planner.runtime import load_planned_model

    plan_dict = small.to_dict()
    planned = load_planned_model(plan_dict, model_file)
    with torch_threads(RANK_THREADS):  # another thread count sums floats in another order
        ref = reference_losses(planned, plan_dict, steps, seed, 1e-4, device, "fp32" if device == "cpu" else "auto")
    return planned, ref


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch intra-op threads (the ranks' OMP_NUM_THREADS), then restore the count."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def per_rank_record(stats: dict[str, Any], warmup: int = WARMUP_STEPS) -> dict[str, Any]:
    """One rank's measurements for smoke.json: step times after ``warmup`` steps, peak allocated/reserved bytes (GPUs)."""
    times = list(stats.get("step_times_s") or [])
    return {
        "rank": stats.get("rank"),
        "step_times_s": times[warmup:] if len(times) > warmup else times,
        "peak_allocated_bytes": stats.get("peak_memory_bytes"),
        "peak_reserved_bytes": stats.get("peak_reserved_bytes"),
    }


def environment(stats: list[dict[str, Any]], engine: str, device: str, world: int) -> dict[str, Any]:
    """What the measurements were taken on: device name, world size, library versions, threads per rank."""

    def ver(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    names = sorted({s.get("device_name") for s in stats if s.get("device_name")})
    record = {
        "device": device,
        "device_name": names[0] if len(names) == 1 else (names or None),
        "world_size": world,
        "engine": engine,
        "torch": ver("torch"),
        "python": platform.python_version(),
        "threads_per_rank": RANK_THREADS,
    }
    package = get_spec(engine).part("smoke").PACKAGE  # the engine's own library, where it has one (deepspeed)
    if package:
        record[package] = ver(package)
    return record


def _stats_checks(result: SmokeResult, work: Path, small: Plan, device: str) -> None:
    stats = []
    for f in sorted(work.glob("stats-*.json"), key=lambda p: int(p.stem.split("-")[1])):
        stats.append(json.loads(f.read_text()))
    result.ranks_stats = stats
    result.per_rank = [per_rank_record(s) for s in stats]
    result.environment = environment(stats, small.layout.engine, device, result.ranks)
    if device != "cuda" or not stats:
        return
    lines = []
    for s in stats:
        rank = s.get("rank", 0)
        pipe = rank // max(small.layout.dp, 1)
        pred = small.ranks[pipe].memory_bytes["total"] if pipe < len(small.ranks) else None
        meas = s.get("peak_memory_bytes")
        if pred and meas:
            lines.append(f"rank {rank}: peak memory {meas / 2**30:.2f} GiB measured vs {pred / 2**30:.2f} GiB predicted ({(pred - meas) / meas:+.0%})")
    times = [_steady(s.get("step_times_s")) for s in stats]
    if times:
        meas = max(times)
        pred = small.predicted.step_time_s
        lines.append(f"step time {meas:.3f} s measured vs {pred:.3f} s predicted ({(pred - meas) / meas:+.0%})")
    result.checks.append(Check("prediction vs measurement (information)", True, "\n".join(lines)))


def _steady(times) -> float:
    """Median step time without the first (warm-up) step."""
    import statistics

    t = list(times or [])
    t = t[1:] if len(t) > 1 else t
    return statistics.median(t) if t else math.nan
