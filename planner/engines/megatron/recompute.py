"""What Megatron's ``--recompute-modules`` recompute before each backward, per GPU and micro-batch (torch-free
closed form): the GEMM FLOPs, the bytes of the memory-bound kernels and the tensor-parallel collectives of the
forward each module runs again. What the modules stop keeping is in planner.engines.megatron.activations
(``layer_saved``) and megatron_moe_activations (``mla_attention_saved``).

* ``core_attn``: the core attention's forward; the traced pieces carry it (``op_flops_core`` / ``op_bytes_core``),
  so it is not repeated here.
* ``mla_up_proj`` (multi_latent_attention.py ``qkv_up_proj_and_rope_apply``, core_v0.16.1): the q and kv up
  projections, 2 S q_lora (heads / tp)(qk_head_dim + rope_dim) and 2 S kv_lora (heads / tp)(qk_head_dim +
  v_head_dim) FLOPs (a full-rank query: hidden in place of q_lora), their fused latent norms (read the latent, write
  the normed one: 2 x bytes of each, as megatron_traffic counts a norm), unfused RoPE on the query's rope part (read
  and write) and the concatenations that write q and k and the copy that makes v contiguous (each read and written
  once). Under sequence parallelism TEColumnParallelLinear all-gathers its input again: the q and kv latents, half of
  an all-gather + reduce-scatter pair of the residual stream per hidden-width of latent.
* ``mlp`` (dense layers: ``tensor_parallel.checkpoint(self.mlp, ...)``): FC1 (2 S h ffn / tp, twice with SwiGLU) and
  FC2 (2 S ffn h / tp), the fused norm and the bias-activation kernel (megatron_traffic's forward bytes), and the
  MLP's own tensor-parallel collectives (one residual-stream all-gather + reduce-scatter, or one all-reduce).

Left out: the recomputed GEMMs' FP8 input casts and the k_pos_emb gather (rope_dim wide).
"""

from __future__ import annotations

from planner.engines.megatron.activations import LayerShape
from planner.engines.megatron.moe_activations import MLAShape
from planner.engines.megatron.traffic import layer_traffic
from planner.records import RecomputeWork

#: a piece that recomputes nothing beyond the attention core
NO_RECOMPUTE = RecomputeWork()


def mla_up_proj_work(
    shape: LayerShape, mla: MLAShape, tokens: int, micro_batch: int, tp: int = 1, sequence_parallel: bool = False, dtype_bytes: float = 2.0
) -> RecomputeWork:
    """``mla_up_proj``'s forward again (module docstring), ``tokens`` = seq / cp."""
    S = float(tokens * micro_batch)
    T = S / (tp if sequence_parallel else 1)
    d, heads = dtype_bytes, mla.heads / tp
    q_in = mla.q_lora_rank or shape.hidden
    flops = (2 * S * q_in * heads * (mla.qk_head_dim + mla.rope_dim), 2 * S * mla.kv_lora_rank * heads * (mla.qk_head_dim + mla.v_head_dim))
    qk = S * heads * (mla.qk_head_dim + mla.rope_dim)
    v = S * heads * mla.v_head_dim
    kernels: tuple[float, ...] = ()
    if mla.latent_norms:
        kernels += tuple(2 * d * T * w for w in (mla.q_lora_rank, mla.kv_lora_rank) if w)
    kernels += (2 * d * S * heads * mla.rope_dim, 2 * d * qk, 2 * d * qk, 2 * d * v)
    latents = sum(w for w in (mla.q_lora_rank, mla.kv_lora_rank) if w)
    coll = 0.5 * latents / shape.hidden if sequence_parallel and tp > 1 else 0.0
    return RecomputeWork(flops, kernels, coll)


def dense_mlp_work(shape: LayerShape, tokens: int, micro_batch: int, tp: int = 1, sequence_parallel: bool = False, dtype_bytes: float = 2.0) -> RecomputeWork:
    """``mlp``'s forward again (module docstring), ``tokens`` = seq / cp."""
    S = float(tokens * micro_batch)
    f = S * shape.hidden * shape.ffn / tp
    flops = (2 * f * (2 if shape.swiglu else 1), 2 * f)
    kernels = tuple(
        k.fwd
        for k in layer_traffic(shape, tokens, micro_batch, tp, sequence_parallel, dtype_bytes)
        if k.part == "mlp" and k.fwd > 0 and "dropout" not in k.name
    )
    return RecomputeWork(flops, kernels, 1.0 if tp > 1 else 0.0)
