"""UCI hand-written digits as a small offline image-classification task.

The embedded default for the ViT head (issue 5) and the image source for the spatial-VQA head.
The data (1,797 real 8x8 digits, pixel values 0-16, CC BY 4.0) ships with the package as
``mixlab/data/uci_digits.csv.gz`` (64 pixel values then the label per row).

Public entry points
- :func:`load_uci_digits` -> ``(images uint8 [N, 8, 8] in 0..255, labels int64 [N])``.
- :class:`DigitsDataModule`: upsampled (bilinear) 3-channel float images ``[B, 3, S, S]`` normalised
  with mean/std 0.5, a fixed seeded train/val/test split, optional random shifts for training.
"""

from __future__ import annotations

import gzip
import importlib.resources
import io
import numbers
from pathlib import Path

import numpy as np
import torch

from mixlab.distributed import ResumableDataModule, check_at_least, check_num_workers, check_seed

__all__ = ["load_uci_digits", "DigitsDataModule", "DigitsDataset"]

_DIGITS_FILE = "uci_digits.csv.gz"


def load_uci_digits(path: str | Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the UCI hand-written digits.

    Args:
        path: a ``.csv`` or ``.csv.gz`` file with 65 integer columns per row (64 pixel values in
            0..16, row-major 8x8, then the label 0..9). ``None`` reads the copy shipped in
            ``mixlab/data/uci_digits.csv.gz``.

    Returns:
        ``images`` uint8 ``[N, 8, 8]`` scaled to 0..255 (``round(v * 255 / 16)``) and ``labels``
        int64 ``[N]`` in 0..9 (N = 1797 for the shipped file).

    Raises:
        FileNotFoundError: the file does not exist.
        IsADirectoryError: ``path`` is a directory.
        ValueError: a row does not have 65 columns, or a pixel/label is out of range (the message
            names the file).
    """
    if path is None:
        ref = importlib.resources.files("mixlab.data") / _DIGITS_FILE
        raw = ref.read_bytes()
        name = f"mixlab/data/{_DIGITS_FILE}"
    else:
        p = Path(path)
        if p.is_dir():
            raise IsADirectoryError(f"UCI digits path is a directory, not a CSV file: {p}")
        if not p.is_file():
            raise FileNotFoundError(f"UCI digits file not found: {p}")
        raw = p.read_bytes()
        name = str(p)
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    try:
        arr = np.loadtxt(io.BytesIO(raw), delimiter=",", dtype=np.int64, ndmin=2)
    except ValueError as exc:
        raise ValueError(f"{name}: cannot parse as integer CSV ({exc})") from exc
    if arr.shape[1] != 65:
        raise ValueError(f"{name}: expected 65 columns (64 pixels + label), got {arr.shape[1]}")
    pix, lab = arr[:, :64], arr[:, 64]
    if pix.min() < 0 or pix.max() > 16:
        raise ValueError(f"{name}: pixel values must be in 0..16, got [{pix.min()}, {pix.max()}]")
    if lab.min() < 0 or lab.max() > 9:
        raise ValueError(f"{name}: labels must be in 0..9, got [{lab.min()}, {lab.max()}]")
    images = torch.from_numpy(np.rint(pix * (255.0 / 16.0)).astype(np.uint8)).view(-1, 8, 8)
    return images, torch.from_numpy(lab.astype(np.int64))


class DigitsDataset(torch.utils.data.Dataset):
    """Upsampled digits as ViT inputs.

    Args:
        images: uint8 ``[N, 8, 8]`` (from :func:`load_uci_digits`).
        labels: int64 ``[N]``.
        image_size: output side ``S`` (int) or ``(H, W)``; bilinear upsampling of the 8x8 image.
        augment: random integer shifts of up to ``max_shift`` pixels (at output resolution,
            zero padded) - a light training augmentation.

    Items: ``(x float32 [3, H, W] normalised to about [-1, 1], y int64 scalar)``.
    """

    def __init__(self, images, labels, image_size=32, augment=False, max_shift=None):
        self.images = images
        self.labels = labels
        self.size = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        self.augment = augment
        self.max_shift = max(1, self.size[0] // 8) if max_shift is None else int(max_shift)
        x = images.float().div(255.0).unsqueeze(1)  # [N, 1, 8, 8]
        x = torch.nn.functional.interpolate(x, size=self.size, mode="bilinear", align_corners=False)
        self._x = ((x - 0.5) / 0.5).expand(-1, 3, -1, -1).contiguous()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        x = self._x[i]
        if self.augment and self.max_shift > 0:
            dy, dx = torch.randint(-self.max_shift, self.max_shift + 1, (2,)).tolist()
            x = torch.roll(x, shifts=(dy, dx), dims=(1, 2))
            # zero (= background, -1 after normalisation) the wrapped-around rows/columns
            if dy > 0:
                x[:, :dy] = -1.0
            elif dy < 0:
                x[:, dy:] = -1.0
            if dx > 0:
                x[:, :, :dx] = -1.0
            elif dx < 0:
                x[:, :, dx:] = -1.0
        return x, self.labels[i]


class DigitsDataModule(ResumableDataModule):
    """UCI digits (real 8x8 handwriting) upsampled to ``image_size`` for the ViT head.

    Args:
        image_size: training resolution (int or ``[H, W]``); must be divisible by the model's
            patch size (checked by the model).
        eval_size: validation/test resolution (defaults to ``image_size``); the resolution
            evaluation overrides it per resolution.
        batch_size: per-device batch size (keep even when Mixup/CutMix is on).
        val_fraction / test_fraction: seeded split fractions (train gets the rest).
        seed: split seed.
        augment: random shifts for training.
        num_workers: DataLoader workers.
        path: optional CSV file instead of the shipped copy.

    Attributes: ``task_name = "digits"``, ``num_classes = 10``, ``in_chans = 3``.

    Raises:
        ValueError: split fractions out of range; ``image_size`` / ``eval_size`` not an int or ``[H, W]``
            (``image_size must be an int or [H, W]; got [32, 32, 32]``) or below 1 pixel; ``batch_size`` below
            1; ``num_workers`` outside ``[0, 64]`` (:func:`~mixlab.distributed.check_num_workers`);
            ``path`` empty or a directory. At ``setup``: as :func:`load_uci_digits` (a missing or bad file).

    Under DDP rank r of W reads images r::W of one seeded order and the train position is
    saved in checkpoints (:class:`mixlab.distributed.ResumableDataModule`); the random
    shifts draw from torch's global generator and are not part of that state.
    """

    split_arguments: tuple[str, ...] = ("seed", "val_fraction", "test_fraction")
    """The seeded split fractions."""

    task_name = "digits"
    num_classes = 10
    in_chans = 3

    def __init__(
        self,
        image_size: int | list[int] = 32,
        eval_size: int | list[int] | None = None,
        batch_size: int = 64,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        seed: int = 0,
        augment: bool = True,
        num_workers: int = 0,
        path: str | None = None,
    ):
        super().__init__()
        self.save_hyperparameters()
        # val_fraction 0: no val split (fit with --trainer.limit_val_batches 0; cli.ValSplitCheck)
        if not (0 <= val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
            raise ValueError(f"DigitsDataModule: data.init_args.val_fraction and test_fraction must be in [0, 1) "
                             f"and their sum < 1; got val_fraction={val_fraction}, "
                             f"test_fraction={test_fraction}")  # a negative one put val images into train
        is_size = lambda v: isinstance(v, int) or (  # noqa: E731
            isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, numbers.Integral) for x in v))
        for name, size in (("image_size", image_size), ("eval_size", eval_size)):  # [32, 32, 32]: a TypeError later
            if size is not None and not is_size(size):
                shown = list(size) if isinstance(size, tuple) else size
                raise ValueError(f"{name} must be an int or [H, W]; got {shown}")
        smallest = lambda size: None if size is None else min([size] if isinstance(size, int) else size)  # noqa: E731
        check_at_least(image_size=(smallest(image_size), 1), eval_size=(smallest(eval_size), 1),
                       batch_size=(batch_size, 1))
        check_num_workers(num_workers)
        check_seed(seed)
        if path is not None and not str(path).strip():  # Path("") is "."
            raise ValueError(f"path must name a CSV file (null: the shipped digits); got {str(path)!r}")
        if path is not None and Path(path).is_dir():
            raise ValueError(f"path must name a CSV file, not a directory; got {path} (a directory)")
        self.image_size = image_size
        self.eval_size = image_size if eval_size is None else eval_size
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.seed = seed
        self.augment = augment
        self.num_workers = num_workers
        self.path = path
        self._splits = None

    def _split(self):
        if self._splits is None:
            images, labels = load_uci_digits(self.path)
            g = torch.Generator().manual_seed(self.seed)
            perm = torch.randperm(len(labels), generator=g)
            n_val = int(round(len(labels) * self.val_fraction))
            n_test = int(round(len(labels) * self.test_fraction))
            idx = {"val": perm[:n_val], "test": perm[n_val:n_val + n_test],
                   "train": perm[n_val + n_test:]}
            self._splits = {k: (images[v], labels[v]) for k, v in idx.items()}
        return self._splits

    def setup(self, stage: str | None = None) -> None:
        self._split()

    def _loader(self, split: str, size, shuffle: bool, augment: bool, drop_last: bool = False):
        ims, labs = self._split()[split]
        ds = DigitsDataset(ims, labs, size, augment=augment)
        return self.resumable_loader(ds, self.batch_size, shuffle, seed=self.seed,
                                     num_workers=self.num_workers, drop_last=drop_last)

    def train_dataloader(self):
        # drop_last keeps every batch even (timm Mixup asserts an even batch)
        return self._loader("train", self.image_size, True, self.augment, drop_last=True)

    def val_dataloader(self):
        return self._loader("val", self.eval_size, False, False)

    def test_dataloader(self):
        return self._loader("test", self.eval_size, False, False)
