"""planner: static planning of pipeline-parallel training for PyTorch models."""

__version__ = "0.1.0"
