"""planner.engines.megatron.architecture: parsing Megatron launch scripts, the rule checks, and the pipeline layout helpers.

The rules are checked against megatron-core 0.16.1 itself where it enforces them
(TransformerConfig, PipelineParallelLayerLayout, get_num_layers_to_build). With a
Megatron-LM checkout at tag core_v0.16.1 in MEGATRON_LM_PATH, the rule examples also
go through Megatron-LM's own parse_args + validate_args (test_rules_agree_with_megatron_lm).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.engines.megatron.architecture import (
    RULES,
    Flag,
    LayoutError,
    MegatronArgs,
    check_megatron_args,
    flag_table,
    layout_string,
    parse_layout,
    split_flags,
    stage_layers,
)
from planner.engines.megatron.core_check import core_config as _core_config
from planner.engines.megatron.core_check import core_stage_layers as _core_stage_layers
from planner.engines.megatron.script import parse_megatron_args

# --------------------------------------------------------------------------- parsing

SCRIPT = r"""#!/bin/bash
# a launch script in the style of Megatron-LM's examples
export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=8
NUM_NODES=2
WORLD_SIZE=$(($GPUS_PER_NODE*$NUM_NODES))
CHECKPOINT_PATH=$1 #<Specify path>
LAYERS="${LAYERS:-32}"

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --master_addr localhost --master_port 6000
)

GPT_MODEL_ARGS=(
    --num-layers $LAYERS
    --hidden-size 4096   # a comment inside the array
	--num-attention-heads 32
    --seq-length 4096
    --max-position-embeddings 4096
)
GPT_MODEL_ARGS+=(--swiglu)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 64
    --lr 6.0e-5 --min-lr 1e-6
    --bf16
)

MODEL_PARALLEL_ARGS=(
	--tensor-model-parallel-size 2
	--pipeline-model-parallel-size 4
	--pipeline-model-parallel-layout "Et*7|(t*8|)*2,t*9L"
)
EXTRA="--log-interval 10 --eval-iters 0"

echo "pretrain_gpt.py starts now"
torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    "${GPT_MODEL_ARGS[@]}" \
    ${TRAINING_ARGS[@]} \
    "${MODEL_PARALLEL_ARGS[@]}" \
    --save "$CHECKPOINT_PATH" \
    --data-path=/data/my\ corpus $EXTRA "$@"
