"""Which blocks are transformer layers (planner.engines.base.repeated_layers): the repeated decoder blocks only, not a
final norm that is a custom module of the same container (nanoGPT's ``transformer.ln_f``, litgpt's). Checked against
the model files' own architecture() (Megatron's --num-layers) and the blocks' paths as the libraries name them."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.cli import app
from planner.engines.base import repeated_layers

MODELS = Path(__file__).resolve().parents[1] / "models"


@pytest.mark.parametrize(
    "blocks,layers",
    [
        # nanoGPT / litgpt: transformer.h.N and a custom final norm transformer.ln_f
        ([None, "transformer.h.0", "transformer.h.0", "transformer.h.1", "transformer.ln_f", None], 2),
        # torchtitan's Llama: layers is a ModuleDict of "0".."N-1"; its norm is torch's RMSNorm (no block)
        ([None, "layers.0", "layers.1", "layers.2", None], 3),
        # transformers: model.layers.N
        ([None, "model.layers.0", "model.layers.1", None], 2),
        # one layer and one final norm: the first parent wins the tie
        ([None, "transformer.h.0", "transformer.ln_f"], 1),
        # blocks with one parent stay blocks (a Sequential of custom stages)
        (["0", "1", "2", "3"], 4),
        ([None, None], 0),
    ],
)
def test_repeated_layers_are_the_blocks_of_the_parent_that_holds_most(blocks, layers):
    got = repeated_layers(blocks)
    assert len(got) == len(blocks)
    assert len({b for b in got if b}) == layers
    assert all(g is None or g == b for g, b in zip(got, blocks, strict=True))
    assert "transformer.ln_f" not in got


def test_nanogpt_plans_for_megatron_from_its_own_architecture(tmp_path):
    """nanoGPT's file (its own LayerNorm class for ln_1, ln_2 and ln_f) with architecture() num_layers = 4: the plan
    renders --num-layers 4, and no stage holds only the final norm (cuts lie between whole layers)."""
    import json

    out = tmp_path / "plan"
    r = CliRunner().invoke(
        app, ["plan", str(MODELS / "nanogpt_style.py"), "--gpus", "8xH100", "--engine", "megatron", "--pp", "4", "--out", str(out), "--quiet"]
    )
    assert r.exit_code == 0, r.output
    script = (out / "pretrain_gpt.sh").read_text()
    assert "--num-layers 4" in script
    doc = json.loads((out / "plan.json").read_text())
    layers = repeated_layers(doc["model"]["blocks"])
    for stage in doc["stages"]:
        a, b = stage["pieces"]
        assert {x for x in layers[a:b] if x}, stage  # every stage holds a layer
