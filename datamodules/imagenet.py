"""ImageNet-style classification data: WebDataset shards (timm's convention) or an ImageFolder tree.

Nothing is downloaded: point the module at shards or folders you already have.

WebDataset convention (timm's reader): shards such as ``/data/imagenet1k-train-{0000..1023}.tar``
(brace patterns, globs, folders of ``.tar``, several joined by ``::`` or as a list: the rule of every
mixlab input, :mod:`mixlab.datamodules.files`), each sample with ``__key__``,
``jpg`` (encoded image bytes) and ``cls`` (ASCII integer label). Every shard goes to one DDP rank x
DataLoader worker, so no sample is read twice; training permutes the shards every epoch and shuffles
samples (``shuffle_buffer``), all seeded (:class:`ShardStream`). :func:`write_imagefolder_shards`
(and ``scripts/make_wds_shards.py``) writes such shards from an ImageFolder tree.

Transforms (timm ``create_transform``):

* train (DeiT recipe): RandomResizedCrop (bicubic, scale 0.08-1), horizontal flip, colour jitter
  0.3 (timm switches it off when RandAugment is on, as DeiT), RandAugment ``rand-m9-mstd0.5-inc1``,
  RandomErasing 0.25 (pixel mode). Mixup/CutMix and
  label smoothing are applied on the model side (:class:`mixlab.heads.vit.ImageClassifier`,
  ``mixup:``) because they change the loss.
* eval at any resolution ``r`` (int or ``[H, W]``): resize the short side to ``floor(r * 256/224)``
  (``crop_pct = 0.875``) then center crop ``r``; non-square ``[H, W]`` keeps the aspect ratio and
  center crops ``H x W``.
* ``decode: gpu`` (shards only): the same recipe split between workers (JPEG bytes, parameter draws) and
  the training device (batched decode and augmentation in ``on_after_batch_transfer``):
  :mod:`mixlab.datamodules.imagenet_gpu`. ``decode: cpu`` is the pipeline above, unchanged.
* Reduced-size JPEG decoding (PIL ``Image.draft``) is not used: a 2x DCT reduction needs both crop sides
  >= 2 x 224 (training) or a short side >= 512 (evaluation at 224), which a typical ImageNet image
  (500 x 375) never has. Where it applies it keeps the recipe within decoder noise (measured on synthetic
  photo-like JPEGs at 1024 x 768 and 2048 x 1536, evaluation at 224: mean |difference| 1.4 and 1.2 levels
  of 255, max 11) for a 1.15x and 1.4x faster decode + transform; ``scripts/bench_input.py`` reports the
  fraction of a shard set where it could apply, to decide whether it is worth adding.

Under DDP: shards go to rank x DataLoader worker (the ranks as webdataset sees them: ``RANK``/
``WORLD_SIZE`` or ``torch.distributed``), each shard to exactly one consumer: evaluation uses
``wds.split_by_node`` then ``split_by_worker`` (shard order), training consumer ``g`` of ``G`` reads
shards ``g::G`` of the epoch's seeded permutation (:func:`mixlab.distributed.consumer_slice`). Fewer
shards than ``world_size * num_workers`` is an error, not resampling (webdataset would hang or let a
rank stop early): the ValueError names the split's pattern and both numbers. Training streams repeat
with a fixed per-worker epoch length (``train_samples``), so every rank runs the same steps.

Exact resume (``format: wds``): the training stream is a function of (seed, epoch, rank, worker):
shard order per epoch from ``stream_seed(seed, epoch, .)``, the sample shuffle buffer seeded per
(seed, epoch, rank, worker), and each sample's augmentation seeded by its position in that stream
(:class:`ShardStream`; the epoch comes from the trainer through
:class:`mixlab.distributed.EpochSyncLoader`, as Lightning only tells samplers). The datamodule's
``state_dict()`` (saved in every checkpoint) holds ``train_stream = {epoch, seed, consumed_batches,
world, num_workers, batch_size, shards}``, the batches from the trainer's fit-loop progress; after
``load_state_dict`` each worker skips, before decoding, the raw samples of the batches it had
produced (DataLoader workers take turns: worker ``w`` of ``W`` made ``ceil((k - w) / W)`` of the
first ``k`` batches), so the resumed run's next batches are the uninterrupted run's, bitwise. Resume
with the same ``world_size``, ``num_workers``, ``batch_size``, seed and shards (else a
RuntimeWarning and the epoch restarts); a corrupt image before the checkpoint shifts its worker by
one sample. The ``folder`` format is map-style: :class:`mixlab.distributed.ResumableDataModule`
splits it by rank and saves its train position for exact resume.

Bad input: a missing shard / folder raises FileNotFoundError naming the pattern; fewer shards than
``world_size * num_workers`` raises ValueError (see above); a label
outside ``[0, num_classes)`` raises ValueError naming the sample key and shard; a corrupt or truncated
image is skipped with a warning that counts the skipped samples, in shards and in ImageFolder trees alike
(there the next image of the folder takes its place, so batches keep their size). The warning gives the count of
the datamodule, over the training process and its DataLoader workers (one rank under DDP;
:attr:`ImageNetDataModule.corrupt_skipped`, :class:`CorruptCount`); :data:`SKIPPED` counts one process.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import math
import os
import random
import re
import sys
import tarfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

import numpy as np
import torch
from PIL import Image

from mixlab.datamodules.files import expand_pattern
from mixlab.distributed import (
    EpochSyncLoader,
    ResumableDataModule,
    SplitLoaders,
    check_num_workers,
    consumer_slice,
    fit_progress,
    loader_generator,
    stream_seed,
    worker_init_ignoring_sigterm,
    worker_skip,
)

__all__ = ["ImageNetDataModule", "ShardStream", "expand_shards", "decode_sample", "write_imagefolder_shards",
           "synthetic_jpeg", "write_synthetic_shards", "sample_image_and_label",
           "SKIPPED", "eval_transform", "train_transform", "SkipCorrupt", "CorruptImage", "checked_loader"]

SKIPPED = {"corrupt": 0}
"""Number of corrupt images skipped so far in this process (each DataLoader worker counts its own)."""

_RUN_COUNT: tuple[torch.Tensor, int] | None = None  # (a CorruptCount's counts, this process's slot), once installed


class CorruptCount:
    """Corrupt images skipped by one datamodule's loaders, over every process that reads them: one int64
    slot per process in shared memory (slot 0 the training process; then each DataLoader worker of the
    train, val and test loaders), each written by its own process only, so no increment is lost.

    :meth:`install` makes this process count into a slot (the loaders' ``worker_init_fn`` calls
    :meth:`worker_init`); :func:`_skip_corrupt` then adds there and warns with :attr:`total`.

    Args:
        num_workers: DataLoader workers per loader (slots: ``1 + 3 * num_workers``)."""

    SPLITS = ("train", "val", "test")

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.counts = torch.zeros(1 + len(self.SPLITS) * num_workers, dtype=torch.int64).share_memory_()

    def install(self, slot: int = 0) -> None:
        """Count this process's skipped images in ``slot``."""
        global _RUN_COUNT
        _RUN_COUNT = (self.counts, slot)

    def worker_init(self, split: str, worker_id: int) -> None:
        """A DataLoader ``worker_init_fn`` (with ``functools.partial(count.worker_init, split)``)."""
        self.install(1 + self.SPLITS.index(split) * self.num_workers + worker_id)

    @property
    def total(self) -> int:
        """Images skipped so far in all processes."""
        return int(self.counts.sum())


log = logging.getLogger("mixlab.imagenet")

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")


def expand_shards(pattern: str | list[str], what: str = "shards") -> list[str]:
    """Shard URLs of a pattern: braces (``a-{0000..0009}.tar``), globs (``a-*.tar``), directories of
    ``.tar`` files, several joined by ``::`` or given as a list; URLs pass as they are
    (:func:`mixlab.datamodules.files.expand_pattern`, the rule of every mixlab input).

    Raises:
        FileNotFoundError: local shards that do not exist, a glob matching none (names ``what`` and the pattern).
        ValueError: an empty pattern.
    """
    return expand_pattern(pattern, what, suffixes=_SHARD_SUFFIXES, remote=True, kind="shards")


