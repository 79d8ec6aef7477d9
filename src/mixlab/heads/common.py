"""Helpers shared by heads: checkpoint-safe hyperparameters and the common Lightning hooks."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from mixlab.optim import build_optimizer

T = TypeVar("T")

__all__ = ["EvalSumsHooks", "as_config", "plain_hparams"]


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


class EvalSumsHooks:
    """Lightning hooks shared by the heads (mixed in before ``LightningModule``).

    A head accumulates exact metric sums in ``*_step`` and implements
    ``_eval_epoch_end(stage)`` to log and reset them; it keeps its optimiser settings in
    ``self.optim_cfg`` (:class:`mixlab.optim.OptimConfig`).
    """

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test")

    def configure_optimizers(self):
        return build_optimizer(self, self.optim_cfg, int(self.trainer.estimated_stepping_batches))
