"""The DeepSpeed renderer: ds_config.json checked by DeepSpeed itself, the PipelineModule's stage split,
real CPU training runs against a single-process reference, golden files, determinism, shell quoting.

Fixture plans live in tests/fixtures/deepspeed/*.plan.json; golden outputs in
tests/fixtures/deepspeed/golden/. Regenerate both with ``UPDATE_GOLDEN=1 pytest tests/engines/test_render_deepspeed.py``.
"""

from __future__ import annotations

import copy
import json
import os
import shlex
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from planner.engines.deepspeed.render import CONFIG, SCRIPT, ds_config, render  # noqa: E402
from planner.engines.deepspeed.rules import precision_config  # noqa: E402
from planner.errors import UsageError  # noqa: E402
from planner.launch import model_path_for  # noqa: E402
from planner.model_ref import resolve_ref  # noqa: E402
from planner.solve.plan import Plan  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "deepspeed"
GOLDEN = FIX / "golden" / "gpt2_pp2_dp2"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"
PLAN_ARGS = {
    "gpt2_pp2_dp1": ["examples/gpt2.py", "--model-arg", "preset=gpt2-tiny", "--gpus", "2xcpu", "--pp", "2", "--zero", "1"],
    "gpt2_pp2_dp2": ["examples/gpt2.py", "--model-arg", "preset=gpt2-tiny", "--gpus", "4xcpu", "--pp", "2"],
    "crossing_pp2": ["tests/fixtures/deepspeed/crossing.py", "--gpus", "2xcpu", "--pp", "2", "--zero", "1", "--dtype", "fp32"],
}
COMMAND = "planner plan examples/gpt2.py --model-arg preset=gpt2-tiny --gpus 4xcpu --engine deepspeed --pp 2 --out plans/gpt2"
HOSTILE = 'my model\'s "dir"/$(touch x)/model.py'
HOSTILE_COMMAND = "planner plan 'my net.py' --out d\n$(touch x)\nimport os; os.system('touch x')"
LR = 3e-3  # large enough that a missing tied-gradient sum moves step-3 losses by ~2e-4 (relative)

_regenerated: set[str] = set()


