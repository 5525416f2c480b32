"""torchvision and timm models built by name (`torchvision:NAME`, `timm:NAME`), no weights, defaults untouched.

The registry's torchvision and timm are built against the CUDA torch: with the `+cpu` torch they fail to import
and these tests skip. Run them in an environment with the registry's own torch:
`pip install torch==2.13.0 torchvision==0.28.0 timm && pytest tests/model/test_thirdparty_vision.py`.
Published figures compared with: ResNet-50 25,557,032 parameters and 4.09 GMACs at 224x224 (torchvision's
model card); ViT-Ti/16 5.7 M parameters, 1.26 GMACs (timm).
"""

import json

import pytest
import torch
from typer.testing import CliRunner

torchvision = pytest.importorskip("torchvision")  # an ImportError (CUDA build next to +cpu torch) skips too

from planner.cli import app

runner = CliRunner()


def inspect(spec: str, *args) -> dict:
    r = runner.invoke(app, ["inspect", spec, "--json", *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_resnet50_parameters_and_flops():
    doc = inspect("torchvision:resnet50")
    model = torchvision.models.resnet50(weights=None)
    assert doc["totals"]["params"] == sum(p.numel() for p in model.parameters()) == 25_557_032
    per_sample = doc["totals"]["flops_fwd"] / doc["totals"]["micro_batch"]
    assert per_sample == pytest.approx(2 * 4.09e9, rel=0.01)
    assert doc["totals"]["micro_batch"] == 2  # BatchNorm: costed at two samples


def test_resnet50_leaf_bottleneck_keeps_each_block_whole():
    doc = inspect("torchvision:resnet50", "--leaf", "Bottleneck")
    names = [l["name"] for l in doc["layers"]]
    assert sum(1 for n in names if n.startswith("layer")) == 3 + 4 + 6 + 3
    assert not any(":" in n for n in names)


@pytest.mark.parametrize("name", ["deeplabv3_mobilenet_v3_large", "lraspp_mobilenet_v3_large"])
def test_segmentation_models_split_into_pieces(name):
    doc = inspect(f"torchvision:{name}")
    model = torchvision.models.get_model(name, weights=None, weights_backbone=None)
    assert doc["totals"]["params"] == sum(p.numel() for p in model.parameters())
    assert doc["totals"]["layers"] >= 10  # the input size read first and used last does not join every piece


def test_convnext_depthwise_backward_is_about_twice_forward():
    timm = pytest.importorskip("timm")
    doc = inspect("timm:convnext_atto")
    model = timm.create_model("convnext_atto", pretrained=False)
    assert doc["totals"]["params"] == sum(p.numel() for p in model.parameters())
    ratio = doc["totals"]["flops_bwd"] / doc["totals"]["flops_fwd"]
    assert 1.9 < ratio <= 2.0


def test_timm_vit_parameters_and_flops():
    timm = pytest.importorskip("timm")
    doc = inspect("timm:vit_tiny_patch16_224")
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    assert doc["totals"]["params"] == sum(p.numel() for p in model.parameters())
    h, s, layers = 192, 197, 12
    matmul = layers * 12 * h * h
    expect = 2 * matmul * s + layers * 4 * s * s * h + 2 * 196 * 3 * 16 * 16 * h + 2 * h * 1000
    assert doc["totals"]["flops_fwd"] == expect


@pytest.mark.parametrize("spec", ["torchvision:resnet50", "timm:vit_tiny_patch16_224"])
def test_plan_with_the_torch_engine(spec, tmp_path):
    if spec.startswith("timm"):
        pytest.importorskip("timm")
    r = runner.invoke(app, ["plan", spec, "--gpus", "4xA100", "--engine", "torch", "--out", str(tmp_path / "p"), "--quiet"])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "p" / "plan.json").read_text())["inputs"]["model_file"] == spec


def test_unknown_name_is_a_clear_error():
    r = runner.invoke(app, ["inspect", "torchvision:resnet51"])
    assert r.exit_code == 2 and "resnet50" in r.output and "Traceback" not in r.output
    assert torch is not None


@pytest.mark.parametrize(
    "name, args",
    [
        ("inception_v3", ()),
        ("r3d_18", ()),
        ("mvit_v2_s", ()),
        ("regnet_y_400mf", ()),
        ("maxvit_t", ()),
        ("lraspp_mobilenet_v3_large", ()),
        ("deeplabv3_resnet50", ("--model-arg", "aux_loss=true")),
    ],
)
def test_parameters_and_flops_match_torchvision_model_cards(name, args):
    """At the input the default weights were trained at (Inception v3's 299x299, 16-frame 112x112 clips for R3D, the
    520x520 segmentation weights' transforms resize to), the forward FLOPs are 2x the GMACs and the parameters those of
    the weights' model card (torchvision's ``_ops`` and ``num_params``). RegNet computes its widths with tensors in
    __init__, MaxViT's window and grid attention differ only in constants: both used to fail. Segmentation models were
    planned at 224x224 (-82% of the card's FLOPs); DeepLabV3's card counts the auxiliary head its weights were trained
    with, which the builder's default leaves out, so that case asks for it."""
    doc = inspect(f"torchvision:{name}", *args)
    meta = torchvision.models.get_model_weights(name).DEFAULT.meta
    assert doc["totals"]["params"] == meta["num_params"]
    per_sample = doc["totals"]["flops_fwd"] / doc["totals"]["micro_batch"]
    assert per_sample == pytest.approx(2 * meta["_ops"] * 1e9, rel=0.02)


def test_video_models_take_clips():
    doc = inspect("torchvision:r3d_18", "--model-arg", "frames=8")
    full = inspect("torchvision:r3d_18")
    assert doc["totals"]["flops_fwd"] == pytest.approx(full["totals"]["flops_fwd"] / 2, rel=0.01)  # 3-D convs: linear in frames


@pytest.mark.parametrize("name", ["fasterrcnn_resnet50_fpn", "raft_small"])
def test_detection_and_optical_flow_models_are_refused_with_what_to_plan(name):
    r = runner.invoke(app, ["inspect", f"torchvision:{name}"])
    assert r.exit_code == 2 and "Plan its backbone instead" in r.output, r.output
