"""torchtitan's tensor parallelism, async TP, torch.compile and Float8 as plan options: the Float8 casts against
torchao's own Float8Linear (counted as it runs, emulated on CPU), what Float8 keeps saved against torchao's saved
tensors, the tensor-parallel working set against its closed form, the refusals, and the rendered flags and
config_registry module against torchtitan's own ConfigManager where it imports."""

from __future__ import annotations

import dataclasses
import sys

import pytest
from conftest import EXAMPLES, costs_of

from planner.engines import get_engine
from planner.engines.torchtitan.render import CONFIG_MODULE, overrides, registry_function, render
from planner.engines.torchtitan.rules import TORCHAO_CAST_BYTES_PER_ELEMENT, float8_cast_bytes, float8_linears, tp_gathered_inputs
from planner.errors import InfeasibleError, UsageError
from planner.planning import plan_model
from planner.render import write_plan_dir
from planner.solve.memory import saved_bytes
from planner.solve.settings import Settings

ENGINE = get_engine("torchtitan")
ARCH = {"hidden_size": 256, "num_attention_heads": 16, "num_query_groups": 4, "ffn_hidden_size": 768, "activation": "swiglu"}


def plan_of(gpus: str = "8xH100", preset: str = "llama-tiny", **pins):
    req = Settings.of(model_file=str(EXAMPLES / "llama.py"), model_args={"preset": preset}, gpus=gpus, engine="torchtitan", **pins)
    return plan_model(req)[0]


def _torchao_casts(k: int, n: int, tokens: int) -> tuple[list[int], list[int]]:
    """Elements of each dynamic Float8 cast torchao's rowwise Float8Linear (k -> n) runs on ``tokens`` tokens,
    forward then backward, counted by wrapping its cast function while it runs (emulated FP8 on CPU)."""
    import torch

    fl = pytest.importorskip("torchao.float8.float8_linear")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    seen: list[int] = []
    real = fl.hp_tensor_to_float8_dynamic

    def counted(t, *a, **kw):
        seen.append(t.numel())
        return real(t, *a, **kw)

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=True)
    model = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False))
    convert_to_float8_training(model, config=config)
    x = torch.randn(tokens, k, requires_grad=True)
    fl.hp_tensor_to_float8_dynamic = counted
    try:
        y = model(x)
        fwd = list(seen)
        seen.clear()
        y.sum().backward()
        bwd = list(seen)
    finally:
        fl.hp_tensor_to_float8_dynamic = real
    return fwd, bwd


@pytest.mark.parametrize("tp", [1, 2])
def test_float8_casts_are_torchaos(tp):
    """Every cast torchao's rowwise Float8Linear runs, per linear of a Llama block at tp, x the cast's bytes per
    element: the bytes the time model charges (float8_cast_bytes)."""
    tokens = 48
    want_f, want_b = 0.0, 0.0
    for k, n in float8_linears(ARCH, "block", tp):
        f, b = _torchao_casts(int(k), int(n), tokens)
        want_f += sum(f) * TORCHAO_CAST_BYTES_PER_ELEMENT
        want_b += sum(b) * TORCHAO_CAST_BYTES_PER_ELEMENT
    fwd, bwd = float8_cast_bytes(ARCH, "block", tokens, tp)
    assert sum(fwd) == pytest.approx(want_f) and sum(bwd) == pytest.approx(want_b)
    # seven linears (wq, wk, wv, wo, w1, w3, w2), each two casts forward and four backward
    assert (len(fwd), len(bwd)) == (14, 28)