"""


def _line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_parse_script_expands_arrays_variables_and_keeps_lines():
    a = parse_megatron_args(SCRIPT, "script")
    assert a.script == "pretrain_gpt.py"
    assert a.nproc_per_node == 8 and a.nnodes == 2 and a.world_size == 16  # torchrun's own parser
    assert a.env_value("CUDA_DEVICE_MAX_CONNECTIONS") == "1"
    assert a.value("--num-layers") == "32"  # ${LAYERS:-32} with LAYERS unset in the script
    assert a.line("--num-layers") == _line_of(SCRIPT, "--num-layers")
    assert a.line("--num-attention-heads") == _line_of(SCRIPT, "--num-attention-heads")  # tab-indented
    assert a.has("--swiglu") and a.line("--swiglu") == _line_of(SCRIPT, "GPT_MODEL_ARGS+=")
    assert a.value("--min-lr") == "1e-6"
    assert a.value("--pipeline-model-parallel-layout") == "Et*7|(t*8|)*2,t*9L"
    assert a.value("--data-path") == "/data/my corpus"  # --flag=value and a backslash-escaped space
    assert a.line("--data-path") == _line_of(SCRIPT, "--data-path")  # on the launch command's last line
    assert a.value("--log-interval") == "10" and a.value("--eval-iters") == "0"  # unquoted $EXTRA is word-split
    assert a.line("--log-interval") == _line_of(SCRIPT, "EXTRA=")
    assert a.value("--save") == ""  # $1: the script is run with no arguments
    assert a.launch_line == _line_of(SCRIPT, "torchrun")
    names = [f.name for f in a.flags]
    assert names[:5] == ["--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--max-position-embeddings"]
    assert check_megatron_args(a) == []


def test_negative_values_as_megatrons_argparse_reads_them():
    """argparse takes "-1e-6" for an option (it only knows -N and -N.N as numbers): Megatron stops, so does the check."""
    a = parse_megatron_args("--lr 1e-4 --min-lr -1e-6 --adam-eps -0.5", "args")
    assert a.value("--lr") == "1e-4" and a.value("--adam-eps") == "-0.5"
    assert [(p.name, p.line) for p in a.problems] == [("--min-lr", 1)]
    assert "MEG027" in {f.rule for f in check_megatron_args(a)}


def test_parse_args_file_one_per_line_or_space_separated():
    text = "# model\n--num-layers 8\n--hidden-size 256 --num-attention-heads 8\n--bf16\n--pipeline-model-parallel-layout 'E|t*8|L'\n"
    a = parse_megatron_args(text, "args")
    assert a.kind == "args"
    assert [(f.name, f.values, f.line) for f in a.flags] == [
        ("--num-layers", ("8",), 2),
        ("--hidden-size", ("256",), 3),
        ("--num-attention-heads", ("8",), 3),
        ("--bf16", (), 4),
        ("--pipeline-model-parallel-layout", ("E|t*8|L",), 5),
    ]
    assert a.world_size is None and a.env == ()


def test_parse_launch_variants():
    a = parse_megatron_args(
        "NODES=4\nCUDA_DEVICE_MAX_CONNECTIONS=1 python -m torch.distributed.run --nproc-per-node=8 --nnodes=$NODES x/pretrain_gpt.py --num-layers 2\n"
    )
    assert a.world_size == 32 and a.env_value("CUDA_DEVICE_MAX_CONNECTIONS") == "1" and a.value("--num-layers") == "2"
    b = parse_megatron_args("torchrun --nproc_per_node $(nvidia-smi -L 2>/dev/null | wc -l) pretrain_gpt.py --num-layers 2\n")
    assert b.world_size is None and b.value("--num-layers") == "2"  # no GPU here: not a usable count
    c = parse_megatron_args('if [[ -f "$X/pretrain_gpt.py" ]]; then echo ok; fi\nexec torchrun --nproc-per-node 2 "$X/pretrain_gpt.py" --num-layers 4\n')
    assert c.world_size == 2 and c.value("--num-layers") == "4" and c.launch_line == 2  # the test line is not the launch
    d = parse_megatron_args("A=(--num-layers 4)\nB=(--hidden-size 64)\n")  # no launch: nothing to check but that
    assert d.flags == () and [f.rule for f in check_megatron_args(d)] == ["MEG031"]
    e = parse_megatron_args("srun --ntasks-per-node 8 python pretrain_gpt.py --num-layers 3\n")
    assert e.script == "pretrain_gpt.py" and e.value("--num-layers") == "3" and e.world_size is None
    f = parse_megatron_args("python tools/make_data.py --out x\ntorchrun --nnodes 2 pretrain_gpt.py --num-layers 5\n")
    assert f.value("--num-layers") == "5" and f.world_size == 2 and f.launch_line == 2  # pretrain*.py is preferred


HEREDOC_SCRIPT = """export NCCL_DEBUG=WARN CUDA_DEVICE_MAX_CONNECTIONS
CUDA_DEVICE_MAX_CONNECTIONS=1
declare -x OMP_NUM_THREADS=4
cat > notes.txt <<-EOF
\t--num-layers 999
\tEOF
cat <<'END'
torchrun pretrain_gpt.py --num-layers 5
END
HEADS="${HEADS:-"16"}"
torchrun --nproc-per-node 2 pretrain_gpt.py --num-layers 4 2>&1 --num-attention-heads "$HEADS" > log.txt --seq-length 16 | tee out
"""


def test_parse_skips_redirections_heredocs_and_reads_exports():
    a = parse_megatron_args(HEREDOC_SCRIPT)
    assert [(f.name, f.value) for f in a.flags] == [("--num-layers", "4"), ("--num-attention-heads", "16"), ("--seq-length", "16")]
    assert a.launch_line == 11 and a.world_size == 2
    assert a.env_value("NCCL_DEBUG") == "WARN" and a.env_value("OMP_NUM_THREADS") == "4"
    # `export NAME` marks the name: the value set on the next line is in the launch's environment, as bash does it
    assert a.env_value("CUDA_DEVICE_MAX_CONNECTIONS") == "1"


BASH_DIFF_SCRIPT = r"""#!/bin/bash
set -eu
N=2
M=$(( (N + 2) * 3 / 2 ))
X="${A:-a  b}"
B=${C:-$X}
D="${E:+yes}"
F=${X:+"set $X"}
G='single $X "q"'
H=$'tab\there'
ARR=( --one "two words" three\ four   # comment
      --five="$X" --data-path ${B} )
