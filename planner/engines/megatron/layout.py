"""Megatron-LM's per-stage layer split: ``--pipeline-model-parallel-layout`` strings and the flags that give a split.

* :func:`layout_string` / :func:`parse_layout` write and read ``--pipeline-model-parallel-layout``
  (megatron-core 0.16.1, pipeline_parallel_layer_layout.py);
* :func:`stage_layers` computes the split Megatron builds from a set of flags (get_num_layers_to_build);
* :func:`split_flags` chooses how a planned split is expressed (even, uneven first/last, layout).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from planner.engines.megatron.flags import Flag, MegatronArgs


class LayoutError(ValueError):
    """A --pipeline-model-parallel-layout string that Megatron cannot parse."""


_LAYOUT_CHARS = {"E", "t", "m", "L"}


def parse_layout(s: str) -> list[list[str]]:
    """Stages of a ``--pipeline-model-parallel-layout`` string, each a list of ``E``/``t``/``m``/``L``.

    Same expansion as megatron-core's ``PipelineParallelLayerLayout.parse_str_to_list``:
    commas removed, ``(...)*n`` then ``x*n`` unrolled, stages split on ``|``. Raises
    :class:`LayoutError` for anything Megatron would reject while parsing.
    """
    text = s.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    stages: list[list[str]] = []
    for stage in text.split("|"):
        bad = sorted({c for c in stage if c not in _LAYOUT_CHARS})
        if bad:
            raise LayoutError(
                f"layout {s!r} has {', '.join(repr(c) for c in bad)} after expansion; "
                "only E (embedding), t (decoder layer), m (MTP layer), L (loss), | (stage separator), "
                "x*n and (...)*n (repetition, no nesting) and commas are understood"
            )
        stages.append(list(stage))
    return stages


def _stage_text(k: int, embedding: bool, loss: bool) -> str:
    body = "t" * k if k <= 3 else f"t*{k}"
    return ("E" if embedding else "") + body + ("L" if loss else "")


def layout_string(stage_layers: Sequence[int], pp: int, has_embedding_first: bool = True, loss_last: bool = True) -> str:
    """The ``--pipeline-model-parallel-layout`` for ``stage_layers`` decoder layers per stage.

    Stages are in Megatron's order (stage i on pipeline rank i % pp, virtual chunk i // pp);
    ``E`` opens the first stage, ``L`` closes the last; runs of equal stages are written as
    ``(t*k|)*n``. Example: ``[1, 2, 2, 2, 2, 2, 2, 1]`` with pp=4 gives ``"Et|(tt|)*6,tL"``.
    """
    counts = [int(k) for k in stage_layers]
    if pp < 1 or not counts or len(counts) % pp:
        raise ValueError(f"{len(counts)} stages do not divide over pp = {pp}")
    if any(k < 0 for k in counts):
        raise ValueError(f"negative layer count in {counts}")
    n = len(counts)
    texts = [_stage_text(k, has_embedding_first and j == 0, loss_last and j == n - 1) for j, k in enumerate(counts)]
    groups: list[tuple[str, int]] = []
    for t in texts:
        if groups and groups[-1][0] == t:
            groups[-1] = (t, groups[-1][1] + 1)
        else:
            groups.append((t, 1))
    out: list[str] = []
    for g, (t, reps) in enumerate(groups):
        last_group = g == len(groups) - 1
        if last_group:
            if reps == 1:
                out.append(t)
            elif reps == 2:
                out.append(f"{t}|{t}")
            else:
                out.append(f"({t}|)*{reps - 1},{t}")
        elif reps == 1:
            out.append(f"{t}|")
        elif t and reps >= 2:
            out.append(f"({t}|)*{reps}")
        else:  # empty stages: "||"
            out.append("|" * reps)
    text = ",".join(out).replace("|,", "|")
    return text


def stage_layers(args: MegatronArgs) -> list[int] | None:
    """Decoder layers Megatron builds on each stage (stage i on rank i % pp, chunk i // pp) for these flags.

    Mirrors megatron-core's ``get_num_layers_to_build``; None when the flags are inconsistent
    (check_megatron_args says why) or not known.
    """
    L = args.int("--num-layers")
    pp = args.int("--pipeline-model-parallel-size", 1)
    if L is None or pp is None or pp < 1:
        return None
    layout = args.value("--pipeline-model-parallel-layout")
    if layout is not None:
        try:
            stages = parse_layout(layout)
        except LayoutError:
            return None
        if len(stages) % pp:
            return None
        return [st.count("t") for st in stages]
    vp = virtual_size(args, L, pp) or 1
    first = args.int("--decoder-first-pipeline-num-layers")
    last = args.int("--decoder-last-pipeline-num-layers")
    emb = args.has("--account-for-embedding-in-pipeline-split")
    loss = args.has("--account-for-loss-in-pipeline-split")
    per_rank = [0] * pp
    if first is not None or last is not None:
        rest, left = L - (first or 0) - (last or 0), pp - (first is not None) - (last is not None)
        if left < 0 or (left == 0 and rest) or (left and rest % left) or rest < 0:
            return None
        mid = rest // left if left else 0
        per_rank = [mid] * pp
        if first is not None:
            per_rank[0] = first
        if last is not None:
            per_rank[-1] = last
    else:
        total = L + emb + loss
        if total % pp:
            return None
        per_rank = [total // pp] * pp
    if any(r % vp for r in per_rank):
        return None
    out = [per_rank[i % pp] // vp for i in range(pp * vp)]
    if emb:
        out[0] -= 1
    if loss:
        out[-1] -= 1
    if any(k < 0 for k in out):
        return None
    return out


def virtual_size(args: MegatronArgs, L: int, pp: int) -> int | None:
    """Virtual stages per pipeline rank (None for no interleaving), as validate_args derives it."""
    layout = args.value("--pipeline-model-parallel-layout")
    if layout is not None:
        try:
            n = len(parse_layout(layout))
        except LayoutError:
            return None
        v = n // pp if n % pp == 0 else None
        return v if v and v > 1 else None
    nvs = args.int("--num-virtual-stages-per-pipeline-rank")
    if nvs is not None:
        return nvs if nvs > 1 else None
    nlpvs = args.int("--num-layers-per-virtual-pipeline-stage")
    if nlpvs is not None and nlpvs > 0:
        total = L + args.has("--account-for-embedding-in-pipeline-split") + args.has("--account-for-loss-in-pipeline-split")
        if total % pp or (total // pp) % nlpvs:
            return None
        v = total // pp // nlpvs
        return v if v > 1 else None
    return None


def split_flags(stage_layers_: Sequence[int], pp: int) -> list[tuple[str, str | None]]:
    """The flags that make Megatron build ``stage_layers_`` decoder layers per stage (len = pp x vp).

    Even split: only ``--num-virtual-stages-per-pipeline-rank`` (when vp > 1). Only the first and/or
    last pipeline rank differ (in every virtual chunk alike, as Megatron spreads them):
    ``--decoder-first/last-pipeline-num-layers``. Otherwise ``--pipeline-model-parallel-layout``
    with E in the first stage and L in the last. The result is checked with :func:`stage_layers`.
    """
    counts = [int(k) for k in stage_layers_]
    if pp < 1 or not counts or len(counts) % pp:
        raise ValueError(f"{len(counts)} stages do not divide over pp = {pp}")
    vp = len(counts) // pp
    L = sum(counts)
    base = [("--num-layers", str(L)), ("--pipeline-model-parallel-size", str(pp))]
    vflags: list[tuple[str, str | None]] = [("--num-virtual-stages-per-pipeline-rank", str(vp))] if vp > 1 else []
    candidates: list[list[tuple[str, str | None]]] = []
    if len(set(counts)) == 1 and counts[0] > 0:
        candidates.append(vflags)
    per_chunk = [counts[c * pp : (c + 1) * pp] for c in range(vp)]
    if pp >= 2 and all(ch == per_chunk[0] for ch in per_chunk) and all(k > 0 for k in counts):
        ch = per_chunk[0]
        if pp == 2 or len(set(ch[1:-1])) == 1:
            mid = ch[1] if pp > 2 else None
            uneven: list[tuple[str, str | None]] = []
            if mid is None or ch[0] != mid:
                uneven.append(("--decoder-first-pipeline-num-layers", str(ch[0] * vp)))
            if mid is not None and ch[-1] != mid:
                uneven.append(("--decoder-last-pipeline-num-layers", str(ch[-1] * vp)))
            candidates.append(vflags + uneven)
    candidates.append([("--pipeline-model-parallel-layout", layout_string(counts, pp))])
    for extra in candidates:
        args = MegatronArgs("args", tuple(Flag(n, (v,) if v is not None else (), 0) for n, v in base + extra))
        if stage_layers(args) == counts:
            return extra
    raise ValueError(f"no Megatron flags express the split {counts} over pp = {pp}")  # pragma: no cover - the layout always does
