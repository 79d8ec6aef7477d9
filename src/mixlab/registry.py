"""Name -> mixer class registry.

Adding a mixer is one file under ``mixlab/mixers/``, one ``@register_mixer("name")``
decorator on its class (plus an import line in ``mixlab/mixers/__init__.py``), and
one test. Every registered mixer is built with the same keyword contract::

    cls(d_model=..., n_heads=..., causal=..., layer_idx=..., n_layers=..., **mixer_args)

and obeys :class:`mixlab.mixers.base.Mixer`'s ``forward(x, coords, cache)``.
"""

from __future__ import annotations

import inspect

from typing import Any, Callable

__all__ = ["register_mixer", "get_mixer_cls", "list_mixers", "build_mixer"]

_MIXERS: dict[str, type] = {}
_DEFAULTS: dict[str, dict[str, Any]] = {}


def register_mixer(name: str, **defaults: Any) -> Callable[[type], type]:
    """Class decorator registering a mixer under ``name``.

    ``defaults`` are keyword arguments bound for this name (e.g. the attention class
    is registered as ``rope``, ``alibi``, ``nope`` and ``goat`` with different
    ``position=``); user ``mixer_args`` override them.

    Raises:
        ValueError: if ``name`` is already registered.
    """

    def deco(cls: type) -> type:
        if name in _MIXERS:
            raise ValueError(f"mixer {name!r} is already registered (by {_MIXERS[name].__qualname__})")
        _MIXERS[name] = cls
        _DEFAULTS[name] = dict(defaults)
        return cls

    return deco


def _ensure_loaded() -> None:
    import mixlab.mixers  # noqa: F401  (registers the built-in mixers)


def list_mixers() -> list[str]:
    """Sorted names of all registered mixers."""
    _ensure_loaded()
    return sorted(_MIXERS)


def get_mixer_cls(name: str) -> type:
    """Class registered as ``name``.

    Raises:
        ValueError: for an unknown name; the message lists the known ones.
    """
    _ensure_loaded()
    if name not in _MIXERS:
        raise ValueError(f"unknown mixer {name!r}; registered mixers: {', '.join(sorted(_MIXERS))}")
    return _MIXERS[name]


def build_mixer(name: str, **kwargs: Any):
    """Instantiate mixer ``name`` with its registered defaults updated by ``kwargs``.

    Raises:
        ValueError: unknown ``name``; an argument the mixer does not take (a typo in
            ``mixer_args``), naming the accepted ones; ``d_model`` or ``n_heads`` < 1.
    """
    cls = get_mixer_cls(name)
    params = inspect.signature(cls.__init__).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(kwargs) - set(params))
        if unknown:
            accepted = ", ".join(n for n in params if n != "self")
            raise ValueError(f"mixer {name!r} got unknown argument(s) {', '.join(map(repr, unknown))}; "
                             f"it accepts: {accepted}")
    for arg in ("d_model", "n_heads"):
        value = kwargs.get(arg)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"mixer {name!r}: {arg} must be an integer >= 1; got {value!r}")
    return cls(**{**_DEFAULTS[name], **kwargs})
