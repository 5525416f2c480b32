"""The host-issue floor (profile fixed_costs.host_us): closed forms, the traced operator count, profiles and calibration."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from planner import hardware
from planner.check.calibrate import fixed_costs_of
from planner.records import Layer
from planner.resources import hardware_profiles_dir
from planner.solve.timing import analytical_times, host_bound, issued_operators
from tests.conftest import costs_of


def test_host_bound_in_closed_form():
    # a forward of 1 ms whose 300 operators take the host 5 us each (1.5 ms): the forward takes the host's 1.5 ms
    assert host_bound(1e-3, 2e-3, 1e-3, 1.5e-3, 1e-3) == pytest.approx((1.5e-3, 2e-3, 1e-3))
    # a backward of 0.6 + 0.2 ms issued in 1.2 ms: stretched by 1.5, input and weight gradients in their own ratio 3:1
    assert host_bound(1e-3, 0.6e-3, 0.2e-3, 0.0, 1.2e-3) == pytest.approx((1e-3, 0.9e-3, 0.3e-3))
    # a backward with no time of its own: all of the host's time is the input gradient's
    assert host_bound(0.0, 0.0, 0.0, 2e-6, 3e-6) == (2e-6, 3e-6, 0.0)
    # the GPU slower than the host: nothing changes
    assert host_bound(5e-3, 4e-3, 2e-3, 1e-3, 1e-3) == (5e-3, 4e-3, 2e-3)


def _layer(**kw) -> Layer:
    base = dict(name="p", kind="mlp", params=0, param_bytes=0, flops_fwd=0.0, flops_bwd=0.0, saved_bytes=0, out_bytes=0)
    return Layer(**(base | kw))


def test_issued_operators_count_each_local_experts_gemms():
    # 2 GEMMs and 3 other operators forward (one on the residual stream); 4 GEMMs and 5 others backward;
    # 3 grouped GEMMs over 128 experts forward and 6 backward: 16 GEMMs each on a GPU of ep 8
    l = _layer(
        op_flops_fwd=(1.0, 2.0),
        op_bytes_fwd=(1.0, 1.0),
        op_bytes_fwd_resid=(1.0,),
        op_flops_bwd=(1.0,) * 4,
        op_bytes_bwd=(1.0,) * 5,
        num_experts=128,
        expert_op_flops_fwd=(1.0,) * 3,
        expert_op_flops_bwd=(1.0,) * 6,
    )
    assert issued_operators(l, ep=8) == (2 + 3 + 16 * 3, 4 + 5 + 16 * 6)
    assert issued_operators(l, ep=128) == (2 + 3 + 3, 4 + 5 + 6)  # one local expert
    assert issued_operators(l, ep=8, casts=4) == (2 + 3 + 48 + 4, 4 + 5 + 96 + 4)
    dense = _layer(op_flops_fwd=(1.0,), op_bytes_fwd=(1.0,), op_flops_bwd=(1.0, 1.0))
    assert issued_operators(dense, ep=8) == (2, 2)  # ep does not touch a dense piece


def test_every_piece_takes_at_least_its_operators_host_time():
    """moe-tiny on an H100 with host_us 50: each piece's forward is max(GPU time, forward operators x 50 us) and its
    backward max(GPU time, backward operators x 50 us); host_us 0 is the time model as it was."""
    c = costs_of("moe", "moe-tiny")
    dev = hardware.parse_gpus("8xH100").device_of(0)
    ep = 4
    base = analytical_times(c, dev, "bf16", experts=(ep, 1, 0.0))
    assert analytical_times(c, dev, "bf16", experts=(ep, 1, 0.0), host_op_s=0.0) == base
    h = 50e-6
    t = analytical_times(c, dev, "bf16", experts=(ep, 1, 0.0), host_op_s=h)
    bound = 0
    for k, l in enumerate(c.layers):
        n_f, n_b = issued_operators(l, ep)
        assert t.fwd[k] == pytest.approx(max(base.fwd[k], n_f * h), rel=1e-12)
        assert t.bwd_input[k] + t.bwd_weight[k] == pytest.approx(max(base.bwd_input[k] + base.bwd_weight[k], n_b * h), rel=1e-12)
        bound += t.fwd[k] > base.fwd[k]
    assert bound > 0  # a tiny model on an H100 is host-bound somewhere
    assert any(l.num_experts for l in c.layers)
    # full recomputation replays the host-bound forward
    full = analytical_times(c, dev, "bf16", "full", experts=(ep, 1, 0.0), host_op_s=h)
    assert full.recompute == pytest.approx(t.fwd, rel=1e-12)


def _profile_with(tmp_path, **fixed) -> hardware.DeviceProfile:
    data = yaml.safe_load((hardware_profiles_dir() / "h100-sxm.yaml").read_text())
    data["fixed_costs"] = fixed
    data["sources"]["fixed_costs"] = "test"
    path = tmp_path / "h100-host.yaml"
    path.write_text(yaml.safe_dump(data))
    return hardware.load_profile(path)


def test_profile_host_us_is_optional_and_read_in_microseconds(tmp_path):
    p = _profile_with(tmp_path, kernel_us=1.0, p2p_sync_us=10.0, host_us=6.5)
    assert p.host_op_s == pytest.approx(6.5e-6) and p.kernel_floor_s == pytest.approx(1e-6)
    assert _profile_with(tmp_path, kernel_us=1.0, p2p_sync_us=10.0).host_op_s == 0.0
    assert hardware.parse_gpus("8xH100").device_of(0).host_op_s == 0.0  # no bundled profile sets it
    with pytest.raises(Exception, match="host_us"):
        _profile_with(tmp_path, kernel_us=1.0, p2p_sync_us=10.0, host_us="fast")


def test_a_calibrated_profile_keeps_the_base_host_time():
    dev = hardware.parse_gpus("8xH100").device_of(0)
    assert fixed_costs_of(dataclasses.replace(dev, kernel_floor_s=2e-6, p2p_sync_s=0.0)) == {"kernel_us": 2.0, "p2p_sync_us": 0.0}
    assert fixed_costs_of(dataclasses.replace(dev, host_op_s=7e-6))["host_us"] == pytest.approx(7.0)
