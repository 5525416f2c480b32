"""A tiny GPT-2 from transformers, built from its config as users write it (defaults untouched except sizes)."""
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, SEQ = 96, 16


def build_model():
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, use_cache=False)
    return GPT2LMHeadModel(config)


def example_inputs(batch_size):
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),)


def example_target(batch_size):
    return torch.randint(0, VOCAB, (batch_size, SEQ))


def loss_fn(output, target):
    """Cross-entropy of the ModelOutput's logits (next-token prediction on random tokens)."""
    return F.cross_entropy(output.logits.flatten(0, 1).float(), target.flatten())
