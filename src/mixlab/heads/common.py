"""The base class of every head, and checkpoint-safe hyperparameters."""

from __future__ import annotations

import dataclasses
import random
from typing import Any, TypeVar

import lightning.pytorch as pl
import numpy as np
import torch

from mixlab.distributed import (
    ResumableDataModule,
    as_batch_end_checkpoint,
    check_validation_on_optimizer_steps,
    fit_progress,
)
from mixlab.optim import OptimConfig, build_optimizer

T = TypeVar("T")

__all__ = ["Head", "CHECKPOINT_KEY", "RNG_KEY", "rng_states", "set_rng_states", "run_record", "as_config",
           "plain_hparams", "qualname", "float_logits"]

CHECKPOINT_KEY = "mixlab"
"""Key of the run record every head writes into its checkpoints (see :func:`run_record`)."""

RNG_KEY = "mixlab_rng"
"""Key of the random-number states every head writes into its checkpoints (see :func:`rng_states`)."""


def rng_states(device: torch.device | None = None) -> dict[str, Any]:
    """The global random-number states a training step draws from: torch's CPU generator, ``device``'s CUDA
    generator (dropout, stochastic depth on a GPU), NumPy's (timm's Mixup / CutMix) and Python's ``random``.
    Tensors and plain Python values only, so a checkpoint holding them loads with ``weights_only=True``."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                           "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                                     "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    if device is not None and device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def set_rng_states(states: dict[str, Any], device: torch.device | None = None) -> None:
    """Restore :func:`rng_states`; a CUDA state is applied only on a CUDA ``device``."""
    torch.set_rng_state(states["torch"])
    version, internal, gauss_next = states["python"]
    random.setstate((version, tuple(internal), gauss_next))
    n = states["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in states and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)


def float_logits(logits: Any) -> Any:
    """Logits in float32 for half-precision models (bf16/fp16 activations), float64 kept for float64
    models (a float32 step would make float64 references depend on the CPU's kernels)."""
    return logits if logits.dtype == torch.float64 else logits.float()


def qualname(obj: Any) -> str:
    """``"package.module.Class"`` of an object's class (what :func:`mixlab.eval.common.import_class` reads)."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def run_record(head: pl.LightningModule, datamodule: Any = None) -> dict[str, Any]:
    """What a checkpoint needs to rebuild its run: ``{"head": class path, "data": datamodule class
    path or None, "data_args": the datamodule's hyperparameters}`` (plain values; keys starting
    with ``_``, LightningCLI's bookkeeping, left out). Read back by :func:`mixlab.eval.common.load_run`."""
    args = dict(getattr(datamodule, "hparams", None) or {}) if datamodule is not None else {}
    return {"head": qualname(head), "data": qualname(datamodule) if datamodule is not None else None,
            "data_args": {k: v for k, v in args.items() if not str(k).startswith("_")}}


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


class Head(pl.LightningModule):
    """Base class of every mixlab head (input embedding -> backbone -> task output, loss, metrics).

    A new head subclasses ``Head`` and writes four methods:

    * ``forward(...)``: the model;
    * ``training_step(batch, batch_idx) -> loss`` (logs ``train/...``);
    * ``_eval_step(batch, stage)``: accumulate exact metric sums of one batch for ``stage``
      (``"val"`` or ``"test"``);
    * ``_eval_epoch_end(stage)``: log ``<stage>/...`` from the sums and reset them.

    and sets ``self.optim_cfg`` (:class:`~mixlab.optim.OptimConfig`) and ``self.run_name`` (the
    run directory name, e.g. :func:`mixlab.backbone.pattern_name` of its mixer pattern) in
    ``__init__``. Optional: ``batch_tokens(batch) -> int`` (the throughput unit; default
    ``batch.numel()``) and ``setup(stage)`` reading the datamodule through :meth:`data_attr`
    (the attributes heads read are listed in :mod:`mixlab.datamodules`).

    Provided here: the validation/test steps and epoch ends, AdamW with warmup + cosine,
    gradient clipping that also works under FSDP, the datamodule accessor, the run record
    ``checkpoint["mixlab"]`` (:func:`run_record`) that the evaluation commands read, and exact
    resume: checkpoints resume where training stopped (also a run stopped at ``max_steps`` and
    extended), validations inside a gradient-accumulation cycle are refused, and ``validate``/``test``
    from a checkpoint log at its global step. A subclass overriding ``on_save_checkpoint``,
    ``on_load_checkpoint``, ``on_fit_start`` or ``on_train_start`` calls ``super()``.
    """

    optim_cfg: OptimConfig
    run_name: str

    # ------------------------------------------------------------------ logging
    def log_train_loss(self, loss: torch.Tensor) -> None:
        """Logs ``train/loss`` (the mean over ranks under DDP), not as a progress-bar metric: Lightning reads
        those to a Python number after every training step, a device sync per step, which keeps the host from
        queueing the next step while the device runs this one (and, with several runs sharing one GPU, makes
        each waiting process hold a CPU core). The CLI's bar (:class:`mixlab.callbacks.LossProgressBar`) shows
        it without a wait; the logger gets it every ``log_every_n_steps`` steps."""
        self.log("train/loss", loss, sync_dist=True)

    # ------------------------------------------------------------------ the datamodule
    @property
    def data(self) -> Any:
        """The datamodule attached to the trainer, or None (no trainer: a plain forward or an
        evaluation command)."""
        return getattr(self._trainer, "datamodule", None) if self._trainer is not None else None

    def data_attr(self, name: str, default: Any = None) -> Any:
        """Attribute ``name`` of the attached datamodule, else ``default`` (also without a datamodule)."""
        return getattr(self.data, name, default)

    # ------------------------------------------------------------------ evaluation
    def _eval_step(self, batch: Any, stage: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement _eval_step(batch, stage)")

    def _eval_epoch_end(self, stage: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement _eval_epoch_end(stage)")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test")

    def on_fit_start(self) -> None:
        """Compile options without effect on this device are said once here, before the progress bars (said
        from the first step, the line landed inside the bar): every submodule's ``compile_notice(device)``, the
        model's own included. Forgets the epoch of an earlier fit's last batch (:meth:`on_train_batch_start`)."""
        self.__dict__.pop("_batch_epoch", None)
        for module in self.modules():
            notice = getattr(module, "compile_notice", None)
            if callable(notice):
                notice(self.device)

    # ------------------------------------------------------------------ optimisation
    def on_train_start(self) -> None:
        """Refuse validations (where checkpoints are written) inside a gradient-accumulation cycle
        (:func:`mixlab.distributed.check_validation_on_optimizer_steps`)."""
        check_validation_on_optimizer_steps(self.trainer)

    def configure_optimizers(self):
        return build_optimizer(self, self.optim_cfg, int(self.trainer.estimated_stepping_batches))

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

    # ------------------------------------------------------------------ checkpoints
    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """``validate``/``test`` from a checkpoint log at the checkpoint's ``global_step``: Lightning logs
        epoch-level metrics at the fit loop's ``_batches_that_stepped``, which only ``fit`` restores, so
        they landed at step 0 of the training run's TensorBoard curve (the final value drawn first).
        A :class:`~mixlab.distributed.ResumableDataModule` gets the datamodule arguments the checkpoint
        records (``checkpoint["mixlab"]["data_args"]``, else Lightning's ``datamodule_hyper_parameters``;
        none for a checkpoint of another datamodule class) as ``checkpoint_hparams``, so a resume whose
        data settings changed names the options (:meth:`~mixlab.distributed.ResumableDataModule.resumable_loader`)."""
        trainer = self._trainer
        if trainer is not None and trainer.state.fn in ("validate", "test"):
            trainer.fit_loop.epoch_loop._batches_that_stepped = int(checkpoint.get("global_step", 0))
        data = self.data
        if isinstance(data, ResumableDataModule):
            record = checkpoint.get(CHECKPOINT_KEY) or {}
            args = record.get("data_args") if "data_args" in record else checkpoint.get("datamodule_hyper_parameters")
            same = record.get("data") in (None, qualname(data))
            data.checkpoint_hparams = dict(args) if same and isinstance(args, dict) else None
        if trainer is not None and trainer.state.fn == "fit" and RNG_KEY in checkpoint:
            self.__dict__["_rng_pending"] = checkpoint[RNG_KEY]  # applied at the first training batch

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Remember the epoch this batch belongs to (the number Lightning gives the samplers' ``set_epoch``), for
        the checkpoints written after it (:func:`mixlab.distributed.as_batch_end_checkpoint`). The first batch
        of a resumed fit first restores the checkpoint's random-number states (:func:`set_rng_states`): set
        here, not at loading, so that what runs in between (a DataLoader iterator draws its base seed from
        torch's generator) does not move them, and the model's own draws (Mixup / CutMix, dropout, stochastic
        depth) continue as in the uninterrupted run."""
        pending = self.__dict__.pop("_rng_pending", None)
        if pending is not None:
            set_rng_states(pending, self.device)
        self.__dict__["_batch_epoch"] = fit_progress(self.trainer)[0]

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Record the head class and the datamodule (class and arguments): ``checkpoint["mixlab"]``; the
        global random-number states (:func:`rng_states`, ``checkpoint["mixlab_rng"]``); the loops' progress as
        at the last batch's end, so resuming continues where training stopped
        (:func:`mixlab.distributed.as_batch_end_checkpoint`)."""
        checkpoint[CHECKPOINT_KEY] = run_record(self, self.data)
        checkpoint[RNG_KEY] = rng_states(self.device)
        as_batch_end_checkpoint(self._trainer, checkpoint, self.__dict__.get("_batch_epoch"))
