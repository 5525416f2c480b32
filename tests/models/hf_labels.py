"""transformers' Llama trained on its own loss: labels given as an input, no loss_fn."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, SEQ = 96, 16


def build_model():
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=False))


def example_inputs(batch_size):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ))
    return {"input_ids": ids, "labels": ids}
