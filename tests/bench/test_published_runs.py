"""The memory model never predicts out-of-memory for a configuration experts really trained (published-runs.md),
and the step-time predictions stay within the error budget (one set of defaults for every run).

The second half checks the published-run data set (bench/data/published_runs.yaml) on its own: layouts that
multiply out, batches that divide, converted step times that reproduce the published figures with each
source's FLOP formula (re-derived here in expanded form, independently of bench/published_runs.py), and
published figures that agree with each other. No prediction accuracy is asserted for the new rows yet."""

from dataclasses import replace

import pytest
import yaml

from bench.published_runs import DATA, RUNS, layout_for, load_runs, model_file, not_expressible, predict, split_args, stage_bounds


@pytest.fixture(scope="module")
def predictions():
    return {r.id: predict(r) for r in RUNS}


@pytest.mark.parametrize("run", RUNS, ids=[r.id for r in RUNS])
def test_published_run_fits_in_80_gb(predictions, run):
    p = predictions[run.id]
    assert p.rejected is None, p.rejected
    assert p.peak_memory_bytes <= p.capacity_bytes


def test_mean_absolute_error_within_10_percent(predictions):
    errors = [abs(p.error) for p in predictions.values()]
    assert sum(errors) / len(errors) <= 0.10
    assert max(errors) <= 0.15


# --------------------------------------------------------------------------- the data set itself

RAW = yaml.safe_load(DATA.read_text())
ROWS = RAW["runs"]
SOURCES = RAW["sources"]
SHAPES = {k: dict(zip(("layers", "hidden", "heads", "kv", "ffn", "vocab", "seq", "arch"), v)) for k, v in RAW["models"].items()}
#: dense bf16/fp16 peak TFLOP/s the sources quote MFU against (A100: 312, H100 SXM: 989)
PEAK = {"A100-80GB": 312.0, "H100-SXM": 989.0}


def _shape(row):
    return SHAPES[row["model"]]


def _flops(row) -> float:
    """FLOPs per step by the row's source, written out term by term (independent of bench/published_runs.py)."""
    m, B = _shape(row), row["global_batch"]
    s, l, h, V, a, g, f = m["seq"], m["layers"], m["hidden"], m["vocab"], m["heads"], m["kv"], m["ffn"]
    formula = SOURCES[row["source"]]["flop_formula"]
    if formula == "megatron2021":  # 96 B s l h^2 (1 + s/6h + V/16lh), expanded
        return 96 * B * s * l * h * h + 16 * B * s * s * l * h + 6 * B * s * h * V
    gated = 1.5 if m["arch"] == "llama" else 1.0
    if formula == "megatron2024":  # 12 B s l h^2 ((1 + g/a + s/h) + f/h gated) + 6 B s h V
        return 12 * B * s * l * (h * h * (1 + g / a) + s * h + h * f * gated) + 6 * B * s * h * V
    if formula == "nemo2407":
        if m["arch"] == "gpt":  # NeMo prices GPT-3 at its 51200 vocabulary whatever the run's
            return 72 * B * s * l * h * h + 12 * B * s * s * l * h + 6 * B * s * h * 51200
        ffn_coeff, vocab = (18, V) if m["arch"] == "llama" else (12, 256000)
        return B * s * l * (12 * h * h + 12 * h * h * g / a + ffn_coeff * f * h + 12 * s * h) + 6 * B * s * h * vocab
    if formula == "bridge2602":  # the llama3 formula with the causal s^2 term halved
        return B * s * l * (12 * h * h + 12 * h * h * g / a + 18 * f * h + 6 * s * h) + 6 * B * s * h * V
    raise AssertionError(f"unknown formula {formula}")


def _step_from_published(row) -> float:
    rep, how = row["reported"], SOURCES[row["source"]]["step_from"]
    if how == "step_s":
        return rep["step_s"]
    if how == "tokens":
        return row["global_batch"] * _shape(row)["seq"] / (rep["tokens"] * row["gpus"])
    if how == "samples":
        return row["global_batch"] / (rep["samples"] * row["gpus"])
    return _flops(row) / (rep["tflops"] * 1e12 * row["gpus"])


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_layout_multiplies_out_to_the_gpu_count(row):
    assert row["tp"] * row["pp"] * row["dp"] * row.get("cp", 1) == row["gpus"]


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_global_batch_is_micro_batch_times_dp_times_microbatches(row):
    m, rem = divmod(row["global_batch"], row["micro_batch"] * row["dp"])
    assert rem == 0 and m >= 1
    assert m * row["micro_batch"] * row["dp"] == row["global_batch"]


