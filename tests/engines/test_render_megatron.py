"""The Megatron-LM renderer: pretrain_gpt.sh, launch_slurm.sh and README.md from a plan.

Fixture plans (tests/fixtures/megatron/*.json, made by regenerate.py with `planner plan`):
llama-7b (tp 2, dp 8), llama-70b (pp 8, tp 8, 2 virtual stages), gpt2-xl (pp 4, interleaved,
uneven: a --pipeline-model-parallel-layout), gpt3-175b (pp 8, tp 8). The rendered flags are fed
to megatron-core's TransformerConfig and get_num_layers_to_build, and to our own rule checks.
"""

from __future__ import annotations

import copy
import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from planner.engines.megatron.architecture import check_megatron_args, stage_layers
from planner.engines.megatron.render import flag_groups, padded_vocab, planned_stage_layers, render, vocab_flags
from planner.engines.megatron.script import parse_megatron_args
from planner.errors import UsageError
from planner.solve.plan import Plan

FIXTURES = Path(__file__).parents[1] / "fixtures" / "megatron"
NAMES = ("llama7b", "llama70b_vp2", "gpt2xl_pp4", "gpt3_175b")
GOLDEN_COMMAND = "planner plan MODEL --engine megatron --out DIR"
REPO = Path(__file__).resolve().parents[2]


def _helpers():
    """megatron-core's view of the flags (planner.engines.megatron.core_check)."""
    from types import SimpleNamespace

    from planner.engines.megatron.core_check import core_config, core_stage_layers

    return SimpleNamespace(_core_config=core_config, _core_stage_layers=core_stage_layers)


def load(name: str) -> Plan:
    return Plan.from_dict(json.loads((FIXTURES / f"{name}.json").read_text()))


def restage(plan: Plan, counts: list[int]) -> Plan:
    """A copy of ``plan`` whose stages hold ``counts`` transformer layers each (same pp; vp = len(counts) / pp)."""
    d = plan.to_dict()
    blocks = d["model"]["blocks"]
    n = len(blocks)
    layer_start = {}
    for i, b in enumerate(blocks):
        if b is not None and b not in layer_start:
            layer_start[b] = i
    starts = list(layer_start.values())
    bounds, k = [0], 0
    for c in counts[:-1]:
        k += c
        bounds.append(starts[k])
    bounds.append(n)
    template = d["stages"][0]
    pp = d["layout"]["pp"]
    d["stages"] = [
        dict(template, index=j, rank=j % pp, pieces=[a, b], layers=[d["model"]["pieces"][a], d["model"]["pieces"][b - 1]])
        for j, (a, b) in enumerate(zip(bounds, bounds[1:]))
    ]
    d["layout"]["vp"] = len(counts) // pp
    return Plan.from_dict(d)


# --------------------------------------------------------------------------- golden files, determinism


#: one golden directory for the engine (interleaved, tensor parallel, an uneven layout string): the other fixture
#: plans are checked by meaning (Megatron's own validation, stage split, flags) rather than frozen bytes
GOLDEN_NAMES = ("llama70b_vp2",)


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_golden_files(name):
    files = render(load(name), GOLDEN_COMMAND, None)
    golden = FIXTURES / "golden" / name
    assert sorted(files) == sorted(p.name for p in golden.iterdir())
    for rel, text in files.items():
        assert text == (golden / rel).read_text(), f"{name}/{rel} differs from the golden file (regenerate.py --golden after a deliberate change)"


def test_deterministic():
    plan = load("llama70b_vp2")
    a = render(plan, GOLDEN_COMMAND, None)
    b = render(Plan.from_dict(json.loads(json.dumps(plan.to_dict()))), GOLDEN_COMMAND, Path("/somewhere/else"))
    assert a == b
    for text in a.values():
        assert str(REPO) not in text and "/tmp" not in text


# --------------------------------------------------------------------------- the flags Megatron receives


@pytest.mark.parametrize("name", NAMES)
def test_rendered_flags_pass_our_rules_and_build_the_planned_split(name):
    plan = load(name)
    script = render(plan, GOLDEN_COMMAND, None)["pretrain_gpt.sh"]
    args = parse_megatron_args(script, "script")
    lay = plan.layout
    assert args.world_size == lay.pp * lay.tp * lay.dp
    assert check_megatron_args(args) == []
    assert stage_layers(args) == planned_stage_layers(plan)
    assert args.int("--micro-batch-size") == lay.micro_batch and args.int("--global-batch-size") == lay.global_batch
    assert args.int("--tensor-model-parallel-size") == lay.tp and args.int("--pipeline-model-parallel-size") == lay.pp
    assert (args.env_value("CUDA_DEVICE_MAX_CONNECTIONS") == "1") == (lay.tp > 1)
    assert args.has("--sequence-parallel") == (lay.tp > 1)
    assert args.has("--use-distributed-optimizer") == (lay.zero >= 1)