ARR+=("$M")
EXTRA="--p 1   --q 2"
cat > /dev/null <<EOF
--num-layers 999
EOF
torchrun --nproc-per-node "$N" pretrain_gpt.py "${ARR[@]}" ${ARR[@]} --x "$X" --b $B --dd "$D" --f "$F" \
    --g "$G" --hh "$H" $EXTRA "--i=$M" 2>/dev/null --j "a"'b'"c" --k ${UNSET:-} --ll "${UNSET:-}" --mm x#y
"""


def test_words_are_what_bash_passes(tmp_path):
    """The words after the script equal what bash passes to a fake torchrun outside the planner."""
    import json
    import subprocess

    fake = tmp_path / "torchrun"
    fake.write_text("#!" + sys.executable + "\nimport json, os, sys\nopen(os.environ['OUT'], 'w').write(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    script = tmp_path / "run.sh"
    script.write_text(BASH_DIFF_SCRIPT)
    env = {"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "OUT": str(tmp_path / "argv.json")}
    subprocess.run(["bash", str(script)], check=True, env=env, cwd=tmp_path)
    argv = json.loads((tmp_path / "argv.json").read_text())
    a = parse_megatron_args(BASH_DIFF_SCRIPT)
    assert argv[: argv.index("pretrain_gpt.py")] == ["--nproc-per-node", "2"] and a.world_size == 2
    assert argv[argv.index("pretrain_gpt.py") + 1 :] == list(a.words)
    assert a.get("--data-path").values == ("a", "b", "6")  # nargs="*": argparse takes every word up to the next option
    assert [p.name for p in a.positionals] == ["b"]  # "--five=a  b" unquoted: "b" belongs to no flag
    assert [f.rule for f in check_megatron_args(a)].count("MEG028") == 1 + sum(1 for f in a.flags if f.name not in flag_table())


def test_torchruns_own_parser_decides():
    """torchrun's argparse refuses "--m" after the script (an ambiguous prefix of --master-addr, --max-restarts, ...)."""
    a = parse_megatron_args("torchrun --nproc-per-node 2 pretrain_gpt.py --num-layers 2 --m 1\n")
    (f,) = check_megatron_args(a)
    assert f.rule == "MEG031" and "ambiguous option: --m" in f.message


# --------------------------------------------------------------------------- rules

BASE = [
    ("--num-layers", "8"),
    ("--hidden-size", "256"),
    ("--num-attention-heads", "8"),
    ("--seq-length", "128"),
    ("--max-position-embeddings", "128"),
    ("--micro-batch-size", "1"),
    ("--global-batch-size", "16"),
    ("--tensor-model-parallel-size", "2"),
    ("--pipeline-model-parallel-size", "2"),
    ("--bf16", None),
]
WORLD = 8


def _script(flags, world=WORLD, export=True) -> str:
    lines = ["#!/bin/bash", "export CUDA_DEVICE_MAX_CONNECTIONS=1" if export else "# no export", "ARGS=("]
    for name, value in flags:
        lines.append("  " + name + ("" if value is None else " " + shlex.quote(value)))
    lines += [")", f'torchrun --nproc-per-node {world} pretrain_gpt.py "${{ARGS[@]}}"', ""]
    return "\n".join(lines)


def _with(changes: dict, drop=(), extra=()) -> list:
    out = [(n, changes.get(n, v)) for n, v in BASE if n not in drop]
    return out + list(extra)


#: a mixture of experts on BASE's tp 2 (no biases, experts unsplit by tp, sequence parallelism as expert parallelism wants)
MOE = [
    ("--num-experts", "4"),
    ("--moe-router-topk", "2"),
    ("--disable-bias-linear", None),
    ("--expert-tensor-parallel-size", "1"),
    ("--sequence-parallel", None),
]
#: multi-latent attention on BASE (plain rope, unfused as MLATransformerConfig wants it)
MLA = [
    ("--multi-latent-attention", None),
    ("--kv-lora-rank", "32"),
    ("--qk-head-dim", "32"),
    ("--qk-pos-emb-head-dim", "16"),
    ("--v-head-dim", "32"),
    ("--position-embedding-type", "rope"),
    ("--rope-type", "rope"),
    ("--no-rope-fusion", None),
]


def _moe(changes: dict | None = None, drop=(), extra=()) -> list:
    """BASE + MOE with MOE's values changed, some flags dropped and others added."""
    changes = changes or {}
    return _with({}) + [(n, changes.get(n, v)) for n, v in MOE if n not in drop] + [(n, v) for n, v in changes.items() if n not in dict(MOE)] + list(extra)


