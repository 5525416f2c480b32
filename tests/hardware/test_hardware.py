"""Tests for planner.hardware: profiles, schema check, --gpus grammar, cluster maths, time model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from planner import hardware as hw
from planner.errors import UsageError
from planner.hardware import profiles as hw_profiles
from planner.resources import hardware_profiles_dir

GB = 1e9
GIB = 2**30
MIB = 2**20
REQUIRED_KEYS = {
    "v100-32gb",
    "a100-40gb",
    "a100-80gb",
    "a100-80gb-pcie",
    "h100-sxm",
    "h100-pcie",
    "h200",
    "b200",
    "a10",
    "l4",
    "l40s",
    "rtx-3090",
    "rtx-4090",
    "rtx-a6000",
    "mi250x",
    "mi300x",
    "cpu",
}


@pytest.fixture(scope="module")
def profiles():
    return hw.available_profiles()


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(hw.ENV_VAR, raising=False)


def bundled_yaml(key: str = "a100-80gb") -> dict:
    return yaml.safe_load((hardware_profiles_dir() / f"{key}.yaml").read_text())


def write_profile(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def schema_error(tmp_path: Path, mutate, name: str = "bad-gpu.yaml") -> str:
    data = bundled_yaml()
    mutate(data)
    path = write_profile(tmp_path / name, data)
    with pytest.raises(UsageError) as e:
        hw.load_profile(path)
    msg = str(e.value)
    assert str(path) in msg, msg
    return msg


# ----------------------------------------------------------------------------- bundled profiles


def test_every_bundled_profile_loads_with_sources(profiles):
    assert REQUIRED_KEYS <= set(profiles)
    files = sorted(p.stem for p in hardware_profiles_dir().glob("*.yaml"))
    assert files == sorted(profiles)
    for key, p in profiles.items():
        assert p.key == key and Path(p.path).stem == key
        assert 0 < p.memory_bytes <= p.marketed_memory_gib * GIB
        for dtype, f in p.peak_flops.items():
            assert dtype in hw.DTYPES and f > 0
        assert p.intra_topology in hw.TOPOLOGIES
        for eff in (p.matmul_efficiency, p.memory_efficiency, p.allreduce_efficiency_intra, p.allreduce_efficiency_inter):
            assert 0 < eff <= 1
        if not p.measured_at_runtime:  # every real number cites a URL
            for field, text in p.sources.items():
                assert "http" in text, (key, field)
    assert profiles["cpu"].measured_at_runtime
    assert sum(p.measured_at_runtime for p in profiles.values()) == 1


def test_dense_bf16_peaks_match_reference_table(profiles):
    # hardware.md section 1, dense column (no 2:4 sparsity); RTX 4090 with FP32 accumulate.
    expected = {
        "a100-40gb": 312,
        "a100-80gb": 312,
        "a100-80gb-pcie": 312,
        "h100-sxm": 989.4,
        "h200": 989.4,
        "h100-pcie": 756,
        "b200": 2250,
        "mi300x": 1307.4,
        "rtx-4090": 165.2,
        "rtx-3090": 71,
        "l40s": 362,
        "l4": 121,
        "a10": 125,
        "rtx-a6000": 154.8,
    }
    for key, tflops in expected.items():
        assert profiles[key].flops("bf16") == pytest.approx(tflops * 1e12), key
    assert profiles["h100-sxm"].flops("fp8") == pytest.approx(1978.9e12)
    assert profiles["a100-80gb"].flops("fp32") == pytest.approx(19.5e12)


def test_reference_link_and_memory_numbers(profiles):
    a100, h100, mi = profiles["a100-80gb"], profiles["h100-sxm"], profiles["mi300x"]
    assert a100.memory_bandwidth == 2039 * GB and a100.intra_bandwidth == 300 * GB
    assert a100.inter_bandwidth == 25 * GB and a100.allreduce_efficiency_intra == 0.77
    assert h100.intra_bandwidth == 450 * GB and h100.inter_bandwidth == 50 * GB
    assert mi.intra_topology == "mesh" and mi.intra_bandwidth == 64 * GB
    assert profiles["a100-40gb"].memory_bytes == 40441 * MIB  # measured, hardware.md
    assert profiles["v100-32gb"].memory_bytes == 34_058_272_768
    assert profiles["a100-80gb-pcie"].intra_topology == "pairs"
    assert profiles["rtx-4090"].intra_topology == "pcie"


def test_bundled_names_do_not_collide(profiles):
    owner: dict[str, str] = {}
    for key, p in profiles.items():
        for n in {hw_profiles._norm(x) for x in (key, p.name, *p.aliases)}:
            assert owner.setdefault(n, key) == key, f"{n!r} is claimed by {owner[n]} and {key}"
    assert not set(hw_profiles.AMBIGUOUS_DEFAULTS) & set(owner), "an ambiguous short name must not be an alias"


def test_flops_dtype_spellings_and_missing_dtype(profiles):
    a100, v100 = profiles["a100-80gb"], profiles["v100-32gb"]
    assert a100.flops("torch.bfloat16") == a100.flops("bf16") == a100.flops("BFloat16")
    assert a100.flops("half") == a100.flops("fp16")
    with pytest.raises(UsageError) as e:
        v100.flops("bf16")
    msg = str(e.value)
    assert "V100" in msg and "fp32" in msg and "fp16" in msg and "bf16" in msg


def test_profiles_are_hashable_and_comparable(profiles):
    a = profiles["a100-80gb"]
    again = hw.load_profile(a.path)
    assert a == again and hash(a) == hash(again)
    assert len({a, again, profiles["h100-sxm"]}) == 2


def test_hardware_module_is_torch_free():
    code = "import sys, planner.hardware; assert 'torch' not in sys.modules, 'torch imported'"
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


# ----------------------------------------------------------------------------- schema check


def test_schema_missing_field(tmp_path):
    msg = schema_error(tmp_path, lambda d: d.pop("memory_bandwidth_gbps"))
    assert "memory_bandwidth_gbps" in msg and "missing" in msg


def test_schema_missing_nested_field(tmp_path):
    msg = schema_error(tmp_path, lambda d: d["intra_node"].pop("latency_us"))
    assert "intra_node.latency_us" in msg and "missing" in msg


def test_schema_unit_typo_suggests_the_right_name(tmp_path):
    def typo(d):
        d["memory_bandwidth_gbs"] = d.pop("memory_bandwidth_gbps")

    msg = schema_error(tmp_path, typo)
    assert "'memory_bandwidth_gbs'" in msg and "'memory_bandwidth_gbps'" in msg


def test_schema_unknown_nested_field_suggests(tmp_path):
    def typo(d):
        d["intra_node"]["bandwidth_gbps"] = d["intra_node"].pop("bandwidth_gbps_per_direction")

    msg = schema_error(tmp_path, typo)
    assert "intra_node.bandwidth_gbps" in msg and "bandwidth_gbps_per_direction" in msg


def test_schema_wrong_type(tmp_path):
    msg = schema_error(tmp_path, lambda d: d.update(memory_bandwidth_gbps="2,039"))
    assert "memory_bandwidth_gbps" in msg and "number" in msg and "str" in msg
    msg = schema_error(tmp_path, lambda d: d.update(aliases="A100"), name="b.yaml")
    assert "aliases" in msg and "list" in msg
    msg = schema_error(tmp_path, lambda d: d.update(measured_at_runtime="yes"), name="c.yaml")
    assert "measured_at_runtime" in msg


@pytest.mark.parametrize("field,value", [("gpus_per_node", -8), ("gpus_per_node", 0), ("memory_gib", -80)])
def test_schema_non_positive_numbers(tmp_path, field, value):
    msg = schema_error(tmp_path, lambda d: d.update({field: value}))
    assert field in msg and "positive" in msg


def test_schema_negative_nested_and_fraction(tmp_path):
    msg = schema_error(tmp_path, lambda d: d["peak_tflops"].update(bf16=-312))
    assert "peak_tflops.bf16" in msg and "positive" in msg
    msg = schema_error(tmp_path, lambda d: d["efficiency"].update(matmul=85), name="e.yaml")
    assert "efficiency.matmul" in msg and "(0, 1]" in msg


def test_schema_gpus_per_node_must_be_whole(tmp_path):
    msg = schema_error(tmp_path, lambda d: d.update(gpus_per_node=7.5))
    assert "gpus_per_node" in msg and "whole" in msg


def test_schema_missing_source(tmp_path):
    msg = schema_error(tmp_path, lambda d: d["sources"].pop("peak_tflops"))
    assert "sources.peak_tflops" in msg and "source" in msg


def test_schema_sources_per_subfield_are_accepted(tmp_path):
    data = bundled_yaml()
    data["sources"].pop("peak_tflops")
    for dtype in data["peak_tflops"]:
        data["sources"][f"peak_tflops.{dtype}"] = f"https://example.com/{dtype}"
    p = hw.load_profile(write_profile(tmp_path / "split.yaml", data))
    assert p.sources["peak_tflops.bf16"].endswith("/bf16")
    # ... but one missing sub-source is reported
    data["sources"].pop("peak_tflops.fp16")
    with pytest.raises(UsageError, match=r"sources\.peak_tflops"):
        hw.load_profile(write_profile(tmp_path / "split2.yaml", data))


def test_schema_unknown_source_key(tmp_path):
    msg = schema_error(tmp_path, lambda d: d["sources"].update(memory_bandwith_gbps="x"))
    assert "sources.memory_bandwith_gbps" in msg and "memory_bandwidth_gbps" in msg


def test_schema_bad_topology_and_dtype(tmp_path):
    msg = schema_error(tmp_path, lambda d: d["intra_node"].update(topology="swtich"))
    assert "intra_node.topology" in msg and "'switch'" in msg
    msg = schema_error(tmp_path, lambda d: d["peak_tflops"].update(bf61=1), name="d.yaml")
    assert "peak_tflops.bf61" in msg and "bf16" in msg


def test_schema_usable_memory_in_wrong_unit(tmp_path):
    msg = schema_error(tmp_path, lambda d: d.update(usable_memory_bytes=79))
    assert "usable_memory_bytes" in msg and "bytes" in msg


def test_schema_not_yaml_or_not_mapping(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(UsageError, match="not valid YAML") as e:
        hw.load_profile(bad)
    assert str(bad) in str(e.value)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(UsageError, match="mapping"):
        hw.load_profile(listy)
    with pytest.raises(UsageError, match="cannot read"):
        hw.load_profile(tmp_path / "absent.yaml")


def test_schema_wrong_version(tmp_path):
    msg = schema_error(tmp_path, lambda d: d.update(schema=2))
    assert "schema" in msg


# ----------------------------------------------------------------------------- search path


def test_env_path_adds_profiles(tmp_path, monkeypatch):
    data = bundled_yaml()
    data["name"] = "Acme Widget 9000"
    data["aliases"] = ["WIDGET"]
    write_profile(tmp_path / "a" / "widget.yaml", data)
    monkeypatch.setenv(hw.ENV_VAR, str(tmp_path / "a"))
    found = hw.available_profiles()
    assert "widget" in found and "a100-80gb" in found
    device, note = hw.resolve_device("widget", found)
    assert device.key == "widget" and note is None
    cluster = hw.parse_gpus("2x4xWidget")
    assert cluster.groups[0].device.name == "Acme Widget 9000"


def test_env_path_later_dirs_and_extra_paths_override(tmp_path, monkeypatch):
    first, second = bundled_yaml(), bundled_yaml()
    first["peak_tflops"]["bf16"] = 100
    second["peak_tflops"]["bf16"] = 200
    write_profile(tmp_path / "one" / "a100-80gb.yaml", first)
    write_profile(tmp_path / "two" / "a100-80gb.yaml", second)
    monkeypatch.setenv(hw.ENV_VAR, f"{tmp_path / 'one'}{os.pathsep}{tmp_path / 'two'}")
    assert hw.available_profiles()["a100-80gb"].flops("bf16") == 200e12
    extra = bundled_yaml()
    extra["peak_tflops"]["bf16"] = 300
    extra_file = write_profile(tmp_path / "extra" / "a100-80gb.yaml", extra)
    got = hw.available_profiles([extra_file])["a100-80gb"]
    assert got.flops("bf16") == 300e12 and got.path == str(extra_file)
    monkeypatch.delenv(hw.ENV_VAR)
    assert hw.available_profiles()["a100-80gb"].flops("bf16") == 312e12


def test_env_path_missing_dir_is_a_usage_error(tmp_path, monkeypatch):
    monkeypatch.setenv(hw.ENV_VAR, str(tmp_path / "nowhere"))
    with pytest.raises(UsageError) as e:
        hw.available_profiles()
    assert "nowhere" in str(e.value) and hw.ENV_VAR in str(e.value)


def test_bad_profile_on_env_path_names_its_file(tmp_path, monkeypatch):
    data = bundled_yaml()
    data.pop("gpus_per_node")
    path = write_profile(tmp_path / "mine.yaml", data)
    monkeypatch.setenv(hw.ENV_VAR, str(tmp_path))
    with pytest.raises(UsageError) as e:
        hw.available_profiles()
    assert str(path) in str(e.value) and "gpus_per_node" in str(e.value)


# ----------------------------------------------------------------------------- name resolution


@pytest.mark.parametrize(
    "name,key",
    [
        ("A100", "a100-80gb"),
        ("H100", "h100-sxm"),
        ("V100", "v100-32gb"),
    ],
)
def test_ambiguous_names_resolve_with_a_note(profiles, name, key):
    device, note = hw.resolve_device(name, profiles)
    assert device.key == key
    assert note and name in note


def test_a100_note_names_the_40gb_part(profiles):
    _, note = hw.resolve_device("a100", profiles)
    assert "80GB" in note and "A100-40GB" in note


@pytest.mark.parametrize(
    "name,key",
    [
        ("a100-80gb", "a100-80gb"),
        ("A100-40GB", "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("A100 80GB PCIe", "a100-80gb-pcie"),
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("h100 pcie", "h100-pcie"),
        ("Tesla V100-SXM2-32GB", "v100-32gb"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("rtx4090", "rtx-4090"),
        ("RTX A6000", "rtx-a6000"),
        ("MI300X", "mi300x"),
        ("b200", "b200"),
        ("L40S", "l40s"),
        ("A10", "a10"),
        ("  h200 ", "h200"),
        ("CPU", "cpu"),
    ],
)
def test_resolve_exact_names(profiles, name, key):
    device, note = hw.resolve_device(name, profiles)
    assert device.key == key
    assert note is None or key == "mi250x"


def test_mi250x_note_explains_gcds(profiles):
    device, note = hw.resolve_device("MI250X", profiles)
    assert device.key == "mi250x" and "GCD" in note


def test_unknown_device_lists_closest_names(profiles):
    with pytest.raises(UsageError) as e:
        hw.resolve_device("RTX-4080", profiles)
    msg = str(e.value)
    assert "'RTX-4080'" in msg and "Closest names" in msg and "4090" in msg.split("Known devices")[0]
    with pytest.raises(UsageError) as e:
        hw.resolve_device("H1000", profiles)
    assert "h100" in str(e.value).split("Known devices")[0].lower()
    assert e.value.hint and "hardware list" in e.value.hint


def test_user_alias_beats_the_ambiguous_default_and_collisions_fail(tmp_path, profiles):
    data = bundled_yaml("a100-40gb")
    data["aliases"] = ["A100"]
    mine = hw.load_profile(write_profile(tmp_path / "my-a100.yaml", data))
    device, note = hw.resolve_device("A100", {**profiles, "my-a100": mine})
    assert device.key == "my-a100" and note is None
    data["aliases"] = ["A100-SXM4-80GB"]  # an alias of a100-80gb (a key match would win)
    clash = hw.load_profile(write_profile(tmp_path / "clash.yaml", data))
    with pytest.raises(UsageError, match="several profiles"):
        hw.resolve_device("A100-SXM4-80GB", {**profiles, "clash": clash})


# ----------------------------------------------------------------------------- --gpus grammar


def shape(cluster):
    return [(g.device.key, g.nodes, g.gpus_per_node) for g in cluster.groups]


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("8xA100", [("a100-80gb", 1, 8)]),
        ("4xA100", [("a100-80gb", 1, 4)]),
        ("64xH100", [("h100-sxm", 8, 8)]),
        ("4x8xA100-80GB", [("a100-80gb", 4, 8)]),
        ("1x2xa100-40gb", [("a100-40gb", 1, 2)]),
        ("A100", [("a100-80gb", 1, 1)]),
        ("8xA100+8xV100", [("a100-80gb", 1, 8), ("v100-32gb", 1, 8)]),
        ("2x8xH100+16xA100-40GB", [("h100-sxm", 2, 8), ("a100-40gb", 2, 8)]),
        ("  2 X 8 x h100-sxm  +  4 x a100  ", [("h100-sxm", 2, 8), ("a100-80gb", 1, 4)]),
        ("8xRTX 4090", [("rtx-4090", 1, 8)]),
        ("8x4090", [("rtx-4090", 1, 8)]),
        ("2x4x3090", [("rtx-3090", 2, 4)]),
        ("16xMI300X", [("mi300x", 2, 8)]),
        ("2x8xmi300x", [("mi300x", 2, 8)]),
        ("8xrtx-a6000", [("rtx-a6000", 2, 4)]),
        ("4xcpu", [("cpu", 1, 4)]),
    ],
)
def test_gpus_grammar(profiles, spec, expected):
    cluster = hw.parse_gpus(spec, profiles=profiles)
    assert shape(cluster) == expected
    assert cluster.world_size == sum(n * g for _, n, g in expected)
    assert cluster.num_nodes == sum(n for _, n, _ in expected)
    assert cluster.spec == spec.strip()


def test_gpus_uses_bundled_profiles_by_default():
    assert shape(hw.parse_gpus("8xA100")) == [("a100-80gb", 1, 8)]


def test_gpus_notes_are_collected_once(profiles):
    cluster = hw.parse_gpus("8xA100+8xA100+8xV100", profiles=profiles)
    assert len(cluster.notes) == 2
    assert any("A100-40GB" in n for n in cluster.notes) and any("V100" in n for n in cluster.notes)
    assert hw.parse_gpus("8xa100-80gb", profiles=profiles).notes == ()


def test_gpus_per_node_override(profiles):
    assert shape(hw.parse_gpus("16xA100", gpus_per_node=4, profiles=profiles)) == [("a100-80gb", 4, 4)]
    assert shape(hw.parse_gpus("12xA100", gpus_per_node=4, profiles=profiles)) == [("a100-80gb", 3, 4)]
    assert shape(hw.parse_gpus("2xA100", gpus_per_node=4, profiles=profiles)) == [("a100-80gb", 1, 2)]
    assert shape(hw.parse_gpus("8xA100+8xV100", gpus_per_node=4, profiles=profiles)) == [("a100-80gb", 2, 4), ("v100-32gb", 2, 4)]
    assert shape(hw.parse_gpus("2x4xA100", gpus_per_node=4, profiles=profiles)) == [("a100-80gb", 2, 4)]
    with pytest.raises(UsageError, match="--gpus-per-node"):
        hw.parse_gpus("2x8xA100", gpus_per_node=4, profiles=profiles)
    for bad in (0, -4, 2.5, True):
        with pytest.raises(UsageError, match="--gpus-per-node"):
            hw.parse_gpus("8xA100", gpus_per_node=bad, profiles=profiles)


def test_inter_node_gbps_override_is_gigabits(profiles):
    cluster = hw.parse_gpus("2x8xA100+8xV100", inter_node_gbps=400, profiles=profiles)
    assert all(g.inter_bandwidth == 50e9 for g in cluster.groups)  # 400 Gb/s = 50 GB/s
    assert cluster.p2p_bandwidth(0, 8) == 50e9
    assert hw.parse_gpus("2x8xA100", profiles=profiles).p2p_bandwidth(0, 8) == 25e9
    for bad in (0, -100, float("nan")):
        with pytest.raises(UsageError, match="--inter-node-gbps"):
            hw.parse_gpus("8xA100", inter_node_gbps=bad, profiles=profiles)


@pytest.mark.parametrize(
    "spec,words",
    [
        ("", ["empty"]),
        ("   ", ["empty"]),
        ("0xA100", ["positive", "0"]),
        ("-8xA100", ["positive", "-8"]),
        ("2x0xA100", ["positive"]),
        ("8.5xA100", ["whole", "8.5"]),
        ("1.5x8xA100", ["whole"]),
        ("12xA100", ["12", "divide evenly", "8"]),
        ("8x", ["no device"]),
        ("x8", ["malformed", "before the device"]),
        ("A100x8", ["malformed", "before the device"]),
        ("8xA100+", ["empty", "+"]),
        ("+8xA100", ["empty"]),
        ("8xA100++8xV100", ["empty"]),
        ("2x4x8xA100", ["3 counts", "at most two"]),
    ],
)
def test_gpus_errors(profiles, spec, words):
    with pytest.raises(UsageError) as e:
        hw.parse_gpus(spec, profiles=profiles)
    msg = str(e.value)
    for w in words:
        assert w in msg, (spec, w, msg)
    assert e.value.hint


def test_gpus_not_divisible_hint_suggests_a_form(profiles):
    with pytest.raises(UsageError) as e:
        hw.parse_gpus("12xA100", profiles=profiles)
    assert "2x8xA100" in e.value.hint and "--gpus-per-node" in e.value.hint


def test_gpus_unknown_device_lists_closest_names(profiles):
    with pytest.raises(UsageError) as e:
        hw.parse_gpus("8xA100+8xH1OO", profiles=profiles)
    head = str(e.value).split("Known devices")[0]
    assert "H1OO" in head and "Closest names" in head and "8xA100+8xH1OO" in head


# ----------------------------------------------------------------------------- cluster maths


def test_rank_layout_heterogeneous(profiles):
    c = hw.parse_gpus("2x4xA100+8xV100", profiles=profiles)
    assert c.world_size == 16 and c.num_nodes == 3 and not c.homogeneous
    assert [c.node_of(r) for r in (0, 3, 4, 7, 8, 15)] == [0, 0, 1, 1, 2, 2]
    assert c.ranks_of_node(1) == range(4, 8) and c.ranks_of_node(2) == range(8, 16)
    assert c.device_of(7).key == "a100-80gb" and c.device_of(8).key == "v100-32gb"
    assert c.gpus_per_node_of(0) == 4 and c.gpus_per_node_of(9) == 8
    for bad in (-1, 16):
        with pytest.raises(ValueError):
            c.node_of(bad)
    with pytest.raises(ValueError):
        c.ranks_of_node(3)
    assert hw.parse_gpus("2x8xA100", profiles=profiles).homogeneous
    assert hw.parse_gpus("8xA100+8xA100-80GB", profiles=profiles).homogeneous


def test_p2p_intra_vs_inter(profiles):
    c = hw.parse_gpus("2x8xA100", profiles=profiles)
    S = 64 * MIB
    # a send inside the node runs at what one NCCL send/recv reaches over NVLink (intra_node.p2p_gbps), not the
    # links' 300 GB/s that collectives use
    assert c.device_of(0).intra_bandwidth == 300e9
    assert c.p2p_bandwidth(0, 7) == 72e9 and c.p2p_latency(0, 7) == pytest.approx(5e-6)
    assert c.p2p_time(S, 0, 7) == pytest.approx(5e-6 + S / 72e9)
    assert c.p2p_bandwidth(7, 8) == 25e9
    assert c.p2p_time(S, 7, 8) == pytest.approx(10e-6 + S / 25e9)
    assert c.p2p_time(S, 3, 3) == 0.0 and c.p2p_time(0, 0, 8) == 0.0
    assert c.p2p_time(S, 7, 8) > 2.5 * c.p2p_time(S, 0, 7)


def test_p2p_heterogeneous_takes_slowest_end(profiles):
    c = hw.parse_gpus("8xA100+8xV100", profiles=profiles)
    assert c.p2p_bandwidth(0, 8) == 6.25e9  # DGX-1 4x EDR per 8 GPUs
    assert c.p2p_latency(0, 8) == max(profiles["a100-80gb"].inter_latency, profiles["v100-32gb"].inter_latency)


def test_pairs_topology(profiles):
    c = hw.parse_gpus("8xA100-PCIe", profiles=profiles)
    d = profiles["a100-80gb-pcie"]
    assert d.intra_topology == "pairs"
    assert c.p2p_bandwidth(0, 1) == c.p2p_bandwidth(6, 7) == 300e9  # bridged
    assert c.p2p_bandwidth(1, 2) == c.p2p_bandwidth(0, 7) == 32e9  # PCIe
    S, eff = 1e9, d.allreduce_efficiency_intra
    assert c.allreduce_time(S, [2, 3]) == pytest.approx(S / (300e9 * eff) + 2 * d.intra_latency)
    assert c.allreduce_time(S, [1, 2]) == pytest.approx(S / (32e9 * eff) + 2 * d.intra_latency)
    assert c.allreduce_time(S, range(4)) == pytest.approx(2 * 3 / 4 * S / (32e9 * eff) + 6 * d.intra_latency)


def test_allreduce_one_node_closed_form(profiles):
    c = hw.parse_gpus("8xA100", profiles=profiles)
    S = 1e9
    expected = 2 * 7 / 8 * S / (300e9 * 0.77) + 2 * 7 * 5e-6
    assert c.allreduce_time(S, range(8)) == pytest.approx(expected, rel=1e-12)
    assert c.reduce_scatter_time(S, range(8)) == pytest.approx(7 / 8 * S / (300e9 * 0.77) + 7 * 5e-6)
    assert c.all_gather_time(S, range(8)) == pytest.approx(c.reduce_scatter_time(S, range(8)))
    assert c.allreduce_time(S, [3]) == 0.0 and c.allreduce_time(S, []) == 0.0
    assert c.allreduce_time(0, range(8)) == 0.0
    assert c.allreduce_time(S, [0, 0, 1]) == pytest.approx(c.allreduce_time(S, [0, 1]))
    with pytest.raises(ValueError):
        c.allreduce_time(-1, range(8))


def test_allreduce_across_nodes_uses_inter_tier(profiles):
    c = hw.parse_gpus("2x8xA100", profiles=profiles)
    S = 1e9
    # one rank per node (e.g. a data-parallel group of a tp=8 layout): the per-GPU NIC share
    busbw = 25e9 * 0.85
    assert c.allreduce_time(S, [0, 8]) == pytest.approx(2 * 1 / 2 * S / busbw + 2 * 10e-6)
    # 8 ranks per node: 8 NIC shares per node, capped by NVLink (300*0.77 = 231 GB/s)
    busbw16 = min(8 * 25e9 * 0.85, 300e9 * 0.77)
    assert busbw16 == 170e9
    assert c.allreduce_time(S, range(16)) == pytest.approx(2 * 15 / 16 * S / busbw16 + 2 * 15 * 10e-6)
    assert c.allreduce_time(S, range(16)) > c.allreduce_time(S, range(8))
    assert c.reduce_scatter_time(S, [0, 8]) == pytest.approx(1 / 2 * S / busbw + 10e-6)


def test_mesh_collectives_scale_with_peers(profiles):
    c = hw.parse_gpus("8xMI300X", profiles=profiles)
    assert c.bus_bandwidth(range(8))[0] == pytest.approx(7 * 64e9 * 0.70)  # ~313.6; measured 312.9 (hardware.md)
    assert c.bus_bandwidth([0, 5])[0] == pytest.approx(64e9 * 0.70)  # measured 47.7 on 2 GPUs
    assert c.p2p_bandwidth(0, 5) == 64e9


def test_cluster_to_dict_is_json(profiles):
    c = hw.parse_gpus("2x8xA100+8xV100", inter_node_gbps=200, profiles=profiles)
    d = json.loads(json.dumps(c.to_dict()))
    assert d["spec"] == "2x8xA100+8xV100" and d["world_size"] == 24 and d["num_nodes"] == 3
    assert [(g["device"], g["nodes"], g["gpus_per_node"]) for g in d["groups"]] == [("a100-80gb", 2, 8), ("v100-32gb", 1, 8)]
    assert d["groups"][0]["name"] == "NVIDIA A100 SXM4 80GB"
    assert d["groups"][1]["inter_node_bandwidth_bytes_per_s"] == 25e9
    assert len(d["notes"]) == 2


# ----------------------------------------------------------------------------- time model


def test_matmul_and_memory_time(profiles):
    """The time model against its closed forms, with every figure read from the YAML file itself (not the loader)."""
    raw = bundled_yaml("a100-80gb")
    a100 = profiles["a100-80gb"]
    eff_mm, eff_mem = raw["efficiency"]["matmul"] * raw["efficiency"].get("sustained", 1.0), raw["efficiency"]["memory"]
    bf16, fp32 = raw["peak_tflops"]["bf16"] * 1e12, raw["peak_tflops"]["fp32"] * 1e12
    big = 1e12  # past the top of the size curve
    assert hw.matmul_efficiency_at(big, a100) == pytest.approx(eff_mm)
    assert hw.matmul_time(big, a100, "bf16") == pytest.approx(big / (bf16 * eff_mm))
    assert hw.matmul_time(big, a100, "fp32") == pytest.approx(big / (fp32 * eff_mm))
    assert hw.memory_time(raw["memory_bandwidth_gbps"] * GB * eff_mem, a100) == pytest.approx(1.0)
    assert hw.matmul_time(0, a100, "bf16") == 0.0 and hw.memory_time(0, a100) == 0.0
    with pytest.raises(UsageError):
        hw.matmul_time(1e9, profiles["v100-32gb"], "bf16")


def test_sustained_fraction_scales_every_gemm_and_no_memory_kernel(profiles):
    """efficiency.sustained multiplies the rate of every GEMM (bf16 and FP8, at every size) and leaves memory-bound
    kernels alone; 1 when a profile does not state it."""
    from dataclasses import replace

    h100 = profiles["h100-sxm"]
    assert profiles["l4"].sustained_matmul == 1.0 and 0.7 <= h100.sustained_matmul <= 1.0  # unstated: 1
    half = replace(h100, sustained_matmul=h100.sustained_matmul / 2)
    for size in (1e6, 4e9, 1e12):
        for dtype in ("bf16", "fp8"):
            assert hw.matmul_time(size, half, dtype) == pytest.approx(2 * hw.matmul_time(size, h100, dtype))
    assert hw.memory_time(1e9, half, bytes_per_op=1e6) == hw.memory_time(1e9, h100, bytes_per_op=1e6)


def test_matmul_efficiency_depends_on_op_size(profiles):
    """Calculon's a100_80g.json tiers (0.95 at 128 GFLOP, 0.9 at 16, 0.6 at 1, 0.1 below), relative to its ceiling."""
    a100 = profiles["a100-80gb"]
    raw = bundled_yaml("a100-80gb")["efficiency"]
    eff = raw["matmul"] * raw.get("sustained", 1.0)
    assert hw.matmul_efficiency_at(1e9, a100) == pytest.approx(eff * 0.6 / 0.95)
    assert hw.matmul_efficiency_at(16e9, a100) == pytest.approx(eff * 0.9 / 0.95)
    assert hw.matmul_efficiency_at(1e3, a100) == pytest.approx(eff * 0.1 / 0.95)
    sizes = [10 ** (k / 4) for k in range(12, 60)]
    effs = [hw.matmul_efficiency_at(s, a100) for s in sizes]
    times = [hw.matmul_time(s, a100, "bf16") for s in sizes]
    assert effs == sorted(effs) and times == sorted(times) and len(set(times)) == len(times)
    # many small matmuls are slower than one large one with the same FLOPs
    assert hw.matmul_time(64e9, a100, "bf16", flops_per_op=1e9) > 1.3 * hw.matmul_time(64e9, a100, "bf16")


