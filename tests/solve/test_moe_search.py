"""The pruned layout search of mixture-of-experts models against pricing every candidate (``exhaustive=True``):
the same top-k layouts and step times on small MoE models, clusters, batches and memory targets."""

import itertools
import random

import pytest

from planner import hardware
from planner.engines import get_engine
from planner.solve.search import _dominance_group, _needs_no_less_memory, enumerate_layouts, search
from planner.solve.settings import Settings
from tests.conftest import costs_of

CASES = [
    # (preset, model overrides, gpus, global batch, memory target)
    pytest.param("deepseek-tiny", {}, "8xH100", None, 0.85, marks=pytest.mark.slow),
    pytest.param("deepseek-tiny", {}, "16xH100", 64, 0.85, marks=pytest.mark.slow),
    ("moe-tiny", {}, "8xH100", 32, 0.85),
    pytest.param("mixtral-8x7b", {"n_layers": 4}, "16xH100", 64, 0.85, marks=pytest.mark.slow),
    ("mixtral-8x7b", {"n_layers": 4}, "16xH100", 64, 0.2),  # tight memory: dominance rejects part of the candidates
]


def _top(res, k):
    return [(e.layout, e.predicted.step_time_s) for e in res.ranked[:k]]


@pytest.mark.parametrize(("preset", "extra", "gpus", "gb", "mem"), CASES)
def test_pruned_moe_search_gives_the_exhaustive_top_k(preset, extra, gpus, gb, mem):
    c = costs_of("moe", preset, **extra)
    cl = hardware.parse_gpus(gpus)
    opts = dict(engine="megatron", top_k=3, global_batch=gb, mem_target=mem)
    fast = search(c, cl, Settings.of(**opts), get_engine("megatron"))
    full = search(c, cl, Settings.of(**opts, exhaustive=True), get_engine("megatron"))
    assert full.considered == fast.considered
    assert fast.priced <= full.priced
    assert _top(fast, 3) == _top(full, 3)
    assert any(e.layout.ep > 1 for e in full.ranked), "the case should exercise expert parallelism"


def test_dominance_group_holds_every_field_the_dominance_requires_equal():
    """Looking dominance up by group loses nothing: layouts of different groups never dominate each other."""
    c = costs_of("moe", "deepseek-tiny")
    cl = hardware.parse_gpus("16xH100")
    layouts, _ = enumerate_layouts(c, cl, Settings.of(engine="megatron"), get_engine("megatron"), 64)
    rng = random.Random(0)
    pairs = [(rng.choice(layouts), rng.choice(layouts)) for _ in range(20000)]
    pairs += [(a, b) for a, b in itertools.product(layouts[:200], layouts[:200])]
    dominated = [(a, b) for a, b in pairs if _needs_no_less_memory(a, b)]
    assert dominated
    assert all(_dominance_group(a) == _dominance_group(b) for a, b in dominated)


def test_remembered_operator_times_follow_the_device_object():
    """The per-operator sums are remembered by device identity: another device (or a changed copy) is timed anew."""
    from dataclasses import replace

    from planner.hardware import memory_time
    from planner.solve.timing import bytes_time

    dev = hardware.parse_gpus("8xH100").device_of(0)
    slow = replace(dev, memory_bandwidth=dev.memory_bandwidth / 2)
    ops = (1e6, 3e7, 5e8)
    for d in (dev, slow, dev, slow):
        assert bytes_time(ops, 0.0, d) == sum(memory_time(x, d, bytes_per_op=x) for x in ops)
    assert bytes_time(ops, 0.0, slow) == pytest.approx(2 * bytes_time(ops, 0.0, dev))
