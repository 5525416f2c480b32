"""Blocking pipeline sends (EngineRules.blocking_sends, StageTimes.blocking) against a model of Megatron's
non-interleaved schedule written from its code: every exchange a paired, blocking rendezvous."""

from __future__ import annotations

import random

import pytest

from planner import hardware
from planner.engines import get_engine
from planner.solve.plan import Layout
from planner.solve.schedules import build_schedule
from planner.solve.simulate import StageTimes, simulate


def _program(r: int, p: int, m: int) -> list[tuple[str, object]]:
    """Rank r's operations in megatron-core's forward_backward_pipelining_without_interleaving (core_v0.16.1):
    min(p - r - 1, m) warm-up forwards, each recv_forward / forward / send_forward; recv_forward; then per remaining
    micro-batch forward, send_forward_recv_backward, backward and send_backward_recv_forward (send_backward after the
    last); then the cool-down's recv_backward / backward / send_backward. ("X", transfers) is one blocking call."""
    ops: list[tuple[str, object]] = []
    warm = min(p - r - 1, m)
    first, last = r == 0, r == p - 1

    def recv_f(j):
        return [] if first else [("f", r - 1, j)]

    def send_f(j):
        return [] if last else [("f", r, j)]

    def recv_b(j):
        return [] if last else [("b", r, j)]

    def send_b(j):
        return [] if first else [("b", r - 1, j)]

    nf = nb = 0
    for _ in range(warm):
        ops += [("X", recv_f(nf)), ("F", nf), ("X", send_f(nf))]
        nf += 1
    rem = m - warm
    if rem:
        ops.append(("X", recv_f(nf)))
    for i in range(rem):
        ops += [("F", nf), ("X", send_f(nf) + recv_b(nb)), ("B", nb)]
        nf += 1
        ops.append(("X", send_b(nb) if i == rem - 1 else send_b(nb) + recv_f(nf)))
        nb += 1
    for _ in range(warm):
        ops += [("X", recv_b(nb)), ("B", nb), ("X", send_b(nb))]
        nb += 1
    return ops


def _rendezvous_step(times: StageTimes, m: int) -> float:
    """Seconds of that schedule when a transfer starts once both ends have posted it and a blocking call returns when
    all its transfers are done (send_fwd[s] / send_bwd[s] seconds across boundary s)."""
    p = times.num_stages
    progs = [_program(r, p, m) for r in range(p)]
    ptr, t, posted = [0] * p, [0.0] * p, [False] * p
    posts: dict[tuple, dict[int, float]] = {}
    back = [i + w for i, w in zip(times.bwd_input, times.bwd_weight)]
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while ptr[r] < len(progs[r]):
                kind, arg = progs[r][ptr[r]]
                if kind == "F":
                    t[r] += times.fwd[r]
                elif kind == "B":
                    t[r] += back[r]
                else:
                    if not posted[r]:
                        for x in arg:  # type: ignore[union-attr]
                            posts.setdefault(x, {})[r] = t[r]
                        posted[r] = True
                    if any(len(posts[x]) < 2 for x in arg):  # type: ignore[union-attr]
                        break
                    dur = [(times.send_fwd if x[0] == "f" else times.send_bwd)[x[1]] for x in arg]  # type: ignore[union-attr]
                    t[r] = max([t[r]] + [max(posts[x].values()) + d for x, d in zip(arg, dur)])  # type: ignore[arg-type]
                    posted[r] = False
                ptr[r] += 1
                moved = True
    assert all(ptr[r] == len(progs[r]) for r in range(p)), "the reference deadlocked"
    return max(t)


def _cases(n: int, sends: bool = True):
    rng = random.Random(7)
    for _ in range(n):
        p = rng.randint(2, 6)
        m = rng.randint(p, 3 * p)
        s = [rng.uniform(0.0, 0.5) if sends else 0.0 for _ in range(p - 1)]
        yield p, m, StageTimes([rng.uniform(1, 3) for _ in range(p)], [rng.uniform(2, 5) for _ in range(p)], [0.0] * p, s, s)


def test_without_sends_the_reference_is_the_1f1b_simulation():
    """The reference's order is the simulator's 1F1B: with free links both give the same step."""
    for p, m, times in _cases(60, sends=False):
        assert _rendezvous_step(times, m) == pytest.approx(simulate(build_schedule("1f1b", p, m), times, timeline=False).step_time, rel=1e-12)


