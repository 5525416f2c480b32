"""Interleaved micro-batch groups (Megatron's --microbatch-group-size-per-virtual-pipeline-stage): which groups the
search tries, the memory a group holds, the rendered flag, and the refusals.

The reference for what Megatron accepts is forward_backward_pipelining_with_interleaving's own two checks
(megatron-core core_v0.16.1 pipeline_parallel/schedules.py): a ValueError unless p <= group <= m, and a RuntimeError
when the last group holds 0 < m % group < p micro-batches. The order of every accepted group is compared with
megatron-core's schedule table in tests/solve/test_schedules.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.cli import app
from planner.engines import get_engine
from planner.solve.rank_memory import order_points

ROOT = Path(__file__).resolve().parents[2]
LLAMA = str(ROOT / "examples" / "llama.py")
TINY_MEGATRON = ["--model-arg", "preset=llama-tiny", "--gpus", "2xA100", "--engine", "megatron", "--pp", "2", "--dp", "1", "--micro-batch", "1"]
MEGATRON = get_engine("megatron")
runner = CliRunner()


def megatron_accepts(p: int, m: int, group: int) -> bool:
    """Megatron's two checks on the group, as its interleaved schedule makes them."""
    return p <= group <= m and not (0 < m % group < p)


@pytest.mark.parametrize("p", [2, 3, 4, 8, 16])
def test_megatron_tries_its_smallest_accepted_group(p):
    for m in range(p, 4 * p + 3):
        groups = MEGATRON.interleaved_groups(p, m)
        if m % p == 0:
            assert groups == (0,) and megatron_accepts(p, m, p)  # the default group, p
            continue
        accepted = [g for g in range(1, m + 1) if megatron_accepts(p, m, g)]
        assert not megatron_accepts(p, m, p)  # the default group fails whenever p does not divide m
        assert groups == (accepted[0],), (p, m)
        assert MEGATRON.runtime_schedule_problems("interleaved", p, m, 2, groups[0]) == []


@pytest.mark.parametrize("p", [2, 3, 4, 6])
def test_megatron_refuses_exactly_the_groups_megatron_refuses(p):
    for m in range(1, 3 * p + 2):
        for g in range(1, m + 1):
            problems = MEGATRON.runtime_schedule_problems("interleaved", p, m, 2, g)
            assert (problems == []) == megatron_accepts(p, m, g), (p, m, g, problems)


@pytest.mark.parametrize("p,m,v,g", [(4, 22, 2, 6), (4, 12, 3, 6), (2, 5, 2, 3), (8, 24, 2, 12), (4, 8, 4, 8)])
def test_a_rank_holds_megatrons_warmup_plus_one(p, m, v, g):
    """The memory count points of the group's order: rank r's peak is Megatron's warm-up count
    (p - r - 1) x 2 + (v - 1) x group (get_pp_rank_microbatches), plus the forward that runs before its first
    backward, at most all v x m chunk passes."""
    pts = order_points("interleaved", p, m, v, g)
    for r in range(p):
        warm = min((p - r - 1) * 2 + (v - 1) * g, v * m)
        assert pts[r].held.sum(axis=1).max() == min(warm + 1, v * m), r


def test_megatron_plans_and_renders_a_micro_batch_count_pp_does_not_divide(tmp_path):
    out = tmp_path / "plan"
    r = runner.invoke(app, ["plan", LLAMA, *TINY_MEGATRON, "--global-batch", "5", "--schedule", "interleaved", "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    lay = json.loads((out / "plan.json").read_text())["layout"]
    # 5 micro-batches on 2 ranks: the default group (2) leaves a last group of 1; 3 is the smallest Megatron takes
    assert (lay["schedule"], lay["num_microbatches"], lay["microbatch_group"]) == ("interleaved", 5, 3)
    script = (out / "pretrain_gpt.sh").read_text()
    assert "--microbatch-group-size-per-virtual-pipeline-stage 3" in script
    # Megatron's warm-up on rank 0: (v - 1) x group + 2 (p - 1) = 3 + 2
    assert "rank 0 runs 5 forwards before its first backward" in " ".join((out / "report.md").read_text().split())
    v = runner.invoke(app, ["validate", str(out), "--model", LLAMA, "--model-arg", "preset=llama-tiny"])
    assert v.exit_code == 0, v.output
    assert "0 error(s)" in v.output and "MEM003" not in v.output  # the group's memory is checked, not skipped


def test_a_pinned_group_is_rendered_and_a_default_one_is_not(tmp_path):
    r = runner.invoke(app, ["plan", LLAMA, *TINY_MEGATRON, "--global-batch", "4", "--microbatch-group", "4", "--out", str(tmp_path / "a"), "-q"])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "a" / "plan.json").read_text())["layout"]["microbatch_group"] == 4
    assert "--microbatch-group-size-per-virtual-pipeline-stage 4" in (tmp_path / "a" / "pretrain_gpt.sh").read_text()
    r = runner.invoke(app, ["plan", LLAMA, *TINY_MEGATRON, "--global-batch", "4", "--microbatch-group", "2", "--out", str(tmp_path / "b"), "-q"])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "b" / "plan.json").read_text())["layout"]["microbatch_group"] == 0  # p: Megatron's default
    assert "--microbatch-group-size" not in (tmp_path / "b" / "pretrain_gpt.sh").read_text()


@pytest.mark.parametrize(
    "extra,words",
    [
        (["--microbatch-group", "1"], "must lie in [p, m] = [2, 5]"),
        (["--microbatch-group", "3", "--schedule", "1f1b"], "applies to the interleaved schedule"),
        (["--microbatch-group", "3", "--engine", "torch"], "Use --engine megatron"),
        (["--microbatch-group", "0"], "--microbatch-group must be a whole number"),
    ],
)
def test_groups_no_engine_runs_are_refused(extra, words):
    r = runner.invoke(app, ["plan", LLAMA, *TINY_MEGATRON, "--global-batch", "5", "-q", *extra])
    assert r.exit_code in (1, 2), r.output
    assert words in " ".join(r.output.split()), r.output