def test_float8_saves_the_bf16_input_as_torchao_does():
    """torchao's Float8Linear saves its high-precision input (and weight) for the backward, so Float8 changes no saved
    activation in torchtitan's plans, while Transformer Engine's FP8 keeps GEMM inputs in FP8 (Megatron)."""
    import torch

    pytest.importorskip("torchao.float8")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=True)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False)).to(torch.bfloat16)
    convert_to_float8_training(model, config=config)
    x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        model(x)
    assert {t.dtype for t in saved} == {torch.bfloat16}
    assert any(t.data_ptr() == x.data_ptr() for t in saved)  # the input itself, not an FP8 copy

    costs = costs_of("llama", "llama-tiny").scaled(2)
    for recompute in ("none", "selective", "full"):
        kept = ENGINE.layer_activations(costs, 1, False, 1, recompute)
        assert [saved_bytes(l, fp8=True) for l in kept.layers] == [saved_bytes(l, fp8=False) for l in kept.layers]
    megatron = get_engine("megatron").layer_activations(costs, 1, False, 1, "none")
    assert sum(saved_bytes(l, fp8=True) for l in megatron.layers) < sum(saved_bytes(l, fp8=False) for l in megatron.layers)


def test_float8_state_has_no_fp8_weight_copy():
    """Dynamic scaling casts each weight every call: no FP8 copy persists, and rowwise FSDP all-gathers stay bf16."""
    lay = plan_of(pp=1, dp=8, zero=3, dtype="fp8", recompute="full").layout
    assert lay.fp8
    recipe = ENGINE.state_recipe("bf16", 3, "adam", lay)
    assert recipe == ENGINE.state_recipe("bf16", 3, "adam", dataclasses.replace(lay, fp8=False))
    assert recipe.fp8_gemm_bytes == 0 and recipe.fp8_gemm_gather_bytes is None


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_working_set_holds_the_gathered_inputs(tp):
    """With sequence parallelism DTensor's column-parallel linears keep their all-gathered inputs while a block runs:
    two of them (attention's and the MLP's), each the block input at full sequence: 2 x (tp - 1) x the sharded input
    more than the sharded copies; nothing changes outside the blocks or without sequence parallelism."""
    costs = costs_of("llama", "llama-tiny").scaled(2)
    grown = tp_gathered_inputs(costs, tp, True)
    for k, (a, b) in enumerate(zip(costs.layers, grown.layers)):
        if a.block is None:
            assert b == a
        else:
            start = min(i for i, l in enumerate(costs.layers) if l.block == a.block)
            assert b.max_op_bytes - a.max_op_bytes == 2 * (tp - 1) * costs.cuts[start].bytes
    assert tp_gathered_inputs(costs, tp, False) == costs


def test_refusals_say_why():
    """tp > 1 only with full checkpointing; async TP only compiled; torch.compile only on torchtitan."""
    with pytest.raises(InfeasibleError, match="full activation checkpointing only") as e:
        plan_of(pp=1, tp=2, dp=4, recompute="selective")
    assert "async TP" not in str(e.value)  # not searched uncompiled
    with pytest.raises(InfeasibleError, match="async TP"):
        plan_of(pp=1, tp=2, dp=4, recompute="full", tp_comm_overlap=True)
    with pytest.raises(UsageError, match="torch.compile"):
        req = Settings.of(model_file=str(EXAMPLES / "llama.py"), model_args={"preset": "llama-tiny"}, gpus="8xH100", engine="megatron", compile=True)
        plan_model(req)


def _config_manager():
    try:
        import torchtitan.models.llama3.config_registry  # noqa: F401
        from torchtitan.config.manager import ConfigManager
    except Exception as exc:  # noqa: BLE001 - any missing optional dependency skips
        pytest.skip(f"torchtitan's ConfigManager is not importable: {exc}")
    return ConfigManager