def decode_sample(sample: dict, num_classes: int, transform=None):
    """``{"__key__", "jpg", "cls"}`` -> ``(image, label)``, or ``None`` for a corrupt image (counted, warned).

    ``image`` is the PIL RGB image passed through ``transform``; ``label`` an int in ``[0, num_classes)``.

    Raises:
        ValueError: missing ``jpg``/``cls`` entry, a non-integer or out-of-range label (names key and shard).
    """
    where, data, label = sample_image_and_label(sample, num_classes)
    try:
        img = Image.open(io.BytesIO(data)).convert("RGB")  # a full decode: truncated/corrupt data raises here
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError ... for bad files
        _skip_corrupt(where, exc)
        return None
    return (transform(img) if transform is not None else img), label


def sample_image_and_label(sample: dict, num_classes: int) -> tuple[str, bytes, int]:
    """``{"__key__", "jpg", "cls"}`` -> (``"'key' in shard"`` for messages, encoded image bytes, label in
    ``[0, num_classes)``).

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
    return f"{key!r} in {url}", sample[img_key], label


def _skip_corrupt(what: str, exc: BaseException, then: str = "") -> None:
    """Count a corrupt image in :data:`SKIPPED` (and in the installed :class:`CorruptCount`'s slot) and warn
    (RuntimeWarning) naming it and the count: the datamodule's over its processes where one is installed (under
    DDP each rank has its own), else this process's."""
    SKIPPED["corrupt"] += 1
    if _RUN_COUNT is not None:
        counts, slot = _RUN_COUNT
        counts[slot] += 1
        so_far = (f"{int(counts.sum())} corrupt image(s) skipped so far by this datamodule (this process and its "
                  "DataLoader workers)")
    else:
        so_far = f"{SKIPPED['corrupt']} corrupt image(s) skipped so far in this process"
    warnings.warn(f"skipped corrupt image {what} ({type(exc).__name__}: {exc}); {so_far}{then}", RuntimeWarning)


class CorruptImage(Exception):
    """An image file PIL cannot decode (raised by :func:`checked_loader`)."""

    def __init__(self, path: str, error: BaseException) -> None:
        super().__init__(f"{path}: {type(error).__name__}: {error}")
        self.path, self.error = path, error


def checked_loader(path: str):
    """torchvision's default image loader (PIL, converted to RGB: a full decode); a file it cannot
    decode raises :class:`CorruptImage`."""
    from torchvision.datasets.folder import default_loader

    try:
        return default_loader(path)
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError ... for bad files
        raise CorruptImage(path, exc) from None


class SkipCorrupt(torch.utils.data.Dataset):
    """A map-style image dataset (an ``ImageFolder`` built with ``loader=checked_loader``) that skips
    corrupt or truncated images.

    A :class:`CorruptImage` is counted in :data:`SKIPPED` and warned about (RuntimeWarning naming the
    file and the count), as the WebDataset path does, and item ``i`` becomes the next readable item
    (``i + 1``, ...), so batches keep their size (Mixup needs even batches; DDP ranks stay in step).
    ``classes``, ``class_to_idx``, ``samples`` and ``root`` are the wrapped dataset's.

    Raises:
        ValueError: no item is readable.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        for name in ("classes", "class_to_idx", "samples", "root"):
            if hasattr(dataset, name):
                setattr(self, name, getattr(dataset, name))

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        n = len(self.dataset)
        for k in range(n):
            try:
                return self.dataset[(index + k) % n]
            except CorruptImage as err:
                _skip_corrupt(repr(err.path), err.error, "; the next image takes its place")
        raise ValueError(f"{getattr(self, 'root', 'image dataset')!r}: none of its {n} images is readable")


def posterize(img: Image.Image, bits_to_keep: int, **_) -> Image.Image:
    """timm's RandAugment ``posterize`` (keep the ``bits_to_keep`` most significant bits of every channel) for
    every argument: 8 or more returns ``img``, 0 or fewer keeps no bit, a black image. That is what Pillow did
    before it began to refuse bits outside 1-8 (Pillow 13 raises ``ValueError``), what TensorFlow's RandAugment
    does, and what the accelerator path does (:mod:`mixlab.datamodules.imagenet_gpu`). timm passes 0 bits:
    ``PosterizeIncreasing`` at level 10, which the DeiT recipe's magnitude noise (``mstd0.5`` around 9) reaches
    for about 0.3% of images, so with timm's own op the first few hundred images end a run."""
    from PIL import ImageOps

    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)
    return ImageOps.posterize(img, int(bits_to_keep))


def train_transform(size, auto_augment: str | None = "rand-m9-mstd0.5-inc1", re_prob: float = 0.25,
                    color_jitter: float = 0.3, hflip: float = 0.5, scale=(0.08, 1.0),
                    interpolation: str = "bicubic", mean=IMAGENET_MEAN, std=IMAGENET_STD):
    """DeiT/timm training transform (RandomResizedCrop, flip, colour jitter, RandAugment, RandomErasing), with
    RandAugment's Posterize ops through :func:`posterize` (0 bits: a black image instead of Pillow's error)."""
    from timm.data import create_transform
    from timm.data.auto_augment import RandAugment

    h, w = (size, size) if isinstance(size, int) else tuple(size)
    transform = create_transform((3, h, w), is_training=True, auto_augment=auto_augment, re_prob=re_prob,
                                 re_mode="pixel", re_count=1, color_jitter=color_jitter, hflip=hflip,
                                 scale=tuple(scale), interpolation=interpolation, mean=mean, std=std)
    for step in transform.transforms:
        if isinstance(step, RandAugment):
            for op in step.ops:
                if op.name.startswith("Posterize"):
                    op.aug_fn = posterize
    return transform


def eval_transform(size, crop_pct: float = 224 / 256, interpolation: str = "bicubic", mean=IMAGENET_MEAN,
                   std=IMAGENET_STD):
    """Resize the short side to ``floor(size / crop_pct)`` (= ``size * 256/224``) then center crop ``size``."""
    from timm.data import create_transform

    h, w = (size, size) if isinstance(size, int) else tuple(size)
    return create_transform((3, h, w), is_training=False, crop_pct=crop_pct, crop_mode="center",
                            interpolation=interpolation, mean=mean, std=std)


@contextlib.contextmanager
def seeded_rngs(seed: int, restore: bool = True) -> Iterator[None]:
    """Seed Python's ``random``, NumPy's global RNG and torch's CPU generator with ``seed`` (the RNGs
    timm/torchvision augmentations draw from) and, with ``restore``, put their previous states back on exit, so
    the caller's random streams (e.g. dropout when ``num_workers=0``) are untouched. ``restore=False`` is for a
    DataLoader worker, whose RNGs nothing else reads: saving and restoring the three states costs ~80 us per call
    (NumPy's alone ~70 us), ~15% of a worker's time per image with ``decode: gpu``. CUDA RNGs are not used."""
    state = (random.getstate(), np.random.get_state(), torch.get_rng_state()) if restore else None
    random.seed(seed)
    np.random.seed((seed ^ (seed >> 32)) & 0xFFFFFFFF)
    torch.default_generator.manual_seed(seed)
    try:
        yield
    finally:
        if state is not None:
            random.setstate(state[0])
            np.random.set_state(state[1])
            torch.set_rng_state(state[2])


