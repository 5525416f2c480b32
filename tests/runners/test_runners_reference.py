"""The single-process reference run (planner.runners.reference) against plain training loops written out by hand.

The hand-written loops spell the contract out independently (explicit sample
indices, their own seeding, their own scaling); the reference must equal them.
"""

from __future__ import annotations

import random
import textwrap

import pytest
import torch
import torch.nn.functional as F

from planner.model.load import load_model_file
from planner.model.trace import build_layer_graph
from planner.runners.reference import (
    BatchLayout,
    LossScaler,
    build_model,
    reference_losses,
    resolve_precision,
    step_seed,
)
from planner.runtime import load_planned_model

MLP = textwrap.dedent(
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class MLP(nn.Module):
        def __init__(self, dropout):
            super().__init__()
            self.fc1 = nn.Linear(6, 16)
            self.fc2 = nn.Linear(16, 3)
            self.p = dropout

        def forward(self, x):
            return self.fc2(F.dropout(torch.tanh(self.fc1(x)), self.p, self.training))

    def build_model(dropout=0.5):
        return MLP(dropout)

    def example_inputs(batch_size):
        return (torch.randn(batch_size, 6),)

    def example_target(batch_size):
        return torch.randn(batch_size, 3)

    def loss_fn(output, target):
        return F.mse_loss(output, target)
    """
)

# Batch statistics couple the samples of a micro-batch: the loss depends on which samples go together.
BNNET = textwrap.dedent(
    """
    import torch
    import torch.nn as nn

    def build_model():
        return nn.Sequential(nn.Conv1d(2, 4, 1), nn.BatchNorm1d(4), nn.ReLU(), nn.Flatten(), nn.Linear(12, 1))

    def example_inputs(batch_size):
        return (torch.randn(batch_size, 2, 3) + torch.arange(batch_size).view(-1, 1, 1) * 0.3,)
    """
)


def _planned(tmp_path, source: str, layout: dict):
    path = tmp_path / "model.py"
    path.write_text(source)
    mf = load_model_file(path, {})
    lg = build_layer_graph(mf.build_meta(torch.float32), mf.inputs_meta(1, torch.float32), None)
    names = [p.name for p in lg.pieces]
    plan = {
        "inputs": {"model_file": str(path), "model_args": {}, "dtype": "fp32", "tracer": "auto"},
        "model": {"pieces": names},
        "layout": dict(layout, dp=layout["dp"]),
        "stages": [{"index": 0, "rank": 0, "pieces": [0, len(names)]}],
    }
    return load_planned_model(plan, path), plan, mf.module


def _seed(s: int) -> None:
    random.seed(s)
    torch.manual_seed(s)


def _layout(global_batch, micro_batch, m, dp):
    return {"global_batch": global_batch, "micro_batch": micro_batch, "num_microbatches": m, "dp": dp}


def test_mlp_reference_equals_whole_batch_training(tmp_path):
    """No coupling between samples: accumulating mean losses / (m * dp) is whole-batch mean-loss training."""
    planned, plan, mod = _planned(tmp_path, MLP, _layout(12, 2, 3, 2))
    steps, seed, lr = 4, 3, 1e-2
    got = reference_losses(planned, plan, steps, seed, lr, "cpu", "fp32")

    _seed(seed)
    model = mod.build_model(dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    want = []
    for s in range(steps):
        _seed(seed * 100003 + s)
        x = mod.example_inputs(12)[0]
        y = mod.example_target(12)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    assert got == pytest.approx(want, rel=1e-6)
    assert len(set(round(v, 6) for v in got)) == steps  # the model trains: losses move


def test_batchnorm_reference_equals_explicit_slicing(tmp_path):
    """Micro-batch d*B/dp + i*mb .. + mb of replica d, loss / (m * dp): written with explicit indices."""
    B, mb, m, dp = 16, 2, 4, 2
    planned, plan, mod = _planned(tmp_path, BNNET, _layout(B, mb, m, dp))
    steps, seed, lr = 3, 0, 5e-2
    got = reference_losses(planned, plan, steps, seed, lr, "cpu", "fp32")

    def hand(order):
        _seed(seed)
        model = mod.build_model().train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        out = []
        for s in range(steps):
            _seed(seed * 100003 + s)
            x = mod.example_inputs(B)[0]
            total = 0.0
            for d in range(dp):
                for i in range(m):
                    idx = order(d, i)
                    y = model(x[idx]).float()  # no loss_fn in the file: error against a ramp over the last dimension
                    loss = (y - torch.linspace(-1.0, 1.0, y.shape[-1])).square().mean()
                    (loss / (m * dp)).backward()
                    total += loss.item()
            opt.step()
            opt.zero_grad()
            out.append(total / (m * dp))
        return out

    contract = hand(lambda d, i: list(range(d * (B // dp) + i * mb, d * (B // dp) + (i + 1) * mb)))
    assert got == pytest.approx(contract, rel=1e-6)
    # The test can tell slicings apart: micro-batches taken strided give other losses.
    strided = hand(lambda d, i: list(range(d * m + i, B, m * dp))[:mb])
    assert got != pytest.approx(strided, rel=1e-4)


def test_no_dropout_reaches_functional_dropout(tmp_path):
    """--no-dropout passes dropout=0 to build_model (F.dropout ignores nn.Dropout's p): runs repeat exactly."""
    planned, plan, _ = _planned(tmp_path, MLP, _layout(8, 4, 2, 1))
    a = reference_losses(planned, plan, 2, 0, 1e-2, "cpu", "fp32")
    b = reference_losses(planned, plan, 2, 0, 1e-2, "cpu", "fp32")
    assert a == b
    model = build_model(planned, 0, no_dropout=True)
    assert model.p == 0.0
    assert build_model(planned, 0, no_dropout=False).p == 0.5
    assert planned.model_file.model_args == {}  # not left changed


def test_layout_and_precision_rules(tmp_path):
    with pytest.raises(ValueError, match="inconsistent"):
        BatchLayout.from_plan({"layout": _layout(10, 2, 3, 2)})
    assert BatchLayout.from_plan({"layout": _layout(12, 2, 3, 2)}).per_replica == 6
    assert step_seed(2, 5) == 2 * 100003 + 5
    plan = {"inputs": {"dtype": "bf16"}}
    assert resolve_precision("auto", plan, torch.device("cpu")) == "fp32"
    assert resolve_precision("auto", plan, torch.device("cuda")) == "bf16"
    assert resolve_precision("fp16", plan, torch.device("cpu")) == "fp16"
    with pytest.raises(ValueError):
        resolve_precision("fp8", plan, torch.device("cpu"))


def test_loss_scaler_backs_off_and_grows():
    s = LossScaler("fp16", init_scale=8.0, growth_interval=2)
    assert not s.update(True) and s.scale == 4.0
    assert s.update(False) and s.scale == 4.0
    assert s.update(False) and s.scale == 8.0
    off = LossScaler("bf16")
    assert not off.enabled and off.scale == 1.0 and off.update(True)


def test_bf16_reference_uses_autocast(tmp_path):
    planned, plan, _ = _planned(tmp_path, MLP, _layout(8, 4, 2, 1))
    fp32 = reference_losses(planned, plan, 2, 0, 1e-2, "cpu", "fp32")
    bf16 = reference_losses(planned, plan, 2, 0, 1e-2, "cpu", "bf16")
    assert bf16 == pytest.approx(fp32, rel=2e-2)
    assert bf16 != fp32
