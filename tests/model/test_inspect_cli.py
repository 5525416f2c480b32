"""`planner inspect`: the JSON it prints and the errors bad input gets (one paragraph, exit 2, no traceback)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from planner.cli import app

ROOT = Path(__file__).resolve().parents[2]
MODELS = Path(__file__).resolve().parents[1] / "models"
runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_inspect_json_has_the_layer_record_fields_in_execution_order():
    r = run("inspect", ROOT / "examples/gpt2.py", "--model-arg", "preset=gpt2-tiny", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert set(doc) >= {"layers", "cuts", "totals"}
    fields = {"name", "kind", "params", "param_bytes", "flops_fwd", "flops_bwd", "saved_bytes", "out_bytes"}
    assert all(fields <= set(l) for l in doc["layers"])
    assert [l["name"] for l in doc["layers"]][:3] == ["wte+wpe+drop", "h.0:attn", "h.0:mlp"]
    assert len(doc["cuts"]) == len(doc["layers"]) - 1
    assert doc["totals"]["params"] == sum(l["params"] for l in doc["layers"]) - doc["tied"][0]["params"]


def test_inspect_table_shows_every_piece():
    r = run("inspect", ROOT / "examples/llama.py", "--model-arg", "preset=llama-tiny")
    assert r.exit_code == 0, r.output
    for name in ("tok_embeddings", "layers.3:feed_forward", "norm", "output", "total"):
        assert name in r.stdout


def _error(r):
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    return r.output


def test_missing_file():
    out = _error(run("inspect", "no/such/model.py"))
    assert "does not exist" in out


def test_file_without_build_model():
    out = _error(run("inspect", MODELS / "no_build.py"))
    assert "does not define build_model()" in out and "examples/gpt2.py" in out


def test_build_model_raising_names_the_line():
    out = _error(run("inspect", MODELS / "raises.py"))
    assert "build_model() raised RuntimeError: weights file not found" in out
    assert "raises.py line 5" in out


def test_forward_failing_on_its_own_arguments_is_not_called_a_tracing_or_meta_problem():
    """fx traces the model; running the graph fails in the model's own call (view(None)): the error says so, names the
    call, and gives neither the meta-device advice nor the torch.where one."""
    out = _error(run("inspect", MODELS / "badarg.py"))
    assert "The model's forward() raised TypeError at its call view()" in out
    assert "not in tracing or the meta device" in out and "--model-arg" in out
    assert "device=x.device" not in out and "torch.where" not in out
    assert run("inspect", MODELS / "badarg.py", "--model-arg", "k=(-1,)").exit_code == 0


def test_forward_failing_under_both_tracers_and_a_plain_run_names_the_line():
    """fx fails on a root-level shape branch, torch.export on topk(k=None); a plain run fails at the same line, so the
    error is the model's (file and line), not the tracers', and suggests no tracer option."""
    out = _error(run("inspect", MODELS / "badarg_root.py"))
    assert "raises TypeError when run as is, before any tracing" in out
    assert "topk(): argument 'k' must be int, not NoneType" in out and "badarg_root.py line 19" in out
    assert "neither tracer nor --leaf can help" in out and "torch.where" not in out
    assert run("inspect", MODELS / "badarg_root.py", "--model-arg", "k=2").exit_code == 0


def test_unknown_model_arg_lists_the_accepted_ones():
    out = _error(run("inspect", ROOT / "examples/gpt2.py", "--model-arg", "presett=gpt2"))
    assert "does not accept --model-arg presett" in out
    assert "'preset'" in out  # did you mean
    assert "Accepted: attention, dropout, n_embd" in out


def test_shapes_that_do_not_agree_are_the_model_code_not_the_meta_device():
    out = _error(run("inspect", ROOT / "examples/gpt2.py", "--model-arg", "n_head=5"))  # 768 is not divisible by 5
    assert "forward() raised RuntimeError in module h.0.attn (CausalSelfAttention) at gpt2.py line" in out
    assert "is invalid for input of size 786432" in out
    assert "meta device" not in out.replace("not in tracing or the meta device", "")
    assert "torch.device('meta')" not in out


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_tensor_made_on_the_cpu_gets_the_device_advice(tracer):
    out = _error(run("inspect", MODELS / "cpu_tensor.py", "--tracer", tracer))
    assert "device=x.device" in out
    assert "torch.where" not in out and "not in tracing or the meta device" not in out


def test_a_parameter_a_factory_made_on_the_cpu_is_planned_on_meta_with_a_note():
    """torch.normal(mean, std, size=...) ignores the meta device context (DiffLlama's lambda vectors): the tensor is
    moved to meta and said in the notes; the model was refused before."""
    with torch.device("meta"):
        assert torch.normal(0, 0.1, size=(2,)).device.type == "cpu"  # the premise: this factory ignores the context
    r = run("inspect", MODELS / "normal_init.py", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["totals"]["params"] == 2 * (8 * 8 + 8) + 8
    assert any("created 1 tensor(s) of 32 bytes outside the meta device (e.g. 'gain' on cpu)" in n for n in doc["notes"])


def test_a_model_with_no_trainable_parameters_is_refused():
    out = _error(run("inspect", ROOT / "examples/gpt2.py", "--model-arg", "n_embd=0", "--model-arg", "n_head=1"))
    assert "the model built has no trainable parameters (0 parameters in all)" in out
    assert "--model-arg" in out


def test_a_failure_with_a_parameter_of_no_elements_names_the_parameter(tmp_path):
    """An hf config with vocab_size 0 builds an embedding of shape [0, 64] and fails while costing: the message names the
    empty parameter and says a size is 0, not that the planner may have a bug."""
    cfg = json.loads((MODELS / "hf" / "llama.json").read_text())
    cfg["vocab_size"] = 0
    cfg["bos_token_id"] = cfg["eos_token_id"] = None
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    out = _error(run("inspect", f"hf:{path}"))
    assert "parameter(s) with no elements, e.g. 'model.embed_tokens.weight' of shape [0, 64]" in out
    assert "is 0" in out and "planner bug" not in out


def test_an_hf_layer_count_override_rebuilds_the_fields_the_config_derives_from_it():
    """Qwen2Config derives layer_types from num_hidden_layers when it is built: --model-arg num_hidden_layers=4 on a
    2-layer config builds 4 layers (set after the build, it left 2 layer types and the model failed at layer 2)."""
    r = run("inspect", f"hf:{MODELS / 'hf' / 'qwen2.json'}", "--model-arg", "num_hidden_layers=4", "--json")
    assert r.exit_code == 0, r.output
    blocks = sorted({l["block"] for l in json.loads(r.stdout)["layers"] if l.get("block")})
    assert blocks == [f"model.layers.{i}" for i in range(4)]


def test_an_hf_override_transformers_refuses_is_reported_as_its_check():
    out = _error(run("inspect", f"hf:{MODELS / 'hf' / 'llama.json'}", "--model-arg", "num_attention_heads=3"))
    assert "transformers refuses this llama config with --model-arg num_attention_heads=3: ValueError: The hidden size (64)" in out
    assert "planner bug" not in out


def test_empty_example_inputs_are_refused():
    out = _error(run("inspect", ROOT / "examples/gpt2.py", "--model-arg", "seq_len=0"))
    assert "returns an empty tensor (input 0, shape (1, 0))" in out
    assert "--model-arg" in out


def test_shape_dependent_branch_in_a_block_is_kept_whole():
    """A block whose forward branches on a shape cannot be traced inside: it becomes one piece, with a note."""
    r = run("inspect", MODELS / "shapebranch.py", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert [l["name"] for l in doc["layers"]] == ["blocks.0", "blocks.1"]
    assert any("Gate" in n and "shapebranch.py line 12" in n for n in doc["notes"])


def test_value_dependent_branch_in_a_block_names_module_and_line():
    out = _error(run("inspect", MODELS / "branchy.py"))
    assert "blocks.0 (Gate)" in out and "branchy.py line 12" in out and "if x.sum() > 0" in out
    assert "torch.where" in out


def test_data_dependent_control_flow_at_the_root_names_module_and_line():
    out = _error(run("inspect", MODELS / "rootbranch.py"))
    assert "rootbranch.py line 14" in out and "if x.mean() > 0" in out
    # both tracers were tried: each one's cause is given, and --tracer export is not suggested again
    assert "torch.fx:" in out and "torch.export:" in out
    assert "--tracer export" not in out and "--leaf" in out


def test_fx_only_tracer_reports_the_module():
    out = _error(run("inspect", MODELS / "rootbranch.py", "--tracer", "fx"))
    assert "(Net)" in out and "rootbranch.py line 14" in out


def test_fx_failure_falls_back_to_torch_export():
    """A root-level shape branch defeats fx; torch.export traces it, and the note says so."""
    r = run("inspect", MODELS / "shaperoot.py", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["totals"]["tracer"] == "export"
    assert [l["name"] for l in doc["layers"]] == ["layers.0", "layers.1", "layers.2"]
    assert any("torch.export" in n for n in doc["notes"])
    assert all(l["flops_fwd"] == 2 * 8 * 8 for l in doc["layers"])


def test_export_tracer_costs_match_fx():
    """Both tracers split gpt2-tiny into the same pieces with the same FLOPs and saved bytes."""
    docs = []
    for tracer in ("fx", "export"):
        r = run("inspect", ROOT / "examples/gpt2.py", "--model-arg", "preset=gpt2-tiny", "--tracer", tracer, "--json")
        assert r.exit_code == 0, r.output
        docs.append(json.loads(r.stdout))
    fx, ex = docs
    # the same pieces; export folds the position lookup (it depends on no input) into whichever piece reads it
    assert [l["name"] for l in fx["layers"]][1:] == [l["name"] for l in ex["layers"]][1:]
    for a, b in zip(fx["layers"], ex["layers"]):
        assert a["flops_fwd"] == b["flops_fwd"] and a["flops_bwd"] == b["flops_bwd"]
        assert a["saved_bytes"] == pytest.approx(b["saved_bytes"], rel=0.02)
    assert [c["bytes"] for c in fx["cuts"]] == [c["bytes"] for c in ex["cuts"]]


def test_export_fallback_traces_kwargs_forward(tmp_path):
    """A forward(**kwargs) model that fx cannot trace goes through torch.export automatically."""
    f = tmp_path / "kw.py"
    f.write_text(
        "import torch\nimport torch.nn as nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])\n"
        "    def forward(self, x, **kwargs):\n        for l in self.layers:\n            x = l(x)\n        return x\n"
        "def build_model():\n    return Net()\n"
        "def example_inputs(batch_size):\n    return (torch.randn(batch_size, 8),)\n"
    )
    r = run("inspect", f, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["totals"]["tracer"] in ("fx", "export")
    assert len(doc["layers"]) == 3


def test_console_script_is_installed():
    out = subprocess.run([sys.executable, "-m", "planner", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "inspect" in out.stdout and "plan" in out.stdout


def test_a_library_whose_own_import_fails_is_reported_as_a_broken_install(tmp_path, monkeypatch):
    """An installed timm that raises while importing (as with compiled ops built for another torch) is named, with
    the torch version and the reinstall command, not reported as a possible planner bug."""
    import sys

    pkg = tmp_path / "timm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "timm", raising=False)
    out = _error(run("inspect", "timm:resnet18"))
    assert "needs timm, which is installed but fails to import here (RuntimeError: operator torchvision::nms does not exist)" in out
    assert "pip install timm torchvision" in out and "planner bug" not in out


def test_export_records_no_stack_traces():
    """torch.export's per-node stack traces took a fifth of a long trace (HF Mamba: 27 s -> 21 s) and nothing reads
    them: the planner's export graph carries none, the same nodes as with them, and torch's setting is put back."""
    import torch.fx.config as fx_config

    from planner.model.trace import _export_trace

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    x = (torch.randn(2, 4),)
    gm = _export_trace(net, x)
    assert fx_config.do_not_emit_stack_traces is False
    assert not any(n.meta.get("stack_trace") for n in gm.graph.nodes)
    with_traces = torch.export.export(net, x, strict=False).module()
    assert any(n.meta.get("stack_trace") for n in with_traces.graph.nodes)  # what torch records unless told not to
    assert [(n.op, str(n.target)) for n in gm.graph.nodes if n.op != "call_module"] == [
        (n.op, str(n.target)) for n in with_traces.graph.nodes if n.op != "call_module"
    ]


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_idle_modules_are_the_modules_no_graph_node_reads(tracer):
    """The modules whose parameters the traced graph never reads, largest first in module order (not their children):
    torch.export's graph fetches every parameter, so only fetches with users count."""
    from planner.model.trace import build_layer_graph, idle_modules

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used = torch.nn.Linear(4, 4)
            self.tower = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
            self.proj = torch.nn.Linear(4, 3, bias=False)

        def forward(self, x, image=None):
            return self.used(x) if image is None else self.proj(self.tower(image))

    with torch.device("meta"):
        net = Net()
    x, x2 = torch.randn(2, 4, device="meta"), torch.randn(4, 4, device="meta")
    lg = build_layer_graph(net, (x,), (x2,), tracer=tracer)
    assert idle_modules(net, lg.gm) == [("tower", 4 * 8 + 8 + 8 * 4 + 4), ("proj", 12)]
