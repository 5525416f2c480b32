"""The CLI's explain, validate, hardware and profile commands, run as a user runs them (a subprocess each),
checked against the records they print from (plan.json, the hardware profiles, profile.json)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from planner import hardware

ROOT = Path(__file__).resolve().parents[2]
GPT2 = ROOT / "examples" / "gpt2.py"
TINY = ["--model-arg", "preset=gpt2-tiny"]


def planner(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {"COLUMNS": "200", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "planner", *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def ds_plan(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("cli")
    r = planner("plan", str(GPT2), *TINY, "--gpus", "4xA100", "--engine", "deepspeed", "--pp", "2", "--out", "plan", "--quiet", cwd=work)
    assert r.returncode == 0, r.stderr
    return work / "plan"


def test_explain_prints_the_plans_own_figures(ds_plan):
    doc = json.loads((ds_plan / "plan.json").read_text())
    r = planner("explain", str(ds_plan), cwd=ds_plan.parent)
    assert r.returncode == 0, r.stderr
    shown = re.search(r"predicted step ([0-9.]+) (ms|s)\b", r.stdout)
    assert shown, r.stdout
    value_s = float(shown.group(1)) * (1e-3 if shown.group(2) == "ms" else 1.0)
    step = doc["predicted"]["step_time_s"]
    assert value_s == pytest.approx(step, rel=0.1, abs=0.006e-3)  # printed to 2-3 significant digits
    lay = doc["layout"]
    assert f"pp{lay['pp']} tp{lay['tp']} dp{lay['dp']}" in r.stdout


def test_explain_of_a_missing_plan_is_a_usage_error(tmp_path):
    r = planner("explain", str(tmp_path / "nothing"), cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr + r.stdout


def test_validate_passes_a_fresh_plan_and_names_the_rule_a_tampered_config_breaks(ds_plan, tmp_path):
    r = planner("validate", str(ds_plan), "--format", "json", cwd=ds_plan.parent)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not [f for f in json.loads(r.stdout) if f["severity"] == "error"]
    # DeepSpeed's batch rule: train_batch_size = micro x gradient accumulation x data-parallel size
    bad = tmp_path / "ds_config.json"
    cfg = json.loads((ds_plan / "ds_config.json").read_text())
    cfg["train_batch_size"] += 1
    bad.write_text(json.dumps(cfg))
    r = planner("validate", str(bad), "--pp", "2", "--gpus", "4xA100", "--format", "json", cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    errors = [f for f in json.loads(r.stdout) if f["severity"] == "error"]
    assert errors and any("train_batch_size" in f["message"] for f in errors)


def test_hardware_list_and_show_print_the_profiles(tmp_path):
    profiles = hardware.available_profiles()
    r = planner("hardware", "list", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for key, p in profiles.items():
        assert key in r.stdout
    r = planner("hardware", "show", "A100-80GB", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    a100 = profiles["a100-80gb"]
    assert f"{a100.peak_flops['bf16'] / 1e12:g} TFLOP/s" in r.stdout
    assert a100.sources["memory_bandwidth_gbps"].split()[0] in r.stdout
    r = planner("hardware", "show", "A100-80", cwd=tmp_path)  # not a name: suggestions, exit 2
    assert r.returncode == 2 and "a100-80gb" in (r.stdout + r.stderr).lower()


def test_profile_on_cpu_feeds_plan(tmp_path):
    r = planner("profile", str(GPT2), *TINY, "--device", "cpu", "--warmup", "1", "--repeats", "3", "--out", "profile.json", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads((tmp_path / "profile.json").read_text())
    assert doc["device"]["type"] == "cpu" and doc["pieces"]
    assert all(p["fwd_s"]["median"] > 0 and p["bwd_s"]["median"] > 0 for p in doc["pieces"])
    r = planner("plan", str(GPT2), *TINY, "--gpus", "2xcpu", "--engine", "torch", "--dtype", "fp32", "--profile", "profile.json", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert "measured" in plan["assumptions"]["time_sources"]


def test_plan_dtype_fp8_plans_on_h100_and_is_refused_on_a100(tmp_path):
    """`--dtype fp8` reaches the planner: on H100 the plan records FP8 GEMMs and Megatron's FP8 flags; A100 has no FP8
    tensor cores (its profile lists no fp8 peak), which is a usage error naming the GPU, not an unknown dtype."""
    args = ("plan", str(ROOT / "examples" / "llama.py"), "--model-arg", "preset=llama-tiny", "--engine", "megatron", "--dtype", "fp8", "--quiet")
    r = planner(*args, "--gpus", "2xH100", "--out", "h100", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "h100" / "plan.json").read_text())
    assert doc["layout"]["fp8"] is True
    assert "--fp8-format" in (tmp_path / "h100" / "pretrain_gpt.sh").read_text()
    r = planner(*args, "--gpus", "2xA100", "--out", "a100", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "FP8 tensor cores" in r.stderr and "A100" in r.stderr and "not accepted" not in r.stderr
    assert not (tmp_path / "a100").exists()
