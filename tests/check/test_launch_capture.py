"""Launch scripts run under bash with stub launchers: what bash runs is what is checked, in bounded time, and nothing real is launched.

The reference is bash itself: each script is written so that only bash's own semantics
(if/else, functions, arrays, $(...), here-documents, source, loops) decide the flags.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from planner.engines.megatron.architecture import check_megatron_args
from planner.engines.megatron.script import parse_megatron_args
from planner.launch_capture import run_script

LAUNCH = "torchrun --nproc-per-node 8 pretrain_gpt.py"


def _line(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_if_else_takes_the_arm_bash_runs():
    text = f"""#!/bin/bash
if [[ -n "${{BIG:-}}" ]]; then
  TP=8
  EXTRA=(--num-layers 80)
elif (( 2 > 1 )); then
  TP=2
  EXTRA=(--num-layers 8)
else
  TP=4
  EXTRA=(--num-layers 40)
fi
{LAUNCH} --tensor-model-parallel-size $TP "${{EXTRA[@]}}"
"""
    a = parse_megatron_args(text)
    assert a.value("--tensor-model-parallel-size") == "2" and a.value("--num-layers") == "8"
    assert a.line("--num-layers") == _line(text, "--num-layers 8)")  # the arm that ran, not the first that mentions it


def test_functions_arrays_command_substitution_and_loops():
    text = f"""#!/bin/bash
layers() {{ echo $(( $1 * 2 )); }}
ARGS=()
for flag in hidden-size:256 num-attention-heads:8; do
  ARGS+=("--${{flag%%:*}}" "${{flag#*:}}")
done
i=0
while (( i < 3 )); do i=$((i + 1)); done
ARGS+=(--seq-length "$(printf '%d' 128)" --micro-batch-size $i)
{LAUNCH} --num-layers "$(layers 4)" "${{ARGS[@]}}"
"""
    a = parse_megatron_args(text)
    assert [(f.name, f.value) for f in a.flags] == [
        ("--num-layers", "8"),
        ("--hidden-size", "256"),
        ("--num-attention-heads", "8"),
        ("--seq-length", "128"),
        ("--micro-batch-size", "3"),
    ]


def test_heredoc_and_source_of_a_neighbouring_env_file(tmp_path):
    (tmp_path / "env.sh").write_text("export CUDA_DEVICE_MAX_CONNECTIONS=1\nLAYERS=12\nread -r -d '' NOTE <<'EOF' || true\n--num-layers 999\nEOF\n")
    script = tmp_path / "launch.sh"
    text = f'#!/bin/bash\nset -e\nsource "$(dirname "${{BASH_SOURCE[0]}}")/env.sh"\ncat > args.txt <<EOF\n--hidden-size 64\nEOF\n{LAUNCH} --num-layers "$LAYERS" $(cat args.txt)\n'
    script.write_text(text)
    a = parse_megatron_args(text, path=script)
    assert a.value("--num-layers") == "12" and a.value("--hidden-size") == "64"
    assert a.env_value("CUDA_DEVICE_MAX_CONNECTIONS") == "1"
    assert not (tmp_path / "args.txt").exists()  # it ran in a temporary directory


def test_a_script_that_loops_forever_is_stopped_in_bounded_time():
    start = time.monotonic()
    a = parse_megatron_args(f"while true; do sleep 1; done\n{LAUNCH} --num-layers 2\n", timeout=2)
    assert time.monotonic() - start < 10
    (f,) = check_megatron_args(a)
    assert f.rule == "MEG031" and "ran past 2 s" in f.message


def test_exponential_growth_and_output_floods_are_stopped():
    start = time.monotonic()
    grow = parse_megatron_args(f"set +x\nA=x\nwhile true; do A=$A$A; done\n{LAUNCH}\n")
    flood = parse_megatron_args(f"set -e +x\nyes\n{LAUNCH}\n")
    survived = parse_megatron_args(f"set +x\nyes\n{LAUNCH} --num-layers 2\n")  # `yes` is killed at the limit, bash goes on
    assert time.monotonic() - start < 30
    for a in (grow, flood):
        (f,) = check_megatron_args(a)
        assert f.rule == "MEG031"
    assert "memory" in grow.stopped or "ran past" in grow.stopped  # which bound comes first depends on the machine's load
    assert "file size" in flood.stopped
    assert survived.stopped is None and survived.value("--num-layers") == "2"


def test_stubs_never_run_what_they_are_given(tmp_path):
    marker = tmp_path / "ran"
    cap = run_script(text=f'python -c \'open("{marker}", "w")\'\nsrun touch {marker}\nmpirun touch {marker}\ndeepspeed x.py\npython3 -V\n')
    assert not marker.exists()
    assert [c.argv[0] for c in cap.calls] == ["python", "srun", "mpirun", "deepspeed", "python3"]
    assert cap.calls[1].argv == ("srun", "touch", str(marker))


def test_clean_environment_and_closed_stdin(monkeypatch):
    monkeypatch.setenv("PLANNER_TEST_SECRET", "leak")
    cap = run_script(text='read -r LINE || LINE=none\ntorchrun x.py "${PLANNER_TEST_SECRET:-absent}" "$HOME" "$LINE"\n')
    (call,) = cap.calls
    assert call.argv[2] == "absent" and call.argv[4] == "none"
    assert call.argv[3] != os.environ.get("HOME") and "PLANNER_TEST_SECRET" not in call.env
    assert Path(call.env["PATH"].split(":")[0]).name == "bin"  # the stubs come first


def test_argv_is_recorded_exactly(tmp_path):
    words = ["a b", "", "tab\there", "new\nline", "*", "$HOME", "--x=1"]
    quoted = " ".join("'" + w.replace("'", "'\\''") + "'" for w in words)
    cap = run_script(text=f"torchrun {quoted}\n")
    assert list(cap.calls[0].argv[1:]) == words
