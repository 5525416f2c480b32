"""The torch.distributed.pipelining renderer: golden files, determinism, shell safety, placement, schedule checks, real runs.

Real runs start the rendered train_torch.py once per rank (the environment
torchrun would set: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) with gloo
on the CPU and compare the losses with planner.runners.reference. Fixture plans
are plan.json files made by the commands in PLANS; ``UPDATE_GOLDEN=1``
re-makes them and the golden files.
"""

from __future__ import annotations

import ast
import json
import os
import runpy
import shlex
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from planner.engines.torch import runner as rt
from planner.engines.torch.render import render as render_torch
from planner.errors import UsageError
from planner.fileio import dumps_json
from planner.runners.reference import reference_losses
from planner.runtime import load_planned_model
from planner.solve.plan import Plan
from planner.solve.schedules import build_schedule

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "torch"
GOLDEN = FIXTURES / "golden"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"

GPT2 = "examples/gpt2.py --model-arg preset=gpt2-tiny"
PLANS = {  # fixture name: the planner arguments that made it (with --engine torch --json)
    "gpt2_zbv": f"{GPT2} --gpus 2xcpu --schedule zbv",
    "gpt2_interleaved": f"{GPT2} --gpus 2xcpu --pp 2 --vp 2 --schedule interleaved",
    "gpt2_1f1b": f"{GPT2} --gpus 2xcpu --pp 2 --schedule 1f1b",
    "gpt2_gpipe": f"{GPT2} --gpus 2xcpu --pp 2 --schedule gpipe",
    "gpt2_zbh1": f"{GPT2} --gpus 2xcpu --pp 2 --schedule zb-h1",
    "gpt2_pp2dp2": f"{GPT2} --gpus 4xcpu --pp 2 --dp 2 --schedule 1f1b",
    "gpt2_zbv_recompute": f"{GPT2} --gpus 2xcpu --schedule zbv --recompute full",
    "llama_1f1b": "examples/llama.py --model-arg preset=llama-tiny --gpus 2xcpu --pp 2 --schedule 1f1b",
    "resnet_fpn_zbv": "examples/resnet.py --model-arg preset=resnet-tiny --model-arg head=fpn --gpus 2xcpu --schedule zbv",
}
GOLDEN_PLANS = ["resnet_fpn_zbv"]  # one golden directory (V schedule, skip connections); the others are checked by meaning


def command_for(name: str) -> str:
    return f"planner plan {PLANS[name]} --engine torch --out {name}"