#: rule id -> (flags, world size, export CUDA_DEVICE_MAX_CONNECTIONS, whether Megatron-LM's parse_args/validate_args/TransformerConfig refuse it)
RULE_CASES = {
    "MEG001": (_with({}, drop=["--hidden-size"]), WORLD, True, True),
    "MEG002": (_with({}), 6, True, True),
    "MEG003": (_with({"--num-layers": "9"}), WORLD, True, True),
    "MEG004": (_with({}, extra=[("--decoder-first-pipeline-num-layers", "0")]), WORLD, True, True),
    "MEG005": (_with({}, extra=[("--decoder-first-pipeline-num-layers", "4"), ("--account-for-embedding-in-pipeline-split", None)]), WORLD, True, True),
    "MEG006": (_with({}, extra=[("--pipeline-model-parallel-layout", "Et*4|t*4X|L")]), WORLD, True, True),
    "MEG007": (_with({}, extra=[("--pipeline-model-parallel-layout", "Et*4|t*3L")]), WORLD, True, True),
    "MEG008": (_with({}, extra=[("--pipeline-model-parallel-layout", "t*4|Et*4L")]), WORLD, True, True),
    "MEG009": (_with({}, extra=[("--pipeline-model-parallel-layout", "Et*4|t*4")]), WORLD, True, True),
    "MEG010": (_with({}, extra=[("--pipeline-model-parallel-layout", "Et*3|t*3|t*2L")]), WORLD, True, True),
    "MEG011": (_with({}, extra=[("--pipeline-model-parallel-layout", "Et*4|t*4L"), ("--decoder-first-pipeline-num-layers", "4")]), WORLD, True, True),
    "MEG012": (_with({}, extra=[("--num-layers-per-virtual-pipeline-stage", "2"), ("--num-virtual-stages-per-pipeline-rank", "2")]), WORLD, True, True),
    "MEG013": (_with({"--num-attention-heads": "5", "--hidden-size": "320"}), WORLD, True, True),
    "MEG014": (
        _with({"--num-attention-heads": "6", "--hidden-size": "384"}, extra=[("--group-query-attention", None), ("--num-query-groups", "3")]),
        WORLD,
        True,
        True,
    ),
    "MEG015": (_with({"--global-batch-size": "15"}), WORLD, True, False),  # asserted when the microbatch calculator is built
    "MEG016": (_with({"--global-batch-size": "6"}, extra=[("--num-virtual-stages-per-pipeline-rank", "2")]), WORLD, True, False),  # at run time
    "MEG017": (_with({}, extra=[("--num-virtual-stages-per-pipeline-rank", "2"), ("--no-overlap-p2p-communication", None)]), WORLD, True, True),
    "MEG018": (_with({"--tensor-model-parallel-size": "1"}, extra=[("--sequence-parallel", None)]), WORLD, True, False),
    "MEG019": (_with({}, extra=[("--overlap-param-gather", None)]), WORLD, True, True),
    "MEG020": (_with({}, extra=[("--recompute-granularity", "full")]), WORLD, True, True),
    "MEG021": (_with({"--seq-length": "126", "--pipeline-model-parallel-size": "1"}, extra=[("--context-parallel-size", "2")]), 4, True, True),
    "MEG022": (_with({}), WORLD, False, True),
    "MEG023": (_with({"--hidden-size": "250"}), WORLD, True, True),
    "MEG024": (_with({"--max-position-embeddings": "64"}), WORLD, True, True),
    "MEG025": (_with({}, extra=[("--fp16", None)]), WORLD, True, True),
    "MEG026": (_with({}, extra=[("--num-query-groups", "4")]), WORLD, True, False),
    "MEG027": (_with({"--num-layers": "eight"}), WORLD, True, True),
    "MEG028": (_with({}, extra=[("--overlap-p2p-communication", None)]), WORLD, True, True),
    "MEG029": (_with({"--micro-batch-size": "2"}, extra=[("--micro-batch-size", "1")]), WORLD, True, False),
    "MEG030": (_with({}, extra=[("--ffn-hidden-size", "1023")]), WORLD, True, False),  # at model build (parallel linear layers)
    "MEG032": (
        [(n, "24" if n == "--global-batch-size" else v) for n, v in _moe({"--expert-model-parallel-size": "4"})],
        12,
        True,
        False,
    ),  # parallel_state at init
    "MEG033": (_moe({"--num-experts": "3", "--expert-model-parallel-size": "2"}), WORLD, True, True),
    "MEG034": (_moe({"--moe-router-topk": "5"}), WORLD, True, False),  # the router's torch.topk at run time
    "MEG035": (_moe({"--moe-layer-freq": "[1]*7"}), WORLD, True, False),  # when the layer specs are built
    "MEG036": (_moe(extra=[("--moe-router-enable-expert-bias", None)]), WORLD, True, True),
    "MEG037": (_moe({"--moe-shared-expert-intermediate-size": "512"}, extra=[("--moe-shared-expert-overlap", None)]), WORLD, True, True),
    "MEG038": (_moe(drop=("--disable-bias-linear", "--expert-tensor-parallel-size")), WORLD, True, True),
    "MEG039": (_moe({"--expert-model-parallel-size": "2"}, drop=("--sequence-parallel",)), WORLD, True, False),
    "MEG040": (_with({}, extra=MLA + [("--group-query-attention", None), ("--num-query-groups", "4")]), WORLD, True, True),
    "MEG041": (_with({}, extra=[("--fp8-format", "hybrid"), ("--fp8-param-gather", None)]), WORLD, True, True),  # no distributed optimizer
    "MEG042": (
        _moe({"--expert-model-parallel-size": "2", "--moe-token-dispatcher-type": "alltoall"}, extra=[("--overlap-moe-expert-parallel-comm", None)]),
        WORLD,
        True,
        True,
    ),  # pp 2 without virtual stages
    "MEG043": (_with({}, extra=[("--squared-relu", None)]), WORLD, True, True),  # biases on, the bias-GeLU fusion on: TransformerConfig raises
    # a2a+p2p without its group sizes: parallel_state asserts them at initialisation, not validate_args
    "MEG044": (_with({"--pipeline-model-parallel-size": "1"}, extra=[("--context-parallel-size", "2"), ("--cp-comm-type", "a2a+p2p")]), 4, True, False),
}


