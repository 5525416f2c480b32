"""Hardening (issue 16): user code cannot end or hang the planner, no user file is lost, every bad value is
answered with exit 2 and what is accepted, user text stays literal, renders are byte-identical anywhere.

Each test names the case of the issue it guards; reverting the fix makes it fail.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner import fileio
from planner.cli import app
from planner.errors import UsageError
from tests.conftest import model_file

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def cli(*args: str, cwd: Path | None = None):
    """Run the CLI in this process (fast); returns (exit code, stdout, stderr)."""
    runner = CliRunner()
    old = Path.cwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        r = runner.invoke(app, [str(a) for a in args], catch_exceptions=True)
    finally:
        os.chdir(old)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r.exit_code, r.stdout, r.stderr


def run_planner(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """The real console entry point in a fresh process."""
    return subprocess.run(
        [PY, "-c", "from planner.cli import main; main()", *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )


# ----------------------------------------------------------------------------- 1. user code under a guard


@pytest.mark.parametrize(
    "prelude, build, phase, says",
    [
        ("import sys\nsys.exit(0)", "pass", "importing", "sys.exit(0)"),
        ("", "import sys; sys.exit(0)", "building", "sys.exit(0)"),
        ("", "import os; os._exit(0)", "building", "os._exit(0)"),
        ("", "raise KeyboardInterrupt", "building", "KeyboardInterrupt"),
        ("import os\nos._exit(3)", "pass", "importing", "os._exit(3)"),
    ],
)
def test_user_code_exits_are_errors_naming_the_phase(tmp_path, prelude, build, phase, says):
    """issue: a model calling sys.exit(0) made inspect exit 0 with no output."""
    m = model_file(tmp_path, prelude=prelude, build=build)
    code, out, err = cli("inspect", m)
    assert code == 2, (code, out, err)
    assert says in err and phase in err and "Traceback" not in err


def test_sys_exit_in_a_model_fails_the_real_process(tmp_path):
    m = model_file(tmp_path, prelude="import sys\nsys.exit(0)")
    p = run_planner("plan", m, "--gpus", "2xA100", "--json")
    assert p.returncode == 2 and p.stdout == "" and "sys.exit(0)" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("where, phase", [("prelude", "importing"), ("build", "building")])
def test_timeout_names_the_phase(tmp_path, where, phase):
    """issue: an import or a forward that never returns hung inspect."""
    loop = "while True:\n    pass" if where == "prelude" else "while True: pass"
    m = model_file(tmp_path, **{where: loop})
    t0 = time.monotonic()
    code, _, err = cli("inspect", m, "--timeout", "1")
    assert code == 2 and f"did not finish {phase} within 1 s" in err
    assert time.monotonic() - t0 < 20


SCAN_MODEL = """
import torch
import torch.nn as nn


class Scan(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.ones(8))

    def forward(self, x):
        state = torch.zeros_like(x[:, 0])
        for t in range(x.shape[1]):
            state = self.a * state + x[:, t]  # THE-STEP
        return state


def build_model():
    return Scan()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 10**9, 8),)
"""


def test_a_trace_timeout_names_the_line_it_was_at(tmp_path):
    """issue: HF Mamba's reference scan (a Python loop over the tokens) outlasted the limit with "may hang or be very
    slow; fix it": the message now names the model's line the trace was at and says why a loop traces slowly."""
    m = tmp_path / "scan.py"
    m.write_text(SCAN_MODEL)
    line = SCAN_MODEL.splitlines().index(next(s for s in SCAN_MODEL.splitlines() if "THE-STEP" in s)) + 1
    # in a process of its own: should the trace not unwind within the watchdog's grace, the watchdog ends the process
    p = run_planner("inspect", m, "--tracer", "export", "--timeout", "8", timeout=120)
    code, err = p.returncode, p.stderr
    assert code == 2, err
    assert "did not finish tracing within 8 s" in err
    assert f"It was at scan.py line {line} (forward): state = self.a * state + x[:, t]" in err
    assert "Python loop" in err and "--timeout SECONDS (0: no limit)" in err and "Traceback" not in err


def test_timeout_value_checked(tmp_path):
    m = model_file(tmp_path)
    for bad in ("-1", "nan", "inf"):
        code, _, err = cli("inspect", m, "--timeout", bad)
        assert code == 2 and "--timeout" in err


