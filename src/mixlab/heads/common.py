"""Helpers shared by heads: checkpoint-safe hyperparameters."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["as_config", "plain_hparams"]


def as_config(cls: type[T], value: T | dict | None) -> T:
    """Accept a config dataclass, its ``dict`` form (from a checkpoint) or ``None`` (defaults).

    Raises:
        TypeError: for unknown fields (the message names them).
    """
    if value is None:
        return cls()
    if isinstance(value, dict):
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(value) - fields
        if unknown:
            raise TypeError(f"{cls.__name__}: unknown field(s) {sorted(unknown)}; valid: {sorted(fields)}")
        return cls(**value)
    return value


def plain_hparams(module: Any) -> None:
    """Turn dataclass hyperparameters of a LightningModule into dicts, in place.

    Call right after ``self.save_hyperparameters()`` in a head's ``__init__``. Lightning
    restores checkpoints (``fit --ckpt_path``, LightningCLI's hparams parsing) with
    ``torch.load(weights_only=True)``, which refuses pickled custom classes; plain dicts
    load anywhere, and heads accept them back through :func:`as_config`.
    """
    for store in (module._hparams, getattr(module, "_hparams_initial", None)):
        if store is None:
            continue
        for k, v in list(store.items()):
            if dataclasses.is_dataclass(v) and not isinstance(v, type):
                store[k] = dataclasses.asdict(v)
