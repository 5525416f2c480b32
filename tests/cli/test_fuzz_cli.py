"""Fuzzing the command line (issue 16): the --gpus grammar, pins, model args, plan.json, ds_config text and launch
scripts. Whatever the input, the answer is exit 0, 1 or 2, never a traceback, within bounded time and memory.

Runs in well under a minute: every case stops before any model is traced (the model file does not exist, or the
value is refused first), and plan.json cases reuse one real plan directory.
"""

from __future__ import annotations

import json
import time
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from planner.cli import app
from planner.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow], derandomize=True)
#: per-example limits
MAX_SECONDS = 5.0
MAX_PYTHON_BYTES = 256 * 2**20


@pytest.fixture(scope="module", autouse=True)
def _imported():
    """Import torch and the planner's modules once, outside the per-example time limit."""
    import planner.check.validate
    import planner.planning
    import planner.report  # noqa: F401


def invoke(args: list[str]) -> tuple[int, str]:
    """Run the CLI in-process under the limits; returns (exit code, stderr)."""
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        r = CliRunner().invoke(app, args, catch_exceptions=True)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    elapsed = time.monotonic() - t0
    assert r.exception is None or isinstance(r.exception, SystemExit), f"{args!r} raised {r.exception!r}"
    assert r.exit_code in (0, 1, 2), (args, r.exit_code, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, (args, r.stderr[-2000:])
    assert elapsed < MAX_SECONDS, (args, elapsed)
    assert peak < MAX_PYTHON_BYTES, (args, peak)
    return r.exit_code, r.stderr


# ----------------------------------------------------------------------------- the value grammar

_device = st.sampled_from(["A100", "a100-80gb", "H100", "V100", "rtx-4090", "mi250x", "[/bold]A100", "", "x", "A100 ", "H100-PCIe", "l40s", "🙂"])
_count = st.one_of(st.integers(-5, 300).map(str), st.sampled_from(["0", "1.5", "+4", "-1", "1e3", "9" * 40, " 8 ", "00008"]))
_term = st.tuples(st.lists(_count, max_size=3), _device, st.sampled_from(["x", "X", "×", " x "])).map(lambda t: t[2].join([*t[0], t[1]]))
GPUS = st.one_of(st.lists(_term, min_size=1, max_size=3).map("+".join), st.text(max_size=40))


@FUZZ
@given(spec=GPUS)
def test_gpus_grammar(spec):
    from planner.hardware import parse_gpus

    try:
        c = parse_gpus(spec)
    except UsageError:
        return
    assert 1 <= c.world_size <= (1 << 17)


_PINS = st.sampled_from(["--pp", "--tp", "--dp", "--vp", "--micro-batch", "--global-batch", "--zero", "--gpus-per-node"])
_pin_value = st.one_of(st.integers(-(2**70), 2**70).map(str), st.sampled_from(["0", "-1", "nan", "1e9", "", "two", "3.0"]))


@FUZZ
@given(
    gpus=GPUS,
    pins=st.lists(st.tuples(_PINS, _pin_value), max_size=4),
    floats=st.lists(
        st.tuples(
            st.sampled_from(["--mem-target", "--inter-node-gbps", "--timeout"]),
            st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), st.just("nan")),
        ),
        max_size=2,
    ),
    names=st.lists(st.tuples(st.sampled_from(["--schedule", "--recompute", "--engine", "--dtype", "--tracer"]), st.text(max_size=12)), max_size=2),
)
def test_plan_flags(tmp_path, gpus, pins, floats, names):
    args = ["plan", str(tmp_path / "missing.py"), "--gpus", gpus]
    for flag, value in [*pins, *floats, *names]:
        args += [flag, value]
    code, _ = invoke(args)
    assert code == 2  # the model file does not exist: at best that is what is reported


_literal = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=10)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=8,
)
_arg_value = st.one_of(
    _literal.map(repr), st.text(max_size=30), st.sampled_from(["[" * 5000, "(" * 100 + ")" * 100, "1" * 5000, "-->" + "<script>", "x" * 5000])
)


