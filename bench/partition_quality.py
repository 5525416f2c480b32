"""Partition quality: the planner's exact DP against the splits users get from today's tools, on one cost model.

For each model and pipeline depth p, every method's split is priced with the same
stage-time function (the planner's analytical per-piece times on an A100-80GB,
micro-batch 1, plus the point-to-point time of the boundary tensors over
InfiniBand, as the DP itself sees it), and compared with the lower bound
max(total / p, largest piece). Baselines, on the layer list a user hands the tool
(embedding, each transformer block or ResNet block, then the rest):

* DeepSpeed ``partition_method="parameters"`` (its default) and ``"uniform"``:
  DeepSpeed's own ``partition_balanced`` / ``partition_uniform``
  (deepspeed.runtime.utils), called here;
* torchtitan's default rule: the first and last stages take one transformer
  layer fewer than the others, for the embedding and the output
  (torchtitan/distributed/pipeline_parallel.py ``generate_llm_fqn_per_model_part``;
  re-implemented as described: torchtitan is not a dependency);
* Megatron-LM's even split of the transformer layers (embedding with the first
  stage, head with the last), and with ``--account-for-embedding-in-pipeline-split``
  and ``--account-for-loss-in-pipeline-split`` (each counts as one more layer).

The planner is shown at block granularity (the cuts every engine can express)
and at its finer granularity (attention | MLP, head and norm apart), which
DeepSpeed and torch.distributed.pipelining can run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

MODELS = (
    ("gpt2-xl", "gpt2", {"preset": "gpt2-xl"}),
    ("llama-7b", "llama", {"preset": "llama-7b"}),
    ("llama-70b", "llama", {"preset": "llama-70b"}),
    ("bloom-7b (250k vocab)", "gpt2", {"preset": "bloom-7b"}),
    ("resnet152", "resnet", {"preset": "resnet152"}),
)
DEPTHS = (2, 4, 8, 16)


@dataclass
class Problem:
    """A model's pieces with their times, the block structure, and the stage-time function."""

    name: str
    costs: object
    times: np.ndarray  # per piece, seconds (fwd + bwd) per micro-batch
    comm: np.ndarray  # per cut, seconds to send the boundary forward and its gradient back
    units: list[tuple[int, int]]  # the user's layer list: piece ranges of embedding, blocks, rest
    unit_params: list[int]

    def stage_time(self, a: int, b: int) -> float:
        return float(self.times[a:b].sum() + (self.comm[a] if a > 0 else 0.0) + (self.comm[b] if b < len(self.times) else 0.0))

    def bottleneck(self, bounds: Sequence[int]) -> float:
        return max(self.stage_time(a, b) for a, b in zip(bounds, bounds[1:]))

    def lower_bound(self, p: int) -> float:
        return max(self.times.sum() / p, self.times.max())

    def piece_bounds(self, unit_bounds: Sequence[int]) -> list[int]:
        """Piece boundaries of a split of the user's layer list."""
        return [self.units[u][0] if u < len(self.units) else len(self.times) for u in unit_bounds]


def without_comm(pb: Problem) -> Problem:
    """The same problem with free stage boundaries: what the lower bound max(total / p, largest piece) describes."""
    return Problem(pb.name, pb.costs, pb.times, np.zeros_like(pb.comm), pb.units, pb.unit_params)


def make_problem(name: str, example: str, args: dict) -> Problem:
    from planner import hardware
    from planner.model.analyze import analyze
    from planner.solve.timing import analytical_times

    costs = analyze(ROOT / "examples" / f"{example}.py", args, 1, "bf16").costs
    cluster = hardware.parse_gpus("16x8xA100-80GB")
    dev = cluster.device_of(0)
    t = analytical_times(costs, dev, "bf16", "none")
    times = np.array(t.total)
    # stage boundaries between nodes (pipeline outermost): InfiniBand, both directions
    comm = np.array([cluster.p2p_time(c.bytes, 0, 8) + cluster.p2p_time(c.grad_bytes, 8, 0) for c in costs.cuts])
    units: list[tuple[int, int]] = []
    k = 0
    while k < costs.n:
        blk = costs.layers[k].block
        j = k + 1
        while j < costs.n and blk is not None and costs.layers[j].block == blk:
            j += 1
        units.append((k, j))
        k = j
    unit_params = [sum(l.params for l in costs.layers[a:b]) for a, b in units]
    return Problem(name, costs, times, comm, units, unit_params)


def _blocks(pb: Problem) -> list[int]:
    return [i for i, (a, b) in enumerate(pb.units) if pb.costs.layers[a].block is not None]


def deepspeed_parameters(pb: Problem, p: int) -> list[int]:
    from deepspeed.runtime.utils import partition_balanced

    return pb.piece_bounds(partition_balanced(pb.unit_params, p))


