"""Run-time side of bring-your-own-model: the rendered scripts' stage modules for models traced with torch.export.

The stage modules are compared with the model itself (a plain forward of the
real model on the same inputs), and smoke's failure reporting and reference
settings with what the ranks really do.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from planner.check import smoke as sm
from planner.cli import app
from planner.engines.torch import runner as rt
from planner.runners.reference import build_model
from planner.runtime import load_planned_model

pytest.importorskip("transformers")

MODELS = Path(__file__).parents[1] / "models"
runner = CliRunner()


def plan_two_stages(spec: str, out: Path, engine: str = "torch", *pins: str) -> Path:
    """`planner plan SPEC` on 2 CPU ranks, two pipeline stages, into ``out``."""
    r = runner.invoke(app, ["plan", spec, "--gpus", "2xcpu", "--engine", engine, "--pp", "2", "--out", str(out), "--quiet", *pins])
    assert r.exit_code == 0, r.output
    return out


def smoke_ok(plan: Path) -> dict:
    """`planner smoke` of ``plan`` for two steps, passed; its smoke.json."""
    r = runner.invoke(app, ["smoke", str(plan), "--steps", "2"])
    assert r.exit_code == 0, r.output
    return json.loads((plan / "smoke.json").read_text())


def stages_equal_the_model(planned, stages, model) -> bool:
    """The stage modules run one after another on a batch of two equal the model's own forward, to the bit."""
    inputs, _ = planned.example_batch(2, seed=1)
    staged = inputs[0]
    for stage in stages:
        staged = stage(staged)
        staged = staged[0] if isinstance(staged, tuple) else staged
    return torch.equal(staged, model(*inputs))


def plan_dir(tmp_path: Path, model: str, engine: str = "torch", *pins: str) -> Path:
    return plan_two_stages(str(MODELS / model), tmp_path / f"{Path(model).stem}-{engine}", engine, *pins)


@pytest.fixture(scope="module")
def gpt2_plan(tmp_path_factory) -> Path:
    return plan_dir(tmp_path_factory.mktemp("gpt2"), "hf_gpt2.py", "torch", "--schedule", "1f1b", "--micro-batch", "2")


def _meta_or_asserts(gm: torch.fx.GraphModule) -> list[str]:
    bad = []
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten._assert_tensor_metadata.default:
            bad.append(f"{node.name}: assert")
        for v in list(node.args) + list(node.kwargs.values()):
            if isinstance(v, torch.device) and v.type == "meta":
                bad.append(f"{node.name}: {v}")
    return bad


def test_export_plan_stages_equal_the_real_model(gpt2_plan):
    """Stages built at run time for an export-traced GPT-2 chain to the model's own forward, exactly."""
    planned = load_planned_model(gpt2_plan)
    assert planned.layer_graph.tracer == "export"
    assert _meta_or_asserts(planned.layer_graph.gm)  # the planning graph is pinned to meta: it cannot run
    model = build_model(planned, seed=0, no_dropout=True)
    run = planned.for_run(model, "cpu")
    assert [p.name for p in run.layer_graph.pieces] == planned.piece_names
    assert not _meta_or_asserts(run.layer_graph.gm)
    inputs, _ = planned.example_batch(2, seed=1)
    stages = [rt.StageModule(run, model, s, "fp32", torch.device("cpu")) for s in range(run.num_stages)]
    x = stages[0](*inputs)
    flat = stages[1](*(x if isinstance(x, tuple) else (x,)))
    out = stages[1].last_output.rebuild(flat)
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"  # the model's own structure for loss_fn
    assert torch.equal(out.logits, model(*inputs).logits)


def test_for_run_moves_device_arguments(gpt2_plan):
    """The graph traced on the CPU weights names the run device wherever it named the tracing device."""
    planned = load_planned_model(gpt2_plan)
    model = build_model(planned, seed=0, no_dropout=True)
    run = planned.for_run(model, "meta")
    devices = {v for n in run.layer_graph.gm.graph.nodes for v in list(n.args) + list(n.kwargs.values()) if isinstance(v, torch.device)}
    assert devices == {torch.device("meta")}
    cpu = planned.for_run(model, "cpu")
    assert {v for n in cpu.layer_graph.gm.graph.nodes for v in n.kwargs.values() if isinstance(v, torch.device)} == {torch.device("cpu")}


def test_no_dropout_reaches_the_run_time_graph(gpt2_plan):
    """torch.export bakes dropout probabilities in: the run-time trace sees --no-dropout, the planning one does not."""
    planned = load_planned_model(gpt2_plan)

    def dropout_ps(gm):
        return sorted({float(n.args[1]) for n in gm.graph.nodes if "dropout" in str(n.target) and len(n.args) > 1})

    assert dropout_ps(planned.layer_graph.gm) and max(dropout_ps(planned.layer_graph.gm)) > 0
    run = planned.for_run(build_model(planned, seed=0, no_dropout=True), "cpu")
    assert dropout_ps(run.layer_graph.gm) in ([], [0.0])