@pytest.mark.parametrize("async_tp", [False, True])
def test_tensor_parallel_compile_and_async_tp_flags_parse_as_planned(async_tp, tmp_path, monkeypatch):
    plan = plan_of(pp=1, tp=2, dp=4, recompute="full", compile=True, tp_comm_overlap=async_tp)
    lay = plan.layout
    assert (lay.tp, lay.compile, lay.tp_comm_overlap, lay.sequence_parallel) == (2, True, async_tp, True)
    words = overrides(plan)
    assert words[words.index("--parallelism.tensor_parallel_degree") + 1] == "2"
    assert ("--compile.enable_async_tensor_parallel" in words) == async_tp
    manager = _config_manager()
    monkeypatch.chdir(tmp_path)
    cfg = manager().parse_args(["--module", "llama3", "--config", "llama3_debugmodel", *words])
    assert cfg.parallelism.tensor_parallel_degree == 2 and cfg.parallelism.enable_sequence_parallel
    assert cfg.compile.enable and "model" in cfg.compile.components
    assert cfg.compile.enable_async_tensor_parallel == async_tp


def test_float8_plan_renders_a_config_module_torchtitan_loads(tmp_path, monkeypatch):
    """A Float8 plan launches torchtitan_plan.<flavor>_float8, which rebuilds the registry function's model spec with
    torchao's converter. torchtitan's ConfigManager imports it from the plan directory; the converter's own hardware
    check is the only refusal on a machine without FP8 tensor cores, and on one with them the blocks' linears are
    Float8 and the output layer is not."""
    plan = plan_of(pp=1, dp=8, zero=3, dtype="fp8", recompute="full", compile=True)
    module, function = registry_function(plan)
    assert (module, function) == (CONFIG_MODULE, "llama3_debugmodel_float8")
    files = render(plan, "planner plan ...")
    assert f"{CONFIG_MODULE}.py" in files and f'TORCHTITAN_CONFIG="${{TORCHTITAN_CONFIG:-{function}}}"' in files["launch_torchtitan.sh"]
    assert "bfloat16" in overrides(plan)  # FP8 GEMMs on bf16 mixed precision
    out = tmp_path / "plan"
    write_plan_dir(out, plan)
    manager = _config_manager()
    pytest.importorskip("torchao.float8")
    monkeypatch.chdir(out)
    monkeypatch.syspath_prepend(str(out))
    sys.modules.pop(CONFIG_MODULE, None)
    import torch

    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        cfg = manager().parse_args(["--module", module, "--config", function, *overrides(plan)])
        model = cfg.model_spec.model
        assert "Float8" in type(model.layers[0].attention.wq).__qualname__ and "Float8" not in type(model.lm_head).__qualname__
    else:
        with pytest.raises(ValueError, match="float8 is only supported on NVIDIA SM89"):
            manager().parse_args(["--module", module, "--config", function, *overrides(plan)])


# --------------------------------------------------------------------------- the loss torchtitan runs


def _head(b: int = 2):
    from planner.engines.torchtitan.loss import head_index

    costs = costs_of("llama", "llama-tiny").scaled(b)
    k = head_index(costs)
    assert k is not None and costs.layers[k].kind == "head"
    return costs, k


@pytest.mark.parametrize("chunks", [1, 2, 8])
def test_chunked_loss_keeps_the_fp32_hidden_gradient_and_one_chunk_at_a_time(chunks):
    """ChunkedLossWrapper: the output piece keeps the fp32 GradAccumulator (2 x its bf16 input); while the loss runs,
    one chunk's share of the output linear's input, the loss's saved tensors and working set and the logits with
    their gradient, plus the chunk copies of the hidden states; every other piece is untouched."""
    from planner.engines.torchtitan.loss import chunked_loss

    costs, k = _head()
    head, hidden = costs.layers[k], costs.cuts[k].bytes
    got = chunked_loss(costs, chunks)
    assert got.layers[k].saved_bytes == 2 * hidden
    want = (head.saved_bytes + head.max_op_bytes + 2 * head.out_bytes) / chunks + hidden
    assert got.layers[k].max_op_bytes == pytest.approx(want, abs=1)
    assert [l for i, l in enumerate(got.layers) if i != k] == [l for i, l in enumerate(costs.layers) if i != k]


