"""Sequence mixers and attention position schemes. Importing this package registers every built-in one.

One file per family; register with ``@register_mixer("name")`` (a position scheme with
``@register_position("name")``, see :mod:`mixlab.mixers.positions`) and add the import here.
"""

from mixlab.mixers.attention import Attention
from mixlab.mixers.base import Mixer, SubLayer
from mixlab.mixers.delta import GatedDeltaMixer  # noqa: F401  (deltanet, gdn, kda, fg2gdn, ...)
from mixlab.mixers.gla import GLA  # noqa: F401  (gla)
from mixlab.mixers.hawk import Hawk  # noqa: F401  (hawk)
from mixlab.mixers.mamba2 import Mamba2  # noqa: F401  (mamba2)
from mixlab.mixers.mesa import Mesa  # noqa: F401  (mesa)
from mixlab.mixers.mla import MultiHeadLatentAttention  # noqa: F401  (mla)
from mixlab.mixers.positions import PositionScheme  # noqa: F401  (goat, alibi, rope, nope)
from mixlab.mixers.swa import SlidingWindowAttention  # noqa: F401  (swa)
from mixlab.registry import MIXERS, POSITIONS

build_mixer, list_mixers, get_mixer_cls = MIXERS.build, MIXERS.names, MIXERS.get
build_position, list_positions = POSITIONS.build, POSITIONS.names

__all__ = ["Mixer", "SubLayer", "Attention", "PositionScheme", "build_mixer", "list_mixers", "get_mixer_cls",
           "build_position", "list_positions"]