class ShardStream(torch.utils.data.IterableDataset):
    """Seeded, resumable training stream over WebDataset shards: ``(image, label)`` samples.

    Consumer ``g = rank * W + w`` of ``G = world * W`` (``W`` DataLoader workers, ``w`` the worker).
    In epoch ``e``, pass ``p`` over the shards (a repeating stream reads them again):

    * shard order: the URL list permuted by ``random.Random(stream_seed(seed, e, -1 - p))``
      (kept as is when ``shard_shuffle`` is falsy); consumer ``g`` reads positions ``g::G``
      (:func:`mixlab.distributed.consumer_slice`), so every pass reads each shard exactly once
      over all consumers and every epoch (and pass) has its own order;
    * samples: webdataset's shuffle buffer (``shuffle_buffer`` samples, rng
      ``random.Random(stream_seed(seed, e, g))``) over the consumer's raw samples; raw sample
      ``i`` of the shuffled stream is decoded by ``decode`` under :func:`seeded_rngs` with seed
      ``stream_seed(seed, e, g) + 1 + i``, so its augmentation depends on ``(seed, e, g, i)`` only;
    * ``length`` decoded samples per worker per epoch (``None``: one pass; corrupt images, for
      which ``decode`` returns ``None``, are dropped and do not count).

    The epoch comes from :meth:`set_epoch` (stored in shared memory, so persistent workers see
    it; :class:`mixlab.distributed.EpochSyncLoader` calls it with the trainer's epoch).
    Resume: after :meth:`load_state_dict` of a state taken after ``k`` batches of epoch ``e``,
    iterating epoch ``e`` again makes physical worker ``w`` play worker ``(w + k) % W`` (a fresh
    DataLoader asks worker 0 first, but batch ``k`` is due from worker ``k % W``), which drops
    the first :func:`mixlab.distributed.worker_skip` ``(k, w', W) x batch_size`` raw samples of
    its shuffled stream before decoding them; the DataLoader then yields the uninterrupted run's
    batches ``k, k+1, ...`` (batching happens in the workers, ``batch_size`` each). Exact as long
    as ``world``, ``W``, ``seed``, the shards and the batch size are unchanged, no image before
    the checkpoint was corrupt, and (for ``length=None``) no worker has run out of samples.

    Args:
        urls: shard URLs (all of them; the stream picks its own).
        decode: ``raw webdataset sample (dict) -> (image, label) | None``.
        seed: base seed. rank, world: this process's rank and the world size.
        batch_size: the DataLoader's batch size. shuffle_buffer: samples (``< 1``: no shuffle).
        shard_shuffle: permute the shard list per epoch and pass. length: see above.
        num_workers: the DataLoader's ``num_workers`` (for ``len`` and the saved state).

    Raises:
        ValueError: fewer shards than ``world x W`` (from ``consumer_slice``); shards of one
            consumer that hold no sample in a repeating stream.
    """

    def __init__(self, urls: list[str], decode: Callable[[dict], Any], seed: int = 0, rank: int = 0, world: int = 1,
                 batch_size: int = 1, shuffle_buffer: int = 0, shard_shuffle: bool | int = True,
                 length: int | None = None, num_workers: int = 0) -> None:
        self.urls, self.decode, self.seed, self.rank, self.world = list(urls), decode, int(seed), rank, world
        self.batch_size, self.shuffle_buffer, self.shard_shuffle = batch_size, shuffle_buffer, bool(shard_shuffle)
        self.length, self.num_workers = length, num_workers
        # [epoch, resume epoch, batches consumed in the resume epoch, first epoch of the resumed run],
        # shared with worker processes
        self._state = torch.tensor([0, -1, 0, 0], dtype=torch.int64).share_memory_()

    @property
    def epoch(self) -> int:
        return int(self._state[0])

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch``'s order next time the stream is iterated (also in persistent workers).

        After :meth:`load_state_dict`, an epoch before the resumed one (the state's epoch, or the next
        one when its batches were all consumed) reads as the resumed one. Lightning creates the resumed
        run's iterator, and trains the resumed epoch on it, before it restores its loops (when the
        model asks for ``trainer.estimated_stepping_batches``, so the trainer's epoch still reads 0)
        or before it moves on to the next epoch (a checkpoint written at the last batch)."""
        self._state[0] = max(int(epoch), int(self._state[3]))

    def _epoch_done(self, batches: int) -> bool:
        return self.length is not None and batches * self.batch_size >= self.length * max(1, self.num_workers)

    def __len__(self) -> int:
        """Samples per epoch on this rank (``length x W``); TypeError for a one-pass stream."""
        if self.length is None:
            raise TypeError("a one-pass ShardStream has no length")
        return self.length * max(1, self.num_workers)

    def state_dict(self, consumed_batches: int = 0) -> dict[str, int]:
        """State to resume after ``consumed_batches`` batches (of this rank) of the current epoch."""
        return {"epoch": self.epoch, "seed": self.seed, "consumed_batches": int(consumed_batches),
                "world": self.world, "num_workers": self.num_workers, "batch_size": self.batch_size,
                "shards": len(self.urls)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue epoch ``state["epoch"]`` after ``state["consumed_batches"]`` batches (next iteration
        of that epoch only; the next epoch if none is left); earlier epochs given to :meth:`set_epoch`
        from then on read as this one. A state saved under another world size, worker count, batch size, seed or
        shard count cannot be replayed: RuntimeWarning naming both values, and the stream starts the epoch afresh
        (the trainer still counts the batches done before, so that epoch is short: its last samples are not read)."""
        mine = self.state_dict()
        changed = [f"{k} {state.get(k)} -> {mine[k]}" for k in ("seed", "world", "num_workers", "batch_size", "shards")
                   if state.get(k) != mine[k]]
        if changed:
            warnings.warn(f"ShardStream: cannot resume the WebDataset stream exactly ({', '.join(changed)} since the "
                          f"checkpoint): the stream starts epoch {state['epoch']} again from its first sample while "
                          f"the trainer keeps its count of that epoch's batches already done, so the rest of epoch "
                          f"{state['epoch']} reads samples from the epoch's start again and not its last ones; later "
                          f"epochs are whole", RuntimeWarning)
            self._state[1], self._state[2] = -1, 0
        else:
            self._state[1], self._state[2] = int(state["epoch"]), int(state["consumed_batches"])
        done = not changed and self._epoch_done(int(state["consumed_batches"]))
        self._state[3] = int(state["epoch"]) + int(done)  # the resumed run's first epoch
        self.set_epoch(int(state["epoch"]))

    def consumer_shards(self, epoch: int, pass_: int, worker: int, num_workers: int) -> list[str]:
        """URLs read by worker ``worker`` of ``num_workers`` (this rank) in pass ``pass_`` of ``epoch``."""
        order = list(range(len(self.urls)))
        if self.shard_shuffle:
            random.Random(stream_seed(self.seed, epoch, -1 - pass_)).shuffle(order)
        return [self.urls[order[j]] for j in consumer_slice(len(order), self.rank, self.world, worker, num_workers)]

    def _raw(self, epoch: int, worker: int, num_workers: int) -> Iterator[dict]:
        import webdataset as wds

        pass_ = 0
        while True:
            urls = self.consumer_shards(epoch, pass_, worker, num_workers)
            n = 0
            try:
                for sample in wds.tarfile_samples([{"url": u} for u in urls]):
                    n += 1
                    yield sample
            except tarfile.TarError as exc:  # webdataset's args: (message, stream, url)
                url = next((a for a in exc.args if isinstance(a, str) and a in urls), " or ".join(urls))
                what = str(exc.args[0]).split(" @ ")[0] if exc.args else type(exc).__name__
                raise ValueError(f"shard {url} is not a readable tar file ({what}): truncated or corrupt; write it "
                                 "again, or leave it out of the pattern") from exc
            if self.length is None:
                return
            if n == 0:
                raise ValueError(f"shards {urls} hold no sample: a repeating stream cannot fill an epoch")
            pass_ += 1

    def __iter__(self) -> Iterator[Any]:
        import webdataset as wds

        info = torch.utils.data.get_worker_info()
        physical, n_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch, resume_epoch, resume_batches = self._state.tolist()[:3]
        consumed = resume_batches if epoch == resume_epoch else 0
        worker = (physical + consumed) % n_workers  # the role of this worker in the uninterrupted run
        base = stream_seed(self.seed, epoch, self.rank * n_workers + worker)
        skip = worker_skip(consumed, worker, n_workers) * self.batch_size
        produced = skip
        if self.length is not None and produced >= self.length:
            return
        raw = self._raw(epoch, worker, n_workers)
        if self.shuffle_buffer > 0:
            raw = wds.filters.shuffle(self.shuffle_buffer, rng=random.Random(base))(raw)
        for i, sample in enumerate(raw):
            if i < skip:  # produced before the checkpoint: skipped undecoded
                continue
            with seeded_rngs((base + 1 + i) % 2**63, restore=info is None):  # a worker's RNGs are its own
                out = self.decode(sample)
            if out is None:
                continue
            yield out
            produced += 1
            if self.length is not None and produced >= self.length:
                return


def _nice_then(nice: int, init: Callable[[int], Any], worker_id: int) -> None:
    """A DataLoader worker's start (``worker_init_fn`` through ``functools.partial``, picklable): ``os.nice(nice)``
    (this worker's threads, and those it starts later, yield the CPU to the training process's), then
    ``init(worker_id)``. See ``ImageNetDataModule(worker_nice=...)``."""
    if nice and hasattr(os, "nice"):
        os.nice(nice)
    init(worker_id)