def plan_dict(name: str) -> dict:
    """A fixture plan as plan.json's dict, with its model file as an absolute path (tests run from anywhere)."""
    path = FIX / f"{name}.plan.json"
    if UPDATE and name not in _regenerated:
        out = subprocess.run(
            [sys.executable, "-m", "planner", "plan", *PLAN_ARGS[name], "--engine", "deepspeed", "--json"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        path.write_text(out)
        _regenerated.add(name)
    d = json.loads(path.read_text())
    d["inputs"]["model_file"] = str(ROOT / d["inputs"]["model_file"])
    return d


def plan_obj(name: str, layout: dict | None = None, inputs: dict | None = None) -> Plan:
    d = plan_dict(name)
    d["layout"].update(layout or {})
    d["inputs"].update(inputs or {})
    return Plan.from_dict(d)


# ----------------------------------------------------------------------------- ds_config.json, checked by DeepSpeed


def deepspeed_config(cfg: dict, world: int, dp: int, monkeypatch):
    """DeepSpeed's own DeepSpeedConfig for ``cfg`` as the pipeline engine builds it: ``world`` ranks, ``dp`` data-parallel.

    PipelineEngine passes its grid as ``mpu``, whose data-parallel size DeepSpeedConfig uses for the batch rule.
    """
    import deepspeed.runtime.config as ds_cfg

    monkeypatch.setattr(ds_cfg.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(ds_cfg.dist, "get_world_size", lambda *a, **k: world)
    grid = SimpleNamespace(get_data_parallel_world_size=lambda: dp)
    return ds_cfg.DeepSpeedConfig(copy.deepcopy(cfg), mpu=grid)


CASES = [  # fixture, dtype, zero, recompute
    ("gpt2_pp2_dp2", "bf16", 1, "none"),
    ("gpt2_pp2_dp2", "bf16", 0, "full"),
    ("gpt2_pp2_dp2", "fp16", 1, "none"),
    ("gpt2_pp2_dp1", "fp32", 0, "selective"),
    ("gpt2_pp2_dp1", "fp32", 1, "full"),
]


@pytest.mark.parametrize("name,dtype,zero,recompute", CASES)
def test_ds_config_is_accepted_by_deepspeed_with_the_plans_numbers(name, dtype, zero, recompute, monkeypatch):
    plan = plan_obj(name, layout={"zero": zero, "recompute": recompute}, inputs={"dtype": dtype})
    lay = plan.layout
    cfg = ds_config(plan)
    conf = deepspeed_config(cfg, world=lay.pp * lay.dp, dp=lay.dp, monkeypatch=monkeypatch)

    assert conf.world_size == lay.dp
    assert conf.train_batch_size == lay.global_batch == lay.micro_batch * lay.num_microbatches * lay.dp
    assert conf.train_micro_batch_size_per_gpu == lay.micro_batch
    assert conf.gradient_accumulation_steps == lay.num_microbatches
    assert conf.zero_optimization_stage == zero
    assert conf.bfloat16_config.enabled is (dtype == "bf16")
    assert conf.float16_config.enabled is (dtype == "fp16")
    if dtype == "bf16":
        assert conf.bfloat16_config.immediate_grad_update is True
    assert conf.grad_accum_dtype == ("fp32" if dtype == "bf16" and zero >= 1 else None)
    assert conf.gradient_clipping == 1.0
    assert conf.wall_clock_breakdown is False
    assert set(cfg["pipeline"]) == {"pipe_partitioned", "grad_partitioned", "activation_checkpoint_interval", "use_reentrant"}
    assert conf.pipeline["activation_checkpoint_interval"] == (1 if recompute == "full" else 0)
    assert conf.pipeline["use_reentrant"] is False
    assert "optimizer" not in cfg and conf.optimizer_name is None
    assert list(json.loads(render(plan, COMMAND)[CONFIG])) == sorted(cfg)


def test_ds_config_batch_is_for_the_data_parallel_size_not_the_world(monkeypatch):
    plan = plan_obj("gpt2_pp2_dp2")
    cfg = ds_config(plan)
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):
        deepspeed_config(cfg, world=4, dp=4, monkeypatch=monkeypatch)  # what dp = world would require
    bad = dict(cfg, train_batch_size=cfg["train_batch_size"] * 2)
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):
        deepspeed_config(bad, world=4, dp=2, monkeypatch=monkeypatch)


@pytest.mark.parametrize(
    "dtype,zero,wrapper,grad_bytes",
    [
        ("bf16", 1, "bf16", 4.0),
        ("bf16", 0, "bf16", 2.0),
        ("fp16", 0, "fp16", 2.0),
        ("fp16", 1, "zero_optimization", 2.0),
        ("fp32", 0, None, 4.0),
        ("fp32", 1, "zero_optimization", 4.0),
    ],
)
def test_deepspeed_picks_the_optimizer_wrapper_the_memory_model_assumes(dtype, zero, wrapper, grad_bytes, monkeypatch):
    """DeepSpeed's own choice (DeepSpeedEngine._do_optimizer_sanity_check) for the rendered config, and its gradient dtype."""
    import deepspeed.runtime.zero.utils as zero_utils
    from deepspeed.runtime.engine import DeepSpeedEngine

    from planner.engines import get_engine

    plan = plan_obj("gpt2_pp2_dp2", layout={"zero": zero}, inputs={"dtype": dtype})
    conf = deepspeed_config(ds_config(plan), world=4, dp=2, monkeypatch=monkeypatch)
    monkeypatch.setattr(zero_utils.dist, "get_rank", lambda *a, **k: 0)
    engine = DeepSpeedEngine.__new__(DeepSpeedEngine)
    engine.__dict__.update(_config=conf, pipeline_parallelism=True, global_rank=0)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3, weight_decay=0.0)
    assert DeepSpeedEngine._do_optimizer_sanity_check(engine, opt) == wrapper
    accum = DeepSpeedEngine.get_data_types(engine)[1]
    recipe = get_engine("deepspeed").state_recipe(dtype, zero)
    if dtype == "bf16":  # BF16_Optimizer: one accumulation buffer of grad_accum_dtype; master + moments partitioned
        assert torch.empty((), dtype=accum).element_size() == recipe.grad_bytes == grad_bytes
        assert recipe.shard_optimizer
    else:
        assert recipe.grad_bytes == grad_bytes


