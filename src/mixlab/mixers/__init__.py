"""Sequence mixers and attention position schemes. Importing this package registers every built-in one.

One file per family; register with ``@register_mixer("name")`` (a position scheme with
``@register_position("name")``, see :mod:`mixlab.mixers.positions`) and add the import here.
"""

import inspect
from typing import Any

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
from mixlab.registry import MIXERS, POSITIONS, load_plugins

build_mixer, list_mixers, get_mixer_cls = MIXERS.build, MIXERS.names, MIXERS.get
build_position, list_positions = POSITIONS.build, POSITIONS.names

__all__ = ["Mixer", "SubLayer", "Attention", "PositionScheme", "build_mixer", "list_mixers", "get_mixer_cls",
           "build_position", "list_positions", "mixer_options", "main"]


def _yaml_value(value: Any) -> Any:
    """A default as YAML can write it (tuples as lists; other objects by ``repr``)."""
    if isinstance(value, (list, tuple)):
        return [_yaml_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _yaml_value(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def mixer_options(name: str) -> dict[str, Any]:
    """The options of mixer ``name`` with their defaults, as a ``mixer_args`` entry. Options the name
    itself sets (e.g. ``deltanet``'s ``decay: none``, ``goat``'s ``position: goat``) are left out: another
    value makes another layer under the same name (:meth:`mixlab.registry.Registry.build` warns). An
    attention mixer's ``position_args`` hold its position scheme's options (``position_args: {}`` in a
    config means these). Required options (none today) read ``"<required>"``.

    Raises:
        ValueError: unknown mixer (the message lists the registered ones).
    """
    bound = MIXERS.defaults(name)
    opts = MIXERS.option_defaults(name)
    scheme = opts.get("position")
    if "position_args" in opts and isinstance(scheme, str) and scheme in POSITIONS:
        opts["position_args"] = POSITIONS.option_defaults(scheme)
    return {k: "<required>" if v is inspect.Parameter.empty else _yaml_value(v) for k, v in opts.items()
            if k not in bound}


def main(argv: list[str] | None = None) -> str:
    """``python -m mixlab mixers [NAME ...]``: the registered mixers, or the named mixers' options with
    their defaults as a ``mixer_args:`` block to paste into a config (``--print_config`` shows only the
    options a config sets: ``mixer_args: {}`` when it keeps every default). Returns the printed text.

    Raises:
        ValueError: an unknown mixer name (one line, listing the registered ones).
    """
    import argparse

    import yaml

    p = argparse.ArgumentParser(prog="python -m mixlab mixers",
                                description="List the registered mixers, or print the named mixers' options with "
                                            "their defaults as a mixer_args block to paste into a config.")
    p.add_argument("names", nargs="*", help="mixers whose options to show (default: list every mixer)")
    args = p.parse_args(argv)
    load_plugins()
    if not args.names:
        width = max(map(len, MIXERS.names()))
        lines = []
        for name in MIXERS.names():
            cls = MIXERS.get(name)
            doc = (inspect.getdoc(cls) or "").split("\n")[0]
            bound = ", ".join(f"{k}={v!r}" for k, v in MIXERS.defaults(name).items())
            lines.append(f"{name:<{width}}  {cls.__module__}.{cls.__qualname__}" + (f" ({bound})" if bound else "")
                         + (f": {doc}" if doc else ""))
        text = "\n".join(lines) + "\n\noptions and defaults of one: python -m mixlab mixers NAME\n"
    else:
        parts = ["mixer_args:"]
        for name in args.names:
            entry = yaml.safe_dump({name: mixer_options(name)}, sort_keys=False)
            bound = MIXERS.defaults(name)
            if bound:
                fixed = ", ".join(f"{k}: {yaml.safe_dump(v).splitlines()[0]}" for k, v in bound.items())
                parts.append(f"  # {name} sets {fixed} by its name (another value warns: it makes another "
                             f"layer under this name)")
            parts += ["  " + line for line in entry.splitlines()]
        text = "\n".join(parts) + "\n"
    print(text, end="")
    return text
