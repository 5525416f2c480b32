"""Mixtures of experts and multi-latent attention rendered for Megatron-LM, checked by megatron-core 0.16.1 (and by
Megatron-LM's own validate_args where a core_v0.16.1 checkout is named by MEGATRON_LM_PATH).

Fixture plans (tests/fixtures/megatron/moe_tiny_tp2.json, deepseek_tiny_pp2.json) come from `planner plan examples/moe.py`
(regenerate.py); plans with ep > 1 are those plans with the Layout's ep changed (the CLI gains --ep with the search).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import re
import warnings
from pathlib import Path

import pytest

from planner.engines.megatron.architecture import architecture_defaults, architecture_problem, check_megatron_args
from planner.engines.megatron.core_check import core_config, core_stage_layers
from planner.engines.megatron.moe import MOE_DEFAULTS, layer_freq_text, layer_pattern, parse_layer_freq
from planner.engines.megatron.render import planned_stage_layers
from planner.engines.megatron.render import render as render_megatron
from planner.engines.megatron.script import parse_megatron_args
from planner.errors import UsageError
from planner.report import overlaps_line
from planner.solve.plan import Plan
from tests.mlm_validate import megatron_lm_config, megatron_lm_path

FIXTURES = Path(__file__).parents[1] / "fixtures" / "megatron"
MOE_NAMES = ("moe_tiny_tp2", "deepseek_tiny_pp2")
REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def load(name: str, **layout) -> Plan:
    plan = Plan.from_dict(json.loads((FIXTURES / f"{name}.json").read_text()))
    return dataclasses.replace(plan, layout=dataclasses.replace(plan.layout, **layout)) if layout else plan


def rendered(plan: Plan):
    return parse_megatron_args(render_megatron(plan, "c", None)["pretrain_gpt.sh"])


def mlp_kinds(cfg) -> list[int]:
    """1 for each layer megatron-core builds as an MoE layer, 0 for a dense MLP (local specs; TE is absent here)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs

    specs = get_gpt_decoder_layer_specs(cfg, use_transformer_engine=False)
    return [int(s.submodules.mlp.module.__name__ == "MoELayer") for s in specs]


# --------------------------------------------------------------------------- rendered plans, megatron-core's view


@pytest.mark.parametrize("name", MOE_NAMES)
@pytest.mark.parametrize("ep", [1, 2])
def test_megatron_core_builds_the_planned_mixture_of_experts(name, ep):
    plan = load(name, ep=ep)
    arch = architecture_defaults(plan.model["architecture"])
    args = rendered(plan)
    assert check_megatron_args(args) == []
    cfg = core_config(args)
    assert type(cfg).__name__ == ("MLATransformerConfig" if arch["multi_latent_attention"] else "TransformerConfig")
    assert (cfg.num_moe_experts, cfg.moe_router_topk) == (arch["num_experts"], arch["moe_router_topk"])
    assert cfg.moe_ffn_hidden_size == arch["moe_ffn_hidden_size"] and cfg.ffn_hidden_size == arch["ffn_hidden_size"]
    assert cfg.moe_shared_expert_intermediate_size == arch["moe_shared_expert_intermediate_size"]
    assert (cfg.expert_model_parallel_size, cfg.expert_tensor_parallel_size) == (ep, plan.layout.etp)
    assert cfg.moe_router_score_function == arch["moe_router_score_function"]
    assert cfg.moe_router_enable_expert_bias == arch["moe_router_enable_expert_bias"]
    assert cfg.moe_router_topk_scaling_factor == arch["moe_router_topk_scaling_factor"]
    assert cfg.moe_router_pre_softmax == arch["moe_router_pre_softmax"] and cfg.moe_grouped_gemm
    assert cfg.moe_token_dispatcher_type == "alltoall"
    assert mlp_kinds(cfg) == layer_pattern(arch["moe_layer_freq"], arch["num_layers"])
    assert core_stage_layers(cfg) == planned_stage_layers(plan)
    readme = " ".join(render_megatron(plan, "c", None)["README.md"].split())
    assert f"{sum(mlp_kinds(cfg))} of {cfg.num_layers} layers route each token to {cfg.moe_router_topk} of {cfg.num_moe_experts} experts" in readme
    assert f"split over {cfg.expert_model_parallel_size} GPU(s)" in readme
    if arch["multi_latent_attention"]:
        for key in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            assert getattr(cfg, key) == arch[key], key
        assert cfg.rope_type == "rope" and cfg.num_query_groups == cfg.num_attention_heads  # None: one group per head
    else:
        assert cfg.num_query_groups == arch["num_query_groups"] and cfg.qk_layernorm == arch["qk_layernorm"]