@pytest.mark.parametrize("name", ["gpt2_pp2_dp2", "crossing_pp2"])
def test_checkpoint_units_are_the_memory_models_units(name):
    """recompute=full checkpoints exactly the units planner.solve.memory counts (a block, or a piece outside blocks)."""
    from planner.engines.deepspeed.runner import checkpoint_units
    from planner.solve.memory import checkpoint_starts

    d = plan_dict(name)
    blocks = d["model"]["blocks"]
    costs = SimpleNamespace(layers=[SimpleNamespace(block=b) for b in blocks])
    for start, stop in [(0, len(blocks))] + [tuple(s["pieces"]) for s in d["stages"]] + [(2, len(blocks) - 1)]:
        units = checkpoint_units(blocks, start, stop)
        assert [a for a, _ in units] == checkpoint_starts(costs, start, stop)
        assert units[0][0] == start and units[-1][1] == stop and all(b == c for (_, b), (c, _) in zip(units, units[1:]))


def test_precision_config_for_a_cpu_run_drops_mixed_precision(monkeypatch):
    cfg = ds_config(plan_obj("gpt2_pp2_dp2"))  # bf16, ZeRO 1
    fp32 = precision_config(cfg, "fp32")
    assert "bf16" not in fp32 and "fp16" not in fp32 and "data_types" not in fp32
    assert deepspeed_config(fp32, 4, 2, monkeypatch).bfloat16_config.enabled is False
    assert precision_config(fp32, "bf16") == cfg
    z0 = precision_config(dict(cfg, zero_optimization={"stage": 0}), "bf16")
    assert "data_types" not in z0  # DeepSpeed refuses fp32 accumulation with bf16 at ZeRO 0
    with pytest.raises(ValueError):
        precision_config(cfg, "int8")


@pytest.mark.parametrize(
    "layout,match",
    [({"zero": 2}, "ZeRO stage 2"), ({"tp": 2}, "tensor parallelism"), ({"schedule": "interleaved"}, "1F1B only"), ({"vp": 2}, "virtual")],
)
def test_refuses_plans_deepspeed_cannot_run(layout, match):
    with pytest.raises(UsageError, match=match):
        render(plan_obj("gpt2_pp2_dp2", layout=layout), COMMAND)


# ----------------------------------------------------------------------------- rendered files


def rendered(plan: Plan, out_dir: Path | None = None) -> dict[str, str]:
    return render(plan, COMMAND, out_dir)


def golden_plan() -> Plan:
    d = plan_dict("gpt2_pp2_dp2")
    d["inputs"]["model_file"] = "examples/gpt2.py"  # relative: the rendered paths do not depend on this machine
    return Plan.from_dict(d)


def test_golden_files():
    files = rendered(golden_plan(), Path("plans/gpt2"))
    if UPDATE:
        GOLDEN.mkdir(parents=True, exist_ok=True)
        for old in GOLDEN.iterdir():
            old.unlink()
        for rel, text in files.items():
            (GOLDEN / rel).write_text(text)
    expected = {p.name: p.read_text() for p in GOLDEN.iterdir()}
    assert sorted(files) == sorted(expected)
    for rel, text in files.items():
        assert text == expected[rel], f"{rel} differs from {GOLDEN / rel} (UPDATE_GOLDEN=1 regenerates)"
    assert "--model ../../examples/gpt2.py" in files["launch_torchrun.sh"]