def cuda_work_queues() -> tuple[str, str]:
    """``(count, shortfall)``: this process's CUDA hardware work queues per GPU (``CUDA_DEVICE_MAX_CONNECTIONS``,
    ``"8"`` when unset: CUDA's default), and, when fewer than 32, what that costs the ``decode: gpu`` path and how to
    get 32 (``""`` otherwise). ``python -m mixlab`` sets 32 unless the environment sets it; a script that builds the
    datamodule itself must export it before CUDA starts. With fewer queues than the path's streams (nvJPEG's 14 and
    the stage's), streams share a queue and run in order: a batch's decode waited behind the training step's queued
    kernels (46 instead of 16 ms per batch on an H100; the fit 0.88-0.89x instead of 0.94-0.95x the model,
    BENCHMARKS.md, forty-sixth session)."""
    queues = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") or "8"
    if queues.isdigit() and int(queues) >= 32:
        return queues, ""
    return queues, ("fewer than the streams of decode gpu, so the decode can wait behind the training step; export "
                    "CUDA_DEVICE_MAX_CONNECTIONS=32 before CUDA starts (python -m mixlab sets it)")


def _check_ranges(**values: Any) -> None:
    """Refuse out-of-range ImageNetDataModule arguments before anything is built.

    Raises:
        ValueError: naming the argument, its allowed range and the value given.
    """
    def size_ok(v: Any) -> bool:  # an int, or [height, width]; every side >= 1 pixel
        sides = list(v) if isinstance(v, (list, tuple)) else [v]
        return len(sides) == 1 + isinstance(v, (list, tuple)) and all(x >= 1 for x in sides)

    rules = {  # name: (test, allowed range in words); None is "not set" where the words say "or null"
        "batch_size": (lambda v: v >= 1, ">= 1"), "eval_batch_size": (lambda v: v >= 1, ">= 1 (or null)"),
        "num_workers": (lambda v: v >= 0, ">= 0"), "shuffle_buffer": (lambda v: v >= 0, ">= 0"),
        "prefetch_batches": (lambda v: v >= 0, ">= 0"), "cpu_decode_fraction": (lambda v: 0 <= v <= 1, "in [0, 1]"),
        "shard_shuffle": (lambda v: v >= 0, ">= 0"), "train_samples": (lambda v: v >= 1, ">= 1 (or null)"),
        "num_classes": (lambda v: v >= 1, ">= 1"),
        "image_size": (size_ok, "an int or [height, width], each >= 1 pixel"),
        "eval_size": (size_ok, "an int or [height, width], each >= 1 pixel (or null)"),
        "crop_pct": (lambda v: 0 < v <= 1, "in (0, 1]"), "re_prob": (lambda v: 0 <= v <= 1, "in [0, 1]"),
        "hflip": (lambda v: 0 <= v <= 1, "in [0, 1]"), "color_jitter": (lambda v: v >= 0, ">= 0 (or null)"),
        "scale": (lambda v: len(v) == 2 and 0 < v[0] <= v[1] <= 1, "(min, max) with 0 < min <= max <= 1"),
        "worker_nice": (lambda v: 0 <= v <= 19, "in [0, 19] (raising a worker's priority needs root)"),
        "switch_interval_ms": (lambda v: 0 < v <= 1000, "in (0, 1000] milliseconds (or null)"),
        **dict.fromkeys(("decode_thread", "cuda_graphs", "priority_training"),
                        (lambda v: isinstance(v, bool), "true or false")),
    }
    for name, value in values.items():
        test, allowed = rules[name]
        unset_allowed = "or null" in allowed
        if (value is None and not unset_allowed) or (value is not None and not test(value)):
            raise ValueError(f"ImageNetDataModule: {name} must be {allowed}; got {value!r}")


def _check_transform_names(image_size: Any, auto_augment: str | None, interpolation: str) -> None:
    """Refuse an ``interpolation`` or ``auto_augment`` string that timm's transforms would reject only when the first
    loader is built (a ``KeyError`` / ``AssertionError`` deep in timm): the interpolation name is looked up in timm's
    table and the training transform is built once here, cheaply.

    Raises:
        ValueError: naming the argument, what it takes and the value given.
    """
    from timm.data.transforms import _str_to_torch_interpolation

    names = list(_str_to_torch_interpolation)
    if interpolation not in names:
        raise ValueError(f"ImageNetDataModule: interpolation must be one of {', '.join(names)}; got {interpolation!r}")
    try:
        train_transform(image_size, auto_augment=auto_augment)
    except (AssertionError, KeyError, ValueError, IndexError) as err:
        raise ValueError("ImageNetDataModule: auto_augment must be a timm policy string such as "
                         f"'rand-m9-mstd0.5-inc1' or 'augmix-m5-w4-d2' (or null); got {auto_augment!r} "
                         f"({type(err).__name__}: {err})") from None


