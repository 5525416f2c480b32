"""Measured per-piece times on a real device (`planner profile`, profile.json), and their use in planning.

``profile_model`` builds the user's model on the device, splits it with the
same LayerGraph as planning (``analyze`` on meta), and times the forward and
backward of each DISTINCT piece (identical repeated blocks share a structural
signature and are measured once) at real size, on the values that really
cross its input cut (produced by running the preceding pieces once). The last
piece includes the loss, as in planning. Timing: CUDA events around each pass
plus a synchronize on GPU, ``time.perf_counter`` on CPU; ``warmup`` untimed
iterations, then ``repeats`` timed ones, summarised as median, min, max and
quartiles (seconds). On CUDA each piece's peak memory is
``max_memory_allocated`` during one forward + backward minus what was
allocated before it (bytes).

``calibrate_device`` measures the achieved matmul rate (square matmuls, FLOP/s)
and the copy bandwidth (bytes read + written per second) of the device;
``profile_to_hardware_yaml`` turns them into a hardware profile such that the
analytical model of planner.hardware reproduces them:

* ``matmul_time(F, op) = F / (peak * efficiency.matmul * size_scale(op))``. With
  ``efficiency.matmul = 1`` and ``peak = achieved / size_scale(op_c)`` (``op_c``
  the FLOPs of the calibration matmul), the model returns exactly the measured
  time for the calibration matmul; on a GPU the default 8192^3 matmul is past the
  top of the size curve (``size_scale = 1``), so ``peak`` is the achieved rate.
* ``memory_time(B, op) = B / (bandwidth * efficiency.memory * size_scale(op))``: the
  costing counts a copy as its input plus output bytes, so ``bandwidth`` = 2 x copied
  bytes / time / size_scale(2 x copied bytes) and ``efficiency.memory = 1``; the
  default copies (256 MiB on CPU, 2 GiB on GPU) are past the top of the size curve.

``match_profile`` reads a profile.json for planning: it checks the model
(file sha256, else identical piece names) and dtype, maps per-piece times onto
the analysed pieces by signature (pieces of a structure not measured keep the
analytical time), scales them linearly to the costed micro-batch, and keys them
by the cluster device the profile was measured on.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from planner import __version__
from planner.errors import UsageError
from planner.fileio import dumps_json, write_text_atomic
from planner.model.cost import piece_structure

PROFILE_SCHEMA = 1
PROFILE_KIND = "planner-profile"
DEVICES = ("cpu", "cuda")
#: default calibration sizes: square matmul sides (n) and the bytes of the copied tensor
CALIBRATION = {
    "cpu": {"matmul_sizes": (512, 1024, 2048), "copy_bytes": 256 * 2**20},
    "cuda": {"matmul_sizes": (2048, 4096, 8192), "copy_bytes": 2 * 2**30},
}
_SHRINK_HINT = (
    "Profile a smaller preset, or shrink it with --model-arg (fewer layers: n_layer=2 for examples/gpt2.py, n_layers=2 "
    "for examples/llama.py): identical blocks are "
    "measured once and matched to every block of the full model by structure, so a model with fewer layers of the "
    "same width gives the same per-block times."
)

Progress = Callable[[str, int, int], None]


# --------------------------------------------------------------------------- signatures


def piece_signatures(lg) -> list[str]:
    """A stable hex digest per piece of ``lg``: equal for structurally identical pieces, whatever the micro-batch.

    It hashes the piece's structure (:func:`planner.model.cost.piece_structure`: graph ops, module classes
    and settings, parameter and buffer shapes and dtypes, block path removed) plus
    the shapes and dtypes of the values crossing its input cut with the batch
    dimension replaced by ``B``, and whether it is the last piece (which carries the loss).
    """
    out = []
    for i, piece in enumerate(lg.pieces):
        struct = piece_structure(lg.stage_module(i, i + 1), piece.block)
        ins = []
        for node in lg.boundaries[i]:
            meta = lg.metas.get(node)
            bdim = lg.batch_dims.get(node)
            for shape, dtype, rg in (meta.tensors if meta else ()):
                dims = tuple("B" if d == bdim else int(x) for d, x in enumerate(shape))
                ins.append((dims, str(dtype), bool(rg)))
        sig = (struct, tuple(ins), i == lg.n - 1)
        out.append(hashlib.sha256(repr(sig).encode()).hexdigest()[:16])
    return out


# --------------------------------------------------------------------------- device facts


def _cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def _meminfo() -> dict[str, int]:
    """MemTotal and MemAvailable in bytes from /proc/meminfo (empty when unreadable)."""
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if key in ("MemTotal", "MemAvailable") and parts:
                out[key] = int(parts[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def _check_device(device: str) -> None:
    if device not in DEVICES:
        raise UsageError(f"Unknown device {device!r} for profiling.", "Use --device cuda (the GPU of this machine) or --device cpu.")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for, but torch sees no CUDA GPU on this machine.",
                         "Run `planner profile` on a machine with the target GPU, or profile with --device cpu.")


def device_name(device: str) -> str:
    """The device's model name: torch.cuda.get_device_name, or the CPU model from /proc/cpuinfo."""
    return torch.cuda.get_device_name() if device == "cuda" else _cpu_model_name()