def test_moe_tiny_flags_as_written():
    """The flags themselves, for a reader: every layer MoE (no --moe-layer-freq), experts unsplit by tp."""
    args = rendered(load("moe_tiny_tp2", ep=2))
    want = {
        "--num-experts": "4",
        "--moe-router-topk": "2",
        "--moe-ffn-hidden-size": "64",
        "--moe-router-score-function": "softmax",
        "--moe-router-load-balancing-type": "none",
        "--moe-token-dispatcher-type": "alltoall",
        "--expert-model-parallel-size": "2",
        "--expert-tensor-parallel-size": "1",
    }
    assert {k: args.value(k) for k in want} == want
    assert args.has("--moe-grouped-gemm") and args.has("--sequence-parallel") and not args.has("--moe-layer-freq")
    assert not args.has("--moe-aux-loss-coeff")  # no balancing loss: examples/moe.py's loss_fn adds none


def test_dense_plans_get_no_moe_flags():
    args = rendered(Plan.from_dict(json.loads((FIXTURES / "llama70b_vp2.json").read_text())))
    assert not [f.name for f in args.flags if re.match(r"--(num-experts|moe-|expert-|multi-latent|kv-channels|qk-layernorm)", f.name)]


@pytest.mark.parametrize(
    "layout, rule",
    [
        (dict(ep=3), "MEG033"),  # 4 experts over 3 GPUs
        (dict(ep=8), "MEG032"),  # etp x ep x pp = 16 > 8 GPUs
    ],
)
def test_expert_layouts_megatron_refuses_are_usage_errors(layout, rule):
    with pytest.raises(UsageError, match=rule):
        rendered(load("moe_tiny_tp2", **layout))


def test_expert_tensor_parallelism_renders_and_megatron_core_takes_it():
    cfg = core_config(rendered(load("moe_tiny_tp2", etp=2)))
    assert (cfg.expert_tensor_parallel_size, cfg.tensor_model_parallel_size, cfg.add_bias_linear) == (2, 2, False)


def test_live_moe_plan_from_the_cli_renders_and_validates_clean(tmp_path):
    """`planner plan examples/moe.py --engine megatron` (ep 1 today) writes flags our rules and megatron-core accept."""
    from planner.planning import plan_model
    from planner.solve.settings import Settings

    plan, _, _ = plan_model(
        Settings.of(model_file=str(REPO / "examples" / "moe.py"), model_args={"preset": "deepseek-tiny"}, gpus="8xA100", engine="megatron", pp=2)
    )
    args = parse_megatron_args(render_megatron(plan, "c", tmp_path)["pretrain_gpt.sh"])
    assert check_megatron_args(args) == [] and args.int("--num-experts") == 8 and args.has("--multi-latent-attention")
    assert mlp_kinds(core_config(args)) == [0, 1, 1, 1]


def _on_v100(plan: Plan) -> Plan:
    """The plan with its device profile's bf16 peak removed, as the V100 profile has it (compute capability 7.0)."""
    d = plan.to_dict()
    for dev in d["assumptions"]["devices"].values():
        dev["peak_flops"].pop("bf16")
    return Plan.from_dict(d)


def test_no_grouped_gemm_before_ampere_and_megatron_core_runs_the_experts_in_turn():
    v100 = rendered(_on_v100(load("moe_tiny_tp2")))
    assert not v100.has("--moe-grouped-gemm") and rendered(load("moe_tiny_tp2")).has("--moe-grouped-gemm")
    assert check_megatron_args(v100) == []
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs

    spec = get_gpt_decoder_layer_specs(core_config(v100), use_transformer_engine=False)[0].submodules.mlp.submodules.experts
    assert spec.module.__name__ == "SequentialMLP"
    v100_profile = REPO / "hardware_profiles" / "v100-32gb.yaml"
    assert "bf16" not in v100_profile.read_text().split("peak_tflops:")[1].split("\n")[0]  # the profile this stands for


