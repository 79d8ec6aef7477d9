"""mixlab: one mixer core (GOAT attention priors, gated delta rules, MesaNet), several heads, one CLI.

Layout (import only downward): ``ops`` (stateless math, reference + fast paths) ->
``mixers`` (modules; registered in the leaf :mod:`mixlab.registry`) -> ``backbone`` ->
``heads`` (LightningModules) -> ``cli`` and ``eval`` (commands); datamodules live in
``mixlab.datamodules`` (the repo's top-level ``datamodules/``) and never import heads.
Importing ``mixlab`` registers every built-in mixer and position scheme.
"""

from mixlab.coords import Coords
from mixlab.mixers import build_mixer, build_position, list_mixers, list_positions
from mixlab.registry import register_mixer, register_position

__version__ = "0.1.0"
__all__ = ["Coords", "build_mixer", "list_mixers", "register_mixer", "build_position", "list_positions",
           "register_position", "__version__"]