def test_json_stays_json_whatever_the_model_prints(tmp_path):
    """issue: plan --json was not valid JSON when the model file printed."""
    m = model_file(tmp_path, prelude="import os\nprint('hello from import')\nos.write(1, b'raw fd write\\n')", build="print('building {')")
    p = run_planner("plan", m, "--gpus", "2xA100", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["layout"]["pp"] >= 1
    assert "hello from import" in p.stderr and "raw fd write" in p.stderr and "building {" in p.stderr
    p = run_planner("inspect", m, "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["totals"]["layers"] >= 1


# ----------------------------------------------------------------------------- 3. CLI values


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--pp", "0"], "--pp must be a whole number from 1"),
        (["--tp", "0"], "--tp must be"),
        (["--dp", "-3"], "--dp must be"),
        (["--vp", "-2"], "--vp must be"),
        (["--vp", "0"], "--vp must be"),
        (["--micro-batch", "0"], "--micro-batch must be"),
        (["--global-batch", "0"], "--global-batch must be"),
        (["--global-batch", "1000000000000"], "--global-batch must be"),
        (["--schedule", "bogus"], "Accepted: 1f1b"),
        (["--engine", "torch", "--schedule", "bogus"], "Accepted: gpipe, 1f1b"),
        (["--zero", "-1"], "Accepted: 0, 1"),
        (["--recompute", "some"], "Accepted: none"),
        (["--engine", "nope"], "Accepted: deepspeed, megatron, torch"),
        (["--dtype", "fp64"], "Accepted: bf16, fp16, fp32"),
        (["--tracer", "jit"], "Accepted: auto, fx, export"),
        (["--mem-target", "0"], "--mem-target must be a finite number"),
        (["--mem-target", "nan"], "--mem-target must be a finite number"),
        (["--mem-target", "1.5"], "--mem-target must be a finite number"),
        (["--gpus-per-node", "0"], "--gpus-per-node must be a positive"),
        (["--inter-node-gbps", "inf"], "--inter-node-gbps must be"),
    ],
)
def test_bad_values_exit_2_saying_what_is_accepted(tmp_path, extra, says):
    """issue: --pp 0 meant 'unset' (exit 0); --schedule bogus, --zero -1, --vp -2 exited 1."""
    m = model_file(tmp_path)
    code, out, err = cli("plan", m, "--gpus", "4xA100", *extra)
    assert code == 2, (code, out, err)
    assert says in err and "Traceback" not in err


@pytest.mark.parametrize(
    "args, says",
    [
        (["validate", ".", "--format", "bogus"], "Accepted: text, json, github"),
        (["smoke", ".", "--device", "bogus"], "Accepted: auto, cpu, cuda"),
        (["profile", "m.py", "--device", "tpu"], "Accepted: cuda, cpu"),
        (["inspect", "m.py", "--micro-batch", "0"], "--micro-batch must be"),
    ],
)
def test_other_commands_check_their_values(tmp_path, args, says):
    """issue: validate --format bogus and smoke --device bogus were internal errors (exit 3)."""
    model_file(tmp_path, "m.py")
    code, _, err = cli(*args, cwd=tmp_path)
    assert code == 2 and says in err


@pytest.mark.parametrize(
    "args, literal",
    [
        (["plan", "m.py", "--gpus", "8x[/bold]A100"], "[/bold]A100"),
        (["hardware", "show", "[/x]"], "[/x]"),
        (["inspect", "[/red]missing.py"], "[/red]missing.py"),
        (["explain", "[bold]nowhere[/]"], "[bold]nowhere[/]"),
        (["plan", "m.py", "--gpus", "2xA100", "--model-arg", "[/x]=1"], "[/x]=1"),
    ],
)
def test_user_text_is_printed_literally(tmp_path, args, literal):
    """issue: user text was read as rich markup and crashed with a traceback."""
    model_file(tmp_path, "m.py")
    code, _, err = cli(*args, cwd=tmp_path)
    assert code == 2 and literal in err and "internal error" not in err


def test_model_exception_message_printed_literally(tmp_path):
    m = model_file(tmp_path, build="raise ValueError('bad [/bold] value [red]')")
    code, _, err = cli("inspect", m)
    assert code == 2 and "bad [/bold] value [red]" in err


# ----------------------------------------------------------------------------- 2. plan directories


def snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_replanning_keeps_user_files(tmp_path, tiny_plan):
    """issue: re-planning deleted checkpoints, notes, smoke.json and the model file itself."""
    from planner.render import write_plan_dir

    plan, model = tiny_plan
    out = tmp_path / "plan"
    write_plan_dir(out, plan)
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "step1.pt").write_bytes(b"weights")
    (out / "notes.txt").write_text("mine")
    (out / "smoke.json").write_text("{}")
    shutil.copy(model, out / "model_copy.py")
    before = snapshot(out)
    notes = write_plan_dir(out, plan)
    after = snapshot(out)
    assert notes == []
    for keep in ("checkpoints/step1.pt", "notes.txt", "smoke.json", "model_copy.py"):
        assert after[keep] == before[keep]
    assert after == before  # same inputs: byte-identical, nothing else touched
    manifest = json.loads((out / ".planner").read_text())
    assert "notes.txt" not in manifest["files"] and "plan.json" in manifest["files"]


