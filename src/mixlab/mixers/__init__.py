"""Sequence mixers. Importing this package registers every built-in mixer.

One file per family; register with ``@register_mixer("name")`` and add the import here.
"""

from mixlab.mixers.base import Mixer
from mixlab.mixers.attention import Attention
from mixlab.mixers.delta import GatedDeltaMixer  # noqa: F401  (deltanet, gdn, kda, fg2gdn, ...)
from mixlab.mixers.mla import MultiHeadLatentAttention  # noqa: F401  (mla)
from mixlab.mixers.mesa import Mesa  # noqa: F401  (mesa)
from mixlab.mixers.hawk import Hawk  # noqa: F401  (hawk)
from mixlab.mixers.gla import GLA  # noqa: F401  (gla)
from mixlab.mixers.mamba2 import Mamba2  # noqa: F401  (mamba2)
from mixlab.mixers.swa import SlidingWindowAttention  # noqa: F401  (swa)

__all__ = ["Mixer", "Attention"]
