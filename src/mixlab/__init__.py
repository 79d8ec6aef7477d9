"""mixlab: one mixer core (GOAT attention priors, gated delta rules, MesaNet), several heads, one CLI.

Layout (import only upward): ``ops`` (stateless math, reference + fast paths) ->
``mixers`` (modules, registry) -> ``backbone`` -> ``heads`` (LightningModules);
datamodules live in ``mixlab.datamodules`` (the repo's top-level ``datamodules/``).
"""

from mixlab.coords import Coords
from mixlab.registry import build_mixer, list_mixers, register_mixer

__version__ = "0.1.0"
__all__ = ["Coords", "build_mixer", "list_mixers", "register_mixer", "__version__"]
