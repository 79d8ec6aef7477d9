"""Registries of named components: mixers and attention position schemes.

A leaf module: it imports nothing of mixlab, so any layer can register into it without an
import cycle. The packages gather their entries (``mixlab.mixers`` imports every built-in
mixer and position scheme, and ``import mixlab`` imports ``mixlab.mixers``), as timm's
``timm.models`` gathers its models.

Adding a mixer is one file under ``mixlab/mixers/`` with a class decorated
``@register_mixer("name")`` (plus an import line in ``mixlab/mixers/__init__.py``); every
registered mixer is built with the same keyword contract::

    cls(d_model=..., n_heads=..., causal=..., layer_idx=..., n_layers=..., **mixer_args)

and obeys :class:`mixlab.mixers.base.Mixer`'s ``forward(x, coords, cache)``. A position
scheme is one class decorated ``@register_position("name")``, built as
``cls(n_heads=..., head_dim=..., causal=..., **position_args)``.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import logging
import math
import operator
import os
import types
import typing
from importlib.metadata import entry_points
from typing import Any, Callable, Literal

__all__ = ["Registry", "closest", "did_you_mean", "MIXERS", "POSITIONS", "register_mixer", "register_position",
           "get_mixer_cls", "list_mixers", "build_mixer", "load_plugins", "PLUGIN_GROUP", "PLUGIN_ENV"]

PLUGIN_GROUP = "mixlab.plugins"
"""Entry-point group whose modules the CLI imports first (your package's mixers and schemes register)."""
PLUGIN_ENV = "MIXLAB_IMPORT"
"""Environment variable: comma-separated modules the CLI imports first (no packaging needed)."""


def load_plugins(env: str | None = None) -> list[str]:
    """Import the modules that register a user's own mixers and position schemes, so that the CLI
    (``python -m mixlab fit ... --model.init_args.backbone.mixer my_mixer``) and every command that
    rebuilds a model from a checkpoint finds them: the entry points of group :data:`PLUGIN_GROUP`
    (``[project.entry-points."mixlab.plugins"] my_pkg = "my_pkg.mixers"`` in your pyproject.toml),
    then the modules named in ``$MIXLAB_IMPORT`` (``env`` overrides it; comma-separated, imported
    from ``sys.path``, which includes the working directory under ``python -m``).

    Returns:
        the module names imported, in order.

    Raises:
        ImportError: a module that cannot be imported, naming its source (the variable or the entry
            point) and the cause, in one line.
    """
    env = os.environ.get(PLUGIN_ENV, "") if env is None else env
    names = [(f"entry point {ep.name!r} of {PLUGIN_GROUP}", ep.value.split(":")[0])
             for ep in entry_points(group=PLUGIN_GROUP)]
    names += [(f"{PLUGIN_ENV}={env}", n.strip()) for n in env.split(",") if n.strip()]
    for source, name in names:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - any failure of the user's module is reported in one line
            raise ImportError(f"{source}: cannot import {name!r}: {type(err).__name__}: {err}") from err
    return [n for _, n in names]



def closest(word: str, candidates: list[str]) -> str | None:
    """The candidate nearest to a misspelt ``word`` (:func:`difflib.get_close_matches`, cutoff 0.6, letter case
    ignored: ``LAST`` -> ``last``), or None: the "did you mean" of every error about an unknown name."""
    lowered = {str(c).lower(): c for c in reversed(candidates)}  # the first of candidates equal but for case
    hits = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[hits[0]] if hits else None


def did_you_mean(words: list[str], candidates: list[str]) -> str:
    """``"; did you mean 'a' for 'b'?"`` for each of ``words`` that has a :func:`closest` candidate, joined (``""``
    when none has): the tail of an error about unknown names."""
    return "".join(f"; did you mean {near!r} for {w!r}?" for w in words if (near := closest(w, candidates)))


_BOUND_TESTS: dict[str, Callable[[float, float], bool]] = {">": operator.gt, ">=": operator.ge, "<": operator.lt,
                                                           "<=": operator.le}
"""The comparisons an entry's ``arg_bounds`` may use (NaN fails every one)."""


@functools.cache
def _constructor_hints(cls: type) -> dict[str, Any]:
    """``cls.__init__``'s resolved annotations (once per class; ``{}`` where one does not resolve)."""
    try:
        return typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: nothing to check against
        return {}


def _plain_types(hint: Any) -> list[Any] | None:
    """The plain types an annotation allows (``int | None`` -> ``[int, NoneType]``; each ``Literal`` value as a
    ``Literal`` of one), or None when it has any other part (lists, tensors, classes: left to the class)."""
    parts = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    out: list[Any] = []
    for t in parts:
        if t in (int, float, bool, str, type(None)):
            out.append(t)
        elif typing.get_origin(t) is Literal:
            out.extend(Literal[v] for v in typing.get_args(t))
        else:
            return None
    return out


def _matches(value: Any, t: Any) -> bool:
    """Whether ``value`` is of the plain type ``t`` as a config writes it (an int is a float; a bool is not an int)."""
    if typing.get_origin(t) is Literal:
        return value == t.__args__[0] and type(value) is type(t.__args__[0])
    if t is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if t is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, t)


