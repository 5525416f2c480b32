"""Load a user's model file and build its model on the meta device.

The model-file contract (see README): ``build_model(**kwargs)``,
``example_inputs(batch_size, **kwargs)``, and optionally ``loss_fn(output,
target)``, ``example_target(batch_size, **kwargs)`` and
``architecture(**kwargs)``. ``--model-arg KEY=VALUE`` values are passed to
every function that accepts them.

A model spec ``hf:CONFIG.json``, ``timm:NAME`` or ``torchvision:NAME`` needs
no model file: :mod:`planner.model.sources` builds the same contract from the
library (see :func:`load_model_file`).

Inference-only switches that break training or tracing (a transformers
config's ``use_cache``) are turned off on every model ``build_model`` returns,
and the ModelFile's ``notes`` say so.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from planner.errors import UsageError
from planner.model.meta import build_on_meta
from planner.model.sources import LIBRARY_PREFIXES, library_contract

CONTRACT = ("build_model", "example_inputs", "loss_fn", "example_target", "architecture")


@dataclass
class ModelFile:
    """A loaded model file: its contract functions and the arguments to call them with."""

    path: Path
    module: ModuleType | None
    model_args: dict[str, Any]
    sha256: str
    funcs: dict[str, Callable[..., Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    spec: str | None = None  # the model spec as given (a file path, or hf:/timm:/torchvision:...)
    #: forward()'s parameter names of the model last built (keyword inputs are put in this order)
    forward_params: tuple[str, ...] = ()
    #: the forward() parameters example_inputs() gives by name (it returned a dict), in forward()'s order; () positional
    input_names: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """How messages name the model: the file name, or the library spec."""
        return self.spec if self.spec and self.spec.partition(":")[0] in LIBRARY_PREFIXES else self.path.name

    def _kwargs(self, name: str) -> dict[str, Any]:
        fn = self.funcs[name]
        sig = inspect.signature(fn)
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
            return dict(self.model_args)
        return {k: v for k, v in self.model_args.items() if k in sig.parameters}

    def call(self, name: str, *args: Any) -> Any:
        """Call contract function ``name``; errors raised by user code become a UsageError naming it."""
        try:
            result = self.funcs[name](*args, **self._kwargs(name))
        except UsageError:
            raise
        except Exception as e:  # user code: report where it failed
            library = LIBRARY_PACKAGES.get((self.spec or "").partition(":")[0])
            if library is not None:
                raise UsageError(
                    f"{self.name}: {library} could not {_STEP.get(name, f'run {name}() for')} this model: it raised "
                    f"{type(e).__name__}: {e} ({_library_frame(e, library)}).",
                    f"The error comes from the library's own code with these settings, not from the planner: {_LIBRARY_HINT[library]}",
                ) from e
            raise UsageError(
                f"{self.name}: {name}() raised {type(e).__name__}: {e} ({_user_frame(e, self.path)}).",
                "Fix the model file or the --model-arg values; the model-file contract is in the README.",
            ) from e
        if name == "build_model" and isinstance(result, torch.nn.Module):
            try:
                self.forward_params = tuple(inspect.signature(result.forward).parameters)
            except (TypeError, ValueError):
                self.forward_params = ()
            for note in training_switches(result):
                if note not in self.notes:
                    self.notes.append(note)
        return result

    def has(self, name: str) -> bool:
        return name in self.funcs

    def build_meta(self, dtype: torch.dtype) -> torch.nn.Module:
        """Build the model on the meta device in ``dtype``: no weights are allocated."""
        model = build_on_meta(lambda: self.call("build_model"))
        if not isinstance(model, torch.nn.Module):
            raise UsageError(
                f"{self.name}: build_model() returned {type(model).__name__}, not a torch.nn.Module.",
                "Return the model object from build_model().",
            )
        real = [(n, t) for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type != "meta"]
        if real:
            # some factories ignore the device context (torch.normal(mean, std, size=...): transformers' DiffLlama draws
            # its lambda vectors so); the planner needs only their shapes. They were allocated already, so moving them
            # costs nothing more, where refusing would leave a library model that cannot be edited unplannable
            size = sum(t.numel() * t.element_size() for _, t in real)
            note = (
                f"build_model() created {len(real)} tensor(s) of {size:,} bytes outside the meta device "
                f"(e.g. {real[0][0]!r} on {real[0][1].device}); the planner moved them to the meta device. A model that "
                "creates its weights with an explicit device=... allocates them for real before planning."
            )
            if note not in self.notes:
                self.notes.append(note)
            model = model.to("meta")
        if not any(p.numel() for p in model.parameters() if p.requires_grad):
            raise UsageError(
                f"{self.name}: the model built has no trainable parameters "
                f"({sum(p.numel() for p in model.parameters()):,} parameters in all): a training step has nothing to update.",
                "Check the --model-arg values that size it (a width or layer count of 0), or unfreeze the parameters to train.",
            )
        model = model.to(dtype=dtype) if dtype is not None else model
        model.train()
        return model

    def example_inputs(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        """``example_inputs(batch_size)`` as a tuple of tensors: positional, or a dict of keyword inputs put in forward()'s
        order (:attr:`input_names` says which; build the model first, which tells forward()'s parameters)."""
        inputs = self.call("example_inputs", batch_size)
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        if isinstance(inputs, Mapping) and inputs and all(isinstance(k, str) for k in inputs):
            unknown = [k for k in inputs if k not in self.forward_params]
            if unknown and self.forward_params and "kwargs" not in self.forward_params:
                raise UsageError(
                    f"{self.name}: example_inputs() names {', '.join(map(repr, unknown))}, which forward() does not take "
                    f"(it takes {', '.join(self.forward_params)}).",
                    "Name the inputs as forward()'s parameters are named.",
                )
            order = {name: i for i, name in enumerate(self.forward_params)}
            self.input_names = tuple(sorted(inputs, key=lambda k: order.get(k, len(order))))
            inputs = tuple(inputs[k] for k in self.input_names)
        else:
            self.input_names = ()
        if not isinstance(inputs, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in inputs):
            raise UsageError(
                f"{self.name}: example_inputs() must return a tensor, a tuple of tensors or a dict of tensors by forward() parameter name.",
                "Return e.g. (torch.randint(0, vocab, (batch_size, seq_len)),), or {'input_ids': ids, 'labels': ids}.",
            )
        return tuple(inputs)

    def inputs_meta(self, batch_size: int, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
        """One micro-batch of example inputs on the meta device (floating inputs cast to ``dtype``)."""
        with torch.device("meta"):
            inputs = self.example_inputs(batch_size)
        inputs = tuple(t if t.device.type == "meta" else t.to("meta") for t in inputs)
        empty = [(i, tuple(t.shape)) for i, t in enumerate(inputs) if t.numel() == 0]
        if empty:
            i, shape = empty[0]
            raise UsageError(
                f"{self.name}: example_inputs({batch_size}) returns an empty tensor (input {i}, shape {shape}): a training "
                "step over no elements has nothing to plan.",
                "Check the --model-arg values that size the inputs (a sequence length or image size of 0).",
            )
        if dtype is not None:
            inputs = tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)
        return inputs

    def architecture(self) -> dict[str, Any] | None:
        return self.call("architecture") if self.has("architecture") else None


def training_switches(model: torch.nn.Module) -> list[str]:
    """Turn off, on ``model`` in place, what a pipeline of static stage graphs cannot run; one note per kind.

    * transformers models default to ``config.use_cache=True``: the forward then returns a KV cache object, which
      training never reads and torch.export cannot return.
    * LayerDrop (a float attribute named ``layerdrop`` > 0 on a module, copied from the config's
      ``encoder_layerdrop`` / ``decoder_layerdrop``: M2M100 defaults to 0.05) skips a whole layer when a random draw
      falls under it: a branch on a tensor value, which no tracer follows and no stage graph can take. Every layer
      runs instead, which is what the plan costs (the most a step can take), and what the scripts train.
    """
    notes: list[str] = []
    seen: set[int] = set()
    dropped: dict[str, float] = {}
    for path, module in model.named_modules():
        for name, value in list(vars(module).items()):
            if name == "layerdrop" and type(value) is float and value > 0:
                setattr(module, name, 0.0)
                dropped[f"{path}.{name}" if path else name] = value
        config = getattr(module, "config", None)
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        if getattr(config, "use_cache", False) is True:
            config.use_cache = False
            where = f"{path}.config" if path else "config"
            notes.append(f"{where}.use_cache set to False: the KV cache is for inference, training does not use it")
    if dropped:
        listed = ", ".join(f"{k}={v:g}" for k, v in list(dropped.items())[:4]) + (", ..." if len(dropped) > 4 else "")
        notes.append(
            f"LayerDrop turned off ({listed}): skipping a layer on a random draw is a branch no pipeline stage graph can "
            "take; every layer runs, as planned and as the scripts train"
        )
    return notes


#: the package whose code a library model spec runs, by spec prefix
LIBRARY_PACKAGES = {"hf": "transformers", "timm": "timm", "torchvision": "torchvision"}
_STEP = {"build_model": "build", "example_inputs": "make example inputs for", "example_target": "make example targets for"}
_LIBRARY_HINT = {
    "transformers": "set the config fields the failing line reads with --model-arg KEY=VALUE, or start from the config.json of a released checkpoint.",
    "timm": "check the --model-arg values against the model's constructor arguments (timm.create_model keywords).",
    "torchvision": "check the --model-arg values against the model builder's keyword arguments.",
}


def _library_frame(exc: BaseException, package: str) -> str:
    """'file.py line N: code' of the deepest traceback frame in ``package``'s model code (``<package>/models/``), else
    anywhere in ``package``, else outside the planner: the library line that raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    here = str(Path(__file__).resolve().parent.parent)
    paths = [f.filename.replace("\\", "/") for f in frames]
    inside = (
        [f for f, q in zip(frames, paths) if f"{package}/models/" in q]  # the model's own code (transformers, timm, torchvision)
        or [f for f, q in zip(frames, paths) if f"{package}/" in q]
        or [f for f in frames if not f.filename.startswith(here)]
    )
    if not inside:
        return "at an unknown line"
    f = inside[-1]
    return f"{Path(f.filename).name} line {f.lineno}: {(f.line or '').strip()}"


def _user_frame(exc: BaseException, path: Path) -> str:
    """'file.py line N' of the deepest traceback frame inside the user's file, if any."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve() == path.resolve()]
    if not frames:
        return "outside the model file"
    f = frames[-1]
    return f"{path.name} line {f.lineno}: {f.line}"


def load_model_file(path: str | Path, model_args: dict[str, Any] | None = None) -> ModelFile:
    """Import ``path`` as a module and check that it follows the contract.

    ``hf:CONFIG.json``, ``timm:NAME`` and ``torchvision:NAME`` build the contract
    from those libraries instead (planner.model.sources).
    """
    prefix = str(path).partition(":")[0]
    if prefix in LIBRARY_PREFIXES:
        lib = library_contract(str(path), dict(model_args or {}))
        return ModelFile(
            path=Path(str(path)), module=None, model_args=lib.model_args, sha256=lib.sha256, funcs=lib.funcs, notes=list(lib.notes), spec=str(path)
        )
    path = Path(path)
    if not path.is_file():
        hint = "Pass the path of a Python file that defines build_model() and example_inputs()."
        if path.with_suffix(".py").is_file():
            hint = f"Did you mean {path.with_suffix('.py')}?"
        raise UsageError(f"Model file {str(path)!r} does not exist.", hint)
    source = path.read_bytes()
    name = "_planner_model_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UsageError(f"{path} cannot be imported as a Python module.", "Model files must be .py files.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        raise UsageError(
            f"Importing {path.name} raised {type(e).__name__}: {e} ({_user_frame(e, path)}).",
            "The model file must import cleanly on a machine without a GPU.",
        ) from e
    funcs = {n: getattr(module, n) for n in CONTRACT if callable(getattr(module, n, None))}
    missing = [n for n in ("build_model", "example_inputs") if n not in funcs]
    if missing:
        raise UsageError(
            f"{path.name} does not define {' and '.join(f'{m}()' for m in missing)}.",
            "A model file defines build_model(**kwargs) -> nn.Module and example_inputs(batch_size, **kwargs) -> tuple of "
            "tensors (optionally loss_fn, example_target, architecture); see examples/gpt2.py.",
        )
    mf = ModelFile(path=path, module=module, model_args=dict(model_args or {}), sha256=hashlib.sha256(source).hexdigest(), funcs=funcs)
    mf.spec = str(path)
    _check_model_args(mf)
    return mf


def _check_model_args(mf: ModelFile) -> None:
    accepted: set[str] = set()
    for fn in mf.funcs.values():
        params = inspect.signature(fn).parameters.values()
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            return
        accepted |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    accepted -= {"batch_size", "output", "target"}
    unknown = sorted(set(mf.model_args) - accepted)
    if unknown:
        from planner.errors import did_you_mean

        raise UsageError(
            f"{mf.name} does not accept --model-arg {', '.join(unknown)}.{did_you_mean(unknown[0], accepted)}",
            f"Accepted: {', '.join(sorted(accepted)) or '(none)'}.",
        )