@pytest.mark.parametrize("name", NAMES)
def test_the_checked_flag_list_is_what_bash_passes(name):
    """The renderer checks its flag list (data); bash running pretrain_gpt.sh passes exactly that list, with that world and environment."""
    from planner.engines.megatron.render import _context, rendered_args

    plan = load(name)
    data = rendered_args(_context(plan, GOLDEN_COMMAND))
    ran = parse_megatron_args(render(plan, GOLDEN_COMMAND, None)["pretrain_gpt.sh"], "script")
    assert ran.stopped is None and ran.argv() == data.argv()
    assert ran.world_size == data.world_size and ran.env_value("CUDA_DEVICE_MAX_CONNECTIONS") == data.env_value("CUDA_DEVICE_MAX_CONNECTIONS")
    assert check_megatron_args(data, data.world_size) == check_megatron_args(ran)


@pytest.mark.parametrize("name", NAMES)
def test_transformer_config_accepts_rendered_flags(name):
    """megatron-core 0.16.1's TransformerConfig, built as Megatron-LM's arguments.py builds it, accepts the flags
    and its get_num_layers_to_build places the planned number of layers on every (virtual) stage."""
    h = _helpers()
    plan = load(name)
    args = parse_megatron_args(render(plan, GOLDEN_COMMAND, None)["pretrain_gpt.sh"])
    cfg = h._core_config(args)
    arch = plan.model["architecture"]
    assert cfg.num_layers == arch["num_layers"] and cfg.hidden_size == arch["hidden_size"]
    assert cfg.num_attention_heads == arch["num_attention_heads"] and cfg.ffn_hidden_size == arch["ffn_hidden_size"]
    assert cfg.num_query_groups == arch["num_query_groups"]
    assert cfg.gated_linear_unit == (arch["activation"] == "swiglu")
    assert cfg.add_bias_linear == arch["bias"] and cfg.normalization == arch["normalization"]
    assert cfg.hidden_dropout == arch["dropout"] and cfg.attention_dropout == arch["dropout"]
    assert (cfg.virtual_pipeline_model_parallel_size or 1) == plan.layout.vp
    assert cfg.sequence_parallel == (plan.layout.tp > 1)
    assert h._core_stage_layers(cfg) == planned_stage_layers(plan)


def test_model_mapping_llama_and_gpt():
    llama = dict(flag_groups(load("llama70b_vp2"))["GPT_MODEL_ARGS"])
    assert llama["--normalization"] == "RMSNorm" and llama["--position-embedding-type"] == "rope"
    assert "--swiglu" in llama and "--untie-embeddings-and-output-weights" in llama and "--disable-bias-linear" in llama
    assert "--group-query-attention" in llama and llama["--num-query-groups"] == "8" and llama["--ffn-hidden-size"] == "28672"
    assert llama["--hidden-dropout"] == "0.0"
    gpt = dict(flag_groups(load("gpt3_175b"))["GPT_MODEL_ARGS"])
    assert gpt["--normalization"] == "LayerNorm" and gpt["--position-embedding-type"] == "learned_absolute"
    for absent in ("--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--group-query-attention"):
        assert absent not in gpt
    assert gpt["--attention-dropout"] == "0.1" and gpt["--max-position-embeddings"] == "2048"


def test_split_forms():
    groups = dict(flag_groups(load("gpt2xl_pp4"))["MODEL_PARALLEL_ARGS"])
    layout = groups["--pipeline-model-parallel-layout"]
    assert layout.startswith("E") and layout.endswith("L")
    assert dict(flag_groups(load("llama70b_vp2"))["MODEL_PARALLEL_ARGS"])["--num-virtual-stages-per-pipeline-rank"] == "2"
    even = dict(flag_groups(load("gpt3_175b"))["MODEL_PARALLEL_ARGS"])
    assert not any(k.startswith(("--decoder-", "--pipeline-model-parallel-layout", "--num-virtual")) for k in even)
    uneven = restage(load("gpt3_175b"), [11, 12, 12, 12, 12, 12, 12, 13])
    flags = dict(flag_groups(uneven)["MODEL_PARALLEL_ARGS"])
    assert flags["--decoder-first-pipeline-num-layers"] == "11" and flags["--decoder-last-pipeline-num-layers"] == "13"
    files = render(uneven, GOLDEN_COMMAND, None)
    assert stage_layers(parse_megatron_args(files["pretrain_gpt.sh"])) == [11, 12, 12, 12, 12, 12, 12, 13]
    h = _helpers()
    assert h._core_stage_layers(h._core_config(parse_megatron_args(files["pretrain_gpt.sh"]))) == [11, 12, 12, 12, 12, 12, 12, 13]