def test_files_the_planner_no_longer_renders_are_removed_others_kept(tmp_path, tiny_plan):
    """A file the manifest lists with the hash of its bytes is the planner's: removed when no longer rendered. One
    listed without a hash, or whose bytes changed since, is not: kept and named."""
    import hashlib

    from planner.render import write_plan_dir

    plan, _ = tiny_plan
    out = tmp_path / "plan"
    write_plan_dir(out, plan)
    manifest = json.loads((out / ".planner").read_text())
    for name, text in (("old_script.sh", "# ours once\n"), ("edited.sh", "# ours, then edited\n"), ("unhashed.sh", "# listed only\n")):
        (out / name).write_text(text)
        manifest["files"].append(name)
    manifest["sha256"]["old_script.sh"] = hashlib.sha256(b"# ours once\n").hexdigest()
    manifest["sha256"]["edited.sh"] = hashlib.sha256(b"# ours\n").hexdigest()
    (out / ".planner").write_text(json.dumps(manifest))
    (out / "user.sh").write_text("# theirs\n")
    notes = write_plan_dir(out, plan)
    assert not (out / "old_script.sh").exists() and (out / "user.sh").read_text() == "# theirs\n"
    assert (out / "edited.sh").read_text() == "# ours, then edited\n" and (out / "unhashed.sh").is_file()
    assert any("edited.sh (changed since" in n for n in notes) and any("unhashed.sh (listed by an older planner" in n for n in notes)


def test_foreign_files_are_not_shadowed_without_force(tmp_path, tiny_plan):
    """issue: any existing directory was replaced; a directory holding a bare .planner was treated as ours."""
    from planner.render import write_plan_dir

    plan, _ = tiny_plan
    out = tmp_path / "plan"
    out.mkdir()
    (out / "ds_config.json").write_text("my own config")
    (out / "keep.txt").write_text("x")
    with pytest.raises(UsageError, match="ds_config.json"):
        write_plan_dir(out, plan)
    assert (out / "ds_config.json").read_text() == "my own config" and not (out / "plan.json").exists()
    write_plan_dir(out, plan, force=True)
    assert (out / "ds_config.json").read_text() != "my own config" and (out / "keep.txt").read_text() == "x"


def test_cli_refuses_shadowing_with_exit_2(tmp_path):
    m = model_file(tmp_path)
    out = tmp_path / "plan"
    out.mkdir()
    (out / "README.md").write_text("mine")
    code, _, err = cli("plan", m, "--gpus", "2xA100", "--out", out, "-q")
    assert code == 2 and "README.md" in err and "--force" in err
    assert (out / "README.md").read_text() == "mine"
    code, _, _ = cli("plan", m, "--gpus", "2xA100", "--out", out, "-q", "--force")
    assert code == 0 and (out / "plan.json").is_file()


def test_model_file_is_never_overwritten_or_deleted(tmp_path, tiny_plan):
    from planner.render import write_plan_dir

    plan, _ = tiny_plan
    out = tmp_path / "plan"
    m = model_file(out, "plan.json")  # a model file named like a rendered file, inside --out
    text = m.read_text()
    from dataclasses import replace

    p2 = replace(plan, settings=plan.settings.but(model_file=str(m)))
    with pytest.raises(UsageError, match="model file"):
        write_plan_dir(out, p2, force=True)
    assert m.read_text() == text
    # a model file the old manifest listed (e.g. a hand-edited manifest) is not deleted either
    m2 = model_file(out, "model.py")
    p3 = replace(plan, settings=plan.settings.but(model_file=str(m2)))
    m.unlink()
    write_plan_dir(out, p3)
    man = json.loads((out / ".planner").read_text())
    man["files"].append("model.py")
    (out / ".planner").write_text(json.dumps(man))
    write_plan_dir(out, p3)
    assert m2.read_text() == text


def test_concurrent_writer_fails_cleanly(tmp_path, tiny_plan):
    """issue: concurrent --force writers raced silently."""
    from planner.render import write_plan_dir

    plan, _ = tiny_plan
    out = tmp_path / "plan"
    out.mkdir()
    with fileio.dir_lock(out), pytest.raises(UsageError, match="another planner process"):
        write_plan_dir(out, plan)
    write_plan_dir(out, plan)
    assert (out / "plan.json").is_file()


class Crash(BaseException):
    pass


def _steps_of_one_update(out: Path, plan) -> list[str]:
    from planner.render import write_plan_dir

    steps: list[str] = []
    fileio.STEP_HOOK = steps.append
    try:
        write_plan_dir(out, plan)
    finally:
        fileio.STEP_HOOK = None
    return steps


