"""What torch.distributed.pipelining runs, shared by the engines built on it (the torch and torchtitan wings).

Facts (torch 2.13): it runs GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble and
DualPipeV over PipelineStage modules. ``Schedule1F1B`` needs micro-batches >= stages; the interleaved and zero-bubble
schedules need the micro-batch count to be a multiple of their rounds ``max(1, m // pp)``; ZBV exactly 2 stages per
rank (torch/distributed/pipelining/schedules.py).
"""

from __future__ import annotations

from planner.engines.base import Engine
from planner.solve.plan import Layout


class PipeliningEngine(Engine):
    """The schedule rules of torch.distributed.pipelining; an engine on it adds its state recipe and its own rules."""

    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "looped-bfs", "zb-h1", "interleaved-zb", "zbv", "dualpipev")
    #: looped-bfs, interleaved-zb and dualpipev are priced on request with --schedule but not searched by default
    searched_schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")

    def blocking_sends(self, layout: Layout) -> bool:
        """Schedule1F1B's steady state blocks on its sends: it fires each forward send together with the next
        gradient receive, and each gradient send with the next forward receive, and waits on both before the next
        pass (torch/distributed/pipelining/schedules.py, torch 2.13: ``_wait_batch_p2p(_batch_p2p(fwd_sends +
        bwd_recvs))``). Its warm-up and cool-down sends, and every other schedule's, are waited on later (priced
        blocking too for 1F1B: a send per boundary of the fill and drain at most)."""
        return layout.schedule == "1f1b" and layout.vp == 1

    def runtime_schedule_problems(self, schedule: str, pp: int, m: int, v: int, group: int = 0) -> list[str]:
        out = super().runtime_schedule_problems(schedule, pp, m, v, group)
        rounds = max(1, m // pp)
        if schedule == "1f1b" and m < pp:
            out.append(f"torch Schedule1F1B needs m >= number of stages (m >= p = {pp}), got m={m}")
        if schedule == "zb-h1" and m % rounds != 0:
            out.append(f"torch ScheduleInterleavedZeroBubble needs m to be a multiple of its number of rounds max(1, m // p) = {rounds} (got m={m}, p={pp})")
        return out
