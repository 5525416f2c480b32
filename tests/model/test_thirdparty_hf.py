"""transformers models planned from config files (`hf:CONFIG.json`), defaults untouched but for tiny sizes.

Parameter counts are compared with the model transformers builds; forward FLOPs with the closed form
2 x (matmul parameters) x tokens + 4 s^2 h per attention layer (MoE: top-k experts only).
Run with transformers installed (`pip install transformers`); skipped otherwise.
"""

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

transformers = pytest.importorskip("transformers")

from planner.cli import app
from planner.engines.megatron.architecture import architecture_problem
from planner.model.load import load_model_file
from planner.model_ref import relative_ref
from tests.conftest import derived_architecture

HF = Path(__file__).resolve().parents[1] / "models" / "hf"
runner = CliRunner()
MODELS = ["gpt2", "llama", "qwen2", "mixtral", "bert", "t5", "bart", "vit", "clip", "resnet", "convnext", "roberta"]
DECODERS = ["gpt2", "llama", "qwen2", "phi3"]


def _config(name: str) -> dict:
    return json.loads((HF / f"{name}.json").read_text())


def _library_model(name: str):
    """The model as transformers itself builds it from the same config."""
    doc = _config(name)
    config = transformers.AutoConfig.for_model(doc.pop("model_type"), **doc)
    cls = {
        "gpt2": "GPT2LMHeadModel",
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "mixtral": "MixtralForCausalLM",
        "bert": "BertModel",
        "t5": "T5ForConditionalGeneration",
        "bart": "BartForConditionalGeneration",
        "vit": "ViTModel",
        "clip": "CLIPModel",
        "resnet": "ResNetForImageClassification",
        "convnext": "ConvNextForImageClassification",
        "roberta": "RobertaForMaskedLM",
    }[name]
    with torch.device("meta"):
        return getattr(transformers, cls)(config), config


_DOCS: dict = {}


def inspect(name: str) -> dict:
    if name not in _DOCS:
        r = runner.invoke(app, ["inspect", f"hf:{HF / name}.json", "--json"])
        assert r.exit_code == 0, r.output
        _DOCS[name] = json.loads(r.stdout)
    return _DOCS[name]


@pytest.mark.parametrize("name", MODELS)
def test_parameter_count_is_exact(name):
    model, _ = _library_model(name)
    assert inspect(name)["totals"]["params"] == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", MODELS)
def test_use_cache_is_turned_off_and_said_so(name):
    doc = inspect(name)
    cfg = _library_model(name)[1]
    if getattr(cfg, "use_cache", False):
        assert any("use_cache set to False" in n for n in doc["notes"])
    assert doc["totals"]["tracer"] == "export"  # transformers 5 forwards take **kwargs: fx cannot trace them


def _decoder_closed_form(c: dict, s: int, experts_active: int | None = None) -> int:
    h = c.get("hidden_size", c.get("n_embd"))
    layers = c.get("num_hidden_layers", c.get("n_layer"))
    heads = c.get("num_attention_heads", c.get("n_head"))
    kv = c.get("num_key_value_heads", heads)
    d = h // heads
    attn = h * h * 2 + 2 * h * kv * d  # q, o; k, v
    if experts_active:
        mlp = experts_active * 3 * h * c["intermediate_size"] + h * c["num_local_experts"]  # routed experts + router
    elif "intermediate_size" in c:
        mlp = 3 * h * c["intermediate_size"]  # gated (SwiGLU)
    else:
        mlp = 2 * h * 4 * h
    matmul = layers * (attn + mlp) + h * c["vocab_size"]  # + the LM head
    return 2 * matmul * s + layers * 4 * s * s * h


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2", "mixtral"])
def test_decoder_forward_flops_match_the_closed_form(name):
    c = _config(name)
    s = c.get("max_position_embeddings", c.get("n_positions"))
    doc = inspect(name)
    assert doc["totals"]["seq_len"] == s
    active = c.get("num_experts_per_tok") if name == "mixtral" else None
    assert doc["totals"]["flops_fwd"] == _decoder_closed_form(c, s, active)


