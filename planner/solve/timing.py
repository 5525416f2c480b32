"""Per-piece time of one micro-batch: an analytical roofline, or measured times where a profile has them.

For each piece, on one GPU of a tensor-parallel group of size ``tp``:

    forward   = matmul_time(FLOPs / tp) + memory_time(bytes moved by other operators / tp) + tp collectives
    backward  = the same for the backward's FLOPs and bytes, split into the input-gradient part (I)
                and the weight-gradient part (W) by their FLOPs
    recompute = full: the whole forward again before the backward; selective: the attention core's forward

``matmul_time`` divides FLOPs by the device's dense peak times its achievable
matmul efficiency at the piece's mean operator size; ``memory_time`` divides
bytes by memory bandwidth times its achievable fraction (planner.hardware).

Tensor parallelism (Megatron style, with sequence parallelism) splits a
transformer piece's matmuls and, with sequence parallelism, its other
operators and saved activations over ``tp`` GPUs, and adds per attention or
MLP piece one all-gather + reduce-scatter of the residual stream forward and
one backward (each pair moves what one all-reduce moves: Korthikanti et al.
2022, section 4.2.2); the vocabulary-parallel embedding and head add one
all-reduce (embedding forward, head backward). These collectives are on the
critical path, so they add to the piece's time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from planner.records import Cut, Layer, ModelCosts

TP_COLLECTIVES = {"attention": (1, 1), "mlp": (1, 1), "block": (2, 2), "embedding": (1, 0), "head": (0, 1)}


@dataclass(frozen=True)
class PieceTimes:
    """Seconds per micro-batch for each piece: forward, backward-input, backward-weight, and the recompute added to backward."""

    fwd: tuple[float, ...]
    bwd_input: tuple[float, ...]
    bwd_weight: tuple[float, ...]
    recompute: tuple[float, ...]
    source: tuple[str, ...]  # "analytical" | "measured" per piece

    @property
    def total(self) -> tuple[float, ...]:
        return tuple(f + i + w + r for f, i, w, r in zip(self.fwd, self.bwd_input, self.bwd_weight, self.recompute))


def shard_costs(costs: ModelCosts, tp: int, sequence_parallel: bool = True) -> ModelCosts:
    """The costs one GPU of a tensor-parallel group of ``tp`` sees (parameters are split later, in memory.stage_params).

    Matmul FLOPs divide by ``tp``; with sequence parallelism so do the other
    operators' bytes, the saved activations and the tensors sent between stages.
    """
    if tp == 1:
        return costs
    act = tp if sequence_parallel else 1
    layers = []
    for l in costs.layers:
        shard = l.kind in TP_COLLECTIVES or l.shardable_params > 0
        if not shard:
            layers.append(replace(l, saved_bytes=int(l.saved_bytes / act), mem_bytes_fwd=l.mem_bytes_fwd / act, mem_bytes_bwd=l.mem_bytes_bwd / act, max_op_bytes=int(l.max_op_bytes / act), out_bytes=int(l.out_bytes / act)))
            continue
        layers.append(
            replace(
                l,
                flops_fwd=l.flops_fwd / tp,
                flops_bwd=l.flops_bwd / tp,
                flops_bwd_weight=l.flops_bwd_weight / tp,
                core_flops_fwd=l.core_flops_fwd / tp,
                core_bytes_fwd=l.core_bytes_fwd / tp,
                core_saved_bytes=int(l.core_saved_bytes / tp),
                saved_bytes=int((l.saved_bytes - l.core_saved_bytes) / act + l.core_saved_bytes / tp),
                mem_bytes_fwd=l.mem_bytes_fwd / act,
                mem_bytes_bwd=l.mem_bytes_bwd / act,
                max_op_bytes=int(l.max_op_bytes / act),
                out_bytes=int(l.out_bytes / act),
            )
        )
    cuts = tuple(replace(c, tensors=tuple(replace(t, bytes=int(t.bytes / act)) for t in c.tensors)) for c in costs.cuts)
    return replace(costs, layers=tuple(layers), cuts=cuts)


def analytical_times(
    costs: ModelCosts,
    device,
    dtype: str,
    recompute: str = "none",
    tp: int = 1,
    tp_collective_time: float | Sequence[float] = 0.0,
) -> PieceTimes:
    """Roofline times of every piece (``costs`` already sharded with :func:`shard_costs`).

    ``tp_collective_time`` is the seconds of one residual-stream collective over
    the tensor-parallel group, per piece or one value for all (0 when tp == 1).
    """
    n = len(costs.layers)
    coll = [float(tp_collective_time)] * n if isinstance(tp_collective_time, (int, float)) else list(tp_collective_time)
    from planner import hardware

    fwd, bi, bw, rc = [], [], [], []
    for k, l in enumerate(costs.layers):
        op = l.flops_fwd / max(l.matmul_ops_fwd, 1)
        f = hardware.matmul_time(l.flops_fwd, device, dtype, flops_per_op=op) + hardware.memory_time(l.mem_bytes_fwd, device)
        w = hardware.matmul_time(l.flops_bwd_weight, device, dtype, flops_per_op=op)
        i = hardware.matmul_time(l.flops_bwd - l.flops_bwd_weight, device, dtype, flops_per_op=op) + hardware.memory_time(l.mem_bytes_bwd, device)
        n_f, n_b = TP_COLLECTIVES.get(l.kind, (0, 0)) if tp > 1 else (0, 0)
        f += n_f * coll[k]
        i += n_b * coll[k]
        if recompute == "full":
            r = f
        elif recompute == "selective":
            r = hardware.matmul_time(l.core_flops_fwd, device, dtype, flops_per_op=op) + hardware.memory_time(l.core_bytes_fwd, device)
        else:
            r = 0.0
        fwd.append(f)
        bi.append(i)
        bw.append(w)
        rc.append(r)
    return PieceTimes(tuple(fwd), tuple(bi), tuple(bw), tuple(rc), ("analytical",) * n)


def with_measured(times: PieceTimes, measured: Mapping[int, tuple[float, float]], recompute: str) -> PieceTimes:
    """Replace analytical times by measured (forward, backward) seconds for the pieces in ``measured``.

    The measured backward is split into input and weight parts in the
    analytical proportion; full recompute adds the measured forward.
    """
    fwd, bi, bw, rc, src = map(list, (times.fwd, times.bwd_input, times.bwd_weight, times.recompute, times.source))
    for k, (f, b) in measured.items():
        total_b = bi[k] + bw[k]
        share = bw[k] / total_b if total_b > 0 else 0.5
        fwd[k], bw[k], bi[k] = f, b * share, b * (1 - share)
        if recompute == "full":
            rc[k] = f
        src[k] = "measured"
    return PieceTimes(tuple(fwd), tuple(bi), tuple(bw), tuple(rc), tuple(src))