def test_recompute_zero_and_precision_flags():
    base = load("gpt2xl_pp4").to_dict()
    for recompute, want in (("none", []), ("selective", ["selective"]), ("full", ["full", "uniform", "1"])):
        d = copy.deepcopy(base)
        d["layout"]["recompute"] = recompute
        d["layout"]["zero"] = 0
        d["layout"]["dp"] = 1
        d["layout"]["global_batch"] = 16
        d["layout"]["num_microbatches"] = 8
        d["layout"]["overlap_grad_reduce"] = False  # a layout field: nothing to overlap without a data-parallel group
        d["model"]["dtype"] = "fp16"
        args = parse_megatron_args(render(Plan.from_dict(d), "c", None)["pretrain_gpt.sh"])
        got = [v for n in ("--recompute-granularity", "--recompute-method", "--recompute-num-layers") for v in ([args.value(n)] if args.has(n) else [])]
        assert got == want
        assert args.has("--fp16") and not args.has("--bf16")
        assert not args.has("--use-distributed-optimizer") and not args.has("--overlap-grad-reduce")
        assert check_megatron_args(args, 4) == []


def test_vocab_is_exact_when_tp_divides_it():
    for vocab, tp in ((32000, 8), (50257, 1), (51200, 8), (128256, 4), (256, 2)):
        arg, d = vocab_flags(vocab, tp)
        assert padded_vocab(arg + 1, tp, d) == vocab  # NullTokenizer: --vocab-size + 1 ids
        assert 1 <= d <= 128
    arg, d = vocab_flags(50257, 8)
    assert d == 128 and padded_vocab(arg + 1, 8, d) == 51200


# --------------------------------------------------------------------------- what does not map


def _plan_with(name: str, **arch_changes) -> Plan:
    d = load(name).to_dict()
    d["model"]["architecture"] = dict(d["model"]["architecture"], **arch_changes) if arch_changes else None
    return Plan.from_dict(d)


def test_model_without_architecture_is_a_usage_error():
    with pytest.raises(UsageError, match=r"architecture\(\)"):
        render(_plan_with("llama7b"), "c", None)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"activation": "relu"}, "activation 'relu'"),
        ({"normalization": "BatchNorm"}, "normalization 'BatchNorm'"),
        ({"position_embedding": "alibi"}, "position embedding 'alibi'"),
        ({"num_query_groups": 7}, "query groups"),
    ],
)
def test_architecture_that_does_not_map(change, words):
    with pytest.raises(UsageError, match="does not map") as e:
        render(_plan_with("llama70b_vp2", **change), "c", None)
    assert words in str(e.value)


def test_stage_boundary_inside_a_layer_is_refused():
    d = load("gpt3_175b").to_dict()
    d["stages"][0]["pieces"][1] += 1  # stage 1 now starts at an MLP piece
    d["stages"][1]["pieces"][0] += 1
    with pytest.raises(UsageError, match="inside transformer layer 'h.12'"):
        render(Plan.from_dict(d), "c", None)


def test_cut_between_final_norm_and_head_is_refused():
    d = load("gpt3_175b").to_dict()
    n = len(d["model"]["blocks"])  # ... h.95:mlp, ln_f, lm_head
    d["stages"][-1]["pieces"][1] = n - 1
    d["stages"].append(dict(d["stages"][-1], index=8, pieces=[n - 1, n]))
    d["layout"]["pp"] = 9
    with pytest.raises(UsageError, match="final norm, output layer and loss on the last"):
        render(Plan.from_dict(d), "c", None)


def test_piece_between_layers_is_refused():
    d = load("gpt3_175b").to_dict()
    d["model"]["blocks"][5] = None
    with pytest.raises(UsageError, match="sits between transformer layers"):
        render(Plan.from_dict(d), "c", None)


def test_plan_megatron_would_refuse_is_a_usage_error():
    d = load("gpt3_175b").to_dict()
    d["model"]["architecture"].update(num_attention_heads=100, num_query_groups=100)  # 100 heads over tp = 8
    d["model"]["architecture"]["hidden_size"] = 12300
    with pytest.raises(UsageError, match="MEG013"):
        render(Plan.from_dict(d), "c", None)