@pytest.mark.parametrize("row", [r for r in ROWS if r.get("vp", 1) > 1], ids=lambda r: r["id"])
def test_interleaved_rows_split_their_layers_evenly(row):
    """Megatron interleaving needs layers / (pp x vp) whole chunks; Megatron-Bridge may count embedding and loss as one layer each."""
    chunks = row["pp"] * row["vp"]
    layers = _shape(row)["layers"]
    assert layers % chunks == 0 or (layers + 2) % chunks == 0


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_converted_step_time_reproduces_the_published_figure(row):
    """step_s in the data file = the source's own conversion of what it published (4 significant digits)."""
    assert row["step_s"] == pytest.approx(_step_from_published(row), rel=6e-4)


@pytest.mark.parametrize("row", [r for r in ROWS if "tflops" in r["reported"]], ids=lambda r: r["id"])
def test_published_tflops_agree_with_the_step_time(row):
    """Where a source publishes TFLOP/s next to tokens/s or a step time, its FLOP formula links the two within 1%
    (this is what pins the model shapes and each source's formula)."""
    tflops = _flops(row) / row["step_s"] / row["gpus"] / 1e12
    assert tflops == pytest.approx(row["reported"]["tflops"], rel=0.01)


@pytest.mark.parametrize("row", [r for r in ROWS if "mfu" in r["reported"] and "tflops" in r["reported"]], ids=lambda r: r["id"])
def test_published_mfu_is_tflops_over_peak(row):
    peak = PEAK[SOURCES[row["source"]]["device"]]
    assert 100 * row["reported"]["tflops"] / peak == pytest.approx(row["reported"]["mfu"], abs=1.0)


@pytest.mark.parametrize("row", [r for r in ROWS if "aggregate_pflops" in r["reported"]], ids=lambda r: r["id"])
def test_published_aggregate_is_tflops_times_gpus(row):
    """Within the rounding of both printed figures (TFLOP/s to its last printed digit, PFLOP/s to 0.1)."""
    tflops = row["reported"]["tflops"]
    decimals = len(str(tflops).split(".")[1]) if "." in str(tflops) else 0
    slack = 0.5 * 10**-decimals * row["gpus"] / 1000 + 0.05
    assert tflops * row["gpus"] / 1000 == pytest.approx(row["reported"]["aggregate_pflops"], abs=slack + 1e-9)


@pytest.mark.parametrize("row", [r for r in ROWS if r["source"] == "korthikanti2022" and "mfu" in r["reported"]], ids=lambda r: r["id"])
def test_korthikanti_mfu_reproduces_from_the_step_time(row):
    """Korthikanti et al. count 72 B s l h^2 (1 + s/6h + V/12lh) model FLOPs per step (no recomputation)."""
    m = _shape(row)
    B, s, l, h, V = row["global_batch"], m["seq"], m["layers"], m["hidden"], m["vocab"]
    flops = 72 * B * s * l * h * h + 12 * B * s * s * l * h + 6 * B * s * h * V
    mfu = 100 * flops / (row["step_s"] * row["gpus"] * 312e12)
    assert mfu == pytest.approx(row["reported"]["mfu"], abs=0.6)


def test_every_row_names_a_source_and_a_known_shape():
    for row in ROWS:
        assert row["source"] in SOURCES and row["model"] in SHAPES, row["id"]
    for key, src in SOURCES.items():
        assert src["split"] in ("tune", "test"), key
        assert src["cite"] and src["flop_text"] and src["device"] in PEAK, key
    assert len({r["id"] for r in ROWS}) == len(ROWS)


def test_set_size_and_coverage():
    """At least 25 rows from at least 4 independent sources, 10+ on H100, 8 to 10,000+ GPUs, with and without pipelining."""
    assert len(ROWS) >= 25
    assert len({r["source"] for r in ROWS}) >= 4
    assert sum(SOURCES[r["source"]]["device"] == "H100-SXM" for r in ROWS) >= 10
    gpus = [r["gpus"] for r in ROWS]
    assert min(gpus) == 8 and max(gpus) >= 10_000
    assert any(r["pp"] > 1 for r in ROWS) and any(r["pp"] == 1 for r in ROWS)