def device_memory(device: str) -> tuple[int, int]:
    """(total, currently free) bytes of the device: CUDA's figures, or /proc/meminfo's MemTotal and MemAvailable."""
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        return int(total), int(free)
    info = _meminfo()
    total = info.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total), int(info.get("MemAvailable", total))


def hardware_key_for(name: str, device: str, profiles: Mapping[str, Any] | None = None) -> str | None:
    """The hardware-profile key of a device name (planner.hardware.resolve_device), ``cpu`` for an unknown CPU, else None."""
    from planner import hardware

    profiles = hardware.available_profiles() if profiles is None else profiles
    try:
        return hardware.resolve_device(name, profiles)[0].key
    except UsageError:
        return "cpu" if device == "cpu" and "cpu" in profiles else None


# --------------------------------------------------------------------------- timing


class _Timer:
    """Times consecutive phases of one iteration: CUDA events on GPU, perf_counter on CPU (seconds)."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self.marks: list[list[Any]] = []

    def start(self) -> None:
        self.marks.append([])
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks[-1].append(e)
        else:
            self.marks[-1].append(time.perf_counter())

    def phases(self) -> list[list[float]]:
        """Per iteration, the seconds between consecutive marks."""
        if self.cuda:
            torch.cuda.synchronize()
            return [[a.elapsed_time(b) / 1e3 for a, b in zip(m, m[1:])] for m in self.marks]
        return [[b - a for a, b in zip(m, m[1:])] for m in self.marks]


def summarize(samples: list[float]) -> dict[str, float]:
    """Median, min, max and quartiles (inclusive method) of ``samples`` (seconds)."""
    xs = sorted(samples)
    if len(xs) >= 2:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    else:
        q1 = q3 = xs[0]
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "q1": q1, "q3": q3}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- calibration


def calibrate_device(
    device: str,
    dtypes: tuple[str, ...] = ("fp32",),
    matmul_sizes: tuple[int, ...] | None = None,
    copy_bytes: int | None = None,
    repeats: int = 5,
) -> dict[str, Any]:
    """Achieved matmul FLOP/s per dtype and copy bandwidth of ``device``.

    Matmul: for each side ``n`` in ``matmul_sizes``, the median rate of ``repeats``
    ``(n x n) @ (n x n)`` products (2 n^3 FLOPs each); the reported rate is the
    largest size's (the large-GEMM rate a profile's peak describes; smaller sizes
    are kept in ``by_size``, e.g. to see how a CPU departs from the GPU-derived
    size curve of planner.hardware). Copy: ``y.copy_(x)`` of ``copy_bytes`` bytes, rate = 2 x bytes / median
    time (read + write, as the costing counts bytes moved).
    """
    from planner.model.analyze import torch_dtype

    _check_device(device)
    sizes = tuple(matmul_sizes or CALIBRATION[device]["matmul_sizes"])
    nbytes = int(copy_bytes or CALIBRATION[device]["copy_bytes"])
    timer_name = "cuda events" if device == "cuda" else "perf_counter"
    matmul: dict[str, Any] = {}
    for name in dtypes:
        dt = torch_dtype(name)
        by_size = []
        for n in sizes:
            a = torch.randn(n, n, device=device).to(dt)
            b = torch.randn(n, n, device=device).to(dt)
            torch.mm(a, b)
            _sync(device)
            t = _Timer(device)
            for _ in range(repeats):
                t.start()
                torch.mm(a, b)
                t.mark()
            secs = statistics.median(p[0] for p in t.phases())
            by_size.append({"n": n, "flops_per_op": 2.0 * n**3, "median_s": secs, "flops_per_s": 2.0 * n**3 / secs})
            del a, b
        top = max(by_size, key=lambda r: r["n"])
        matmul[name] = {"n": top["n"], "flops_per_op": top["flops_per_op"], "flops_per_s": top["flops_per_s"], "by_size": by_size}
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    y = torch.empty_like(x)
    y.copy_(x)
    _sync(device)
    t = _Timer(device)
    for _ in range(repeats):
        t.start()
        y.copy_(x)
        t.mark()
    secs = statistics.median(p[0] for p in t.phases())
    copied = x.numel() * 4
    del x, y
    total, free = device_memory(device)
    return {
        "matmul": matmul,
        "copy": {"bytes": copied, "median_s": secs, "bytes_per_s": 2.0 * copied / secs},
        "memory_total_bytes": total,
        "memory_available_bytes": free,
        "repeats": repeats,
        "timer": timer_name,
    }


# --------------------------------------------------------------------------- model on the device


def _estimate_bytes(costs, itemsize: int) -> int:
    """Bytes profiling needs at once: all weights, plus the largest piece's gradients, saved activations and cut values."""
    weights = costs.total_params * itemsize + sum(l.buffer_bytes for l in costs.layers)
    piece = max((l.param_bytes + l.saved_bytes + 2 * l.out_bytes + l.max_op_bytes for l in costs.layers), default=0)
    cut = max((c.bytes for c in costs.cuts), default=0)
    return int(weights + piece + 2 * cut)


