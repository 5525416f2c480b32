"""Mixtures of experts and multi-latent attention on Megatron-LM: the MoE layer pattern, its ``--moe-layer-freq`` text,
and the rules an ``architecture()``'s MoE and MLA keys follow.

* :func:`layer_pattern` expands ``moe_layer_freq`` (an int N or a 0/1 list) to one 0/1 entry per layer, as
  megatron-core's ``get_gpt_decoder_layer_specs`` does; :func:`layer_freq_text` writes a pattern back as the
  shortest of the exact forms Megatron's parser takes; :func:`parse_layer_freq` reads one (without ``eval``).
* :func:`moe_problems` / :func:`mla_problems` say why MoE / MLA keys do not map onto Megatron's GPT model.

Sources: Megatron-LM core_v0.16.1 megatron/training/arguments.py (``moe_freq_type``, ``_eval_pattern``, the MoE and
MLA checks of ``validate_args``, ``_add_moe_args`` choices and defaults); megatron-core 0.16.1
megatron/core/transformer/transformer_config.py (``TransformerConfig.__post_init__``: expert bias needs the sigmoid
score function, top-1 softmax routing needs ``--moe-router-pre-softmax``) and
megatron/core/models/gpt/gpt_layer_specs.py (``get_gpt_decoder_layer_specs``: int N means layer i is MoE when i % N == 0).
Torch-free.
"""

from __future__ import annotations

import re
from typing import Any

#: --moe-router-score-function choices (TransformerConfig.moe_router_score_function)
SCORE_FUNCTIONS = ("softmax", "sigmoid")
#: --moe-router-load-balancing-type choices (arguments.py, _add_moe_args)
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
#: the MoE keys of architecture() besides num_experts (given without num_experts they describe nothing)
MOE_KEYS = (
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    "moe_layer_freq",
    "moe_router_score_function",
    "moe_router_pre_softmax",
    "moe_router_enable_expert_bias",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_topk_scaling_factor",
    "moe_router_load_balancing_type",
    "moe_aux_loss_coeff",
)
#: Megatron's defaults of the MoE keys that have one (TransformerConfig field defaults, megatron-core 0.16.1)
MOE_DEFAULTS: dict[str, Any] = {
    "moe_layer_freq": 1,
    "moe_router_score_function": "softmax",
    "moe_shared_expert_gate": False,
    "moe_router_pre_softmax": False,
    "moe_router_enable_expert_bias": False,
    "moe_router_load_balancing_type": "aux_loss",
    "moe_aux_loss_coeff": 0.0,
}
#: MLA widths Megatron-LM needs stated (its flag defaults, 32 / 128 / 64 / 128, describe no published model)
MLA_REQUIRED = ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
#: the longest pattern :func:`parse_layer_freq` builds (a written pattern has one entry per layer)
MAX_PATTERN = 1 << 16


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def layer_pattern(freq: int | list[int] | tuple[int, ...], num_layers: int) -> list[int]:
    """One 0/1 entry per decoder layer (1: MoE): int N -> layer i is MoE when i % N == 0; a list is itself."""
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(num_layers)]
    return [int(x) for x in freq]


def _runs(pattern: list[int]) -> str:
    """``[0]*3+[1]*58``: the pattern as runs of equal entries."""
    out, i = [], 0
    while i < len(pattern):
        j = i
        while j < len(pattern) and pattern[j] == pattern[i]:
            j += 1
        out.append(f"[{pattern[i]}]" + (f"*{j - i}" if j - i > 1 else ""))
        i = j
    return "+".join(out)


def _literal(pattern: list[int]) -> str:
    return "[" + ",".join(str(x) for x in pattern) + "]"


