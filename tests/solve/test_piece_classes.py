"""The search's shortcuts over repeated pieces: ``records.evolve`` builds the record ``dataclasses.replace`` builds, and
``analytical_times`` with ``records.piece_classes`` gives every piece the times it gives without them, bit for bit."""

from __future__ import annotations

import dataclasses

import pytest

from planner import hardware
from planner.records import ModelCosts, RecomputeWork, TensorInfo, evolve, piece_classes
from planner.solve.search import fp8_casts
from planner.solve.timing import analytical_times, shard_costs, split_context
from tests.conftest import costs_of


def test_evolve_builds_what_replace_builds():
    layer = costs_of("llama", "llama-tiny").layers[1]
    changes = {"saved_bytes": 7, "op_bytes_fwd": (1.0, 2.0), "name": "x"}
    new = evolve(layer, **changes)
    assert new == dataclasses.replace(layer, **changes) and new is not layer
    assert new.__dict__ == dataclasses.replace(layer, **changes).__dict__
    assert layer.saved_bytes != 7  # the original is untouched
    t = TensorInfo("x", (2, 3), "bf16", 12, batch_dim=0)
    assert evolve(t, bytes=24) == dataclasses.replace(t, bytes=24)
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_field'"):
        evolve(layer, no_such_field=1)


def test_evolve_runs_post_init_checks():
    costs = costs_of("llama", "llama-tiny")
    with pytest.raises(ValueError, match="cuts"):  # ModelCosts checks its cuts in __post_init__: evolve goes through it
        evolve(costs, cuts=costs.cuts[:-1])
    assert isinstance(evolve(costs, notes=("n",)), ModelCosts)


def test_piece_classes_group_the_repeated_blocks():
    costs = costs_of("llama", "llama-tiny")
    classes = piece_classes(costs.layers)
    assert len(classes) == costs.n and all(c <= k for k, c in enumerate(classes))
    for k, c in enumerate(classes):
        a, b = costs.layers[k], costs.layers[c]
        assert {f: v for f, v in a.__dict__.items() if f not in ("name", "block", "modules")} == {
            f: v for f, v in b.__dict__.items() if f not in ("name", "block", "modules")
        }
    blocks = [k for k, l in enumerate(costs.layers) if l.block is not None]
    assert len(set(classes[k] for k in blocks)) < len(blocks)  # the blocks repeat: fewer classes than pieces
    # a piece whose costs differ in one number leaves its class
    changed = list(costs.layers)
    changed[blocks[-1]] = evolve(changed[blocks[-1]], flops_fwd=changed[blocks[-1]].flops_fwd + 1)
    assert piece_classes(changed)[blocks[-1]] == blocks[-1]


def _same(a, b):
    assert (a.fwd, a.bwd_input, a.bwd_weight, a.recompute) == (b.fwd, b.bwd_input, b.bwd_weight, b.recompute)