def _too_big(what: str, need: float, have: float, device: str, name: str) -> UsageError:
    return UsageError(
        f"The model is too big to profile on {device} ({name}): {what} needs about {need / 2**30:.1f} GiB, "
        f"{have / 2**30:.1f} GiB is free.",
        _SHRINK_HINT,
    )


def _build_real(mf, device: str, dtype: torch.dtype, low_memory: bool) -> torch.nn.Module:
    """The model on ``device`` in ``dtype``, created there directly (no CPU copy).

    ``low_memory`` creates floating tensors in ``dtype`` from the start (default
    dtype switched) instead of in float32 then cast, halving the peak for bf16.
    """
    prev = torch.get_default_dtype()
    try:
        if low_memory and dtype.is_floating_point:
            torch.set_default_dtype(dtype)
        with torch.device(device):
            model = mf.call("build_model")
    finally:
        torch.set_default_dtype(prev)
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"{mf.path.name}: build_model() returned {type(model).__name__}, not a torch.nn.Module.")
    model = model.to(device=device, dtype=dtype)
    model.train()
    return model


def _on_device(x: Any, device: str, dtype: torch.dtype) -> Any:
    def move(t):
        if not isinstance(t, torch.Tensor):
            return t
        t = t.to(device)
        return t.to(dtype) if t.is_floating_point() else t

    return torch.utils._pytree.tree_map(move, x)


def _check_no_meta(mod, piece_name: str) -> None:
    for node in mod.gm.graph.nodes:
        if node.op == "get_attr":
            obj = mod.gm
            for part in str(node.target).split("."):
                obj = getattr(obj, part)
            if isinstance(obj, torch.Tensor) and obj.device.type == "meta":
                raise UsageError(
                    f"Piece {piece_name} uses a constant {node.target} that only exists on the meta device "
                    "(torch.export lifted it while tracing).",
                    "Profile with --tracer fx, or make the constant a registered buffer of the model.",
                )


def _flat(x: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def _leaf_inputs(values: list[Any], metas: list[Any]) -> tuple[Any, ...]:
    """Detached copies of the cut values; floating tensors require grad where the traced value did."""
    out = []
    for v, meta in zip(values, metas):
        flat, spec = torch.utils._pytree.tree_flatten(v)
        flags = [rg for _, _, rg in meta.tensors] if meta is not None else []
        k, new = 0, []
        for x in flat:
            if isinstance(x, torch.Tensor):
                rg = flags[k] if k < len(flags) else True
                k += 1
                x = x.detach().requires_grad_(bool(rg) and x.is_floating_point())
            new.append(x)
        out.append(torch.utils._pytree.tree_unflatten(new, spec))
    return tuple(out)


class _PieceRun:
    """One distinct piece on its real input values: a forward + backward step, timed or not."""

    def __init__(self, mod, args: tuple[Any, ...], loss: Callable[[Any], torch.Tensor] | None):
        self.mod, self.args, self.loss = mod, args, loss
        self.params = [p for p in mod.parameters() if p.requires_grad]
        self.leaves = [t for t in _flat(args) if t.requires_grad]
        self.grads: list[torch.Tensor] | None = None

    def step(self, timer: _Timer | None = None) -> None:
        """Forward (with the loss for the last piece), then backward into the parameters and the inputs."""
        if timer:
            timer.start()
        out = self.mod(*self.args)
        roots = [self.loss(out)] if self.loss is not None else [t for t in _flat(out) if t.requires_grad]
        if timer:
            timer.mark()
        if roots:
            if self.grads is None:
                self.grads = [torch.ones_like(r) for r in roots]
            torch.autograd.backward(roots, self.grads)
        if timer:
            timer.mark()
        del out, roots
        for p in self.params + self.leaves:
            p.grad = None

    def peak_bytes(self) -> int:
        """CUDA bytes allocated at the peak of one step, above what was allocated before it."""
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        self.step()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - base)


