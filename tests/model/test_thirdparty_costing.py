"""Costing patterns third-party models use, on small models written here (no optional library needed).

FLOPs are compared with closed forms; every test fails if the feature it names is broken.
"""

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from planner.cli import app
from planner.errors import UsageError
from planner.model.cost import cost_piece
from planner.model.flops import flop_counter, grouped_mm_flop
from planner.model.sources import require

MODELS = Path(__file__).resolve().parents[1] / "models"
runner = CliRunner()


def inspect_json(*args):
    r = runner.invoke(app, ["inspect", *map(str, args), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def _conv_flops(groups: int, transposed: bool = False) -> tuple[float, float]:
    conv = (nn.ConvTranspose2d if transposed else nn.Conv2d)(32, 32, 3, padding=1, groups=groups, device="meta")
    x = torch.randn(2, 32, 14, 14, device="meta", requires_grad=True)
    with flop_counter() as f:
        y = conv(x)
    fwd = f.get_total_flops()
    with flop_counter() as f:
        y.sum().backward()
    return fwd, f.get_total_flops()


@pytest.mark.parametrize("groups", [1, 4, 32])
@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_and_depthwise_conv_backward_is_twice_the_forward(groups, transposed):
    fwd, bwd = _conv_flops(groups, transposed)
    assert fwd == 2 * 2 * 14 * 14 * 32 * (32 // groups) * 9  # 2 x N x H x W x Cout x Cin/groups x k^2
    assert bwd == 2 * fwd  # input gradient + weight gradient, each one forward's worth


def test_grouped_mm_counts_the_routed_rows_not_all_experts():
    """MoE experts as transformers' grouped_mm runs them: tokens x top-k rows against per-expert weights."""
    tokens, k, experts, hidden, ffn = 24, 2, 8, 16, 32
    rows = tokens * k
    a = torch.randn(rows, hidden, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(experts, hidden, ffn, device="meta", dtype=torch.bfloat16, requires_grad=True)
    offs = torch.arange(1, experts + 1, device="meta", dtype=torch.int32) * (rows // experts)
    with flop_counter() as f:
        out = torch._grouped_mm(a, w, offs)
    assert f.get_total_flops() == 2 * rows * hidden * ffn
    with flop_counter() as f:
        out.backward(torch.ones_like(out))  # a dense gradient: the meta kernel refuses an expanded one
    assert f.get_total_flops() == 2 * (2 * rows * hidden * ffn)  # grad of the routed input and of the expert weights
    # the weight-gradient form (2-D x 2-D, K grouped) and the batched form
    assert grouped_mm_flop((hidden, rows), (rows, ffn), (experts,), out_shape=(experts, hidden, ffn)) == 2 * hidden * rows * ffn
    assert grouped_mm_flop((experts, 5, hidden), (experts, hidden, ffn), out_shape=(experts, 5, ffn)) == 2 * experts * 5 * hidden * ffn


def test_op_without_a_formula_is_named_in_the_notes(tmp_path):
    f = tmp_path / "tbc.py"
    f.write_text(
        "import torch\nimport torch.nn as nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.w = nn.Parameter(torch.randn(3, 64, 64))\n        self.b = nn.Parameter(torch.zeros(64))\n"
        "    def forward(self, x):\n        return torch.conv_tbc(x, self.w, self.b, 1)\n"
        "def build_model():\n    return Net()\n"
        "def example_inputs(batch_size):\n    return (torch.randn(16, batch_size, 64),)\n"
    )
    doc = inspect_json(f)
    assert any("aten.conv_tbc" in n and "no FLOP formula" in n for n in doc["notes"]), doc["notes"]


def test_no_false_alarm_for_ops_with_formulas():
    doc = inspect_json(MODELS / "bottleneck.py", "--model-arg", "size=4")
    assert not any("no FLOP formula" in n for n in doc["notes"])


def test_inplace_relu_after_a_cut_and_batchnorm_at_micro_batch_1():
    """torchvision's Bottleneck: `out += identity; out = relu(out)` with ReLU(inplace=True), BatchNorm on a 1x1 map."""
    doc = inspect_json(MODELS / "bottleneck.py", "--model-arg", "size=1")
    names = [l["name"] for l in doc["layers"]]
    # a piece starts with the in-place ReLU (the cut after the residual add) and is costed
    assert any(n.endswith(":relu") for n in names), names
    assert doc["totals"]["micro_batch"] == 2
    assert any("costed at micro-batch 2" in n and "BatchNorm" in n for n in doc["notes"])
    c = 16
    conv = 2 * c * c * 1 + 2 * c * c * 9 + 2 * c * c * 1  # three convs per block on a 1x1 map, per sample
    stem = 2 * 3 * c * 9
    per_sample = stem + 3 * conv + 2 * c * 10
    fw = sum(l["flops_fwd"] for l in doc["layers"])
    # convolutions and the head are all the FLOPs FlopCounterMode counts (BatchNorm, ReLU, adds: memory-bound)
    assert fw == 2 * per_sample


def test_depthwise_block_backward_is_about_twice_forward():
    doc = inspect_json(MODELS / "bottleneck.py", "--model-arg", "size=8", "--model-arg", "depthwise=True", "-b", "2")
    fw = sum(l["flops_fwd"] for l in doc["layers"])
    bw = sum(l["flops_bwd"] for l in doc["layers"])
    # the stem has no input gradient to compute: its backward is one forward; all the rest two
    stem = next(l for l in doc["layers"] if l["name"] == "stem")
    assert bw == pytest.approx(2 * fw - stem["flops_fwd"])


def test_leaf_class_is_kept_whole():
    split = [l["name"] for l in inspect_json(MODELS / "bottleneck.py", "--model-arg", "size=4")["layers"]]
    whole = [l["name"] for l in inspect_json(MODELS / "bottleneck.py", "--model-arg", "size=4", "--leaf", "Bottleneck")["layers"]]
    assert any(":" in n for n in split)  # without --leaf, blocks are cut inside
    assert whole == ["stem", "layers.0", "layers.1", "layers.2", "head"]


def test_optional_forward_argument_is_traced_at_its_default():
    """forward(x, attn_mask=None) given only x: fx specialises attn_mask to None instead of asking for it."""
    doc = inspect_json(MODELS / "optional_arg.py")
    assert doc["totals"]["tracer"] == "fx"
    assert [l["name"] for l in doc["layers"]][:3] == ["blocks.0", "blocks.1", "blocks.2"] or len(doc["layers"]) >= 3
    assert doc["totals"]["flops_fwd"] == 3 * 2 * (2 * 16 * 16 * 8)  # the mask branch is not traced


def test_shape_read_at_the_start_and_used_at_the_end_does_not_join_pieces():
    doc = inspect_json(MODELS / "shape_skip.py")
    assert len(doc["layers"]) >= 5
    assert any("do not depend on the batch size" in n for n in doc["notes"])


def test_batch_dependent_value_joins_pieces_and_says_why():
    doc = inspect_json(MODELS / "shape_skip.py", "--model-arg", "batch_view=True")
    assert len(doc["layers"]) == 1
    assert any("change with the batch size" in n and "joined" in n for n in doc["notes"])


def test_tuple_value_between_pieces_is_passed_whole():
    """A block returning (hidden, aux) as one value: the next piece receives the tuple, not its first tensor."""
    doc = inspect_json(MODELS / "tuple_blocks.py")
    assert len(doc["layers"]) == 4
    assert doc["totals"]["flops_fwd"] == 4 * 2 * 8 * 32 * 32


def test_missing_optional_library_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "timm", None)
    with pytest.raises(UsageError) as e:
        require("timm")
    assert "pip install timm" in e.value.message + (e.value.hint or "")


def test_library_specs_give_clear_errors(tmp_path):
    for spec, words in [
        ("hf:" + str(tmp_path / "nope.json"), "no transformers config"),
        ("hf:", "names nothing"),
    ]:
        r = runner.invoke(app, ["inspect", spec])
        assert r.exit_code == 2 and words in r.output and "Traceback" not in r.output, r.output
    bad = tmp_path / "c.json"
    bad.write_text('{"hidden_size": 8}')
    r = runner.invoke(app, ["inspect", f"hf:{bad}"])
    assert r.exit_code == 2 and "model_type" in r.output, r.output


def test_cost_piece_accepts_an_input_updated_in_place():
    class M(nn.Module):
        def forward(self, x):
            return torch.relu_(x) * 2

    x = torch.randn(4, 8, device="meta", requires_grad=True)
    cost, _ = cost_piece(M(), (x,), None, 4)
    assert cost.saved_bytes > 0


class _Attn(nn.Module):
    """q, k, v of ``shape`` (any leading dims) straight into F.scaled_dot_product_attention, with an optional mask."""

    def __init__(self, mask_shape=None):
        super().__init__()
        self.mask_shape = mask_shape

    def forward(self, q, k, v):
        mask = None if self.mask_shape is None else torch.zeros(self.mask_shape, device=q.device)
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize(
    "shape, mask",
    [
        ((2, 3, 4, 16, 8), None),  # windowed attention (timm's Hiera / NesT): batch, heads, windows, tokens, dim
        ((6, 16, 8), None),  # one head, no head dim
        ((2, 3, 4, 16, 8), (4, 16, 16)),  # a relative-position bias broadcast over batch and heads (timm's SAM ViT)
    ],
)
def test_attention_with_other_than_four_dims_costs_as_its_four_dim_equivalent(shape, mask):
    """F.scaled_dot_product_attention takes any batch dims; the fused kernels the costing routes to take four.
    Closed form: 4 x n x s^2 x d FLOPs forward (QK^T and PV), n = the product of the leading dims."""
    s, d = shape[-2], shape[-1]
    n = 1
    for x in shape[:-2]:
        n *= x
    qkv = tuple(torch.randn(shape, device="meta", requires_grad=True) for _ in range(3))
    cost, out = cost_piece(_Attn(mask), qkv, None, shape[0])
    assert tuple(out.shape) == shape
    assert cost.flops_fwd == 4 * n * s * s * d
    flat = tuple(torch.randn(n, 1, s, d, device="meta", requires_grad=True) for _ in range(3))
    ref, _ = cost_piece(_Attn(None if mask is None else (n, 1, s, s)), flat, None, shape[0])
    assert (cost.flops_fwd, cost.flops_bwd) == (ref.flops_fwd, ref.flops_bwd)
    assert cost.saved_bytes == ref.saved_bytes


def test_a_constructor_that_reads_tensor_data_builds_with_its_weights_on_meta():
    """Parameters 8x8+8, 8x12+12, 12x18+18 (widths computed from tensors in __init__), every one on the meta device."""
    from planner.model.load import load_model_file
    from planner.model.meta import parameters_on_meta

    doc = inspect_json(MODELS / "computed_widths.py")
    assert doc["totals"]["params"] == (8 * 8 + 8) + (8 * 12 + 12) + (12 * 18 + 18)
    model = load_model_file(MODELS / "computed_widths.py", {}).build_meta(torch.float32)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}
    with parameters_on_meta():  # the registration hooks are undone on exit
        pass
    assert nn.Linear(2, 2).weight.device.type == "cpu"


class _Windows(nn.Module):
    """Tokens regrouped into windows of ``w`` (a constant fx writes into the graph, as torchvision's MaxViT does)."""

    def __init__(self, w):
        super().__init__()
        self.w = w

    def forward(self, x):
        b, n, c = x.shape
        return x.reshape(b, n // self.w, self.w, c)


def test_pieces_that_differ_only_in_a_constant_are_not_costed_as_one():
    """Windows of 7 and of 8 give outputs (2, 8, 7, 4) and (2, 7, 8, 4): a structural signature blind to constants
    took one for the other and handed the next piece the wrong shape (MaxViT's window and grid attention)."""
    from types import SimpleNamespace

    from planner.model.cost import piece_structure

    seven, eight, again = (SimpleNamespace(gm=torch.fx.symbolic_trace(_Windows(w))) for w in (7, 8, 7))
    assert piece_structure(seven, None) != piece_structure(eight, None)
    assert piece_structure(seven, None) == piece_structure(again, None)
    x = torch.randn(2, 56, 4, device="meta")
    assert tuple(seven.gm(x).shape) == (2, 8, 7, 4) and tuple(eight.gm(x).shape) == (2, 7, 8, 4)


def test_timm_contract_takes_the_models_own_input_size(monkeypatch):
    """timm:NAME plans at the model's pretrained_cfg input size, or at the image_size model-arg; nothing of
    torchvision's (default weights' crop, video clips) applies. Run against a minimal module in timm's place
    (create_model, list_models, __version__: what the contract calls), since timm is not a test dependency."""
    import sys
    import types

    from planner.model.meta import build_on_meta
    from planner.model.sources import library_contract

    class Net(torch.nn.Module):
        pretrained_cfg = {"input_size": (3, 160, 128)}

        def __init__(self, num_classes: int = 10):
            super().__init__()
            self.head = torch.nn.Linear(3, num_classes)

        def forward(self, x):
            return self.head(x.mean((2, 3)))

    stand_in = types.ModuleType("timm")
    stand_in.__version__ = "0"
    stand_in.list_models = lambda: ["net"]
    stand_in.create_model = lambda name, pretrained=False, **kw: Net(**kw)
    monkeypatch.setitem(sys.modules, "timm", stand_in)

    c = library_contract("timm:net", {})
    model = build_on_meta(c.funcs["build_model"])
    assert isinstance(model, Net) and model.head.weight.is_meta
    assert c.funcs["example_inputs"](2)[0].shape == (2, 3, 160, 128)
    assert c.funcs["example_target"](2).max() < 10
    sized = library_contract("timm:net", {"image_size": 96, "num_classes": 5})
    assert sized.funcs["example_inputs"](1)[0].shape == (1, 3, 96, 96)
    assert sized.funcs["example_target"](4).max() < 5
