"""Models built by name from a library, with no model file: ``hf:CONFIG.json``, ``timm:NAME``, ``torchvision:NAME``.

Each spec yields the model-file contract (build_model, example_inputs,
loss_fn, example_target, architecture) as closures, so everything that loads
a model file (planning, the rendered training scripts, smoke runs) rebuilds
the same model from the spec recorded in plan.json.

* ``hf:path/config.json`` (or a folder holding config.json): a transformers
  config as a user writes it. The model class is the config's
  ``architectures[0]``, else a causal LM for decoder-only types, a
  sequence-to-sequence LM for encoder-decoders, the base model otherwise.
  ``--model-arg KEY=VALUE`` overrides a config field; ``seq_len`` sets the
  sequence length (default: the config's maximum positions, at most 2048);
  ``model_class`` names another transformers class.
* ``timm:NAME``: ``timm.create_model(NAME, pretrained=False, **model_args)``;
  inputs at the model's default input size.
* ``torchvision:NAME``: ``torchvision.models.get_model(NAME, weights=None,
  **model_args)``; ``image_size`` sets the input size (default: the model's
  own ``image_size``, else the input its default weights' transforms give it:
  the crop, as Inception v3's 299, or for segmentation the resize, 520; else
  224); video models take clips of ``frames``
  (default 16, the reference recipe's clip length, or the weights' minimum).
  Detection and optical-flow models, whose training step takes images with
  box targets or image pairs, are refused.

The libraries are optional extras, imported only when a spec names them.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from planner.errors import UsageError, did_you_mean
from planner.model.losses import default_loss
from planner.model.meta import build_on_meta

LIBRARY_PREFIXES = ("hf", "timm", "torchvision")
PIP = {"transformers": "pip install transformers", "timm": "pip install timm torchvision", "torchvision": "pip install torchvision"}
HF_DEFAULT_MAX_SEQ = 2048
HF_RESERVED_ARGS = ("seq_len", "model_class")
VISION_RESERVED_ARGS = ("image_size", "frames")
VIDEO_FRAMES = 16  # torchvision references/video_classification: --clip-len 16


@dataclass
class LibraryContract:
    """The contract functions of a library model, the model arguments they take, and a digest of the spec."""

    funcs: dict[str, Callable[..., Any]]
    model_args: dict[str, Any]
    sha256: str
    #: what the planner leaves out of the model as built (said with the plan)
    notes: list[str] = field(default_factory=list)


def library_contract(spec: str, model_args: dict[str, Any]) -> LibraryContract:
    """The model-file contract for ``spec`` (``hf:...``, ``timm:...`` or ``torchvision:...``)."""
    prefix, _, rest = spec.partition(":")
    if not rest:
        raise UsageError(f"Model spec {spec!r} names nothing after {prefix}:.", _SPEC_HINT)
    if prefix == "hf":
        return _hf_contract(spec, rest, model_args)
    if prefix == "timm":
        return _vision_contract(spec, rest, model_args, "timm")
    if prefix == "torchvision":
        return _vision_contract(spec, rest, model_args, "torchvision")
    raise UsageError(f"Unknown model spec prefix {prefix!r}.", _SPEC_HINT)


_SPEC_HINT = "Use a model file (model.py), hf:path/to/config.json, timm:MODEL_NAME or torchvision:MODEL_NAME."


def require(module: str) -> Any:
    """Import an optional library, or a UsageError naming the pip command that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        lib = module.split(".")[0]
        raise UsageError(
            f"This model spec needs {lib}, which cannot be imported here ({type(e).__name__}: {e}).",
            f"Install it with `{PIP[lib]}` (or pip install 'planner[{lib}]'), in the environment that runs the planner.",
        ) from e
    except Exception as e:  # noqa: BLE001 - the library is installed but its own import fails (e.g. compiled ops built for another torch)
        lib = module.split(".")[0]
        torch = importlib.import_module("torch")
        raise UsageError(
            f"This model spec needs {lib}, which is installed but fails to import here ({type(e).__name__}: {' '.join(str(e).split())[:300]}).",
            f"Its install is broken or was built for another torch than this one ({torch.__version__}): reinstall it with "
            f"`{PIP[lib]}` at the version that matches torch, in the environment that runs the planner.",
        ) from e


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
        h.update(b"\0")
    return h.hexdigest()