def _time_runs(runs: list[_PieceRun], device: str, warmup: int, repeats: int, warmup_s: float, progress: Progress | None) -> list[dict[str, Any]]:
    """Warm every run up, then time them in interleaved rounds (one step of each run per round).

    Warm-up: ``warmup`` steps of each run, then more rounds until ``warmup_s``
    seconds have passed (a GPU needs a fraction of a second of work to raise its
    clocks from idle; tiny pieces would otherwise be timed at idle clocks).
    Interleaving spreads a burst of load from other processes over one sample of
    every piece instead of all samples of one piece, so medians stay robust.
    """
    peaks: list[int | None] = []
    start = time.perf_counter()
    for run in runs:
        peaks.append(run.peak_bytes() if device == "cuda" else None)
        for _ in range(warmup - (device == "cuda")):
            run.step()
    _sync(device)
    while time.perf_counter() - start < warmup_s:
        for run in runs:
            run.step()
        _sync(device)
    timers = [_Timer(device) for _ in runs]
    for r in range(repeats):
        if progress:
            progress("measure", r, repeats)
        for run, timer in zip(runs, timers):
            run.step(timer)
    if progress:
        progress("measure", repeats, repeats)
    out = []
    for timer, peak in zip(timers, peaks):
        phases = timer.phases()
        out.append({"fwd_s": summarize([p[0] for p in phases]), "bwd_s": summarize([p[1] for p in phases]), "peak_bytes": peak})
    return out


def _loss_for(mf, batch: int, device: str, dtype: torch.dtype) -> Callable[[Any], torch.Tensor]:
    """The last piece's loss: the model file's loss_fn on example_target, else the mean of the output (as in costing)."""
    if mf.has("loss_fn") and mf.has("example_target"):
        with torch.device(device):
            target = _on_device(mf.call("example_target", batch), device, dtype)
        fn = mf.funcs["loss_fn"]
        return lambda out: fn(out, target)
    return lambda out: sum(t.float().mean() for t in _flat(out) if t.is_floating_point())


# --------------------------------------------------------------------------- profile