def test_render_is_deterministic(tmp_path):
    a = rendered(golden_plan(), Path("plans/gpt2"))
    b = rendered(Plan.from_dict(golden_plan().to_dict()), Path("plans/gpt2"))
    assert a == b
    for text in a.values():
        assert "/tmp" not in text and str(ROOT) not in text
    # the header names the version and the command; the script compiles
    from planner import __version__

    assert f"Generated by planner {__version__}: {COMMAND}" in a[SCRIPT]
    compile(a[SCRIPT], SCRIPT, "exec")


def _fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_hostile_model_path_arrives_as_one_argument(tmp_path):
    plan = plan_obj("gpt2_pp2_dp2", inputs={"model_file": HOSTILE})
    out = tmp_path / "plan dir"
    out.mkdir()
    files = render(plan, HOSTILE_COMMAND, out)
    for rel, text in files.items():  # the command stays inside its comment line
        if rel != "README.md":
            assert all(line.lstrip().startswith("#") for line in text.splitlines() if "touch x" in line and "model.py" not in line), rel
    for rel, text in files.items():
        (out / rel).write_text(text)
        if rel.endswith(".sh"):
            (out / rel).chmod(0o755)
            subprocess.run(["bash", "-n", str(out / rel)], check=True)
    compile(files[SCRIPT], SCRIPT, "exec")
    expected = model_path_for(plan, out)
    assert "$(touch x)" in expected

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    argv_log = tmp_path / "argv.json"
    printer = f'exec {shlex.quote(sys.executable)} -c \'import json, sys; open(sys.argv[1], "a").write(json.dumps(sys.argv[2:]) + "\\n")\' {shlex.quote(str(argv_log))} "$(basename "$0")" "$@"\n'
    _fake(bin_dir, "deepspeed", printer)
    _fake(bin_dir, "torchrun", printer)
    _fake(bin_dir, "scontrol", "echo node-0\n")
    _fake(bin_dir, "srun", 'while [[ "$1" == --* ]]; do shift; done; exec "$@"\n')  # run the task locally
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="node-0", SLURM_NODEID="0", SLURM_SUBMIT_DIR=str(out))
    for script in ("launch_deepspeed.sh", "launch_torchrun.sh", "launch_slurm.sh"):
        subprocess.run([str(out / script), "--steps", "1"], check=True, cwd=tmp_path, env=env)
    calls = [json.loads(line) for line in argv_log.read_text().splitlines()]
    assert [c[0] for c in calls] == ["deepspeed", "torchrun", "torchrun"]
    for call in calls:
        args = call[1:]
        assert args[args.index(SCRIPT) :] == [SCRIPT, "--plan", "plan.json", "--model", expected, "--steps", "1"]
    assert not list(tmp_path.rglob("x")), "the model path was executed"


def test_multi_node_hostfile_parses_with_deepspeeds_parser(tmp_path):
    from deepspeed.launcher.runner import _parse_hostfile

    d = plan_dict("gpt2_pp2_dp2")
    d["cluster"]["groups"][0].update(nodes=2, gpus_per_node=2)
    files = rendered(Plan.from_dict(d), tmp_path)
    assert "--hostfile hostfile" in files["launch_deepspeed.sh"]
    assert "--num_nodes 2" in files["launch_deepspeed.sh"]
    assert dict(_parse_hostfile(files["hostfile"].splitlines())) == {"worker-0": 2, "worker-1": 2}
    assert "hostfile" not in rendered(plan_obj("gpt2_pp2_dp2"), tmp_path)


# ----------------------------------------------------------------------------- real gloo jobs on the CPU


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nprocs: int, args: list[str], cwd: Path, ext_dir: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TORCH_EXTENSIONS_DIR=str(ext_dir))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nprocs), "--master-port", str(free_port()), *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return proc


