"""How the sources of a run's options combine: defaults, then every ``--config`` file and command-line
option in the order given; for every option the last value given wins, wherever it comes from.

jsonargparse (under LightningCLI) does that for plain options and nested dataclasses, with two
exceptions that :class:`mixlab.cli.MixlabCLI` corrects through :func:`install`:

* **nested mixer options.** ``mixer_args`` (``{mixer: {option: value, position_args: {...}}}``) is
  a ``dict`` option, which jsonargparse replaces as a whole: ``--model.init_args.backbone.mixer_args.
  goat.impl reference`` on a config with GOAT ``position_args`` dropped them, a second ``--config``
  setting one GOAT option did the same, and a deeper key (``...goat.position_args.n_modes 1``)
  became the dotted key ``"position_args.n_modes"`` holding the string ``"1"``. Options named in
  :data:`DEEP_MERGED` are deep-merged instead (:func:`deep_merge`): a later source sets only the
  leaves it names; a command-line value is read as YAML (``1`` an int, ``1e-3`` a float, ``true`` a
  bool, ``[2, 2]`` a list, ``null`` None), as in a config file, and a mapping given for a key that
  held a plain value replaces it (the mixer then checks what it receives, e.g. a typo is a one-line
  error naming the options it accepts). The checkpoint's own hyperparameters, which LightningCLI parses
  over the config for ``--ckpt_path FILE``, still replace (see :func:`replacing_dicts`).
* **runtime options at evaluation.** ``validate``/``test``/``--ckpt_path`` build the model from the
  checkpoint's hyperparameters, but options that choose *how* the model computes, not *what*
  (:func:`is_runtime_option`: the kernels, ``impl``/``*_impl``, ``loss_chunk_tokens``, ``loss_kernel``,
  ``compile`` and ``backbone.compile``), keep the config's and command line's values (:func:`keep_runtime_options`):
  a checkpoint trained with a GPU kernel evaluates on a CPU, a memory setting can change.
* **trainer batch counts.** Lightning reads ``limit_val_batches=1`` as one batch and ``1.0`` as all
  of them, but its annotation ``Optional[Union[int, float]]`` reaches jsonargparse as
  ``Union[float, int, None]`` (``typing`` caches Unions by equality and an equal one with float first
  was made earlier; Lightning issue #21259), so ``1`` from a YAML file or the command line became
  ``1.0``. :func:`int_before_float` gives these options the order ``int | float | None``.
"""

from __future__ import annotations

import contextlib
import contextvars
import types
import typing
from typing import Any, Iterator

__all__ = ["DEEP_MERGED", "deep_merge", "install", "replacing_dicts", "int_before_float", "changed_leaves",
           "changed_values",
           "is_runtime_option", "keep_runtime_options"]

DEEP_MERGED = frozenset({"mixer_args"})
"""Names of ``dict`` options deep-merged across sources (the last part of the option's key)."""

_REPLACE = contextvars.ContextVar("mixlab_replace_dicts", default=False)


def deep_merge(base: dict, update: dict) -> dict:
    """``base`` with ``update`` merged in, recursively: a mapping in both merges key by key, any other
    value of ``update`` (a scalar, a list, ``None``) replaces. Neither argument is modified."""
    out = dict(base)
    for key, value in update.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else value
    return out


def _nested(keys: str, value: Any) -> dict:
    """``{"a": {"b": value}}`` for ``keys="a.b"``."""
    out: Any = value
    for part in reversed(keys.split(".")):
        out = {part: out}
    return out


@contextlib.contextmanager
def replacing_dicts() -> Iterator[None]:
    """Within this block :data:`DEEP_MERGED` options are replaced as a whole again (jsonargparse's
    rule): used while LightningCLI parses a checkpoint's hyperparameters, which describe the trained
    model completely."""
    token = _REPLACE.set(True)
    try:
        yield
    finally:
        _REPLACE.reset(token)


def install() -> None:
    """Make jsonargparse deep-merge the :data:`DEEP_MERGED` options (idempotent).

    Wraps ``jsonargparse``'s ``ActionTypeHint._check_type``, the one step every source's value of a
    typed option passes through (config files, ``--key value``, ``--key.sub value``) with the
    option's previous value at hand.
    """
    from jsonargparse._typehints import ActionTypeHint
    from jsonargparse._util import NestedArg, parse_value_or_config

    original = ActionTypeHint._check_type
    if getattr(original, "_mixlab_deep_merge", False):
        return

    def _check_type(self, value, append=False, cfg=None, mode=None):
        name = self.dest.rpartition(".")[2]
        if name not in DEEP_MERGED or cfg is None or _REPLACE.get():
            return original(self, value, append=append, cfg=cfg, mode=mode)
        prev = cfg.get(self.dest)
        if isinstance(value, NestedArg):  # --...mixer_args.goat.position_args.n_modes 1
            # jsonargparse hands a command-line null (or ~) over as the string "None"; a quoted YAML string
            # ('"reference"') is that string, as in a config file (jsonargparse keeps a str value's quotes)
            text = value.val
            if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
                import yaml

                loaded = yaml.safe_load(text)
            else:
                loaded = None if text == "None" else parse_value_or_config(text, enable_path=False,
                                                                           simple_types=True)[0]
            value = _nested(value.key, loaded)
        out = original(self, value, append=append, cfg=cfg, mode=mode)
        return deep_merge(prev, out) if isinstance(prev, dict) and isinstance(out, dict) else out

    _check_type._mixlab_deep_merge = True  # type: ignore[attr-defined]
    ActionTypeHint._check_type = _check_type