@pytest.fixture(scope="session")
def fixture_plans() -> None:
    """With UPDATE_GOLDEN=1, re-make the fixture plans with the planner's CLI (alternatives dropped: not read here)."""
    if not UPDATE:
        return
    for name, args in PLANS.items():
        out = subprocess.run(
            [sys.executable, "-m", "planner", "plan", *shlex.split(args), "--engine", "torch", "--json"],
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        doc = json.loads(out)
        doc["alternatives"] = []
        (FIXTURES / f"{name}.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def load_fixture(name: str) -> Plan:
    doc = json.loads((FIXTURES / f"{name}.json").read_text())
    doc["inputs"]["model_file"] = str(REPO / doc["inputs"]["model_file"])
    return Plan.from_dict(doc)


def render(name: str, out_dir: Path | None = None, plan: Plan | None = None) -> dict[str, str]:
    plan = plan or load_fixture(name)
    return render_torch(plan, command_for(name), out_dir or REPO / "plans" / name)


# ----------------------------------------------------------------------------- rendering


GOLDEN_FILES = ["README.md", "train_torch.py"]  # the launchers come from planner/render/launch.py's templates (tested there);
# what this renderer passes them is checked by test_hostile_model_path_is_one_argument_and_never_runs


@pytest.mark.parametrize("name", GOLDEN_PLANS)
def test_golden_files(name, fixture_plans):
    files = render(name)
    assert sorted(files) == ["README.md", "launch_slurm.sh", "launch_torchrun.sh", "train_torch.py"]
    folder = GOLDEN / name
    if UPDATE:
        folder.mkdir(parents=True, exist_ok=True)
        for rel in GOLDEN_FILES:
            (folder / rel).write_text(files[rel])
    for rel in GOLDEN_FILES:
        assert files[rel] == (folder / rel).read_text(), f"{name}/{rel} differs from the golden file (UPDATE_GOLDEN=1 re-makes it)"


def test_render_is_deterministic(fixture_plans):
    a = render("gpt2_interleaved")
    b = render("gpt2_interleaved", plan=Plan.from_dict(load_fixture("gpt2_interleaved").to_dict()))
    assert a == b
    for text in a.values():
        assert str(REPO) not in text  # no absolute path of this machine


def test_script_states_the_plan(fixture_plans):
    script = render("gpt2_zbv")["train_torch.py"]
    tree = ast.parse(script)
    consts = {t.id: ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if t.id in ("MODEL_PATH", "PLANNED")}
    assert consts["MODEL_PATH"] == "../../examples/gpt2.py"
    assert consts["PLANNED"]["schedule"] == "zbv"
    assert consts["PLANNED"]["stage_ranks"] == [0, 1, 1, 0]
    assert "ScheduleZBVZeroBubble" in script
    assert script.startswith("#!/usr/bin/env python3\n# Generated by planner ")
    readme = render("gpt2_zbv")["README.md"]
    assert "planner" in readme and "launch_torchrun.sh" in readme and "selective" not in readme.split("## Assumptions")[0].split("Recomputation")[1]


def test_refuses_plans_torch_cannot_run(fixture_plans):
    doc = load_fixture("gpt2_1f1b").to_dict()
    doc["layout"]["engine"] = "deepspeed"
    with pytest.raises(UsageError, match="engine"):
        render_torch(Plan.from_dict(doc), "planner plan", None)
    doc = load_fixture("gpt2_1f1b").to_dict()
    doc["layout"]["tp"] = 2
    with pytest.raises(UsageError, match="tensor parallel"):
        render_torch(Plan.from_dict(doc), "planner plan", None)


HOSTILE = 'my model\'s "dir"/$(touch x)/model.py'


def test_hostile_model_path_is_one_argument_and_never_runs(tmp_path, fixture_plans):
    doc = load_fixture("gpt2_zbv").to_dict()
    doc["inputs"]["model_file"] = str(tmp_path / HOSTILE)
    out = tmp_path / "plan"
    files = render_torch(Plan.from_dict(doc), f"planner plan {shlex.quote(HOSTILE)} --engine torch\n$(touch y)", out)
    out.mkdir()
    for rel, text in files.items():
        (out / rel).write_text(text)
        if rel.endswith(".sh"):
            os.chmod(out / rel, 0o755)
            subprocess.run(["bash", "-n", str(out / rel)], check=True)
    # The Python script: the path is a Python string literal, the command stays a comment.
    tree = ast.parse(files["train_torch.py"])
    consts = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets}
    assert ast.literal_eval(consts["MODEL_PATH"]) == "../" + HOSTILE
    for rel, text in files.items():
        for line in text.splitlines():
            if "touch y" in line:
                assert line.lstrip().startswith(("#", "<!--")), (rel, line)
    # launch_torchrun.sh with a fake torchrun that prints its arguments, NUL-separated.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "torchrun").write_text("#!/usr/bin/env bash\nprintf '%s\\0' \"$@\"\n")
    os.chmod(fake / "torchrun", 0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
    res = subprocess.run([str(out / "launch_torchrun.sh"), "--steps", "2"], capture_output=True, env=env, cwd=tmp_path, check=True)
    argv = res.stdout.decode().split("\0")[:-1]
    i = argv.index("train_torch.py")
    assert argv[i:] == ["train_torch.py", "--plan", "plan.json", "--model", "../" + HOSTILE, "--steps", "2"]
    assert not list(tmp_path.rglob("x")) and not list(tmp_path.rglob("y"))


# ----------------------------------------------------------------------------- placement and schedule


def _stand_in(stage_index: int, num_stages: int, rank: int, p: int):
    # What the schedule constructors and check_schedule read of a stage; no process group, no module.
    return types.SimpleNamespace(
        stage_index=stage_index,
        num_stages=num_stages,
        group_rank=rank,
        group_size=p,
        submod=None,
        is_first=stage_index == 0,
        is_last=stage_index == num_stages - 1,
        stage_index_to_group_rank={i: i % p for i in range(num_stages)},
    )


def _synthetic_plan(schedule: str, pp: int, m: int, vp: int) -> dict:
    ir = build_schedule(schedule, pp, m, vp)
    return {
        "layout": {"schedule": schedule, "pp": pp, "num_microbatches": m, "vp": vp},
        "stages": [{"index": j, "rank": r, "pieces": [j, j + 1]} for j, r in enumerate(ir.stage_to_rank)],
    }


def _torch_schedule(plan: dict, rank: int, schedule: str | None = None):
    lay = plan["layout"]
    n = len(plan["stages"])
    stages = [_stand_in(j, n, rank, lay["pp"]) for j in rt.local_stage_ids(plan, rank)]
    return rt.make_schedule(schedule or lay["schedule"], stages, lay["num_microbatches"], None), stages


def test_stage_placement_follows_engine_rules(fixture_plans):
    """engines.md: interleaved stage j on rank j % pp; V schedules stages r and 2pp-1-r on rank r."""
    inter = load_fixture("gpt2_interleaved").to_dict()
    assert [rt.local_stage_ids(inter, r) for r in range(2)] == [[0, 2], [1, 3]]
    zbv = load_fixture("gpt2_zbv").to_dict()
    assert [rt.local_stage_ids(zbv, r) for r in range(2)] == [[0, 3], [1, 2]]
    for pp in (2, 3, 4):
        plan = _synthetic_plan("interleaved", pp, 2 * pp, 2)
        assert all(rt.local_stage_ids(plan, r) == [r, r + pp] for r in range(pp))
        plan = _synthetic_plan("zbv", pp, 2 * pp, 2)
        assert all(rt.local_stage_ids(plan, r) == [r, 2 * pp - 1 - r] for r in range(pp))
        for r in range(pp):  # and torch's own schedule objects communicate along the same placement
            sched, stages = _torch_schedule(plan, r)
            rt.check_schedule(sched, stages, plan)


@pytest.mark.parametrize(
    "schedule,pp,m,vp",
    [
        ("gpipe", 2, 2, 1),
        ("gpipe", 4, 6, 1),
        ("1f1b", 2, 2, 1),
        ("1f1b", 4, 8, 1),
        ("interleaved", 2, 4, 2),
        ("interleaved", 4, 8, 2),
        ("zb-h1", 2, 2, 1),
        ("zb-h1", 4, 4, 1),
        ("zbv", 2, 2, 2),
        ("zbv", 4, 8, 2),
    ],
)
def test_check_schedule_accepts_torch_schedules(schedule, pp, m, vp):
    plan = _synthetic_plan(schedule, pp, m, vp)
    for r in range(pp):
        sched, stages = _torch_schedule(plan, r)
        planned = rt.check_schedule(sched, stages, plan)
        assert len(planned[r]) > 0


def test_check_schedule_refuses_what_was_not_planned():
    # plan.json says zb-h1, the object runs 1F1B (e.g. plan.json edited after rendering)
    plan = _synthetic_plan("zb-h1", 2, 4, 1)
    sched, stages = _torch_schedule(plan, 0, schedule="1f1b")
    with pytest.raises(rt.ScheduleMismatch, match="Refusing to train"):
        rt.check_schedule(sched, stages, plan)
    # a looped plan whose stage ranks were edited into a V
    plan = _synthetic_plan("interleaved", 2, 4, 2)
    plan["stages"][2]["rank"], plan["stages"][3]["rank"] = 1, 0
    sched, stages = _torch_schedule(_synthetic_plan("interleaved", 2, 4, 2), 0)
    with pytest.raises(rt.ScheduleMismatch, match="places stages"):
        rt.check_schedule(sched, stages, plan)
    # another micro-batch count than planned
    plan = _synthetic_plan("1f1b", 2, 4, 1)
    sched, stages = _torch_schedule(_synthetic_plan("1f1b", 2, 3, 1), 0)
    with pytest.raises(rt.ScheduleMismatch):
        rt.check_schedule(sched, stages, plan)


def test_edited_plan_json_is_refused(tmp_path, fixture_plans):
    d = write_plan_dir(tmp_path / "plan", "gpt2_1f1b")
    doc = json.loads((d / "plan.json").read_text())
    doc["layout"]["schedule"] = "gpipe"
    (d / "edited.json").write_text(json.dumps(doc))
    main = runpy.run_path(str(d / "train_torch.py"), run_name="rendered")["main"]
    with pytest.raises(rt.PlanChanged, match="schedule"):
        main(["--plan", str(d / "edited.json")])
    assert rt.run_main(lambda: main(["--plan", str(d / "edited.json")])) == 2


# ----------------------------------------------------------------------------- stage modules


def test_stage_module_recomputes_and_clones(fixture_plans):
    plan = load_fixture("gpt2_zbv_recompute")
    doc = plan.to_dict()
    planned = load_planned_model(doc, doc["inputs"]["model_file"])
    from planner.runners.reference import build_model

    model = build_model(planned, 0, no_dropout=True)
    calls = []
    model.h[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    cpu = torch.device("cpu")
    mod = rt.StageModule(planned, model, 0, "fp32", cpu, recompute=True, clone_outputs=True)
    x = planned.example_batch(2, 0)[0][0]
    out = mod(x)
    assert len(calls) == 1
    out.sum().backward()
    assert len(calls) == 2  # the piece ran again in the backward: recomputed
    plain = rt.StageModule(planned, model, 0, "fp32", cpu)
    assert torch.equal(plain(x), out)
    assert out.grad_fn.name().startswith("Clone")
    bf16 = rt.StageModule(planned, model, 0, "bf16", cpu)(x)
    assert not torch.equal(bf16.float(), out)  # autocast changed the arithmetic


# ----------------------------------------------------------------------------- real runs


def write_plan_dir(d: Path, name: str) -> Path:
    plan = load_fixture(name)
    d.mkdir(parents=True)
    files = {"plan.json": dumps_json(plan.to_dict()), **render_torch(plan, command_for(name), d)}
    for rel, text in files.items():
        (d / rel).write_text(text)
    return d


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(d: Path, nprocs: int, args: list[str], timeout: float = 300) -> float:
    """Start train_torch.py once per rank as torchrun would; returns the wall time, seconds."""
    port, t0 = _free_port(), time.perf_counter()
    procs, logs = [], []
    for r in range(nprocs):
        env = {
            **os.environ,
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "WORLD_SIZE": str(nprocs),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        logs.append(d / f"rank{r}.log")
        with open(logs[-1], "w") as log:
            procs.append(subprocess.Popen([sys.executable, "train_torch.py", *args], cwd=d, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        while True:
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes) or time.perf_counter() - t0 > timeout:
                text = "\n".join(f"--- rank {r} (exit {c})\n{logs[r].read_text()[-3000:]}" for r, c in enumerate(codes))
                raise AssertionError(f"train_torch.py failed or timed out:\n{text}")
            if all(c == 0 for c in codes):
                return time.perf_counter() - t0
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def run_and_compare(tmp_path: Path, name: str, nprocs: int, precision: str = "fp32", steps: int = 3) -> dict:
    d = write_plan_dir(tmp_path / name, name)
    wall = launch(
        d,
        nprocs,
        ["--steps", str(steps), "--no-dropout", "--device", "cpu", "--precision", precision, "--losses-out", "losses.json", "--stats-out", "stats{rank}.json"],
    )
    got = json.loads((d / "losses.json").read_text())["losses"]
    doc = json.loads((d / "plan.json").read_text())
    planned = load_planned_model(doc, doc["inputs"]["model_file"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks ran; much faster on a busy 2-core machine
    try:
        want = reference_losses(planned, doc, steps, 0, 1e-4, "cpu", precision)
    finally:
        torch.set_num_threads(threads)
    rel = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    print(f"{name}: {nprocs} ranks, {wall:.1f} s, max relative loss difference {rel:.2e}")
    assert len(got) == steps and rel <= 1e-5, (got, want)
    stats = [json.loads((d / f"stats{r}.json").read_text()) for r in range(nprocs)]
    for s in stats:
        assert len(s["step_times_s"]) == steps and s["peak_memory_bytes"] is None
        assert s["stages"] == rt.local_stage_ids(doc, s["pipe_rank"])
    return {"stats": stats, "losses": got, "reference": want}


def test_real_run_zbv_matches_reference(tmp_path, fixture_plans):
    """ZB-V: V placement (stages 0 and 3 on rank 0), split backward, tied embedding/head on one rank."""
    out = run_and_compare(tmp_path, "gpt2_zbv", 2)
    assert [s["stages"] for s in out["stats"]] == [[0, 3], [1, 2]]


def test_real_run_interleaved_matches_reference(tmp_path, fixture_plans):
    """Interleaved 1F1B: looped placement; the tied embedding (stage 0, rank 0) and head (stage 3, rank 1) summed across ranks."""
    out = run_and_compare(tmp_path, "gpt2_interleaved", 2)
    assert [s["stages"] for s in out["stats"]] == [[0, 2], [1, 3]]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,nprocs,precision",
    [
        ("gpt2_1f1b", 2, "fp32"),
        ("gpt2_gpipe", 2, "fp32"),
        ("gpt2_zbh1", 2, "fp32"),
        ("gpt2_pp2dp2", 4, "fp32"),
        ("gpt2_zbv_recompute", 2, "fp32"),
        ("llama_1f1b", 2, "fp32"),
        ("resnet_fpn_zbv", 2, "fp32"),
        ("gpt2_1f1b", 2, "bf16"),
    ],
)
def test_real_run_matches_reference_slow(tmp_path, fixture_plans, name, nprocs, precision):
    run_and_compare(tmp_path, name, nprocs, precision)


# ----------------------------------------------------------------------------- one process, several stages


def single_rank_plan(name: str, schedule: str, vp: int, cuts: list[int]) -> Plan:
    """A fixture plan re-cut for one pipeline rank (pp=1) holding ``vp`` stages split at ``cuts``."""
    doc = load_fixture(name).to_dict()
    bounds = [0, *cuts, len(doc["model"]["pieces"])]
    names = doc["model"]["pieces"]
    doc["stages"] = [
        dict(doc["stages"][0], index=j, rank=0, pieces=[bounds[j], bounds[j + 1]], layers=[names[bounds[j]], names[bounds[j + 1] - 1]])
        for j in range(len(bounds) - 1)
    ]
    m, mb = 2, 4
    doc["layout"].update(pp=1, dp=1, vp=vp, schedule=schedule, num_microbatches=m, micro_batch=mb, global_batch=m * mb)
    doc["ranks"] = doc["ranks"][:1]
    return Plan.from_dict(doc)


@pytest.fixture
def single_process_group(monkeypatch):
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the launched ranks run (OMP_NUM_THREADS=1); several threads crawl on a busy 2-core box
    yield
    torch.set_num_threads(threads)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def test_script_main_in_process_two_stages_on_one_rank(tmp_path, fixture_plans, single_process_group):
    """The rendered main() in this process: ZB-V with both stages on rank 0, skip tensors (FPN) crossing the cut."""
    plan = single_rank_plan("resnet_fpn_zbv", "zbv", 2, [4])
    d = tmp_path / "plan"
    d.mkdir()
    for rel, text in {"plan.json": dumps_json(plan.to_dict()), **render_torch(plan, "planner plan (test)", d)}.items():
        (d / rel).write_text(text)
    main = runpy.run_path(str(d / "train_torch.py"), run_name="rendered")["main"]
    assert main(["--steps", "2", "--no-dropout", "--device", "cpu", "--losses-out", str(d / "losses.json")]) == 0
    got = json.loads((d / "losses.json").read_text())["losses"]
    doc = plan.to_dict()
    want = reference_losses(load_planned_model(doc, doc["inputs"]["model_file"]), doc, 2, 0, 1e-4, "cpu", "fp32")
    assert got == pytest.approx(want, rel=1e-5)


def test_shape_inference_leaves_batchnorm_statistics_alone(fixture_plans, single_process_group):
    """After one step the running statistics equal a single-process run's: torch's start-up
    shape inference (which runs stage 0 on the first micro-batch) leaves no trace."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from planner.runners.reference import BatchLayout, build_model, global_batch

    plan = single_rank_plan("resnet_fpn_zbv", "gpipe", 1, []).to_dict()
    planned = load_planned_model(plan, plan["inputs"]["model_file"])
    layout = BatchLayout.from_plan(plan)
    inputs, target = global_batch(planned, layout, 0, 0)
    dist.init_process_group("gloo")
    cpu = torch.device("cpu")

    def after_one_step(stage_cls):
        model = build_model(planned, 0, no_dropout=True)
        stage = stage_cls(rt.StageModule(planned, model, 0, "fp32", cpu), 0, 1, cpu)
        sched = rt.make_schedule("gpipe", [stage], layout.num_microbatches, lambda o, t: planned.loss(o, t))
        sched.step(*inputs, target=target, losses=[], return_outputs=False)
        return model.bn1.running_mean.clone()

    single = build_model(planned, 0, no_dropout=True)
    for i in range(layout.num_microbatches):
        single(*(t[i * layout.micro_batch : (i + 1) * layout.micro_batch] for t in inputs))
    assert torch.equal(after_one_step(rt.PlannedStage), single.bn1.running_mean)
    assert not torch.equal(after_one_step(PipelineStage), single.bn1.running_mean)  # torch's own stage: one extra update
