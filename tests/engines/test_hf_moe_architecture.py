"""architecture() derived from transformers MoE configs (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3), checked against the
model transformers itself builds from the same config (which layers are sparse, the widths of experts and shared experts),
and rendered for Megatron-LM (megatron-core's TransformerConfig and layer specs take the flags). Tiny configs, no hub."""

from __future__ import annotations

import json
import warnings

import pytest

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

from planner.engines.megatron.architecture import architecture_defaults, architecture_problem  # noqa: E402
from planner.engines.megatron.moe import layer_pattern  # noqa: E402
from tests.conftest import derived_architecture  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

BASE = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=64)
CONFIGS = {
    "mixtral": dict(BASE, model_type="mixtral", intermediate_size=128, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        BASE,
        model_type="qwen2_moe",
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
        norm_topk_prob=False,
    ),
    "qwen3_moe": dict(
        BASE, model_type="qwen3_moe", head_dim=32, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True
    ),
    "deepseek_v3": dict(
        BASE,
        model_type="deepseek_v3",
        num_key_value_heads=4,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=4,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    ),
}


def _write(tmp_path, name: str, **change):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(dict(CONFIGS[name], **change)))
    return path


def _arch(path):
    return derived_architecture(f"hf:{path}")


def _hf_model(path):
    doc = json.loads(path.read_text())
    config = transformers.AutoConfig.for_model(doc.pop("model_type"), **doc)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def _sparse_layers(model) -> list[int]:
    """1 for each decoder layer whose MLP holds routed experts (a module with ``experts``), as transformers built it."""
    return [int(hasattr(layer.mlp, "experts")) for layer in model.model.layers]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_architecture_matches_the_model_transformers_builds(tmp_path, name):
    path = _write(tmp_path, name)
    arch = _arch(path)
    assert architecture_problem(arch) is None
    model = _hf_model(path)
    full = architecture_defaults(arch)
    assert layer_pattern(full["moe_layer_freq"], full["num_layers"]) == _sparse_layers(model)
    sparse = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    assert full["num_experts"] == sparse.experts.num_experts
    experts = dict(sparse.experts.named_parameters())
    assert full["moe_ffn_hidden_size"] in experts["down_proj"].shape[1:]  # (experts, hidden, ffn): each expert's width
    shared = getattr(sparse, "shared_expert", None) or getattr(sparse, "shared_experts", None)
    assert full["moe_shared_expert_intermediate_size"] == (shared.gate_proj.out_features if shared is not None else None)
    assert full["moe_shared_expert_gate"] == hasattr(sparse, "shared_expert_gate")
    dense = [layer.mlp for layer in model.model.layers if not hasattr(layer.mlp, "experts")]
    assert all(m.gate_proj.out_features == full["ffn_hidden_size"] for m in dense)


def test_routing_keys_follow_each_router(tmp_path):
    mixtral, qwen2, qwen3, ds = (_arch(_write(tmp_path, n)) for n in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"))
    assert mixtral["moe_router_topk"] == 2 and "moe_router_pre_softmax" not in mixtral  # softmax, renormalised top-k
    assert qwen2["moe_router_pre_softmax"] is True and "moe_router_pre_softmax" not in qwen3  # norm_topk_prob False / True
    assert qwen3["kv_channels"] == 32 and qwen3["qk_layernorm"] is True
    assert (ds["moe_router_score_function"], ds["moe_router_enable_expert_bias"], ds["moe_router_topk_scaling_factor"]) == ("sigmoid", True, 2.5)
    assert (ds["moe_router_num_groups"], ds["moe_router_group_topk"]) == (4, 2)
    assert ds["multi_latent_attention"] and ds["qk_head_dim"] == 16 and ds["num_query_groups"] is None and "kv_channels" not in ds
    assert all(a["moe_router_load_balancing_type"] == "none" for a in (mixtral, qwen2, qwen3, ds))
    aux = _arch(_write(tmp_path, "mixtral", output_router_logits=True, router_aux_loss_coef=0.02))
    assert (aux["moe_router_load_balancing_type"], aux["moe_aux_loss_coeff"]) == ("aux_loss", 0.02)


def test_routing_megatron_does_not_run_gives_no_architecture(tmp_path):
    """Group scores: Megatron ranks groups by their top-(k / topk_group) scores, transformers by their top 2."""
    assert derived_architecture(f"hf:{_write(tmp_path, 'deepseek_v3', topk_group=1)}") is None
    assert derived_architecture(f"hf:{_write(tmp_path, 'deepseek_v3')}") is not None


def megatron_core_built(spec: str, tmp_path):
    """(plan, parsed Megatron flags, megatron-core's TransformerConfig) of ``spec`` planned for Megatron on 4 A100s
    (pp 2): the rendered flags are checked against the planner's Megatron rules and handed to megatron-core."""
    from planner.engines.megatron.architecture import check_megatron_args
    from planner.engines.megatron.core_check import core_config
    from planner.engines.megatron.render import render as render_megatron
    from planner.engines.megatron.script import parse_megatron_args
    from planner.planning import plan_model
    from planner.solve.settings import Settings

    plan = plan_model(Settings.of(model_file=spec, model_args={}, gpus="4xA100", engine="megatron", pp=2))[0]
    args = parse_megatron_args(render_megatron(plan, "c", tmp_path)["pretrain_gpt.sh"])
    assert check_megatron_args(args) == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan, args, core_config(args)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hf_moe_plans_render_for_megatron_and_megatron_core_builds_them(tmp_path, name):
    from tests.engines.test_render_megatron_moe import mlp_kinds
    from tests.mlm_validate import megatron_lm_config, megatron_lm_path

    path = _write(tmp_path, name)
    plan, args, cfg = megatron_core_built(f"hf:{path}", tmp_path)
    c = CONFIGS[name]
    assert cfg.num_moe_experts == (c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts"))
    assert mlp_kinds(cfg) == _sparse_layers(_hf_model(path))
    # the model's own attention norms (Qwen3's per-head q/k norms, DeepSeek-V3's MLA latent norms) are built by Megatron
    # only under --qk-layernorm (q_layernorm / kv_layernorm in gpt_layer_specs.py)
    norms = ("q_norm", "k_norm", "q_a_layernorm", "kv_a_layernorm")
    assert cfg.qk_layernorm == any(n.rsplit(".", 1)[-1] in norms for n, _ in _hf_model(path).named_modules())
    if megatron_lm_path() is not None:  # and Megatron-LM's own parse_args / validate_args, where a checkout is named
        _, lm_cfg = megatron_lm_config(args.argv(), plan.layout.world)
        assert mlp_kinds(lm_cfg) == mlp_kinds(cfg)
