"""Batch-coupled losses (planner.model.coupling): found at plan time, said in the plan, and smoked on the same
micro-batches.

References: the definition itself, computed here with plain torch (a loss over a batch against the mean of its
samples' losses), and open_clip's ClipLoss written out in tests/models/clip_style.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from planner.cli import app
from planner.model.analyze import analyze
from planner.model.coupling import loss_split_gap, meeting_in_loss, meeting_in_shapes, split_gap_words

runner = CliRunner()
MODELS = Path(__file__).parents[1] / "models"


def _per_sample_gap(loss, out: tuple[torch.Tensor, ...], target) -> float:
    """|loss(batch) - mean over samples of loss(sample)|, by the definition."""
    whole = float(loss(out, target))
    each = [float(loss(tuple(t[i : i + 1] if t.dim() else t for t in out), None if target is None else target[i : i + 1])) for i in range(out[0].shape[0])]
    return abs(whole - sum(each) / len(each))


def _clip_loss():
    import importlib.util

    spec = importlib.util.spec_from_file_location("clip_style", MODELS / "clip_style.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.loss_fn


def test_shapes_with_two_batch_dimensions_are_where_samples_meet():
    assert meeting_in_shapes([("x", [(4, 8)], [(8, 8)]), ("sim", [(4, 4)], [(8, 8)])]) == "sim is 4x4 at micro-batch 4 and 8x8 at 8: indexed by sample twice"
    assert meeting_in_shapes([("flat", [(32, 16)], [(64, 16)]), ("scalar", [()], [()])]) is None


def test_the_contrastive_loss_is_coupled_by_its_shapes_and_by_its_values():
    loss = _clip_loss()
    g = torch.Generator().manual_seed(0)
    out = (F.normalize(torch.randn(4, 16, generator=g), dim=-1), F.normalize(torch.randn(4, 16, generator=g), dim=-1), torch.tensor(14.3))
    assert _per_sample_gap(loss, out, None) > 0.1  # the definition: not the mean of its samples' losses
    meta = lambda b: tuple(torch.empty(t.shape[:0] + ((b,) + t.shape[1:] if t.dim() else ()), device="meta") for t in out)  # noqa: E731
    where = meeting_in_loss(lambda: loss(meta(2), None), lambda: loss(meta(4), None))
    assert where is not None and where.startswith("loss_fn's mm is 2x2")
    gap = loss_split_gap(loss, meta(2), meta(4), None, None)
    assert gap is not None and split_gap_words(*gap) is not None


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_summed_loss_is_twice_its_halves_mean_and_a_mean_is_not_coupled(reduction):
    def loss(out, target):
        return F.cross_entropy(out[0], target, reduction=reduction)

    out, target = (torch.randn(6, 5),), torch.randint(0, 5, (6,))
    assert (_per_sample_gap(loss, out, target) > 1e-3) == (reduction == "sum")
    meta = lambda b: (torch.empty(b, 5, device="meta"),)  # noqa: E731
    gap = loss_split_gap(loss, meta(3), meta(6), torch.empty(3, dtype=torch.long, device="meta"), torch.empty(6, dtype=torch.long, device="meta"))
    assert gap is not None
    whole, a, b = gap
    if reduction == "sum":
        assert whole == pytest.approx(a + b, rel=1e-6) and "sums over samples" in split_gap_words(*gap)
    else:
        assert whole == pytest.approx((a + b) / 2, rel=1e-6) and split_gap_words(*gap) is None


def test_a_clip_style_model_is_planned_at_two_samples_or_more_said_so_and_smokes(tmp_path):
    """open_clip's loss over the batch's similarity matrix: plan.json, the README and the smoke say it couples the
    samples; the pick's micro-batch is at least 2 (one pair's contrastive loss is 0); 2 CPU ranks match a single
    process run on the same micro-batches."""
    costs = analyze(MODELS / "clip_style.py").costs
    assert costs.loss is not None and costs.loss.coupling.startswith("loss_fn's mm is 1x1 at micro-batch 1 and 2x2 at 2")
    assert any("couples the samples" in n for n in costs.notes)
    out = tmp_path / "plan"
    r = runner.invoke(app, ["plan", str(MODELS / "clip_style.py"), "--gpus", "2xcpu", "--engine", "torch", "--pp", "2", "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "plan.json").read_text())
    assert doc["layout"]["micro_batch"] >= 2
    assert "loss_fn's mm" in doc["model"]["loss"]["coupling"]
    assert any("micro-batch size is part of the objective" in n for n in doc["notes"])
    assert "couples the samples of a micro-batch" in (out / "README.md").read_text()
    r = runner.invoke(app, ["smoke", str(out), "--steps", "2"])
    assert r.exit_code == 0, r.output
    assert "couples the samples" in r.output
    smoke = json.loads((out / "smoke.json").read_text())
    assert smoke["max_relative_difference"] <= 1e-5 and all(x > 0.1 for x in smoke["losses"])


def test_a_loss_computed_in_forward_over_the_batch_is_found_in_the_graph(tmp_path):
    """transformers' CLIPModel(return_loss=True) computes the contrastive loss in forward: the traced graph holds
    the (b, b) logits."""
    (tmp_path / "m.py").write_text(
        "import torch, torch.nn as nn, torch.nn.functional as F\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.a = nn.Linear(8, 4); self.b = nn.Linear(8, 4)\n"
        "    def forward(self, x, y):\n"
        "        logits = self.a(x) @ self.b(y).t()\n"
        "        labels = torch.arange(logits.shape[0], device=logits.device)\n"
        "        return {'loss': F.cross_entropy(logits, labels), 'logits': logits}\n"
        "def build_model(): return M()\n"
        "def example_inputs(b): return (torch.randn(b, 8), torch.randn(b, 8))\n"
    )
    costs = analyze(tmp_path / "m.py").costs
    assert costs.loss is not None and costs.loss.source == "model output"
    assert "at micro-batch 1 and 2x2 at 2" in costs.loss.coupling and costs.loss.coupling.startswith("the model's")


@pytest.mark.parametrize("model", ["nanogpt_style.py", "hf_labels.py"])
def test_losses_that_are_means_over_samples_are_not_coupled(model):
    costs = analyze(MODELS / model).costs
    assert costs.loss is not None and costs.loss.coupling == ""
    assert not any("couples the samples" in n for n in costs.notes)


def test_batchnorm_is_said_to_normalise_over_each_micro_batch(tmp_path):
    (tmp_path / "bn.py").write_text(
        "import torch, torch.nn as nn\n"
        "def build_model(): return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))\n"
        "def example_inputs(b): return (torch.randn(b, 8),)\n"
    )
    notes = analyze(tmp_path / "bn.py").costs.notes
    assert any(n.startswith("BatchNorm (1) normalises over each micro-batch") for n in notes)
