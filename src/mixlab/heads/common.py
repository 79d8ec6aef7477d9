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

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Lightning's clipping, except under FSDP: Lightning's FSDP precision plugin refuses
        ``gradient_clip_algorithm="norm"``, so the root FSDP module's ``clip_grad_norm_`` clips
        by the global norm over all shards (the same rule as unsharded clipping)."""
        root = getattr(self.trainer.strategy, "model", None)
        if gradient_clip_val and gradient_clip_algorithm in (None, "norm") and hasattr(root, "clip_grad_norm_"):
            root.clip_grad_norm_(gradient_clip_val)
            return
        self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val,
                            gradient_clip_algorithm=gradient_clip_algorithm)

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test")

    def configure_optimizers(self):
        return build_optimizer(self, self.optim_cfg, int(self.trainer.estimated_stepping_batches))