class ImageNetDataModule(SplitLoaders, ResumableDataModule):
    """ImageNet (or any ImageNet-format classification set) as WebDataset shards or ImageFolder trees.

    Args:
        format: ``"wds"`` (shards, ``*_path`` are shard patterns: braces or globs) or ``"folder"`` (``*_path`` are
            ImageFolder roots ``<root>/<class>/<image>``).
        train_path / val_path / test_path: data locations (test defaults to val).
        num_classes: labels must lie in ``[0, num_classes)``.
        image_size: training resolution (int or ``[H, W]``).
        eval_size: evaluation resolution (default ``image_size``); the resolution-transfer
            evaluation overrides it.
        batch_size: per-device batch size (training batches are full: drop_last, even for Mixup).
        eval_batch_size: per-device eval batch size (default ``batch_size``).
        num_workers: DataLoader workers per device.
        shuffle_buffer: sample shuffle buffer (WebDataset training); shard_shuffle: ``> 0`` permutes
            the training shards each epoch (a full seeded permutation, not a buffer size); 0 keeps
            their order.
        train_samples: samples per epoch over all ranks (ImageNet-1k: 1,281,167). For shards it
            sets a fixed per-worker epoch length (timm/webdataset ``with_epoch`` on a repeating
            stream) so every rank runs the same number of steps under DDP; ``None`` = one pass.
        crop_pct, interpolation, auto_augment, re_prob, color_jitter, hflip, scale: transforms.
        seed: shuffle seed (combined with ``seed_everything``'s, see ``order_seed``).
        persistent_workers: keep training DataLoader workers alive between epochs.
        decode: where JPEGs are decoded and augmented (``format: wds``). ``"cpu"``: in the DataLoader
            workers with timm's PIL transforms (the reference recipe). ``"gpu"``: workers read the bytes and
            sample the augmentation parameters only; the device stage (``prefetch_batches`` ahead in a
            background thread, or ``on_after_batch_transfer``) decodes the batch with
            ``torchvision.io.decode_jpeg`` on the training device and augments it there
            (:mod:`mixlab.datamodules.imagenet_gpu`; runs on a CPU device too). ``"auto"`` (default):
            ``"gpu"`` when CUDA is available and the trainer's root device is a CUDA device, else ``"cpu"``.
            Raises ValueError for ``"gpu"`` with ``format: folder``.
        prefetch_batches: with ``decode: gpu`` under a trainer, run that device stage this many batches
            ahead in a background thread on its own CUDA stream
            (:class:`~mixlab.datamodules.imagenet_gpu.DevicePrefetcher`), so its kernel launches and JPEG
            parsing overlap the model's step; ``0`` runs it in ``on_after_batch_transfer`` instead. Each
            prefetched batch holds its float32 images in device memory (256 x 224^2: 154 MB).
        cuda_graphs: with ``decode: gpu`` on CUDA, replay the training augmentation (RandAugment / colour
            jitter layers) as CUDA graphs, one per layer, op family and bucket of image counts, captured at
            the first batch (:class:`~mixlab.datamodules.imagenet_gpu._AugmentGraphs`): the same images, one
            launch per family instead of ~70 ops (H200: 458 instead of 784 ops per batch of 256 for the whole
            stage). ``false``: every op launched from Python. No effect on a CPU device.
        augment_impl: with ``cuda_graphs`` on CUDA, how the augmentation layers run: ``"torch"`` (default) the
            family-batched torch ops in their graphs; ``"triton"`` each layer as two Triton kernels over the whole
            batch, every layer of a batch in one CUDA graph (:mod:`~mixlab.datamodules.imagenet_triton`; the same
            images as ``"torch"``; a quarter of its device time), and the crop + resize of training and evaluation
            batches on CUDA as two Triton kernels instead of TF32 GEMMs (float32 sums: torchvision's
            ``resized_crop`` to a rare one-level tie). Without Triton installed, ``"torch"``.
        priority_training: with the device stage prefetched on CUDA, run the training step on a
            high-priority CUDA stream while the stage's kernels keep the lowest priority, so they fill the
            SMs the model leaves idle rather than delaying its kernels
            (:class:`~mixlab.datamodules.imagenet_gpu.DevicePrefetcher`'s ``priority_consumer``).
        cpu_decode_fraction: with ``decode: gpu``, the share of each training batch (``round(F * batch_size)`` images,
            the first of the batch) that the DataLoader workers decode, crop, resize and flip themselves (libjpeg-turbo
            through ``torchvision.io.decode_jpeg``, then ``resized_crop``:
            :func:`~mixlab.datamodules.imagenet_gpu.decode_crop_cpu`); the accelerator decodes the rest and augments
            all. Worker cores have spare time in the ``gpu`` mode (bytes and draws only), and every image they decode
            takes its decode and resize off the accelerator, whose stage time otherwise adds to the training step's.
            ``0``: the accelerator decodes everything; ``1``: the workers do (they need about 2 ms of a core per
            ImageNet-sized image, so a share larger than the idle cores can carry starves the step; on the H200 hosts
            measured, 15 workers on 16 cores, no share gained: BENCHMARKS.md).
        jpeg_decoder: with ``decode: gpu`` on CUDA, the JPEG decoder: ``"torchvision"`` (``decode_jpeg``: nvJPEG's
            CUDA kernels on the SMs, Huffman decoding on the host), ``"nvimgcodec"`` (NVIDIA nvImageCodec, ``pip install
            'nvidia-nvimgcodec-cu13[nvjpeg]'``: the GPU's hardware JPEG decoder where it has one, A100 / H100 / H200,
            so that decoding takes no SM time from the model; its images equal PIL's to one level, but it trained
            slower in every fit measured on H100 and H200 hosts: BENCHMARKS.md, thirty-seventh session).
            :func:`~mixlab.datamodules.imagenet_gpu.decode_jpegs`. A CPU device decodes with torchvision.
            ``"nvimgcodec"`` without the package raises ImportError when the loaders are built for a CUDA device.
        decode_thread: with the device stage prefetched, decode the next batch's JPEGs in a second background
            thread while the stage thread crops and augments the current one (torchvision's ``decode_jpeg`` on CUDA
            returns only after nvJPEG's device work, which waits behind the training step's kernels where streams share
            CUDA's hardware work queues: ``CUDA_DEVICE_MAX_CONNECTIONS`` below the 32 ``python -m mixlab`` sets),
            instead of one thread doing both in turn
            (:class:`~mixlab.datamodules.imagenet_gpu.DevicePrefetcher`'s ``decode_thread``). The same batches.
        worker_nice: added to each DataLoader worker's Linux nice value (``os.nice``, at the worker's start): with
            ``n > 0`` the training process's threads (the training step's launches, the device stage, the pin-memory
            thread) win the CPU from the workers whenever both are ready to run, and the workers take the cores left
            over. For ``decode: gpu`` with as many workers as cores, where the workers' ~9 busy cores can delay the
            training process's own threads. ``0`` (default): unchanged. Ignored where ``os.nice`` does not exist.
        switch_interval_ms: Python's thread switch interval (:func:`sys.setswitchinterval`, milliseconds) while the
            training device stage runs in its background thread, restored at ``teardown``. The stage thread's
            Python holds the GIL between its launches; when the training thread asks for it, CPython hands it over
            only after this interval (5 ms by default), and every such wait delays the training step's launches.
            ``null`` (default): unchanged. Used only with the device stage prefetched (``decode: gpu``).
    """

    task_name = "imagenet"
    in_chans = 3
    _train_stream: ShardStream | None = None
    _train_prefetcher: Any = None  # the last training DevicePrefetcher built (input_timings)
    _pending_stream_state: dict[str, int] | None = None
    _pending_stream_owner: Any = None  # the trainer that loaded _pending_stream_state

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
        decode: Literal["auto", "cpu", "gpu"] = "auto",
        prefetch_batches: int = 2,
        cuda_graphs: bool = True,
        augment_impl: Literal["torch", "triton"] = "torch",
        priority_training: bool = True,
        cpu_decode_fraction: float = 0.0,
        decode_thread: bool = False,
        jpeg_decoder: Literal["torchvision", "nvimgcodec"] = "torchvision",
        worker_nice: int = 0,
        switch_interval_ms: float | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if format not in ("wds", "folder"):
            raise ValueError(f"ImageNetDataModule: format must be 'wds' or 'folder'; got {format!r}")
        if decode not in ("auto", "cpu", "gpu"):
            raise ValueError(f"ImageNetDataModule: decode must be 'auto', 'cpu' or 'gpu'; got {decode!r}")
        if jpeg_decoder not in ("torchvision", "nvimgcodec"):
            raise ValueError("ImageNetDataModule: jpeg_decoder must be 'torchvision' or 'nvimgcodec'; got "
                             f"{jpeg_decoder!r}")
        if augment_impl not in ("triton", "torch"):
            raise ValueError(f"ImageNetDataModule: augment_impl must be 'triton' or 'torch'; got {augment_impl!r}")
        if cpu_decode_fraction and (decode == "cpu" or format == "folder"):
            warnings.warn(f"ImageNetDataModule: cpu_decode_fraction={cpu_decode_fraction} has no effect with "
                          f"{'format=folder' if format == 'folder' else 'decode=cpu'}: the workers decode every image")
        if decode == "gpu" and format != "wds":
            raise ValueError("ImageNetDataModule: decode='gpu' reads WebDataset shards; use format='wds' "
                             "or decode='cpu'")
        _check_ranges(prefetch_batches=prefetch_batches, batch_size=batch_size, eval_batch_size=eval_batch_size,
                      num_workers=num_workers, shuffle_buffer=shuffle_buffer, shard_shuffle=shard_shuffle,
                      train_samples=train_samples, num_classes=num_classes, image_size=image_size,
                      eval_size=eval_size, crop_pct=crop_pct, re_prob=re_prob, hflip=hflip, color_jitter=color_jitter,
                      scale=scale, cpu_decode_fraction=cpu_decode_fraction, worker_nice=worker_nice,
                      decode_thread=decode_thread, cuda_graphs=cuda_graphs, priority_training=priority_training,
                      switch_interval_ms=switch_interval_ms)
        check_num_workers(num_workers)  # the wds loaders do not go through resumable_loader's check
        _check_transform_names(image_size, auto_augment, interpolation)
        self.worker_nice, self.decode_thread, self.switch_interval_ms = worker_nice, decode_thread, switch_interval_ms
        self._switch_interval_before: float | None = None
        self.decode, self.prefetch_batches, self.cuda_graphs = decode, prefetch_batches, cuda_graphs
        self.priority_training, self.cpu_decode_fraction = priority_training, cpu_decode_fraction
        self.jpeg_decoder, self.augment_impl = jpeg_decoder, augment_impl
        self._gpu_pipelines: dict[bool, Any] = {}
        if batch_size % 2:
            warnings.warn(f"ImageNetDataModule: batch_size={batch_size} is odd; timm Mixup needs even batches")
        self.format = format
        self.paths = {"train": train_path, "val": val_path, "test": test_path or val_path}
        self._test_is_val = test_path is None and val_path is not None
        self.num_classes = num_classes
        self.image_size = image_size
        self.eval_size = image_size if eval_size is None else eval_size
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size or batch_size
        self.num_workers, self.shuffle_buffer, self.shard_shuffle = num_workers, shuffle_buffer, shard_shuffle
        self.train_samples, self.seed, self.persistent_workers = train_samples, seed, persistent_workers
        self.tf_args = dict(auto_augment=auto_augment, re_prob=re_prob, color_jitter=color_jitter, hflip=hflip,
                            scale=scale, interpolation=interpolation)
        self.crop_pct, self.interpolation = crop_pct, interpolation
        self.corrupt = CorruptCount(num_workers)

    # ------------------------------------------------------------------ helpers
    def _path(self, split: str) -> str:
        p = self.paths[split]
        if not p:
            raise ValueError(f"ImageNetDataModule: {split}_path is not set (needed for the {split} dataloader)")
        if split == "test" and self._test_is_val:
            log.info("imagenet: test_path is not set: testing on val_path %s", p)
            self._test_is_val = False  # said once
        return p

    @property
    def corrupt_skipped(self) -> int:
        """Corrupt images this datamodule's loaders skipped so far, in the training process and all workers."""
        return self.corrupt.total

    def _root_device(self) -> torch.device | None:
        """The trainer's root device, or None without a trainer."""
        return getattr(getattr(self.trainer, "strategy", None), "root_device", None)

    def decode_mode(self) -> str:
        """``"cpu"`` or ``"gpu"``: ``decode`` with ``"auto"`` resolved (see the class docstring)."""
        if self.decode != "auto":
            return self.decode
        device = self._root_device()
        gpu = self.format == "wds" and torch.cuda.is_available() and getattr(device, "type", None) == "cuda"
        return "gpu" if gpu else "cpu"

    def gpu_pipeline(self, train: bool):
        """The accelerator side of ``decode: gpu`` for training (``train=True``) or evaluation:
        :class:`mixlab.datamodules.imagenet_gpu.GpuPipeline`, ``EncodedBatch -> (images, labels)``.

        Raises:
            ImportError: ``jpeg_decoder: nvimgcodec`` for a CUDA device without nvImageCodec installed."""
        if train not in self._gpu_pipelines:
            from mixlab.datamodules.imagenet_gpu import NVIMGCODEC_MISSING, GpuPipeline, nvimgcodec_available

            device = self._root_device()
            if (self.jpeg_decoder == "nvimgcodec" and getattr(device, "type", None) == "cuda"
                    and not nvimgcodec_available()):
                raise ImportError(f"ImageNetDataModule: {NVIMGCODEC_MISSING}")
            self._gpu_pipelines[train] = GpuPipeline(self.transform("train" if train else "val"), train,
                                                     cuda_graphs=self.cuda_graphs,
                                                     jpeg_decoder=self.jpeg_decoder,
                                                     augment_impl=self.augment_impl)
        return self._gpu_pipelines[train]

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Lightning hook: an encoded batch (``decode: gpu``) moves its labels only (the JPEG bytes are read
        from host memory by ``decode_jpeg``); anything else as Lightning moves it."""
        from mixlab.datamodules.imagenet_gpu import EncodedBatch

        if isinstance(batch, EncodedBatch):
            return batch.to(device)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Lightning hook: an encoded batch (``decode: gpu``) becomes ``(images float32 [B, 3, H, W], labels
        int64 [B])`` on its device (decoded, cropped, augmented, normalised: :meth:`gpu_pipeline`)."""
        from mixlab.datamodules.imagenet_gpu import EncodedBatch

        if isinstance(batch, EncodedBatch):
            return self.gpu_pipeline(batch.train)(batch)
        return batch

    def transform(self, split: str):
        if split == "train":
            return train_transform(self.image_size, **self.tf_args)
        return eval_transform(self.eval_size, self.crop_pct, self.interpolation)

    def _shards(self, split: str, workers: int) -> tuple[list[str], int, int]:
        """``(shard urls, world size, readers = world x workers)`` of ``split``'s pattern; raises as
        :meth:`wds_dataset` documents."""
        import webdataset as wds

        pattern = self._path(split)
        urls = expand_shards(pattern, f"{split}_path")
        _, world, _, _ = wds.utils.pytorch_worker_info()  # the ranks split_by_node will use
        consumers = world * max(1, workers)
        if len(urls) < consumers:
            raise ValueError(f"{split}_path {pattern!r}: {len(urls)} shards but world_size x num_workers = {world} x "
                             f"{max(1, workers)} = {consumers} readers, and every rank/worker needs at least one shard "
                             f"(webdataset would hang or stop a rank early); write at least {consumers} shards "
                             f"or lower data.init_args.num_workers")
        return urls, world, consumers

    def setup(self, stage: str | None = None) -> None:
        """Check the shard patterns a ``fit`` reads (``train_path``, and ``val_path`` when set) before the
        trainer's sanity validation, so a missing shard or too few shards for the workers is one error before
        any step (raises as :meth:`wds_dataset`)."""
        super().setup(stage)
        if self.format == "wds" and stage == "fit":
            for split in ("train", "val") if self.paths.get("val") else ("train",):
                self._shards(split, self.num_workers)

    def wds_dataset(self, split: str, num_workers: int | None = None):
        """The WebDataset pipeline of ``split`` (yields ``(image tensor, label)``): a :class:`ShardStream`
        for ``train``, shards split by rank then worker and read in order for evaluation.

        Raises:
            ValueError: fewer shards than ``world_size x num_workers`` (names the pattern and numbers).
        """
        import webdataset as wds

        workers = self.num_workers if num_workers is None else num_workers
        urls, world, consumers = self._shards(split, workers)
        if self.decode_mode() == "gpu":  # bytes + sampled parameters; decoded by on_after_batch_transfer
            from mixlab.datamodules.imagenet_gpu import TrainParams, encode_sample

            params = TrainParams(self.transform(split)) if split == "train" else None
            decode = functools.partial(encode_sample, num_classes=self.num_classes, params=params)
        else:
            decode = functools.partial(decode_sample, num_classes=self.num_classes, transform=self.transform(split))
        if split == "train":  # seeded per epoch, resumable (see ShardStream)
            per_worker = None
            if self.train_samples:
                per_worker = math.ceil(self.train_samples / consumers)
                per_worker = max(1, per_worker // self.batch_size) * self.batch_size
            rank, _, _, _ = wds.utils.pytorch_worker_info()
            return ShardStream(urls, decode, seed=self.order_seed(self.seed), rank=rank, world=world,
                               batch_size=self.batch_size, shuffle_buffer=self.shuffle_buffer,
                               shard_shuffle=self.shard_shuffle, length=per_worker, num_workers=workers)
        ds = wds.WebDataset(urls, nodesplitter=wds.split_by_node, workersplitter=wds.split_by_worker,
                            shardshuffle=False, empty_check=True, seed=self.seed)
        return ds.map(decode)

    def folder_dataset(self, split: str):
        """``torchvision.datasets.ImageFolder`` of ``split`` with the split's transform; corrupt or
        truncated images are skipped, counted and warned about (:class:`SkipCorrupt`)."""
        from torchvision.datasets import ImageFolder

        root = self._path(split)
        if not Path(root).is_dir():
            raise FileNotFoundError(f"{split}_path: ImageFolder root {root!r} is not a directory")
        ds = SkipCorrupt(ImageFolder(root, transform=self.transform(split), loader=checked_loader))
        if len(ds.classes) > self.num_classes:
            raise ValueError(f"{split}_path {root!r} has {len(ds.classes)} class folders but "
                             f"num_classes={self.num_classes}")
        return ds

    def split_loader(self, split: str):
        """Loader of ``split`` (ImageFolder or WebDataset shards): ``(images [B, 3, H, W] float, labels [B]
        int64)`` batches; training augmented and resumable, evaluation resized and center-cropped."""
        train = split == "train"
        bs = self.batch_size if train else self.eval_batch_size
        ds = self.wds_dataset(split) if self.format == "wds" else self.folder_dataset(split)
        kw: dict[str, Any] = dict(num_workers=self.num_workers, drop_last=train,
                                  pin_memory=torch.cuda.is_available(),
                                  generator=loader_generator(self.order_seed(self.seed)),
                                  persistent_workers=train and self.num_workers > 0 and self.persistent_workers,
                                  worker_init_fn=worker_init_ignoring_sigterm(functools.partial(
                                      _nice_then, self.worker_nice,
                                      functools.partial(self.corrupt.worker_init, split))))
        self.corrupt.install()  # this process: the accelerator decode (decode: gpu) and num_workers 0
        if self.format == "wds" and self.decode_mode() == "gpu":
            from mixlab.datamodules.imagenet_gpu import collate_encoded

            collate = collate_encoded
            if train:  # the augmentation planned in the workers; the first share of each batch decoded there too
                stage = self.gpu_pipeline(True)
                collate = functools.partial(collate_encoded, cpu_fraction=self.cpu_decode_fraction,
                                            size=tuple(stage.size), interpolation=stage.interp.value,
                                            planner=stage.planner(self._root_device()))
            kw.update(collate_fn=collate)
        if self.format == "folder":  # map-style: rank split + resumable train position
            return self.resumable_loader(ds, bs, train, seed=self.seed, **kw)
        if isinstance(ds, ShardStream):  # wds training: seeded per epoch, resumable
            self._train_stream = ds
            state = self._stream_state_to_apply()
            if state:
                ds.load_state_dict(state)
            loader = EpochSyncLoader(ds, batch_size=bs, epoch_fn=self._fit_epoch, **kw)
        else:
            loader = torch.utils.data.DataLoader(ds, batch_size=bs, **kw)
        if train:
            log.info("imagenet: %s", self.pipeline_summary())
            queues, short = cuda_work_queues()
            if short and self.decode_mode() == "gpu" and getattr(self._root_device(), "type", None) == "cuda":
                warnings.warn(f"ImageNetDataModule: {queues} CUDA hardware work queues per GPU are {short}",
                              stacklevel=2)
        return self.prefetched(loader, train)

    def pipeline_summary(self) -> str:
        """Where the training images are decoded and augmented, in words (logged when the train loader is built)."""
        own = os.nice(0) if hasattr(os, "nice") else 0  # Linux caps a nice value at 19
        gain = min(19, own + self.worker_nice) - own
        at_nice = ("" if not (self.worker_nice and self.num_workers) else
                   f" at nice +{gain} (worker_nice)" if gain == self.worker_nice else
                   f" at nice +{gain} (worker_nice {self.worker_nice}, capped: this process runs at nice {own} and "
                   f"19 is the lowest priority)")
        no_nice = " (worker_nice has no effect without DataLoader workers)" if self.worker_nice and not at_nice else ""
        if self.decode_mode() == "cpu":
            unused = "".join(f" ({what} has no effect here)" for what, on in (
                (f"cpu_decode_fraction={self.cpu_decode_fraction}", self.cpu_decode_fraction),
                ("decode_thread", self.decode_thread), ("switch_interval_ms", self.switch_interval_ms is not None))
                if on)
            return (f"decode cpu: JPEG decoding and augmentation in {self.num_workers} DataLoader worker(s){at_nice}"
                    f"{no_nice}{unused}")
        device = self._root_device() or torch.device("cpu")
        prefetch = self.train_prefetch_batches()
        where = (f"{prefetch} batch(es) ahead in a background thread" if prefetch
                 else "in on_after_batch_transfer" + (" (num_workers 0: the samples' augmentation draws reseed the "
                                                       "random generators the training step draws from)"
                                                       if self.prefetch_batches else ""))
        if self.decode_thread:
            where += (" (decode_thread: the JPEG decode one batch ahead in a thread of its own)"
                      if prefetch else " (decode_thread has no effect with prefetch_batches 0)")
        if self.switch_interval_ms is not None:
            where += (f" (thread switch interval {self.switch_interval_ms:g} ms)" if prefetch
                      else " (switch_interval_ms has no effect with prefetch_batches 0)")
        if self.cuda_graphs and device.type == "cuda":
            from mixlab.datamodules.imagenet_gpu import triton_available

            fused = self.augment_impl == "triton" and triton_available()
            graphs = ("as Triton kernels in one CUDA graph, crop + resize as Triton kernels" if fused
                      else "in CUDA graphs"
                      + (" (augment_impl triton: Triton is not installed)" if self.augment_impl == "triton" else ""))
        else:
            graphs = "launched op by op" + (" (cuda_graphs has no effect on a CPU device)" if self.cuda_graphs else "")
            if self.augment_impl == "triton":
                graphs += (" (augment_impl triton has no effect on a CPU device)" if device.type != "cuda" else
                           " (augment_impl triton without cuda_graphs: the crop + resize as Triton kernels only)")
        priority = ""
        if prefetch and self.priority_training:
            priority = ("; training step on a high-priority CUDA stream" if device.type == "cuda"
                        else " (priority_training has no effect on a CPU device)")
        jpeg = (f"decoding ({self.jpeg_decoder})" if device.type == "cuda" else
                "decoding" + (f" (jpeg_decoder {self.jpeg_decoder} has no effect on a CPU device: torchvision)"
                              if self.jpeg_decoder == "nvimgcodec" else ""))
        if device.type == "cuda":
            queues, short = cuda_work_queues()
            priority += f"; {queues} hardware work queues per GPU (CUDA_DEVICE_MAX_CONNECTIONS)" + (
                f": {short}" if short else "")
        return (f"decode gpu: {jpeg} and augmentation on {device}, {where}; RandAugment {graphs}{priority}"
                f"{self._worker_share_summary()}" + (f"; DataLoader workers{at_nice}" if at_nice else no_nice))

    def _worker_share_summary(self) -> str:
        """The ``cpu_decode_fraction`` part of :meth:`pipeline_summary` (empty when 0)."""
        from mixlab.datamodules.imagenet_gpu import worker_decoded

        if not self.cpu_decode_fraction:
            return ""
        n, b = worker_decoded(self.cpu_decode_fraction, self.batch_size), self.batch_size
        if not n:
            return (f"; cpu_decode_fraction={self.cpu_decode_fraction} is no image of a batch of {b}: the accelerator "
                    "decodes all")
        workers = (f"in the {self.num_workers} DataLoader worker(s)" if self.num_workers
                   else "by the DataLoader in the training process (num_workers 0)")
        return f"; {n} of {b} images of each training batch decoded, cropped, resized and flipped {workers}"

    def train_prefetch_batches(self) -> int:
        """``prefetch_batches`` for the training loader: 0 with ``num_workers: 0``. The training samples' parameter
        draws (:func:`seeded_rngs`) then run in the process that trains, reseeding Python's, NumPy's and torch's
        global generators per sample and restoring them; from the prefetch thread they would interleave with the
        training step's own draws (Mixup / CutMix, dropout) at whatever moment the threads switch: two runs of one
        seed differed from their first step (an H100; on the CPU device too). In the training step the order is
        fixed."""
        return 0 if self.num_workers == 0 else self.prefetch_batches

    def prefetched(self, loader: Any, train: bool) -> Any:
        """``loader`` behind a :class:`~mixlab.datamodules.imagenet_gpu.DevicePrefetcher` running the device
        stage (``decode: gpu``, ``prefetch_batches > 0``, a trainer's root device known); else ``loader``."""
        device = self._root_device()
        if self.decode_mode() != "gpu" or (self.train_prefetch_batches() if train else self.prefetch_batches) == 0 \
                or device is None:
            return loader
        from mixlab.datamodules.imagenet_gpu import DevicePrefetcher

        prefetcher = DevicePrefetcher(loader, self.gpu_pipeline(train), device, self.prefetch_batches,
                                      priority_consumer=train and self.priority_training,
                                      decode_thread=self.decode_thread)
        if train:
            self._train_prefetcher = prefetcher
            if self.switch_interval_ms is not None:
                if self._switch_interval_before is None:
                    self._switch_interval_before = sys.getswitchinterval()
                sys.setswitchinterval(self.switch_interval_ms / 1000)
        return prefetcher

    def teardown(self, stage: str) -> None:
        """After a fit: stop the training DataLoader's persistent workers now. Lightning shuts down the workers of
        the loaders it iterates itself, but it sees the device stage's :class:`DevicePrefetcher`, not the
        DataLoader inside, so the workers lived until the process exited, where torch (2.11) waits 5 s for each
        before killing it: 75 s after the last step of a 15-worker fit on the GPU (BENCHMARKS.md). Python's thread
        switch interval set for the device stage (``switch_interval_ms``) is restored. Where images were skipped as
        corrupt, one log line gives their total so far (:attr:`corrupt_skipped`), after the warnings that named
        each."""
        super().teardown(stage)
        if self._switch_interval_before is not None:
            sys.setswitchinterval(self._switch_interval_before)
            self._switch_interval_before = None
        if self._train_prefetcher is not None:
            from lightning.pytorch.utilities.combined_loader import _shutdown_workers_and_reset_iterator

            _shutdown_workers_and_reset_iterator(self._train_prefetcher.loader)  # what Lightning does to its own
        if self.corrupt_skipped:
            log.warning("ImageNetDataModule: %d corrupt image(s) skipped so far (after %s), each named in a warning "
                        "above", self.corrupt_skipped, getattr(stage, "value", stage))  # TrainerFn -> "fit"

    def input_timings(self) -> dict[str, float]:
        """Where the training input's host time went so far, from the device stage's prefetcher
        (:meth:`~mixlab.datamodules.imagenet_gpu.DevicePrefetcher.timings`: seconds, and ``batches``); ``{}``
        without one (``decode: cpu``, ``prefetch_batches: 0``, no trainer). The ``ThroughputMemory`` callback logs
        it per batch as ``perf/input/<name>_ms``."""
        return {} if self._train_prefetcher is None else self._train_prefetcher.timings()

    def _stream_state_to_apply(self) -> dict[str, int] | None:
        """The loaded ``train_stream`` state while it still concerns the trainer's epoch. It is applied to
        every train stream built in the resumed fit up to the epoch after its own (Lightning builds the
        loader before it restores its loops, and again after them with ``reload_dataloaders_every_n_epochs``),
        then dropped; a different trainer (a new fit) drops it too."""
        state, epoch = self._pending_stream_state, self._fit_epoch()
        if state and ((self._pending_stream_owner is not None and self.trainer is not self._pending_stream_owner)
                      or (epoch is not None and epoch > int(state["epoch"]) + 1)):
            state = self._pending_stream_state = None
        return state

    def _fit_epoch(self) -> int | None:
        """The trainer's epoch (what Lightning gives samplers' ``set_epoch``); ``None`` without one."""
        return fit_progress(self.trainer)[0] if self.trainer is not None else None

    def state_dict(self) -> dict[str, Any]:
        """The map-style train position (``train_sampler``, ``format: folder``) or the WebDataset
        stream's (``train_stream``: epoch, seed, consumed_batches and the settings they depend on)."""
        state = super().state_dict()
        if self._train_stream is not None and self.trainer is not None:
            state["train_stream"] = self._train_stream.state_dict(fit_progress(self.trainer)[1])
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the position saved by :meth:`state_dict` (applied to the next train loader)."""
        super().load_state_dict(state_dict)
        self._pending_stream_state, self._pending_stream_owner = state_dict.get("train_stream"), self.trainer


# ---------------------------------------------------------------------- shard writer
_IMG_EXT = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


def check_shard_pattern(pattern: str) -> None:
    """Raises ValueError unless ``pattern`` has exactly one printf field, a ``%d`` one (``%04d``), for the shard
    number (webdataset's ShardWriter fills it with ``pattern % k``; a literal ``%`` is ``%%``)."""
    fields = [f for f in re.findall(r"%%|%[^%a-zA-Z]*[a-zA-Z]", pattern) if f != "%%"]
    if len(fields) != 1 or not re.fullmatch(r"%0?\d*d", fields[0]):
        raise ValueError(f"shard pattern {pattern!r} needs exactly one printf field for the shard number, such as "
                         f"%04d; found {len(fields)} field(s){': ' + ', '.join(fields) if fields else ''} (a literal % "
                         "is written %%)")


def _sample_key(path: Path, root: Path) -> str:
    """A shard sample's ``__key__``: ``path`` under ``root`` without its extension, every character other than
    ASCII letters, digits, ``_`` and ``-`` (path separators included) replaced by ``_``."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", str(path.relative_to(root).with_suffix("")))


def write_imagefolder_shards(root: str | Path, pattern: str, maxcount: int = 1000, shuffle_seed: int | None = 0,
                             class_to_idx: dict[str, int] | None = None, quality: int = 95,
                             before_write: Callable[[], Any] | None = None) -> list[str]:
    """Write an ImageFolder tree ``<root>/<class>/<image>`` as WebDataset shards (timm convention).

    Args:
        root: ImageFolder root; classes are its sub-folders in sorted order (torchvision's mapping).
        pattern: output shard pattern with a printf field, e.g. ``out/imagenet1k-train-%04d.tar``.
        maxcount: samples per shard.
        shuffle_seed: shuffle the sample order before writing (``None`` keeps folder order); shards
            then hold a class mix, which makes shard-level shuffling effective.
        class_to_idx: explicit class -> label mapping (default: sorted folder names -> 0..C-1).
        quality: JPEG quality when an image is not already a JPEG (JPEG files are copied byte for byte).
        before_write: called once after the checks below passed and before the first shard is written (e.g. to
            remove older shards of the pattern: a bad input then removes nothing).

    Returns:
        the shard paths written. Also writes ``classes.txt`` (one class name per label) next to them.

    Raises:
        FileNotFoundError: ``root`` is not a directory or holds no images.
        ValueError: ``pattern`` has no ``%d``-style field, or more than one ``%`` field; two images would get
            the same sample key (the path under ``root`` without its extension, characters other than letters,
            digits, ``_`` and ``-`` replaced by ``_``), which readers reject as a duplicate file in a tar; it
            names both files. Checked before anything is written.

    A file that is not a JPEG and cannot be read as an image is skipped with a warning naming it (JPEG files are
    copied unchecked; a corrupt one is skipped and counted by the loaders).
    """
    import random

    import webdataset as wds

    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"ImageFolder root {str(root)!r} is not a directory")
    check_shard_pattern(pattern)
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    if not classes:
        flat = sum(1 for f in root.iterdir() if f.is_file() and f.suffix.lower() in _IMG_EXT)
        raise FileNotFoundError(f"ImageFolder root {str(root)!r} has no class sub-folders ({flat} images directly "
                                f"in it): the layout is <root>/<class>/<image>")
    class_to_idx = class_to_idx or {c: i for i, c in enumerate(classes)}
    items = [(p, class_to_idx[c]) for c in classes for p in sorted((root / c).rglob("*"))
             if p.is_file() and p.suffix.lower() in _IMG_EXT]
    if not items:
        raise FileNotFoundError(f"no images under ImageFolder root {str(root)!r}")
    owner: dict[str, Path] = {}
    for p, _ in items:  # sample keys must be unique: a tar with two members of one name is unreadable
        key = _sample_key(p, root)
        if key in owner:
            raise ValueError(f"{str(owner[key])!r} and {str(p)!r} both get the sample key {key!r} (the path under the "
                             "root without its extension, characters other than letters, digits, _ and - as _); "
                             "rename one of them")
        owner[key] = p
    if before_write is not None:
        before_write()
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(items)
    out_dir = Path(pattern).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    skipped = 0
    # a whole-second mtime: webdataset's default (time.time(), a float) makes tarfile write a pax header before
    # every member, which doubles the readers' tar parsing (the workers' largest cost per image)
    with wds.ShardWriter(pattern, maxcount=maxcount, verbose=0, mtime=int(time.time())) as sink:
        for p, label in items:
            data = p.read_bytes()
            if data[:2] != b"\xff\xd8":  # not a JPEG: re-encode
                buf = io.BytesIO()
                try:
                    Image.open(io.BytesIO(data)).convert("RGB").save(buf, format="JPEG", quality=quality)
                except (OSError, ValueError, Image.DecompressionBombError) as exc:  # unreadable: skip it
                    skipped += 1
                    warnings.warn(f"write_imagefolder_shards: skipped {str(p)!r}, not a readable image ({exc}); "
                                  f"{skipped} skipped so far")
                    continue
                data = buf.getvalue()
            key = _sample_key(p, root)
            sink.write({"__key__": key, "jpg": data, "cls": str(label).encode("ascii")})
            if sink.fname and sink.fname not in written:
                written.append(sink.fname)
    (out_dir / "classes.txt").write_text("".join(f"{c}\n" for c in sorted(class_to_idx, key=class_to_idx.get)))
    return written


def synthetic_jpeg(rng: np.random.Generator, width: int = 500, height: int = 375, quality: int = 90,
                   noise: float = 9.0) -> bytes:
    """A photo-like JPEG (smooth colour field + texture + Gaussian noise of std ``noise`` levels), for
    benchmarks and tests. At the defaults (ImageNet's typical 500 x 375) a file is about 77 kB, as an
    ImageNet training JPEG; decoding costs about as much as a photo's."""
    def field(cell: int) -> np.ndarray:
        small = rng.random((max(2, height // cell), max(2, width // cell), 3)) * 255
        return np.asarray(Image.fromarray(small.astype(np.uint8)).resize((width, height), Image.BICUBIC), np.float32)

    arr = 0.6 * field(40) + 0.4 * field(6) + rng.normal(0, noise, (height, width, 3))
    buf = io.BytesIO()
    Image.fromarray(arr.clip(0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def write_synthetic_shards(out_dir: str | Path, n_images: int, size: tuple[int, int] = (500, 375),
                           num_classes: int = 10, maxcount: int = 100, seed: int = 0,
                           prefix: str = "synthetic") -> str:
    """Write ``n_images`` :func:`synthetic_jpeg` images (``size`` = (width, height) pixels, labels ``i %
    num_classes``) as an ImageFolder tree under ``out_dir/folder`` and then as WebDataset shards with
    :func:`write_imagefolder_shards` (the ``scripts/make_wds_shards.py`` code; JPEGs copied byte for byte).

    Returns:
        the brace pattern of the shards, e.g. ``out_dir/synthetic-{0000..0009}.tar``.
    """
    out_dir = Path(out_dir)
    rng = np.random.default_rng(seed)
    root = out_dir / "folder"
    for i in range(n_images):
        d = root / f"class_{i % num_classes:03d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"img{i:06d}.jpg").write_bytes(synthetic_jpeg(rng, *size))
    shards = write_imagefolder_shards(root, str(out_dir / f"{prefix}-%04d.tar"), maxcount=maxcount, shuffle_seed=seed)
    return str(out_dir / f"{prefix}-{{0000..{len(shards) - 1:04d}}}.tar")