def test_folded_sends_price_megatrons_blocking_exchanges_within_one_send_per_stage():
    """Folding each send into its sender's pass (StageTimes.blocking) never exceeds the paired rendezvous, and falls
    short of it by at most one send per boundary: the warm-up forwards' sends, which wait for a receiver still busy
    forwarding the micro-batch before. The unfolded times (sends overlapped) miss the sends on the steady state's
    critical path: they fall short by more than that on these cases."""
    behind = 0
    for p, m, times in _cases(200):
        ref = _rendezvous_step(times, m)
        folded = simulate(build_schedule("1f1b", p, m), times.blocking(), timeline=False).step_time
        overlapped = simulate(build_schedule("1f1b", p, m), times, timeline=False).step_time
        slack = (p - 1) * max(times.send_fwd)
        assert folded <= ref + 1e-9
        assert ref <= folded + slack + 1e-9
        behind += ref > overlapped + slack + 1e-9
    assert behind > 100


def test_blocking_moves_each_send_onto_its_sender():
    t = StageTimes([1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [0.5, 0.5, 0.5], [0.1, 0.2], [0.3, 0.4])
    b = t.blocking()
    assert b.fwd == (1.1, 2.2, 3.0)
    assert b.bwd_input == (4.0, 5.3, 6.4)
    assert b.bwd_weight == t.bwd_weight and b.send_fwd == (0.0, 0.0) and b.send_bwd == (0.0, 0.0)


@pytest.mark.parametrize(
    "engine,vp,blocks",
    [
        ("megatron", 1, True),
        ("megatron", 2, False),
        ("deepspeed", 1, True),
        ("torch", 1, True),
        ("torch", 2, False),
        ("torchtitan", 1, True),
        ("torchtitan", 2, False),
    ],
)
def test_which_engines_block_on_their_sends(engine, vp, blocks):
    """Megatron's non-interleaved schedule (batched, waited and device-synchronised exchanges), DeepSpeed's pipeline
    engine (dist.send) and torch.distributed.pipelining's Schedule1F1B (each send fired with the next receive and
    waited) block; the interleaved schedules overlap their exchanges."""
    lay = Layout(engine, 4, 1, 1, vp, 1, 8, 8, "interleaved" if vp > 1 else "1f1b", "none", 0)
    assert get_engine(engine).blocking_sends(lay) is blocks


def test_one_send_between_two_a100s_of_a_node_runs_at_nccls_point_to_point_rate():
    """hardware_profiles/a100-80gb.yaml intra_node.p2p_gbps: a send inside a node at 72 GB/s (nccl-tests' sendrecv on
    NVLink3), across nodes at the NIC's 25 GB/s; all-reduces keep the links' 300 GB/s."""
    cluster = hardware.parse_gpus("16xA100-80GB")
    assert cluster.p2p_bandwidth(0, 1) == pytest.approx(72e9)
    assert cluster.p2p_bandwidth(7, 8) == pytest.approx(25e9)
    assert cluster.device_of(0).intra_bandwidth == pytest.approx(300e9)
    nbytes = 28.3e6
    assert cluster.p2p_time(nbytes, 0, 1) == pytest.approx(5e-6 + nbytes / 72e9)
    h100 = hardware.parse_gpus("16xH100-SXM")
    assert h100.p2p_bandwidth(0, 1) == pytest.approx(h100.device_of(0).intra_bandwidth)  # no figure: the link's


def test_a_megatron_1f1b_step_is_priced_with_its_sends_blocking(monkeypatch):
    """price_layout simulates Megatron's non-interleaved layouts with the folded times: slower than the same layout
    with its sends overlapped, by no more than the sends on every micro-batch's path."""
    from pathlib import Path

    from planner.model.analyze import analyze
    from planner.solve.search import Context, price_layout
    from planner.solve.settings import Settings

    path = Path(__file__).resolve().parents[2] / "examples" / "gpt2.py"
    costs = analyze(path, {"preset": "gpt2-tiny", "n_layer": 4}, 1, "bf16").costs
    engine = get_engine("megatron")
    lay = Layout("megatron", 2, 1, 1, 1, 1, 8, 8, "1f1b", "none", 0)

    def step():
        ctx = Context(costs, hardware.parse_gpus("2xA100-80GB"), Settings.of(engine="megatron", global_batch=8), engine)
        return price_layout(ctx, lay, "bf16").predicted.step_time_s

    blocking = step()
    monkeypatch.setattr(type(engine), "blocking_sends", lambda self, layout: False)
    overlapped = step()
    assert blocking > overlapped
