"""Small training/evaluation helpers shared by several test files."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint


def fit_two_epochs(model: pl.LightningModule, data, tmp_path, ckpt: str | None = None, every: int | None = None):
    """``Trainer(max_epochs=2)`` on CPU without logger or validation; with ``every`` a checkpoint
    ``{step}.ckpt`` in ``tmp_path`` every ``every`` steps; resumes from ``ckpt``. Returns the model."""
    cbs = []
    if every:
        cbs = [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=every, save_top_k=-1, filename="{step}")]
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, callbacks=cbs, enable_checkpointing=bool(every),
                         limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, data, ckpt_path=ckpt)
    return model


def direct_top1(ckpt: str, image_size: int, eval_size: int | None = None, patch_coords: str | None = None,
                batches: int = 2, batch_size: int = 50) -> float:
    """Top-1 (%) of an ImageClassifier checkpoint on the first ``batches`` digits validation batches,
    by a plain forward (the reference for the ``resolution`` command's numbers)."""
    from mixlab.datamodules.digits import DigitsDataModule
    from mixlab.heads.vit import ImageClassifier

    model = ImageClassifier.load_from_checkpoint(ckpt, weights_only=False).eval()
    if patch_coords is not None:
        model.model.patch_coords = patch_coords
    dm = DigitsDataModule(image_size=image_size, eval_size=eval_size, batch_size=batch_size)
    dm.setup()
    hits = n = 0
    for b, (x, y) in enumerate(dm.val_dataloader()):
        if b == batches:
            break
        with torch.no_grad():
            hits += int((model(x).argmax(-1) == y).sum())
        n += len(y)
    return 100 * hits / n
