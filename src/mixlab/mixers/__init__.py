"""Sequence mixers. Importing this package registers every built-in mixer.

One file per family; register with ``@register_mixer("name")`` and add the import here.
"""

from mixlab.mixers.base import Mixer
from mixlab.mixers.attention import Attention

__all__ = ["Mixer", "Attention"]