# --------------------------------------------------------------------------- transformers


def _hf_config_path(rest: str) -> Path:
    path = Path(rest)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UsageError(
            f"hf:{rest}: no transformers config file there.",
            "Pass the path of a config.json as written by transformers (with a model_type key), e.g. hf:configs/llama.json.",
        )
    return path


def _hf_config_dict(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"hf:{path}: not a JSON file ({e}).", "A transformers config is a JSON object.") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("model_type"), str):
        raise UsageError(
            f"hf:{path}: the config has no model_type.",
            'Add "model_type" (e.g. "llama", "gpt2", "bert", "t5", "vit") as transformers writes it in config.json.',
        )
    return doc


def hf_config(path: Path, overrides: dict[str, Any]) -> Any:
    """The transformers config of ``path`` with ``overrides`` applied (unknown fields refused)."""
    transformers = require("transformers")
    doc = _hf_config_dict(path)
    model_type = doc.pop("model_type")
    known = importlib.import_module("transformers.models.auto.configuration_auto").CONFIG_MAPPING
    if model_type not in known:
        close = difflib.get_close_matches(model_type, list(known.keys()), n=3)
        raise UsageError(
            f"hf:{path}: transformers {transformers.__version__} does not know model_type {model_type!r}"
            + (f"; close names: {', '.join(close)}." if close else "."),
            "Use a model_type of the installed transformers (or a transformers release that has this one).",
        )
    config = _build_config(transformers, path, model_type, doc, "", "The check is transformers' own: fix the field it names in config.json.")
    unknown = sorted(k for k in overrides if not hasattr(config, k))
    if unknown:
        raise UsageError(
            f"hf:{path}: --model-arg {', '.join(unknown)} is neither a field of the {type(config).__name__} nor one of {', '.join(HF_RESERVED_ARGS)}.",
            "Pass config fields (e.g. --model-arg num_hidden_layers=2) or seq_len=N.",
        )
    if not overrides:
        return config
    # built again with the overrides as constructor arguments, so that the fields the config derives from them
    # (e.g. layer_types from num_hidden_layers) follow, and transformers validates the result
    given = ", ".join(f"{k}={v!r}" for k, v in overrides.items())
    return _build_config(
        transformers,
        path,
        model_type,
        {**doc, **overrides},
        f" with --model-arg {given}",
        "The check is transformers' own: change the --model-arg values, or the config.json field it names.",
    )


def _build_config(transformers: Any, path: Path, model_type: str, fields: dict[str, Any], what: str, hint: str) -> Any:
    """``AutoConfig.for_model(model_type, **fields)``; what transformers' own validation refuses becomes a UsageError."""
    try:
        return transformers.AutoConfig.for_model(model_type, **fields)
    except Exception as e:  # noqa: BLE001 - transformers validating the config's own fields
        cause: BaseException = e
        while cause.__cause__ is not None:
            cause = cause.__cause__
        first = next((x.strip() for x in str(cause).splitlines() if x.strip()), "")
        raise UsageError(f"hf:{path}: transformers refuses this {model_type} config{what}: {type(cause).__name__}: {first}", hint) from e


def hf_model_class(config: Any, name: str | None = None) -> Any:
    """The transformers class to build: ``name``, the config's architectures[0], else by the kind of model."""
    transformers = require("transformers")
    auto = importlib.import_module("transformers.models.auto.modeling_auto")
    name = name or next(iter(getattr(config, "architectures", None) or []), None)
    if name:
        cls = getattr(transformers, name, None)
        if cls is None:
            raise UsageError(
                f"transformers has no model class {name!r}.", "Name a class of the installed transformers (model_class=... or the config's architectures)."
            )
        return cls
    mt = config.model_type
    if getattr(config, "is_encoder_decoder", False):
        # never the decoder alone (WhisperForCausalLM is the causal-LM class of whisper's config)
        if mt in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
            return transformers.AutoModelForSeq2SeqLM
        if mt in auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES:
            return transformers.AutoModelForSpeechSeq2Seq
        return transformers.AutoModel
    if mt in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and mt not in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return transformers.AutoModelForCausalLM
    if mt in auto.MODEL_MAPPING_NAMES:
        return transformers.AutoModel
    # a type with no base model class (PP-LCNet, ShieldGemma 2): the first task class transformers has for it
    tasks = {
        "IMAGE_CLASSIFICATION": "AutoModelForImageClassification",
        "MASKED_LM": "AutoModelForMaskedLM",
        "SEQUENCE_CLASSIFICATION": "AutoModelForSequenceClassification",
        "IMAGE_TEXT_TO_TEXT": "AutoModelForImageTextToText",
    }
    for task, auto_class in tasks.items():
        if mt in getattr(auto, f"MODEL_FOR_{task}_MAPPING_NAMES", {}):
            return getattr(transformers, auto_class)
    raise UsageError(
        f"transformers has no model class for model type {mt!r} without a task: the config names no architectures.",
        "Name the class with --model-arg model_class=..., or give the config the architectures of a released checkpoint.",
    )