def test_interrupted_update_at_every_step_is_recovered(tmp_path, tiny_plan):
    """issue: a crash between the renames left the plan directory missing and .NAME.old/.NAME.tmp forever."""
    from dataclasses import replace

    from planner.render import write_plan_dir

    plan, _ = tiny_plan
    # the "new" plan differs from the old one in every rendered file's header and in one file more or less
    other = replace(plan, settings=plan.settings.but(mem_target=0.8))
    probe = tmp_path / "probe"
    write_plan_dir(probe, plan)
    steps = _steps_of_one_update(probe, other)
    assert len(steps) > 20 and "journal" in steps
    for k, step in enumerate(steps):
        out = tmp_path / f"run{k}"
        write_plan_dir(out, plan)
        (out / "mine.txt").write_text("user data")
        old_state = snapshot(out)

        def hook(name, k=k, seen=[0]):  # noqa: B006 - a counter per run
            if seen[0] == k:
                raise Crash(name)
            seen[0] += 1

        fileio.STEP_HOOK = hook
        try:
            with pytest.raises(Crash):
                write_plan_dir(out, other)
        finally:
            fileio.STEP_HOOK = None
        leftovers = sorted(p.name for p in out.iterdir() if p.name.startswith(".planner."))
        assert leftovers, step  # the interruption left its staging folders
        notes = fileio.recover_dir(out, ".planner")
        assert notes and all(".planner." in n for n in notes)
        state = snapshot(out)
        assert state["mine.txt"] == b"user data"
        new_state = snapshot(tmp_path / "probe")
        assert state == old_state or {k2: v for k2, v in state.items() if k2 != "mine.txt"} == new_state, step
        assert not [p for p in out.iterdir() if p.name.startswith(".planner.")]
        # and the next run goes through, naming nothing more
        assert write_plan_dir(out, other) == []
        assert snapshot(out)["mine.txt"] == b"user data"


def test_next_run_names_and_recovers_leftovers(tmp_path, tiny_plan):
    from planner.render import write_plan_dir

    plan, _ = tiny_plan
    out = tmp_path / "plan"
    write_plan_dir(out, plan)
    fileio.STEP_HOOK = lambda name: (_ for _ in ()).throw(Crash()) if name.startswith("aside") else None
    try:
        with pytest.raises(Crash):
            write_plan_dir(out, plan)
    finally:
        fileio.STEP_HOOK = None
    notes = write_plan_dir(out, plan)
    assert len(notes) == 1 and "rolled back" in notes[0] and ".planner.old." in notes[0]


def test_legacy_swap_leftovers_are_named_and_never_touched(tmp_path, tiny_plan):
    """The whole-directory swap of planner <= 0.x left ``.NAME.old.*`` / ``.NAME.tmp.*`` beside the plan directory:
    they are outside it, so they are named and left as they are (they may be anyone's)."""
    from planner.render import write_plan_dir

    plan, _ = tiny_plan
    out = tmp_path / "plan"
    write_plan_dir(out, plan)
    (out / "mine.txt").write_text("user data")
    os.replace(out, tmp_path / ".plan.old.abc123")
    (tmp_path / ".plan.tmp.def456").mkdir()
    (tmp_path / ".plan.tmp.def456" / "theirs.txt").write_text("x")
    notes = write_plan_dir(out, plan)
    assert any(".plan.old.abc123" in n for n in notes) and any(".plan.tmp.def456" in n for n in notes)
    assert (tmp_path / ".plan.old.abc123" / "mine.txt").read_text() == "user data"
    assert (tmp_path / ".plan.tmp.def456" / "theirs.txt").read_text() == "x"
    assert (out / "plan.json").is_file()


@pytest.mark.parametrize("make", ["file", "parent_file"])
def test_unusable_out_is_exit_2(tmp_path, make):
    """issue: an --out whose parent is a file was an internal error."""
    m = model_file(tmp_path)
    f = tmp_path / "afile"
    f.write_text("x")
    out = f if make == "file" else f / "sub"
    code, _, err = cli("plan", m, "--gpus", "2xA100", "--out", out, "-q")
    assert code == 2 and "file" in err and "internal error" not in err


def test_out_dot_with_force(tmp_path):
    """issue: --out . --force was an internal error."""
    m = model_file(tmp_path / "work")
    code, _, err = cli("plan", m, "--gpus", "2xA100", "--out", ".", "--force", "-q", cwd=tmp_path / "work")
    assert code == 0, err
    assert (tmp_path / "work" / "model.py").is_file() and (tmp_path / "work" / "plan.json").is_file()
    assert json.loads((tmp_path / "work" / "plan.json").read_text())["inputs"]["model_file"] == "model.py"


# ----------------------------------------------------------------------------- 5. canonical, reproducible renders