def test_size_curves_are_profile_data(tmp_path, profiles):
    """A profile's own efficiency curves replace the defaults (Calculon's A100 tiers) for that device alone."""
    data = bundled_yaml()
    eff_mm, eff_mem = data["efficiency"]["matmul"] * data["efficiency"].get("sustained", 1.0), data["efficiency"]["memory"]
    data["efficiency"]["matmul_size_scale"] = [[1e9, 0.5], [1e10, 1.0]]
    data["efficiency"]["memory_size_scale"] = [[1e6, 0.25], [1e8, 1.0]]
    own = hw.load_profile(write_profile(tmp_path / "curved.yaml", data))
    assert hw.matmul_efficiency_at(1e9, own) == pytest.approx(eff_mm * 0.5)
    assert hw.matmul_efficiency_at(10**9.5, own) == pytest.approx(eff_mm * 0.75)  # halfway in log(FLOPs)
    assert hw.memory_efficiency_at(1e7, own) == pytest.approx(eff_mem * 0.625)
    assert hw.matmul_efficiency_at(1e9, profiles["a100-80gb"]) == pytest.approx(eff_mm * 0.6 / 0.95)
    rows = {r[0]: r for r in hw.describe_profile(own)}
    assert "1e+09 FLOPs: 0.500" in rows["efficiency.matmul_size_scale"][1]