def test_split_is_by_source_and_keeps_the_original_runs_in_tune():
    splits = {r["source"]: SOURCES[r["source"]]["split"] for r in ROWS}
    assert sum(s == "test" for s in splits.values()) >= 3
    assert all(SOURCES[r["source"]]["split"] == "tune" for r in ROWS if r["id"].startswith("C"))
    assert {f"C{i}" for i in range(1, 8)} <= {r["id"] for r in ROWS}


def test_loader_keeps_every_row_and_names_what_the_planner_lacks():
    runs = {r.id: r for r in load_runs()}
    assert len(runs) == len(ROWS)
    for rid in ("L3-16k-cp16", "N-gpt3-5b", "N-llama3-70b", "M24-462b", "N-nemotron-22b"):  # cp, FP8, squared ReLU are priced
        assert not_expressible(runs[rid]) is None, rid
    path, args = model_file(runs["N-nemotron-22b"])
    assert path.name == "llama.py" and args["activation"] == "squared_relu"
    elsewhere = replace(runs["N-nemotron-22b"], source=replace(runs["N-nemotron-22b"].source, device="TPU-v5p"))
    assert "hardware profile for the TPU-v5p" in not_expressible(elsewhere)
    p = predict(elsewhere)  # kept and reported, not dropped
    assert p.predicted_step_s is None and "TPU-v5p" in p.skipped


def test_layouts_carry_cp_fp8_and_the_sources_overlaps():
    """The Layout priced for a row is the row's: cp, FP8, and each overlap only where Megatron allows it."""
    runs = {r.id: r for r in load_runs()}
    lay = layout_for(runs["N-llama3-70b"])
    assert (lay.tp, lay.pp, lay.cp, lay.dp, lay.vp, lay.fp8) == (4, 4, 2, 2, 5, True)
    assert lay.world == 64 and lay.overlaps == ("tp-comm-overlap", "overlap-grad-reduce", "overlap-param-gather")
    assert layout_for(runs["N-llama3-8b"]).overlaps == ("overlap-grad-reduce", "overlap-param-gather")  # tp 1: no TP overlap
    assert layout_for(runs["C1"]).overlaps == () and not layout_for(runs["C1"]).fp8
    assert layout_for(runs["L3-16k-cp16"]).cp == 16
    for r in runs.values():
        if r.source.key in ("nemo_2407", "llama3"):
            assert "overlaps" in r.assumed, r.id  # not stated by the source: its software's defaults, marked
        if r.source.key == "bridge_2602":
            # read off the Megatron-Bridge v0.3.0 performance recipes (tp_comm_overlap=True, both DP overlaps)
            assert not r.assumed, r.id
            assert r.pipeline_split == (("embedding", "loss") if r.id == "B-llama3-405b" else ()), r.id  # llama31_405b_pretrain_config
            assert layout_for(r).overlaps == ("tp-comm-overlap", "overlap-grad-reduce", "overlap-param-gather"), r.id


def test_fp8_rows_carry_the_precision_their_software_ran():
    """NeMo 24.07's FP8 recipes reduce gradients in bf16 (grad_sync_dtype, not in the table: assumed) and keep bf16
    weights; Megatron-Bridge 26.02's performance scripts state bf16 gradients and FP8 primary weights. Other rows keep
    Megatron's defaults (fp32 main gradients, bf16 weights)."""
    runs = load_runs()
    for r in runs:
        lay = layout_for(r)
        if r.source.key == "nemo_2407":
            assert (lay.main_grads_dtype, lay.fp8_param_gather) == ("bf16", False) and "main_grads_dtype" in r.assumed, r.id
        elif r.source.key == "bridge_2602":
            assert (lay.main_grads_dtype, lay.fp8_param_gather) == ("bf16", True) and "main_grads_dtype" not in r.assumed, r.id
            assert lay.zero == 1 and lay.fp8  # what --fp8-param-gather needs
        else:
            assert (lay.main_grads_dtype, lay.fp8_param_gather) == ("fp32", False), r.id
    src = {r.source.key: r.source for r in runs}
    assert "grad_sync_dtype=bf16" in src["nemo_2407"].precision_text
    assert "fp8_param_gather = True" in src["bridge_2602"].precision_text and "grad_reduce_in_fp32 = False" in src["bridge_2602"].precision_text


# --------------------------------------------------------------------------- uneven stage splits (Llama 3 405B)

SPLIT_RUNS = [r for r in load_runs() if r.pipeline_split]