@FUZZ
@given(pairs=st.lists(st.tuples(st.one_of(st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True), st.text(max_size=6)), _arg_value), max_size=3))
def test_model_args(tmp_path, pairs):
    args = ["inspect", str(tmp_path / "missing.py")]
    for k, v in pairs:
        args += ["--model-arg", f"{k}={v}"]
    code, _ = invoke(args)
    assert code == 2


# ----------------------------------------------------------------------------- files: plan.json, ds_config, launch scripts


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory):
    """One real plan directory (tiny GPT-2, DeepSpeed, pp 2) whose plan.json the cases mutate."""
    from planner.planning import plan_model
    from planner.render import write_plan_dir
    from planner.solve.settings import Settings

    d = tmp_path_factory.mktemp("fuzz") / "plan"
    plan, _, _ = plan_model(
        Settings.of(model_file=str(ROOT / "examples" / "gpt2.py"), model_args={"preset": "gpt2-tiny"}, gpus="4xA100", engine="deepspeed", pp=2)
    )
    write_plan_dir(d, plan)
    return d


_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**100), 2**100), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)


def _paths(doc, prefix=()):
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:3]):
            yield prefix + (i,)
            yield from _paths(v, prefix + (i,))


def _mutate(doc, path, value):
    target = doc
    for p in path[:-1]:
        target = target[p]
    target[path[-1]] = value
    return doc


@FUZZ
@given(data=st.data())
def test_plan_json_fields(plan_dir, tmp_path, data):
    """Any one field of a real plan.json replaced by any JSON value: explain answers 0, 1 or 2."""
    doc = json.loads((plan_dir / "plan.json").read_text())
    paths = list(_paths(doc))
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        try:
            _mutate(doc, path, data.draw(_json))
        except (KeyError, IndexError, TypeError):  # an earlier mutation removed the parent
            pass
    d = tmp_path / "p"
    d.mkdir(exist_ok=True)
    (d / "plan.json").write_text(json.dumps(doc))
    invoke(["explain", str(d)])


@FUZZ
@given(text=st.one_of(_json.map(json.dumps), st.text(max_size=200), st.sampled_from(["[" * 100_000, '{"a":' * 50_000, "\ufeff{}"])))
def test_plan_json_text(tmp_path, text):
    d = tmp_path / "p"
    d.mkdir(exist_ok=True)
    (d / "plan.json").write_text(text)
    invoke(["explain", str(d)])


_DS_KEYS = [
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "zero_optimization",
    "bf16",
    "fp16",
    "pipeline",
    "gradient_clipping",
    "optimizer",
    "steps_per_print",
    "wall_clock_breakdown",
    "fp16.loss_scale",
]


@FUZZ
@given(base=st.booleans(), changes=st.dictionaries(st.sampled_from(_DS_KEYS), _json, max_size=4))
def test_ds_config(plan_dir, tmp_path, base, changes):
    doc = json.loads((plan_dir / "ds_config.json").read_text()) if base else {}
    doc.update(changes)
    f = tmp_path / "ds_config.json"
    f.write_text(json.dumps(doc))
    invoke(["validate", str(f), "--pp", "2", "--gpus", "4xA100"])


_shell_words = st.sampled_from(
    [
        "torchrun",
        "pretrain_gpt.py",
        "--tensor-model-parallel-size",
        "--pipeline-model-parallel-size",
        "2",
        "4",
        "0",
        "-1",
        "--micro-batch-size",
        "--global-batch-size",
        "--num-layers",
        "$A",
        "${B:-",
        "}",
        '"',
        "'",
        "\\\n",
        "A=$A$A",
        "$(cmd)",
        "&&",
        "|",
        ";",
        "\n",
        "*",
        "{1..99999999}",
        "--bf16",
        "--fp16",
        "<<EOF",
        "EOF",
        "${#A}",
        "$((1<<60))",
    ]
)


@FUZZ
@given(words=st.lists(_shell_words, max_size=40), prefix=st.booleans())
def test_launch_scripts(tmp_path, words, prefix):
    f = tmp_path / "pretrain_gpt.sh"
    f.write_text(("#!/bin/bash\n" if prefix else "") + " ".join(words) + "\n")
    invoke(["validate", str(f), "--gpus", "8xA100"])
