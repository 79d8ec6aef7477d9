"""mixlab: one mixer core (GOAT attention priors, gated delta rules, MesaNet), several heads, one CLI.

Layout (import only downward): ``ops`` (stateless math, reference + fast paths) ->
``mixers`` (modules; registered in the leaf :mod:`mixlab.registry`) -> ``backbone`` ->
``heads`` (LightningModules) -> ``cli`` and ``eval`` (commands); datamodules live in
``mixlab.datamodules`` (the repo's top-level ``datamodules/``) and never import heads.
Importing ``mixlab`` registers every built-in mixer and position scheme.
"""

import signal as _signal
import sys as _sys


def _terminated_while_starting(signum, frame):
    """SIGTERM while ``python -m mixlab`` imports its libraries: one line and exit status 143 (the default action
    ended the process with no word). :func:`mixlab.cli.main` installs its own handler once it runs. The process
    ends with ``os._exit``: nothing is written yet, and a ``SystemExit`` raised inside a half-imported C extension
    (torch) can abort the interpreter at exit (SIGABRT)."""
    import os

    print("mixlab: SIGTERM while starting: stopped; nothing saved", file=_sys.stderr, flush=True)
    os._exit(128 + _signal.SIGTERM)


def _interrupted_while_starting(signum, frame):
    """Ctrl-C while ``python -m mixlab`` imports its libraries: one line and exit status 130, as later (it was an
    import traceback). :func:`mixlab.cli.main` puts Python's handler back once it runs."""
    import os

    print("mixlab: interrupted (Ctrl-C) while starting", file=_sys.stderr, flush=True)
    os._exit(128 + _signal.SIGINT)


# `python -m mixlab ...`: while the package imports, argv[0] is still "-m"; a library import leaves handlers alone
if _sys.argv[:1] == ["-m"] and _signal.getsignal(_signal.SIGTERM) == _signal.SIG_DFL:
    _signal.signal(_signal.SIGTERM, _terminated_while_starting)
if _sys.argv[:1] == ["-m"] and _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
    _signal.signal(_signal.SIGINT, _interrupted_while_starting)

from mixlab.coords import Coords  # noqa: E402
from mixlab.mixers import build_mixer, build_position, list_mixers, list_positions  # noqa: E402
from mixlab.registry import register_mixer, register_position  # noqa: E402

__version__ = "0.1.0"
__all__ = ["Coords", "build_mixer", "list_mixers", "register_mixer", "build_position", "list_positions",
           "register_position", "__version__"]