@pytest.mark.parametrize("example,preset", [("llama", "llama-tiny"), ("moe", "deepseek-tiny")])
def test_times_with_classes_are_bit_identical(example, preset):
    costs = costs_of(example, preset)
    dev = hardware.parse_gpus("8xH100").device_of(0)
    for tp, cp in ((1, 1), (2, 1), (2, 2)):
        c = split_context(shard_costs(costs, tp), cp)
        classes = piece_classes(c.layers)
        casts, kept = fp8_casts(costs, 1, tp, cp, tp)
        # per-piece inputs that differ between pieces of one class (distinct per piece, one at a time): each must keep
        # those pieces apart
        coll = [1e-6 * (k + 1) for k in range(c.n)]
        a2a = [1e-5 * (k + 1) if l.num_experts else 0.0 for k, l in enumerate(c.layers)]
        terms = [(1e-5 * k, 2e-5) for k in range(c.n)]
        work = tuple(RecomputeWork((1e9 * (k + 1),), (1e6,), 1.0) for k in range(c.n))
        fused = [1e9 * (k + 1) for k in range(c.n)]
        casts_k = [(list(f) + [1e3 * (k + 1)], list(b)) for k, (f, b) in enumerate(casts)]
        kept_k = [(f + 1e6 * k, b) for k, (f, b) in enumerate(kept)]
        # the piece before an MoE piece differs from one block to the next: what ``before`` carries into it
        ahead = [1e-6 * (k + 1) if not l.num_experts else 1e-6 for k, l in enumerate(c.layers)]
        variants = [
            dict(),
            dict(recompute="full", tp=tp, tp_collective_time=coll, kernel_floor_s=3e-6, host_op_s=2e-6),
            dict(recompute="selective", tp=tp, tp_collective_time=coll, tp_overlap=True),
            dict(recompute="selective", tp=tp, tp_collective_time=1e-5, tp_overlap=True, recompute_work=work),
            dict(matmul_dtype="fp8", cast_bytes=casts, kept_flops=kept),
            dict(matmul_dtype="fp8", cast_bytes=casts_k, kept_flops=kept),
            dict(matmul_dtype="fp8", cast_bytes=casts, kept_flops=kept_k),
            dict(experts=(4, tp, a2a), ep_overlap=0.5),
            dict(experts=(4, tp, 1e-4), dispatcher_terms=terms),
            dict(experts=(4, tp, 1e-4), ep_overlap=0.5, tp=2, tp_collective_time=ahead),
            dict(cp=cp, cp_step_s=1e-4, fused_core_flops=fused),
            dict(cp=cp, cp_exposed=(1e-4, 2e-4)),
        ]
        for kw in variants:
            _same(analytical_times(c, dev, "bf16", **kw, classes=classes), analytical_times(c, dev, "bf16", **kw))


def test_classes_are_only_a_shortcut():
    """Classes that claim two different pieces are alike would give the second the first's times: the check that the
    test above can fail."""
    costs = costs_of("llama", "llama-tiny")
    dev = hardware.parse_gpus("8xH100").device_of(0)
    wrong = tuple(0 for _ in costs.layers)
    assert analytical_times(costs, dev, "bf16", classes=wrong).fwd != analytical_times(costs, dev, "bf16").fwd


@pytest.mark.parametrize("example,preset", [("llama", "llama-tiny"), ("moe", "deepseek-tiny")])
def test_scaling_sharding_and_splitting_by_class_give_the_same_layers(example, preset):
    costs = costs_of(example, preset)
    classes = piece_classes(costs.layers)
    assert costs.scaled(3, classes) == costs.scaled(3)
    for tp, sp, cp in ((2, True, 1), (4, False, 2), (1, True, 4)):
        by_class = split_context(shard_costs(costs.scaled(2, classes), tp, sp, classes), cp, classes)
        plain = split_context(shard_costs(costs.scaled(2), tp, sp), cp)
        assert by_class == plain
        assert [l.name for l in by_class.layers] == [l.name for l in costs.layers]
        assert [(l.block, l.modules) for l in by_class.layers] == [(l.block, l.modules) for l in costs.layers]
    # a class that is not one (every piece in class 0) copies the first piece's costs: what the equality above rules out
    wrong = tuple(0 for _ in costs.layers)
    assert shard_costs(costs, 2, True, wrong) != shard_costs(costs, 2, True)


def test_evolve_falls_back_where_copying_the_fields_would_not_be_the_record():
    import functools

    @dataclasses.dataclass(frozen=True, slots=True)
    class Slotted:
        a: int
        b: int = 0

    @dataclasses.dataclass(frozen=True)
    class Cached:
        a: int

        @functools.cached_property
        def double(self) -> int:
            return 2 * self.a

    assert evolve(Slotted(1, 2), b=3) == Slotted(1, 3)
    c = Cached(1)
    assert c.double == 2
    assert evolve(c, a=5).double == 10  # the cached value of the original is not carried over