@pytest.fixture(scope="module")
def bart_plan(tmp_path_factory) -> Path:
    """transformers' BART (its config's defaults: dropout 0.1 through F.dropout, on module floats, not nn.Dropout)."""
    return plan_two_stages(f"hf:{MODELS / 'hf' / 'bart.json'}", tmp_path_factory.mktemp("bart") / "plan")


def test_no_dropout_reaches_functional_dropout_on_module_floats(bart_plan):
    """BART calls F.dropout(x, p=self.dropout) with floats its layers copied from the config: --no-dropout zeroes them,
    so the run-time graph has no dropout left and two training-mode forwards agree exactly."""
    planned = load_planned_model(bart_plan)
    model = build_model(planned, seed=0, no_dropout=True)
    floats = {(type(m).__name__, k): v for m in model.modules() for k, v in vars(m).items() if type(v) is float and "drop" in k}
    assert floats and set(floats.values()) == {0.0}
    assert model.config.dropout == 0.0 and model.config.activation_dropout == 0.0
    run = planned.for_run(model, "cpu")
    assert not {float(n.args[1]) for n in run.layer_graph.gm.graph.nodes if "dropout" in str(n.target) and len(n.args) > 1} - {0.0}
    inputs, _ = planned.example_batch(2, seed=1)
    assert torch.equal(model(*inputs).logits, model(*inputs).logits)
    kept = build_model(planned, seed=0, no_dropout=False)
    assert kept.config.dropout == 0.1 and not torch.equal(kept(*inputs).logits, kept(*inputs).logits)


@pytest.mark.slow
def test_bart_smoke_equals_one_process(bart_plan):
    """An encoder-decoder with functional dropout, two pipeline stages on two CPU ranks: losses equal one process."""
    doc = smoke_ok(bart_plan)
    assert doc["ok"] and doc["ranks"] == 2 and doc["max_relative_difference"] <= 1e-5


@pytest.mark.slow
@pytest.mark.slow
def test_an_export_plan_whose_cuts_change_with_the_batch_runs_its_planned_pieces(tmp_path):
    """Funnel's export trace offers fewer sub-block cuts at the scripts' micro-batch (22 pieces at 8) than at the
    planned one (32 at 1): the run checks the model at the batch the plan was traced at, then places the plan's pieces
    on the run-time graph; it trains as one process does."""
    out = plan_two_stages(f"hf:{MODELS / 'hf' / 'funnel.json'}", tmp_path / "plan")
    doc = json.loads((out / "plan.json").read_text())
    assert doc["inputs"]["tracer_used"] == "export" and doc["layout"]["micro_batch"] > doc["inputs"]["cost_micro_batch"]
    smoke = smoke_ok(out)
    assert smoke["ok"] and smoke["ranks"] == 2 and smoke["max_relative_difference"] <= 1e-5


def test_resnet_whose_stage_adds_into_its_received_value_equals_one_process(tmp_path):
    """transformers' ResNet adds the shortcut into the block's output in place (hidden_state += residual): cut there,
    the second stage writes the value it received."""
    out = plan_two_stages(f"hf:{MODELS / 'hf' / 'resnet.json'}", tmp_path / "plan")
    planned = load_planned_model(out)
    model = build_model(planned, seed=0, no_dropout=True)
    run = planned.for_run(model, "cpu")
    assert any(rt.written_placeholders(run.stage(model, s).gm) for s in range(1, run.num_stages))
    smoke_ok(out)


class TwoTowers(torch.nn.Module):
    """A stage's view of CLIP: an image path received from the previous stage, a text path from token ids."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.tok = torch.nn.Embedding(10, 4)
        self.text = torch.nn.Linear(4, 4)
        self.scale = torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, image, ids):
        t = self.text(self.tok(ids)).mean(1)
        return (self.proj(image) * t).sum(-1) * self.scale.exp()


def test_weights_the_received_activations_do_not_reach_are_found():
    """The text tower (fed by token ids) and a scale read alone are off the received image path; the image projection
    and what consumes both paths are on it. With no differentiable input every weight is off it."""
    gm = torch.fx.symbolic_trace(TwoTowers())
    assert rt.weights_off_the_gradient_path(gm, [True, False]) == ["tok.weight", "text.weight", "text.bias", "scale"]
    assert set(rt.weights_off_the_gradient_path(gm, [False, False])) == {n for n, _ in TwoTowers().named_parameters()}
    assert rt.weights_off_the_gradient_path(gm, [True, True]) == ["scale"]


@pytest.mark.slow
def test_clip_under_a_zero_bubble_schedule_equals_one_process(tmp_path):
    """CLIP cut between its towers: the second stage's text tower reads token ids only, which torch's split backward
    cannot reach (its gradients were wrong from the second step, 1.26 relative); that stage now runs its whole backward
    in the input-gradient pass."""
    doc = smoke_ok(plan_two_stages(f"hf:{MODELS / 'hf' / 'clip.json'}", tmp_path / "plan", "torch", "--schedule", "zbv"))
    assert doc["ok"] and doc["max_relative_difference"] <= 1e-5 and doc["losses"][0] != doc["losses"][1]


#: the model-file contract's functions for a Model taking 8 features (appended to the model files below)
CONTRACT_8 = """

