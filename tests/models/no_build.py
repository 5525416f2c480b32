import torch


def example_inputs(batch_size):
    return (torch.randn(batch_size, 8),)