def test_mixtral_counts_the_top_k_experts_not_all():
    c = _config("mixtral")
    s = c["max_position_embeddings"]
    fw = inspect("mixtral")["totals"]["flops_fwd"]
    assert fw == _decoder_closed_form(c, s, c["num_experts_per_tok"])
    assert fw < _decoder_closed_form(c, s, c["num_local_experts"])


def test_bert_forward_flops_match_the_closed_form():
    c = _config("bert")
    s, h = c["max_position_embeddings"], c["hidden_size"]
    per_layer = 4 * h * h + 2 * h * c["intermediate_size"]
    pooler = 2 * h * h  # one token
    expect = 2 * c["num_hidden_layers"] * per_layer * s + c["num_hidden_layers"] * 4 * s * s * h + pooler
    doc = inspect("bert")
    assert doc["totals"]["flops_fwd"] == expect
    # the padding mask reaches every attention piece: each is costed with its mask, not with a hidden state
    assert any(t["dtype"] == "bool" for cut in doc["cuts"] for t in cut["tensors"])


def test_vit_forward_flops_match_the_closed_form():
    c = _config("vit")
    h, p = c["hidden_size"], c["patch_size"]
    s = (c["image_size"] // p) ** 2 + 1  # patches + CLS
    per_layer = 4 * h * h + 2 * h * c["intermediate_size"]
    patch_embed = 2 * (s - 1) * 3 * p * p * h
    expect = 2 * c["num_hidden_layers"] * per_layer * s + c["num_hidden_layers"] * 4 * s * s * h + patch_embed + 2 * h * h
    assert inspect("vit")["totals"]["flops_fwd"] == expect


def test_t5_encoder_decoder_is_traced_with_its_three_inputs():
    """input_ids, the padding mask and decoder_input_ids: both stacks are pieces, and the encoder's output crosses
    every decoder cut (cross-attention reads it)."""
    doc = inspect("t5")
    blocks = {l["block"].split(".block.")[0] for l in doc["layers"] if l["block"]}
    assert blocks == {"encoder", "decoder"}
    first_decoder = next(i for i, l in enumerate(doc["layers"]) if (l["block"] or "").startswith("decoder"))
    h = _config("t5")["d_model"]
    for cut in doc["cuts"][first_decoder:]:
        assert sum(1 for t in cut["tensors"] if t["shape"][-1] == h) >= 2  # decoder state + encoder output


def test_bart_forward_flops_match_the_closed_form():
    """Encoder layers (self-attention, MLP), decoder layers (self- and cross-attention, MLP) and the LM head; the two
    stacks' layers are costed apart although their pieces look alike (a piece's cache key includes its wiring)."""
    c = _config("bart")
    s, h = c["max_position_embeddings"], c["d_model"]
    encoder = 4 * h * h + 2 * h * c["encoder_ffn_dim"]
    decoder = 8 * h * h + 2 * h * c["decoder_ffn_dim"]
    matmul = c["encoder_layers"] * encoder + c["decoder_layers"] * decoder + h * c["vocab_size"]
    attentions = c["encoder_layers"] + 2 * c["decoder_layers"]
    assert inspect("bart")["totals"]["flops_fwd"] == 2 * matmul * s + attentions * 4 * s * s * h


def test_clip_reads_token_ids_and_images_side_by_side():
    """A dual encoder: text tower over the text config's positions, vision tower over patches + CLS, both projections
    (one pooled token each) and the image-text logits."""
    c = _config("clip")
    t, v, p = c["text_config"], c["vision_config"], c["projection_dim"]
    s, sv = t["max_position_embeddings"], (v["image_size"] // v["patch_size"]) ** 2 + 1
    doc = inspect("clip")
    assert doc["totals"]["seq_len"] == s

    def tower(cfg, n):
        h = cfg["hidden_size"]
        return cfg["num_hidden_layers"] * (2 * (4 * h * h + 2 * h * cfg["intermediate_size"]) * n + 4 * n * n * h)

    patch_embed = 2 * (sv - 1) * 3 * v["patch_size"] ** 2 * v["hidden_size"]
    projections = 2 * t["hidden_size"] * p + 2 * v["hidden_size"] * p
    assert doc["totals"]["flops_fwd"] == tower(t, s) + tower(v, sv) + patch_embed + projections + 2 * p


def test_roberta_plans_the_tokens_its_positions_hold():
    """RoBERTa's position ids start after the padding index: 34 positions hold 32 tokens. The model transformers builds
    runs the planned inputs on the CPU; one token more indexes past its position table, and is refused as a seq_len."""
    c = _config("roberta")
    doc = inspect("roberta")
    assert doc["totals"]["seq_len"] == c["max_position_embeddings"] - 2
    mf = load_model_file(f"hf:{HF / 'roberta.json'}")
    model = mf.call("build_model")
    (ids, mask) = mf.call("example_inputs", 1)
    assert ids.shape[1] == doc["totals"]["seq_len"]
    ids = torch.where(ids == c.get("pad_token_id", 1), 5, ids)  # a padding token would not take a position
    assert model(ids, mask).logits.shape[1] == ids.shape[1]
    with pytest.raises((IndexError, RuntimeError), match="out of"):
        model(torch.cat([ids, ids[:, :1]], 1), torch.cat([mask, mask[:, :1]], 1))
    r = runner.invoke(app, ["inspect", f"hf:{HF / 'roberta.json'}", "--model-arg", "seq_len=33"])
    assert r.exit_code == 2 and "more than the 32 tokens a roberta config" in r.output


@pytest.mark.parametrize("name", ["gpt2", "bert", "bart", "clip"])
def test_a_sequence_longer_than_the_learned_position_table_is_refused(name):
    """GPT-2's wpe, BERT's and CLIP's text position_embeddings, BART's embed_positions (2 rows of offset) hold the
    config's position count: the model transformers builds runs that many tokens on the CPU and indexes past its table
    with one more, which the planner refuses as a seq_len (exit 2) instead of planning a run that cannot start."""
    c = _config(name)
    held = c.get("n_positions") or c.get("max_position_embeddings") or c["text_config"]["max_position_embeddings"]
    mf = load_model_file(f"hf:{HF / name}.json", {"seq_len": held})
    model = mf.call("build_model")
    inputs = mf.call("example_inputs", 1)
    ids = inputs[0]
    assert ids.shape[1] == held
    model(*inputs)
    longer = [torch.cat([t, t[:, :1]], 1) if t.dim() == 2 and t.shape[1] == held else t for t in inputs]
    with pytest.raises((IndexError, RuntimeError, ValueError), match="out of|index|max_position_embeddings|must match the existing size"):
        model(*longer)
    r = runner.invoke(app, ["inspect", f"hf:{HF / name}.json", "--model-arg", f"seq_len={held + 1}"])
    assert r.exit_code == 2 and f"more than the {held} positions its learned position table" in r.output, r.output


def test_rotary_and_relative_positions_take_longer_sequences():
    """Llama (rope) and T5 (relative buckets) have no position table: a longer seq_len than the config's default plans."""
    for name in ("llama", "t5"):
        r = runner.invoke(app, ["inspect", f"hf:{HF / name}.json", "--model-arg", "seq_len=80"])
        assert r.exit_code == 0, r.output


def test_speech_models_are_refused_not_planned_without_their_encoder(tmp_path):
    """Whisper's config has a causal-LM class too (its decoder alone): an encoder-decoder is built whole, and its
    input_features, which an hf: spec cannot make, are asked for instead of tracing the decoder alone."""
    from planner.model.sources import hf_config, hf_model_class

    path = tmp_path / "whisper.json"
    path.write_text(json.dumps({"model_type": "whisper"}))
    assert hf_model_class(hf_config(path, {})) is transformers.AutoModelForSpeechSeq2Seq
    r = runner.invoke(app, ["inspect", f"hf:{path}"])
    assert r.exit_code == 2
    assert "WhisperForConditionalGeneration reads input_features" in r.output and "example_inputs() returns" in r.output


def test_a_vision_language_decoder_says_its_vision_tower_is_idle(tmp_path):
    """LLaVA needs image tokens placed in its ids, which a config does not say: planned on text, and said so."""
    tiny = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    doc = {
        "model_type": "llava",
        "text_config": {"model_type": "llama", "vocab_size": 200, "max_position_embeddings": 32, **tiny},
        "vision_config": {"model_type": "clip_vision_model", "image_size": 32, "patch_size": 8, **tiny},
    }
    path = tmp_path / "llava.json"
    path.write_text(json.dumps(doc))
    r = runner.invoke(app, ["inspect", f"hf:{path}", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert any("planned on token ids only (no images): its vision tower does not run" in n for n in out["notes"])
    # issue: the note said the vision tower's parameters were counted; no piece holds them, and the count left them out
    model = transformers.AutoModel.from_config(transformers.AutoConfig.for_model(**doc))  # LlavaModel, as planned
    tower = sum(p.numel() for p in model.vision_tower.parameters())
    projector = sum(p.numel() for p in model.multi_modal_projector.parameters())
    idle = next(n for n in out["notes"] if "parameters are in no piece" in n)
    assert idle.startswith(f"{tower + projector:,} parameters are in no piece: forward() does not read vision_tower ({tower:,}), ")
    assert out["totals"]["params"] == sum(p.numel() for p in model.parameters()) - tower - projector


def _derived(name: str, args: dict | None = None):
    return derived_architecture(f"hf:{HF / name}.json", args)


@pytest.mark.parametrize("name", DECODERS)
def test_architecture_from_the_config_is_accepted_by_megatron_rules(name):
    arch = _derived(name)
    assert architecture_problem(arch, name) is None
    c = _config(name)
    assert arch["num_layers"] == c.get("num_hidden_layers", c.get("n_layer"))
    assert arch["vocab_size"] == c["vocab_size"]
    if name == "gpt2":
        assert (arch["normalization"], arch["activation"], arch["position_embedding"], arch["tied_embeddings"]) == (
            "LayerNorm",
            "gelu",
            "learned_absolute",
            True,
        )
    else:
        assert (arch["normalization"], arch["activation"], arch["position_embedding"]) == ("RMSNorm", "swiglu", "rope")
        assert arch["num_query_groups"] == c["num_key_value_heads"] and arch["ffn_hidden_size"] == c["intermediate_size"]


@pytest.mark.parametrize(
    "name,field,act,why",
    [("llama", "hidden_act", "gelu", "activation 'gated gelu'"), ("gpt2", "activation_function", "silu", "activation 'silu'")],
)
def test_an_mlp_megatron_cannot_build_is_refused_not_mapped_onto_another(name, field, act, why, tmp_path):
    """Llama's MLP is gated (down(act(gate x) * up x)): with GeLU it is no Megatron MLP (--swiglu is gated SiLU only, GeLU
    ungated); GPT-2's is ungated: SiLU there is not --swiglu. Both were rendered as the other MLP; now refused (exit 2)."""
    mf = load_model_file(f"hf:{HF / name}.json", {field: act})
    model = mf.call("build_model")
    mlp = next(m for n, m in model.named_modules() if n.endswith(".mlp"))
    assert hasattr(mlp, "gate_proj") == (name == "llama")  # what transformers builds: gated or not
    arch = _derived(name, {field: act})
    assert why in architecture_problem(arch, name)[0]
    out = tmp_path / "out"
    r = runner.invoke(app, ["plan", f"hf:{HF / name}.json", "--model-arg", f"{field}={act}", "--gpus", "8xH100-SXM", "--engine", "megatron", "--out", str(out)])
    assert r.exit_code == 2 and why in r.output and not out.exists(), r.output


def test_no_architecture_for_encoders_and_the_moe_keys_for_mixtral():
    for name in ("bert", "t5", "bart", "vit", "clip", "resnet", "convnext", "roberta"):
        assert _derived(name) is None
    arch, c = _derived("mixtral"), _config("mixtral")
    assert (arch["num_experts"], arch["moe_router_topk"], arch["moe_ffn_hidden_size"]) == (
        c["num_local_experts"],
        c["num_experts_per_tok"],
        c["intermediate_size"],
    )


def test_model_args_override_config_fields_and_unknown_ones_are_refused():
    r = runner.invoke(app, ["inspect", f"hf:{HF / 'llama'}.json", "--model-arg", "num_hidden_layers=1", "--model-arg", "seq_len=16", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["totals"]["seq_len"] == 16 and sum(1 for l in doc["layers"] if l["block"]) >= 1
    assert not any(l["block"] and l["block"].startswith("model.layers.1") for l in doc["layers"])
    r = runner.invoke(app, ["inspect", f"hf:{HF / 'llama'}.json", "--model-arg", "num_layerz=1"])
    assert r.exit_code == 2 and "num_layerz" in r.output and "Traceback" not in r.output


ENGINES = {name: ("deepspeed", "torch", "megatron") if name in (*DECODERS, "mixtral") else ("deepspeed", "torch") for name in MODELS}


@pytest.mark.parametrize("name,engine", [(n, e) for n in MODELS for e in ENGINES[n]])
def test_plan_succeeds(name, engine, tmp_path):
    r = runner.invoke(app, ["plan", f"hf:{HF / name}.json", "--gpus", "4xA100", "--engine", engine, "--out", str(tmp_path / "p"), "--quiet"])
    assert r.exit_code == 0, r.output
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    # recorded relative to the plan directory, as a spec (planner.model_ref.relative_ref)
    assert plan["inputs"]["model_file"] == relative_ref(f"hf:{HF / name}.json", tmp_path / "p")
    assert plan["inputs"]["model_file"].startswith("hf:../")


def test_megatron_refuses_an_encoder_with_a_clear_error(tmp_path):
    r = runner.invoke(app, ["plan", f"hf:{HF / 'bert'}.json", "--gpus", "4xA100", "--engine", "megatron", "--out", str(tmp_path / "p")])
    assert r.exit_code == 2 and "model type 'bert'" in " ".join(r.output.split()) and "Traceback" not in r.output


def test_a_config_transformers_cannot_build_names_the_library_line(tmp_path):
    """transformers itself fails to build this config (an unknown activation): the error says the library's code
    raised, names the modeling file's line, and points at --model-arg, not at a model file."""
    doc = _config("llama") | {"hidden_act": "no_such_act"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    r = runner.invoke(app, ["inspect", f"hf:{path}"])
    assert r.exit_code == 2
    out = " ".join(r.output.split())
    assert "transformers could not build this model: it raised KeyError" in out
    assert "modeling_llama.py line" in out and "ACT2FN[config.hidden_act]" in out
    assert "--model-arg KEY=VALUE" in out and "model file" not in out


@pytest.mark.parametrize(
    "fields, says",
    [
        ({"num_attention_heads": 3}, "transformers refuses this llama config: ValueError: The hidden size"),
        ({"hidden_size": "64"}, "transformers refuses this llama config: TypeError: Field 'hidden_size' expected int"),
        ({"model_type": "lama"}, "does not know model_type 'lama'; close names: llama"),
        # not validated by transformers: its attention broadcasts 3 key/value heads to 4 query heads and fails
        ({"num_key_value_heads": 3}, "The model's own code raised RuntimeError at sdpa_attention.py line"),
    ],
)
def test_a_config_transformers_refuses_says_so_and_names_no_planner_bug(tmp_path, fields, says):
    """A config transformers' own validation rejects is the config's problem: the message is transformers' own check,
    not an import failure that might be a planner bug."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_config("llama") | fields))
    r = runner.invoke(app, ["inspect", f"hf:{path}"])
    assert r.exit_code == 2, r.output
    out = " ".join(r.output.split())
    assert says in out
    assert "planner bug" not in out and "torch.where" not in out and "Traceback" not in out


@pytest.mark.parametrize(
    "model_type, fields",
    [
        ("gemma2", {"head_dim": 16}),  # gated GeLU, sandwich norms, soft-capping: not Megatron's GPT layer
        ("olmo", {}),  # LayerNorm without weights
        ("gpt_neox", {}),  # parallel attention and MLP residual
    ],
)
def test_decoders_megatron_does_not_run_as_transformers_does_get_no_architecture(model_type, fields):
    """No Megatron shape is derived for a decoder whose layer Megatron's GPT layer does not run as transformers does
    (each would otherwise render flags for another model); the reason names the type."""
    from planner.engines.megatron.hf_shapes import hf_architecture, hf_architecture_gap

    config = transformers.AutoConfig.for_model(
        model_type, num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=1000, **fields
    )
    assert hf_architecture(config, 64) is None
    assert f"model type {model_type!r}" in hf_architecture_gap(config, 64)


def test_sliding_window_shorter_than_the_sequence_gets_no_architecture():
    """Mistral's sliding window is full attention up to its width: a shape is derived below it, refused above it."""
    from planner.engines.megatron.hf_shapes import hf_architecture, hf_architecture_gap

    config = transformers.AutoConfig.for_model(
        "mistral", **{k: v for k, v in _config("llama").items() if k not in ("model_type", "architectures")}, sliding_window=32
    )
    assert hf_architecture(config, 32) is not None
    assert hf_architecture(config, 64) is None and "sliding-window attention over 32 tokens" in hf_architecture_gap(config, 64)


def test_megatron_refuses_an_hf_decoder_it_cannot_build_with_the_reason(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "gemma2",
                "num_hidden_layers": 2,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "vocab_size": 1000,
                "max_position_embeddings": 64,
            }
        )
    )
    r = runner.invoke(app, ["plan", f"hf:{path}", "--gpus", "8xH100", "--engine", "megatron", "--out", str(tmp_path / "out")])
    assert r.exit_code == 2, r.output
    out = " ".join(r.output.split())
    assert "model type 'gemma2': Megatron-LM's GPT layer runs the decoder layers of gpt2, llama" in out
    assert "--engine torch" in out and "defines no architecture()" not in out
    assert not (tmp_path / "out").exists()


def test_qwen2_keeps_its_qkv_biases_under_megatron(tmp_path):
    """transformers' Qwen2 attention has biases on q, k and v only (no config field says so); the architecture says
    qkv_bias, the script adds --add-qkv-bias to --disable-bias-linear, and megatron-core's config (Megatron-LM's own
    argument handling too, where a checkout is named) builds q/k/v biases and no others."""
    from planner.engines.megatron.core_check import core_config
    from planner.engines.megatron.script import parse_megatron_args
    from tests.mlm_validate import megatron_lm_config, megatron_lm_path

    model, _ = _library_model("qwen2")
    biases = {n.rsplit(".", 2)[-2] for n, _ in model.named_parameters() if n.endswith(".bias")}
    assert biases == {"q_proj", "k_proj", "v_proj"}
    arch = _derived("qwen2")
    assert arch["qkv_bias"] is True and arch["bias"] is False
    assert _derived("llama")["qkv_bias"] is False
    out = tmp_path / "out"
    r = runner.invoke(app, ["plan", f"hf:{HF / 'qwen2'}.json", "--gpus", "2xH100-SXM", "--engine", "megatron", "--pp", "2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    args = parse_megatron_args((out / "pretrain_gpt.sh").read_text())
    assert args.has("--disable-bias-linear") and args.has("--add-qkv-bias")
    cfg = core_config(args)
    assert cfg.add_qkv_bias and not cfg.add_bias_linear
    if megatron_lm_path() is not None:
        lm_args, lm_cfg = megatron_lm_config(args.argv(), 2)
        assert lm_args.add_qkv_bias and lm_cfg.add_qkv_bias and not lm_cfg.add_bias_linear


def test_a_model_type_with_several_classes_builds_the_first_without_architectures():
    """Funnel's model type maps to FunnelModel and FunnelBaseModel; with no architectures in the config transformers'
    own AutoModel.from_config raises (transformers 5.25), and the planner builds the class transformers would choose,
    the first (parameter count exact)."""
    doc = _config("funnel")
    assert "architectures" not in doc
    config = transformers.AutoConfig.for_model(doc.pop("model_type"), **doc)
    with torch.device("meta"):
        model = transformers.FunnelModel(config)
    assert inspect("funnel")["totals"]["params"] == sum(p.numel() for p in model.parameters())


def test_a_config_with_a_text_encoder_and_a_decoder_reads_the_decoders_positions():
    """MusicGen's config holds a text encoder and a decoder: transformers' get_text_config() raises as ambiguous, and
    the planner stopped with "importing ... failed ... this is a planner bug". The decoder's config is the text one."""
    from transformers import AutoConfig

    from planner.model.sources import hf_seq_len

    config = AutoConfig.for_model("musicgen", decoder={"max_position_embeddings": 640})
    with pytest.raises(ValueError, match="ambiguous"):
        config.get_text_config()
    assert hf_seq_len(config, None) == 640


def test_layerdrop_is_turned_off_and_said_so():
    """M2M100 defaults to encoder_layerdrop = decoder_layerdrop = 0.05: in training each layer is skipped when a random
    draw falls under it, a branch on a tensor value no tracer follows (it was refused with exit 2). The planner turns it
    off on the modules that read it, says so, and plans every layer; the scripts build the model the same way."""
    assert _config("m2m_100")["encoder_layerdrop"] == 0.05
    doc = inspect("m2m_100")
    assert any(n.startswith("LayerDrop turned off (model.encoder.layerdrop=0.05, model.decoder.layerdrop=0.05)") for n in doc["notes"])
    model = load_model_file(f"hf:{HF / 'm2m_100.json'}").build_meta(torch.float32)
    assert model.model.encoder.layerdrop == 0.0 and model.model.decoder.layerdrop == 0.0
    names = [l["name"] for l in doc["layers"]]
    for stack in ("encoder", "decoder"):  # every layer is costed
        assert all(any(n.startswith(f"model.{stack}.layers.{i}") for n in names) for i in range(_config("m2m_100")[f"{stack}_layers"]))


def test_a_type_without_a_base_model_class_takes_its_task_class():
    """PP-LCNet and ShieldGemma 2 have no AutoModel class: without architectures the planner asked AutoModel, which
    raised KeyError, reported as "a planner bug". The first task class transformers has for the type is built."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto import modeling_auto

    from planner.model.sources import hf_model_class

    for model_type, auto_class in (("pp_lcnet", "AutoModelForImageClassification"), ("shieldgemma2", "AutoModelForImageClassification")):
        assert model_type not in modeling_auto.MODEL_MAPPING_NAMES
        assert hf_model_class(AutoConfig.for_model(model_type)) is getattr(transformers, auto_class)
    # PP-LCNet's classifier returns its last hidden state, no logits: its loss is the default one (it raised KeyError)
    doc = inspect("pp_lcnet")
    with torch.device("meta"):
        model = transformers.PPLCNetForImageClassification(transformers.PPLCNetConfig.from_json_file(HF / "pp_lcnet.json"))
    assert doc["totals"]["params"] == sum(p.numel() for p in model.parameters())


def test_a_failed_trace_is_one_paragraph_not_a_graph_dump(tmp_path):
    """wav2vec2 (transformers' own class, its LayerDrop branching on torch.rand in training mode): torch.export writes
    the graph it failed on to file descriptor 2 (6 KB here, 22 KB at the default size); inspect's stderr is the
    planner's one paragraph (under 4 KB), its first line the error, and the hint offers no --leaf (torch.fx failed at the
    root, and torch.export has no leaf modules)."""
    import subprocess
    import sys

    f = tmp_path / "w2v.py"
    f.write_text(
        "import torch\n"
        "from transformers import Wav2Vec2Config, Wav2Vec2Model\n"
        "def build_model():\n"
        "    return Wav2Vec2Model(Wav2Vec2Config(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2,\n"
        "        conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2))\n"
        "def example_inputs(batch_size=1):\n"
        "    return (torch.randn(batch_size, 1600),)\n"
    )
    r = subprocess.run([sys.executable, "-m", "planner", "inspect", str(f)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(r.stderr.encode()) < 4096, r.stderr[:3000]
    assert r.stderr.startswith("error: Cannot trace the model (Wav2Vec2Model)"), r.stderr[:500]
    assert "def forward" not in r.stderr and "--leaf" not in r.stderr


def test_phi3_plans_for_megatron_and_megatron_core_builds_it(tmp_path):
    """issue: the hf: Phi-3 config was refused for Megatron while the same model with a hand-written architecture()
    planned. Phi-3's fused qkv_proj and gate_up_proj (no biases, up * silu(gate)) are Megatron's linear_qkv and
    --swiglu linear_fc1; the rendered flags pass the planner's Megatron rules and megatron-core's TransformerConfig, with
    the layer count, widths and query groups of the config."""
    from tests.engines.test_hf_moe_architecture import megatron_core_built

    _, _, cfg = megatron_core_built(f"hf:{HF / 'phi3.json'}", tmp_path)
    c = _config("phi3")
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_query_groups) == (
        c["num_hidden_layers"],
        c["hidden_size"],
        c["intermediate_size"],
        c["num_key_value_heads"],
    )
    assert cfg.gated_linear_unit and not cfg.add_bias_linear
