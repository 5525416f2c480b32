"""`planner smoke`: the CI path (plan -> render -> smoke on CPU) and deliberately broken plans.

Each run launches real processes with torchrun and gloo (15-25 s each on 2 cores).
"""

import json
import math
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from planner.cli import app

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def plan_dir(tmp_path: Path, engine: str, gpus: str, *pins: str) -> Path:
    out = tmp_path / f"plan-{engine}"
    r = runner.invoke(
        app,
        ["plan", str(ROOT / "examples/gpt2.py"), "--model-arg", "preset=gpt2-tiny", "--gpus", gpus, "--engine", engine, "--out", str(out), "--quiet", *pins],
    )
    assert r.exit_code == 0, r.output
    return out


def smoke(d: Path, *args: str):
    r = runner.invoke(app, ["smoke", str(d), "--steps", "2", *args])
    doc = json.loads((d / "smoke.json").read_text()) if (d / "smoke.json").is_file() else None
    return r, doc


def test_deepspeed_pipe2_x_data2_matches_single_process(tmp_path):
    d = plan_dir(tmp_path, "deepspeed", "4xcpu", "--pp", "2", "--dp", "2")
    r, doc = smoke(d)
    assert r.exit_code == 0, r.output
    assert doc["ok"] and doc["ranks"] == 4 and doc["layout"]["pp"] == 2 and doc["layout"]["dp"] == 2
    assert doc["max_relative_difference"] <= 1e-5
    assert len(doc["losses"]) == 2 and doc["losses"] == pytest.approx(doc["reference_losses"], rel=1e-5)


def test_scale_down_is_explicit_and_recorded(tmp_path):
    """A plan for more ranks than allowed runs with fewer data-parallel replicas, and says so."""
    d = plan_dir(tmp_path, "deepspeed", "4xcpu", "--pp", "2", "--dp", "2")
    r, doc = smoke(d, "--ranks", "2")
    assert r.exit_code == 0, r.output
    assert doc["ranks"] == 2 and doc["layout"]["dp"] == 1 and doc["layout"]["pp"] == 2
    assert any("data-parallel replicas 2 -> 1" in n for n in doc["scale_down"])
    assert "data-parallel replicas 2 -> 1" in r.output


UPCAST_NORM_MODEL = """
import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        h = x.to(torch.float32)  # Llama's norm: fp32 inside, whatever the model's dtype
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = RMSNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(self.norm(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(32) for _ in range(4)])
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build_model():
    return Net()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 32),)
"""


def test_scaled_down_bf16_plan_keeps_its_stage_boundaries(tmp_path):
    """issue: a bf16 plan for GPUs (an HF Llama or SmolLM3 on 8 A100) with more data-parallel replicas than the smoke's
    ranks was re-planned in fp32, whose trace has more pieces (the norm's fp32 upcast splits only an fp32 trace), so the
    plan's pinned stage boundaries failed: "stage boundaries [0, 5, 9, 14, 19] do not split 27 pieces". The scaled plan
    is traced in the plan's dtype, as the committed scripts are, and its ranks run in fp32."""
    m = tmp_path / "m.py"
    m.write_text(UPCAST_NORM_MODEL)
    pieces = {}
    for dtype in ("bf16", "fp32"):
        r = runner.invoke(app, ["inspect", str(m), "--dtype", dtype, "--tracer", "export", "--json"])
        assert r.exit_code == 0, r.output
        pieces[dtype] = len(json.loads(r.stdout)["layers"])
    assert pieces["fp32"] > pieces["bf16"]  # the premise: the two traces cut differently (as HF's export graphs do)
    d = tmp_path / "plan"
    pins = ["--pp", "2", "--dp", "4", "--schedule", "1f1b", "--engine", "torch", "--tracer", "export"]
    r = runner.invoke(app, ["plan", str(m), "--gpus", "8xA100", "--out", str(d), "--quiet", *pins])
    assert r.exit_code == 0, r.output
    r, doc = smoke(d, "--ranks", "2")
    assert r.exit_code == 0, r.output
    assert (doc["layout"]["pp"], doc["layout"]["dp"]) == (2, 1)
    assert any("precision bf16 -> fp32" in n for n in doc["scale_down"])
    assert doc["max_relative_difference"] <= 1e-5