def build_model():
    return Model()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 8),)
"""

#: four Blocks in a row, with CONTRACT_8: the tail of the model files whose Block is what a test is about
FOUR_BLOCKS_8 = """

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(4)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x

"""
FOUR_BLOCKS_8 += CONTRACT_8

SCALAR_GAIN = """import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.gain = nn.Parameter(torch.tensor(0.5))  # a 0-dim weight (ReZero-style residual gain)

    def forward(self, x):
        return x + self.gain * torch.tanh(self.lin(x))


"""
SCALAR_GAIN += FOUR_BLOCKS_8


@pytest.mark.slow
def test_a_0_dim_weight_trains_under_deepspeed_as_in_one_process(tmp_path):
    """DeepSpeed 0.19.8 broadcasts every parameter as p.data.view(torch.uint8), which raises for a 0-dim weight (a
    ReZero gain, CLIP's logit_scale); the script gives such weights the shape [1], and the losses equal one process."""
    (tmp_path / "m.py").write_text(SCALAR_GAIN)
    out = plan_two_stages(str(tmp_path / "m.py"), tmp_path / "plan", "deepspeed")
    assert "ds.scalar_parameters_as_vectors(module)" in (out / "train_deepspeed.py").read_text()
    smoke_ok(out)


def test_scalar_parameters_become_vectors_in_place():
    from planner.engines.deepspeed import runner as ds

    m = torch.nn.Module()
    m.gain, m.w = torch.nn.Parameter(torch.tensor(0.5)), torch.nn.Parameter(torch.ones(2))
    gain, storage = m.gain, m.gain.data.untyped_storage().data_ptr()
    assert ds.scalar_parameters_as_vectors(m) == ["gain"]
    assert m.gain is gain and m.gain.shape == (1,) and m.gain.item() == 0.5 and m.w.shape == (2,)
    assert m.gain.data.untyped_storage().data_ptr() == storage  # a view, not a copy


def test_a_planned_piece_of_layout_nodes_the_run_time_graph_lacks_is_empty():
    """A piece made only of nodes the other trace does not have (the random ops of a stochastic depth --no-dropout
    turns off, a ``contiguous`` a bf16 meta trace has and an fp32 one not) runs empty: its cut falls where the next
    piece starts, and the other pieces keep their nodes."""
    from planner.model.trace import Piece, build_layer_graph
    from planner.runtime import PlanMismatch, impose_pieces

    with torch.device("meta"):
        model = SizeAtEnd()
    traced = build_layer_graph(model, (torch.empty(2, 8, device="meta"),), tracer="fx")
    nodes = traced.pieces[0].nodes
    cut = next(i for i, n in enumerate(nodes) if n.op == "call_module" and n.target == "blocks.1")
    ghost = torch.fx.Graph().call_function(torch.rand, (2,))  # a node of the other trace only
    ghost.name = "rand_7"
    template = [Piece(0, "a", "block", None, nodes[:cut], ()), Piece(1, "a'", "block", None, [ghost], ()), Piece(2, "b", "block", None, nodes[cut:], ())]
    imposed = impose_pieces(dataclasses.replace(traced, pieces=template, cut_kinds=["input", "block", "block", "output"]), traced, "m.py")
    two = impose_pieces(dataclasses.replace(traced, pieces=[template[0], template[2]], cut_kinds=["input", "block", "output"]), traced, "m.py")
    assert [p.nodes for p in imposed.pieces] == [two.pieces[0].nodes, [], two.pieces[1].nodes] and all(two.pieces[i].nodes for i in (0, 1))
    assert [n.name for n in imposed.boundaries[1]] == [n.name for n in imposed.boundaries[2]] == ["size", "blocks_0"]
    # pieces whose nodes run in another order are not the planned model
    with pytest.raises(PlanMismatch, match="the graphs run their nodes in another order at run time than at planning"):
        impose_pieces(dataclasses.replace(traced, pieces=[template[2], template[0]]), traced, "m.py")


def test_align_nodes_matches_names_shifted_by_nodes_one_trace_lacks():
    """--no-dropout removes a stochastic depth's random ops (rand, add, floor, div, mul) from the run-time trace, which
    renumbers every later add; a stride-dependent contiguous shifts the later contiguous names the same way."""
    from planner.runtime import align_nodes

    planned = ["linear", "contiguous", "reshape", "rand", "add", "floor", "div", "mul", "add_1", "layer_norm", "contiguous_1", "linear_1", "add_2"]
    run = ["linear", "reshape", "add", "layer_norm", "contiguous", "linear_1", "add_1"]
    got = align_nodes(planned, run)
    named = {planned[i]: run[j] for i, j in got.items()}
    # ops both graphs have equally many of keep their names; the others are matched by op, in order
    assert named["linear"] == "linear" and named["reshape"] == "reshape" and named["layer_norm"] == "layer_norm" and named["linear_1"] == "linear_1"
    assert named["add_2"] == "add_1" and named["contiguous_1"] == "contiguous"
    assert len(got) == len(run) and sorted(got.values()) == list(range(len(run)))  # every run-time node placed once
    assert all(a.split("_")[0] == b.split("_")[0] for a, b in named.items())
    assert sorted(got.values()) == [got[i] for i in sorted(got)]  # in order
    assert not {"rand", "floor", "div", "mul", "contiguous"} & set(named)
    assert align_nodes(run, run) == {i: i for i in range(len(run))}
    with pytest.raises(ValueError, match="another order"):
        align_nodes(["linear", "layer_norm"], ["layer_norm", "linear"])
    # equally many contiguous ops in both traces, in other places (BigBird at another batch and dtype): matched by
    # position between the anchors, not by their names
    planned = ["linear", "contiguous", "bmm", "contiguous_1", "softmax", "bmm_1", "linear_1"]
    run = ["linear", "bmm", "contiguous", "softmax", "contiguous_1", "bmm_1", "linear_1"]
    named = {planned[i]: run[j] for i, j in align_nodes(planned, run).items()}
    assert named["bmm"] == "bmm" and named["softmax"] == "softmax" and named["linear_1"] == "linear_1"
    assert named["contiguous_1"] == "contiguous" and "contiguous" not in named


RELU_IN_PLACE = """
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        h = x.relu_()  # in place on the block's input
        return self.lin(h.transpose(1, 2)).transpose(1, 2)  # the input's gradient comes back transposed


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(6, 6)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return x


def build_model():
    return Model()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 6, 6),)
"""


FROZEN_SHARED_TABLE = """
import torch
import torch.nn as nn


class Model(nn.Module):
    \"\"\"Every block reads one frozen table, as RoFormer's layers read its sinusoidal position table.\"\"\"

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.linspace(-1, 1, 8), requires_grad=False)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x) + self.table)
        return x

"""
FROZEN_SHARED_TABLE += CONTRACT_8


@pytest.mark.slow
def test_a_frozen_parameter_read_by_two_stages_is_not_reduced_as_tied(tmp_path):
    """Only trainable parameters are tied across stages: a frozen one has no gradient to sum (the torch runner's
    all-reduce of its None gradient raised on RoFormer), and both stages build it alike from the seed."""
    (tmp_path / "m.py").write_text(FROZEN_SHARED_TABLE)
    plan = plan_two_stages(str(tmp_path / "m.py"), tmp_path / "plan", "torch", "--schedule", "1f1b")
    planned = load_planned_model(plan)
    model = build_model(planned, seed=0)
    assert all(name != "table" for name, _ in planned.tied_parameters(model))
    # both stages read the same frozen table
    assert all(any(p is model.table for p in planned.stage(model, s).gm.parameters()) for s in range(2))
    doc = smoke_ok(plan)
    assert doc["ok"] and doc["max_relative_difference"] <= 1e-5


FUNCTIONAL_DROPOUT_HEAD = """
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    \"\"\"A classifier head's dropout as timm writes it (GhostNet, RepGhost): a float on the module, a branch on it and
    F.dropout, which an fx trace records with p = 0.5 as a constant.\"\"\"

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])
        self.drop_rate = 0.5

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        if self.drop_rate > 0.0:
            x = F.dropout(x, p=self.drop_rate, training=self.training)
        return x

"""
FUNCTIONAL_DROPOUT_HEAD += CONTRACT_8


def test_no_dropout_reaches_an_fx_graph_that_baked_functional_dropout(tmp_path):
    """An fx-traced plan is traced again for the run where its graph holds a random op: the dropout probability is a
    constant of the planning trace, so --no-dropout did not reach it and the pipeline ran dropout where the one-process
    reference did not (timm's GhostNet and RepGhost: smoke 2.9e-3 and 9.8e-4 off). A graph without one is kept."""
    (tmp_path / "m.py").write_text(FUNCTIONAL_DROPOUT_HEAD)
    plan = plan_two_stages(str(tmp_path / "m.py"), tmp_path / "plan", "torch", "--schedule", "1f1b")
    planned = load_planned_model(plan)
    assert planned.layer_graph.tracer == "fx"

    def dropout_ps(gm):
        return [n.kwargs.get("p", n.args[1] if len(n.args) > 1 else None) for n in gm.graph.nodes if "dropout" in str(n.target)]

    assert dropout_ps(planned.layer_graph.gm) == [0.5]
    model = build_model(planned, seed=0, no_dropout=True)
    run = planned.for_run(model, "cpu")
    assert dropout_ps(run.layer_graph.gm) == [] and run.piece_names == planned.piece_names
    assert stages_equal_the_model(planned, [run.stage(model, s) for s in range(run.num_stages)], model)
    (tmp_path / "plain.py").write_text(FUNCTIONAL_DROPOUT_HEAD.replace("self.drop_rate = 0.5", "self.drop_rate = 0.0"))
    plain = load_planned_model(plan_two_stages(str(tmp_path / "plain.py"), tmp_path / "plain", "torch", "--schedule", "1f1b"))
    assert plain.for_run(build_model(plain, seed=0, no_dropout=True), "cpu") is plain


@pytest.mark.slow
def test_functional_dropout_of_an_fx_plan_smoke_equals_one_process(tmp_path):
    (tmp_path / "m.py").write_text(FUNCTIONAL_DROPOUT_HEAD)
    doc = smoke_ok(plan_two_stages(str(tmp_path / "m.py"), tmp_path / "plan", "torch", "--schedule", "1f1b"))
    assert doc["ok"] and doc["max_relative_difference"] <= 1e-5


SIZE_PASSED_TO_BLOCKS = """
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, h, w):
        b, n, c = x.shape
        y = self.lin(x).transpose(1, 2).reshape(b, c, h, w)
        return x + torch.tanh(y).flatten(2).transpose(1, 2)


class Model(nn.Module):
    \"\"\"The input's height and width read once and passed to every block, as timm's XCiT, FastViT and CSPNeXt do.\"\"\"

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(4)])

    def forward(self, img):
        h, w = img.shape[-2:]
        x = img.flatten(2).transpose(1, 2)
        for blk in self.blocks:
            x = blk(x, h, w)
        return x


def build_model():
    return Model()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 8, 4, 4),)
"""


def test_an_fx_plan_is_traced_again_with_its_shape_constants_fixed(tmp_path):
    """The planner fixes shape values that do not change with the batch (the input's height and width, passed to every
    block) as constants, read off traces at the costs' batch and twice it, so that pieces can be cut between blocks.
    The scripts traced fx plans at one batch only: the values stayed in the graph, joined every block into one piece,
    and the run stopped with PlanMismatch (XCiT: 11 pieces against the plan's 46)."""
    (tmp_path / "m.py").write_text(SIZE_PASSED_TO_BLOCKS)
    plan = plan_two_stages(str(tmp_path / "m.py"), tmp_path / "plan", "torch", "--schedule", "1f1b")
    doc = json.loads((plan / "plan.json").read_text())
    assert len(doc["model"]["pieces"]) >= 4
    planned = load_planned_model(plan)
    assert planned.piece_names == doc["model"]["pieces"]
    model = build_model(planned, seed=0, no_dropout=True)
    assert stages_equal_the_model(planned, [planned.stage(model, s) for s in range(planned.num_stages)], model)


SHARED_BIAS_TABLE_IN_A_LEAF = """
import torch
import torch.nn as nn


class Heads(nn.Module):
    \"\"\"Cascaded heads, each adding its row of one bias table (EfficientViT's attention biases).\"\"\"

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.biases = nn.Parameter(torch.linspace(-1, 1, 16).reshape(2, 8))

    def forward(self, x):
        feat, outs = x, []
        for i, head in enumerate(self.heads):
            feat = (head(feat) + self.biases[i]).softmax(-1)
            outs.append(feat)
        return torch.stack(outs).sum(0)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.mixer = Heads()
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return x + self.mixer(self.norm(x))

"""
SHARED_BIAS_TABLE_IN_A_LEAF += FOUR_BLOCKS_8


@pytest.mark.slow
def test_a_weight_pass_whose_parameter_groups_share_graph_nodes_keeps_the_graph(tmp_path):
    """Under a zero-bubble schedule torch computes the weight gradients one parameter group at a time and freed the
    autograd graph after each; a bias table whose rows two cascaded heads add, inside a module the tracer keeps whole
    (a block's child, so the stage cannot see that the table is read alone), puts shared nodes in two groups, and the
    second group's pass stopped with "Trying to backward through the graph a second time" (timm's EfficientViT-MSRA
    and CoaT). The weight pass now keeps the graph until it ends: the losses equal one process."""
    (tmp_path / "m.py").write_text(SHARED_BIAS_TABLE_IN_A_LEAF)
    plan = plan_two_stages(str(tmp_path / "m.py"), tmp_path / "plan", "torch", "--schedule", "zbv")
    doc = smoke_ok(plan)
    assert doc["ok"] and doc["max_relative_difference"] <= 1e-5


def test_an_input_written_in_place_through_an_alias_is_copied():
    """MobileOne's disabled squeeze-excitation is an nn.Identity: the received value passed through it and was written
    by the next ReLU(inplace=True), which torch refuses on the stage's input ("Output 0 of _ContiguousGrad is a view
    and is being modified inplace"). Writes through an identity module or a view method count as writes to the input;
    a write to a new tensor computed from it does not."""

    class Through(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.se, self.act = torch.nn.Identity(), torch.nn.ReLU(inplace=True)

        def forward(self, a, b, c):
            self.act(self.se(a))  # through nn.Identity
            b.view(-1)[:2].mul_(2)  # through two views
            (c + 1).relu_()  # a new tensor
            return a + b + c

    gm = torch.fx.symbolic_trace(Through())
    assert rt.written_placeholders(gm) == {0, 1}
    a, b, c = (torch.randn(2, 3, requires_grad=True) for _ in range(3))
    with pytest.raises(RuntimeError, match="modified inplace"):  # the premise: what torch does without the copy
        gm(*(rt._received(t, False) for t in (a, b, c)))
    out = gm(*(rt._received(t, i in rt.written_placeholders(gm)) for i, t in enumerate((a, b, c))))
    assert torch.equal(out, Through()(a.detach().clone(), b.detach().clone(), c.detach().clone()))


RELATIVE_BIAS_INDEX = """
import torch
import torch.nn as nn


class Block(nn.Module):
    \"\"\"A relative positional bias read through an index buffer, as MaxViT's: the planner's trace holds the index as a
    constant of the graph, taken from the model it traced.\"\"\"

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.table = nn.Parameter(torch.linspace(-1, 1, 15))
        self.register_buffer("index", torch.arange(8)[:, None] - torch.arange(8)[None, :] + 7)

    def forward(self, x):
        bias = self.table[self.index.view(-1)].view(8, 8)  # MaxViT's relative positional bias
        return x + torch.tanh(self.lin(x) @ bias)


"""
RELATIVE_BIAS_INDEX += FOUR_BLOCKS_8


def test_an_fx_plan_holding_constants_of_the_meta_model_is_traced_again_on_the_real_one(tmp_path):
    """The plan's graph was traced on the meta model: a tensor constant it holds has no data, and a stage holding it
    could not be moved ("Cannot copy out of meta tensor": torchvision's MaxViT, timm's Swin V2 CR). The scripts trace
    such a plan again on the real model, symbolically (so the constants are the model's own) with the shapes run in
    fake mode; the stages equal the model."""
    (tmp_path / "m.py").write_text(RELATIVE_BIAS_INDEX)
    planned = load_planned_model(plan_two_stages(str(tmp_path / "m.py"), tmp_path / "plan", "torch", "--schedule", "1f1b"))
    assert planned.layer_graph.tracer == "fx"
    model = build_model(planned, seed=0, no_dropout=True)
    from planner.runtime import meta_constants

    assert meta_constants(planned.layer_graph.gm, model)
    with pytest.raises(NotImplementedError, match="meta tensor"):  # the planning graph's stage, as the scripts ran it
        planned.stage(model, planned.num_stages - 1).to("cpu")
    run = planned.for_run(model, "cpu")
    assert not meta_constants(run.layer_graph.gm, model) and run.piece_names == planned.piece_names
    stages = [run.stage(model, s) for s in range(run.num_stages)]
    for stage in stages:
        stage.to("cpu")  # raised for the meta constant
        assert all(t.device.type == "cpu" for t in stage.buffers())
    assert stages_equal_the_model(planned, stages, model)


LAZY_BUFFER_IN_A_LEAF = """
import torch
import torch.nn as nn


class Lazy(nn.Module):
    \"\"\"Computes a table on its first call and assigns it to its buffer, as ConViT's attention does with its relative
    position indices; a block's child, so it runs as it is.\"\"\"

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("table", torch.zeros(1), persistent=False)

    def forward(self, x):
        if self.table.shape[0] != x.shape[-1]:
            self.table = torch.linspace(0.5, 1.5, x.shape[-1], device=x.device)
        return self.lin(x) * self.table


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.mixer = Lazy()
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return x + torch.tanh(self.mixer(self.norm(x)))

"""
LAZY_BUFFER_IN_A_LEAF += FOUR_BLOCKS_8


@pytest.mark.slow
def test_a_buffer_the_model_replaces_on_its_first_call_is_put_back_after_the_shape_inference(tmp_path):
    """torch runs each stage once to learn its shapes; the planner puts the buffers back afterwards. It wrote the old
    values into the new tensor where the model had replaced one (the initial one-element zeros broadcast into the
    computed table), so the table stayed zero and was never computed again (timm's ConViT: 4.7e-4 off one process). The
    original tensor is put back, and the first step computes the table as one process does."""
    (tmp_path / "m.py").write_text(LAZY_BUFFER_IN_A_LEAF)
    doc = smoke_ok(plan_two_stages(str(tmp_path / "m.py"), tmp_path / "plan", "torch", "--schedule", "1f1b"))
    assert doc["ok"] and doc["max_relative_difference"] <= 1e-5


def test_a_stage_writing_its_input_in_place_runs_on_a_copy_and_sends_contiguous_gradients(tmp_path):
    """torch.distributed.pipelining hands a stage its received values as leaves that require grad: an in-place op on
    one (x.relu_(), ResNet's hidden += residual) raises, and a gradient with transposed strides cannot be received
    into torch's buffer. The stage copies what it writes and returns contiguous gradients; values and gradients equal
    the whole model's."""
    (tmp_path / "m.py").write_text(RELU_IN_PLACE)
    planned = load_planned_model(plan_two_stages(str(tmp_path / "m.py"), tmp_path / "plan"))
    model = build_model(planned, seed=0)
    last = planned.num_stages - 1
    assert rt.written_placeholders(planned.stage(model, last).gm) == {0}
    x = torch.randn(2, 6, 6)
    model(x).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    stages = [rt.StageModule(planned, model, s, "fp32", torch.device("cpu")) for s in range(planned.num_stages)]
    h = stages[0](x)
    sent = h.detach().requires_grad_(True)  # as a receiving stage gets it: a leaf
    out = stages[last](sent)
    assert torch.allclose(out, model(x)) and torch.equal(sent, h)  # the received value itself is left as it came
    out.sum().backward()
    assert sent.grad is not None and sent.grad.is_contiguous()
    h.backward(sent.grad)
    assert all(torch.allclose(p.grad, want[n]) for n, p in model.named_parameters())


def test_stage_outputs_are_contiguous(tmp_path):
    """A block returning a transposed view crosses the stage boundary as a contiguous tensor (gloo refuses others)."""
    d = plan_dir(tmp_path, "permuted.py")
    planned = load_planned_model(d)
    model = build_model(planned, seed=0)
    x = planned.example_batch(2, seed=0)[0][0]
    raw = planned.stage(model, 0)(x)
    assert not raw.is_contiguous()
    for clone in (False, True):
        out = rt.StageModule(planned, model, 0, "fp32", torch.device("cpu"), clone_outputs=clone)(x)
        assert out.is_contiguous() and torch.equal(out, raw)


def test_flat_output_round_trip():
    """Dicts and nested outputs with non-tensor leaves go to PipelineStage as tensors and come back whole."""
    a, b = torch.ones(2), torch.zeros(3)
    value = {"logits": a, "aux": (b, 7), "name": "x"}
    flat = rt.FlatOutput.of(value)
    assert all(isinstance(t, torch.Tensor) for t in flat.tensors) and len(flat.tensors) == 2
    back = flat.rebuild(tuple(t + 1 for t in flat.tensors))
    assert torch.equal(back["logits"], a + 1) and torch.equal(back["aux"][0], b + 1) and back["aux"][1] == 7 and back["name"] == "x"
    assert rt.FlatOutput.of(a).spec is None and rt.FlatOutput.of((a, b)).spec is None


class SizeAtEnd(torch.nn.Module):
    """Reads its input's batch size first and uses it last: a non-tensor value live across every cut."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x):
        n = x.size(0)
        for b in self.blocks:
            x = b(x)
        return x.reshape(n, -1)


def test_non_tensor_value_across_a_stage_cut_is_refused_by_name():
    """A plan cut where a non-tensor value crosses (the tracer never offers one) is refused, naming the value."""
    from planner.model.trace import Piece, build_layer_graph
    from planner.runtime import PlanMismatch, PlannedModel, impose_pieces

    with torch.device("meta"):
        model = SizeAtEnd()
    traced = build_layer_graph(model, (torch.empty(2, 8, device="meta"),), tracer="fx")
    assert traced.n == 1  # the tracer keeps the size and its use in one piece
    nodes = traced.pieces[0].nodes
    cut = next(i for i, n in enumerate(nodes) if n.op == "call_module" and n.target == "blocks.1")
    template = [Piece(0, "a", "block", None, nodes[:cut], ()), Piece(1, "b", "block", None, nodes[cut:], ())]
    imposed = impose_pieces(dataclasses.replace(traced, pieces=template, cut_kinds=["input", "block", "output"]), traced, "m.py")
    assert [n.name for n in imposed.boundaries[1]] == ["size", "blocks_0"]
    planned = PlannedModel(None, imposed, [0, 1, 2], ["a", "b"])
    with pytest.raises(PlanMismatch, match="value size crossing the stage boundary before piece 1 .b. is not a tensor"):
        planned.check_sendable()
    PlannedModel(None, imposed, [0, 2], ["a", "b"]).check_sendable()  # one stage: nothing crosses a send


# ----------------------------------------------------------------------------- smoke reporting

GLOO_CLOSED = """[rank0]: Traceback (most recent call last):
[rank0]:   File "train_torch.py", line 120, in <module>
[rank0]:     work.wait()
[rank0]: RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:50598
"""
REAL = """[rank1]: Traceback (most recent call last):
[rank1]:   File "train_torch.py", line 99, in main
[rank1]:     out = self.body(*args)
[rank1]: RuntimeError: input tensor has to be contiguous
"""


def test_failing_rank_is_the_real_exception_not_the_closed_connection():
    now = time.time()
    rank, err = sm.failing_rank({0: GLOO_CLOSED, 1: REAL, -1: "torchrun summary"}, {0: now - 5, 1: now})
    assert rank == 1 and err == "RuntimeError: input tensor has to be contiguous"
    # two real exceptions: the earlier one caused the failure
    rank, err = sm.failing_rank({0: REAL.replace("rank1", "rank0"), 1: REAL}, {0: now, 1: now - 3})
    assert rank == 1
    # the scripts' own one-line errors count (exit 2)
    rank, err = sm.failing_rank({0: GLOO_CLOSED, 1: "error (rank 1): PlanMismatch: changed"}, {})
    assert rank == 1 and err.startswith("error (rank 1): PlanMismatch")
    assert sm.failing_rank({0: "step 1/2 loss 4.5"}, {}) == (-1, None)


def test_failing_rank_of_a_worker_killed_by_a_signal_is_torchrun_s_root_cause(tmp_path):
    """issue: a rank that died by SIGSEGV inside torch (timm cpubone_nano under ZBV) left no Python error, and smoke said
    "failing rank (unknown)" with torchrun's log as "rank -1". The root cause torchrun prints names it: here, from a
    real torchrun whose rank 1 kills itself with SIGSEGV while rank 0 waits."""
    script = tmp_path / "crash.py"
    script.write_text("import os, signal, time\nif os.environ['RANK'] == '1':\n    os.kill(os.getpid(), signal.SIGSEGV)\ntime.sleep(60)\n")
    p = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(sm._free_port()), str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert p.returncode != 0
    rank, err = sm.failing_rank({0: "", 1: "", -1: p.stdout + p.stderr}, {})
    assert rank == 1 and err == "killed by SIGSEGV without a Python error (torchrun's root cause: exit code -11)", (rank, err, p.stderr[-2000:])
    # the surviving rank's "connection reset by peer" is what the crash caused, not the cause
    assert sm.failing_rank({0: GLOO_CLOSED, 1: "", -1: p.stdout + p.stderr}, {}) == (1, err)
    assert sm.torchrun_root_cause("torchrun summary") == (-1, None)


CRASHES_ON_RANK_1 = """
import os
import signal

import torch
import torch.nn as nn


class Crash(nn.Module):
    def forward(self, x):
        if os.environ.get("RANK") == "1":
            os.kill(os.getpid(), signal.SIGSEGV)  # a crash in native code, as a torch kernel's
        return x * 1.0


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), Crash()) for _ in range(4)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def build_model():
    return Model()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 8),)
