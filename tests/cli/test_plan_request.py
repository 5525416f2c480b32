"""Settings.pinned_to: re-planning a plan's layout (smoke, calibrate) pins every dimension the layout fixes."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from planner.planning import plan_model
from planner.solve.plan import Layout
from planner.solve.settings import Settings

GPT2 = str(Path(__file__).resolve().parents[2] / "examples" / "gpt2.py")
SHARED = sorted(set(Settings().flat()) & {f.name for f in fields(Layout)})


def test_every_layout_dimension_the_search_turns_is_pinned():
    lay = Layout("megatron", 2, 2, 2, 2, 1, 8, 32, "interleaved", "selective", 1, True, cp=2, tp_comm_overlap=True)
    lay = Layout.from_dict({**lay.to_dict(), "overlap_grad_reduce": True, "main_grads_dtype": "bf16", "optimizer_state_dtype": "bf16", "fp8": True})
    inputs = Settings.of(model_file=GPT2, model_args={"preset": "gpt2-tiny"}, gpus="16xH100", engine="megatron").to_inputs()
    req = Settings.pinned_to(inputs, lay, (0, 3, 6), gpus="16xH100")
    assert {"pp", "tp", "dp", "vp", "cp", "tp_comm_overlap", "fp8", "main_grads_dtype"} <= set(SHARED)
    for name in SHARED:
        assert req.flat()[name] == getattr(lay, name), name
    assert (req.pins.bounds, req.memory.mem_target, req.cluster.profile) == ((0, 3, 6), 1.0, None)


def test_replanning_a_plan_pinned_to_its_layout_reproduces_it():
    req = Settings.of(model_file=GPT2, model_args={"preset": "gpt2-tiny"}, gpus="8xH100", engine="megatron")
    plan = plan_model(req)[0]
    bounds = tuple([s.pieces[0] for s in plan.stages] + [plan.stages[-1].pieces[1]])
    again = plan_model(Settings.pinned_to(plan.inputs, plan.layout, bounds))[0]
    assert again.layout == plan.layout
    assert [s.pieces for s in again.stages] == [s.pieces for s in plan.stages]


def test_the_settings_are_one_tree_each_field_declared_once_and_read_back_as_written():
    """Every field sits in one section; plan.json's inputs are the recorded fields (not the search's knobs), and
    reading them back gives the same record."""
    from planner.solve.settings import SECTION_OF, SECTIONS

    names = [f.name for cls in SECTIONS.values() for f in fields(cls)]
    assert len(names) == len(set(names)) == len(SECTION_OF)
    req = Settings.of(model_file=GPT2, gpus="16xH100", engine="megatron", pp=2, leaf=("Block",), recompute_modules=("mlp",), bounds=(0, 2, 4), top_k=3)
    inputs = req.to_inputs()
    assert "top_k" not in inputs and "fp8" not in inputs and inputs["leaf"] == ["Block"] and inputs["bounds"] == [0, 2, 4]
    back = Settings.from_inputs(inputs)
    assert back.but(top_k=3) == req
    assert req.pins.pp == 2 and req.model.leaf == ("Block",) and req.knobs.top_k == 3


def test_plans_options_are_the_settings_fields_each_in_its_sections_panel():
    """`planner plan` takes one option per CLI field of the record (its flag, default and help from the field), and
    nothing else but its own five (--out, --json, --quiet, --force, --timeout)."""
    import typer.main

    from planner.cli import app
    from planner.solve.settings import SECTIONS

    command = typer.main.get_command(app).commands["plan"]
    by_name = {p.name: p for p in command.params}
    wanted = {"engine"} | {f.name for cls in SECTIONS.values() for f in fields(cls) if f.metadata["cli"]}
    assert set(by_name) - {"help"} == (wanted - {"model_file"}) | {"model", "out_dir", "as_json", "quiet", "force", "timeout"}
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            if not f.metadata["cli"] or f.name == "model_file":
                continue
            p = by_name[f.name]
            assert p.help == f.metadata["help"] and p.rich_help_panel == section.title(), f.name
            assert (f.metadata["flag"] or "--" + f.name.replace("_", "-")) in p.opts, f.name
    assert by_name["engine"].rich_help_panel == "Engine" and not by_name["out_dir"].rich_help_panel


def test_the_options_given_are_the_fields_plan_json_records(tmp_path):
    from typer.testing import CliRunner

    from planner.cli import app

    out = tmp_path / "plan"
    args = ["plan", GPT2, "--model-arg", "preset=gpt2-tiny", "--gpus", "4xA100", "--engine", "deepspeed", "--pp", "2", "--mem-target", "0.8"]
    r = CliRunner().invoke(app, [*args, "--zero", "1", "--no-overlap-grad-reduce", "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    import json

    inputs = json.loads((out / "plan.json").read_text())["inputs"]
    given = Settings.from_inputs(inputs)
    assert (given.pins.pp, given.pins.zero, given.memory.mem_target, given.overlaps.overlap_grad_reduce) == (2, 1, 0.8, False)
    assert given.model.model_args == {"preset": "gpt2-tiny"} and given.cluster.gpus == "4xA100"
    assert set(inputs) - {"model_file_sha256", "tracer_used"} == set(Settings.recorded()) - {"bounds"}


def test_the_command_a_plan_directory_records_re_makes_its_settings(tmp_path, monkeypatch):
    """The canonical command (render.canonical_command, written where no command is given) is built from the settings
    record's fields and flags: run again in the plan directory, it plans the same settings. Before it was built from
    the record, --microbatch-group was left out of it."""
    import json
    import shlex

    from typer.testing import CliRunner

    from planner.cli import app
    from planner.render import canonical_command
    from planner.solve.plan import load_plan

    out = tmp_path / "plan"
    flags = ["--gpus", "16xH100", "--engine", "megatron", "--pp", "2", "--vp", "2", "--microbatch-group", "2"]
    flags += ["--recompute-modules", "mlp", "--mem-target", "0.8", "--no-overlap-grad-reduce", "--main-grads-dtype", "bf16", "--global-batch", "64"]
    r = CliRunner().invoke(app, ["plan", GPT2, "--model-arg", "preset=gpt2-tiny", *flags, "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    command = canonical_command(load_plan(out))
    assert "--microbatch-group 2" in command and "--recompute-modules mlp" in command
    words = shlex.split(command)
    assert words[:2] == ["planner", "plan"] and words[-2:] == ["--out", "."]
    monkeypatch.chdir(out)
    again = tmp_path / "again"
    r = CliRunner().invoke(app, [*words[1:-2], "--out", str(again), "--quiet"])
    assert r.exit_code == 0, r.output
    first, second = (json.loads((d / "plan.json").read_text())["inputs"] for d in (out, again))
    for doc in (first, second):
        doc.pop("model_file")
    assert first == second
