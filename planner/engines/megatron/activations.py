"""Bytes one of Megatron's own transformer layers saves for backward, per micro-batch (torch-free closed form).

pretrain_gpt.py builds its GPT layer from flags with Transformer Engine modules (megatron/core/models/gpt/
gpt_layer_specs.py, ``get_gpt_layer_with_transformer_engine_spec``, core_v0.16.1), so under ``--engine megatron`` a
layer's saved activations are those of that layer, not of the user's module. Each term below is what one module keeps
until its backward, for ``s`` tokens (``seq / cp`` per context-parallel rank), ``b`` samples and hidden size ``h``; the
residual stream is split over ``tp`` only with sequence parallelism, the tensors between the column- and row-parallel
GEMMs always are:

* input norm fused with the QKV GEMM (TE ``LayerNormLinear``, transformer_engine/pytorch/module/layernorm_linear.py):
  the norm's input, its fp32 statistics (LayerNorm: mean and 1/sigma; RMSNorm: 1/sigma) and the norm's output, which
  only the GEMM keeps, for the weight gradient (with sequence parallelism the local shard, gathered again in backward;
  TE 1.x's backward reads inputmat, mu, rsigma and ln_out, TE 2.x saves the same through prepare_for_saving);
* RoPE (``apply_rope_fusion``, TE's fused kernel) keeps only the frequency table, shared by all layers: nothing per token;
* core attention (TE ``DotProductAttention``, flash or cuDNN fused backend, transformer_engine/pytorch/attention/
  dot_product_attention/backends.py in TE 2.x, transformer_engine/pytorch/attention.py in TE 1.x; flash-attn's
  FlashAttnFunc likewise): q, k and v as the kernel reads them (k and v at the query-group width: GQA is
  not expanded), its output and the fp32 softmax statistics (one per head and token); attention dropout regenerates its
  mask from the RNG state, and no s x s matrix is kept;
* the output projection (TE ``Linear``, transformer_engine/pytorch/module/linear.py) keeps its input, which is the
  attention output the kernel keeps too (one storage in bf16);
* bias-dropout-add (megatron/core/fusions/fused_bias_dropout.py): the dropout mask, 1 byte per element, only when the
  hidden dropout is > 0 (torch's dropout returns its input at p = 0); the residual add keeps nothing;
* pre-MLP norm fused with FC1, as the first bullet; FC1's output (2 x ffn wide with SwiGLU), kept by the fused
  bias-GeLU / bias-SwiGLU (megatron/core/fusions/fused_bias_gelu.py, fused_bias_swiglu.py: their input); with
  ``--squared-relu`` (megatron/core/activations.py ``torch.pow(F.relu(x), 2)``, never fused) ReLU keeps its output and
  the square keeps its input, one tensor of ffn wide, and FC1's output is freed; FC2 keeps the activation's output,
  its own input; then a second bias-dropout-add.

Kinds (what :func:`planner.solve.memory.saved_bytes` does with them under FP8): ``gemm``, kept only by a weight GEMM,
which TE keeps in FP8 (1 byte); ``shared``, kept by a GEMM and another operator (the attention output), which gains an
FP8 copy; ``core``, what ``--recompute-granularity selective`` (``recompute_modules`` core_attn) no longer keeps: with
flash attention the softmax statistics, and the attention output is then kept by the projection only. ``explicit``
attention (unfused softmax, Korthikanti et al. 2022, arXiv 2205.05198, section 4.1) keeps q and k for QK^T, the softmax
output, the dropout mask and output (s x s per head, the ``core`` of selective recomputation) and v.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from planner.engines.megatron.architecture import architecture_defaults, megatron_ffn_hidden_size

#: bytes of a dropout mask element (torch keeps a bool mask), of a norm statistic and a softmax statistic (fp32)
MASK_BYTES = 1.0
STAT_BYTES = 4.0
#: Megatron's default --recompute-modules with --recompute-granularity selective
CORE_ATTN = frozenset({"core_attn"})


@dataclass(frozen=True)
class Saved:
    """One tensor a layer keeps for backward: its name, bytes per micro-batch, kind (other | gemm | shared | core) and
    sub-layer (attention | mlp)."""

    name: str
    bytes: float
    kind: str
    part: str


@dataclass(frozen=True)
class LayerShape:
    """The shapes of one Megatron transformer layer, from an ``architecture()`` dict (Megatron's defaults filled)."""

    hidden: int
    heads: int
    groups: int
    kv_channels: int
    ffn: int
    activation: str  # gelu | swiglu | squared_relu (planner.engines.megatron.architecture.ACTIVATIONS)
    rmsnorm: bool
    dropout: float

    @property
    def swiglu(self) -> bool:
        """A gated MLP: FC1 is 2 x ffn wide."""
        return self.activation == "swiglu"

    @classmethod
    def from_architecture(cls, arch: dict[str, Any]) -> LayerShape:
        a = architecture_defaults(arch)
        h, heads = int(a["hidden_size"]), int(a["num_attention_heads"])
        swiglu = a["activation"] == "swiglu"
        return cls(
            hidden=h,
            heads=heads,
            groups=int(a["num_query_groups"] or heads),
            kv_channels=int(a.get("kv_channels") or h // heads),
            ffn=int(a["ffn_hidden_size"] or megatron_ffn_hidden_size(h, swiglu)),
            activation=str(a["activation"]),
            rmsnorm=a["normalization"] == "RMSNorm",
            dropout=float(a["dropout"] or 0.0),
        )


def layer_saved(
    shape: LayerShape,
    tokens: int,
    micro_batch: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    dtype_bytes: float = 2.0,
    attention: str = "flash",
    recompute: str = "none",
    modules: frozenset[str] = CORE_ATTN,
) -> tuple[Saved, ...]:
    """Every tensor one layer keeps for backward on one GPU (bytes per micro-batch of ``micro_batch`` samples of
    ``tokens`` tokens each: ``seq / cp`` under context parallelism). ``attention``: ``flash`` (Megatron's TE layer) or
    ``explicit`` (Korthikanti's). ``recompute`` ``selective`` recomputes ``modules`` (``--recompute-modules``), and
    what they drop is of kind ``core``:

    * ``core_attn`` (``_checkpointed_attention_forward``: an ordinary checkpoint of the core attention): the kernel's
      own saves (the softmax statistics; explicit: the s x s tensors) go, q, k and v stay as the checkpoint's inputs,
      and the attention output becomes the projection's alone;
    * ``mlp`` (transformer_layer.py ``_forward_mlp``: ``tensor_parallel.checkpoint(self.mlp, False,
      pre_mlp_layernorm_output)``, dense layers only): the MLP keeps only its input, which with TE's fused
      LayerNormLinear (``pre_mlp_layernorm`` is IdentityOp) is the residual stream the norm already kept; its norm
      statistics, norm output, FC1 output and activation output go (the bias-dropout-add after it is outside the
      checkpoint and keeps its mask).

    Under ``none`` the softmax statistics (the explicit s x s tensors) stay of kind ``core``: what the default
    selective recomputation would drop."""
    core_attn = recompute != "selective" or "core_attn" in modules
    recompute_mlp = recompute == "selective" and "mlp" in modules
    sb = float(tokens * micro_batch)
    resid = sb * shape.hidden / (tp if sequence_parallel else 1)  # residual-stream elements on this GPU
    q = sb * shape.heads * shape.kv_channels / tp
    kv = sb * shape.groups * shape.kv_channels / tp
    heads = shape.heads / tp
    norm_stats = (1 if shape.rmsnorm else 2) * STAT_BYTES * resid / shape.hidden
    d = dtype_bytes
    out: list[Saved] = []
    core = "core" if core_attn else "other"
    for part in ("attention", "mlp"):
        inside = part == "mlp" and recompute_mlp  # dropped by the MLP's checkpoint
        out += [Saved(f"{part} norm input", d * resid, "other", part), Saved(f"{part} norm statistics", norm_stats, "core" if inside else "other", part)]
        out.append(Saved(f"{part} norm output (GEMM input)", d * resid, "core" if inside else "gemm", part))
        if part == "attention":
            if attention == "flash":
                out += [Saved("q", d * q, "other", part), Saved("k", d * kv, "other", part), Saved("v", d * kv, "other", part)]
                out.append(Saved("softmax statistics", STAT_BYTES * sb * heads, core, part))
                shared = "gemm" if recompute == "selective" and core_attn else "shared"
                out.append(Saved("attention output (projection input)", d * q, shared, part))
            elif attention == "explicit":
                ss = sb * tokens * heads  # s x s scores per head, b samples
                out += [Saved("q", d * q, "other", part), Saved("k", d * kv, "other", part)]
                out += [Saved("softmax output", d * ss, core, part), Saved("softmax dropout mask", MASK_BYTES * ss, core, part)]
                out += [Saved("softmax dropout output", d * ss, core, part), Saved("v", d * kv, "other", part)]
                out.append(Saved("attention output (projection input)", d * q, "gemm", part))
            else:
                raise ValueError(f"unknown attention {attention!r}")
        else:
            ffn = sb * shape.ffn / tp
            kept = "ReLU output (the square's input)" if shape.activation == "squared_relu" else "FC1 output (activation input)"
            out.append(Saved(kept, d * ffn * (2 if shape.swiglu else 1), "core" if inside else "other", part))
            out.append(Saved("activation output (FC2 input)", d * ffn, "core" if inside else "gemm", part))
        if shape.dropout > 0:
            out.append(Saved(f"{part} dropout mask", MASK_BYTES * resid, "other", part))
    return tuple(out)


@dataclass(frozen=True)
class PartBytes:
    """Bytes one sub-layer keeps, by kind, as :class:`planner.records.Layer` records them (``total`` holds them all)."""

    total: float
    gemm: float
    shared: float
    core: float


def part_bytes(terms: tuple[Saved, ...], part: str) -> PartBytes:
    """The terms of one sub-layer summed by kind."""
    mine = [t for t in terms if t.part == part]
    return PartBytes(
        total=sum(t.bytes for t in mine),
        gemm=sum(t.bytes for t in mine if t.kind == "gemm"),
        shared=sum(t.bytes for t in mine if t.kind == "shared"),
        core=sum(t.bytes for t in mine if t.kind == "core"),
    )


def kept_bytes(terms: tuple[Saved, ...], recompute: str = "none", fp8: bool = False, dtype_bytes: float = 2.0) -> float:
    """Bytes the terms leave saved until backward (``none`` or ``selective`` recompute; FP8 GEMM inputs in 1 byte)."""
    f = 1.0 / dtype_bytes if fp8 else 1.0
    total = 0.0
    for t in terms:
        if t.kind == "gemm":
            total += t.bytes * f
        elif t.kind == "shared":
            total += t.bytes * (1.0 + (f if fp8 else 0.0))
        elif t.kind == "core":
            total += 0.0 if recompute == "selective" else t.bytes
        else:
            total += t.bytes
    return total
