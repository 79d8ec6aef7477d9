"""ImageNet-style classification data: WebDataset shards (timm's convention) or an ImageFolder tree.

Nothing is downloaded: point the module at shards or folders you already have.

WebDataset convention (timm's reader): shards such as ``/data/imagenet1k-train-{0000..1023}.tar``
(brace patterns; a comma-free list of patterns is also accepted), each sample with ``__key__``,
``jpg`` (encoded image bytes) and ``cls`` (ASCII integer label). Shards are split by node (DDP
rank) and then by DataLoader worker before shuffling, so no sample is read twice; training then
shuffles shards and samples (``shuffle_buffer``). :func:`write_imagefolder_shards` (and
``scripts/make_wds_shards.py``) writes such shards from an ImageFolder tree.

Transforms (timm ``create_transform``):

* train (DeiT recipe): RandomResizedCrop (bicubic, scale 0.08-1), horizontal flip, colour jitter
  0.3, RandAugment ``rand-m9-mstd0.5-inc1``, RandomErasing 0.25 (pixel mode). Mixup/CutMix and
  label smoothing are applied on the model side (:class:`mixlab.heads.vit.ImageClassifier`,
  ``mixup:``) because they change the loss.
* eval at any resolution ``r`` (int or ``[H, W]``): resize the short side to ``floor(r * 256/224)``
  (``crop_pct = 0.875``) then center crop ``r``; non-square ``[H, W]`` keeps the aspect ratio and
  center crops ``H x W``.

Bad input: a missing shard / folder raises FileNotFoundError naming the pattern; fewer shards than
``world_size * num_workers`` raises ValueError (webdataset would hang or yield nothing); a label
outside ``[0, num_classes)`` raises ValueError naming the sample key and shard; a corrupt image is
skipped with a warning that counts the skipped samples (:data:`SKIPPED`).
"""

from __future__ import annotations

import functools
import io
import math
import os
import re
import warnings
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from PIL import Image

__all__ = ["ImageNetDataModule", "expand_shards", "decode_sample", "write_imagefolder_shards", "SKIPPED",
           "eval_transform", "train_transform"]

SKIPPED = {"corrupt": 0}
"""Number of corrupt images skipped so far in this process (each DataLoader worker counts its own)."""

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_REMOTE = re.compile(r"^(pipe:|https?://|gs://|s3://|ais://)")


def expand_shards(pattern: str | list[str], what: str = "shards") -> list[str]:
    """Expand brace patterns (``a-{0000..0009}.tar``; several patterns separated by ``::`` or given as a
    list) to shard URLs and check that local ones exist.

    Raises:
        FileNotFoundError: a local shard does not exist (names ``what``, the pattern and the first missing files).
        ValueError: the pattern expands to nothing.
    """
    import braceexpand

    pats = pattern if isinstance(pattern, (list, tuple)) else str(pattern).split("::")
    urls = [u for p in pats for u in braceexpand.braceexpand(str(p).strip()) if u]
    if not urls:
        raise ValueError(f"{what}: pattern {pattern!r} expands to no shard")
    local = [u[7:] if u.startswith("file://") else u for u in urls if not _REMOTE.match(u)]
    missing = [u for u in local if not os.path.isfile(u)]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise FileNotFoundError(f"{what}: {len(missing)} of {len(urls)} shards from pattern {pattern!r} do not exist, "
                                f"e.g. {missing[:3]}{more}")
    return urls


