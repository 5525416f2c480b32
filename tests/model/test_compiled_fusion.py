"""What torch.compile leaves of the memory-bound work (planner.model.cost._Fusion, Layer.fused_bytes_*), against
closed forms: a pointwise chain reads its input once and writes its output once; a tensor a matmul reads is written;
a norm's fp32 intermediates are never written; and the time model swaps in the fused regions only for compiled
blocks (and the loss, when it is compiled)."""

from __future__ import annotations

import torch
from conftest import costs_of
from torch import nn

from planner.model.cost import cost_piece
from planner.solve.timing import compiled_traffic

T, H = 64, 32  # tokens, width
X = T * H * 2  # bytes of one (T, H) bf16 activation


def _fused(module: nn.Module) -> tuple[tuple[float, ...], float]:
    with torch.device("meta"):
        x = torch.empty(1, T, H, dtype=torch.bfloat16)
    module = module.to(device="meta", dtype=torch.bfloat16)
    cost, _ = cost_piece(module, (x,), T, 1)
    return cost.fused_bytes_fwd, sum(cost.op_bytes_fwd) + sum(cost.op_bytes_fwd_resid)


class Chain(nn.Module):
    def forward(self, x):
        return torch.relu(x * 2.0 + 1.0) * 3.0


class ChainMatmul(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(H, H, bias=False)

    def forward(self, x):
        return self.w(torch.relu(x)) + 1.0


class RMSNorm(nn.Module):
    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x)


def test_a_pointwise_chain_reads_its_input_and_writes_its_output_once():
    fused, eager = _fused(Chain())
    assert fused == (2 * X,)
    assert eager == 4 * 2 * X  # four kernels, each reading and writing a (T, H) tensor


def test_a_matmul_input_is_written_and_its_output_read():
    fused, _ = _fused(ChainMatmul())
    # region 1: relu reads x, writes its output (the matmul reads it); region 2: the add reads the matmul's output
    # and writes the piece's output
    assert fused == (2 * X, 2 * X)


def test_a_norm_writes_no_fp32_intermediate():
    fused, eager = _fused(RMSNorm())
    assert fused == (2 * X,)  # the bf16 input read, the bf16 output written
    assert eager > 4 * fused[0]  # eager: the fp32 copy, its square, the mean, the scaled product ...


def test_compiled_traffic_swaps_blocks_and_a_compiled_loss_only():
    costs = costs_of("llama", "llama-tiny").scaled(2)
    last = max(k for k, l in enumerate(costs.layers) if l.block is not None)
    for loss in (False, True):
        got = compiled_traffic(costs, loss)
        for k, (a, b) in enumerate(zip(costs.layers, got.layers)):
            fused = a.block is not None or (loss and k > last and a.kind == "head")
            if fused:
                assert b.op_bytes_fwd == a.fused_bytes_fwd and b.op_bytes_bwd == a.fused_bytes_bwd and not b.op_bytes_fwd_resid
                assert b.mem_bytes_fwd == sum(a.fused_bytes_fwd)
            else:
                assert b == a
    block = next(l for l in costs.layers if l.block is not None)
    assert sum(block.fused_bytes_fwd) < sum(block.op_bytes_fwd) + sum(block.op_bytes_fwd_resid)