#: model types whose position ids count from the padding index + 1 (transformers' create_position_ids_from_input_ids):
#: of max_position_embeddings positions, pad_token_id + 1 are never used by a token
PADDING_OFFSET_POSITIONS = frozenset(
    {"roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "longformer", "roberta-prelayernorm", "data2vec-text", "xmod", "ibert", "mpnet", "luke", "esm"}
)


def hf_seq_len(config: Any, seq_len: int | None) -> int:
    """The planned sequence length: ``seq_len``, else the tokens the config's positions hold (RoBERTa's 514 positions
    hold 512: :data:`PADDING_OFFSET_POSITIONS`) capped at HF_DEFAULT_MAX_SEQ."""
    config = _text_config(config)  # a dual encoder's (CLIP's) positions are its text model's
    most = next((getattr(config, k) for k in ("max_position_embeddings", "n_positions", "n_ctx") if isinstance(getattr(config, k, None), int)), None)
    offset = most is not None and config.model_type in PADDING_OFFSET_POSITIONS
    if offset:
        most -= int(getattr(config, "pad_token_id", None) or 0) + 1
    if seq_len is not None:
        if not isinstance(seq_len, int) or seq_len < 1:
            raise UsageError(f"--model-arg seq_len={seq_len!r} is not a positive integer.")
        if offset and seq_len > most:
            raise UsageError(
                f"--model-arg seq_len={seq_len} is more than the {most} tokens a {config.model_type} config with "
                f"max_position_embeddings={config.max_position_embeddings} and pad_token_id={config.pad_token_id} holds (its "
                "position ids start after the padding index).",
                f"Use seq_len <= {most}, or raise max_position_embeddings in the config.",
            )
        return seq_len
    return min(most, HF_DEFAULT_MAX_SEQ) if most else 512


#: words in a module path that mark a position table indexed by image patches or audio frames, not by token positions
_NON_TEXT_PATHS = ("vision", "visual", "image", "patch", "audio", "speech")


def learned_position_tables(model: torch.nn.Module) -> list[tuple[str, int]]:
    """(module path, token positions it holds) of each learned position table of a text model: an ``nn.Embedding``
    named for positions (GPT-2's ``wpe``, BERT's ``position_embeddings``, BART's and OPT's ``embed_positions``) outside
    a vision or audio tower. Position ids index it directly, so a sequence longer than it holds indexes past it on the
    GPU; BART's and OPT's tables keep ``offset`` (2) rows before the first position."""
    out = []
    for name, m in model.named_modules():
        leaf = name.rpartition(".")[2].lower()
        if not isinstance(m, torch.nn.Embedding) or not (leaf == "wpe" or "position" in leaf or leaf.startswith("pos_")):
            continue
        if any(w in name.lower() for w in _NON_TEXT_PATHS):
            continue
        out.append((name, int(m.num_embeddings) - int(getattr(m, "offset", 0) or 0)))
    return out


def _check_positions(model: torch.nn.Module, seq: int, what: str) -> None:
    short = [(n, k) for n, k in learned_position_tables(model) if seq > k]
    if short:
        name, held = min(short, key=lambda x: x[1])
        raise UsageError(
            f"{what}: seq_len {seq} is more than the {held} positions its learned position table {name} holds; the "
            "position ids would index past it on the GPU.",
            f"Use --model-arg seq_len={held} or less, or raise the config's position count (max_position_embeddings / n_positions).",
        )


def _names(mapping: dict[str, Any], cls_name: str) -> bool:
    """Whether a transformers auto mapping (model_type -> class name(s)) lists ``cls_name``."""
    return any(cls_name == v or isinstance(v, (tuple, list)) and cls_name in v for v in mapping.values())


def _positional(params: list[str], wanted: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The wanted inputs as positional arguments: forward's leading parameters, up to the first one not wanted."""
    out = []
    for name in params:
        if name not in wanted:
            break
        out.append(wanted[name])
    return tuple(out)


def _text_config(config: Any) -> Any:
    """The config of the model's text part: the config itself, its ``text_config``, or where it has a text encoder
    and a decoder (MusicGen), whose plain ``get_text_config()`` raises as ambiguous, the decoder's."""
    if not hasattr(config, "get_text_config"):
        return config
    try:
        return config.get_text_config()
    except ValueError:
        return config.get_text_config(decoder=True)


def _logits(output: Any) -> torch.Tensor | None:
    """The output's logits; None for a model output without them (a ModelOutput is a dict)."""
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, dict):
        return output.get("logits")
    return output[0]


def _cross_entropy(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits against random integer targets, in fp32 (for an output without logits, the planner's default loss); the default
    loss of a model file without loss_fn where the output has no logits (transformers 5.25's PP-LCNet image classifier
    returns its last hidden state only)."""
    logits = _logits(output)
    if logits is None:
        return default_loss(output)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def _concrete_class(cls: Any, config: Any) -> Any:
    """The class an Auto* class builds for ``config``; any other class is itself.

    Where a model type maps to several classes (Funnel: FunnelModel and FunnelBaseModel) transformers takes the one the
    config's ``architectures`` names, else the first (auto_factory._get_model_class); that function raises on a config
    whose ``architectures`` is None (transformers 5.25: ``AutoModel.from_config`` fails on such a Funnel config), so the
    same choice is made here with None read as no names.
    """
    if not hasattr(cls, "_model_mapping"):
        return cls
    mapped = cls._model_mapping[type(config)]
    if not isinstance(mapped, (tuple, list)):
        return mapped
    by_name = {c.__name__: c for c in mapped}
    return next((by_name[a] for a in getattr(config, "architectures", None) or () if a in by_name), mapped[0])


def _hf_contract(spec: str, rest: str, model_args: dict[str, Any]) -> LibraryContract:
    path = _hf_config_path(rest)
    overrides = {k: v for k, v in model_args.items() if k not in HF_RESERVED_ARGS}
    config = hf_config(path, overrides)
    cls = hf_model_class(config, model_args.get("model_class"))
    concrete = _concrete_class(cls, config)
    if hasattr(cls, "_model_mapping") and isinstance(cls._model_mapping[type(config)], (tuple, list)):
        cls = concrete  # built directly: the Auto class's own choice among several raises without architectures
    seq = hf_seq_len(config, model_args.get("seq_len"))
    main_input = getattr(concrete, "main_input_name", "input_ids")
    text = _text_config(config)
    vocab = getattr(text, "vocab_size", None)
    cls_name = concrete.__name__
    auto = importlib.import_module("transformers.models.auto.modeling_auto")
    causal = _names(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, cls_name)
    lm = causal or _names(auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, cls_name) or _names(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES, cls_name)
    params = [p for p in inspect.signature(concrete.forward).parameters if p != "self"]
    classifier = cls_name.endswith(("ForImageClassification", "ForSequenceClassification"))
    num_labels = getattr(config, "num_labels", 2)
    if main_input not in ("input_ids", "pixel_values"):
        raise UsageError(
            f"hf:{path.name}: transformers' {cls_name} reads {main_input} (speech or other non-token input); hf: specs give "
            "token ids and images only, and planning it without its input would leave its encoder out.",
            "Write a model file whose build_model() builds this model from the config and whose example_inputs() returns "
            f"{main_input} as the model's processor makes it (README: the model-file contract).",
        )
    vision = getattr(config, "vision_config", None)
    image_tokens = any(getattr(config, k, None) is not None for k in ("image_token_index", "image_token_id"))
    # a dual encoder (CLIP, SigLIP) reads token ids and images side by side; a vision-language decoder (LLaVA) needs its
    # image tokens placed in the ids, which a config alone does not say: it is planned on text, its vision tower idle
    paired_image = main_input == "input_ids" and "pixel_values" in params and vision is not None and not image_tokens
    notes = []
    if vision is not None and image_tokens:
        notes.append(f"{cls_name} planned on token ids only (no images): its vision tower does not run")

    def build_model(**_: Any) -> torch.nn.Module:
        model = cls.from_config(hf_config(path, overrides)) if hasattr(cls, "from_config") else cls(hf_config(path, overrides))
        if main_input == "input_ids":
            _check_positions(model, seq, f"hf:{path.name}")
        return model

    def example_inputs(batch_size: int, **_: Any) -> tuple[torch.Tensor, ...]:
        if main_input == "pixel_values":
            size = getattr(config, "image_size", 224)
            size = (size, size) if isinstance(size, int) else tuple(size)
            return (torch.randn(batch_size, getattr(config, "num_channels", 3), *size),)
        wanted = {"input_ids": torch.randint(0, vocab or 2, (batch_size, seq))}
        if paired_image:
            size = getattr(vision, "image_size", 224)
            size = (size, size) if isinstance(size, int) else tuple(size)
            wanted["pixel_values"] = torch.randn(batch_size, getattr(vision, "num_channels", 3), *size)
        if not causal:  # encoders and encoder-decoders take a padding mask
            wanted["attention_mask"] = torch.ones(batch_size, seq, dtype=torch.long)
        if getattr(config, "is_encoder_decoder", False):
            wanted["decoder_input_ids"] = torch.randint(0, vocab or 2, (batch_size, seq))
        return _positional(params, wanted)

    def example_target(batch_size: int, **_: Any) -> torch.Tensor:
        if classifier:
            return torch.randint(0, num_labels, (batch_size,))
        return torch.randint(0, vocab or 2, (batch_size, seq))

    funcs: dict[str, Callable[..., Any]] = {"build_model": build_model, "example_inputs": example_inputs}
    if lm or classifier:
        funcs["loss_fn"] = _cross_entropy
        funcs["example_target"] = example_target
    # the config's bytes, not how its path is spelled: the same config planned from another directory has one digest
    return LibraryContract(funcs, dict(model_args), _digest(b"hf", path.read_bytes()), notes)


# --------------------------------------------------------------------------- the transformers config of a model


def transformers_config(model: torch.nn.Module) -> tuple[Any, bool] | None:
    """(the transformers config, whether the model is a causal language model) of a model built from transformers'
    classes (an ``hf:`` spec, or a model file that builds one), else None. The engines that build their own model
    from a shape derive it from this config (planner.engines.megatron.hf_shapes)."""
    config = getattr(model, "config", None)
    if config is None or not type(model).__module__.startswith("transformers.") or not hasattr(config, "model_type"):
        return None
    auto = importlib.import_module("transformers.models.auto.modeling_auto")
    return config, _names(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, type(model).__name__)


# --------------------------------------------------------------------------- timm / torchvision


def _vision_contract(spec: str, name: str, model_args: dict[str, Any], lib: str) -> LibraryContract:
    kwargs = {k: v for k, v in model_args.items() if k not in VISION_RESERVED_ARGS}
    size_arg = model_args.get("image_size")
    crop, video, min_frames = None, False, 1  # torchvision's default weights and video models set them below
    if lib == "timm":
        timm = require("timm")
        if name not in timm.list_models():
            raise UsageError(f"timm has no model {name!r}.{did_you_mean(name, timm.list_models())}", "List the names with timm.list_models().")

        def make() -> torch.nn.Module:
            return timm.create_model(name, pretrained=False, **kwargs)

        version = timm.__version__
    else:
        tv = require("torchvision")
        names = tv.models.list_models()
        if name not in names:
            raise UsageError(f"torchvision has no model {name!r}.{did_you_mean(name, names)}", "List the names with torchvision.models.list_models().")

        for family in ("detection", "optical_flow"):
            if name in tv.models.list_models(module=getattr(tv.models, family)):
                raise UsageError(
                    f"torchvision:{name} is a {family.replace('_', '-')} model: its training step takes "
                    + ("a list of images with box targets" if family == "detection" else "pairs of images and flow targets")
                    + ", which the planner's tensor-batch pipeline stages do not carry.",
                    "Plan its backbone instead (e.g. torchvision:resnet50), or write a model file whose forward() takes a "
                    "tensor batch and returns the training output.",
                )
        builder = tv.models.get_model_builder(name)
        video = name in tv.models.list_models(module=tv.models.video)
        crop, min_frames = _weights_input(tv, name)
        # segmentation and detection builders fetch ImageNet backbone weights by default: never load weights
        no_weights = {"weights": None} | ({"weights_backbone": None} if "weights_backbone" in inspect.signature(builder).parameters else {})

        def make() -> torch.nn.Module:
            return builder(**no_weights, **kwargs)

        version = tv.__version__
    state: dict[str, Any] = {}

    def build_model(**_: Any) -> torch.nn.Module:
        model = make()
        size = _input_size(model, _requested_size(model, lib, size_arg, crop))
        if video:
            frames = int(model_args.get("frames", max(VIDEO_FRAMES, min_frames)))
            size = (size[0], frames, *size[1:])  # (channels, frames, height, width)
        state["input_size"] = size
        state["classes"] = getattr(model, "num_classes", None) or _classes(model)
        return model

    def shape() -> tuple[int, ...]:
        if "input_size" not in state:
            build_on_meta(build_model)
        return state["input_size"]

    def example_inputs(batch_size: int, **_: Any) -> tuple[torch.Tensor, ...]:
        return (torch.randn(batch_size, *shape()),)

    def example_target(batch_size: int, **_: Any) -> torch.Tensor:
        shape()
        return torch.randint(0, state["classes"] or 2, (batch_size,))

    def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of the class logits against random labels, or for dense outputs (segmentation, detection) the planner's default loss (a mean squared error against a ramp)."""
        if isinstance(output, torch.Tensor) and output.dim() == 2:
            return F.cross_entropy(output.float(), target)
        return default_loss(output)  # dense outputs (segmentation): as for a model file without loss_fn

    funcs = {"build_model": build_model, "example_inputs": example_inputs, "loss_fn": loss_fn, "example_target": example_target}
    return LibraryContract(funcs, dict(model_args), _digest(spec.encode(), f"{lib} {version}".encode(), repr(sorted(model_args.items())).encode()))


def _requested_size(model: torch.nn.Module, lib: str, size_arg: Any, crop: Any) -> Any:
    """The image size to plan at, before _input_size's defaults: the user's ``image_size`` model-arg; for torchvision
    (timm reads its own pretrained_cfg) the size the model was built for (ViT's ``image_size``), else the crop of its
    default weights; None where neither says."""
    if size_arg is not None or lib == "timm":
        return size_arg
    return getattr(model, "image_size", None) or crop


def _weights_input(tv: Any, name: str) -> tuple[Any, int]:
    """(image size, minimum frames) of a torchvision model's default weights: the input their transforms give the model,
    the crop of classification and video weights, the resize of segmentation weights (which crop nothing: 520 for
    DeepLabV3, FCN and LR-ASPP, the size their model cards count GFLOPs at)."""
    try:
        weights = tv.models.get_model_weights(name).DEFAULT
    except (ValueError, AttributeError, KeyError):
        return None, 1
    keywords = getattr(weights.transforms, "keywords", {})
    size = keywords.get("crop_size") or keywords.get("resize_size")
    return size, int(weights.meta.get("min_temporal_size", 1))


def _input_size(model: torch.nn.Module, size: Any) -> tuple[int, ...]:
    """(channels, height, width): ``size`` (an int or (h, w)), else timm's pretrained_cfg input_size, else 3x224x224."""
    if size is not None:
        hw = (size, size) if isinstance(size, int) else tuple(size)
        return (3, *hw)
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
    if isinstance(cfg, dict) and cfg.get("input_size"):
        return tuple(int(x) for x in cfg["input_size"])
    return (3, 224, 224)


def _classes(model: torch.nn.Module) -> int | None:
    """Output features of the last Linear (a classifier's class count), if any."""
    last = None
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            last = m
    return last.out_features if last is not None else None