def profile_model(
    path: str | Path,
    model_args: dict[str, Any] | None = None,
    device: str = "cuda",
    micro_batch: int = 1,
    dtype: str | None = None,
    leaf: list[str] | None = None,
    tracer: str = "auto",
    warmup: int = 3,
    repeats: int = 10,
    calibrate: bool = False,
    progress: Progress | None = None,
    seed: int = 0,
    warmup_s: float | None = None,
) -> dict[str, Any]:
    """Measure every distinct piece of the model in ``path`` on ``device``; returns the profile.json document.

    ``dtype`` defaults to bf16 on CUDA and fp32 on CPU. Times are seconds per
    micro-batch of ``micro_batch`` samples. ``warmup`` steps per piece, then
    warm-up rounds until ``warmup_s`` seconds (default 0.5 on CUDA, 0.1 on CPU),
    then ``repeats`` timed rounds. Raises UsageError when the model does not fit
    on the device (with a hint to shrink it).
    """
    from planner.model.analyze import analyze, torch_dtype
    from planner.model.load import load_model_file

    _check_device(device)
    if warmup < 0 or repeats < 1:
        raise UsageError(f"warmup must be >= 0 and repeats >= 1, got {warmup} and {repeats}.")
    warmup_s = (0.5 if device == "cuda" else 0.1) if warmup_s is None else float(warmup_s)
    dtype = dtype or ("bf16" if device == "cuda" else "fp32")
    tdtype = torch_dtype(dtype)
    itemsize = torch.empty((), dtype=tdtype).element_size()
    name = device_name(device)
    total, free = device_memory(device)
    # the weights alone, from the model on meta: refuses a huge model before tracing and costing it
    weights = sum(p.numel() for p in load_model_file(path, model_args).build_meta(tdtype).parameters()) * itemsize
    if weights > 0.9 * free:
        raise _too_big("its weights", weights, free, device, name)
    analysis = analyze(path, model_args, micro_batch, dtype, list(leaf or ()), tracer, progress=progress)
    mf, lg, costs = analysis.model_file, analysis.layer_graph, analysis.costs
    need = _estimate_bytes(costs, itemsize)
    if need > 0.9 * free:
        raise _too_big("one piece's forward and backward with all weights resident", need, free, device, name)
    fp32_weights = sum(l.params for l in costs.layers) * 4
    sigs = piece_signatures(lg)
    try:
        torch.manual_seed(seed)
        model = _build_real(mf, device, tdtype, low_memory=fp32_weights > 0.5 * free)
        with torch.device(device):
            raw_inputs = mf.call("example_inputs", micro_batch)
        raw_inputs = (raw_inputs,) if isinstance(raw_inputs, torch.Tensor) else tuple(raw_inputs)
        inputs = _on_device(raw_inputs, device, tdtype)
        loss = _loss_for(mf, micro_batch, device, tdtype)
        pieces = _measure_all(lg, model, inputs, loss, sigs, costs, device, warmup, repeats, warmup_s, progress)
    except (torch.OutOfMemoryError, MemoryError) as e:
        raise UsageError(f"The model ran out of memory while profiling on {device} ({name}): {str(e).splitlines()[0]}", _SHRINK_HINT) from None
    doc: dict[str, Any] = {
        "schema": PROFILE_SCHEMA,
        "kind": PROFILE_KIND,
        "planner_version": __version__,
        "model": {
            "file": Path(path).name,
            "sha256": mf.sha256,
            "model_args": dict(sorted((model_args or {}).items())),
            "tracer": lg.tracer,
            "leaf": sorted(leaf or ()),
            "pieces": lg.n,
            "distinct_pieces": len(set(sigs)),
        },
        "device": {
            "type": device,
            "name": name,
            "key": hardware_key_for(name, device),
            "memory_bytes": total,
            "torch": torch.__version__,
            "cuda": torch.version.cuda if device == "cuda" else None,
            "threads": torch.get_num_threads(),
        },
        "dtype": dtype,
        "micro_batch": micro_batch,
        "inputs": [{"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")} for t in _flat(inputs)],
        "settings": {"warmup": warmup, "warmup_s": warmup_s, "repeats": repeats, "timer": "cuda events + synchronize" if device == "cuda" else "time.perf_counter", "seed": seed},
        "pieces": pieces,
    }
    if calibrate:
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
        dts = ("fp32", "bf16", "fp16") if device == "cuda" else tuple(dict.fromkeys(("fp32", dtype)))
        doc["calibration"] = calibrate_device(device, dts)
    return doc


def _measure_all(lg, model, inputs, loss, sigs, costs, device, warmup, repeats, warmup_s, progress) -> list[dict[str, Any]]:
    """Run the pieces in order on real values, keep each new signature's inputs, then time those pieces."""
    values: dict[Any, Any] = dict(zip(lg.boundaries[0], inputs))
    first: dict[str, int] = {}
    runs: list[_PieceRun] = []
    rows: list[dict[str, Any]] = []
    for i, piece in enumerate(lg.pieces):
        if progress:
            progress("inputs", i, lg.n)
        mod = lg.stage_module(i, i + 1, root=model)
        _check_no_meta(mod, piece.name)
        nodes = lg.boundaries[i]
        cur = [values[v] for v in nodes]
        layer = costs.layers[i]
        rows.append({
            "index": i,
            "name": piece.name,
            "kind": piece.kind,
            "signature": sigs[i],
            "same_as": first.get(sigs[i]),
            "flops_fwd": layer.flops_fwd,
            "flops_bwd": layer.flops_bwd,
        })
        if sigs[i] not in first:
            first[sigs[i]] = i
            runs.append(_PieceRun(mod, _leaf_inputs(cur, [lg.metas.get(v) for v in nodes]), loss if i == lg.n - 1 else None))
        if i < lg.n - 1:
            with torch.no_grad():
                out = mod(*cur)
            outs = out if len(lg.boundaries[i + 1]) != 1 else (out,)
            values = dict(zip(lg.boundaries[i + 1], outs))
        del cur
    del values
    if progress:
        progress("inputs", lg.n, lg.n)
    results = dict(zip(first.values(), _time_runs(runs, device, warmup, repeats, warmup_s, progress)))
    for row in rows:
        src = results[row["same_as"] if row["same_as"] is not None else row["index"]]
        row.update(fwd_s=dict(src["fwd_s"]), bwd_s=dict(src["bwd_s"]), peak_bytes=src["peak_bytes"])
    return rows


def write_profile(path: str | Path, doc: Mapping[str, Any]) -> None:
    """Write the profile document atomically as canonical JSON (sorted keys)."""
    write_text_atomic(path, dumps_json(doc))