@pytest.mark.parametrize("curve", [[[1e9, 0.5]], [[1e9, 0.5], [1e8, 1.0]], [[1e9, 1.5], [1e10, 1.0]], "fast", [[1e9, float("nan")], [1e10, 1]]])
def test_size_curve_schema(tmp_path, curve):
    msg = schema_error(tmp_path, lambda d: d["efficiency"].__setitem__("matmul_size_scale", curve))
    assert "efficiency.matmul_size_scale" in msg


# ----------------------------------------------------------------------------- CLI helpers


def test_profiles_table_rows(profiles):
    rows = hw.profiles_table_rows(profiles)
    assert [r["key"] for r in rows] == sorted(profiles)
    row = next(r for r in rows if r["key"] == "a100-80gb")
    assert row["bf16_tflops"] == 312 and row["memory_bandwidth_gbps"] == 2039
    assert row["inter_node_gbps_per_gpu"] == 25 and row["gpus_per_node"] == 8
    assert 78 < row["usable_memory_gib"] <= 80 and "300" in row["intra_link"]
    assert next(r for r in rows if r["key"] == "v100-32gb")["bf16_tflops"] is None
    assert "PCIe 32" in next(r for r in rows if r["key"] == "a100-80gb-pcie")["intra_link"]


def test_describe_profile(profiles):
    rows = hw.describe_profile(profiles["h100-sxm"])
    table = {field: (value, source) for field, value, source in rows}
    assert table["peak_tflops.bf16"][0] == "989.4 TFLOP/s dense" and "http" in table["peak_tflops.bf16"][1]
    assert table["inter_node.bandwidth_gbps_per_direction"][0].startswith("50 GB/s") and "400 Gb/s" in table["inter_node.bandwidth_gbps_per_direction"][0]
    assert table["intra_node.topology"][0] == "switch"
    assert "measured_at_runtime" not in table
    assert "measured_at_runtime" in {f for f, _, _ in hw.describe_profile(profiles["cpu"])}