def test_live_plan_renders(tmp_path):
    """The solver's current output for a small Llama on 8 GPUs (pp 2, tp 2) renders and passes the rules."""
    from planner.planning import plan_model
    from planner.solve.settings import Settings

    plan, _, _ = plan_model(
        Settings.of(model_file=str(REPO / "examples" / "llama.py"), model_args={"preset": "llama-tiny"}, gpus="8xA100", engine="megatron", pp=2, tp=2)
    )
    args = parse_megatron_args(render(plan, "c", tmp_path)["pretrain_gpt.sh"])
    assert check_megatron_args(args) == [] and args.world_size == 8
    assert stage_layers(args) == planned_stage_layers(plan)


# --------------------------------------------------------------------------- shell safety

HOSTILE = 'my model\'s "dir"/$(touch pwned)/`touch pwned2`/model.py'

FAKE_TORCHRUN = """#!{python}
import json, os, sys
with open(os.environ["FAKE_OUT"], "w") as f:
    json.dump({{"argv": sys.argv[1:], "env": {{k: os.environ.get(k) for k in ("CUDA_DEVICE_MAX_CONNECTIONS", "NODE_RANK", "MASTER_ADDR")}}}}, f)
"""
FAKE_SRUN = """#!/usr/bin/env bash
while [[ "$1" == --* ]]; do shift; done
SLURM_NODEID=0 exec "$@"
"""
# a large job's node list (> 64 KiB): a launcher that reads only its first line must not die of SIGPIPE under pipefail
FAKE_SCONTROL = """#!/usr/bin/env bash
echo node0
for i in $(seq 1 20000); do echo node$i; done
"""


