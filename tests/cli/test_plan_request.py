"""PlanRequest.pinned_to: re-planning a plan's layout (smoke, calibrate) pins every dimension the layout fixes."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from planner.planning import PlanRequest, plan_model
from planner.solve.plan import Layout
from planner.solve.search import SearchOptions

GPT2 = str(Path(__file__).resolve().parents[2] / "examples" / "gpt2.py")
SHARED = sorted({f.name for f in fields(SearchOptions)} & {f.name for f in fields(Layout)})


def test_every_layout_dimension_the_search_turns_is_pinned():
    lay = Layout("megatron", 2, 2, 2, 2, 1, 8, 32, "interleaved", "selective", 1, True, cp=2, tp_comm_overlap=True)
    lay = Layout.from_dict({**lay.to_dict(), "overlap_grad_reduce": True, "main_grads_dtype": "bf16", "optimizer_state_dtype": "bf16", "fp8": True})
    inputs = PlanRequest(model_file=GPT2, model_args={"preset": "gpt2-tiny"}, gpus="16xH100", engine="megatron").to_inputs()
    req = PlanRequest.pinned_to(inputs, lay, (0, 3, 6), gpus="16xH100")
    assert {"pp", "tp", "dp", "vp", "cp", "tp_comm_overlap", "fp8", "main_grads_dtype"} <= set(SHARED)
    for name in SHARED:
        assert getattr(req, name) == getattr(lay, name), name
    assert (req.bounds, req.mem_target, req.profile) == ((0, 3, 6), 1.0, None)


def test_replanning_a_plan_pinned_to_its_layout_reproduces_it():
    req = PlanRequest(model_file=GPT2, model_args={"preset": "gpt2-tiny"}, gpus="8xH100", engine="megatron")
    plan = plan_model(req)[0]
    bounds = tuple([s.pieces[0] for s in plan.stages] + [plan.stages[-1].pieces[1]])
    again = plan_model(PlanRequest.pinned_to(plan.inputs, plan.layout, bounds))[0]
    assert again.layout == plan.layout
    assert [s.pieces for s in again.stages] == [s.pieces for s in plan.stages]