def test_renders_are_byte_identical_across_directories_checkouts_and_force(tmp_path):
    """issue: headers recorded --force, the working directory and an absolute model path."""
    a = tmp_path / "a" / "checkout"
    b = tmp_path / "b" / "deeper" / "checkout"
    for root in (a, b):
        model_file(root / "models")
    cli("plan", "models/model.py", "--gpus", "2xA100", "--pp", "2", "--out", "plans/p", "-q", cwd=a)
    cli("plan", b / "models" / "model.py", "--gpus", "2xA100", "--pp", "2", "--out", b / "plans" / "p", "--force", "-q", cwd=tmp_path)
    sa, sb = snapshot(a / "plans" / "p"), snapshot(b / "plans" / "p")
    assert sa.keys() == sb.keys() and len(sa) >= 9
    assert sa == sb
    text = sa["launch_torchrun.sh"].decode()
    assert "--force" not in text and str(tmp_path) not in text and "../../models/model.py" in text
    assert json.loads(sa["plan.json"])["inputs"]["model_file"] == "../../models/model.py"


def test_header_command_replans_to_the_same_bytes(tmp_path):
    """The canonical command in the headers, run in the plan directory, reproduces the directory."""
    m = model_file(tmp_path / "repo")
    code, _, err = cli("plan", m, "--gpus", "2xA100", "--engine", "torch", "--model-arg", "note=a b", "--out", tmp_path / "repo" / "plan", "-q")
    assert code == 0, err
    d = tmp_path / "repo" / "plan"
    before = snapshot(d)
    header = before["launch_torchrun.sh"].decode().splitlines()[1]
    import shlex

    words = shlex.split(header.split(": ", 1)[1])
    assert words[:3] == ["planner", "plan", "../model.py"] and "--out" in words and "note=a b" in words
    code, _, err = cli(*words[1:], "-q", cwd=d)
    assert code == 0, err
    assert snapshot(d) == before


def test_header_command_keeps_every_pin(tmp_path):
    """The header of a Megatron plan pinned on context parallelism, overlaps, precision options and FP8 primary weights
    re-plans to the same bytes: every pinned dimension is in the recorded command."""
    import shutil

    (tmp_path / "repo").mkdir()
    m = tmp_path / "repo" / "model.py"
    shutil.copy(Path(__file__).resolve().parents[2] / "examples" / "llama.py", m)
    pins = [
        "--model-arg",
        "preset=llama-tiny",
        "--dtype",
        "fp8",
        "--zero",
        "1",
        "--cp",
        "1",
        "--main-grads-dtype",
        "bf16",
        "--fp8-param-gather",
        "--no-overlap-param-gather",
    ]
    code, _, err = cli("plan", m, "--gpus", "2xH100", "--engine", "megatron", *pins, "--out", tmp_path / "repo" / "plan", "-q")
    assert code == 0, err
    d = tmp_path / "repo" / "plan"
    before = snapshot(d)
    import shlex

    words = shlex.split(before["launch_slurm.sh"].decode().splitlines()[1].split(": ", 1)[1])
    for flag in ("--cp", "--main-grads-dtype", "--fp8-param-gather", "--no-overlap-param-gather", "--zero", "--dtype"):
        assert flag in words, flag
    code, _, err = cli(*words[1:], "-q", cwd=d)
    assert code == 0, err
    assert snapshot(d) == before


def test_header_command_keeps_the_expert_parallel_overlap_pin(tmp_path):
    """A MoE plan pinned on --overlap-moe-expert-parallel-comm renders Megatron's flag, says so in report.md's overlaps, and
    its header command records the pin and re-plans to the same bytes."""
    import shlex
    import shutil

    (tmp_path / "repo").mkdir()
    m = tmp_path / "repo" / "model.py"
    shutil.copy(Path(__file__).resolve().parents[2] / "examples" / "moe.py", m)
    pins = ["--model-arg", "preset=moe-tiny", "--ep", "2", "--overlap-moe-expert-parallel-comm"]
    code, _, err = cli("plan", m, "--gpus", "4xH100", "--engine", "megatron", *pins, "--out", tmp_path / "repo" / "plan", "-q")
    assert code == 0, err
    d = tmp_path / "repo" / "plan"
    before = snapshot(d)
    assert "--overlap-moe-expert-parallel-comm" in before["pretrain_gpt.sh"].decode()
    assert "--overlap-moe-expert-parallel-comm" in before["report.md"].decode() and "combined 1F1B" in before["report.md"].decode()
    words = shlex.split(before["launch_slurm.sh"].decode().splitlines()[1].split(": ", 1)[1])
    assert "--overlap-moe-expert-parallel-comm" in words and "--ep" in words
    code, _, err = cli(*words[1:], "-q", cwd=d)
    assert code == 0, err
    assert snapshot(d) == before


