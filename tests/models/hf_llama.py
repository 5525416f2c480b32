"""A tiny Llama from transformers, built from its config as users write it (defaults untouched except sizes)."""
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, SEQ = 96, 16


def build_model():
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def example_inputs(batch_size):
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),)


def example_target(batch_size):
    return torch.randint(0, VOCAB, (batch_size, SEQ))


def loss_fn(output, target):
    """Cross-entropy of the ModelOutput's logits (next-token prediction on random tokens)."""
    return F.cross_entropy(output.logits.flatten(0, 1).float(), target.flatten())