def test_llama3_rows_carry_the_papers_schedule():
    """Section 3.3.2: interleaved, embedding and loss in place of a layer each on the first and last stage; V = 8 is the
    only V for which that removes exactly one layer from each (one layer per model chunk: (126 + 2) / 16)."""
    rows = [r for r in load_runs() if r.source.key == "llama3"]
    assert rows and all(r.pipeline_split == ("embedding", "loss") for r in rows)
    for r in rows:
        assert (r.model.layers + 2) == r.pp * r.vp  # one layer per chunk
        assert layout_for(r).schedule == "interleaved"
        assert r.num_microbatches % r.pp == 0  # Megatron's interleaving needs m to be a multiple of pp
        assert "vp" in r.assumed


@pytest.mark.parametrize("run", SPLIT_RUNS, ids=[r.id for r in SPLIT_RUNS])
def test_split_layers_are_megatron_cores(run):
    """The layers per stage the harness pins are what megatron-core's get_num_layers_to_build builds for the same flags."""
    from planner.engines.megatron.core_check import core_config, core_stage_layers
    from planner.engines.megatron.layout import stage_layers

    args = split_args(run)
    ours = stage_layers(args)
    assert ours == core_stage_layers(core_config(args))
    per_chunk = (run.model.layers + 2) // (run.pp * run.vp)  # the embedding and the loss each take a layer's place
    assert (run.model.layers + 2) % (run.pp * run.vp) == 0
    assert ours[0] == ours[-1] == per_chunk - 1 and set(ours[1:-1]) == {per_chunk}


def test_stage_bounds_put_the_embedding_alone_first_and_the_head_alone_last():
    """On a small Llama (6 layers, pp 4 x vp 2, embedding and loss as layers): stage 0 holds only the embedding, the
    last stage only the final norm and the output layer, every other stage one whole block."""
    import dataclasses

    from planner.model.analyze import analyze

    run = dataclasses.replace(SPLIT_RUNS[0], pp=4, vp=2, model=dataclasses.replace(SPLIT_RUNS[0].model, layers=6))
    path, args = model_file(run)
    args.update(n_layers=6, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, seq_len=32, vocab_size=256)
    costs = analyze(path, args, 1, "bf16").costs
    b = stage_bounds(run, costs)
    assert len(b) == 4 * 2 + 1 and b[0] == 0 and b[-1] == costs.n
    kinds = [[costs.layers[i].kind for i in range(x, y)] for x, y in zip(b, b[1:])]
    assert kinds[0] == ["embedding"]
    assert kinds[-1] == ["norm", "head"]
    assert all(k == ["attention", "mlp"] for k in kinds[1:-1])
    assert stage_bounds(dataclasses.replace(run, pipeline_split=()), costs) is None


# --------------------------------------------------------------------------- fixed costs: the fit and the shipped profiles


def test_golden_section_finds_a_closed_form_minimum():
    from bench.fit_fixed_costs import _golden

    x = _golden(lambda t: (t - 3.7) ** 2 + 1.0, 0.0, 10.0, steps=40)
    assert x == pytest.approx(3.7, abs=1e-6)


def test_fit_tune_rows_are_the_tune_sources_only():
    from bench.fit_fixed_costs import TUNE_SOURCES, tune_rows

    for device, keys in TUNE_SOURCES.items():
        rows = tune_rows(device)
        assert rows and {r.source.key for r in rows} == set(keys)
        assert all(r.split == "tune" and r.source.device == device for r in rows)
    assert not {r.id for d in TUNE_SOURCES for r in tune_rows(d)} & {r.id for r in load_runs() if r.split == "test"}


def test_profile_fixed_costs_are_written_only_when_plausible(tmp_path):
    from bench.fit_fixed_costs import Fit, profile_path, write_profile
    from planner.hardware import load_profile

    src = profile_path("A100-80GB")
    path = tmp_path / src.name
    path.write_text(src.read_text())
    good = Fit("A100-80GB", 4.0, 120.0, ("C1",), (-0.1,), (-0.05,))
    write_profile(good, path)
    p = load_profile(path)
    assert (p.kernel_floor_s, p.p2p_sync_s) == (pytest.approx(4e-6), pytest.approx(120e-6))
    assert "bench/fit_fixed_costs.py" in p.sources["fixed_costs"]
    write_profile(Fit("A100-80GB", 1.5, 9000.0, ("C1",), (-0.1,), (-0.02,)), path)  # outside the plausible range: removed
    p = load_profile(path)
    assert (p.kernel_floor_s, p.p2p_sync_s) == (0.0, 0.0) and "fixed_costs" not in p.sources