def test_pipeline_module_holds_exactly_the_planned_stages(tmp_path):
    """Each rank of a real 2-process gloo job builds the planned stage, not DeepSpeed's own split."""
    d = plan_dict("gpt2_pp2_dp1")
    d["stages"][0]["pieces"][1] = d["stages"][1]["pieces"][0] = 2  # an unusual split: [0, 2) and [2, 11)
    (tmp_path / "plan.json").write_text(json.dumps(d))
    torchrun(2, [str(FIX / "build_stages.py"), "plan.json", d["inputs"]["model_file"], "stage_{rank}.json"], tmp_path, tmp_path / "ext")
    records = [json.loads((tmp_path / f"stage_{r}.json").read_text()) for r in range(2)]
    bounds = [0, 2, 11]
    for r, rec in enumerate(records):
        assert bounds not in rec["deepspeed_splits"].values()  # DeepSpeed's own methods would cut elsewhere
        assert rec["parts"] == bounds
        assert rec["local"] == bounds[r : r + 2]
        assert rec["layer_names"] == list(range(bounds[r], bounds[r + 1]))
        assert rec["same_parameters"]
        assert rec["others_released"]
        assert rec["tied"] == {"wte.weight": [0, 1]}  # wte.weight is lm_head.weight: embedding on stage 0, head on stage 1
    assert records[0]["replicated"] == [] and "lm_head.weight" in records[1]["replicated"]


def reference(plan: dict, steps: int, lr: float, clip: float, seed: int = 0) -> tuple[list[float], list[float]]:
    """Single-process losses and pre-clipping gradient norms: same model, seed, data and AdamW; gradients accumulated
    over all micro-batches of all replicas (each loss divided by their count), clipped at ``clip`` as DeepSpeed does."""
    from planner.runners.reference import BatchLayout, build_model, global_batch, microbatches, replica_batch
    from planner.runtime import load_planned_model

    planned = load_planned_model(plan, plan["inputs"]["model_file"])
    layout = BatchLayout.from_plan(plan)
    model = build_model(planned, seed, no_dropout=True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    count = layout.num_microbatches * layout.dp
    losses, norms = [], []
    for step in range(steps):
        inputs, target = global_batch(planned, layout, seed, step)
        total = 0.0
        for d in range(layout.dp):
            for mb_inputs, mb_target in microbatches(*replica_batch(inputs, target, layout, d), layout):
                loss = planned.loss(model(*mb_inputs), mb_target)
                (loss / count).backward()
                total += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / count)
    return losses, norms


def train(plan: dict, tmp_path: Path, nprocs: int, steps: int = 3, extra: list[str] = ()) -> tuple[list[float], list[dict], float]:
    """Render ``plan`` into tmp_path and run its train_deepspeed.py with torchrun; (losses, per-rank stats, seconds)."""
    out = tmp_path / "plan"
    out.mkdir()
    (out / "plan.json").write_text(json.dumps(plan))
    for rel, text in render(Plan.from_dict(plan), COMMAND, out).items():
        (out / rel).write_text(text)
    ext = tmp_path / "torch_extensions"
    t0 = time.perf_counter()
    torchrun(
        nprocs,
        [
            SCRIPT,
            "--plan",
            "plan.json",
            "--model",
            model_path_for(Plan.from_dict(plan), out),
            "--steps",
            str(steps),
            "--lr",
            str(LR),
            "--no-dropout",
            "--losses-out",
            "losses.json",
            "--stats-out",
            "stats_{rank}.json",
            *extra,
        ],
        out,
        ext,
    )
    seconds = time.perf_counter() - t0
    assert not ext.exists(), "DeepSpeed compiled a C++ op (deepspeed_shm_comm?)"
    losses = json.loads((out / "losses.json").read_text())["losses"]
    stats = [json.loads((out / f"stats_{r}.json").read_text()) for r in range(nprocs)]
    return losses, stats, seconds


def assert_matches_reference(plan: dict, losses: list[float], stats: list[dict]) -> None:
    clip = ds_config(Plan.from_dict(plan))["gradient_clipping"]
    ref_losses, ref_norms = reference(plan, len(losses), LR, clip)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert len(set(losses)) == len(losses), "the loss does not move: nothing is trained"
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= 1e-5 * abs(want), (losses, ref_losses)
    for rec in stats:
        if rec["grad_norms"][0] is not None:  # ZeRO / BF16 optimizers record the global norm (tied copies once)
            for got, want in zip(rec["grad_norms"], ref_norms):
                assert abs(got - want) <= 1e-5 * want, (rec["grad_norms"], ref_norms)