# --------------------------------------------------------------------------- Megatron-LM's own validation


def test_megatron_lm_refuses_grouped_gemm_before_ampere():
    argv = rendered(load("moe_tiny_tp2")).argv()
    with pytest.raises(AssertionError, match="GroupedGEMM"):
        megatron_lm_config(argv, 8, capability=(7, 0))
    megatron_lm_config(rendered(_on_v100(load("moe_tiny_tp2"))).argv(), 8, capability=(7, 0))


@pytest.mark.parametrize("name", MOE_NAMES)
@pytest.mark.parametrize("ep", [1, 2])
def test_megatron_lm_validate_args_accepts_the_rendered_flags(name, ep):
    plan = load(name, ep=ep)
    args = rendered(plan)
    margs, cfg = megatron_lm_config(args.argv(), plan.layout.world)
    arch = architecture_defaults(plan.model["architecture"])
    assert (margs.num_experts, margs.expert_model_parallel_size, margs.expert_tensor_parallel_size) == (arch["num_experts"], ep, plan.layout.etp)
    assert cfg.num_moe_experts == arch["num_experts"] and mlp_kinds(cfg) == layer_pattern(arch["moe_layer_freq"], arch["num_layers"])
    assert bool(getattr(cfg, "multi_latent_attention", False)) == arch["multi_latent_attention"]


def _rule_cases():
    from tests.engines.test_megatron_args import RULE_CASES

    return sorted(RULE_CASES)


@pytest.mark.parametrize("rule", _rule_cases())
def test_megatron_lm_refuses_exactly_the_failing_examples_said_to_be_refused(rule):
    """Every rule's failing example (tests/engines/test_megatron_args.py RULE_CASES) is refused by Megatron-LM's parse_args /
    validate_args / core_transformer_config_from_args exactly when the case says so (the others fail later: at
    initialization, model build or run time, or are warnings)."""
    from tests.engines.test_megatron_args import RULE_CASES, _script

    flags, world, export, refused = RULE_CASES[rule]
    argv = parse_megatron_args(_script(flags, world, export)).argv()
    if refused:
        with pytest.raises((AssertionError, ValueError, SystemExit)):
            megatron_lm_config(argv, world, "1" if export else None)
    else:
        megatron_lm_config(argv, world, "1" if export else None)


def test_megatron_lm_refuses_mla_with_fused_plain_rope():
    argv = rendered(load("deepseek_tiny_pp2")).argv()
    with pytest.raises(ValueError, match="YARN"):
        megatron_lm_config([w for w in argv if w != "--no-rope-fusion"], 8)


# --------------------------------------------------------------------------- --moe-layer-freq


def _megatron_eval(text: str):
    """Megatron-LM core_v0.16.1 moe_freq_type / _eval_pattern (arguments.py): the character check, then Python's eval."""
    if "[" not in text:
        return int(text)
    assert not re.search(r"[^,\d\[\]\(\)\+\*]", text)
    return eval(text)  # noqa: S307 - our own rendered pattern, checked as Megatron checks it


def test_every_short_pattern_round_trips_through_megatron_s_parser():
    for L in range(1, 11):
        for pattern in itertools.product((0, 1), repeat=L):
            text = layer_freq_text(list(pattern))
            assert layer_pattern(_megatron_eval(text), L) == list(pattern), text
            assert parse_layer_freq(text) == _megatron_eval(text)


def test_freq_text_is_the_shortest_of_the_exact_forms():
    assert layer_freq_text([0] * 3 + [1] * 58) == "[0]*3+[1]*58"  # DeepSeek-V3: first_k_dense_replace 3
    assert layer_freq_text(layer_pattern(2, 48)) == "2" and layer_freq_text([1] * 61) == "1"
    assert layer_freq_text([1, 1, 1, 0, 0] * 2) == "[1,1,1,0,0]*2"  # Megatron's help example "([1]*3+[0]*2)*2", 2 shorter
    assert layer_freq_text([0] + [1] * 23) == "[0]+[1]*23"  # the other: "([0]+[1]*23)"
    assert layer_freq_text([0, 1, 0]) == "[0,1,0]"
    rng = random.Random(0)
    for _ in range(300):
        pattern = [rng.choice((0, 1)) for _ in range(rng.randint(1, 64))]
        text = layer_freq_text(pattern)
        runs = "+".join(f"[{k}]*{len(list(g))}" for k, g in itertools.groupby(pattern))
        assert len(text) <= min(len(runs), len(str(pattern).replace(" ", ""))) and layer_pattern(_megatron_eval(text), len(pattern)) == pattern