def test_every_rule_has_a_failing_example():
    assert sorted(RULE_CASES) == sorted(set(RULES) - {"MEG031"})  # MEG031 (a script that stops) has its own tests


def test_base_example_has_no_findings():
    assert check_megatron_args(parse_megatron_args(_script(BASE))) == []


@pytest.mark.parametrize("rule", sorted(RULE_CASES))
def test_rule_failing_example_yields_exactly_that_rule(rule):
    flags, world, export, _ = RULE_CASES[rule]
    findings = check_megatron_args(parse_megatron_args(_script(flags, world, export)))
    assert {f.rule for f in findings} == {rule}, [str(f) for f in findings]
    for f in findings:
        assert f.severity == RULES[rule][0]
        assert f.line is not None and f.message and f.fix


def test_layout_with_virtual_stage_flag_is_refused():
    flags = _with({}, extra=[("--pipeline-model-parallel-layout", "Et*2|t*2|t*2|t*2L"), ("--num-virtual-stages-per-pipeline-rank", "2")])
    assert [f.rule for f in check_megatron_args(parse_megatron_args(_script(flags)))] == ["MEG011"]


def test_findings_name_the_numbers_and_lines():
    text = _script(_with({"--num-layers": "9"}))
    (f,) = check_megatron_args(parse_megatron_args(text))
    assert f.rule == "MEG003" and "9" in f.message and "pp = 2" in f.message
    assert f.line == _line_of(text, "--num-layers")
    (g,) = check_megatron_args(parse_megatron_args(_script(_with({"--global-batch-size": "15"}))))
    assert "15" in g.message and "2" in g.message


def test_world_size_argument_overrides_the_script():
    a = parse_megatron_args(_script(BASE, world=8))
    assert [f.rule for f in check_megatron_args(a, world_size=10)] == ["MEG002"]
    assert [f.rule for f in check_megatron_args(a, world_size=12)] == ["MEG015"]  # dp 3 does not divide 16
    assert check_megatron_args(a, world_size=16) == []


def test_uneven_and_interleaved_examples_pass():
    ok = [
        _with(
            {"--num-layers": "10", "--pipeline-model-parallel-size": "4"},
            extra=[("--decoder-first-pipeline-num-layers", "1"), ("--decoder-last-pipeline-num-layers", "3")],
        ),
        _with(
            {"--num-layers": "14", "--pipeline-model-parallel-size": "4"}, extra=[("--pipeline-model-parallel-layout", "Et|(tt|)*6,tL")]
        ),  # engines.md's example
        _with({"--num-layers": "16", "--pipeline-model-parallel-size": "4"}, extra=[("--num-virtual-stages-per-pipeline-rank", "2")]),
        _with({"--num-layers": "7"}, extra=[("--account-for-embedding-in-pipeline-split", None)]),
    ]
    for flags in ok:
        world = 2 * int(dict(flags)["--pipeline-model-parallel-size"])
        findings = check_megatron_args(parse_megatron_args(_script(flags, world)))
        assert findings == [], [str(f) for f in findings]


