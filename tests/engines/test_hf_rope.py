"""The rotary embedding of an `hf:` config, as Megatron-LM builds it from the rendered flags.

The reference on each side is the real component: transformers' own rope initialisation for the config
(``ROPE_INIT_FUNCTIONS`` / the default rope) and megatron-core's ``RotaryEmbedding`` built from the flags the
renderer writes. Positions' angles must agree; what Megatron cannot run is refused by name.
"""

import math
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
rope_module = pytest.importorskip("megatron.core.models.common.embeddings.rotary_pos_embedding")

from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from planner.engines.megatron.architecture import architecture_defaults, architecture_problem  # noqa: E402
from planner.engines.megatron.hf_shapes import hf_architecture  # noqa: E402
from planner.engines.megatron.render import model_flags  # noqa: E402

SHAPE = dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512, vocab_size=1000)
LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _config(model_type: str = "llama", **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoConfig.for_model(model_type, **SHAPE, **kw)


def _hf_angles(config, positions: int) -> torch.Tensor:
    """(positions, rotated pairs) angles transformers uses: position x inverse frequency (its rope init for the config)."""
    params = config.rope_parameters
    kind = params.get("rope_type", "default")
    if kind == "default":
        head = config.hidden_size // config.num_attention_heads
        dim = int(head * params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
        inv = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    else:
        inv, _ = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    return torch.outer(torch.arange(positions, dtype=torch.float32), inv.float())


def _megatron_angles(config, positions: int) -> torch.Tensor:
    """The same angles from megatron-core's RotaryEmbedding, built from the flags the renderer writes."""
    arch = architecture_defaults(hf_architecture(config, 128))
    assert architecture_problem(arch) is None
    flags = dict(model_flags(arch))
    emb = rope_module.RotaryEmbedding(
        kv_channels=config.hidden_size // config.num_attention_heads,
        rotary_percent=float(flags.get("--rotary-percent", 1.0)),
        seq_len_interpolation_factor=(float(flags["--rotary-seq-len-interpolation-factor"]) if "--rotary-seq-len-interpolation-factor" in flags else None),
        rotary_base=int(flags.get("--rotary-base", 10000)),
        rope_scaling="--use-rope-scaling" in flags,
        rope_scaling_factor=float(flags.get("--rope-scaling-factor", 8.0)),
        use_cpu_initialization=True,
    )
    return emb.get_freqs_non_repeated(positions)


@pytest.mark.parametrize(
    "model_type, kw",
    [
        ("llama", {}),
        ("llama", {"rope_theta": 500000.0, "max_position_embeddings": 131072, "rope_scaling": LLAMA31}),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
        ("qwen2", {"rope_theta": 1000000.0}),
        ("stablelm", {"partial_rotary_factor": 0.25}),
    ],
    ids=["llama", "llama3.1-scaling", "linear", "qwen2-theta", "partial-rotary"],
)
def test_megatron_rotates_every_position_as_transformers_does(model_type, kw):
    cfg = _config(model_type, **kw)
    hf, meg = _hf_angles(cfg, 4096), _megatron_angles(cfg, 4096)
    assert hf.shape == meg.shape
    torch.testing.assert_close(meg, hf, rtol=1e-5, atol=1e-3)


def test_the_flags_are_written_only_off_megatron_defaults():
    plain = dict(model_flags(architecture_defaults(hf_architecture(_config("llama"), 128))))
    assert "--use-rope-scaling" not in plain and "--rotary-percent" not in plain
    assert plain["--rotary-base"] == "10000" and plain["--norm-epsilon"] == repr(_config("llama").rms_norm_eps)
    scaled = dict(
        model_flags(architecture_defaults(hf_architecture(_config("llama", rope_theta=500000.0, max_position_embeddings=131072, rope_scaling=LLAMA31), 128)))
    )
    assert scaled["--rotary-base"] == "500000" and "--use-rope-scaling" in scaled and float(scaled["--rope-scaling-factor"]) == 8.0


@pytest.mark.parametrize(
    "kw, says",
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}}, "rope scaling 'yarn'"),
        ({"rope_scaling": {**LLAMA31, "high_freq_factor": 2.0}, "max_position_embeddings": 131072}, "llama3 with high_freq_factor 2.0"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.5}}, "an integer above 1"),
        ({"rope_theta": 12345.6}, "--rotary-base takes a positive integer"),
    ],
    ids=["yarn", "llama3-constants", "linear-fraction", "fractional-base"],
)
def test_rope_megatron_cannot_build_is_refused_by_name(kw, says):
    problem = architecture_problem(hf_architecture(_config("llama", **kw), 128), "hf:cfg.json")
    assert problem is not None and says in problem[0]


def test_hand_written_architecture_rope_rules():
    base = {**hf_architecture(_config("llama"), 128)}
    assert architecture_problem({**base, "rotary_percent": 0.0}) is not None
    assert architecture_problem({**base, "rope_scaling": "llama3"}) is not None  # factor missing
    assert architecture_problem({**base, "rope_scaling": "llama3", "rope_scaling_factor": 8}) is None
    assert architecture_problem({**base, "position_embedding": "learned_absolute", "rope_scaling": "linear", "rope_scaling_factor": 2}) is not None
    # the frequencies Megatron's Llama 3.x scaling keeps: wavelengths under 8192 / 4 unchanged, over 8192 divided by 8
    cfg = _config("llama", rope_theta=500000.0, max_position_embeddings=131072, rope_scaling=LLAMA31)
    inv = _megatron_angles(cfg, 2)[1]
    plain = _hf_angles(_config("llama", rope_theta=500000.0), 2)[1]
    wavelen = 2 * math.pi / plain
    assert torch.equal(inv[wavelen < 2048], plain[wavelen < 2048])
    torch.testing.assert_close(inv[wavelen > 8192], plain[wavelen > 8192] / 8)