def test_two_rank_pipeline_training_matches_single_process(tmp_path):
    plan = plan_dict("gpt2_pp2_dp1")  # pipe 2: stage 0 [0, 5), stage 1 [5, 11); wte.weight tied across them
    losses, stats, seconds = train(plan, tmp_path, 2)
    print(f"2-rank DeepSpeed CPU run: {seconds:.1f} s")
    assert_matches_reference(plan, losses, stats)
    assert [s["pieces"] for s in stats] == [s["pieces"] for s in plan["stages"]]
    assert [s["optimizer"] for s in stats] == ["DeepSpeedZeroOptimizer"] * 2  # fp32 on CPU, ZeRO 1
    assert [s["forward_calls"] for s in stats] == [5 * 2 * 3, 6 * 2 * 3]  # pieces x micro-batches x steps, no recompute


@pytest.mark.slow
def test_four_rank_pipe2_data2_training_matches_single_process(tmp_path):
    plan = plan_dict("gpt2_pp2_dp2")
    losses, stats, seconds = train(plan, tmp_path, 4)
    print(f"4-rank DeepSpeed CPU run: {seconds:.1f} s")
    assert_matches_reference(plan, losses, stats)
    assert [(s["stage"], s["data_parallel_rank"]) for s in stats] == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.slow
def test_mixed_tensors_cross_stages_with_full_recompute(tmp_path):
    """Token ids, a bool mask and gradient-free floats cross the cut; recompute=full checkpoints each planned unit."""
    plan = plan_dict("crossing_pp2")
    plan["layout"]["recompute"] = "full"
    losses, stats, _ = train(plan, tmp_path, 2)
    assert_matches_reference(plan, losses, stats)
    (a, b), (c, e) = plan["stages"][0]["pieces"], plan["stages"][1]["pieces"]
    mbs = plan["layout"]["num_microbatches"]
    assert [s["activation_checkpoint_interval"] for s in stats] == [1, 1]
    assert [s["forward_calls"] for s in stats] == [2 * (b - a) * mbs * 3, 2 * (e - c) * mbs * 3]  # every piece recomputed once


@pytest.mark.slow
def test_bf16_on_cpu_runs_bf16_optimizer_with_fp32_accumulation(tmp_path):
    plan = plan_dict("gpt2_pp2_dp1")
    losses, stats, _ = train(plan, tmp_path, 2, extra=["--precision", "bf16"])
    ref_losses, _ = reference(plan, len(losses), LR, 1.0)
    assert all(abs(g - w) <= 2e-3 * w for g, w in zip(losses, ref_losses)), (losses, ref_losses)
    assert {(s["optimizer"], s["grad_accum_dtype"], s["precision"]) for s in stats} == {("BF16_Optimizer", "float32", "bf16")}


@pytest.mark.slow
def test_bf16_export_traced_float_input_model_trains(tmp_path):
    """An export-traced model with float inputs under bf16: traced again in bf16, inputs cast to the weights' dtype."""
    from typer.testing import CliRunner

    from planner.cli import app

    out = tmp_path / "planned"
    model = Path(__file__).parents[1] / "models" / "shaperoot.py"
    r = CliRunner().invoke(app, ["plan", str(model), "--gpus", "2xcpu", "--engine", "deepspeed", "--pp", "2", "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    plan = json.loads((out / "plan.json").read_text())
    assert plan["inputs"]["tracer_used"] == "export"
    plan["inputs"]["model_file"] = resolve_ref(plan["inputs"]["model_file"], out)  # recorded relative to `out`; trained elsewhere
    losses, stats, _ = train(plan, tmp_path, 2, extra=["--precision", "bf16"])
    ref_losses, _ = reference(plan, len(losses), LR, 1.0)
    assert {s["precision"] for s in stats} == {"bf16"}
    assert all(abs(g - w) <= 2e-2 * max(abs(w), 0.1) for g, w in zip(losses, ref_losses)), (losses, ref_losses)
