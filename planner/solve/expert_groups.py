"""Megatron's expert process groups as global ranks of the planner's placement (torch-free).

The planner places ranks tp innermost, then cp, then dp, with pp outermost (Megatron's default order
``tp-cp-ep-dp-pp``). Megatron-LM core_v0.16 megatron/core/parallel_state.py builds the expert groups with a
second RankGenerator over the same GPUs (tp = etp, ep, dp = world / (etp x ep x pp), cp = 1, the same order):
within a pipeline stage's tp x cp x dp GPUs an expert tensor-parallel group is etp consecutive ranks, an
expert-parallel group ep ranks etp apart, and an expert-data-parallel group (the ranks holding the same expert
shard, over which expert gradients are reduced) tp x cp x dp / (ep x etp) ranks etp x ep apart.
"""

from __future__ import annotations


def expert_parallel_ranks(first: int, ep: int, etp: int) -> list[int]:
    """The expert-parallel group that starts at global rank ``first``."""
    return [first + etp * i for i in range(ep)]


def expert_tensor_ranks(first: int, etp: int) -> list[int]:
    """The expert tensor-parallel group that starts at global rank ``first``."""
    return list(range(first, first + etp))


def expert_data_ranks(first: int, ep: int, etp: int, edp: int) -> list[int]:
    """The expert-data-parallel group that starts at global rank ``first``."""
    return [first + etp * ep * d for d in range(edp)]