def _int_first(hint: Any) -> Any:
    """``hint`` with ``int`` moved before ``float`` when it is a Union holding both, else ``hint``."""
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        return hint
    args = typing.get_args(hint)
    if int not in args or float not in args or args.index(int) < args.index(float):
        return hint
    ordered = tuple(a for a in args if a is int) + tuple(a for a in args if a is not int)
    return typing.Union[ordered]  # a flat tuple: cached by its own order, not by an equal nested Union


def int_before_float(parser: Any, prefix: str = "trainer.") -> list[str]:
    """Give every option of ``parser`` under ``prefix`` typed as a Union of ``int`` and ``float`` the
    order int first, so ``1`` stays the int 1 (one batch) and ``1.0`` the float (all batches), from a
    YAML file or the command line alike. Returns the keys changed."""
    from jsonargparse._typehints import ActionTypeHint

    changed = []
    for action in parser._actions:
        hint = getattr(action, "_typehint", None)
        if isinstance(action, ActionTypeHint) and action.dest.startswith(prefix) and _int_first(hint) is not hint:
            action._typehint = _int_first(hint)
            changed.append(action.dest)
    return changed


def _leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b": leaf}`` of a nested Namespace / dict (jsonargparse's ``Namespace`` or plain dicts)."""
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    if not isinstance(value, dict):
        return {prefix: value}
    out: dict[str, Any] = {}
    for key, sub in value.items():
        if not str(key).startswith("__"):
            out.update(_leaves(sub, f"{prefix}.{key}" if prefix else str(key)))
    return out


def changed_values(before: Any, after: Any) -> dict[str, tuple[str, str]]:
    """``{key: (repr of old, repr of new or "unset")}`` for every leaf of ``before`` whose value differs in ``after``
    or is gone there (nested Namespaces or dicts; keys dotted, ``init_args.`` left out)."""
    old, new = _leaves(before), _leaves(after)
    return {k.replace("init_args.", ""): (repr(old[k]), repr(new[k]) if k in new else "unset")
            for k in old if k not in new or not _same(old[k], new[k])}


def changed_leaves(before: Any, after: Any) -> list[str]:
    """``"key: old -> new"`` for every leaf of ``before`` whose value differs in ``after`` or is gone
    there (``-> unset``) (:func:`changed_values`), sorted."""
    return sorted(f"{k}: {old} -> {new}" for k, (old, new) in changed_values(before, after).items())


def _same(a: Any, b: Any) -> bool:
    """``a == b``, with NaN equal to NaN (a config's ``.nan`` is not a change)."""
    return a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


def is_runtime_option(key: str) -> bool:
    """Whether the dotted model option ``key`` chooses how the model computes rather than what: a
    kernel or code path (a last part named ``impl`` or ending in ``_impl``), ``loss_chunk_tokens``,
    ``loss_kernel``, ``compile`` (the LM's whole-model one) or the backbone's ``compile``. Same values up to
    rounding whichever is set."""
    last = key.rsplit(".", 1)[-1]
    return (last == "impl" or last.endswith("_impl") or last in ("loss_chunk_tokens", "loss_kernel")
            or key.endswith("backbone.compile") or key in ("compile", "init_args.compile"))


def _set_leaf(value: Any, key: str, leaf: Any) -> None:
    """Set the dotted ``key`` of a nested Namespace / dict to ``leaf``; missing dicts on the way are made."""
    *path, last = key.split(".")
    for part in path:
        if isinstance(value, dict):
            if value.get(part) is None:
                value[part] = {}
            value = value[part]
        else:
            value = getattr(value, part)
    if isinstance(value, dict):
        value[last] = leaf
    else:
        setattr(value, last, leaf)


def keep_runtime_options(before: Any, after: Any, mixers: set[str] | None = None) -> list[str]:
    """Put back into ``after`` (in place) every runtime option (:func:`is_runtime_option`) that ``before``
    sets and ``after`` changed or lacks. A mixer's option (``...mixer_args.<name>....``) that ``after``
    lacks is added only for the mixers in ``mixers`` (the model's pattern; None: any): a checkpoint
    trained with the defaults records ``mixer_args: {}``. Returns ``"key: value"`` for each one put
    back (dotted, ``init_args.`` left out), sorted."""
    old, new = _leaves(before), _leaves(after)
    kept = []
    for key in sorted(old):
        if not is_runtime_option(key) or (key in new and new[key] == old[key]):
            continue
        if key not in new:
            parts = key.split(".")
            if "mixer_args" not in parts[:-1]:
                continue
            name = parts[parts.index("mixer_args") + 1]
            if mixers is not None and name not in mixers:
                continue
        _set_leaf(after, key, old[key])
        kept.append(f"{key.replace('init_args.', '')}: {old[key]!r}")
    return kept
