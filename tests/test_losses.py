"""The default loss (a model file without loss_fn): its value, and that its gradient reaches the weights.

References: the closed form d/dy mean((y - r)^2) = 2 (y - r) / N, and autograd's gradient of the plain mean and of
the mean square through a final LayerNorm, both zero (each row of the output has mean 0 and variance 1 whatever the
input), which is why the default regresses onto a ramp instead.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from planner.cli import app
from planner.model.losses import default_loss, ramp_target

runner = CliRunner()


def test_default_loss_sums_each_floating_outputs_error_against_a_ramp():
    a, b = torch.randn(3, 4), torch.randn(5, dtype=torch.float64)
    out = {"a": a, "rest": (b, torch.ones(2, dtype=torch.long))}
    ra = torch.tensor([-1.0, -1 / 3, 1 / 3, 1.0])
    rb = torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0], dtype=torch.float64)
    expect = ((a - ra) ** 2).sum() / 12 + ((b - rb) ** 2).sum() / 5
    assert default_loss(out).item() == pytest.approx(expect.item(), rel=1e-6)
    assert default_loss(torch.full((2, 2), 3.0, dtype=torch.bfloat16)).dtype == torch.float32
    assert default_loss(torch.tensor(2.0)).item() == pytest.approx(9.0)  # a scalar output: the ramp is [-1]
    assert ramp_target(torch.empty(7, 3)).tolist() == [-1.0, 0.0, 1.0]


def test_the_default_loss_reaches_weights_below_a_final_norm():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32))
    x = torch.randn(8, 16)
    w = model[0].weight
    for naive in (model(x).mean(), model(x).square().mean()):
        assert torch.autograd.grad(naive, [w])[0].abs().max() < 1e-5  # these train nothing below the norm
    (grad,) = torch.autograd.grad(default_loss(model(x)), [w])
    y = model(x)
    (closed,) = torch.autograd.grad(y, [w], 2 * (y.detach() - ramp_target(y)) / y.numel())
    assert grad.abs().max() > 1e-2 and torch.allclose(grad, closed, atol=1e-7)


def test_an_encoder_without_a_head_smokes_on_a_loss_of_order_one(tmp_path):
    """transformers' BertModel (no head, no loss_fn): the losses are of order one, not the ~1e-4 mean of a
    normalised output, they fall between steps, and they equal a single-process run's."""
    pytest.importorskip("transformers")
    out = tmp_path / "plan"
    spec = f"hf:{Path(__file__).parent / 'models' / 'hf' / 'bert.json'}"
    r = runner.invoke(app, ["plan", spec, "--gpus", "2xcpu", "--engine", "torch", "--pp", "2", "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["smoke", str(out), "--steps", "2"])
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "smoke.json").read_text())
    assert doc["max_relative_difference"] <= 1e-5
    first, second = doc["losses"]
    assert 0.5 < first < 3.0 and second < first
