"""Bytes the memory-bound kernels of one of Megatron's own dense transformer layers move, per micro-batch (torch-free
closed form): the memory-bound part of its time, as :mod:`planner.engines.megatron.activations` gives its saved bytes.

pretrain_gpt.py runs its Transformer Engine layer (megatron/core/models/gpt/gpt_layer_specs.py,
``get_gpt_layer_with_transformer_engine_spec``, core_v0.16.1) with the fusions megatron/training/arguments.py turns on
by default (``--no-bias-gelu-fusion``, ``--no-bias-swiglu-fusion``, ``--no-bias-dropout-fusion`` and
``--no-rope-fusion`` are ``store_false``). A user's module run as it is (DeepSpeed, torch.distributed.pipelining) moves
what its traced operators move; Megatron's layer moves, for ``T`` tokens on one GPU (``R`` residual-stream elements:
``T x h``, over ``tp`` with sequence parallelism; ``Q`` / ``K`` query / key-value elements and ``F`` MLP elements, over
``tp``; ``d`` bytes per element; each kernel reads its inputs once and writes its outputs once):

forward
* each norm (TE ``LayerNormLinear`` runs the norm as its own kernel before the GEMM): reads ``R``, writes ``R`` and
  its fp32 statistics;
* RoPE (TE's fused kernel, rope and mrope): reads and writes q and k, ``2 (Q + K)``;
* with query groups (``num_query_groups`` < heads) the query's reshape from [s, b, groups, heads / groups x head]
  to [s, b, heads, head] cannot be a view of the split QKV output (megatron/core/transformer/attention.py,
  ``get_query_key_value_tensors``): a copy, ``2 Q``;
* q/k norms (``qk_layernorm``): a norm of q and of k, ``2 (Q + K)``;
* bias-dropout-add (megatron/core/fusions/fused_bias_dropout.py, one fused kernel): reads the projection's output
  and the residual, writes the sum, ``3 R``, and a 1-byte dropout mask ``R`` when the hidden dropout is > 0;
* the activation (fused_bias_gelu.py: reads ``F``, writes ``F``; fused_bias_swiglu.py: reads ``2 F``, writes ``F``;
  squared ReLU, unfused: ``relu`` then ``pow``, each reading and writing ``F``).

backward
* bias-dropout-add: with dropout, reads the gradient and the mask and writes the input gradient, ``2 R`` + mask;
  with a bias, one reduction over the tokens reads ``R`` for its gradient; the residual path passes the gradient on;
* each sub-layer's input gradient is the sum of the residual path's and the norm's: ``3 R``;
* each norm's backward reads the output gradient, its input and statistics and writes the input gradient, ``3 R``;
* RoPE and the q/k norms as forward (``2 (Q + K)``, ``3 (Q + K)``); the split of the QKV output concatenates the
  q, k and v gradients back into one, ``2 (Q + 2 K)``;
* the activation's backward: GeLU reads the gradient and the input and writes the input gradient, ``3 F``; SwiGLU
  ``5 F``; squared ReLU runs four kernels (the aten ops its autograd dispatches in torch 2.13: ``pow`` (x^1),
  ``mul`` by 2, ``mul`` by the gradient, ``threshold_backward``), ``2 F + 2 F + 3 F + 3 F``; with a bias the FC1 bias
  gradient reads ``2 F`` / ``F`` more (squared ReLU: ``F``, and its separate bias add forward, ``2 F``).

Not here: the GEMMs and the attention core (their FLOPs, as traced), Transformer Engine's FP8 casts
(timing.fp8_cast_bytes), the tensor-parallel collectives (the cluster model), bias additions fused into GEMM epilogues.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.engines.megatron.activations import STAT_BYTES, LayerShape

#: position embeddings whose rotation runs inside each layer (TE's fused RoPE kernel)
ROTARY = ("rope", "mrope")


@dataclass(frozen=True)
class Kernel:
    """One memory-bound kernel of a layer: its name, bytes read and written forward and backward per micro-batch (0:
    it runs in one direction only), and its sub-layer (attention | mlp)."""

    name: str
    fwd: float
    bwd: float
    part: str


def layer_traffic(
    shape: LayerShape,
    tokens: int,
    micro_batch: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    dtype_bytes: float = 2.0,
    rotary: bool = False,
    qk_norm: bool = False,
    bias: bool = True,
) -> tuple[Kernel, ...]:
    """Every memory-bound kernel of one dense layer on one GPU (bytes per micro-batch of ``micro_batch`` samples of
    ``tokens`` tokens each: ``seq / cp`` under context parallelism)."""
    t = float(tokens * micro_batch)
    d = dtype_bytes
    r = t * shape.hidden / (tp if sequence_parallel else 1)
    q = t * shape.heads * shape.kv_channels / tp
    kv = t * shape.groups * shape.kv_channels / tp
    f = t * shape.ffn / tp
    stats = (1 if shape.rmsnorm else 2) * STAT_BYTES * r / shape.hidden
    mask = r if shape.dropout > 0 else 0.0
    out: list[Kernel] = []
    for part in ("attention", "mlp"):
        out.append(Kernel(f"{part} norm", 2 * d * r + stats, 3 * d * r + stats, part))
        out.append(Kernel(f"{part} input gradient sum", 0.0, 3 * d * r, part))
        if part == "attention":
            if rotary:
                out.append(Kernel("rope", 2 * d * (q + kv), 2 * d * (q + kv), part))
            if shape.groups < shape.heads:
                out.append(Kernel("query reshape copy", 2 * d * q, 0.0, part))
            if qk_norm:
                out.append(Kernel("q/k norms", 2 * d * (q + kv), 3 * d * (q + kv), part))
            out.append(Kernel("qkv gradient concatenation", 0.0, 2 * d * (q + 2 * kv), part))
        else:
            if shape.swiglu:
                out.append(Kernel("bias-swiglu", 3 * d * f, 5 * d * f + (2 * d * f if bias else 0.0), part))
            elif shape.activation == "squared_relu":
                out.append(Kernel("squared relu", 4 * d * f + (2 * d * f if bias else 0.0), 10 * d * f + (d * f if bias else 0.0), part))
            else:
                out.append(Kernel("bias-gelu", 2 * d * f, 3 * d * f + (d * f if bias else 0.0), part))
        out.append(Kernel(f"{part} bias-dropout-add", 3 * d * r + mask, (2 * d * r + mask if mask else 0.0) + (d * r if bias else 0.0), part))
    return tuple(out)


def part_traffic(kernels: tuple[Kernel, ...], part: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(forward, backward) bytes of each kernel of one sub-layer that runs in that direction."""
    mine = [k for k in kernels if k.part == part]
    return tuple(k.fwd for k in mine if k.fwd > 0), tuple(k.bwd for k in mine if k.bwd > 0)
