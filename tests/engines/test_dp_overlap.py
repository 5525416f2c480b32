"""Megatron's data-parallel overlap, bucket by bucket: the closed forms against an event-by-event replay of the
buckets (gradient reduction during the last backward, parameter all-gather chained through the first forward)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.engines import get_engine
from planner.engines.megatron.rules import bucket_params, grad_reduce_exposed, param_gather_exposed
from planner.solve.plan import Layout


def _replay_reduce(comm: float, backward: float, n: int) -> float:
    """Bucket k's gradients are ready at k x backward / n; reductions run one at a time in that order."""
    free = 0.0
    for k in range(1, n + 1):
        free = max(free, k * backward / n) + comm / n
    return free - backward


def _replay_gather(comm: float, forward: float, n: int) -> float:
    """Bucket 0's all-gather starts at the step's end; bucket i + 1's starts when bucket i's forward waits for bucket i's."""
    t, done = 0.0, comm / n  # t: compute clock; done: when the current bucket's gather finishes
    stall = 0.0
    for _ in range(n):
        start = max(t, done)  # the pre-hook waits for this bucket's gather
        stall += start - t
        nxt = start + comm / n  # and dispatches the next one now
        t = start + forward / n
        done = nxt
    return stall


@pytest.mark.parametrize("comm,compute,n", [(1.0, 5.0, 10), (2.0, 0.5, 10), (0.4, 0.4, 84), (3.0, 1.0, 1), (0.3, 0.29, 7)])
def test_closed_forms_match_the_bucket_replay(comm, compute, n):
    assert grad_reduce_exposed(comm, compute, n) == pytest.approx(_replay_reduce(comm, compute, n), rel=1e-12)
    assert param_gather_exposed(comm, compute, n) == pytest.approx(_replay_gather(comm, compute, n), rel=1e-12)


def test_exposed_dp_time_counts_buckets_of_the_ddp_size():
    meg = get_engine("megatron")
    lay = Layout("megatron", 1, 8, 48, 1, 1, 4, 192, "1f1b", "none", 1, True, overlap_grad_reduce=True, overlap_param_gather=True)
    params = 4.0e9  # 48M-parameter buckets at dp 48: 84 buckets
    n = -(-int(params) // bucket_params(48))
    assert n == 84
    got = meg.exposed_dp_time(lay, 0.39, 0.20, [0.15], [0.07], params)
    assert got == pytest.approx(0.39 - 0.15 + 0.15 / n + 0.20 / n + (n - 1) * (0.20 - 0.07) / n)
    assert meg.exposed_dp_time(replace(lay, overlap_grad_reduce=False, overlap_param_gather=False), 0.39, 0.20, [0.15], [0.07], params) == pytest.approx(0.59)