class Registry:
    """Name -> class, with bound default arguments per name and one checked way to build.

    Args:
        kind: what the entries are (``"mixer"``), used in messages.
        label: how messages name an entry's arguments, a format string with ``{name}``
            (``"mixer {name!r}"``, ``"position_args of {name!r}"``).
        word: what one argument is called in messages (``"argument"``, ``"key"``).
        contract: keywords every entry receives from its caller (not user options): left
            out of the "it accepts" list of an unknown-argument error.
        positive: contract keywords that must be integers >= 1.
        nested: ``(holder, selector, registry)``: an entry's argument ``holder`` holds the options of the
            ``registry`` entry named by its argument ``selector`` (a mixer's ``position_args`` of its
            ``position`` scheme), for :meth:`check_keys`.
        config_key: where entries' arguments live in a config (``"mixer_args"``), for the place an error points to.
    """

    def __init__(self, kind: str, label: str, word: str = "argument", contract: tuple[str, ...] = (),
                 positive: tuple[str, ...] = (), nested: tuple[str, str, Registry] | None = None,
                 config_key: str | None = None) -> None:
        self.kind = kind
        self.label = label
        self.word = word
        self.contract = contract
        self.positive = positive
        self.nested = nested
        self.config_key = config_key
        self._classes: dict[str, type] = {}
        self._defaults: dict[str, dict[str, Any]] = {}
        self._noted: set[str] = set()

    def register(self, name: str, **defaults: Any) -> Callable[[type], type]:
        """Class decorator registering the class under ``name``.

        ``defaults`` are keyword arguments bound for this name (e.g. the attention class is
        registered as ``rope``, ``alibi``, ``nope`` and ``goat`` with different
        ``position=``); arguments given to :meth:`build` override them (logged once as a warning).

        Raises:
            ValueError: ``name`` is already registered.
        """

        def deco(cls: type) -> type:
            if name in self._classes:
                raise ValueError(f"{self.kind} {name!r} is already registered (by {self._classes[name].__qualname__})")
            self._classes[name] = cls
            self._defaults[name] = dict(defaults)
            return cls

        return deco

    def names(self) -> list[str]:
        """Sorted registered names."""
        return sorted(self._classes)

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def get(self, name: str) -> type:
        """Class registered as ``name``.

        Raises:
            ValueError: unknown name; the message lists the registered ones.
        """
        if name not in self._classes:
            near = closest(str(name), self.names())
            raise ValueError(f"unknown {self.kind} {name!r}; registered {self.kind}s: {', '.join(self.names())}"
                             + (f"; did you mean {near!r}?" if near else ""))
        return self._classes[name]

    def defaults(self, name: str) -> dict[str, Any]:
        """Arguments bound to ``name`` at registration (a copy); ValueError for an unknown name."""
        self.get(name)
        return dict(self._defaults[name])

    def options(self, name: str) -> list[str] | None:
        """Keyword arguments a user may set for ``name`` (constructor parameters minus the
        contract), in signature order; None when the constructor takes ``**kwargs``."""
        params = inspect.signature(self.get(name).__init__).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return None
        return [n for n, p in params.items() if n != "self" and n not in self.contract
                and p.kind is not inspect.Parameter.VAR_POSITIONAL]

    def option_defaults(self, name: str) -> dict[str, Any]:
        """Each user option of ``name`` with the value it takes when a config leaves it out: the
        registration's bound default, else the constructor's (``inspect.Parameter.empty`` for a
        required one). ``{}`` for a constructor taking ``**kwargs``; ValueError for an unknown name."""
        params = inspect.signature(self.get(name).__init__).parameters
        bound = self._defaults[name]
        return {opt: bound.get(opt, params[opt].default) for opt in self.options(name) or []}

    def check_keys(self, name: str, kwargs: dict[str, Any], deep: bool = False,
                   outer: tuple[str, str, list[str]] | None = None) -> None:
        """Refuse arguments ``name`` does not take, whose value is not of a plain annotated type, or not finite or
        out of the class's ``arg_bounds`` (``{"abs_scale": ((">", 0),)}``: each argument's comparisons, ``None``
        exempt)
        (what :meth:`build` checks first; other values are checked by the class). An unknown key that belongs to the
        nested scheme (a ``position_args`` key such as GOAT's ``lane_impl`` given at the mixer's level) is pointed
        to its place. ``deep``: the nested scheme's own keys (``position_args``) are checked too, as the class would
        when built, and a mixer's own argument given there (``position_args.impl``) is pointed back.
        ``outer``: ``(label, place, keys)`` of the entry holding this one, for that pointer.

        Raises:
            ValueError: an unknown ``name``; one line naming the unknown arguments and the accepted ones; one
                line naming an argument whose value is not of its annotated ``int``/``float``/``bool``/``str``
                (or ``Literal``) type, or out of its ``arg_bounds`` (``abs_scale must be finite and > 0; got 0``).
        """
        self.get(name)
        accepted = self.options(name)
        scheme = self._nested_scheme(name, kwargs)
        if accepted is not None:
            unknown = sorted(set(kwargs) - set(accepted) - set(self.contract))
            if unknown:
                accepts = f"it accepts: {', '.join(accepted)}" if accepted else f"it accepts no {self.word}s"
                inner = self._nested_options(scheme)
                holder = self.nested[0] if self.nested else ""
                place = f"{self.config_key}.{name}." if self.config_key else ""
                hints = "".join(f"; {k!r} is a key of {holder}: {place}{holder}.{k}" for k in unknown if k in inner)
                if outer is not None:
                    inner = [*inner, *outer[2]]
                    hints += "".join(f"; {k!r} is an argument of {outer[0]}: {outer[1]}{k}"
                                     for k in unknown if k in outer[2])
                raise ValueError(f"{self.label.format(name=name)} got unknown {self.word}(s) "
                                 f"{', '.join(map(repr, unknown))}; {accepts}{hints}"
                                 f"{did_you_mean([k for k in unknown if k not in inner], list(accepted))}")
        self._check_types(name, kwargs)
        if deep and scheme is not None and isinstance(kwargs.get(self.nested[0]), dict):
            place = f"{self.config_key}.{name}." if self.config_key else ""
            self.nested[2].check_keys(scheme, kwargs[self.nested[0]],
                                      outer=(f"{self.kind} {name!r}", place, list(accepted or [])))

    def _check_types(self, name: str, kwargs: dict[str, Any]) -> None:
        """ValueError naming the first user argument whose value does not match a plain annotation of
        ``name``'s constructor (``int``, ``float``, ``bool``, ``str``, a ``Literal``, or one of them ``| None``;
        other annotations are left to the class), or is not finite or out of the class's ``arg_bounds``."""
        cls = self.get(name)
        hints = _constructor_hints(cls)
        for key, value in kwargs.items():
            if key in self.contract or key not in hints:
                continue
            allowed = _plain_types(hints[key])
            if allowed is not None and not any(_matches(value, t) for t in allowed):
                want = " or ".join(repr(t.__args__[0]) if typing.get_origin(t) is Literal else
                                   "null" if t is type(None) else t.__name__ for t in allowed)
                raise ValueError(f"{self.label.format(name=name)}: {key} must be {want}; got {value!r}")
        bounds = getattr(cls, "arg_bounds", {})
        for key, value in kwargs.items():
            if key in bounds and isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and not (math.isfinite(value) and all(_BOUND_TESTS[op](value, limit) for op, limit in bounds[key])):
                want = " and ".join(f"{op} {limit:g}" for op, limit in bounds[key])
                raise ValueError(f"{self.label.format(name=name)}: {key} must be finite and {want}; got {value!r}")

    def _nested_scheme(self, name: str, kwargs: dict[str, Any]) -> str | None:
        """The registered name of ``name``'s nested scheme (its ``selector`` argument, given or default), or None."""
        if self.nested is None or self.nested[0] not in (self.options(name) or []):
            return None
        selector, registry = self.nested[1], self.nested[2]
        scheme = kwargs.get(selector, self.option_defaults(name).get(selector))
        return scheme if isinstance(scheme, str) and scheme in registry else None

    def _nested_options(self, scheme: str | None) -> list[str]:
        """The user options of the nested scheme ``scheme`` ([] for None)."""
        if scheme is None:
            return []
        registry = self.nested[2]
        return [k for k in registry.options(scheme) or [] if k not in registry.contract]

    def build(self, name: str, /, **kwargs: Any) -> Any:
        """Instantiate ``name`` with its registered defaults updated by ``kwargs``.

        Raises:
            ValueError: unknown ``name``; an argument the class does not take (a typo in a
                config), in one line naming the accepted ones; a ``positive`` contract argument
                that is not an integer >= 1.
        """
        cls = self.get(name)
        self.check_keys(name, kwargs)
        bound = self._defaults[name]
        replaced = {k: v for k, v in kwargs.items() if k in bound and v != bound[k]}
        if replaced:  # e.g. deltanet with decay='scalar' is a GDN layer that still runs under the name deltanet
            note = (f"{self.kind} {name!r}: " + ", ".join(f"{k}={v!r} replaces the {k}={bound[k]!r} its name sets"
                                                          for k, v in replaced.items())
                    + f"; the run is still named after {name!r}")
            if note not in self._noted:  # once per process, not once per layer
                self._noted.add(note)
                logging.getLogger("mixlab.registry").warning(note)
        for arg in self.positive:
            value = kwargs.get(arg)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{self.kind} {name!r}: {arg} must be an integer >= 1; got {value!r}")
        return cls(**{**self._defaults[name], **kwargs})


POSITIONS = Registry("position scheme", "position_args of {name!r}", "key", contract=("n_heads", "head_dim", "causal"))
"""Every attention position scheme (``position:`` / ``position_args:`` of attention mixers)."""

MIXERS = Registry("mixer", "mixer {name!r}", "argument",
                  contract=("d_model", "n_heads", "causal", "layer_idx", "n_layers"), positive=("d_model", "n_heads"),
                  nested=("position_args", "position", POSITIONS), config_key="mixer_args")
"""Every sequence mixer (``mixer:`` / ``mixer_args:`` in configs)."""

register_mixer = MIXERS.register
register_position = POSITIONS.register
get_mixer_cls = MIXERS.get
list_mixers = MIXERS.names
build_mixer = MIXERS.build
