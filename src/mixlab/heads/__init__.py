"""Task heads (LightningModules): embedding in, backbone, task output, loss and metrics."""

from mixlab.heads.lm import CausalLM
from mixlab.heads.synthetic import SyntheticLM  # noqa: F401
from mixlab.heads.vqa import SpatialVQA  # noqa: F401
from mixlab.heads.vit import ImageClassifier  # noqa: F401  (also registers timm vit_small_patch16_goat)

__all__ = ["CausalLM"]
