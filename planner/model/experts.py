"""Find the routed experts of a mixture-of-experts model by its structure (no names, no model registry).

Two ways of writing experts are recognised, both with the expert count as a module attribute:

* per-expert 3-D weights: a module with ``num_experts`` (or ``num_local_experts``) whose own parameters have
  that many rows in their first dimension (examples/moe.py ``Experts``; transformers 5 writes its MoE experts
  this way, e.g. ``MixtralExperts`` with ``gate_up_proj`` [E, 2f, h] and ``down_proj`` [E, h, f]);
* a ``ModuleList`` of that many structurally identical expert MLPs held by a module with the attribute
  (transformers 4's Mixtral block, Megatron's SequentialMLP).

Shared experts (always-on MLPs) are ordinary dense weights and are not reported. The router (a linear map from
the hidden state to one logit per expert, inside the module that holds the experts) is found the same way: Megatron
keeps it whole on every GPU (megatron/core/transformer/moe/router.py, core_v0.16: a plain parameter, not split by
tensor parallelism), so it is replicated rather than sharded.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

_COUNT_ATTRS = ("num_experts", "num_local_experts")


def _expert_count(module: nn.Module) -> int:
    for attr in _COUNT_ATTRS:
        v = getattr(module, attr, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 1:
            return v
    return 0


def _shapes(module: nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((n, tuple(p.shape)) for n, p in module.named_parameters())


@dataclass(frozen=True)
class ExpertGroup:
    """One MoE layer's routed experts: the module holding them, how many, the top-k its router picks (0 when no
    enclosing module names it), and the paths of their parameters."""

    path: str
    num_experts: int
    top_k: int
    params: tuple[str, ...]


def _top_k(model: nn.Module, path: str) -> int:
    """The top-k named by the module at ``path`` or its nearest enclosing module (``top_k``, ``num_experts_per_tok``)."""
    parts = path.split(".") if path else []
    for cut in range(len(parts), -1, -1):
        mod = model.get_submodule(".".join(parts[:cut]))
        for attr in _TOP_K_ATTRS:
            v = getattr(mod, attr, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return 0


_TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "moe_router_topk")


def find_experts(model: nn.Module) -> list[ExpertGroup]:
    """Every module of ``model`` that holds routed experts (see the module docstring), in module order."""
    out = []
    for path, mod in model.named_modules():
        e = _expert_count(mod)
        if not e:
            continue
        prefix = f"{path}." if path else ""
        names = [prefix + name for name, p in mod.named_parameters(recurse=False) if p.dim() >= 3 and p.shape[0] == e]
        for child_name, child in mod.named_children():
            if isinstance(child, nn.ModuleList) and len(child) == e and len(child) > 1:
                first = _shapes(child[0])
                if first and all(_shapes(m) == first for m in child):
                    names += [f"{prefix}{child_name}.{name}" for name, _ in child.named_parameters()]
        if names:
            out.append(ExpertGroup(path, e, _top_k(model, path), tuple(names)))
    return out


def expert_parameters(model: nn.Module) -> dict[str, int]:
    """Parameter path -> number of experts, for every parameter that belongs to routed experts."""
    return {name: g.num_experts for g in find_experts(model) for name in g.params}


def router_parameters(model: nn.Module) -> set[str]:
    """Paths of the router weights: linear layers producing one logit per expert under a module with an expert count."""
    experts = expert_parameters(model)
    out: set[str] = set()
    for path, mod in model.named_modules():
        e = _expert_count(mod)
        if not e:
            continue
        prefix = f"{path}." if path else ""
        for sub, m in mod.named_modules():
            if isinstance(m, nn.Linear) and m.out_features == e:
                for name, _ in m.named_parameters(recurse=False):
                    full = f"{prefix}{sub}.{name}" if sub else f"{prefix}{name}"
                    if full not in experts:
                        out.add(full)
    return out
