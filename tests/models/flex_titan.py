"""A Llama written the way torchtitan writes its flex-attention models: ``flex_attention`` compiled once as a class
attribute of the attention wrapper (torchtitan/models/attention.py, FlexAttentionWrapper), grouped-query attention
(4 query heads, 2 key/value heads), and one causal BlockMask made by ``create_block_mask`` in the model's forward and
passed to every layer. Sizes are small; the structure is torchtitan's."""
import torch, torch.nn as nn, torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention, create_block_mask, BlockMask

class FlexAttention(nn.Module):
    flex_attn = torch.compile(flex_attention, mode="max-autotune-no-cudagraphs")
    compiled_create_block_mask = torch.compile(create_block_mask)
    def forward(self, q, k, v, block_mask):
        return FlexAttention.flex_attn(q, k, v, block_mask=block_mask, enable_gqa=q.size(1) != k.size(1))

def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx

class Attention(nn.Module):
    def __init__(self, d=64, h=4, kvh=2):
        super().__init__(); self.h, self.kvh, self.hd = h, kvh, d // h
        self.wq = nn.Linear(d, d, bias=False); self.wk = nn.Linear(d, kvh * self.hd, bias=False); self.wv = nn.Linear(d, kvh * self.hd, bias=False); self.wo = nn.Linear(d, d, bias=False)
        self.inner = FlexAttention()
    def forward(self, x, mask):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.h, self.hd).transpose(1, 2)
        k = self.wk(x).view(B, T, self.kvh, self.hd).transpose(1, 2)
        v = self.wv(x).view(B, T, self.kvh, self.hd).transpose(1, 2)
        return self.wo(self.inner(q, k, v, mask).transpose(1, 2).reshape(B, T, -1))

class Block(nn.Module):
    def __init__(self):
        super().__init__(); self.attention = Attention(); self.ffn = nn.Sequential(nn.Linear(64, 256, bias=False), nn.SiLU(), nn.Linear(256, 64, bias=False)); self.n1 = nn.RMSNorm(64); self.n2 = nn.RMSNorm(64)
    def forward(self, x, mask):
        x = x + self.attention(self.n1(x), mask)
        return x + self.ffn(self.n2(x))

class Transformer(nn.Module):
    def __init__(self):
        super().__init__(); self.tok_embeddings = nn.Embedding(128, 64); self.layers = nn.ModuleDict({str(i): Block() for i in range(2)}); self.norm = nn.RMSNorm(64); self.output = nn.Linear(64, 128, bias=False)
    def forward(self, tokens):
        T = tokens.shape[1]
        mask = create_block_mask(causal, None, None, T, T, device=tokens.device)
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values(): h = layer(h, mask)
        return self.output(self.norm(h))

def build_model(): return Transformer()
def example_inputs(b): return (torch.randint(0, 128, (b, 256)),)
