"""The parallel axes of a layout and every rank arithmetic on them: one record, used by the search, its lower bound,
pricing, memory, the plan record and the renderers alike (torch-free).

Placement: tp innermost, then cp, then dp, with pp outermost, Megatron's default order ``tp-cp-ep-dp-pp``
(Megatron-LM core_v0.16 megatron/core/parallel_state.py ``RankGenerator``) and torchtitan's ``ParallelDims`` mesh
(pp, dp, cp, tp, outermost first). So pipeline rank r holds the :attr:`Mesh.block` consecutive GPUs
``[r * block, (r + 1) * block)``; the GPUs that hold the same weights (the gradient-reduction group) are the dp x cp
ranks ``tp`` apart within it.

Experts (mixture-of-experts layers): Megatron builds the expert groups with a second RankGenerator over the same GPUs
(tp = etp, ep, dp = world / (etp x ep x pp), cp = 1, the same order), so within a pipeline rank's tp x cp x dp GPUs an
expert tensor-parallel group is etp consecutive ranks, an expert-parallel group ep ranks etp apart, and an
expert-data-parallel group (the ranks holding the same expert shard, over which expert gradients are reduced and
the distributed optimizer shards their state) tp x cp x dp / (ep x etp) ranks etp x ep apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Mesh:
    """GPUs per axis: pipeline (pp), data (dp), context (cp), tensor (tp) parallel, and the expert axes ep and etp
    that tile each pipeline rank's tp x cp x dp GPUs."""

    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    etp: int = 1

    @property
    def world(self) -> int:
        """GPUs in all: pp x dp x cp x tp."""
        return self.pp * self.dp * self.cp * self.tp

    @property
    def block(self) -> int:
        """GPUs of one pipeline rank: dp x cp x tp."""
        return self.dp * self.cp * self.tp

    @property
    def replicas(self) -> int:
        """GPUs holding the same dense weights, over which gradients are reduced and ZeRO shards: dp x cp."""
        return self.dp * self.cp

    @property
    def expert_data_parallel(self) -> int:
        """GPUs holding the same expert shard: tp x cp x dp / (ep x etp)."""
        return self.block // (self.ep * self.etp)

    def first_gpu(self, r: int) -> int:
        """The first global rank of pipeline rank ``r``."""
        return r * self.block

    def last_gpu(self, r: int) -> int:
        return (r + 1) * self.block - 1

    def firsts(self) -> list[int]:
        """The first global rank of every pipeline rank, in order."""
        return [self.first_gpu(r) for r in range(self.pp)]

    def grad_group(self, first: int) -> list[int]:
        """The gradient-reduction group starting at global rank ``first``: the dp x cp replicas, tp ranks apart."""
        return [first + d * self.tp for d in range(self.replicas)]

    def tp_group(self, first: int) -> list[int]:
        """The tensor-parallel group starting at global rank ``first``: tp consecutive ranks."""
        return list(range(first, first + self.tp))

    def cp_group(self, first: int) -> list[int]:
        """The context-parallel ring starting at global rank ``first``: cp ranks tp apart."""
        return [first + k * self.tp for k in range(self.cp)]

    def expert_parallel_group(self, first: int) -> list[int]:
        """The expert-parallel group starting at global rank ``first``: ep ranks etp apart."""
        return [first + self.etp * i for i in range(self.ep)]

    def expert_tensor_group(self, first: int) -> list[int]:
        """The expert tensor-parallel group starting at global rank ``first``: etp consecutive ranks."""
        return list(range(first, first + self.etp))

    def expert_data_group(self, first: int) -> list[int]:
        """The expert-data-parallel group starting at global rank ``first``: etp x ep ranks apart."""
        return [first + self.etp * self.ep * d for d in range(self.expert_data_parallel)]

    def problems(self) -> list[str]:
        """Every divisibility rule the axes break (empty when they tile the GPUs): each axis at least 1, and ep x etp
        dividing the tp x cp x dp GPUs of a pipeline rank (Megatron-LM core_v0.16 parallel_state.py: world % (etp x ep x
        pp) == 0)."""
        out = [f"{name} = {value} must be at least 1" for name, value in vars(self).items() if value < 1]
        if not out and self.block % (self.ep * self.etp):
            out.append(f"ep x etp = {self.ep} x {self.etp} does not divide the tp x cp x dp = {self.block} GPUs of a pipeline stage")
        return out


def cp_comm_problems(cp_comm: str, cp: int, tp: int, architecture: dict[str, Any] | None) -> list[str]:
    """Why context parallelism's ``cp_comm`` cannot run at this cp x tp: the all-to-all type scatters each GPU's
    attention heads and key/value heads over its cp GPUs (Transformer Engine context_parallel.py,
    flash_attn_a2a_communicate: ``x.view(..., cp_size, heads // cp_size, ...)`` on q, k and v), so both per-GPU counts
    must divide by cp; an unknown architecture cannot be checked, so all-to-all is not planned for it."""
    if cp_comm != "a2a":
        return []
    if not architecture or not architecture.get("num_attention_heads"):
        return ["--cp-comm-type a2a needs the model's attention heads (no architecture was derived) to check they divide by cp"]
    heads = int(architecture["num_attention_heads"])
    groups = int(architecture.get("num_query_groups") or heads)
    if heads % tp or groups % tp or (heads // tp) % cp or (groups // tp) % cp:
        return [
            f"--cp-comm-type a2a scatters heads over cp: {heads} attention and {groups} key/value heads over tp {tp} leave a count per GPU that cp {cp} does not divide"
        ]
    return []