def layer_freq_text(pattern: list[int]) -> str:
    """The shortest exact ``--moe-layer-freq`` value for a 0/1 pattern (ties: the first of the forms below).

    Forms tried: the int N whose every-N-th-layer pattern it is; a list literal ``[1,0,1]``; runs
    ``[0]*3+[1]*58``; a repeated block ``([1]*3+[0])*4`` (the block as runs or a literal). Every form
    but the int contains ``[``, which is how Megatron's ``moe_freq_type`` tells a pattern from an int.
    """
    L = len(pattern)
    forms: list[str] = [str(n) for n in range(1, L + 1) if layer_pattern(n, L) == pattern][:1]
    forms += [_literal(pattern), _runs(pattern)]
    for period in range(1, L // 2 + 1):
        if L % period == 0 and pattern[:period] * (L // period) == pattern:
            block = pattern[:period]
            for inner in (_runs(block), _literal(block)):
                forms.append(f"({inner})*{L // period}" if "+" in inner else f"{inner}*{L // period}")
    return min(forms, key=len)


_TOKEN = re.compile(r"\d+|[\[\](),+*]")


def parse_layer_freq(text: str) -> int | list[int]:
    """What Megatron-LM's ``moe_freq_type`` makes of a ``--moe-layer-freq`` value: an int, or the list a pattern evaluates to.

    Patterns are read by a small parser of the grammar ``_eval_pattern`` admits (digits, ``,[]()+*``; Megatron
    then calls ``eval``), never by ``eval``. Raises ValueError for what Megatron refuses or what is not an int
    or a list of ints, and for patterns longer than :data:`MAX_PATTERN`.
    """
    text = text.strip()
    if "[" not in text:
        return int(text)
    if re.search(r"[^,\d\[\]\(\)\+\*\s]", text):
        raise ValueError(f"invalid pattern {text!r} (only digits and , [ ] ( ) + * are allowed)")
    tokens = _TOKEN.findall(text)
    if "".join(tokens) != re.sub(r"\s", "", text):
        raise ValueError(f"invalid pattern {text!r}")
    pos = 0

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take(tok: str) -> None:
        nonlocal pos
        if peek() != tok:
            raise ValueError(f"invalid pattern {text!r}: expected {tok!r} at token {pos}")
        pos += 1

    def atom() -> Any:
        nonlocal pos
        tok = peek()
        if tok is None:
            raise ValueError(f"invalid pattern {text!r}: it ends early")
        if tok.isdigit():
            pos += 1
            return int(tok)
        if tok == "(":
            take("(")
            value = expr()
            take(")")
            return value
        if tok == "[":
            take("[")
            items: list[Any] = []
            while peek() != "]":
                items.append(expr())
                if peek() == ",":
                    take(",")
                elif peek() != "]":
                    raise ValueError(f"invalid pattern {text!r}: expected ',' or ']' at token {pos}")
            take("]")
            return items
        raise ValueError(f"invalid pattern {text!r}: unexpected {tok!r}")

    def term() -> Any:
        value = atom()
        while peek() == "*":
            take("*")
            if peek() == "*":
                raise ValueError(f"invalid pattern {text!r}: '**' is not read here")
            other = atom()
            if isinstance(value, list) and isinstance(other, list):
                raise ValueError(f"invalid pattern {text!r}: a list times a list")
            n = len(value) * other if isinstance(value, list) else len(other) * value if isinstance(other, list) else 0
            if n > MAX_PATTERN:
                raise ValueError(f"pattern {text!r} is longer than {MAX_PATTERN} entries")
            value = value * other
        return value

    def expr() -> Any:
        value = term()
        while peek() == "+":
            take("+")
            other = term()
            if isinstance(value, list) != isinstance(other, list):
                raise ValueError(f"invalid pattern {text!r}: a list plus a number")
            value = value + other
        return value

    value = expr()
    if pos != len(tokens):
        raise ValueError(f"invalid pattern {text!r}: unexpected {tokens[pos]!r} at token {pos}")
    if not isinstance(value, list) or not all(_is_int(x) for x in value):
        raise ValueError(f"pattern {text!r} is not a list of integers")
    return value


def moe_problems(arch: dict[str, Any]) -> list[str]:
    """Why an architecture's MoE keys do not map onto Megatron's MoE layer (``arch`` with its defaults filled); empty when they do."""
    experts: Any = arch.get("num_experts")
    if experts is None:
        given = [k for k in MOE_KEYS if arch.get(k) is not None and arch.get(k) != MOE_DEFAULTS.get(k)]
        return [f"{', '.join(given)} without num_experts (a dense model takes no MoE keys)"] if given else []
    out = []
    if not _is_int(experts) or experts < 1:
        return [f"num_experts = {experts!r} (a positive integer is needed)"]
    topk: Any = arch.get("moe_router_topk")
    if not _is_int(topk) or not 1 <= topk <= experts:
        out.append(f"moe_router_topk = {topk!r} (each token goes to 1 ... {experts} of the {experts} experts)")
    for key in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        if arch.get(key) is not None and (not _is_int(arch[key]) or arch[key] < 1):
            out.append(f"{key} = {arch[key]!r} (a positive integer or unset)")
    freq, L = arch.get("moe_layer_freq", 1), arch.get("num_layers")
    if _is_int(freq):
        if freq < 1:
            out.append(f"moe_layer_freq = {freq!r} (every N-th layer needs N >= 1)")
    elif not isinstance(freq, (list, tuple)) or not all(x in (0, 1) and not isinstance(x, bool) for x in freq):
        out.append(f"moe_layer_freq = {freq!r} (an int N or a list of 0/1, one per layer)")
    elif len(freq) != L:
        out.append(f"moe_layer_freq has {len(freq)} entries for {L} layers (get_gpt_decoder_layer_specs asserts one per layer)")
    score = arch.get("moe_router_score_function", "softmax")
    if score not in SCORE_FUNCTIONS:
        out.append(f"moe_router_score_function {score!r} (Megatron takes {', '.join(SCORE_FUNCTIONS)})")
    balance = arch.get("moe_router_load_balancing_type", "aux_loss")
    if balance not in LOAD_BALANCING:
        out.append(f"moe_router_load_balancing_type {balance!r} (Megatron takes {', '.join(LOAD_BALANCING)})")
    for key in ("moe_shared_expert_gate", "moe_router_pre_softmax", "moe_router_enable_expert_bias"):
        if not isinstance(arch.get(key, False), bool):
            out.append(f"{key} = {arch[key]!r} (True or False)")
    for key in ("moe_router_topk_scaling_factor", "moe_aux_loss_coeff"):
        v = arch.get(key)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0):
            out.append(f"{key} = {v!r} (a non-negative number or unset)")
    if arch.get("moe_shared_expert_gate") and not arch.get("moe_shared_expert_intermediate_size"):
        out.append("moe_shared_expert_gate without shared experts (moe_shared_expert_intermediate_size)")
    groups: Any = arch.get("moe_router_num_groups")
    group_topk: Any = arch.get("moe_router_group_topk")
    if (groups is None) != (group_topk is None):
        out.append("moe_router_num_groups and moe_router_group_topk go together (TransformerConfig: group-limited routing needs both)")
    elif groups is not None and (not _is_int(groups) or not _is_int(group_topk) or groups < 1 or experts % groups or not 1 <= group_topk <= groups):
        out.append(
            f"group-limited routing over {groups!r} groups, {group_topk!r} per token (TransformerConfig asserts the groups divide the "
            f"{experts} experts and group_topk <= groups)"
        )
    if arch.get("moe_router_enable_expert_bias") and score != "sigmoid":
        out.append("moe_router_enable_expert_bias with the softmax score function (TransformerConfig: expert bias needs sigmoid scores)")
    if topk == 1 and score == "softmax" and not arch.get("moe_router_pre_softmax") and balance != "sinkhorn":
        out.append("top-1 softmax routing without moe_router_pre_softmax (TransformerConfig raises: softmax over one logit has zero gradient)")
    return out


def mla_problems(arch: dict[str, Any]) -> list[str]:
    """Why an architecture's multi-latent attention keys do not map onto Megatron's MLATransformerConfig; empty when they do."""
    if not arch.get("multi_latent_attention"):
        given = [k for k in ("q_lora_rank", *MLA_REQUIRED) if arch.get(k) is not None]
        return [f"{', '.join(given)} without multi_latent_attention"] if given else []
    out = []
    heads, groups = arch.get("num_attention_heads"), arch.get("num_query_groups")
    if groups is not None and groups != heads:
        out.append(f"multi-latent attention with {groups} query groups (validate_args: grouped-query attention excludes MLA)")
    missing = [k for k in MLA_REQUIRED if arch.get(k) is None]
    if missing:
        out.append(f"multi-latent attention without {', '.join(missing)}")
    for key in ("q_lora_rank", *MLA_REQUIRED):
        v = arch.get(key)
        if v is not None and (not _is_int(v) or v < 1):
            out.append(f"{key} = {v!r} (a positive integer)")
    if arch.get("position_embedding") != "rope":
        out.append(f"multi-latent attention with position embedding {arch.get('position_embedding')!r} (MLA's decoupled key is rotary: rope)")
    return out