def test_profiles_and_clusters_pickle_and_stay_read_only(profiles):
    import copy
    import dataclasses
    import pickle

    c = hw.parse_gpus("2x8xA100+8xV100", profiles=profiles)
    c.node_of(9)  # fills the cached rank table
    again = pickle.loads(pickle.dumps(c))
    assert again == c and again.allreduce_time(1e9, range(24)) == c.allreduce_time(1e9, range(24))
    assert copy.deepcopy(profiles["a100-80gb"]) == profiles["a100-80gb"]
    assert dataclasses.asdict(profiles["a100-80gb"])["peak_flops"]["bf16"] == 312e12
    with pytest.raises(TypeError):
        profiles["a100-80gb"].peak_flops["bf16"] = 1.0
    assert len({c, again}) == 1


#: OpenXLA's sm_90 default matmul table (third_party/xla/xla/service/gpu/model/matmul_interpolator_data.h), BF16 GEMMs with
#: every dimension >= 1024, by size 2 b m n k: the median of the shapes of that size, TFLOP/s, worked out by hand from the
#: table's entries (two middle values averaged where the count is even)
XLA_SM90_BF16_MEDIANS = {
    2 * 2 * 1024**3: (350.0, 373.3, 373.3, 373.9),  # 4.3 GFLOP: median (373.3 + 373.3) / 2
    2 * 4 * 1024**3: 491.85,  # 8.6 GFLOP, 10 shapes: (490.3 + 493.4) / 2
    2 * 2048**3: 627.75,  # 17.2 GFLOP, 16 shapes: (626.1 + 629.4) / 2
    2 * 2 * 2048**3: 714.6,  # 34.4 GFLOP, 19 shapes: the 10th
    2 * 4 * 2048**3: 736.0,  # 68.7 GFLOP, 16 shapes: (733.3 + 738.7) / 2
    2 * 4096**3: 775.55,  # 137 GFLOP, 10 shapes: (773.5 + 777.6) / 2
}


