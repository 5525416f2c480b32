"""What torchtitan's loss holds, per piece (torch-free closed forms over the traced output layer and loss).

torchtitan 0.3.0's llama3 registry functions train ``ChunkedLossWrapper(CrossEntropyLoss)``
(models/llama3/config_registry.py; components/loss.py ``ChunkedLossWrapper``): the decoder returns its normed hidden
states without the output layer (``_skip_lm_head``), the wrapper splits them into ``num_chunks`` (default 8) along the
sequence, and for each chunk runs the output layer and the cross-entropy (``pred.flatten(0, 1).float()``, as the
traced model file's loss does) and its backward at once, writing the chunk's hidden-state gradient into a
``GradAccumulator`` of fp32 (``dtype=torch.float32``). So no logits outlive one chunk, and what a micro-batch keeps
until the decoder's backward is that fp32 gradient of its hidden states.

Per micro-batch the output-layer piece therefore keeps 2 x its input's bf16 bytes (the fp32 accumulator), and while
the loss runs its working set is one chunk's share of the traced output layer and loss (the saved tensors, the
largest operator output and the logits with their gradient, / ``num_chunks``) plus the contiguous chunk copies of
the hidden states (1 x its input).
"""

from __future__ import annotations

from dataclasses import replace

from planner.records import ModelCosts

#: ChunkedLossWrapper.Config.num_chunks (components/loss.py, torchtitan 0.3.0)
LOSS_CHUNKS = 8
#: bytes of the fp32 GradAccumulator per bf16 byte of the hidden states it accumulates
ACCUMULATOR_PER_HIDDEN_BYTE = 2.0


def head_index(costs: ModelCosts) -> int | None:
    """The output-layer piece (kind ``head``) after the last transformer block, or None."""
    last_block = max((k for k, l in enumerate(costs.layers) if l.block is not None), default=-1)
    heads = [k for k, l in enumerate(costs.layers) if k > last_block and l.kind == "head"]
    return heads[-1] if heads else None


def chunked_loss(costs: ModelCosts, num_chunks: int = LOSS_CHUNKS, compiled: bool = False) -> ModelCosts:
    """``costs`` with the output layer and loss as ChunkedLossWrapper runs them (module docstring): its saved bytes the
    fp32 hidden-state gradient, its working set one chunk's share plus the chunk copies, its output not kept.

    The traced piece is the output linear (which keeps its input) and the model file's loss (``.float()`` upcast,
    log-softmax: the fp32 tensors it saves and its largest output). ``compiled`` (torchtitan's compile components
    include "loss"): torch.compile fuses the upcast, log-softmax and NLL into kernels that keep only the bf16 logits
    (and a log-sum-exp per token, 4 bytes, not counted) and whose backward writes the bf16 logits' gradient, so the
    fp32 tensors are never allocated. Per chunk: the linear's input, the loss's saved tensors and working set, and
    the logits with their gradient."""
    k = head_index(costs)
    if k is None:
        return costs
    head = costs.layers[k]
    hidden = float(costs.cuts[k].bytes)
    loss_saved = 0.0 if compiled else max(0.0, head.saved_bytes - hidden)
    loss_work = 0.0 if compiled else float(head.max_op_bytes)
    chunk = (hidden + loss_saved + loss_work + 2.0 * head.out_bytes) / num_chunks
    layers = list(costs.layers)
    layers[k] = replace(
        head,
        saved_bytes=int(round(ACCUMULATOR_PER_HIDDEN_BYTE * hidden)),
        core_saved_bytes=0,
        gemm_saved_bytes=0,
        gemm_shared_bytes=0,
        max_op_bytes=int(round(chunk + hidden)),
    )
    return replace(costs, layers=tuple(layers))
