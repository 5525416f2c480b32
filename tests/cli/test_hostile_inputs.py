"""Hostile and careless inputs: tampered plan.json values, unbounded numbers, FIFOs, control characters and markup in
every value that reaches a file, and model files that misbehave at the process level. Each ends in exit 0, 1 or 2
with no traceback and no hang; no file is written where it should not be.

References: the formats' own parsers (xml.dom.minidom for the SVGs, markdown-it for report.md and the README, the
JSON of ``--json`` with json.loads) and the process's real exit status (the CLI run as a subprocess, as a user runs it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import xml.dom.minidom
from pathlib import Path

import pytest

from planner.check.validate import Options, validate
from tests.conftest import model_file

PY = sys.executable


def cli(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The planner as a user runs it: its own process, its real exit status."""
    return subprocess.run([PY, "-m", "planner", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=timeout)


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("plan")
    m = model_file(d)
    r = cli("plan", m, "--gpus", "2xA100", "--out", d / "plan", "--quiet")
    assert r.returncode == 0, r.stderr
    return d / "plan"


def _tampered(plan_dir: Path, tmp_path: Path, text: str) -> Path:
    d = tmp_path / "t"
    shutil.copytree(plan_dir, d)
    (d / "plan.json").write_text(text)
    return d


@pytest.mark.parametrize(
    "edit,says",
    [
        (lambda t: t.replace('"global_batch": 16', '"global_batch": ' + "9" * 5000, 1), "5,000 digits"),
        (lambda t: t[: t.rindex("}")] + ', "layout": {}}', "twice"),
        (lambda t: t.replace('"mem_target": 0.85', '"mem_target": NaN', 1), "NaN"),
        (lambda t: t.replace('"hardware_profiles": []', '"hardware_profiles": ["/dev/zero", "../../../etc/passwd"]', 1), "outside the repository"),
    ],
)
def test_validate_refuses_tampered_plan_json_as_plan_would(plan_dir, tmp_path, edit, says):
    text = (plan_dir / "plan.json").read_text()
    changed = edit(text)
    assert changed != text
    d = _tampered(plan_dir, tmp_path, changed)
    found = validate([d], Options())
    errors = [f for f in found.findings if f.severity == "error"]
    assert errors and any(f.rule == "PLAN005" and says in f.message for f in errors), [str(f) for f in found.findings]


def test_a_recorded_model_file_is_never_imported(plan_dir, tmp_path):
    """inputs.model_file = /etc/passwd: validate imports only the model --model names, and says so."""
    text = (plan_dir / "plan.json").read_text()
    changed = text.replace('"model_file": "../model.py"', '"model_file": "/etc/passwd"', 1)
    assert changed != text
    found = validate([_tampered(plan_dir, tmp_path, changed)], Options())
    assert not [f for f in found.findings if f.severity == "error"]
    assert any(f.rule == "MEM003" and "only when --model names it" in f.message for f in found.findings)


def test_explain_refuses_absurd_plans_quickly(plan_dir, tmp_path):
    doc = json.loads((plan_dir / "plan.json").read_text())
    doc["stages"] = doc["stages"] * 50_000
    d = _tampered(plan_dir, tmp_path, json.dumps(doc))
    start = time.monotonic()
    r = cli("explain", d)
    assert r.returncode == 2 and "stages" in r.stderr and "Traceback" not in r.stderr
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("flag,value", [("--tensor-model-parallel-size", "0"), ("--micro-batch-size", "0"), ("--num-layers", str(10**30))])
def test_megatron_sizes_out_of_range_are_refused(flag, value):
    from planner.engines.megatron.architecture import check_megatron_args
    from planner.engines.megatron.script import parse_megatron_args

    base = {"--num-layers": "4", "--hidden-size": "64", "--num-attention-heads": "4", "--seq-length": "32", "--max-position-embeddings": "32"}
    base.update({"--micro-batch-size": "1", "--global-batch-size": "8", flag: value})
    words = " ".join(f"{k} {v}" for k, v in base.items())
    args = parse_megatron_args(f"torchrun --nproc-per-node 8 pretrain_gpt.py {words}\n", execute=False)
    assert any(f.rule == "MEG027" and flag in f.message for f in check_megatron_args(args, 8))


def test_fifos_and_devices_are_refused_by_type_in_under_a_second(plan_dir, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for args in (
        ["calibrate", "--log", fifo, plan_dir, "--name", "x", "--out", tmp_path / "x.yaml"],
        ["plan", plan_dir.parent / "model.py", "--gpus", "2xA100", "--hardware-profile", fifo],
        ["plan", plan_dir.parent / "model.py", "--gpus", "2xA100", "--hardware-profile", "/dev/zero"],
    ):
        start = time.monotonic()
        r = cli(*args, timeout=30)
        assert r.returncode == 2 and "not a regular file" in r.stderr, (args, r.stderr)
        assert time.monotonic() - start < 20  # the interpreter's start-up included; the refusal itself is immediate


HOSTILE_ARG = "note=a\x1c\x0b\x0c\x1b[31m<script>alert(1)</script><img src=x onerror=alert(1)> \u2028z [bold]b[/bold]"


def test_control_characters_and_markup_in_a_model_argument(tmp_path):
    """The SVGs stay well-formed XML, report.md and the README carry no HTML of the value (rendered by a real Markdown
    parser), nothing writes a raw control character, and the fresh plan passes its own drift check."""
    from markdown_it import MarkdownIt

    m = model_file(tmp_path, prelude="", build="pass")
    out = tmp_path / "plan"
    r = cli("plan", m, "--gpus", "2xA100", "--model-arg", HOSTILE_ARG, "--out", out, "--quiet")
    assert r.returncode == 0, r.stderr
    for svg in out.glob("*.svg"):
        xml.dom.minidom.parse(str(svg))
    md = MarkdownIt("commonmark")
    for name in ("report.md", "README.md"):
        text = (out / name).read_text()
        html = md.render(text)
        assert "<script" not in html and "onerror" not in html.replace("onerror=alert(1)&gt;", "").replace("onerror=alert\\(1\\)", ""), name
        assert not [c for c in text if (ord(c) < 32 and c not in "\n\t") or c in "\u2028\u2029\x85"], name
    found = validate([out], Options(model=str(m), model_args={"note": HOSTILE_ARG[5:]}))
    assert [f for f in found.findings if f.severity == "error"] == [], [str(f) for f in found.findings]


PRELUDES = {
    "atexit": 'import atexit\natexit.register(lambda: print("ATEXIT"))',
    "del": "class _D:\n    def __del__(self):\n        print('DEL')\n_d = _D()",
    "fork": "import os\nif os.fork() == 0:\n    print('CHILD')\n    os._exit(0)",
    "thread": "import threading\nthreading.Timer(0.2, lambda: print('TIMER')).start()",
}


@pytest.mark.parametrize("kind", sorted(PRELUDES))
def test_json_stays_json_whatever_the_model_prints_after_it(tmp_path, kind):
    m = model_file(tmp_path, prelude=PRELUDES[kind])
    r = cli("plan", m, "--gpus", "2xA100", "--json")
    assert r.returncode == 0, r.stderr
    json.loads(r.stdout)


def test_a_model_that_changes_directory_does_not_move_the_output(tmp_path):
    m = model_file(tmp_path, prelude="import os\nos.chdir('/')")
    r = cli("plan", m, "--gpus", "2xA100", "--out", "rel_out", "--quiet", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "rel_out" / "plan.json").is_file() and not Path("/rel_out").exists()


@pytest.mark.parametrize(
    "build,says",
    [
        ("class E(BaseException): pass\n    raise E('boom')", "BaseException"),
        ("raise GeneratorExit()", "GeneratorExit"),
        ("import os; os.abort()", "os.abort()"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", "SIGTERM"),
    ],
)
def test_a_model_that_ends_the_process_is_exit_2_without_a_traceback(tmp_path, build, says):
    m = model_file(tmp_path, build=build)
    r = cli("plan", m, "--gpus", "2xA100", "--quiet")
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_thread_that_never_ends_does_not_hang_the_command(tmp_path):
    m = model_file(tmp_path, prelude="import threading, time\nthreading.Thread(target=lambda: time.sleep(10**6)).start()")
    start = time.monotonic()
    r = cli("plan", m, "--gpus", "2xA100", "--quiet", timeout=60)
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - start < 60


def test_a_build_that_holds_the_interpreter_is_stopped_from_outside(tmp_path):
    """sum(range(10**12)) is one C loop that never releases the GIL nor checks for signals: neither SIGALRM's handler nor the watchdog thread can run;
    the watchdog process ends the command with exit 2 and the message, within the limit plus both graces."""
    from planner.model.guard import OUTSIDE_GRACE_S, WATCHDOG_GRACE_S

    m = model_file(tmp_path, build="x = sum(range(10 ** 12))")
    t = time.monotonic()
    # a limit of 5 s: the import before the build must finish within it on a loaded machine (at 1 s it did not once)
    r = cli("plan", m, "--gpus", "2xA100", "--quiet", "--timeout", "5", timeout=90)
    took = time.monotonic() - t
    assert r.returncode == 2, r.stderr
    assert "held the interpreter" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert took < 5 + WATCHDOG_GRACE_S + OUTSIDE_GRACE_S + 15, took
