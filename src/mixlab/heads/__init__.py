"""Task heads (LightningModules): embedding in, backbone, task output, loss and metrics."""

from mixlab.heads.lm import CausalLM

__all__ = ["CausalLM"]