"""


def test_smoke_names_a_rank_killed_by_a_signal_and_its_python_stack(tmp_path):
    """A rank that crashes in native code leaves no Python error: smoke names it from torchrun's root cause, and the
    ranks run with Python's fault handler, so its log shows the Python stack it crashed in (the model's line here)."""
    (tmp_path / "m.py").write_text(CRASHES_ON_RANK_1)
    plan = plan_two_stages(str(tmp_path / "m.py"), tmp_path / "plan", "torch", "--schedule", "1f1b", "--leaf", "Crash")
    r = runner.invoke(app, ["smoke", str(plan), "--steps", "1"])
    assert r.exit_code == 1, r.output
    check = next(c for c in json.loads((plan / "smoke.json").read_text())["checks"] if not c["ok"])
    assert "failing rank 1: killed by SIGSEGV without a Python error" in check["detail"], check["detail"]
    fault = check["detail"].split("--- rank 1 crashed in (Python's fault handler, innermost call first) ---\n")[1].splitlines()
    assert fault[0] == "Fatal Python error: Segmentation fault" and fault[1].strip().endswith('m.py", line 12 in forward'), fault


def test_reference_runs_with_the_ranks_thread_count(tmp_path):
    """The single-process reference runs with the ranks' torch thread count, then the caller's is restored."""
    (tmp_path / "m.py").write_text(
        "import torch\nimport torch.nn as nn\nSEEN = []\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])\n"
        "    def forward(self, x):\n        SEEN.append(torch.get_num_threads())\n"
        "        for l in self.layers:\n            x = l(x)\n        return x\n"
        "def build_model():\n    return M()\n"
        "def example_inputs(batch_size):\n    return (torch.randn(batch_size, 4),)\n"
    )
    d = tmp_path / "plan"
    r = runner.invoke(app, ["plan", str(tmp_path / "m.py"), "--gpus", "2xcpu", "--engine", "torch", "--pp", "2", "--out", str(d), "--quiet"])
    assert r.exit_code == 0, r.output
    from planner.solve.plan import load_plan

    small = load_plan(d)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        planned, ref = sm.reference_run(small, str(tmp_path / "m.py"), 1, 0, "cpu")
        forwards = small.layout.num_microbatches * small.layout.dp  # one step; earlier entries are the trace's
        seen = planned.model_file.module.SEEN
        assert len(seen) >= forwards and seen[-forwards:] == [sm.RANK_THREADS] * forwards and len(ref) == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(old)


def test_per_rank_record_drops_warm_up():
    rec = sm.per_rank_record({"rank": 3, "step_times_s": [2.0, 0.5, 0.4], "peak_memory_bytes": 10, "peak_reserved_bytes": 12})
    assert rec == {"rank": 3, "step_times_s": [0.5, 0.4], "peak_allocated_bytes": 10, "peak_reserved_bytes": 12}


def test_loss_of_an_output_without_floating_tensors_is_refused_by_name():
    """The default loss sums over the output's floating tensors; an output with none (token ids, a bool mask)
    has nothing to train on and is refused with what to add, not summed to the integer 0 that backward cannot use."""
    from pathlib import Path

    from planner.errors import UsageError
    from planner.model.load import ModelFile
    from planner.runtime import PlannedModel

    planned = PlannedModel(ModelFile(Path("m.py"), None, {}, ""), None, [0, 1], ["a"])  # type: ignore[arg-type]
    out = {"ids": torch.ones(2, 3, dtype=torch.long), "mask": torch.ones(2, dtype=torch.bool)}
    with pytest.raises(UsageError, match=r"no floating-point tensor to train on \(torch.bool tensor, torch.int64 tensor\).*loss_fn"):
        planned.loss(out, None)
    loss = planned.loss({"x": torch.full((2,), 3.0), "ids": out["ids"]}, None)
    assert isinstance(loss, torch.Tensor) and loss.item() == 10.0  # the mean of (3 - (-1))^2 = 16 and (3 - 1)^2 = 4