def read_profile(path: str | Path) -> dict[str, Any]:
    """Load and check a profile.json (UsageError when missing, malformed or not a planner profile)."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise UsageError(f"cannot read profile {path}: {e.strerror or e}.", "Write one with `planner profile MODEL.py --out profile.json`.") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"profile {path} is not valid JSON ({e}).", "Re-run `planner profile` to write it again.") from None
    if not isinstance(doc, dict) or doc.get("kind") != PROFILE_KIND:
        raise UsageError(f"{path} is not a profile written by `planner profile` (no \"kind\": \"{PROFILE_KIND}\").",
                         "Pass the profile.json that `planner profile` wrote.")
    if doc.get("schema") != PROFILE_SCHEMA:
        raise UsageError(f"profile {path} has schema {doc.get('schema')!r}; this planner reads schema {PROFILE_SCHEMA}.",
                         "Re-run `planner profile` with this planner version.")
    for key in ("model", "device", "dtype", "micro_batch", "pieces"):
        if key not in doc:
            raise UsageError(f"profile {path} lacks the field {key!r}.", "Re-run `planner profile` to write it again.")
    return doc


# --------------------------------------------------------------------------- matching for planning


def _cluster_device(doc: dict[str, Any], cluster) -> tuple[str | None, str]:
    """(cluster device key the profile was measured on, or None; the name used)."""
    from planner import hardware

    dev = doc["device"]
    name = str(dev.get("name") or "")
    devices = {g.device.key: g.device for g in cluster.groups}
    if name:
        try:
            return hardware.resolve_device(name, devices)[0].key, name
        except UsageError:
            pass
    if dev.get("key") in devices:
        return dev["key"], name
    if dev.get("type") == "cpu" and "cpu" in devices:
        return "cpu", name
    return None, name


def match_profile(path: str | Path, analysis, cluster) -> tuple[dict[str, dict[int, tuple[float, float]]], list[str]]:
    """Measured (forward, backward) seconds per piece of ``analysis`` at its costed micro-batch, by cluster device key.

    Returns ``({device key: {piece index: (fwd_s, bwd_s)}}, notes)``; ``{}`` with a
    note when the profile's device is not in ``cluster``. Raises UsageError when
    the profile is for another model or dtype, or matches none of its pieces.
    """
    doc = read_profile(path)
    costs = analysis.costs
    mf, lg = analysis.model_file, analysis.layer_graph
    pname = Path(path).name
    if doc["dtype"] != costs.dtype:
        raise UsageError(
            f"{pname} was measured in {doc['dtype']}, but this plan uses {costs.dtype}.",
            f"Profile again with --dtype {costs.dtype}, or plan with --dtype {doc['dtype']}.",
        )
    names = [p.name for p in lg.pieces]
    rows = doc["pieces"]
    same_file = doc["model"].get("sha256") == mf.sha256
    same_pieces = [r.get("name") for r in rows] == names
    if not same_file and not same_pieces:
        raise UsageError(
            f"{pname} was measured on another model: {doc['model'].get('file')} (sha256 {str(doc['model'].get('sha256'))[:12]}...) "
            f"with {len(rows)} pieces, not {mf.path.name} (sha256 {mf.sha256[:12]}...) with {len(names)} pieces.",
            f"Run `planner profile {mf.path.name}` to measure this model, or plan without --profile.",
        )
    sigs = piece_signatures(lg)
    by_sig: dict[str, tuple[float, float]] = {}
    for r in rows:
        by_sig.setdefault(r["signature"], (float(r["fwd_s"]["median"]), float(r["bwd_s"]["median"])))
    hits = {i: by_sig[s] for i, s in enumerate(sigs) if s in by_sig}
    args_note = ""
    if doc["model"].get("model_args") != dict(sorted(mf.model_args.items())):
        args_note = f" (measured with model args {doc['model'].get('model_args')}, planned with {dict(sorted(mf.model_args.items()))})"
    if not hits:
        raise UsageError(
            f"{pname} matches none of the {len(names)} pieces of {mf.path.name}{args_note}: no measured piece has the same structure.",
            "Profile the model with the same --model-arg values (layer count may differ), --leaf and --tracer as the plan.",
        )
    notes = []
    if not same_file:
        notes.append(f"{pname}: the model file changed since profiling (sha256 differs), but it has the same pieces; measured times used")
    key, name = _cluster_device(doc, cluster)
    if key is None:
        devs = ", ".join(sorted({g.device.key for g in cluster.groups}))
        notes.append(f"{pname} was measured on {name or 'an unknown device'}, which is not in the cluster ({devs}); analytical times used")
        return {}, notes
    scale = costs.micro_batch / int(doc["micro_batch"])
    measured = {i: (f * scale, b * scale) for i, (f, b) in sorted(hits.items())}
    n_meas, n = len(measured), len(names)
    scaled = f", scaled linearly from micro-batch {doc['micro_batch']} to {costs.micro_batch}" if scale != 1 else ""
    notes.append(
        f"{pname}: measured times on {key} ({name}, torch {doc['device'].get('torch')}) for {n_meas} of {n} pieces"
        f"{args_note}{scaled}; {n - n_meas} analytical"
    )
    return {key: measured}, notes


# --------------------------------------------------------------------------- hardware profile from a calibration


_PLACEHOLDER_GPU = {
    "intra_node": {"topology": "pcie", "bandwidth_gbps_per_direction": 25, "latency_us": 10},
    "pcie_gbps_per_direction": 25,
    "inter_node": {"bandwidth_gbps_per_direction": 12.5, "latency_us": 20, "fabric": "assumed: 100 Gb/s Ethernet or InfiniBand per GPU"},
    "allreduce_intra": 0.7,
    "allreduce_inter": 0.7,
}


def suggested_hardware_key(profile: Mapping[str, Any]) -> str:
    """A file stem (= profile key) for the calibrated YAML: the resolved device key, or a slug of the name, + '-calibrated'."""
    dev = profile["device"]
    base = dev.get("key") if dev.get("type") == "cuda" and dev.get("key") else None
    if base is None:
        base = "cpu" if dev.get("type") == "cpu" else "".join(c if c.isalnum() else "-" for c in str(dev.get("name", "gpu")).lower()).strip("-")
    return f"{base}-calibrated"


def profile_to_hardware_yaml(profile: Mapping[str, Any], base_profiles: Mapping[str, Any] | None = None) -> str:
    """A hardware-profile YAML (planner/hardware.py schema) from a profile with ``calibration``.

    Measured: ``peak_tflops`` per calibrated dtype (the achieved matmul rate divided
    by planner.hardware's size factor at the calibration size, with
    ``efficiency.matmul`` 1.0, so matmul_time reproduces the measurement),
    ``memory_bandwidth_gbps`` (copy rate, ``efficiency.memory`` 1.0) and memory
    capacity. Links, latencies and all-reduce efficiencies cannot be measured on
    one device: they come from the bundled profile of the same device (CPU: the
    ``cpu`` placeholder profile) when there is one, else from stated assumptions.
    Save it as ``<key>.yaml`` (the file stem is the key) and pass it with
    ``--hardware-profile``.
    """
    import yaml

    from planner import hardware

    cal = profile.get("calibration")
    if not cal:
        raise UsageError("this profile has no calibration.", "Run `planner profile ... --calibrate` to measure the device's matmul rate and bandwidth.")
    dev = profile["device"]
    name, kind = str(dev["name"]), dev["type"]
    where = f"measured by planner profile --calibrate on {name} ({kind}, torch {dev.get('torch')})"
    profiles = hardware.available_profiles() if base_profiles is None else base_profiles
    base_key = dev.get("key") if dev.get("key") in profiles else ("cpu" if kind == "cpu" and "cpu" in profiles else None)
    base = profiles.get(base_key) if base_key else None

    peak, peak_src = {}, []
    for dt, m in sorted(cal["matmul"].items(), key=lambda kv: hardware.DTYPES.index(kv[0]) if kv[0] in hardware.DTYPES else 99):
        scale = hardware.size_scale(m["flops_per_op"], hardware.MATMUL_SIZE_SCALE)  # the written profile keeps the default curves
        peak[dt] = _round(m["flops_per_s"] / scale / 1e12)
        peak_src.append(f"{dt}: {m['flops_per_s'] / 1e12:.4g} TFLOP/s achieved by a {m['n']}x{m['n']} matmul, / size factor {scale:.3f} at {m['flops_per_op']:.3g} FLOP")
    moved = 2.0 * cal["copy"]["bytes"]
    mem_scale = hardware.size_scale(moved, hardware.MEMORY_SIZE_SCALE)
    bw = _round(cal["copy"]["bytes_per_s"] / mem_scale / 1e9)
    total = int(dev.get("memory_bytes") or cal.get("memory_total_bytes"))
    if kind == "cpu":
        avail = int(cal.get("memory_available_bytes") or total)
        usable = min(max(avail, total // 2 + 1), total)
        usable_src = f"MemAvailable from /proc/meminfo at calibration, kept within 50-100% of MemTotal; {where}"
        mem_src = f"MemTotal from /proc/meminfo; {where}"
    else:
        usable = total
        usable_src = f"torch.cuda.mem_get_info total (driver total; context and allocator reserve not subtracted); {where}"
        mem_src = f"torch.cuda.mem_get_info total / 2^30; {where}"

    def from_base(field: str) -> tuple[Any, str]:
        if base is None:
            return None, ""
        src = base.sources.get(field) or " ".join(f"{k}: {v}" for k, v in base.sources.items() if k.startswith(field + "."))
        return base, f"Not measured by calibration: copied from the bundled profile {base.key} ({src})"

    if base is not None:
        _, link_src = from_base("intra_node")
        intra = {"topology": base.intra_topology, "bandwidth_gbps_per_direction": _round(base.intra_bandwidth / 1e9), "latency_us": _round(base.intra_latency * 1e6)}
        pcie = _round(base.pcie_bandwidth / 1e9)
        inter = {"bandwidth_gbps_per_direction": _round(base.inter_bandwidth / 1e9), "latency_us": _round(base.inter_latency * 1e6), "fabric": base.inter_fabric or "as in " + base.key}
        gpn = base.gpus_per_node
        ar = (base.allreduce_efficiency_intra, base.allreduce_efficiency_inter)
        srcs = {k: from_base(k)[1] for k in ("intra_node", "pcie_gbps_per_direction", "inter_node", "gpus_per_node")}
        ar_src = f"Not measured by calibration: all-reduce efficiencies copied from the bundled profile {base.key}"
    else:
        p = _PLACEHOLDER_GPU
        intra, pcie, inter = dict(p["intra_node"]), p["pcie_gbps_per_direction"], dict(p["inter_node"])
        gpn = max(torch.cuda.device_count(), 1) if kind == "cuda" and torch.cuda.is_available() else 8
        ar = (p["allreduce_intra"], p["allreduce_inter"])
        assumed = "Assumption, not measured (calibration times one device only): "
        srcs = {
            "intra_node": assumed + "GPUs talk over PCIe Gen4 x16, ~25 GB/s per direction, 10 us per step. Replace with your node's NVLink figures.",
            "pcie_gbps_per_direction": assumed + "PCIe Gen4 x16, ~25 GB/s per direction.",
            "inter_node": assumed + "one 100 Gb/s NIC share per GPU (12.5 GB/s), 20 us per step. Override with --inter-node-gbps.",
            "gpus_per_node": f"torch.cuda.device_count() on the profiling machine ({gpn})",
        }
        ar_src = assumed + "all-reduce reaches 0.7 of the link bandwidth"
    data = {
        "schema": hardware.SCHEMA_VERSION,
        "name": f"{name} (calibrated)",
        "aliases": [name],
        "memory_gib": _round(total / 2**30),
        "usable_memory_bytes": int(usable),
        "peak_tflops": peak,
        "memory_bandwidth_gbps": bw,
        "intra_node": intra,
        "pcie_gbps_per_direction": pcie,
        "inter_node": inter,
        "gpus_per_node": int(gpn),
        "efficiency": {"matmul": 1.0, "memory": 1.0, "allreduce_intra": ar[0], "allreduce_inter": ar[1]},
        "sources": {
            "memory_gib": mem_src,
            "usable_memory_bytes": usable_src,
            "peak_tflops": "; ".join(peak_src) + f" (so matmul_time reproduces the measured rate at that size); {where}",
            "memory_bandwidth_gbps": f"2 x {cal['copy']['bytes']} bytes / median time of a tensor copy (read + write) = {cal['copy']['bytes_per_s'] / 1e9:.4g} GB/s, / size factor {mem_scale:.3f} at {moved:.3g} bytes (so memory_time reproduces it); {where}",
            **srcs,
            "efficiency.matmul": f"1.0: peak_tflops already is the achieved rate; {where}",
            "efficiency.memory": f"1.0: memory_bandwidth_gbps already is the achieved copy rate; {where}",
            "efficiency.allreduce_intra": ar_src,
            "efficiency.allreduce_inter": ar_src,
        },
    }
    header = (
        f"# Hardware profile calibrated by `planner profile --calibrate` on {name} ({kind}).\n"
        f"# Save as {suggested_hardware_key(profile)}.yaml (the file name is the key) and pass --hardware-profile FILE.\n"
        "# Matmul peak and memory bandwidth are measured; links and all-reduce figures are not (see sources).\n"
    )
    return header + yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=10_000)


def _round(x: float) -> float:
    """Four significant digits (YAML stays readable; calibration noise is larger)."""
    if x == 0 or not math.isfinite(x):
        return x
    return float(f"{x:.4g}")