def decode_sample(sample: dict, num_classes: int, transform=None):
    """``{"__key__", "jpg", "cls"}`` -> ``(image, label)``, or ``None`` for a corrupt image (counted, warned).

    ``image`` is the PIL RGB image passed through ``transform``; ``label`` an int in ``[0, num_classes)``.

    Raises:
        ValueError: missing ``jpg``/``cls`` entry, a non-integer or out-of-range label (names key and shard).
    """
    key, url = sample.get("__key__", "?"), sample.get("__url__", "?")
    img_key = next((k for k in ("jpg", "jpeg", "png", "webp") if k in sample), None)
    if img_key is None or "cls" not in sample:
        raise ValueError(f"sample {key!r} in {url}: expected keys 'jpg' and 'cls' (timm convention); "
                         f"got {sorted(k for k in sample if not k.startswith('__'))}")
    raw = sample["cls"]
    try:
        label = int(raw.decode("ascii").strip() if isinstance(raw, (bytes, bytearray)) else raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"sample {key!r} in {url}: 'cls' is not an integer label ({raw!r})") from exc
    if not 0 <= label < num_classes:
        raise ValueError(f"sample {key!r} in {url}: label {label} is out of range [0, {num_classes}) "
                         f"(num_classes={num_classes})")
    try:
        img = Image.open(io.BytesIO(sample[img_key]))
        img = img.convert("RGB")  # forces the full decode: truncated/corrupt data raises here
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError ... for bad files
        SKIPPED["corrupt"] += 1
        warnings.warn(f"skipped corrupt image {key!r} in {url} ({type(exc).__name__}: {exc}); "
                      f"{SKIPPED['corrupt']} corrupt image(s) skipped so far in this process", RuntimeWarning)
        return None
    return (transform(img) if transform is not None else img), label


def train_transform(size, auto_augment: str | None = "rand-m9-mstd0.5-inc1", re_prob: float = 0.25,
                    color_jitter: float = 0.3, hflip: float = 0.5, scale=(0.08, 1.0),
                    interpolation: str = "bicubic", mean=IMAGENET_MEAN, std=IMAGENET_STD):
    """DeiT/timm training transform (RandomResizedCrop, flip, colour jitter, RandAugment, RandomErasing)."""
    from timm.data import create_transform

    h, w = (size, size) if isinstance(size, int) else tuple(size)
    return create_transform((3, h, w), is_training=True, auto_augment=auto_augment, re_prob=re_prob,
                            re_mode="pixel", re_count=1, color_jitter=color_jitter, hflip=hflip,
                            scale=tuple(scale), interpolation=interpolation, mean=mean, std=std)


def eval_transform(size, crop_pct: float = 224 / 256, interpolation: str = "bicubic", mean=IMAGENET_MEAN, std=IMAGENET_STD):
    """Resize the short side to ``floor(size / crop_pct)`` (= ``size * 256/224``) then center crop ``size``."""
    from timm.data import create_transform

    h, w = (size, size) if isinstance(size, int) else tuple(size)
    return create_transform((3, h, w), is_training=False, crop_pct=crop_pct, crop_mode="center",
                            interpolation=interpolation, mean=mean, std=std)


