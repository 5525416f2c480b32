"""What torchtitan's activation checkpointing keeps and recomputes, per piece (torch-free closed forms over the traced
compute operators, planner.records.Layer.compute_op_*).

torchtitan 0.3.0 (torchtitan/distributed/activation_checkpoint.py) wraps every transformer block (``model.layers``) and
nothing else: the embedding, the final norm and the output layer keep what they save.

* ``full`` (``FullAC``): a block keeps its input; its forward runs again before its backward.
* ``selective`` (``SelectiveAC``, the Trainer's default; "per-op" SAC): ``create_selective_checkpoint_contexts`` with a
  policy that MUST_SAVEs the outputs of the ops in ``_get_default_save_ops()`` (torch 2.13's
  ``get_default_op_list().compute_intensive_ops``: mm, addmm, bmm, convolution, the flash and efficient attention ops,
  _scaled_mm, upsample_bilinear2d; plus the cudnn, math and fused SDPA variants, ``aten.max``, flex attention, ``linear``,
  ``topk`` and the reduce-scatter / all-to-all collectives) except every second ``mm``/``linear`` of the block, counted
  per block forward (``meta["forward_mm_count"] % 2 == 0`` is recomputed, so the 1st, 3rd, 5th ... are kept), and
  PREFER_RECOMPUTEs every other op. A block keeps its input and those outputs; in its backward the rest is recomputed
  (the recomputed mms and every memory-bound op), and for that while the block's full saved set exists once more.
  ``force_recompute_mm_shapes_by_fqns`` (default ``moe.router.gate``) only touches MoE routers.

torchtitan 0.1's "selective layer" variant (every n-th block fully checkpointed, ``selective_ac_option = N``) is gone
from 0.3.0 (the policies are selective, full, memory-budget and none), so it is not planned; memory-budget needs
torch.compile's partitioner and is not planned either.
"""

from __future__ import annotations

from dataclasses import replace

from planner.records import Layer, ModelCosts, RecomputeWork

#: the ops whose outputs torchtitan's SelectiveAC keeps (aten overload packet names)
SAVED_OPS = frozenset(
    {
        "mm",
        "addmm",
        "bmm",
        "convolution",
        "convolution_backward",
        "_scaled_mm",
        "upsample_bilinear2d",
        "_flash_attention_forward",
        "_efficient_attention_forward",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_attention_math",
        "_scaled_dot_product_fused_attention_overrideable",
        "max",
        "linear",
        "topk",
        "flex_attention",
    }
)
#: the matmuls whose outputs alternate: every second one of a block is recomputed
ALTERNATING = frozenset({"mm", "linear"})


def block_ranges(costs: ModelCosts) -> list[tuple[int, int]]:
    """[a, b) piece ranges of the checkpointed units: consecutive pieces of one repeated block."""
    out: list[tuple[int, int]] = []
    k = 0
    while k < costs.n:
        blk = costs.layers[k].block
        j = k + 1
        if blk is not None:
            while j < costs.n and costs.layers[j].block == blk:
                j += 1
            out.append((k, j))
        k = j
    return out


def selective_kept(layers: tuple[Layer, ...]) -> list[tuple[float, float]]:
    """Per piece of one block (in order): (bytes of op outputs SelectiveAC keeps, FLOPs of the matmuls it recomputes)."""
    count = 0
    out = []
    for layer in layers:
        kept, recomputed = 0.0, 0.0
        for name, nbytes, flops in zip(layer.compute_op_names, layer.compute_op_bytes, layer.compute_op_flops):
            if name in ALTERNATING:
                count += 1
                if count % 2 == 0:
                    recomputed += flops
                    continue
            if name in SAVED_OPS:
                kept += nbytes
            else:
                recomputed += flops
        out.append((kept, recomputed))
    return out


def checkpointed(costs: ModelCosts, recompute: str) -> ModelCosts:
    """``costs`` with each piece's saved bytes as torchtitan's checkpointing keeps them (``none``, ``selective``,
    ``full``), and the block's full saved set, rebuilt during its backward, in each of its pieces' working set
    (``max_op_bytes``). Pieces outside the blocks are not checkpointed."""
    if recompute == "none":
        return costs
    layers = list(costs.layers)
    for a, b in block_ranges(costs):
        full = sum(l.saved_bytes for l in layers[a:b])
        entry = costs.cuts[a].bytes  # the block's input, which the checkpoint keeps
        if recompute == "selective":
            kept = [k for k, _ in selective_kept(tuple(layers[a:b]))]
        elif recompute == "full":
            kept = [0.0] * (b - a)
        else:
            raise ValueError(f"torchtitan has no {recompute} activation checkpointing")
        kept[0] += entry
        held = sum(kept)
        for k in range(a, b):
            l = layers[k]
            layers[k] = replace(
                l,
                saved_bytes=int(round(kept[k - a])),
                core_saved_bytes=0,
                gemm_saved_bytes=0,
                gemm_shared_bytes=0,
                max_op_bytes=int(l.max_op_bytes + max(0.0, full - held)),
            )
    return replace(costs, layers=tuple(layers))


def selective_work(costs: ModelCosts) -> tuple[RecomputeWork, ...]:
    """Per piece: what SelectiveAC runs again in the backward: the recomputed matmuls and every memory-bound operator
    of the blocks (pieces outside the blocks: nothing)."""
    work = [RecomputeWork() for _ in costs.layers]
    for a, b in block_ranges(costs):
        for k, (_, flops) in zip(range(a, b), selective_kept(costs.layers[a:b])):
            l = costs.layers[k]
            work[k] = RecomputeWork((flops,) if flops else (), tuple(l.op_bytes_fwd) + tuple(l.op_bytes_fwd_resid))
    return tuple(work)