def test_parse_layer_freq_agrees_with_eval_on_random_expressions():
    rng = random.Random(1)

    def expr(depth: int) -> str:
        pick = rng.randint(0, 3 if depth < 3 else 0)
        if pick == 0:
            return "[" + ",".join(str(rng.randint(0, 1)) for _ in range(rng.randint(1, 3))) + "]"
        if pick == 1:
            return f"{expr(depth + 1)}*{rng.randint(0, 4)}"
        if pick == 2:
            return f"{expr(depth + 1)}+{expr(depth + 1)}"
        return f"({expr(depth + 1)})"

    for _ in range(500):
        text = expr(0)
        assert parse_layer_freq(text) == _megatron_eval(text), text


@pytest.mark.parametrize("bad", ["[1]*10**9", "__import__('os')", "[1]+", "[1]*[1]", "[1]+2", "([1]", "1.5", "[1];[0]"])
def test_parse_layer_freq_refuses_what_it_cannot_read(bad):
    with pytest.raises(ValueError):
        parse_layer_freq(bad)


# --------------------------------------------------------------------------- architecture() rules


def _arch(**change):
    return _arch_of("moe-tiny") | change


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(moe_router_topk=5), "moe_router_topk = 5"),
        (dict(moe_router_topk=0), "moe_router_topk = 0"),
        (dict(moe_layer_freq=[1, 1, 1]), "3 entries for 4 layers"),
        (dict(moe_layer_freq=[1, 2, 1, 1]), "0/1"),
        (dict(moe_router_enable_expert_bias=True), "needs sigmoid"),
        (dict(moe_router_topk=1), "top-1 softmax"),
        (dict(moe_router_score_function="relu"), "'relu'"),
        (dict(moe_router_load_balancing_type="switch"), "'switch'"),
        (dict(num_experts=None), "without num_experts"),
        (dict(multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16), "grouped-query attention excludes MLA"),
        (dict(multi_latent_attention=True, num_query_groups=None), "without kv_lora_rank"),
        (dict(kv_lora_rank=16), "without multi_latent_attention"),
        (dict(kv_channels=0), "kv_channels = 0"),
    ],
)
def test_architecture_keys_that_do_not_map_are_named(change, words):
    assert architecture_problem(_arch()) is None
    problem = architecture_problem(_arch(**change))
    assert problem is not None and words in problem[0], problem