def deepspeed_uniform(pb: Problem, p: int) -> list[int]:
    from deepspeed.runtime.utils import partition_uniform

    return pb.piece_bounds(partition_uniform(len(pb.units), p))


def _split_blocks(pb: Problem, counts: Sequence[int]) -> list[int] | None:
    """Stages holding ``counts`` transformer blocks in order; the units before the first block go to stage 0,
    those after the last block to the last stage."""
    blocks = _blocks(pb)
    if sum(counts) != len(blocks) or any(c < 0 for c in counts):
        return None
    bounds, i = [0], 0
    for c in counts[:-1]:
        i += c
        bounds.append(pb.units[blocks[i]][0] if i < len(blocks) else len(pb.times))
    bounds.append(len(pb.times))
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
        return None
    return bounds


def megatron_even(pb: Problem, p: int, account: bool = False) -> list[int] | None:
    L = len(_blocks(pb))
    if not account:
        if L % p:
            return None
        return _split_blocks(pb, [L // p] * p)
    total = L + 2  # embedding and loss count as one layer each
    if total % p:
        return None
    per = total // p
    counts = [per] * p
    counts[0] -= 1
    counts[-1] -= 1
    return _split_blocks(pb, counts)


def torchtitan_rule(pb: Problem, p: int) -> list[int] | None:
    """First and last stage one layer fewer than the others (the rest spread as evenly as the count allows)."""
    L = len(_blocks(pb))
    if p == 1:
        return _split_blocks(pb, [L])
    inner = (L + 2) // p  # the layer budget of a middle stage
    counts = [inner] * p
    counts[0] = counts[-1] = inner - 1
    extra = L - sum(counts)
    for i in range(1, p - 1):
        if extra <= 0:
            break
        counts[i] += 1
        extra -= 1
    counts[-1] += max(extra, 0)
    return _split_blocks(pb, counts)


def planner_dp(pb: Problem, p: int, blocks_only: bool) -> list[int]:
    from planner.solve import partition as part

    n = len(pb.times)
    allowed = np.zeros(n + 1, dtype=bool)
    if blocks_only:
        for a, _ in pb.units:
            allowed[a] = True
    else:
        allowed[:] = True
    allowed[0] = allowed[n] = True
    pre = np.concatenate([[0.0], np.cumsum(pb.times)])
    zero = np.zeros(n + 1)
    comm_in = [zero] + [pb.comm.copy() for _ in range(p - 1)]
    comm_out = [pb.comm.copy() for _ in range(p - 1)] + [zero]
    prob = part.PartitionProblem([pre], [0] * p, comm_in, comm_out, zero, zero, [1.0] * p, [math.inf] * p, allowed)
    sol = part.solve(prob)
    return list(sol.bounds)


METHODS: tuple[tuple[str, Callable], ...] = (
    ("planner DP (pieces)", lambda pb, p: planner_dp(pb, p, False)),
    ("planner DP (blocks)", lambda pb, p: planner_dp(pb, p, True)),
    ("DeepSpeed parameters", deepspeed_parameters),
    ("DeepSpeed uniform", deepspeed_uniform),
    ("torchtitan rule", torchtitan_rule),
    ("Megatron even", lambda pb, p: megatron_even(pb, p, False)),
    ("Megatron even + account-for", lambda pb, p: megatron_even(pb, p, True)),
)


def evaluate(pb: Problem, p: int) -> dict[str, float | None]:
    """Bottleneck / lower bound for every method (None where the method cannot split this model p ways)."""
    lb = pb.lower_bound(p)
    out: dict[str, float | None] = {}
    for name, fn in METHODS:
        bounds = fn(pb, p)
        out[name] = None if bounds is None else pb.bottleneck(bounds) / lb
    return out


def run_all(comm: bool = False, problems: list[Problem] | None = None) -> list[tuple[str, int, dict[str, float | None]]]:
    """Ratios for every model and depth; ``comm`` adds the boundary transfers over InfiniBand to every stage."""
    rows = []
    for pb in problems or [make_problem(*m) for m in MODELS]:
        pb = pb if comm else without_comm(pb)
        for p in DEPTHS:
            if p <= len(pb.units):
                rows.append((pb.name, p, evaluate(pb, p)))
    return rows


def markdown(rows) -> str:
    names = [m for m, _ in METHODS]
    lines = ["| model | p | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
    for model, p, res in rows:
        cells = []
        best = min(v for v in res.values() if v is not None)
        for m in names:
            v = res[m]
            cells.append("n/a" if v is None else (f"**{v:.3f}**" if v == best else f"{v:.3f}"))
        lines.append(f"| {model} | {p} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        "Each cell: bottleneck stage time / lower bound max(total / p, largest piece), both in per-micro-batch compute time "
        "(plus boundary transfers where the table says so); 1.000 is optimal. "
        "n/a: the method cannot split this model p ways (Megatron's even split needs the layer count divisible by p)."
    )
    return "\n".join(lines)
