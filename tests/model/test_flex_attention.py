"""Flex attention plans on the meta device (planner.model.meta_policies, the fx tracer's block-mask call).

References: the parameter count of the model built on the CPU, and the closed forms of its FLOPs: a linear layer
2 * tokens * in * out, attention's two GEMMs 4 * b * heads * s^2 * head_dim (torch's sdpa_flop_count, which torch's
own flex_attention formula also uses).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from planner.model.analyze import analyze

MODELS = Path(__file__).parents[1] / "models"
fa = pytest.importorskip("torch.nn.attention.flex_attention")


def _built(name: str) -> torch.nn.Module:
    spec = importlib.util.spec_from_file_location(name, MODELS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build_model()


def test_torchtitans_compiled_flex_attention_with_a_mask_made_in_forward_inspects_exactly():
    a = analyze(MODELS / "flex_titan.py")
    assert a.costs.total_params == sum(p.numel() for p in _built("flex_titan").parameters()) == 106_816
    layers = {l.name: l for l in a.costs.layers}
    # one cut between every layer: the block mask is made again in each piece, not sent between them
    assert [l.name for l in a.costs.layers] == ["tok_embeddings", "layers.0:attention", "layers.0:ffn", "layers.1:attention", "layers.1:ffn", "norm", "output"]
    s, d, h, kv, hd = 256, 64, 4, 2, 16
    gemms = 2 * s * d * (d + 2 * kv * hd + d)  # wq, wk, wv, wo
    attention = 4 * 1 * h * s * s * hd
    assert layers["layers.0:attention"].flops_fwd == gemms + attention
    assert layers["layers.0:ffn"].flops_fwd == 2 * s * (d * 256 * 2)


def test_eager_flex_attention_inside_a_block_is_costed_as_the_fused_kernel():
    a = analyze(MODELS / "flex_block.py")
    assert a.costs.total_params == sum(p.numel() for p in _built("flex_block").parameters())
    s, d, h = 128, 64, 4
    block = next(l for l in a.costs.layers if l.name == "layers.0")
    assert block.flops_fwd == 2 * s * d * 3 * d + 2 * s * d * d + 4 * h * s * s * (d // h)
    # the fused kernel keeps the output and a log-sum-exp per row, never a seq x seq matrix
    assert block.saved_bytes < h * s * s * 2


def test_the_policies_are_lifted_only_while_the_planner_runs_on_meta():
    before = (fa._validate_device, fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG, torch._dynamo.config.disable)
    analyze(MODELS / "flex_block.py")
    assert (fa._validate_device, fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG, torch._dynamo.config.disable) == before
    q = torch.randn(1, 1, 128, 16, device="meta")
    with pytest.raises(ValueError, match="meta device"):  # outside the planner, torch's own check stands
        fa.flex_attention(q, q, q)


def test_the_scripts_build_the_planned_stages_of_a_flex_attention_model(tmp_path):
    """The training scripts trace the model again (planner.runtime.load_planned_model): the same pieces, on meta."""
    from typer.testing import CliRunner

    from planner.cli import app
    from planner.runtime import load_planned_model

    out = tmp_path / "plan"
    r = CliRunner().invoke(app, ["plan", str(MODELS / "flex_titan.py"), "--gpus", "2xcpu", "--engine", "torch", "--pp", "2", "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    planned = load_planned_model(out)
    assert len(planned.layer_graph.pieces) == 7