def test_router_rules_are_transformer_config_s():
    """The two router combinations architecture_problem refuses are the ones TransformerConfig raises on."""
    from megatron.core.transformer import TransformerConfig

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=4, add_bias_linear=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        TransformerConfig(**base, moe_router_topk=1, moe_router_pre_softmax=True)
        TransformerConfig(**base, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
        with pytest.raises(ValueError, match="pre-softmax"):
            TransformerConfig(**base, moe_router_topk=1)
        with pytest.raises(ValueError, match="sigmoid"):
            TransformerConfig(**base, moe_router_enable_expert_bias=True)
    assert architecture_problem(_arch(moe_router_topk=1, moe_router_pre_softmax=True)) is None


def test_moe_defaults_are_transformer_config_s():
    from megatron.core.transformer import TransformerConfig

    defaults = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    assert MOE_DEFAULTS == {k: defaults[k] for k in MOE_DEFAULTS}


def test_flag_table_is_megatron_lm_s_parser():
    """templates/megatron/flags_core_v0.16.1.tsv lists exactly the long options of Megatron-LM's own parser, with their nargs."""
    import argparse

    from planner.engines.megatron.flags import flag_table
    from tests.mlm_validate import arguments_module

    parser = arguments_module().add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    options = {o: a for a in parser._actions for o in a.option_strings if o.startswith("--")}
    assert sorted(options) == sorted(flag_table())
    for name, action in options.items():
        nargs = "0" if action.nargs == 0 else "1" if action.nargs is None else str(action.nargs)
        assert flag_table()[name].nargs == nargs, name


@pytest.mark.parametrize("preset", ["mixtral-8x7b", "mixtral-8x22b", "deepseek-v3", "qwen3-30b-a3b", "qwen3-235b-a22b"])
def test_published_moe_shapes_map_onto_megatron(preset):
    """examples/moe.py's published presets: their architecture() gives flags megatron-core builds into the same model
    (experts, widths, the MoE layer pattern; DeepSeek-V3's three dense layers as "[0]*3+[1]*58")."""
    from types import SimpleNamespace

    from planner.engines.megatron.architecture import MegatronArgs
    from planner.engines.megatron.flags import Flag
    from planner.engines.megatron.render import model_flags, moe_flags

    arch = architecture_defaults(_arch_of(preset))
    assert architecture_problem(arch) is None
    lay = SimpleNamespace(ep=8, etp=1)
    model, parallel = moe_flags(arch, lay)
    pairs = model_flags(arch) + model + parallel + [("--bf16", None), ("--micro-batch-size", "1"), ("--global-batch-size", "64")]
    args = MegatronArgs("args", tuple(Flag(n, () if v is None else (v,) if isinstance(v, str) else tuple(v), None) for n, v in pairs))
    assert check_megatron_args(args, 64) == []
    cfg = core_config(args)
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (arch["num_experts"], arch["moe_router_topk"], arch["moe_ffn_hidden_size"])
    assert mlp_kinds(cfg) == layer_pattern(arch["moe_layer_freq"], arch["num_layers"])
    if preset == "deepseek-v3":
        assert args.value("--moe-layer-freq") == "[0]*3+[1]*58" and cfg.moe_router_topk_scaling_factor == 2.5
    if megatron_lm_path() is not None:
        megatron_lm_config(args.argv(), 64)


def _arch_of(preset: str) -> dict:
    import importlib.util

    spec = importlib.util.spec_from_file_location("moe_example", REPO / "examples" / "moe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.architecture(preset)


# --------------------------------------------------------------------------- --overlap-moe-expert-parallel-comm


def test_ep_overlap_renders_and_megatron_takes_it():
    """The overlap of an interleaved plan with ep 2 is one flag, which megatron-core's TransformerConfig (and
    Megatron-LM's validate_args, with a checkout) accept; on the 1F1B plan without virtual stages both refuse it,
    as MEG042 does."""
    plan = load("moe_tiny_tp2", ep=2, ep_comm_overlap=True)
    args = rendered(plan)
    assert args.has("--overlap-moe-expert-parallel-comm") and not rendered(load("moe_tiny_tp2", ep=2)).has("--overlap-moe-expert-parallel-comm")
    assert check_megatron_args(args) == []
    assert core_config(args).overlap_moe_expert_parallel_comm
    report = overlaps_line(plan.layout)
    assert "--overlap-moe-expert-parallel-comm" in report and "combined 1F1B" in report
    flat = load("deepseek_tiny_pp2", ep=2, ep_comm_overlap=True)  # pp 2 without virtual stages
    with pytest.raises(UsageError, match="MEG042"):
        rendered(flat)
    text = render_megatron(load("deepseek_tiny_pp2", ep=2), "c", None)["pretrain_gpt.sh"]
    bad = parse_megatron_args(text.replace("  --expert-model-parallel-size 2\n", "  --expert-model-parallel-size 2\n  --overlap-moe-expert-parallel-comm\n"))
    assert [f.rule for f in check_megatron_args(bad)] == ["MEG042"]
    with pytest.raises((AssertionError, ValueError)):
        core_config(bad)
    if megatron_lm_path() is not None:
        margs, cfg = megatron_lm_config(args.argv(), plan.layout.world)
        assert margs.overlap_moe_expert_parallel_comm and cfg.overlap_moe_expert_parallel_comm
        with pytest.raises((AssertionError, ValueError)):
            megatron_lm_config(bad.argv(), flat.layout.world)