# --------------------------------------------------------------------------- megatron-core agrees


@pytest.mark.parametrize(
    "rule",
    ["MEG003", "MEG004", "MEG005", "MEG007", "MEG008", "MEG009", "MEG010", "MEG011", "MEG013", "MEG014", "MEG020", "MEG036", "MEG037", "MEG038", "MEG043"],
)
def test_transformer_config_refuses_what_the_rule_refuses(rule):
    """Rules that megatron-core's TransformerConfig (or its layer-count function) enforces: it raises on the failing example."""
    flags, world, export, _ = RULE_CASES[rule]
    args = parse_megatron_args(_script(flags, world, export))
    with pytest.raises((ValueError, AssertionError)):
        cfg = _core_config(args)
        _core_stage_layers(cfg)


@pytest.mark.parametrize(
    "extra",
    [
        [("--squared-relu", None), ("--no-bias-gelu-fusion", None)],
        [("--squared-relu", None), ("--disable-bias-linear", None)],
    ],
)
def test_squared_relu_without_the_gelu_fusion_passes_and_megatron_core_builds_it(extra):
    args = parse_megatron_args(_script(_with({}, extra=extra)))
    assert check_megatron_args(args) == []
    from megatron.core.activations import squared_relu

    cfg = _core_config(args)
    assert cfg.activation_func is squared_relu and not cfg.bias_activation_fusion and not cfg.gated_linear_unit


def test_squared_relu_with_swiglu_is_refused():
    args = parse_megatron_args(_script(_with({}, extra=[("--squared-relu", None), ("--swiglu", None), ("--disable-bias-linear", None)])))
    assert [f.rule for f in check_megatron_args(args)] == ["MEG043"]


def test_transformer_config_accepts_the_base_example():
    cfg = _core_config(parse_megatron_args(_script(BASE)))
    assert _core_stage_layers(cfg) == [4, 4]


def test_moe_and_mla_examples_pass_and_megatron_core_builds_them():
    """The MoE and MLA bases pass every rule, and megatron-core's (MLA)TransformerConfig takes them as given."""
    from megatron.core.transformer import MLATransformerConfig

    moe = parse_megatron_args(_script(_moe({"--expert-model-parallel-size": "2", "--moe-layer-freq": "[0]+[1]*7"})))
    assert check_megatron_args(moe) == []
    cfg = _core_config(moe)
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.expert_model_parallel_size, cfg.expert_tensor_parallel_size) == (4, 2, 2, 1)
    assert cfg.moe_layer_freq == [0] + [1] * 7 and cfg.moe_ffn_hidden_size == cfg.ffn_hidden_size  # unset: the dense width
    mla = parse_megatron_args(_script(_with({}, extra=MLA)))
    assert check_megatron_args(mla) == []
    cfg = _core_config(mla)
    assert isinstance(cfg, MLATransformerConfig) and (cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim, cfg.rope_type) == (32, 16, "rope")


def test_expert_widths_must_divide_over_their_tensor_parallel_groups():
    """Routed experts split their width over etp, shared experts over tp (MEG030); megatron-core's linear layers assert it."""
    bad = [_moe({"--moe-ffn-hidden-size": "100", "--expert-tensor-parallel-size": "8"}), _moe({"--moe-shared-expert-intermediate-size": "101"})]
    for flags in bad:
        assert {f.rule for f in check_megatron_args(parse_megatron_args(_script(flags, 16)))} == {"MEG030"}
    ok = _moe({"--moe-ffn-hidden-size": "100", "--expert-tensor-parallel-size": "4"})
    assert check_megatron_args(parse_megatron_args(_script(ok))) == []


def test_mla_with_fused_plain_rope_is_refused_by_us_and_by_mla_transformer_config():
    """Megatron-LM fuses rope by default; MLATransformerConfig refuses that with --rope-type rope (MEG040)."""
    args = parse_megatron_args(_script(_with({}, extra=[(n, v) for n, v in MLA if n != "--no-rope-fusion"])))
    assert {f.rule for f in check_megatron_args(args)} == {"MEG040"}
    with pytest.raises(ValueError, match="YARN"):
        _core_config(args)


# --------------------------------------------------------------------------- layouts