def _write_bin(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _hostile_dir(tmp_path: Path) -> tuple[Path, Path, Path, dict[str, str]]:
    d = load("gpt2xl_pp4").to_dict()  # its layout string holds | ( ) * characters
    d["inputs"]["model_file"] = HOSTILE
    plan = Plan.from_dict(d)
    command = "planner plan " + shlex.quote(HOSTILE + "\n$(touch pwned3)") + " --engine megatron"
    out = tmp_path / "plan dir $(touch pwned4)"
    out.mkdir()
    files = render(plan, command, out)
    for rel, text in files.items():
        (out / rel).write_text(text)
        if rel.endswith(".sh"):
            (out / rel).chmod(0o755)
    megatron = tmp_path / "Megatron-LM 'q' $(touch pwned5)"
    megatron.mkdir()
    (megatron / "pretrain_gpt.py").write_text("raise SystemExit('must not run')\n")
    fake = tmp_path / "bin"
    fake.mkdir()
    _write_bin(fake / "torchrun", FAKE_TORCHRUN.format(python=sys.executable))
    _write_bin(fake / "srun", FAKE_SRUN)
    _write_bin(fake / "scontrol", FAKE_SCONTROL)
    env = {
        "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}",
        "MEGATRON_LM_PATH": str(megatron),
        "FAKE_OUT": str(tmp_path / "argv.json"),
        "HOME": str(tmp_path),
    }
    return out, megatron, fake, env


def _pwned(tmp_path: Path) -> list[Path]:
    return [p for p in tmp_path.rglob("pwned*")]


def test_scripts_parse_with_bash(tmp_path):
    out, _, _, _ = _hostile_dir(tmp_path)
    for script in ("pretrain_gpt.sh", "launch_slurm.sh"):
        subprocess.run(["bash", "-n", str(out / script)], check=True)
    assert _pwned(tmp_path) == []


def test_hostile_values_arrive_as_single_arguments(tmp_path):
    out, megatron, _, env = _hostile_dir(tmp_path)
    extra = ["--save", "ckpt dir $(touch pwned6)", "--load", "`touch pwned7`"]
    run = subprocess.run(["bash", str(out / "pretrain_gpt.sh"), *extra], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    got = json.loads((tmp_path / "argv.json").read_text())
    argv = got["argv"]
    script_at = argv.index(f"{megatron}/pretrain_gpt.py")
    assert argv[:script_at] == ["--nproc-per-node", "8", "--nnodes", "1", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", "29500"]
    parsed = parse_megatron_args((out / "pretrain_gpt.sh").read_text())
    assert argv[script_at + 1 :] == parsed.argv() + extra
    layout = argv[argv.index("--pipeline-model-parallel-layout") + 1]
    assert layout == parsed.value("--pipeline-model-parallel-layout") and "|" in layout and "(" in layout
    assert got["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] is None  # tp = 1 in this plan
    assert _pwned(tmp_path) == []


def test_slurm_launcher_runs_the_script_on_each_node(tmp_path):
    out, megatron, _, env = _hostile_dir(tmp_path)
    env = dict(env, SLURM_SUBMIT_DIR=str(out), SLURM_JOB_NODELIST="node[0-1]")
    run = subprocess.run(["bash", str(out / "launch_slurm.sh"), "--eval-iters", "0"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    got = json.loads((tmp_path / "argv.json").read_text())
    assert got["env"]["NODE_RANK"] == "0" and got["env"]["MASTER_ADDR"] == "node0"
    assert got["argv"][-2:] == ["--eval-iters", "0"] and f"{megatron}/pretrain_gpt.py" in got["argv"]
    assert "#SBATCH --job-name=model-megatron" in (out / "launch_slurm.sh").read_text()
    assert _pwned(tmp_path) == []


def test_missing_checkout_stops_before_torchrun(tmp_path):
    out, _, _, env = _hostile_dir(tmp_path)
    env = dict(env, MEGATRON_LM_PATH=str(tmp_path / "nowhere"))
    run = subprocess.run(["bash", str(out / "pretrain_gpt.sh")], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 1 and "MEGATRON_LM_PATH" in run.stderr
    assert not (tmp_path / "argv.json").exists()


# --------------------------------------------------------------------------- architecture() keys


def _architecture_table() -> str:
    from planner.engines.megatron.architecture import ARCHITECTURE, REQUIRED

    rows = ["| key | default | what Megatron-LM makes of it |", "| --- | --- | --- |"]
    for k in ARCHITECTURE:
        default = "required" if k.default is REQUIRED else "unset" if k.default is None else f"`{k.default!r}`"
        rows.append(f"| `{k.name}` | {default} | {k.meaning} |")
    return "\n".join(rows) + "\n"


def test_readme_documents_every_architecture_key_with_its_default():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert _architecture_table() in readme, "README.md's architecture() table differs from planner.engines.megatron.architecture.ARCHITECTURE"


def test_architecture_defaults_are_megatron_cores():
    """The documented defaults are TransformerConfig's own (bias, norm epsilon, FFN width without swiglu)."""
    from megatron.core.transformer import TransformerConfig

    from planner.engines.megatron.architecture import architecture_defaults, megatron_ffn_hidden_size

    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4)
    full = architecture_defaults({})
    assert full["bias"] is cfg.add_bias_linear is True and cfg.layernorm_epsilon == 1e-5 and cfg.normalization == "LayerNorm"
    assert megatron_ffn_hidden_size(64, swiglu=False) == cfg.ffn_hidden_size
    assert megatron_ffn_hidden_size(4096, swiglu=True) == 10880  # validate_args: int((4 * h * 2 / 3) / 64) * 64


def test_only_the_required_keys_plan_and_render():
    """A model file giving exactly the keys the error message asks for renders (bias, dropout, ... defaulted)."""
    from planner.engines.megatron.architecture import ARCHITECTURE_KEYS, architecture_problem

    plan = load("llama7b")
    given = {k: plan.model["architecture"][k] for k in ARCHITECTURE_KEYS}
    problem = architecture_problem({k: v for k, v in given.items() if k != "activation"})
    assert problem is not None and "activation" in problem[0]
    d = plan.to_dict()
    d["model"]["architecture"] = given
    files = render(Plan.from_dict(d), GOLDEN_COMMAND, None)
    args = parse_megatron_args(files["pretrain_gpt.sh"])
    assert check_megatron_args(args) == [] and args.value("--hidden-dropout") == "0.0" and not args.has("--disable-bias-linear")
    assert "with linear biases, dropout 0.0" in files["README.md"]


@pytest.mark.parametrize("kind", ["learned_absolute", "rope", "mrope", "relative", "none"])
def test_every_position_embedding_megatron_accepts(kind):
    """Megatron-LM core_v0.16.1's --position-embedding-type choices all render, and the flags pass argparse and the rules."""
    extra = {"mrope_section": [16, 24, 24]} if kind == "mrope" else {}
    files = render(_plan_with("llama7b", position_embedding=kind, **extra), GOLDEN_COMMAND, None)
    args = parse_megatron_args(files["pretrain_gpt.sh"])
    assert args.value("--position-embedding-type") == kind and check_megatron_args(args) == []
    if kind == "mrope":
        assert args.get("--mrope-section").values == ("16", "24", "24")
    with pytest.raises(UsageError, match="mrope_section"):
        render(_plan_with("llama7b", position_embedding="mrope"), GOLDEN_COMMAND, None)
