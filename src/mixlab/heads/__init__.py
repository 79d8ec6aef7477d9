"""Task heads (LightningModules): embedding in, backbone, task output, loss and metrics.

Every head derives from :class:`~mixlab.heads.common.Head`.
"""

from mixlab.heads.common import Head
from mixlab.heads.lm import CausalLM
from mixlab.heads.synthetic import SyntheticLM
from mixlab.heads.vit import ImageClassifier  # also registers timm vit_small_patch16_goat
from mixlab.heads.vqa import SpatialVQA

__all__ = ["Head", "CausalLM", "SyntheticLM", "ImageClassifier", "SpatialVQA"]