def test_markup_in_model_args_is_escaped_in_reports(tmp_path):
    """issue: a --model-arg with --><script> ended raw in report.md and closed the README's header comment."""
    m = model_file(tmp_path)
    evil = "--><script>alert(1)</script>*x*"
    for engine in ("deepspeed", "torch", "megatron"):
        out = tmp_path / engine
        code, _, err = cli("plan", m, "--gpus", "2xA100", "--engine", engine, "--model-arg", f"note={evil}", "--out", out, "-q")
        if engine == "megatron":  # the tiny model has no architecture(): Megatron refuses it (exit 2), nothing else
            assert code == 2
            continue
        assert code == 0, err
        report = (out / "report.md").read_text()
        readme = (out / "README.md").read_text()
        outside_code = re.sub(r"(`+)(?s:.*?)\1", "", report)  # code spans are literal in Markdown
        assert "<script>" not in outside_code and "<script>" not in readme
        first = readme.splitlines()[0]
        assert first.startswith("<!--") and first.count("-->") == 1 and first.endswith("-->")
        assert "&lt;script&gt;" in report


def test_nothing_fits_advice_uses_the_resolved_cluster(tmp_path):
    """issue: with a custom --hardware-profile the advice re-parsed a spec by device key: exit 2 'unknown device'."""
    import yaml

    src = yaml.safe_load((ROOT / "hardware_profiles" / "a100-80gb.yaml").read_text())
    src["memory_gib"] = 0.001
    src["usable_memory_bytes"] = int(0.001 * 2**30)
    src["aliases"] = ["tinygpu"]
    src["name"] = "Tiny GPU"
    prof = tmp_path / "tiny-gpu.yaml"
    prof.write_text(yaml.safe_dump(src))
    m = model_file(tmp_path, build="pass")
    code, _, err = cli("plan", m, "--gpus", "1xtiny-gpu", "--hardware-profile", prof, "--model-arg", "dim=256", "-q")
    assert code == 1, err
    assert "unknown device" not in err and "No layout" in err


# ----------------------------------------------------------------------------- 4. bounded resources


def _bus_bandwidth_rank_by_rank(cluster, ranks):
    """The reference: the rank-by-rank computation the planner used before (kept here as the oracle)."""
    by_node: dict[int, tuple] = {}
    for r in sorted(set(ranks)):
        grp, node, loc = cluster._locate(r)
        by_node.setdefault(node, (grp, []))[1].append(loc)
    if len(by_node) == 1:
        ((g, local),) = by_node.values()
        if len(local) < 2:
            return math.inf, 0.0
        return cluster._intra_busbw(g.device, local), g.device.intra_latency
    inter = min(len(ls) * grp.inter_bandwidth * grp.device.allreduce_efficiency_inter for grp, ls in by_node.values())
    caps = [cluster._intra_busbw(grp.device, ls) for grp, ls in by_node.values() if len(ls) > 1]
    latency = max(g.device.inter_latency for g, _ in by_node.values())
    return min([inter, *caps]), latency


def test_bus_bandwidth_by_node_groups_matches_rank_by_rank():
    from planner.hardware import parse_gpus

    rng = random.Random(16)
    specs = ["8xA100", "2x8xA100", "4x4xV100+2x8xA100", "8xrtx-4090", "4x4xrtx-4090+8xH100", "3x2xL40S", "16xmi250x"]
    for spec in specs:
        c = parse_gpus(spec)
        for _ in range(60):
            n = rng.randint(1, c.world_size)
            kind = rng.random()
            if kind < 0.3:
                start, step = rng.randrange(c.world_size), rng.randint(1, 9)
                ranks = list(range(start, c.world_size, step))[:n]
            elif kind < 0.4:
                ranks = range(rng.randrange(c.world_size), c.world_size)
            else:
                ranks = rng.sample(range(c.world_size), n) * rng.randint(1, 2)  # duplicates and any order
            assert c.bus_bandwidth(ranks) == pytest.approx(_bus_bandwidth_rank_by_rank(c, list(ranks)), rel=1e-12), (spec, ranks)
            for nb in (0, 1e6):
                n_eff = len(set(ranks))
                bw, lat = _bus_bandwidth_rank_by_rank(c, list(ranks))
                want = 0.0 if n_eff == 1 or nb == 0 else 2 * (n_eff - 1) / n_eff * nb / bw + 2 * (n_eff - 1) * lat
                assert c.allreduce_time(nb, ranks) == pytest.approx(want, rel=1e-12)


def test_collectives_on_the_largest_cluster_take_milliseconds():
    from planner.hardware import parse_gpus
    from planner.hardware.gpus import MAX_WORLD_SIZE

    c = parse_gpus(f"{MAX_WORLD_SIZE // 8}x8xA100")
    ranks = list(range(c.world_size))  # rank by rank this took 120 ms per call; by node groups about 4 ms
    t0 = time.perf_counter()
    for _ in range(10):
        c.allreduce_time(1e9, ranks)
    assert (time.perf_counter() - t0) / 10 < 0.04


