"""The default loss (a model file without loss_fn): its value, and that its gradient reaches the weights.

References: the closed form d/dy mean((y - r)^2) = 2 (y - r) / N, and autograd's gradient of the plain mean and of
the mean square through a final LayerNorm, both zero (each row of the output has mean 0 and variance 1 whatever the
input), which is why the default regresses onto a ramp instead.
"""

from __future__ import annotations

import json
import math
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
    spec = f"hf:{Path(__file__).parents[1] / 'models' / 'hf' / 'bert.json'}"
    r = runner.invoke(app, ["plan", spec, "--gpus", "2xcpu", "--engine", "torch", "--pp", "2", "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["smoke", str(out), "--steps", "2"])
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "smoke.json").read_text())
    assert doc["max_relative_difference"] <= 1e-5
    first, second = doc["losses"]
    assert 0.5 < first < 3.0 and second < first


# --------------------------------------------------------------------------- which loss is trained

MODELS = Path(__file__).parents[1] / "models"


def _model_file(tmp_path, body: str):
    from planner.model.load import load_model_file

    f = tmp_path / "m.py"
    f.write_text("import torch\n" + body)
    return load_model_file(f)


def test_the_loss_an_output_carries_is_found_where_libraries_put_it():
    from transformers.modeling_outputs import CausalLMOutput

    from planner.model.losses import output_loss

    loss, logits = torch.tensor(2.5), torch.randn(2, 3)
    assert output_loss((logits, loss)) == ("[1]", loss)  # nanoGPT's (logits, loss)
    assert output_loss({"logits": logits, "loss": loss}) == ("loss", loss)
    assert output_loss(CausalLMOutput(loss=loss, logits=logits)) == ("loss", loss)
    assert output_loss(CausalLMOutput(logits=logits)) is None  # transformers without labels: no loss
    assert output_loss((logits, None)) is None  # nanoGPT without targets
    assert output_loss((torch.tensor(1.0), torch.tensor(2.0))) is None  # two scalars: which one is ambiguous
    assert output_loss(logits) is None


def test_the_choice_prefers_loss_fn_then_the_models_own_loss_then_says_it_is_the_default(tmp_path):
    from planner.errors import UsageError
    from planner.model.losses import choose_loss, loss_function

    out = (torch.randn(2, 3), torch.tensor(1.5))
    both = _model_file(tmp_path, "def build_model(): pass\ndef example_inputs(b): pass\ndef loss_fn(o, t): return o[1] * 2\n")
    choice = choose_loss(both, out)
    assert choice.source == "loss_fn" and "None" in choice.text  # no example_target: the targets are inputs
    assert loss_function(both, choice, None)(out).item() == 3.0
    own = _model_file(tmp_path, "def build_model(): pass\ndef example_inputs(b): pass\n")
    choice = choose_loss(own, out)
    assert (choice.source, choice.where) == ("model output", "[1]")
    assert loss_function(own, choice, None)(out).item() == 1.5
    assert choose_loss(own, torch.randn(2, 3)).source == "default"
    assert "default" in choose_loss(own, torch.randn(2, 3)).text
    targets_only = _model_file(tmp_path, "def build_model(): pass\ndef example_inputs(b): pass\ndef example_target(b): pass\n")
    with pytest.raises(UsageError, match="example_target\\(\\) but no loss_fn"):
        choose_loss(targets_only, torch.randn(2, 3))


def _own_first_step_loss(plan_dir: Path, call) -> float:
    """The first step's loss computed without the planner's loss code: the model file's model, built from the smoke's
    seed, run on the smoke's global batch cut into the plan's micro-batches, ``call`` reading the model's own loss."""
    from planner.runners.reference import BatchLayout, global_batch, microbatches
    from planner.runtime import load_planned_model, seed_everything

    doc = json.loads((plan_dir / "plan.json").read_text())
    planned = load_planned_model(plan_dir)
    layout = BatchLayout.from_plan(doc)
    seed_everything(0)
    model = planned.model_file.call("build_model").float()
    model.train()
    inputs, target = global_batch(planned, layout, 0, 0)
    losses = [float(call(model, mb).detach()) for mb, _ in microbatches(inputs, target, layout)]
    return sum(losses) / len(losses)


@pytest.mark.parametrize("engine", ["torch", "deepspeed"])
def test_a_nanogpt_file_trains_the_models_own_cross_entropy(tmp_path, engine):
    """nanoGPT's file: example_inputs gives (idx, targets), forward returns (logits, loss), loss_fn returns output[1]
    and there is no example_target. The smoke's first loss is the model's own cross-entropy (about ln 96 = 4.56 at
    initialisation), not the default loss (31 on this model), in the rendered scripts and the single process alike."""
    out = tmp_path / "plan"
    r = runner.invoke(app, ["plan", str(MODELS / "nanogpt_style.py"), "--gpus", "2xcpu", "--engine", engine, "--pp", "2", "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "plan.json").read_text())
    assert doc["model"]["loss"]["source"] == "loss_fn"
    assert "loss_fn(output, None)" in (out / "README.md").read_text()
    r = runner.invoke(app, ["smoke", str(out), "--steps", "1"])
    assert r.exit_code == 0, r.output
    assert "loss trained: the model file's loss_fn" in r.output
    first = json.loads((out / "smoke.json").read_text())["losses"][0]
    own = _own_first_step_loss(out, lambda model, mb: model(*mb)[1])
    assert first == pytest.approx(own, rel=0.01)
    assert abs(first - math.log(96)) < 0.1


def test_a_transformers_causal_lm_given_labels_trains_its_own_loss(tmp_path):
    """A file that builds LlamaForCausalLM and gives labels as a keyword input (no loss_fn): the loss the ModelOutput
    carries (transformers' shifted next-token cross-entropy) is trained."""
    out = tmp_path / "plan"
    r = runner.invoke(app, ["plan", str(MODELS / "hf_labels.py"), "--gpus", "2xcpu", "--engine", "torch", "--pp", "2", "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    loss = json.loads((out / "plan.json").read_text())["model"]["loss"]
    assert (loss["source"], loss["where"]) == ("model output", "loss")
    r = runner.invoke(app, ["smoke", str(out), "--steps", "1"])
    assert r.exit_code == 0, r.output
    first = json.loads((out / "smoke.json").read_text())["losses"][0]
    own = _own_first_step_loss(out, lambda model, mb: model(input_ids=mb[0], labels=mb[1]).loss)
    assert first == pytest.approx(own, rel=0.01)


def test_a_default_loss_is_said_and_targets_without_a_loss_are_refused(tmp_path):
    body = "import torch.nn as nn\ndef build_model(): return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))\ndef example_inputs(b): return (torch.randn(b, 8),)\n"
    (tmp_path / "plain.py").write_text("import torch\n" + body)
    out = tmp_path / "plan"
    r = runner.invoke(app, ["plan", str(tmp_path / "plain.py"), "--gpus", "2xcpu", "--engine", "torch", "--pp", "2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "loss trained: the planner's default loss" in r.output
    assert json.loads((out / "plan.json").read_text())["model"]["loss"]["source"] == "default"
    assert "the planner's default loss" in (out / "README.md").read_text()
    (tmp_path / "targets.py").write_text("import torch\n" + body + "def example_target(b): return torch.randint(0, 4, (b,))\n")
    r = runner.invoke(app, ["plan", str(tmp_path / "targets.py"), "--gpus", "2xcpu", "--engine", "torch", "--out", str(tmp_path / "p2")])
    assert r.exit_code == 2, r.output
    assert "loss_fn(output, target)" in r.output and "Traceback" not in r.output