def test_layout_string_matches_megatron_example():
    assert layout_string([1, 2, 2, 2, 2, 2, 2, 1], 4) == "Et|(tt|)*6,tL"
    assert parse_layout("Et|(tt|)*6,tL") == [["E", "t"]] + [["t", "t"]] * 6 + [["t", "L"]]
    assert layout_string([5], 1) == "Et*5L"
    assert layout_string([0, 3, 3, 0], 2) == "E|(ttt|)*2,L"


def test_parse_layout_rejects_garbage():
    for bad in ("Et*4|tX|L", "E(t|(t)*2)*2L", "Et*|L", "E t|L"):
        with pytest.raises(LayoutError):
            parse_layout(bad)


_splits = st.integers(min_value=1, max_value=6).flatmap(
    lambda pp: st.tuples(st.just(pp), st.integers(min_value=1, max_value=4).flatmap(lambda v: st.lists(st.integers(0, 12), min_size=pp * v, max_size=pp * v)))
)


@settings(max_examples=200, deadline=None)
@given(_splits)
def test_layout_string_round_trips(case):
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    pp, counts = case
    s = layout_string(counts, pp)
    stages = parse_layout(s)
    assert [st_.count("t") for st_ in stages] == counts
    assert sum(st_.count("t") for st_ in stages) == sum(counts)
    assert stages[0][0] == "E" and stages[-1][-1] == "L"
    assert sum(st_.count("E") for st_ in stages) == 1 and sum(st_.count("L") for st_ in stages) == 1
    # megatron-core parses it the same way and accepts it for a model of sum(counts) layers
    core = PipelineParallelLayerLayout.parse_str_to_list(s)
    assert [[t.name for t in stage] for stage in core] == [[{"E": "embedding", "t": "decoder", "L": "loss"}[c] for c in stage] for stage in stages]
    PipelineParallelLayerLayout(s, pp).validate_layer_layout(num_layers=sum(counts), mtp_num_layers=None)
    args = MegatronArgs(
        "args",
        (
            Flag("--num-layers", (str(sum(counts)),), 1),
            Flag("--pipeline-model-parallel-size", (str(pp),), 2),
            Flag("--pipeline-model-parallel-layout", (s,), 3),
        ),
    )
    assert not [f for f in check_megatron_args(args) if f.rule in ("MEG006", "MEG007", "MEG008", "MEG009", "MEG010", "MEG011")]


def _args(pairs) -> MegatronArgs:
    return MegatronArgs("args", tuple(Flag(n, () if v is None else (v,), k + 1) for k, (n, v) in enumerate(pairs)))


@settings(max_examples=60, deadline=None)
@given(_splits.filter(lambda c: sum(c[1]) > 0 and (c[0] >= 2 or len(c[1]) == 1)))
def test_split_flags_build_the_planned_split_in_megatron_core(case):
    pp, counts = case
    flags = split_flags(counts, pp)
    args = _args(
        [("--num-layers", str(sum(counts))), ("--hidden-size", "64"), ("--num-attention-heads", "4"), ("--pipeline-model-parallel-size", str(pp))] + flags
    )
    assert stage_layers(args) == counts
    rules = {f.rule for f in check_megatron_args(args)} - {"MEG001"}
    assert not rules, rules
    assert _core_stage_layers(_core_config(args)) == counts


def test_split_flags_prefers_the_simplest_form():
    assert split_flags([4, 4, 4, 4], 4) == []
    assert split_flags([2] * 8, 4) == [("--num-virtual-stages-per-pipeline-rank", "2")]
    assert split_flags([3, 4, 4, 5], 4) == [("--decoder-first-pipeline-num-layers", "3"), ("--decoder-last-pipeline-num-layers", "5")]
    assert split_flags([4, 4, 4, 2], 4) == [("--decoder-last-pipeline-num-layers", "2")]
    assert split_flags([1, 2, 2, 1, 2, 2], 3) == [("--num-virtual-stages-per-pipeline-rank", "2"), ("--decoder-first-pipeline-num-layers", "2")]
    assert split_flags([3, 4, 4, 4, 4, 4, 4, 4], 4) == [("--pipeline-model-parallel-layout", "Ettt|(t*4|)*6,t*4L")]


def test_flag_table_is_megatron_core_v0_16_1():
    table = flag_table()
    assert len(table) > 600
    assert table["--num-layers"].nargs == "1" and table["--num-layers"].type == "int"
    assert table["--bf16"].nargs == "0"
    assert "--no-overlap-p2p-communication" in table and "--overlap-p2p-communication" not in table