@pytest.mark.parametrize("spec", ["1000000x8xA100", "99999999999x1xH100", "9" * 5000 + "xA100", "131073xA100"])
def test_cluster_size_is_bounded(spec):
    """issue: --gpus 1000000x8xA100 and 99999999999x1xH100 ran for minutes."""
    t0 = time.monotonic()
    code, _, err = cli("plan", "m.py", "--gpus", spec)
    assert code == 2 and "--gpus" in err and time.monotonic() - t0 < 5


def _profiles_dir(tmp_path: Path) -> Path:
    d = tmp_path / "profiles"
    d.mkdir()
    shutil.copy(ROOT / "hardware_profiles" / "a100-80gb.yaml", d / "mine.yaml")
    return d


def test_fifo_and_symlink_loop_in_profile_folder_are_skipped_with_a_note(tmp_path):
    """issue: a FIFO in a profile folder blocked hardware list."""
    d = _profiles_dir(tmp_path)
    os.mkfifo(d / "pipe.yaml")
    os.symlink(d / "loop.yaml", d / "loop.yaml")
    p = run_planner("hardware", "list", "--hardware-profile", d, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "pipe.yaml: not a regular file" in p.stderr and "loop.yaml" in p.stderr and "mine" in p.stdout


def test_yaml_alias_bomb_and_deep_nesting_refused(tmp_path):
    """issue: YAML alias bombs exhausted memory."""
    bomb = tmp_path / "bomb.yaml"
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"] + [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 12)]
    bomb.write_text("\n".join(lines) + "\nname: *a11\n")
    code, _, err = cli("hardware", "list", "--hardware-profile", bomb)
    assert code == 2 and "alias" in err
    deep = tmp_path / "deep.yaml"
    deep.write_text("name: " + "[" * 500 + "]" * 500 + "\n")
    code, _, err = cli("hardware", "list", "--hardware-profile", deep)
    assert code == 2 and "nests deeper" in err


def test_absurd_profile_numbers_refused(tmp_path):
    """issue: a 1e300 TFLOP/s profile exhausted memory drawing the timeline."""
    import yaml

    src = yaml.safe_load((ROOT / "hardware_profiles" / "a100-80gb.yaml").read_text())
    src["peak_tflops"]["bf16"] = 1e300
    p = tmp_path / "fast.yaml"
    p.write_text(yaml.safe_dump(src))
    code, _, err = cli("hardware", "list", "--hardware-profile", p)
    assert code == 2 and "peak_tflops.bf16" in err and "at most" in err


@pytest.mark.parametrize(
    "content",
    [
        b"\xff\xfe not utf-8",
        b"[" * 100_000 + b"]" * 100_000,
        json.dumps({"schema_version": 1, "stages": []}).encode(),
        b'{"layout": {"pp": 0}, "stages": [], "inputs": null}',
        b"null",
    ],
)
def test_explain_on_broken_plan_json_is_exit_2(tmp_path, content):
    """issue: explain on stages: [], non-UTF-8 plan.json or 100k-deep JSON was an internal error."""
    (tmp_path / "plan.json").write_bytes(content)
    code, _, err = cli("explain", tmp_path)
    assert code == 2 and "internal error" not in err and "Traceback" not in err


def test_json_depth_and_bounded_loads():
    assert fileio.json_depth('{"a": [1, {"b": "[[["}]}') == 3
    with pytest.raises(UsageError, match="deeper"):
        fileio.loads_json_bounded("[" * 1000 + "]" * 1000, "x")
    assert fileio.loads_json_bounded('{"a": [1]}', "x") == {"a": [1]}


def test_validate_and_explain_refuse_fifos_and_huge_files(tmp_path):
    """issue: a 200 MB config took 205 s; a FIFO blocks any read."""
    d = tmp_path / "plan"
    d.mkdir()
    os.mkfifo(d / "ds_config.json")
    for args in (["validate", d], ["validate", d / "ds_config.json"], ["explain", d]):
        code, _, err = cli(*args)
        assert code == 2 and "not a regular file" in err
    big = tmp_path / "big" / "plan.json"
    big.parent.mkdir()
    with open(big, "wb") as f:
        f.truncate(fileio.MAX_INPUT_BYTES + 1)
    t0 = time.monotonic()
    code, _, err = cli("explain", big.parent)
    assert code == 2 and "bytes" in err and time.monotonic() - t0 < 5


@pytest.mark.parametrize(
    "prelude, build",
    [
        ("def architecture():\n    return 'gpt'", "pass"),  # architecture() returning a string
        ("", 'm = Net(dim, layers); m.blocks.add_module("q\'x\\n-->", nn.Identity()); return m'),  # a submodule name with quotes and a newline
    ],
)
def test_failures_on_user_code_are_exit_2(tmp_path, prelude, build):
    """issue: architecture() returning a string and submodule names with quotes or newlines were internal errors."""
    m = model_file(tmp_path, prelude=prelude, build=build)
    code, _, err = cli("plan", m, "--gpus", "2xA100", "-q")
    assert code == 2 and "model.py failed" in err and "internal error" not in err


def test_forked_child_still_exits_for_real():
    """Inside the guard, os._exit raises only in the planner's own process; a child the user code forks exits."""
    from planner.model.guard import guard_user_code

    with guard_user_code("model.py", None):
        pid = os.fork()
        if pid == 0:
            os._exit(7)
        _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 7
    assert os._exit.__module__ == "posix"  # restored


def test_watchdog_ends_a_hang_outside_python(tmp_path):
    """A model stuck in C code (a catastrophic regular expression) never returns to Python for SIGALRM: the
    watchdog still ends the run with exit 2 and the message, a few seconds after the limit."""
    m = model_file(tmp_path, prelude="import re\nre.match(r'(a+)+$', 'a' * 64 + 'b')")
    t0 = time.monotonic()
    p = run_planner("inspect", m, "--timeout", "1", timeout=90)
    assert p.returncode == 2 and "did not finish importing within 1 s" in p.stderr
    assert time.monotonic() - t0 < 60


def test_directory_with_the_old_bare_marker_is_upgraded_with_force(tmp_path, tiny_plan):
    """A plan directory written before the manifest (bare `.planner`): nothing says which files are the planner's, so
    replacing them takes --force; other files are kept either way."""
    from planner.render import render_files, write_plan_dir

    plan, _ = tiny_plan
    out = tmp_path / "plan"
    out.mkdir()
    for rel, text in render_files(plan, "planner plan old command", out).items():
        (out / rel).write_text(text)
    (out / ".planner").write_text("planner 0.1.0\n")
    (out / "notes.md").write_text("mine")
    with pytest.raises(UsageError, match="--force"):
        write_plan_dir(out, plan)
    assert "planner plan old command" in (out / "launch_torchrun.sh").read_text()
    write_plan_dir(out, plan, force=True)
    assert (out / "notes.md").read_text() == "mine"
    assert "notes.md" not in json.loads((out / ".planner").read_text())["files"]
    assert "planner plan old command" not in (out / "launch_torchrun.sh").read_text()


def test_hardware_profile_paths_are_recorded_relative_to_the_plan_directory(tmp_path):
    """A --hardware-profile typed relative to where `planner plan` ran is recorded relative to the plan directory (as
    the model file is), so the recorded command works there and validate finds the device from any directory."""
    import yaml

    src = yaml.safe_load((ROOT / "hardware_profiles" / "a100-80gb.yaml").read_text())
    src["aliases"] = ["mygpu"]
    src["name"] = "My GPU"
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "my-gpu.yaml").write_text(yaml.safe_dump(src))
    model_file(tmp_path, build="pass")
    code, _, err = cli("plan", "model.py", "--gpus", "2xmygpu", "--hardware-profile", "profiles/my-gpu.yaml", "--out", "plans/a", "-q", cwd=tmp_path)
    assert code == 0, err
    plan = json.loads((tmp_path / "plans" / "a" / "plan.json").read_text())
    assert plan["inputs"]["hardware_profiles"] == ["../../profiles/my-gpu.yaml"]
    assert "--hardware-profile ../../profiles/my-gpu.yaml" in (tmp_path / "plans" / "a" / "README.md").read_text()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code, out, err = cli("validate", tmp_path / "plans" / "a", "--model", tmp_path / "model.py", cwd=elsewhere)
    assert code == 0, out + err
    assert "unknown device" not in out + err


def test_the_line_a_limit_names_is_never_the_planner_s_own():
    """issue: RWKV's costing (planner code) outlasted the limit and the message named the console script ("It was at
    planner line 6 (<module>): sys.exit(main())"); frames of torch, the planner and its console script are skipped."""
    import sysconfig
    import traceback

    from planner.model import guard

    script = os.path.join(sysconfig.get_path("scripts"), "planner")
    frames = traceback.StackSummary.from_list([(script, 6, "<module>", "sys.exit(main())"), (guard.__file__, 10, "f", "x")])
    assert guard.model_line(frames) is None
    frames = traceback.StackSummary.from_list([(script, 6, "<module>", "x"), ("/src/m.py", 3, "forward", "y = f(x)"), (guard.__file__, 1, "g", "")])
    assert guard.model_line(frames) == "m.py line 3 (forward): y = f(x)"
