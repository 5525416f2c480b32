"""The engines behind one interface: each engine's rules, and the search asking the engine rather than its name."""

from __future__ import annotations

import pytest

from planner.engines import ENGINES, get_engine
from planner.errors import UsageError
from planner.solve.schedules import SCHEDULES, schedule_constraints


def test_every_engine_runs_only_known_schedules():
    for engine in (spec.rules for spec in ENGINES.values()):
        assert set(engine.searched_schedules) <= set(engine.schedules) <= set(SCHEDULES)
        assert 0 in engine.zero_levels and "none" in engine.recompute_modes


def test_unknown_engine_names_the_known_ones():
    with pytest.raises(UsageError, match="deepspeed, megatron, torch"):
        get_engine("colossal")


def test_schedule_rules_per_engine():
    torch, megatron, deepspeed = (get_engine(n) for n in ("torch", "megatron", "deepspeed"))
    # Megatron interleaving: m % p == 0 and m >= p; torch accepts more (flexible rounds).
    assert schedule_constraints("interleaved", 4, 6, 2) == []
    assert torch.runtime_schedule_problems("interleaved", 4, 6, 2) == []
    assert any("multiple of p" in x for x in megatron.runtime_schedule_problems("interleaved", 4, 6, 2))
    assert any("m >= p" in x for x in megatron.runtime_schedule_problems("interleaved", 4, 3, 2))
    assert megatron.runtime_schedule_problems("interleaved", 4, 8, 2) == []
    # torch Schedule1F1B needs m >= p; DeepSpeed and Megatron run it, though the planner never plans it
    assert any("Schedule1F1B needs m >= number of stages" in x for x in torch.runtime_schedule_problems("1f1b", 4, 3, 1))
    assert deepspeed.runtime_schedule_problems("1f1b", 4, 3, 1) == []
    assert any("cannot fill 4 pipeline stages" in x for x in deepspeed.schedule_problems("1f1b", 4, 3, 1))
    assert deepspeed.schedule_problems("1f1b", 4, 4, 1) == []
    # torch's zero-bubble class checks rounds even with one stage per rank.
    assert schedule_constraints("zb-h1", 4, 9) == []
    assert torch.runtime_schedule_problems("zb-h1", 4, 9, 1) != []
    # engines that do not run a schedule say so
    assert any("does not run" in x for x in deepspeed.runtime_schedule_problems("zbv", 4, 8, 2))
    assert any("does not run" in x for x in torch.runtime_schedule_problems("pipedream", 4, 8, 1))
    assert deepspeed.schedules == ("1f1b",)
    assert set(megatron.schedules) == {"1f1b", "interleaved"}


def test_every_engine_rule_set_is_stricter_than_the_schedule_rules():
    for name in SCHEDULES:
        for engine in (spec.rules for spec in ENGINES.values()):
            for p in (1, 2, 3, 4):
                for m in range(1, 10):
                    for v in (1, 2, 3):
                        if not engine.schedule_problems(name, p, m, v):
                            assert not schedule_constraints(name, p, m, v)


def test_zero_rules():
    ds = get_engine("deepspeed")
    assert any("ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism" in x for x in ds.zero_problems(2, 2))
    assert ds.zero_problems(1, 4) == [] and ds.zero_problems(0, 4) == []
    assert get_engine("torch").zero_problems(1, 2) != []
    assert get_engine("megatron").zero_problems(1, 2) == []


def test_dp_overlap_is_the_engines():
    from planner.solve.plan import Layout

    comm, backward, params = 3.0, [1.0, 0.5], 4e9  # buckets of 40M of 4B parameters: 1% of the exchange cannot hide
    on = Layout("megatron", 2, 1, 4, 1, 1, 8, 32, "1f1b", "none", 0, overlap_grad_reduce=True)
    # 3 s of reduction behind 1.5 s of backward: 1.5 s, plus the wait for the first bucket's gradients (1.5 / 100)
    assert get_engine("megatron").exposed_dp_time(on, comm, 0.0, backward, [0.5], params) == pytest.approx(1.5 + 1.5 / 100)
    assert get_engine("megatron").exposed_dp_time(on, 1.0, 0.0, backward, [0.5], params) == pytest.approx(0.01)
    off = Layout("megatron", 2, 1, 4, 1, 1, 8, 32, "1f1b", "none", 0)
    assert get_engine("megatron").exposed_dp_time(off, comm, 0.0, backward, [0.5], params) == comm
    assert get_engine("deepspeed").exposed_dp_time(off, comm, 0.0, backward, [0.5], params) == comm
    assert get_engine("torch").exposed_dp_time(off, comm, 0.0, backward, [0.5], params) == comm


def test_output_copies_only_for_torch_split_backward():
    torch = get_engine("torch")
    assert torch.sends_output_copies("zbv") and torch.sends_output_copies("zb-h1")
    assert not torch.sends_output_copies("1f1b") and not get_engine("deepspeed").sends_output_copies("1f1b")


def test_expert_parallelism_refusals_name_the_reason():
    """ep > 1 runs on Megatron only; DeepSpeed's refusal says why (its pipeline engine splits only its own MoE layer)."""
    from planner.solve.plan import Layout

    ep2 = Layout("deepspeed", 2, 1, 4, 1, 1, 8, 32, "1f1b", "none", 0, ep=2)
    (ds,) = [p for p in get_engine("deepspeed").feature_problems(ep2, None) if "expert" in p]
    assert "deepspeed.moe.layer.MoE" in ds and "token dropping" in ds and "--engine megatron" in ds
    assert any("expert parallelism" in p for p in get_engine("torch").feature_problems(ep2, None))
    assert not [p for p in get_engine("megatron").feature_problems(ep2, None) if "expert" in p]
    assert not [p for p in get_engine("deepspeed").feature_problems(Layout("deepspeed", 2, 1, 4, 1, 1, 8, 32, "1f1b", "none", 0), None) if "expert" in p]


def test_deepspeed_moe_facts_the_refusal_states():
    """The facts of DeepSpeed 0.19.8 the refusal rests on: MoE drops tokens by default, its gate takes a capacity factor,
    and expert groups are drawn per pipeline stage (the pipeline size is an input of the expert-group builder)."""
    import inspect

    deepspeed = pytest.importorskip("deepspeed")
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups

    params = inspect.signature(MoE.__init__).parameters
    assert params["drop_tokens"].default is True and "capacity_factor" in params and "ep_size" in params
    assert "pp_size" in inspect.signature(groups._create_expert_and_data_parallel).parameters
    assert deepspeed.__version__.startswith("0.19")