def test_bundled_profile_agreement_is_what_the_fit_decides():
    """The bench's check (`python -m bench` runs the fit, minutes): an implausible fit agrees with a profile that ships
    no fixed costs, a plausible one only with a profile carrying its values."""
    from bench.fit_fixed_costs import Fit, markdown, profile_path, shipped_agrees
    from planner.hardware import load_profile

    p = load_profile(profile_path("A100-80GB"))
    shipped = (p.kernel_floor_s * 1e6, p.p2p_sync_s * 1e6)
    implausible = Fit("A100-80GB", 200.0, 30000.0, ("C1",), (-0.1,), (-0.02,))
    plausible = Fit("A100-80GB", 4.0, 120.0, ("C1",), (-0.1,), (-0.05,))
    assert shipped_agrees(implausible) == (shipped == (0.0, 0.0))
    assert shipped_agrees(plausible) == (shipped == pytest.approx((4.0, 120.0)))
    assert shipped_agrees(implausible) != shipped_agrees(plausible)
    assert "| A100-80GB | 200 | 30000 | no |" in markdown([implausible])


def test_bundled_sustained_fraction_is_what_the_fit_decides():
    """The bench's check for efficiency.sustained (`python -m bench` runs the fit): a plausible fit agrees only with a
    profile carrying its value, an implausible one only with 1; the fit minimises the tune rows' squared log error."""
    from bench.fit_fixed_costs import profile_path
    from bench.fit_sustained import PLAUSIBLE, SustainedFit, markdown, shipped_agrees
    from planner.hardware import load_profile

    shipped = load_profile(profile_path("H100-SXM")).sustained_matmul
    assert PLAUSIBLE[0] <= shipped <= PLAUSIBLE[1]
    assert shipped_agrees(SustainedFit("H100-SXM", shipped, ("M24-1.7b",), (-0.3,), (-0.1,)))
    assert not shipped_agrees(SustainedFit("H100-SXM", round(shipped - 0.05, 2), ("M24-1.7b",), (-0.3,), (-0.1,)))
    assert shipped_agrees(SustainedFit("H100-SXM", 0.5, ("M24-1.7b",), (-0.3,), (-0.1,))) == (shipped == 1.0)
    assert f"| H100-SXM | 1 | {shipped:.2f} | yes |" in markdown([SustainedFit("H100-SXM", shipped, ("M24-1.7b",), (-0.3,), (-0.1,))])


def test_results_table_reports_the_dense_and_the_moe_sets_apart():
    """markdown() groups the priced rows by source, by split, and into the dense set (issue 14's) and the MoE test set
    (issue 17's); each group's mean absolute error is over its own priced rows."""
    from bench.published_runs import RUNS_ALL, Prediction, markdown

    dense_tune = next(r for r in RUNS_ALL if r.split == "tune")
    dense_test = next(r for r in RUNS_ALL if r.split == "test" and r.model.arch != "moe")
    moe = next(r for r in RUNS_ALL if r.model.arch == "moe")
    preds = [
        Prediction(dense_tune, 1.1, 1.0, 1.0, 2.0, 0.0),  # +10%
        Prediction(dense_test, 0.8, 1.0, 1.0, 2.0, 0.0),  # -20%
        Prediction(moe, 1.5, 1.0, 1.0, 2.0, 0.0),  # +50%
    ]
    rows = {ln.split(" | ")[0].lstrip("| "): ln for ln in markdown(preds).splitlines() if ln.startswith("| **")}
    assert "| 1 | 1 | 0 | 0 | 20.0% |" in rows["**dense test**"]
    assert "| 2 | 2 | 0 | 0 | 15.0% |" in rows["**dense (tune + test)**"]
    assert "| 1 | 1 | 0 | 0 | 50.0% |" in rows["**mixture-of-experts test**"]
    assert "| 3 | 3 | 0 | 0 | 26.7% |" in rows["**all**"]