# --------------------------------------------------------------------------- Megatron-LM itself (optional)


def _megatron_lm_validate():
    """Megatron-LM's parse_args + validate_args + core_transformer_config_from_args from MEGATRON_LM_PATH, or skip."""
    root = os.environ.get("MEGATRON_LM_PATH")
    if not root or not (Path(root) / "megatron" / "training" / "arguments.py").is_file():
        pytest.skip("set MEGATRON_LM_PATH to a Megatron-LM checkout (tag core_v0.16.1) to run Megatron's own validate_args")
    import importlib
    import re
    import types

    sys.path.insert(0, root)
    try:
        importlib.import_module("regex")
    except ImportError:  # only the GPT-2 BPE tokenizer module needs it at import time
        sys.modules["regex"] = re
    try:
        importlib.import_module("triton")
    except ImportError:  # batch-invariant kernels are imported by megatron.training.initialize
        stub = types.ModuleType("megatron.core.transformer.custom_layers.batch_invariant_kernels")
        stub.enable_batch_invariant_mode = lambda *a, **k: None
        stub.is_batch_invariant_mode_enabled = lambda *a, **k: False
        sys.modules[stub.__name__] = stub
    try:
        A = importlib.import_module("megatron.training.arguments")
    except ModuleNotFoundError as e:  # Megatron-LM's training package needs a few extra pure-Python packages (six, ...)
        pytest.skip(f"Megatron-LM's arguments.py does not import here: {e}")
    A.get_device_arch_version = lambda: 9  # a Hopper GPU: the CUDA_DEVICE_MAX_CONNECTIONS rule applies

    def validate(args: MegatronArgs, world: int) -> None:
        argv = args.argv()
        if args.value("--position-embedding-type") == "rope":
            argv.append("--no-rope-fusion")  # Transformer Engine is not installed here
        saved = (sys.argv, dict(os.environ))
        os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        os.environ.update({e.name: e.value for e in args.env if e.value is not None})
        os.environ.update(WORLD_SIZE=str(world), RANK="0")
        sys.argv = ["pretrain_gpt.py"] + argv
        try:
            ns = A.parse_args()
            A.validate_args(ns)
            A.core_transformer_config_from_args(ns)
        finally:
            sys.argv = saved[0]
            os.environ.clear()
            os.environ.update(saved[1])

    return validate


def test_rules_agree_with_megatron_lm():
    validate = _megatron_lm_validate()
    validate(parse_megatron_args(_script(BASE)), WORLD)
    for rule, (flags, world, export, refused) in sorted(RULE_CASES.items()):
        args = parse_megatron_args(_script(flags, world, export))
        if refused:
            with pytest.raises((AssertionError, ValueError, SystemExit)):
                validate(args, world)
        else:
            validate(args, world)


_SHELL_BITS = st.sampled_from(
    list("ab-= \t\n\\'\"$(){}[]@*#|&;<>`:+?!019")
    + [
        "--num-layers",
        "--pipeline-model-parallel-size",
        "torchrun",
        "pretrain_gpt.py",
        "ARR=(",
        "${ARR[@]}",
        "<<EOF\n",
        "EOF",
        "$((",
        "))",
        "export ",
        "${X:-",
        "}",
    ]
)


@settings(max_examples=100, deadline=None)
@given(st.lists(_SHELL_BITS, max_size=40).map("".join))
def test_parser_and_checks_never_crash(text):
    for kind in ("script", "args"):
        a = parse_megatron_args(text, kind)
        for f in check_megatron_args(a, 8):
            assert f.rule in RULES


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(1, 16), st.integers(1, 64), st.sampled_from([1, 2, 4, 8]))
def test_tensor_parallel_problems_match_the_rules(groups, per_group, ffn, tp):
    """The search-side helper agrees with the MEG013/MEG014/MEG030 rules on the same sizes."""
    from planner.engines.megatron.architecture import tensor_parallel_problems

    heads = groups * per_group
    arch = {"num_attention_heads": heads, "num_query_groups": groups, "ffn_hidden_size": ffn}
    args = _args(
        [
            ("--num-attention-heads", str(heads)),
            ("--group-query-attention", None),
            ("--num-query-groups", str(groups)),
            ("--ffn-hidden-size", str(ffn)),
            ("--tensor-model-parallel-size", str(tp)),
        ]
    )
    ruled = {f.rule for f in check_megatron_args(args)} & {"MEG013", "MEG014", "MEG030"}
    assert bool(tensor_parallel_problems(arch, tp)) == bool(ruled)