@pytest.mark.parametrize("name", ["h100-sxm.yaml", "h200.yaml"])
def test_gh100_gemm_size_curve_is_the_measured_sm90_table(name):
    """The GH100 profiles rate a BF16 GEMM of each size at the median the XLA table measured for it (within the curve's
    3-digit rounding), and the table's largest GEMMs at the MAMF ceiling; the A100 keeps the default (Calculon) curve."""
    from dataclasses import replace

    # the table's short-loop rates: before the fraction of them a training step sustains (efficiency.sustained)
    p = replace(hw_profiles.load_profile(hardware_profiles_dir() / name), sustained_matmul=1.0)
    for flops, median in XLA_SM90_BF16_MEDIANS.items():
        tflops = median[1] if isinstance(median, tuple) else median
        assert p.flops("bf16") * hw.matmul_efficiency_at(flops, p, "bf16") / 1e12 == pytest.approx(tflops, rel=2e-3)
        # seconds of one such GEMM: FLOPs over the measured rate
        assert hw.matmul_time(flops, p, "bf16") == pytest.approx(flops / (tflops * 1e12), rel=2e-3)
    # 275 GFLOP and up: the table's 802-809 (550 GFLOP: 793) TFLOP/s, at or above 0.80 x 989.4 = 791.5: the ceiling
    assert hw.matmul_efficiency_at(2 * 2 * 4096**3, p, "bf16") == pytest.approx(0.8, rel=1e-4)
    assert hw.matmul_efficiency_at(2 * 4 * 4096**3, p, "bf16") == pytest.approx(0.8)
    a100 = hw_profiles.load_profile(hardware_profiles_dir() / "a100-80gb.yaml")
    assert a100.matmul_size_scale == hw_profiles.MATMUL_SIZE_SCALE


def test_hardware_show_lists_the_sustained_fraction_where_a_profile_states_one(profiles):
    """`planner hardware show` prints efficiency.sustained and its source where the profile has one, nothing where not."""
    from planner.hardware import describe_profile

    h100 = {k: (v, s) for k, v, s in describe_profile(profiles["h100-sxm"])}
    assert h100["efficiency.sustained"][0].startswith(f"{profiles['h100-sxm'].sustained_matmul:g} ")
    assert "bench/fit_sustained.py" in h100["efficiency.sustained"][1]
    assert "efficiency.sustained" not in {k for k, _, _ in describe_profile(profiles["l4"])}