def test_compiled_loss_never_allocates_the_fp32_tensors():
    """Compiled (torchtitan's compile components include the loss), the loss keeps the bf16 logits only and writes
    their bf16 gradient: per chunk the linear's input and the logits with their gradient."""
    from planner.engines.torchtitan.loss import chunked_loss

    costs, k = _head()
    head, hidden = costs.layers[k], costs.cuts[k].bytes
    assert head.saved_bytes > hidden + head.out_bytes  # the traced loss keeps fp32 tensors (.float(), log-softmax)
    got = chunked_loss(costs, 4, compiled=True)
    assert got.layers[k].max_op_bytes == pytest.approx((hidden + 2 * head.out_bytes) / 4 + hidden, abs=1)


def test_loss_chunks_and_compile_components_render_and_parse(tmp_path, monkeypatch):
    plan = plan_of(pp=1, dp=8, recompute="full", compile=True, compile_loss=False, loss_chunks=4)
    words = overrides(plan)
    assert words[words.index("--loss.num_chunks") + 1] == "4"
    assert words[words.index("--compile.components") + 1 :][:1] == ["model"]
    default = overrides(plan_of(pp=1, dp=8, recompute="full"))
    assert default[default.index("--loss.num_chunks") + 1] == "8"
    manager = _config_manager()
    monkeypatch.chdir(tmp_path)
    cfg = manager().parse_args(["--module", "llama3", "--config", "llama3_8b", *words])
    assert cfg.loss.num_chunks == 4 and cfg.compile.enable and list(cfg.compile.components) == ["model"]


def test_loss_options_are_torchtitans_only():
    for pins in ({"loss_chunks": 2}, {"compile_loss": True}):
        req = Settings.of(model_file=str(EXAMPLES / "llama.py"), model_args={"preset": "llama-tiny"}, gpus="8xH100", engine="megatron", **pins)
        with pytest.raises(UsageError, match="--engine torchtitan"):
            plan_model(req)
    with pytest.raises(UsageError, match="do not divide by 3"):
        render(plan_of(pp=1, dp=8, loss_chunks=3), "planner plan ...")


def test_compiled_casts_read_once_and_write_once():
    """Compiled, inductor fuses each rowwise cast's amax with the cast: 3 bytes per element (read bf16, write FP8)
    where eager moves 5 (the amax pass reads the tensor too)."""
    from planner.engines.torchtitan.rules import TORCHAO_COMPILED_CAST_BYTES_PER_ELEMENT

    eager = float8_cast_bytes(ARCH, "block", 48, 2)
    fused = float8_cast_bytes(ARCH, "block", 48, 2, compiled=True)
    assert (TORCHAO_CAST_BYTES_PER_ELEMENT, TORCHAO_COMPILED_CAST_BYTES_PER_ELEMENT) == (5.0, 3.0)
    for e, f in zip(eager, fused):
        assert [x * 3 / 5 for x in e] == pytest.approx(f)


def test_compile_prices_the_fused_blocks():
    """A compiled torchtitan plan moves fewer memory-bound bytes than the eager one (the same layout), so its step is
    shorter; its memory is the same (the blocks' compile is not modelled in memory, the loss is not compiled here)."""
    eager = plan_of(pp=1, dp=8, recompute="full", micro_batch=2)
    compiled = plan_of(pp=1, dp=8, recompute="full", micro_batch=2, compile=True, compile_loss=False)
    assert compiled.predicted.step_time_s < eager.predicted.step_time_s
    assert [r.memory_bytes for r in compiled.ranks] == [r.memory_bytes for r in eager.ranks]


