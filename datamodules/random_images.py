"""Random images for measuring an image model's training speed through the CLI, without an input pipeline.

:class:`RandomImageDataModule` hands the :class:`~mixlab.heads.vit.ImageClassifier` one fixed batch of N(0, 1)
images (made once, on the training device) with fresh random labels every step: the model's images/s under the
same Lightning loop, precision and callbacks as a real run, i.e. the reference against which an input pipeline is
judged (``perf/images_per_s`` of a run on shards over that of this one). Overlay it on an image config::

    python -m mixlab fit --config configs/vit/goat_imagenet.yaml --config configs/data/random_images.yaml \\
        --trainer.max_steps 250 --trainer.limit_val_batches 0

It measures speed, not learning: the images repeat and carry no signal.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import Tensor

from mixlab.distributed import loader_generator

__all__ = ["RandomImageDataModule"]


class RandomImageDataModule(L.LightningDataModule):
    """Batches ``(images float32 [B, 3, H, W], labels int64 [B])``: the same N(0, 1) images every step (one
    tensor, created on the device at the first batch), labels uniform in ``[0, num_classes)`` from a generator
    seeded by ``seed`` (through a DataLoader, so Lightning's transfer and hooks run as for real data).

    Args:
        num_classes: label range (the head checks it against its own).
        image_size: side in pixels, or ``[H, W]``.
        batch_size: images per step.
        steps_per_epoch: batches per training epoch.
        seed: seed of the labels.

    Raises:
        ValueError: a non-positive argument (names it).
    """

    task_name = "random_images"

    def __init__(self, num_classes: int = 1000, image_size: int | list[int] = 224, batch_size: int = 256,
                 steps_per_epoch: int = 10000, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        sides = list(image_size) if isinstance(image_size, (list, tuple)) else [image_size, image_size]
        for name, value in (("num_classes", num_classes), ("batch_size", batch_size),
                            ("steps_per_epoch", steps_per_epoch), *(("image_size", v) for v in sides)):
            if value is None or value < 1:
                raise ValueError(f"RandomImageDataModule: {name} must be >= 1; got {value!r}")
        if len(sides) != 2:
            raise ValueError(f"RandomImageDataModule: image_size must be an int or [H, W]; got {image_size!r}")
        self.num_classes, self.batch_size, self.steps_per_epoch, self.seed = (num_classes, batch_size,
                                                                             steps_per_epoch, seed)
        self.image_size = self.eval_size = image_size
        self.hw = tuple(sides)
        self._images: Tensor | None = None

    def train_dataloader(self) -> Any:
        gen = torch.Generator().manual_seed(self.seed)
        labels = torch.randint(0, self.num_classes, (self.steps_per_epoch * self.batch_size,), generator=gen)
        return torch.utils.data.DataLoader(labels, batch_size=self.batch_size, drop_last=True,
                                           pin_memory=torch.cuda.is_available(), generator=loader_generator(self.seed))

    def on_after_batch_transfer(self, batch: Tensor, dataloader_idx: int) -> tuple[Tensor, Tensor]:
        """Labels ``[B]`` on the device -> ``(images, labels)`` with the fixed images (made on the first call)."""
        n = batch.shape[0]
        if self._images is None or self._images.device != batch.device or self._images.shape[0] < n:
            gen = torch.Generator().manual_seed(self.seed + 1)
            self._images = torch.randn(max(n, self.batch_size), 3, *self.hw, generator=gen).to(batch.device)
        return self._images[:n], batch