def test_leave_one_source_out_refits_on_the_other_sources_only():
    """bench.loso: a group's value is fitted on the same GPU type's other sources (never its own rows, never another
    GPU type's); the grid minimiser of the shipped H100 tune rows is the shipped 0.79 (bench/fit_sustained.py's
    golden-section fit, rounded), found here on a grid around it; errors are expm1(log(predicted / published))."""
    import math

    import bench.loso as loso
    from bench.fit_fixed_costs import tune_rows

    rows = tune_rows("H100-SXM")
    grid = (0.77, 0.78, 0.79, 0.80, 0.81)
    table = {r.id: {s: loso.priced_step(r, sustained_matmul=s) for s in grid} for r in rows}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loso, "GRID", grid)
        assert loso.fit(rows, table) == loso.shipped_value("H100-SXM") == 0.79
    # synthetic: two sources of one GPU type, one of another; each left out is fitted on the others of its type only
    from dataclasses import replace

    a, b, c = rows[0], rows[1], next(r for r in loso.dense_rows() if r.source.device == "A100-80GB")
    a = replace(a, id="A", source=replace(a.source, key="s1"), step_s=1.0)
    b = replace(b, id="B", source=replace(b.source, key="s2"), step_s=1.0)
    c = replace(c, id="C", source=replace(c.source, key="s3"), step_s=1.0)
    synth = {"A": {s: 2 * s for s in loso.GRID}, "B": {s: 1.0 / s for s in loso.GRID}, "C": {s: 5.0 for s in loso.GRID}}
    got = {g.source: g for g in loso.leave_one_source_out([a, b, c], synth, {"A", "B", "C"})}
    assert got["s1"].refit == 1.0  # fitted on B alone: 1/s closest to 1 at s = 1
    assert got["s2"].refit == 0.6  # fitted on A alone: 2s closest to 1 at the grid's low end
    assert got["s3"].refit == loso.shipped_value("A100-80GB")  # no other A100 source: the shipped value
    assert got["s1"].loso_errors == pytest.approx((math.expm1(math.log(2.0)),))


def test_zero_bubble_rows_split_as_the_paper_and_keep_its_own_schedules_out():
    """Qi et al. 2024: 4 models x 3 micro-batch counts x 4 schedules. 1F1B and 1F1B-I (Megatron's) are priced, the first
    and last stages one layer fewer (the account-for flags), 1F1B-I one layer per chunk with the embedding and the loss
    in chunks of their own; ZB-1p and ZB-2p (the paper's own searched schedules) are kept and named, never priced."""
    from planner.engines.megatron.layout import stage_layers

    runs = {r.id: r for r in load_runs() if r.source.key == "qi2024_zb"}
    assert len(runs) == 48
    for r in runs.values():
        why = not_expressible(r)
        if r.schedule:
            assert r.schedule in ("zb-1p", "zb-2p") and "no rendered engine runs" in why, r.id
        else:
            assert why is None and r.pp == r.gpus and r.tp == r.dp == 1, r.id
    assert stage_layers(split_args(runs["ZB-1.5b-1f1b-m24"])) == [2, 3, 3, 3, 3, 3, 3, 2]
    assert stage_layers(split_args(runs["ZB-6.2b-1f1b-i-m24"])) == [0] + [1] * 30 + [0]
    p = predict(runs["ZB-14.6b-zb-2p-m48"])
    assert p.predicted_step_s is None and "zb-2p" in p.skipped


def test_zero_bubble_shapes_carry_the_papers_parameter_counts():
    """The vocabulary (32000, derived in the source's precision_text) gives each shape the size the paper names it by:
    12 l h^2 + 13 l h (weights, biases, norms) + V h (tied embedding) + s h (positions), rounded to 0.1 B."""
    named = {"zb-1.5b": 1.5, "zb-6.2b": 6.2, "zb-14.6b": 14.6, "zb-28.3b": 28.3}
    for key, billions in named.items():
        m = SHAPES[key]
        l, h, V, s = m["layers"], m["hidden"], m["vocab"], m["seq"]
        assert m["ffn"] == 4 * h and m["arch"] == "gpt"
        params = 12 * l * h * h + 13 * l * h + V * h + s * h
        assert round(params / 1e9, 1) == billions, key
        assert round((params + (50304 - V) * h) / 1e9, 1) != billions or key in ("zb-1.5b", "zb-6.2b"), key  # a GPT-2 vocabulary would not


def test_pass_times_match_the_passes_zero_bubble_profiled():
    """bench/pass_times.py: one micro-batch's forward, input- and weight-gradient passes through a stage of full layers
    against the times Zero Bubble profiled on A100 (Table 6): F + B + W within 8% on every row."""
    from bench import pass_times

    rows = pass_times.run_all()
    assert len(rows) == 12
    for c in rows:
        assert abs(c.total_error) < 0.08, (c.row.model, c.row.microbatches, c.total_error)