def test_export_pieces_hold_operations_and_a_weightless_stage_trains(tmp_path):
    """issue: torch.export's dtype check of a norm's ``.to(float32)`` (no users, no computation) made a piece of its
    own (every HF Llama layer had two: "input_layernorm" and "post_attention_layernorm", with 0 FLOPs and 0 parameters,
    the norms running in the next piece). A bf16 trace now has no such piece. A stage can still hold no weights (an fp32
    trace cuts a norm between its statistics and its weight): the torch scripts ran AdamW over no parameters and
    failed ("optimizer got an empty parameter list"); such a rank now has nothing to step, and trains."""
    m = tmp_path / "m.py"
    m.write_text(UPCAST_NORM_MODEL)
    r = runner.invoke(app, ["inspect", str(m), "--dtype", "bf16", "--tracer", "export", "--json"])
    layers = json.loads(r.stdout)["layers"]
    assert [l["name"] for l in layers] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    assert all(l["flops_fwd"] > 0 for l in layers)
    d = tmp_path / "plan"
    pins = ["--pp", "2", "--schedule", "1f1b", "--engine", "torch", "--tracer", "export", "--dtype", "fp32"]
    r = runner.invoke(app, ["plan", str(m), "--gpus", "2xA100", "--out", str(d), "--quiet", *pins])
    assert r.exit_code == 0, r.output
    stages = json.loads((d / "plan.json").read_text())["stages"]
    assert stages[0]["params"] == 0, stages  # the premise: the split puts the first norm's statistics alone on rank 0
    r, doc = smoke(d)
    assert r.exit_code == 0, r.output
    assert doc["max_relative_difference"] <= 1e-5


def _inject(d: Path, script: str, code: str) -> None:
    """Insert ``code`` into a rendered training script right after its imports (a deliberately broken plan)."""
    path = d / script
    text = path.read_text()
    marker = "\nimport "
    i = text.index(marker)
    path.write_text(text[:i] + "\nimport os as _o, time as _t\n" + code + "\n" + text[i:])


def test_crashing_rank_is_named_with_its_log(tmp_path):
    d = plan_dir(tmp_path, "deepspeed", "2xcpu", "--pp", "2")
    _inject(d, "train_deepspeed.py", "if _o.environ.get('RANK') == '1':\n    raise RuntimeError('injected failure on rank 1')")
    r, doc = smoke(d)
    assert r.exit_code == 1
    check = doc["checks"][0]
    assert not check["ok"] and "failing rank 1: RuntimeError: injected failure on rank 1" in check["detail"]


def test_hanging_rank_times_out_and_nothing_is_left_running(tmp_path):
    d = plan_dir(tmp_path, "deepspeed", "2xcpu", "--pp", "2")
    _inject(d, "train_deepspeed.py", "if _o.environ.get('RANK') == '1':\n    _o.environ['PLANNER_HANG'] = '1'\n    _t.sleep(3600)")
    r, doc = smoke(d, "--timeout", "25")
    assert r.exit_code == 1
    check = doc["checks"][0]
    assert not check["ok"] and "no result within 25 s" in check["detail"] and "process group killed" in check["detail"]
    assert "some processes survived" not in check["detail"]
    # no worker of this run is left: none has the run's plan directory as its working directory
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cwd = os.readlink(proc / "cwd")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        assert not (cwd == str(d) and state not in ("Z", "X")), f"process {proc.name} still runs in {d}"


def test_edited_stage_boundary_is_refused(tmp_path):
    """plan.json edited after rendering: the scripts refuse to train a split they were not rendered for."""
    d = plan_dir(tmp_path, "deepspeed", "2xcpu", "--pp", "2")
    plan = json.loads((d / "plan.json").read_text())
    cut = plan["stages"][0]["pieces"][1]
    plan["stages"][0]["pieces"][1] = cut + 1
    plan["stages"][1]["pieces"][0] = cut + 1
    (d / "plan.json").write_text(json.dumps(plan))
    r, doc = smoke(d)
    assert r.exit_code == 1
    detail = doc["checks"][0]["detail"]
    assert not doc["checks"][0]["ok"] and ("plan.json" in detail or "stage" in detail)


