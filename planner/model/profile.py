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

The device calibration it records (planner.model.device.calibrate_device: the achieved
matmul rate, FLOP/s, and copy bandwidth, bytes read + written per second) becomes a hardware
profile through planner.hardware.calibrated.profile_to_hardware_yaml, chosen so that the
analytical model of planner.hardware reproduces the measurements:

* ``matmul_time(F, op) = F / (peak * efficiency.matmul * size_scale(op))``. With
  ``efficiency.matmul = 1`` and ``peak = achieved / size_scale(op_c)`` (``op_c``
  the FLOPs of the calibration matmul), the model returns exactly the measured
  time for the calibration matmul; on a GPU the default 8192^3 matmul is past the
  top of the size curve (``size_scale = 1``), so ``peak`` is the achieved rate.
* ``memory_time(B, op) = B / (bandwidth * efficiency.memory * size_scale(op))``: the
  costing counts a copy as its input plus output bytes, so ``bandwidth`` = 2 x copied
  bytes / time / size_scale(2 x copied bytes) and ``efficiency.memory = 1``; the
  default copies (256 MiB on CPU, 2 GiB on GPU) are past the top of the size curve.

planner.model.profile_match maps a profile.json onto a plan's pieces.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from planner import __version__
from planner.errors import UsageError
from planner.fileio import dumps_json, write_text_atomic
from planner.model.analyze import analyze, torch_dtype
from planner.model.cost import piece_structure
from planner.model.device import Timer, calibrate_device, check_device, device_memory, device_name, hardware_key_for, summarize, sync
from planner.model.load import load_model_file
from planner.model.losses import choose_loss, loss_function, tensor_leaves

PROFILE_SCHEMA = 1
PROFILE_KIND = "planner-profile"
DEVICES = ("cpu", "cuda")
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
            for shape, dtype, rg in meta.tensors if meta else ():
                dims = tuple("B" if d == bdim else int(x) for d, x in enumerate(shape))
                ins.append((dims, str(dtype), bool(rg)))
        sig = (struct, tuple(ins), i == lg.n - 1)
        out.append(hashlib.sha256(repr(sig).encode()).hexdigest()[:16])
    return out


# --------------------------------------------------------------------------- device facts
# --------------------------------------------------------------------------- model on the device


def _estimate_bytes(costs, itemsize: int) -> int:
    """Bytes profiling needs at once: all weights, plus the largest piece's gradients, saved activations and cut values."""
    weights = costs.total_params * itemsize + sum(l.buffer_bytes for l in costs.layers)
    piece = max((l.param_bytes + l.saved_bytes + 2 * l.out_bytes + l.max_op_bytes for l in costs.layers), default=0)
    cut = max((c.bytes for c in costs.cuts), default=0)
    return int(weights + piece + 2 * cut)


def _too_big(what: str, need: float, have: float, device: str, name: str) -> UsageError:
    return UsageError(
        f"The model is too big to profile on {device} ({name}): {what} needs about {need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB is free.",
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
                    f"Piece {piece_name} uses a constant {node.target} that only exists on the meta device (torch.export lifted it while tracing).",
                    "Profile with --tracer fx, or make the constant a registered buffer of the model.",
                )


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
        self.leaves = [t for t in tensor_leaves(args) if t.requires_grad]
        self.grads: list[torch.Tensor] | None = None

    def step(self, timer: Timer | None = None) -> None:
        """Forward (with the loss for the last piece), then backward into the parameters and the inputs."""
        if timer:
            timer.start()
        out = self.mod(*self.args)
        roots = [self.loss(out)] if self.loss is not None else [t for t in tensor_leaves(out) if t.requires_grad]
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
    sync(device)
    while time.perf_counter() - start < warmup_s:
        for run in runs:
            run.step()
        sync(device)
    timers = [Timer(device) for _ in runs]
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
    """The last piece's loss, chosen as in costing (planner.model.losses.choose_loss) on its first output."""
    target = None
    if mf.has("example_target"):
        with torch.device(device):
            target = _on_device(mf.call("example_target", batch), device, dtype)
    chosen: list[Any] = []

    def loss(out: Any) -> torch.Tensor:
        if not chosen:
            chosen.append(loss_function(mf, choose_loss(mf, out), target))
        return chosen[0](out)

    return loss


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

    check_device(device)
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
            raw_inputs = mf.example_inputs(micro_batch)
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
            "count": torch.cuda.device_count() if device == "cuda" else 1,
        },
        "dtype": dtype,
        "micro_batch": micro_batch,
        "inputs": [{"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")} for t in tensor_leaves(inputs)],
        "settings": {
            "warmup": warmup,
            "warmup_s": warmup_s,
            "repeats": repeats,
            "timer": "cuda events + synchronize" if device == "cuda" else "time.perf_counter",
            "seed": seed,
        },
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
        rows.append(
            {
                "index": i,
                "name": piece.name,
                "kind": piece.kind,
                "signature": sigs[i],
                "same_as": first.get(sigs[i]),
                "flops_fwd": layer.flops_fwd,
                "flops_bwd": layer.flops_bwd,
            }
        )
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
        raise UsageError(
            f'{path} is not a profile written by `planner profile` (no "kind": "{PROFILE_KIND}").', "Pass the profile.json that `planner profile` wrote."
        )
    if doc.get("schema") != PROFILE_SCHEMA:
        raise UsageError(
            f"profile {path} has schema {doc.get('schema')!r}; this planner reads schema {PROFILE_SCHEMA}.",
            "Re-run `planner profile` with this planner version.",
        )
    for key in ("model", "device", "dtype", "micro_batch", "pieces"):
        if key not in doc:
            raise UsageError(f"profile {path} lacks the field {key!r}.", "Re-run `planner profile` to write it again.")
    return doc