class ImageNetDataModule(pl.LightningDataModule):
    """ImageNet (or any ImageNet-format classification set) as WebDataset shards or ImageFolder trees.

    Args:
        format: ``"wds"`` (shards, ``*_path`` are brace patterns) or ``"folder"`` (``*_path`` are
            ImageFolder roots ``<root>/<class>/<image>``).
        train_path / val_path / test_path: data locations (test defaults to val).
        num_classes: labels must lie in ``[0, num_classes)``.
        image_size: training resolution (int or ``[H, W]``).
        eval_size: evaluation resolution (default ``image_size``); the resolution-transfer
            evaluation overrides it.
        batch_size: per-device batch size (training batches are full: drop_last, even for Mixup).
        eval_batch_size: per-device eval batch size (default ``batch_size``).
        num_workers: DataLoader workers per device.
        shuffle_buffer: sample shuffle buffer (WebDataset training); shard_shuffle: shard buffer.
        train_samples: samples per epoch over all ranks (ImageNet-1k: 1,281,167). For shards it
            sets a fixed per-worker epoch length (timm/webdataset ``with_epoch`` on a repeating
            stream) so every rank runs the same number of steps under DDP; ``None`` = one pass.
        crop_pct, interpolation, auto_augment, re_prob, color_jitter, hflip, scale: transforms.
        seed: shuffle seed.
        persistent_workers: keep training DataLoader workers alive between epochs.
    """

    task_name = "imagenet"
    in_chans = 3

    def __init__(
        self,
        format: Literal["wds", "folder"] = "wds",
        train_path: str | None = None,
        val_path: str | None = None,
        test_path: str | None = None,
        num_classes: int = 1000,
        image_size: int | list[int] = 224,
        eval_size: int | list[int] | None = None,
        batch_size: int = 128,
        eval_batch_size: int | None = None,
        num_workers: int = 8,
        shuffle_buffer: int = 5000,
        shard_shuffle: int = 100,
        train_samples: int | None = 1281167,
        crop_pct: float = 224 / 256,
        interpolation: str = "bicubic",
        auto_augment: str | None = "rand-m9-mstd0.5-inc1",
        re_prob: float = 0.25,
        color_jitter: float = 0.3,
        hflip: float = 0.5,
        scale: tuple[float, float] = (0.08, 1.0),
        seed: int = 0,
        persistent_workers: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if format not in ("wds", "folder"):
            raise ValueError(f"ImageNetDataModule: format must be 'wds' or 'folder'; got {format!r}")
        if batch_size % 2:
            warnings.warn(f"ImageNetDataModule: batch_size={batch_size} is odd; timm Mixup needs even batches")
        self.format = format
        self.paths = {"train": train_path, "val": val_path, "test": test_path or val_path}
        self.num_classes = num_classes
        self.image_size = image_size
        self.eval_size = image_size if eval_size is None else eval_size
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size or batch_size
        self.num_workers, self.shuffle_buffer, self.shard_shuffle = num_workers, shuffle_buffer, shard_shuffle
        self.train_samples, self.seed, self.persistent_workers = train_samples, seed, persistent_workers
        self.tf_args = dict(auto_augment=auto_augment, re_prob=re_prob, color_jitter=color_jitter, hflip=hflip,
                            scale=scale, interpolation=interpolation)
        self.crop_pct, self.interpolation = crop_pct, interpolation

    # ------------------------------------------------------------------ helpers
    def _path(self, split: str) -> str:
        p = self.paths[split]
        if not p:
            raise ValueError(f"ImageNetDataModule: {split}_path is not set (needed for the {split} dataloader)")
        return p

    def _world(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            return trainer.world_size, trainer.global_rank
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_world_size(), torch.distributed.get_rank()
        return 1, 0

    def transform(self, split: str):
        if split == "train":
            return train_transform(self.image_size, **self.tf_args)
        return eval_transform(self.eval_size, self.crop_pct, self.interpolation)

    def wds_dataset(self, split: str, num_workers: int | None = None):
        """The WebDataset pipeline of ``split`` (yields ``(image tensor, label)``)."""
        import webdataset as wds

        workers = self.num_workers if num_workers is None else num_workers
        urls = expand_shards(self._path(split), f"{split}_path")
        world, _ = self._world()
        if len(urls) < world * max(1, workers):
            raise ValueError(f"{split}_path has {len(urls)} shards but world_size x num_workers = {world} x "
                             f"{max(1, workers)}: every worker needs at least one shard (write more shards or use fewer workers)")
        train = split == "train"
        per_worker = None
        if train and self.train_samples:
            per_worker = math.ceil(self.train_samples / (world * max(1, workers)))
            per_worker = max(1, per_worker // self.batch_size) * self.batch_size
        ds = wds.WebDataset(urls, nodesplitter=wds.split_by_node, workersplitter=wds.split_by_worker,
                            shardshuffle=self.shard_shuffle if train else False, repeat=per_worker is not None,
                            empty_check=True, seed=self.seed)
        if train:
            ds = ds.shuffle(self.shuffle_buffer)
        ds = ds.map(functools.partial(decode_sample, num_classes=self.num_classes, transform=self.transform(split)))
        if per_worker is not None:
            ds = ds.with_epoch(per_worker).with_length(per_worker * max(1, workers))
        return ds

    def folder_dataset(self, split: str):
        """``torchvision.datasets.ImageFolder`` of ``split`` with the split's transform."""
        from torchvision.datasets import ImageFolder

        root = self._path(split)
        if not Path(root).is_dir():
            raise FileNotFoundError(f"{split}_path: ImageFolder root {root!r} is not a directory")
        ds = ImageFolder(root, transform=self.transform(split))
        if len(ds.classes) > self.num_classes:
            raise ValueError(f"{split}_path {root!r} has {len(ds.classes)} class folders but num_classes={self.num_classes}")
        return ds

    def _loader(self, split: str):
        train = split == "train"
        bs = self.batch_size if train else self.eval_batch_size
        ds = self.wds_dataset(split) if self.format == "wds" else self.folder_dataset(split)
        kw: dict[str, Any] = dict(batch_size=bs, num_workers=self.num_workers, drop_last=train,
                                  pin_memory=torch.cuda.is_available(), persistent_workers=train and self.num_workers > 0 and self.persistent_workers)
        if self.format == "folder":
            sampler = None
            world, rank = self._world()
            if world > 1:  # Lightning replaces samplers only for map datasets it sees; be explicit
                sampler = torch.utils.data.DistributedSampler(ds, world, rank, shuffle=train, seed=self.seed, drop_last=train)
            kw.update(shuffle=train and sampler is None, sampler=sampler)
        return torch.utils.data.DataLoader(ds, **kw)

    def train_dataloader(self):
        return self._loader("train")

    def val_dataloader(self):
        return self._loader("val")

    def test_dataloader(self):
        return self._loader("test")


# ---------------------------------------------------------------------- shard writer
_IMG_EXT = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


def write_imagefolder_shards(root: str | Path, pattern: str, maxcount: int = 1000, shuffle_seed: int | None = 0,
                             class_to_idx: dict[str, int] | None = None, quality: int = 95) -> list[str]:
    """Write an ImageFolder tree ``<root>/<class>/<image>`` as WebDataset shards (timm convention).

    Args:
        root: ImageFolder root; classes are its sub-folders in sorted order (torchvision's mapping).
        pattern: output shard pattern with a printf field, e.g. ``out/imagenet1k-train-%04d.tar``.
        maxcount: samples per shard.
        shuffle_seed: shuffle the sample order before writing (``None`` keeps folder order); shards
            then hold a class mix, which makes shard-level shuffling effective.
        class_to_idx: explicit class -> label mapping (default: sorted folder names -> 0..C-1).
        quality: JPEG quality when an image is not already a JPEG (JPEG files are copied byte for byte).

    Returns:
        the shard paths written. Also writes ``classes.txt`` (one class name per label) next to them.

    Raises:
        FileNotFoundError: ``root`` is not a directory or holds no images.
        ValueError: ``pattern`` has no ``%d``-style field.
    """
    import random

    import webdataset as wds

    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"ImageFolder root {str(root)!r} is not a directory")
    if not re.search(r"%0?\d*d", pattern):
        raise ValueError(f"shard pattern {pattern!r} needs a printf field such as %04d")
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    class_to_idx = class_to_idx or {c: i for i, c in enumerate(classes)}
    items = [(p, class_to_idx[c]) for c in classes for p in sorted((root / c).rglob("*"))
             if p.is_file() and p.suffix.lower() in _IMG_EXT]
    if not items:
        raise FileNotFoundError(f"no images under ImageFolder root {str(root)!r}")
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(items)
    out_dir = Path(pattern).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    with wds.ShardWriter(pattern, maxcount=maxcount, verbose=0) as sink:
        for p, label in items:
            data = p.read_bytes()
            if data[:2] != b"\xff\xd8":  # not a JPEG: re-encode
                buf = io.BytesIO()
                Image.open(io.BytesIO(data)).convert("RGB").save(buf, format="JPEG", quality=quality)
                data = buf.getvalue()
            rel = p.relative_to(root).with_suffix("")
            key = re.sub(r"[^A-Za-z0-9_-]", "_", str(rel))
            sink.write({"__key__": key, "jpg": data, "cls": str(label).encode("ascii")})
            if sink.fname and sink.fname not in written:
                written.append(sink.fname)
    (out_dir / "classes.txt").write_text("".join(f"{c}\n" for c in sorted(class_to_idx, key=class_to_idx.get)))
    return written
