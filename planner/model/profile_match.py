"""Measured per-piece times (a profile.json from `planner profile`) mapped onto a plan's pieces.

``match_profile`` checks the model (file sha256, else identical piece names) and dtype, maps per-piece
times onto the analysed pieces by signature (pieces of a structure not measured keep the analytical time),
scales them linearly to the costed micro-batch, and keys them by the cluster device the profile was
measured on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from planner import hardware
from planner.errors import UsageError
from planner.hardware import Cluster
from planner.model.analyze import Analysis
from planner.model.profile import piece_signatures, read_profile


def _cluster_device(doc: dict[str, Any], cluster: Cluster) -> tuple[str | None, str]:
    """(cluster device key the profile was measured on, or None; the name used)."""
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


def match_profile(path: str | Path, analysis: Analysis, cluster: Cluster) -> tuple[dict[str, dict[int, tuple[float, float]]], list[str]]:
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
        f"{pname}: measured times on {key} ({name}, torch {doc['device'].get('torch')}) for {n_meas} of {n} pieces{args_note}{scaled}; {n - n_meas} analytical"
    )
    return {key: measured}, notes