def test_context_parallelism_is_the_all_gather_exchange_and_parses(tmp_path, monkeypatch):
    """torchtitan's CP all-gathers keys and values (FlexAttention's CP wrapper): planned as that exchange, rendered
    as context_parallel_degree, read back by torchtitan's ConfigManager; a ring it does not run is refused."""
    req = Settings.of(
        model_file=str(EXAMPLES / "llama.py"),
        model_args={"preset": "llama-1b", "seq_len": 8192},
        gpus="16xH100",
        engine="torchtitan",
        cp=2,
        pp=1,
        recompute="full",
    )
    plan = plan_model(req)[0]
    assert (plan.layout.cp, plan.layout.cp_comm) == (2, "all_gather")
    words = overrides(plan)
    assert words[words.index("--parallelism.context_parallel_degree") + 1] == "2"
    with pytest.raises(InfeasibleError, match="no --cp-comm-type p2p"):
        plan_model(req.but(cp_comm="p2p"))
    manager = _config_manager()
    monkeypatch.chdir(tmp_path)
    cfg = manager().parse_args(["--module", "llama3", "--config", "llama3_8b", *words])
    assert cfg.parallelism.context_parallel_degree == 2


def test_async_tp_holds_two_shards_of_symmetric_memory():
    """Async TP's workspace: two of one rank's (s / tp x b x h) bf16 shards (torch's pipelined all-gather and
    reduce-scatter ask for one shard and two output chunks); Transformer Engine's userbuffers are Megatron's, not
    torchtitan's, and torchao's dynamic scaling keeps no amax history."""
    from dataclasses import replace

    from planner.solve.search import feature_buffers

    costs = costs_of("llama", "llama-tiny")
    lay = plan_of(pp=1, tp=2, dp=4, recompute="full", compile=True, tp_comm_overlap=True, micro_batch=2).layout
    e = ENGINE
    got = feature_buffers(costs, lay, e.tp_overlap_buffers, e.fp8_amax_history, e.tp_overlap_shard_buffers)
    h, s = costs.architecture["hidden_size"], costs.seq_len
    assert got == 2 * (s / 2) * 2 * h * 2
    assert feature_buffers(costs, replace(lay, fp8=True), e.tp_overlap_buffers, e.fp8_amax_history, e.tp_overlap_shard_buffers) == got


def test_a_float8_compiled_tensor_parallel_plan_validates_clean(tmp_path):
    """`planner validate` of a torchtitan plan directory with Float8, compile, async TP and context parallelism: the
    command line matches plan.json (and torchtitan's own parser, where it imports, reads it against the function the
    Float8 module wraps), the files do not drift, and its memory is checked (the model analysed in bf16 under FP8)."""
    from planner.check.validate import Options, validate

    args = {"preset": "llama-1b", "seq_len": 8192}
    req = Settings.of(
        model_file=str(EXAMPLES / "llama.py"), model_args=args, gpus="16xH100", engine="torchtitan", tp=2, cp=2, dtype="fp8", compile=True, tp_comm_overlap=True
    )
    out = tmp_path / "plan"
    write_plan_dir(out, plan_model(req)[0])
    found = validate([out], Options(model=str(EXAMPLES / "llama.py"), model_args=args))
    assert [f for f in found.findings if f.severity == "error"] == [], found.findings
    assert not [f for f in found.findings if f.rule == "MEM003"], found.findings


@pytest.mark.parametrize("config", ["llama", "qwen2"])
def test_a_transformers_decoder_maps_onto_torchtitans_modules(config):
    """A transformers decoder (``model.layers.N`` blocks, the embedding before them, the final norm and lm_head after)
    is planned and rendered for torchtitan: each piece is the torchtitan module at its place, every layer once in
    order; a model whose pieces are not a decoder's is still refused."""
    from planner.engines.torchtitan.render import piece_fqns, stage_fqns

    model = EXAMPLES.parent / "tests" / "models" / "hf" / f"{config}.json"
    plan = plan_model(Settings.of(model_file=f"hf:{model}", gpus="8xH100", engine="torchtitan", pp=2, dp=4))[0]
    flat = [f for part in stage_fqns(plan) for f in part]
    layers = sum(1 for b in dict.fromkeys(plan.model["blocks"]) if b)
    assert flat == ["tok_embeddings", *(f"layers.{i}" for i in range(layers)), "norm", "lm_head"]
    with pytest.raises(UsageError, match="not a torchtitan Llama module"):
        piece_fqns(["stem", "h.0:attn", "head"], [None, "h.0", None])