def test_megatron_smoke_checks_flags_without_training(tmp_path):
    out = tmp_path / "meg"
    r = runner.invoke(
        app,
        [
            "plan",
            str(ROOT / "examples/llama.py"),
            "--model-arg",
            "preset=llama-tiny",
            "--gpus",
            "4xA100",
            "--engine",
            "megatron",
            "--out",
            str(out),
            "--quiet",
            "--micro-batch",
            "1",
        ],
    )
    assert r.exit_code == 0, r.output
    r, doc = smoke(out, "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert doc["trained"] is False
    names = [c["name"] for c in doc["checks"]]
    assert "flags pass Megatron's argument rules" in names and "megatron-core TransformerConfig accepts the flags" in names
    assert "no training was run" in r.output


@pytest.mark.parametrize("pins", [("--schedule", "zbv"), ("--schedule", "interleaved", "--vp", "2")], ids=["zbv", "interleaved"])
def test_torch_two_ranks_matches_single_process(tmp_path, pins):
    d = plan_dir(tmp_path, "torch", "2xcpu", "--pp", "2", *pins)
    r, doc = smoke(d)
    assert r.exit_code == 0, r.output
    assert doc["ok"] and doc["layout"]["schedule"] == pins[1] and doc["ranks"] == 2
    assert doc["max_relative_difference"] <= 1e-5


def test_model_traced_with_torch_export_trains_in_a_pipeline(tmp_path):
    """A model only torch.export can trace (a root-level shape branch) runs pipelined and matches one process."""
    out = tmp_path / "export"
    r = runner.invoke(
        app, ["plan", str(Path(__file__).parents[1] / "models/shaperoot.py"), "--gpus", "2xcpu", "--engine", "torch", "--pp", "2", "--out", str(out), "--quiet"]
    )
    assert r.exit_code == 0, r.output
    assert json.loads((out / "plan.json").read_text())["inputs"]["tracer_used"] == "export"
    r, doc = smoke(out)
    assert r.exit_code == 0, r.output
    assert doc["max_relative_difference"] <= 1e-5


# ----------------------------------------------------------------------------- transformers models as users build them

HF_RUNS = [
    pytest.param("hf_gpt2.py", "torch", id="gpt2-torch"),
    pytest.param("hf_llama.py", "deepspeed", id="llama-deepspeed"),
    pytest.param("hf_gpt2.py", "deepspeed", id="gpt2-deepspeed", marks=pytest.mark.slow),
    pytest.param("hf_llama.py", "torch", id="llama-torch", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("model, engine", HF_RUNS)
def test_transformers_model_trains_pipelined_like_one_process(tmp_path, model, engine):
    """A tiny transformers GPT-2 / Llama (export-traced, ModelOutput returned) on 2 CPU ranks equals one process."""
    pytest.importorskip("transformers")
    out = tmp_path / "plan"
    r = runner.invoke(
        app, ["plan", str(Path(__file__).parents[1] / "models" / model), "--gpus", "2xcpu", "--engine", engine, "--pp", "2", "--out", str(out), "--quiet"]
    )
    assert r.exit_code == 0, r.output
    assert json.loads((out / "plan.json").read_text())["inputs"]["tracer_used"] == "export"
    r, doc = smoke(out)
    assert r.exit_code == 0, r.output
    assert doc["ok"] and doc["ranks"] == 2 and doc["max_relative_difference"] <= 1e-5
    assert len(doc["losses"]) == 2 and all(math.isfinite(x) for x in doc["losses"])
    # measurements for calibration: one record per rank, the warm-up step left out
    assert [p["rank"] for p in doc["per_rank"]] == [0, 1]
    assert all(len(p["step_times_s"]) == 1 and p["step_times_s"][0] > 0 for p in doc["per_rank"])
    assert all(p["peak_allocated_bytes"] is None and p["peak_reserved_bytes"] is None for p in doc["per_rank"])  # CPU
    env = doc["environment"]
    assert env["world_size"] == 2 and env["device_name"] == "cpu" and env["torch"] == torch.__version__
    if engine == "deepspeed":
        import deepspeed

        assert env["deepspeed"] == deepspeed.__version__
