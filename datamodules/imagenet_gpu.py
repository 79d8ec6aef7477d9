"""ImageNet input pipeline with JPEG decoding and augmentation on the accelerator (``decode: gpu``).

The CPU pipeline (:func:`mixlab.datamodules.imagenet.train_transform`, timm's DeiT recipe on PIL images)
decodes every JPEG and runs RandomResizedCrop, flip, RandAugment and RandomErasing in DataLoader
workers: about 190 img/s per core, so 15 workers feed an H200 a third of what ViT-S/16 trains at. This
module splits the same recipe in two:

* **workers** (cheap, per sample, seeded as the CPU path by :class:`ShardStream`): read the JPEG bytes,
  read the image size from its header (no decode), and *sample* every random parameter of the recipe with
  timm's and torchvision's own samplers, in the CPU path's order, from the same RNG calls:
  ``RandomResizedCropAndInterpolation.get_params`` (on the original size), the flip draw, timm
  ``RandAugment``'s op choice / probability / magnitude / sign draws (timm's ops run on a recorder instead
  of an image), ``ColorJitter.get_params`` (only where timm keeps colour jitter: not with RandAugment),
  and the boxes of timm ``RandomErasing._erase``. With the same per-sample seed the parameters equal the
  CPU path's draws exactly (tests check it). :func:`encode_sample` returns them with the bytes;
  :func:`collate_encoded` packs a batch (:class:`EncodedBatch`).
* **the accelerator** (:class:`GpuPipeline`, run by the datamodule's :class:`DevicePrefetcher` in a background
  thread, ``prefetch_batches`` ahead, or with ``prefetch_batches: 0`` from ``on_after_batch_transfer``):
  ``torchvision.io.decode_jpeg(list, device=...)`` for the whole batch, the crop + bicubic (antialiased)
  resize of the whole batch (:func:`resized_crops`), then the augmentations batched *with per-sample
  parameters*, normalisation and random erasing. The same code runs with ``device='cpu'`` (the tests).
  Its device ops per batch are a fixed sequence: they depend neither on which RandAugment ops the images
  drew nor on the batch size (:func:`stage_op_counts` counts them; a test holds it), the per-batch
  parameters reach the device in two transfers (the augmentation plan, the erasing boxes), and nothing in
  the stage waits for the device. On CUDA the RandAugment layers replay CUDA graphs: by default the family-batched
  ops below (:class:`_AugmentGraphs`); with ``augment_impl="triton"`` each layer as two Triton kernels over the
  whole batch (:class:`_FusedLayer`, :mod:`.imagenet_triton`), all layers in one graph (:class:`_FusedGraphs`),
  and the crop + resize as two Triton kernels (``resized_crops(impl="triton")``) instead of batched GEMMs.
* **optionally, a share of the decoding in the workers** (``cpu_decode_fraction`` of the datamodule,
  ``cpu_fraction`` of :func:`collate_encoded`): the first images of each training batch are decoded, cropped,
  resized and flipped in the worker (:func:`decode_crop_cpu`) and reach the accelerator as uint8 pixels (pinned by
  the DataLoader), which then decodes only the rest; the augmentation runs on the accelerator for all.

Why not ``torchvision.transforms.v2.RandAugment`` / ``ColorJitter`` / ``RandomErasing`` on the batch: a
v2 transform draws one parameter set per call, so on a ``[B, 3, H, W]`` batch every image would get the
same op, magnitude and erasing box (a correlated batch, not the recipe), and v2's RandAugment differs from
timm's ``rand-m9-mstd0.5-inc1`` anyway (no Invert / SolarizeAdd, ops always applied instead of p=0.5, a
fixed magnitude on 31 bins instead of N(9, 0.5) on 10). Here each RandAugment layer runs once per op
*family* on the images that drew one of its ops, each image with its own op and argument (:class:`_Layer`):
the geometric ops as one ``grid_sample`` with per-image PIL affine matrices, Color / Sharpness as one blend
with a per-image degenerate image, every point op (AutoContrast, Equalize as torchvision's ``equalize``,
Invert, Posterize, Solarize, SolarizeAdd, Brightness, Contrast) as per-image ``ImageOps``-style lookup
tables and one ``take``; colour jitter (when on) the same way, one step at a time.

Differences to the CPU path (measured in ``tests/test_imagenet_gpu.py``):

* JPEG decoder (``jpeg_decoder``, :func:`decode_jpegs`): torchvision's nvJPEG on CUDA differs from PIL's libjpeg by
  3.3 levels on average, up to 30, more than 2 levels on half of the values (an H100, 32 synthetic 500x375 JPEGs;
  the chroma upsampling, most likely); nvImageCodec's hardware decoder by at most 1 level (mean 1e-4); libjpeg-turbo
  through torchvision on a CPU device by +-1-2 levels;
* the crop + resize's matrix products run in TF32 on CUDA (:func:`resized_crops`): a few percent of pixels
  (2.8% measured) 1 level off torchvision's float32 ``resized_crop`` (``augment_impl="triton"``: float32 sums, a
  rare tie off by one level); worker-decoded images use torchvision's
  uint8 resize (fixed-point weights): about a fifth of pixels 1 level off the float32 result, never more;
* geometric RandAugment ops (Rotate, ShearX/Y, TranslateX/YRel) use ``grid_sample`` (bicubic a=-0.75)
  where PIL uses a=-0.5; fill, centre convention and out-of-image test follow PIL;
* RandomErasing noise comes from a generator seeded per batch (the boxes are timm's draws).

Everything else (which op, magnitudes, crop boxes, flips, blend truncation, L = (19595 R + 38470 G + 7471 B
+ 2^15) >> 16 grey levels, autocontrast / posterize / solarize LUTs) follows the CPU path. A JPEG whose
header says CMYK / YCCK / P mode or no JPEG at all, or whose end-of-image marker is missing, is decoded by
PIL in the worker (corrupt: skipped and counted there) and re-encoded as an RGB JPEG of quality 95, so the
accelerator only sees RGB / greyscale JPEGs. A JPEG that still fails to decode on the accelerator is
retried alone, then with PIL, and otherwise skipped and counted (:data:`mixlab.datamodules.imagenet.SKIPPED`):
the batch then has one image less.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import io
import math
import os
import queue
import random
import sys
import threading
import time
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.profiler import record_function

__all__ = ["EncodedBatch", "TrainParams", "encode_sample", "collate_encoded", "decode_crop_cpu", "worker_decoded",
           "GpuPipeline", "RA_OPS", "apply_ra_op", "decode_jpegs", "aa_resample_weights", "aa_resample_windows",
           "resized_crops",
           "DevicePrefetcher", "quiet_profiler_without_cuda", "stage_op_counts", "JPEG_DECODERS", "AUGMENT_IMPLS",
           "nvimgcodec_available", "AugmentPlan", "AugmentPlanner"]

# RandAugment ops the accelerator implements (timm names); params carry their index, -1 = no op
RA_OPS = ("AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "PosterizeIncreasing", "PosterizeOriginal",
          "Solarize", "SolarizeIncreasing", "SolarizeAdd", "Color", "ColorIncreasing", "Contrast",
          "ContrastIncreasing", "Brightness", "BrightnessIncreasing", "Sharpness", "SharpnessIncreasing",
          "ShearX", "ShearY", "TranslateX", "TranslateY", "TranslateXRel", "TranslateYRel")
_GEOMETRIC = {"Rotate", "ShearX", "ShearY", "TranslateX", "TranslateY", "TranslateXRel", "TranslateYRel"}
_PIL_MODES = {0: "nearest", 2: "bilinear", 3: "bicubic"}  # PIL resampling code -> grid_sample mode


class _Recorder(list):
    """Stands in for the image in timm's RandAugment / RandomErasing: records what would be applied."""

    def __setitem__(self, key, value) -> None:  # RandomErasing: img[:, top:top + h, left:left + w] = pixels
        if isinstance(key, tuple):
            _, ys, xs = key
            self.append((ys.start, xs.start, ys.stop - ys.start, xs.stop - xs.start))
        else:
            super().__setitem__(key, value)


class _RecordOp:
    """A timm RandAugment op's ``aug_fn`` that records ``(name, argument, resample)`` on a :class:`_Recorder`
    (a class, not a closure: the parameters pickle to spawned workers)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, rec: _Recorder, *args, **kwargs) -> _Recorder:
        from timm.data.auto_augment import _interpolation

        # geometric ops draw the interpolation (random.choice when a list) as timm's _check_args_tf does
        resample = int(_interpolation(dict(kwargs))) if self.name in _GEOMETRIC else 0
        rec.append((self.name, float(args[0]) if args else 0.0, resample))
        return rec


class TrainParams:
    """Samples the random parameters of a timm training transform, as the transform itself would.

    Built from the ``Compose`` of :func:`mixlab.datamodules.imagenet.train_transform` (timm
    ``create_transform``); its steps must be RandomResizedCropAndInterpolation, RandomHorizontalFlip,
    RandAugment (timm), ColorJitter (brightness / contrast / saturation, no hue), MaybeToTensor, Normalize,
    RandomErasing (timm) in any subset. ``__call__(img)`` makes the same RNG calls in the same order as
    the transform would on ``img`` (Python ``random``, NumPy's and torch's global RNGs) but reads only
    ``img.size``, so a lazily opened PIL image (header only) is enough.

    Raises:
        NotImplementedError: a step the accelerator pipeline does not implement (names it).
    """

    def __init__(self, transform: Any) -> None:
        from timm.data.auto_augment import RandAugment

        self.rrc = self.flip_p = self.ra = self.jitter = self.eraser = None
        self.mean = self.std = None
        self.ra_layers = 0
        self.ra_families: set[str] = set()
        self.ra_modes: tuple[int, ...] = (3,)
        for t in transform.transforms:
            name = type(t).__name__
            if name == "RandomResizedCropAndInterpolation":
                if isinstance(t.interpolation, (list, tuple)):
                    raise NotImplementedError("decode='gpu': random crop interpolation is not implemented")
                self.rrc, self.size = t, tuple(t.size)
            elif name == "RandomHorizontalFlip":
                self.flip_p = float(t.p)
            elif isinstance(t, RandAugment):
                ops = []
                for op in t.ops:
                    if op.name not in RA_OPS:
                        raise NotImplementedError(f"decode='gpu': RandAugment op {op.name} is not implemented")
                    op = copy.copy(op)
                    op.aug_fn = _RecordOp(op.name)
                    ops.append(op)
                self.ra = RandAugment(ops, t.num_layers, t.choice_weights)
                self.ra_layers = int(t.num_layers)
                self.ra_families = {_FAMILY[op.name] for op in t.ops}
                res = [op.kwargs.get("resample", Image.BICUBIC) for op in t.ops]  # timm: one code or a random choice
                codes = {int(r) for v in res for r in (v if isinstance(v, (list, tuple)) else [v])}
                self.ra_modes = tuple(sorted(codes)) or (3,)  # PIL resampling codes the geometric ops can use
                self.fill = tuple(float(v) for v in t.ops[0].kwargs["fillcolor"]) if t.ops else (128.0,) * 3
            elif name == "ColorJitter":
                if t.hue is not None and tuple(t.hue) != (0, 0):
                    raise NotImplementedError("decode='gpu': ColorJitter hue is not implemented")
                self.jitter = t
            elif name == "RandomErasing":
                self.eraser = copy.copy(t)
                self.eraser.mode, self.eraser.per_pixel, self.eraser.rand_color = "const", False, False
                self.eraser.device = "cpu"
                if t.mode != "pixel" or t.num_splits > 1:
                    raise NotImplementedError("decode='gpu': RandomErasing implements mode='pixel' only")
            elif name == "Normalize":
                self.mean, self.std = tuple(float(v) for v in t.mean), tuple(float(v) for v in t.std)
            elif name not in ("MaybeToTensor", "ToTensor"):
                raise NotImplementedError(f"decode='gpu' does not implement the transform step {t!r}")
        if self.rrc is None:
            raise NotImplementedError("decode='gpu' needs a RandomResizedCrop first step")
        self.max_erase = self.eraser.max_count if self.eraser is not None else 0

    def __call__(self, img: Image.Image) -> dict[str, Tensor]:
        """Parameters of one sample (original size ``img.size`` = (W, H) pixels):

        * ``crop`` int64 ``[4]``: top, left, height, width of the crop in original pixels;
        * ``flip`` bool ``[]``;
        * ``ra_op`` int64 ``[L]`` (index in :data:`RA_OPS`, -1: none), ``ra_arg`` float64 ``[L]`` (timm's
          level argument: degrees, factor, fraction, bits, threshold or added levels), ``ra_interp`` int64
          ``[L]`` (PIL resampling code), in the order applied; ``L`` = RandAugment layers;
        * ``cj_order`` int64 ``[4]`` (0 brightness, 1 contrast, 2 saturation, 3 hue) and ``cj_factor``
          float64 ``[4]`` (1 = unchanged), when colour jitter is on;
        * ``erase`` int64 ``[max_count, 4]``: top, left, height, width in output pixels (height 0: none);
        * ``seed`` int64 ``[]``: for the erasing noise.
        """
        out: dict[str, Tensor] = {}
        i, j, h, w = self.rrc.get_params(img, self.rrc.scale, self.rrc.ratio)
        out["crop"] = torch.tensor([i, j, h, w], dtype=torch.int64)
        out["flip"] = torch.tensor(bool(self.flip_p is not None and torch.rand(1).item() < self.flip_p))
        if self.ra is not None:  # Python lists, one tensor per field: element-wise tensor writes cost ~3 us each
            rec = self.ra(_Recorder())
            op, arg, interp = [-1] * self.ra_layers, [0.0] * self.ra_layers, [0] * self.ra_layers
            for k, (name, a, r) in enumerate(rec):
                op[k], arg[k], interp[k] = RA_OPS.index(name), a, r
            out.update(ra_op=torch.tensor(op, dtype=torch.int64), ra_arg=torch.tensor(arg, dtype=torch.float64),
                       ra_interp=torch.tensor(interp, dtype=torch.int64))
        if self.jitter is not None:
            t = self.jitter
            order, b, c, s, _ = t.get_params(t.brightness, t.contrast, t.saturation, t.hue)
            out["cj_order"] = order.to(torch.int64)
            out["cj_factor"] = torch.tensor([1.0 if v is None else float(v) for v in (b, c, s)] + [0.0],
                                            dtype=torch.float64)
        if self.eraser is not None:
            rec = _Recorder()
            self.eraser._erase(rec, 3, self.size[0], self.size[1], torch.float32)
            boxes = [list(box) for box in rec] + [[0, 0, 0, 0]] * (self.max_erase - len(rec))
            out["erase"] = torch.tensor(boxes, dtype=torch.int64).view(self.max_erase, 4)
        out["seed"] = torch.tensor(random.getrandbits(62), dtype=torch.int64)
        return out


def _has_eoi(data: bytes) -> bool:
    return data.rstrip(b"\x00\r\n ")[-2:] == b"\xff\xd9"


def encode_sample(sample: dict, num_classes: int, params: TrainParams | None = None) -> dict | None:
    """Worker side of ``decode: gpu``: ``{"__key__", "jpg", "cls"}`` -> a dict with ``jpeg`` (uint8 ``[n]``,
    the encoded bytes), ``label`` (int), ``key`` (str) and, for training, the :class:`TrainParams` draws.

    Reads the JPEG header only. Not a JPEG, a colour mode other than RGB / L, or no end-of-image marker:
    PIL decodes the image fully here (corrupt or truncated data: skipped and counted, ``None`` returned,
    as :func:`mixlab.datamodules.imagenet.decode_sample`) and non-RGB/L or non-JPEG images are re-encoded
    as RGB JPEG (quality 95).

    Raises:
        ValueError: missing ``jpg``/``cls`` entry, a non-integer or out-of-range label (names key and shard).
    """
    from mixlab.datamodules.imagenet import _skip_corrupt, sample_image_and_label

    where, data, label = sample_image_and_label(sample, num_classes)
    try:
        img = Image.open(io.BytesIO(data))
        fmt, mode = img.format, img.mode
        if fmt != "JPEG" or mode not in ("RGB", "L") or not _has_eoi(data):
            full = img.convert("RGB")  # full decode: corrupt or truncated data raises here
            if fmt != "JPEG" or mode not in ("RGB", "L"):
                buf = io.BytesIO()
                full.save(buf, format="JPEG", quality=95)
                data = buf.getvalue()
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError ... for bad files
        _skip_corrupt(where, exc)
        return None
    out: dict[str, Any] = {"jpeg": torch.frombuffer(bytearray(data), dtype=torch.uint8), "label": label,
                           "key": where}
    if params is not None:
        out.update(params(img))
    return out


class EncodedBatch:
    """A batch of encoded images and their sampled parameters (CPU tensors; see :func:`collate_encoded`).

    Attributes:
        data: uint8 ``[N]``, the JPEG files of the images the accelerator decodes, one after another;
            offsets: int64 ``[B - P + 1]`` (that image ``b`` is ``data[offsets[b]:offsets[b + 1]]``).
        pixels: uint8 ``[P, 3, H, W]``: the batch's first ``P`` images, already decoded, cropped, resized and
            flipped in the DataLoader worker (``cpu_fraction`` of :func:`collate_encoded`), or None (``P = 0``).
        labels: int64 ``[B]``. keys: ``B`` names (``'key' in shard``) for warnings.
        params: name -> ``[B, ...]`` tensor (:meth:`TrainParams.__call__`); empty for evaluation.
        train: whether ``params`` hold training augmentation.
        plan: the batch's :class:`AugmentPlan`, made in the worker (:func:`collate_encoded` with a ``planner``), or
            None (the stage plans).

    A plain class, not a tuple or dataclass: Lightning's input conversion and device transfer leave it
    alone; the datamodule's ``transfer_batch_to_device`` moves ``labels`` only (``decode_jpeg`` reads CPU
    bytes) and ``on_after_batch_transfer`` turns it into ``(images, labels)``.

    Host memory: pickled (a DataLoader worker sending the batch to the training process), all of a host batch's
    tensors travel packed in ONE uint8 buffer and come back as views of it (:meth:`__getstate__`), so the training
    process maps one shared-memory segment per batch instead of one per tensor; :meth:`release` frees it with the
    GIL released. Both keep the Python work of the input off the training thread's GIL (BENCHMARKS.md, fortieth
    session: unpickling a batch of ~12 tensors and freeing them held the GIL ~6 ms per batch).
    """

    def __init__(self, data: Tensor, offsets: Tensor, labels: Tensor, keys: list[str], params: dict[str, Tensor],
                 train: bool, pixels: Tensor | None = None, plan: AugmentPlan | None = None) -> None:
        self.data, self.offsets, self.labels, self.keys, self.params, self.train = (data, offsets, labels, keys,
                                                                                      params, train)
        self.pixels, self.plan = pixels, plan
        self.transported = False  # unpacked from a worker's buffer (__setstate__): release() frees it
        self.pages_held = False  # device work may read the bytes after the stage returns (nvImageCodec: _hold)

    def _tensors(self) -> list[tuple[str, Tensor]]:
        """``(name, tensor)`` of every tensor the batch holds (params as ``params.<key>``, the plan's as
        ``plan.<attribute>``)."""
        named = [("data", self.data), ("offsets", self.offsets), ("labels", self.labels)]
        named += [(f"params.{k}", v) for k, v in self.params.items()]
        named += [(f"plan.{k}", v) for k, v in self.plan._tensors()] if self.plan is not None else []
        return named + ([("pixels", self.pixels)] if self.pixels is not None else [])

    def __getstate__(self) -> dict:
        """The batch's state with its host tensors packed into one contiguous uint8 buffer (each at an 8-byte
        aligned offset) and a layout ``(name, dtype, shape, offset)``: pickling sends one storage. A batch with a
        tensor on an accelerator pickles as it is."""
        state = dict(self.__dict__)
        named = self._tensors()
        if not all(t.device.type == "cpu" for _, t in named):
            return state
        layout, total = [], 0
        for name, t in named:
            total = -(-total // 8) * 8
            layout.append((name, t.dtype, tuple(t.shape), total))
            total += t.nbytes
        blob = torch.empty(total, dtype=torch.uint8)
        for (_, dtype, _, at), (_, t) in zip(layout, named):
            if t.numel():
                blob[at:at + t.nbytes].view(dtype).copy_(t.reshape(-1))
        for k in ("data", "offsets", "labels", "params", "pixels"):
            state.pop(k)
        if self.plan is not None:  # the plan without its tensors (they travel in the buffer)
            state["plan"] = copy.copy(self.plan)
            for name, _ in self.plan._tensors():
                setattr(state["plan"], name, None)
        state["_packed"] = (blob, layout)
        return state

    def __setstate__(self, state: dict) -> None:
        """Inverse of :meth:`__getstate__`: the tensors as views of the one buffer."""
        packed = state.pop("_packed", None)
        self.__dict__.update(state)
        if packed is None:
            return
        blob, layout = packed
        self.transported = True
        storage = blob.untyped_storage()
        self.params, self.pixels = {}, None
        for name, dtype, shape, at in layout:  # views of the storage itself (no base tensor: release() frees it)
            t = torch.empty(0, dtype=dtype).set_(storage, at // dtype.itemsize, shape)
            if name.startswith("params."):
                self.params[name.removeprefix("params.")] = t
            elif name.startswith("plan."):
                setattr(self.plan, name.removeprefix("plan."), t)
            else:
                setattr(self, name, t)

    def release(self) -> None:
        """Free the host memory of a batch that came from a DataLoader worker (:attr:`transported`; any other batch
        is the caller's own and is left as it is). Its one shared-memory buffer's pages go back to the system first
        (:func:`_give_back_pages`: ``madvise(MADV_REMOVE)`` through ctypes, which releases the GIL), unless
        :attr:`pages_held` (device work may still read them; they are freed with the last reference); then every
        host tensor is emptied by ``Tensor.set_()``. Freeing 20 MB of shared memory with the last reference holds
        the GIL (torch frees a storage with a Python object from that object's deallocation) and stalled the
        training thread ~2 ms per batch (BENCHMARKS.md, forty-first session). Call it only when nothing reads the
        batch's host tensors any more (the device stage has returned; copies from them were issued: CUDA copies
        from pageable memory return after staging it, pinned ``pixels`` are guarded by the caching host
        allocator). The batch is empty afterwards."""
        if not self.transported:
            return
        if not self.pages_held:
            _give_back_pages(self.data.untyped_storage())
        for _, t in self._tensors():
            if t.device.type == "cpu":
                t.set_()

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_decoded(self) -> int:
        """``P``: images decoded in the worker (the first ``P`` of the batch)."""
        return 0 if self.pixels is None else int(self.pixels.shape[0])

    def pin_memory(self) -> EncodedBatch:
        """The DataLoader's pin-memory thread calls this: the worker-decoded ``pixels`` and the plan's buffers go to
        page-locked memory (their copies to the device are then asynchronous); the bytes stay (``decode_jpeg`` reads
        them on the host)."""
        if self.pixels is not None and not self.pixels.is_pinned():
            self.pixels = self.pixels.pin_memory()
        if self.plan is not None:
            self.plan.pin_memory()
        return self

    def to(self, device: torch.device | str) -> EncodedBatch:
        """The batch with ``labels`` on ``device`` (bytes, pixels and parameters stay on the CPU)."""
        out = copy.copy(self)  # the same host tensors, plan and flags
        out.labels = self.labels.to(device, non_blocking=True)
        return out


_MADV_REMOVE = 9  # Linux <sys/mman.h>


@functools.lru_cache(maxsize=None)
def _libc() -> Any:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)  # a CDLL call releases the GIL
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _give_back_pages(storage: torch.UntypedStorage) -> bool:
    """Free the pages of a shared-memory ``storage`` now, with the GIL released: ``madvise(MADV_REMOVE)`` on the
    whole pages inside it (a tmpfs hole: the pages are freed and read back as zeros; a partial first or last page is
    kept). Linux only; returns whether the kernel did it (False elsewhere, for memory that is not shared, or if it
    refuses: nothing changes then)."""
    if not sys.platform.startswith("linux") or not storage.is_shared():
        return False
    page = os.sysconf("SC_PAGESIZE")
    start = -(-storage.data_ptr() // page) * page
    end = (storage.data_ptr() + storage.nbytes()) // page * page
    return end > start and _libc().madvise(start, end - start, _MADV_REMOVE) == 0


def decode_crop_cpu(jpeg: Tensor, crop: Tensor, flip: Tensor, size: tuple[int, int],
                    interpolation: str = "bicubic") -> Tensor:
    """One training image decoded and cropped on the CPU, as the accelerator does it for a batch: libjpeg-turbo
    (``torchvision.io.decode_jpeg``, RGB), crop ``crop`` (top, left, height, width), resize to ``size`` with
    antialiasing (``interpolation``: a ``torchvision.transforms.InterpolationMode`` value, e.g. ``"bicubic"``) and flip
    when ``flip``.

    Returns uint8 ``[3, size[0], size[1]]`` (:func:`resized_crops` computes the same resize in float32 and rounds).

    Raises:
        RuntimeError: data libjpeg-turbo cannot decode.
    """
    from torchvision.io import ImageReadMode, decode_jpeg
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.v2.functional import horizontal_flip, resized_crop

    t, le, h, w = crop.tolist()
    x = resized_crop(decode_jpeg(jpeg, mode=ImageReadMode.RGB), t, le, h, w, list(size),
                     interpolation=InterpolationMode(interpolation), antialias=True)
    return horizontal_flip(x) if bool(flip) else x


def worker_decoded(cpu_fraction: float, batch_size: int) -> int:
    """Images of a training batch of ``batch_size`` that the workers decode: ``round(cpu_fraction * batch_size)``."""
    return round(cpu_fraction * batch_size) if cpu_fraction > 0 else 0


def collate_encoded(samples: list[dict], cpu_fraction: float = 0.0, size: tuple[int, int] | None = None,
                    interpolation: str = "bicubic", planner: AugmentPlanner | None = None) -> EncodedBatch:
    """DataLoader ``collate_fn`` for :func:`encode_sample` outputs: bytes concatenated (one tensor per batch
    through the worker queue instead of ``B``), parameters stacked.

    With ``cpu_fraction > 0`` (training batches; ``size``: the crop's output size), the first
    ``round(cpu_fraction * B)`` (:func:`worker_decoded`) images are decoded, cropped, resized and flipped here, in
    the worker (:func:`decode_crop_cpu`), and travel as ``pixels``; the accelerator decodes the rest. This moves
    decode work from the accelerator to idle worker cores: a share that the workers keep up with shortens the device
    stage without slowing the loader. The batch is reordered so that the worker-decoded images come first (an image
    libjpeg-turbo refuses goes to the accelerator's decode, which retries it and skips it with a count).

    With a ``planner`` (:meth:`GpuPipeline.planner`), training batches also carry their augmentation's host plan
    (:class:`AugmentPlan`), made here instead of in the training process.
    """
    n_cpu = worker_decoded(cpu_fraction, len(samples)) if "crop" in samples[0] else 0
    pixels: Tensor | None = None
    if n_cpu:
        if size is None:
            raise ValueError("collate_encoded: cpu_fraction > 0 needs the crop's output size")
        done, failed = [], []
        for s in samples[:n_cpu]:
            try:
                done.append((s, decode_crop_cpu(s["jpeg"], s["crop"], s["flip"], tuple(size), interpolation)))
            except RuntimeError:  # left to the accelerator's decode (retried, else skipped and counted there)
                failed.append(s)
        samples = [s for s, _ in done] + failed + samples[n_cpu:]
        pixels = torch.stack([x for _, x in done]) if done else None
        n_cpu = len(done)
    jpegs = [s["jpeg"] for s in samples[n_cpu:]]
    offsets = torch.zeros(len(jpegs) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor([len(j) for j in jpegs], dtype=torch.int64).cumsum(0)
    names = [k for k in samples[0] if k not in ("jpeg", "label", "key") and not k.startswith("__")]  # wds adds __key__
    params = {k: torch.stack([s[k] for s in samples]) for k in names}
    data = torch.cat(jpegs) if jpegs else torch.zeros(0, dtype=torch.uint8)
    plan = planner(params) if planner is not None and names else None
    return EncodedBatch(data, offsets, torch.tensor([s["label"] for s in samples], dtype=torch.int64),
                        [s["key"] for s in samples], params, train=bool(names), pixels=pixels, plan=plan)


# ---------------------------------------------------------------------- accelerator side
_DECODE_STREAMS: dict[torch.device, Any] = {}


JPEG_DECODERS = ("torchvision", "nvimgcodec")
"""The accelerator's JPEG decoders (:func:`decode_jpegs`'s ``decoder``): ``"torchvision"``,
``torchvision.io.decode_jpeg`` (nvJPEG's default backend on CUDA: Huffman decoding on the host for small images,
the IDCT and colour conversion in CUDA kernels on the SMs); ``"nvimgcodec"``, NVIDIA nvImageCodec (``pip install
nvidia-nvimgcodec-cu13[nvjpeg]``), which sends each JPEG to the GPU's hardware JPEG decoder (NVJPG engines: A100,
H100, H200, ...) when the GPU has one and the file suits it, so that decoding leaves the SMs to the model, and to
nvJPEG's CUDA backends otherwise."""


NVIMGCODEC_MISSING = ("jpeg_decoder 'nvimgcodec' needs NVIDIA nvImageCodec: pip install "
                      "'nvidia-nvimgcodec-cu13[nvjpeg]' (or mixlab's extra '.[hwjpeg]'; cu12 for a CUDA 12 build of "
                      "torch), or set data.init_args.jpeg_decoder to torchvision")
"""The one error text for ``jpeg_decoder: nvimgcodec`` without nvImageCodec installed."""

AUGMENT_IMPLS = ("triton", "torch")  # GpuPipeline's augment_impl


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Whether Triton is installed (the Triton kernels of ``augment_impl="triton"``, :mod:`.imagenet_triton`; CUDA
    only). Looked up once per process: the stage asks at every batch."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def nvimgcodec_available() -> bool:
    """Whether nvImageCodec's Python package (``nvidia.nvimgcodec``) imports."""
    try:
        from nvidia import nvimgcodec  # noqa: F401
    except ImportError:
        return False
    return True


def decode_jpegs(data: Tensor, offsets: Tensor, device: torch.device, keys: list[str],
                 decoder: str = "torchvision") -> list[Tensor | None]:
    """Decode a batch of JPEGs to RGB uint8 ``[3, H_b, W_b]`` tensors on ``device``.

    ``decoder`` (:data:`JPEG_DECODERS`; CUDA only, a CPU device always uses torchvision's libjpeg-turbo):
    ``"torchvision"``: one batched ``torchvision.io.decode_jpeg`` call on the ``split`` of ``data`` (one op, no
    per-image slicing); ``"nvimgcodec"``: one batched nvImageCodec decode (:class:`_NvImageCodec`; planar images
    in its own buffers). Images the batched call does not decode (torchvision
    fails the whole batch; nvImageCodec returns None for the image) are decoded alone by torchvision, then by PIL;
    an image no decoder reads is skipped with a counted warning and its entry is ``None``.

    On CUDA the decode runs under a dedicated stream, which the caller's stream then waits for, and the images
    are marked as used by the caller's stream (``record_stream``). torchvision allocates the output images on
    the *current* stream but nvJPEG writes them on a stream of its own without waiting for the current one, so
    on the caller's stream it could write into memory that the caller's queued kernels still read (memory
    freed by the previous batch): on an H200, index tensors of the previous batch's crop were overwritten
    (``index_copy_(): index out of bounds``) when the stage ran ahead in the prefetch thread at 512 px.
    nvImageCodec's images live in its own stream-ordered pool, which ``record_stream`` does not reach: their
    user keeps them until the device has read them (:meth:`GpuPipeline.finish` holds them behind an event).

    Raises:
        ValueError: ``decoder`` not in :data:`JPEG_DECODERS`.
        ImportError: ``decoder="nvimgcodec"`` on CUDA without nvImageCodec installed.
    """
    if decoder not in JPEG_DECODERS:
        raise ValueError(f"decode_jpegs: decoder must be one of {JPEG_DECODERS}; got {decoder!r}")
    if device.type != "cuda":
        return _decode_jpegs(data, offsets, device, keys)
    caller = torch.cuda.current_stream(device)
    dec = _DECODE_STREAMS.get(device)
    if dec is None:
        dec = _DECODE_STREAMS[device] = torch.cuda.Stream(device)
    with torch.cuda.stream(dec):  # its memory pool holds only decoded images, each released after the caller's use
        imgs = (_decode_nvimgcodec(data, offsets, device, keys, dec) if decoder == "nvimgcodec" else
                _decode_jpegs(data, offsets, device, keys))
    caller.wait_stream(dec)
    for im in imgs:
        if im is not None:
            im.record_stream(caller)
    return imgs


def _decode_nvimgcodec(data: Tensor, offsets: Tensor, device: torch.device, keys: list[str],
                       stream: Any) -> list[Tensor | None]:
    """:func:`decode_jpegs` with nvImageCodec (:class:`_NvImageCodec`, on ``stream``); the images it returns None
    for are decoded alone by torchvision, then PIL, or skipped and counted (:func:`_decode_jpegs`)."""
    imgs = _NvImageCodec.get(device).decode(data, offsets, stream)
    missing = [k for k, im in enumerate(imgs) if im is None]
    if missing:
        idx = torch.tensor(missing)
        sub_off = torch.zeros(len(missing) + 1, dtype=torch.int64)
        sub_off[1:] = (offsets[idx + 1] - offsets[idx]).cumsum(0)
        sub = torch.cat([data[offsets[k]:offsets[k + 1]] for k in missing])
        for k, im in zip(missing, _decode_jpegs(sub, sub_off, device, [keys[k] for k in missing])):
            imgs[k] = im
    return imgs


class _NvImageCodec:
    """One nvImageCodec ``Decoder`` per CUDA device (:meth:`get`), built at first use: hardware JPEG decoding
    first (``HW_GPU_ONLY``, every image it takes), nvJPEG's CUDA and hybrid backends for the rest; RGB output
    without EXIF rotation (as ``torchvision.io.decode_jpeg`` and the CPU path's PIL). Calls are serialised (a
    lock): the training stage and an evaluation loader may share the device."""

    _decoders: dict[torch.device, _NvImageCodec] = {}
    _lock = threading.Lock()
    CPU_THREADS = 4  # its host threads (JPEG parsing, hybrid Huffman decoding); the DataLoader workers have the rest
    PLANAR = True  # ask for planar [3, H, W] images (the crop reads them without a per-image layout copy)

    def __init__(self, device: torch.device) -> None:
        try:
            from nvidia import nvimgcodec
        except ImportError as err:
            raise ImportError(NVIMGCODEC_MISSING) from err
        kind = nvimgcodec.BackendKind
        backends = [nvimgcodec.Backend(kind.HW_GPU_ONLY), nvimgcodec.Backend(kind.GPU_ONLY),
                    nvimgcodec.Backend(kind.HYBRID_CPU_GPU)]
        self.decoder = nvimgcodec.Decoder(device_id=device.index or 0, max_num_cpu_threads=self.CPU_THREADS,
                                          backends=backends)
        common = dict(color_spec=nvimgcodec.ColorSpec.SRGB, allow_any_depth=False, apply_exif_orientation=False)
        planar = getattr(getattr(nvimgcodec, "SampleFormat", None), "P_RGB", None)  # nvImageCodec >= 0.9
        self.planar = self.PLANAR and planar is not None
        self.params = nvimgcodec.DecodeParams(**common, **({"sample_format": planar} if self.planar else {}))
        self.device = device
        self.lock = threading.Lock()

    @classmethod
    def get(cls, device: torch.device) -> _NvImageCodec:
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        with cls._lock:
            if device not in cls._decoders:
                cls._decoders[device] = cls(device)
            return cls._decoders[device]

    def decode(self, data: Tensor, offsets: Tensor, stream: Any) -> list[Tensor | None]:
        """The JPEGs ``data[offsets[i]:offsets[i + 1]]`` (host uint8) decoded on ``stream``: uint8 ``[3, H, W]``
        device images (nvImageCodec's planar ``P_RGB`` buffers; with older releases, views of its ``[H, W, 3]``
        buffers), None where it could not decode the image (every entry None when it returned fewer images than it
        was given: the caller decodes them otherwise)."""
        buf = data.numpy()
        off = offsets.tolist()
        chunks = [buf[a:b] for a, b in zip(off[:-1], off[1:])]
        with self.lock:
            out = self.decoder.decode(chunks, params=self.params, cuda_stream=stream.cuda_stream)
        if len(out) != len(chunks):  # older nvImageCodec releases left out the images they could not decode
            return [None] * len(chunks)
        if self.planar:
            return [None if im is None else torch.as_tensor(im, device=self.device) for im in out]
        return [None if im is None else torch.as_tensor(im, device=self.device).permute(2, 0, 1) for im in out]


def _decode_jpegs(data: Tensor, offsets: Tensor, device: torch.device, keys: list[str]) -> list[Tensor | None]:
    from torchvision.io import ImageReadMode, decode_jpeg

    from mixlab.datamodules.imagenet import _skip_corrupt

    chunks = list(data.split(np.diff(offsets.numpy()).tolist()))
    try:
        return list(decode_jpeg(chunks, mode=ImageReadMode.RGB, device=device))
    except RuntimeError:
        pass
    out: list[Tensor | None] = []
    for chunk, key in zip(chunks, keys):
        try:
            out.append(decode_jpeg(chunk, mode=ImageReadMode.RGB, device=device))
            continue
        except RuntimeError:
            pass
        try:
            img = Image.open(io.BytesIO(chunk.numpy().tobytes())).convert("RGB")
            out.append(torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
                       .view(img.size[1], img.size[0], 3).permute(2, 0, 1).contiguous().to(device))
        except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError ... for bad files
            _skip_corrupt(key, exc, " (at accelerator decode; the batch is one image shorter)")
            out.append(None)
    return out


class _Upload:
    """Host-side (NumPy) parameters of one device stage gathered into ONE int64 buffer and copied to the
    device in one non-blocking transfer (pinned on CUDA); float64 arrays travel as their bits. ``add``
    returns a slot; ``to(device)`` returns the device tensors by slot (views of the one buffer: a ``split``
    and a ``view`` each, no kernels). :meth:`host` and :meth:`layout` are the buffer and what :func:`_uploaded`
    needs to make the same slots from it later (a plan made in a DataLoader worker: :class:`AugmentPlan`)."""

    def __init__(self) -> None:
        self.parts: list[tuple[np.ndarray, tuple[int, ...], bool]] = []

    def add(self, a: Any, dtype: Any = None) -> int:
        a = np.asarray(a, dtype=dtype)
        flt = a.dtype.kind == "f"
        a = np.ascontiguousarray(a, dtype=np.float64 if flt else np.int64)
        self.parts.append((a.reshape(-1).view(np.int64), a.shape, flt))
        return len(self.parts) - 1

    def layout(self) -> tuple[tuple[tuple[int, ...], bool], ...]:
        """The slots' shapes and kinds: equal layouts give equal offsets (:class:`_AugmentGraphs`)."""
        return tuple((shape, flt) for _, shape, flt in self.parts)

    def host(self) -> Tensor:
        """The parts as one int64 host tensor ``[total]``."""
        return torch.from_numpy(np.concatenate([p for p, _, _ in self.parts]) if self.parts
                                else np.zeros(0, np.int64))

    def to(self, device: torch.device, out: Tensor | None = None) -> list[Tensor]:
        """The slots on ``device`` (:func:`_uploaded` of :meth:`host` and :meth:`layout`)."""
        return _uploaded(self.host(), self.layout(), device, out)


def _uploaded(buf: Tensor, layout: tuple[tuple[tuple[int, ...], bool], ...], device: torch.device,
              out: Tensor | None = None) -> list[Tensor]:
    """The slots of an :class:`_Upload` (host buffer ``buf``, int64 ``[total]``, and its ``layout``) on ``device``:
    views of one fresh int64 buffer, or of ``out`` (int64, exactly ``buf``'s length) after one copy into it (a
    buffer that CUDA graphs read). On CUDA the copy is non-blocking from page-locked memory (``buf`` pinned here
    unless it is already).

    Raises:
        ValueError: ``out`` of another length than ``buf``."""
    if device.type == "cuda" and not buf.is_pinned():
        buf = buf.pin_memory()
    if out is not None:
        if out.shape != buf.shape:
            raise ValueError(f"_Upload.to: out holds {out.numel()} values, the parts {buf.numel()}")
        buf = out.copy_(buf, non_blocking=True)
    else:
        buf = buf.to(device, non_blocking=True)
    segs = buf.split([math.prod(shape) for shape, _ in layout])
    return [s.view(torch.float64).view(shape) if flt else s.view(shape) for s, (shape, flt) in zip(segs, layout)]


def _cubic_aa(x: Tensor) -> Tensor:
    """The bicubic filter of antialiased resampling (Keys, ``a = -0.5``: PIL's and torch's ``antialias=True``)."""
    a = -0.5
    x = x.abs()
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return torch.where(x < 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


def _window_taps(max_scale: float, n_max: int) -> int:
    """Taps enough for every window of :func:`aa_resample_weights` with scales ``in / resized <= max_scale``:
    a window ``[trunc(c - 2 t + 1/2), trunc(c + 2 t + 1/2))`` (``t = max(s, 1)``) clipped to the image holds at
    most ``ceil(4 t)`` pixels; +2 absorbs the rounding of ``s`` between host and device; never more than
    ``n_max`` (a window lies inside its image)."""
    return max(1, min(math.ceil(4 * max(float(max_scale), 1.0)) + 2, int(n_max)))


def _round4(n: int) -> int:
    """``n`` rounded up to a multiple of 4 (float32 rows of a multiple of 16 bytes)."""
    return -(-n // 4) * 4


def _normalise(w: Tensor) -> Tensor:
    """Rows of ``w`` divided by their sums (last dim); an all-zero row stays zero."""
    s = w.sum(-1, keepdim=True)
    return w / torch.where(s == 0, 1.0, s)


def aa_resample_weights(in_sizes: Tensor, out_size: int, n_max: int, resized: Tensor | None = None,
                        offsets: Tensor | None = None, taps: int | None = None, flip: Tensor | None = None) -> Tensor:
    """Resampling matrices of ``interpolate(mode="bicubic", antialias=True, align_corners=False)`` along one
    axis: float32 ``[n, out_size, n_max]`` on ``in_sizes``' device (row ``o`` of matrix ``b`` holds the
    weights of input pixels ``0 .. in_sizes[b] - 1`` for output pixel ``o``; zero beyond ``in_sizes[b]``).
    With ``resized`` (int ``[n]``) and ``offsets`` (int ``[n]``) the input is resized to ``resized[b]``
    pixels and rows ``offsets[b] .. offsets[b] + out_size - 1`` of that are returned (a resize followed by a
    crop, as ``Resize`` + ``CenterCrop``). With ``flip`` (bool or int ``[n]``) the rows of matrix ``b`` are
    reversed where ``flip[b]``: row ``o`` holds output pixel ``offsets[b] + out_size - 1 - o`` (a horizontal
    flip of the result, without a pass over the matrix).

    The filter support, window and normalisation follow ATen's ``_compute_indices_min_size_weights_aa``
    (PIL's ``ImagingResample``): scale ``s = in / out``, centre ``c = s (o + 1/2)``, support ``2 max(s, 1)``,
    window ``[lo, hi) = [trunc(c - support + 1/2), trunc(c + support + 1/2))`` clipped to the image, weights
    ``cubic((j - c + 1/2) / max(s, 1))`` normalised to sum 1 (a row with an empty window, which only a row past
    the resized input can have, is zero).

    The weights are computed on each row's window only: float64 ``[n, out_size, taps]`` for input pixels ``j = lo + k``,
    ``k < taps`` (zero where ``j >= hi``), normalised there, then scattered as float32 (one ``scatter_``, each row's
    indices distinct) into a zero matrix ``[n, out_size, n_max + taps]`` (its width rounded up to a multiple of 4: rows
    of a multiple of 16 bytes, so that cuBLAS takes its aligned TF32 kernels for a GEMM on the view) whose first
    ``n_max`` columns are returned (a view). ``taps`` must be at least the widest window: ``ceil(4 max(s, 1)) + 2`` over
    the rows is (:func:`_window_taps`, on the host from the sizes; no device value is read). When None: derived from
    ``n_max / out_size`` if ``resized`` is None (``in_sizes <= n_max``), else the weights are computed densely on
    ``[n, out_size, n_max]`` in float64 (the same values; the sums differ only in summation order).
    """
    if taps is None and resized is None:
        taps = _window_taps(n_max / out_size, n_max)
    if taps is None:  # dense: every input pixel of every row
        size, centre, stretch, lo, hi = _aa_windows(in_sizes, out_size, resized, offsets, flip)
        j = torch.arange(n_max, device=in_sizes.device, dtype=torch.float64).view(1, 1, -1)
        w = _cubic_aa((j - centre + 0.5) / stretch) * ((j >= lo) & (j < hi))
        return _normalise(w).to(torch.float32)
    start, w = aa_resample_windows(in_sizes, out_size, taps, resized, offsets, flip)
    j = start.unsqueeze(-1) + torch.arange(taps, device=in_sizes.device)  # [n, out, taps]: < n_max + taps
    dense = torch.zeros(in_sizes.shape[0], out_size, _round4(n_max + taps), device=in_sizes.device,
                        dtype=torch.float32)
    return dense.scatter_(2, j, w)[..., :n_max]


def _aa_windows(in_sizes: Tensor, out_size: int, resized: Tensor | None, offsets: Tensor | None,
                flip: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """float64 ``[n, 1, 1]`` input sizes and ``[n, out_size, 1]`` filter centres, stretches ``max(s, 1)`` and
    windows ``[lo, hi)`` of :func:`aa_resample_weights` (its docstring gives the formulas)."""
    dev = in_sizes.device
    size = in_sizes.to(torch.float64).view(-1, 1, 1)
    scale = size / (out_size if resized is None else resized.to(dev, torch.float64).view(-1, 1, 1))
    stretch = scale.clamp_min(1.0)  # support / 2 and the filter's stretch: max(s, 1)
    o = torch.arange(out_size, device=dev, dtype=torch.float64).view(1, -1, 1)
    if flip is not None:
        o = torch.where(flip.to(dev).view(-1, 1, 1) != 0, (out_size - 1) - o, o)
    if offsets is not None:
        o = o + offsets.to(dev, torch.float64).view(-1, 1, 1)
    centre = scale * (o + 0.5)
    lo = (centre - 2 * stretch + 0.5).trunc().clamp_min(0)
    hi = torch.minimum((centre + 2 * stretch + 0.5).trunc(), size)
    return size, centre, stretch, lo, hi


def aa_resample_windows(in_sizes: Tensor, out_size: int, taps: int, resized: Tensor | None = None,
                        offsets: Tensor | None = None, flip: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The rows of :func:`aa_resample_weights` on their windows only: ``(start, w)``, int64 ``[n, out_size]``, the
    first input pixel of each row's window (``lo`` clipped to the input size), and float32 ``[n, out_size, taps]``,
    the weights of input pixels ``start .. start + taps - 1`` (zero from the window's end ``hi`` on; normalised
    in float64 over the window, then rounded). Arguments as :func:`aa_resample_weights`; ``taps`` at least the widest
    window (:func:`_window_taps`)."""
    size, centre, stretch, lo, hi = _aa_windows(in_sizes, out_size, resized, offsets, flip)
    j = torch.minimum(lo, size) + torch.arange(taps, device=in_sizes.device, dtype=torch.float64)  # [n, out, taps]
    w = _normalise(_cubic_aa((j - centre + 0.5) / stretch) * (j < hi)).to(torch.float32)
    return j[..., 0].to(torch.int64), w


@contextlib.contextmanager
def _tf32_matmul(enabled: bool) -> Iterator[None]:
    """Lets the CUDA float32 matmuls inside use TF32 tensor cores, then restores the caller's setting exactly: the
    legacy level (``torch.get_float32_matmul_precision``) and the ``fp32_precision`` entries that setting
    ``allow_tf32`` and restoring that level write (``cuda`` / ``mkldnn`` matmul, torch >= 2.9). Nothing changes
    where TF32 is already on, or where the caller mixed the legacy and new APIs so that the setting cannot be
    read (torch raises there): the matmuls then run at the caller's precision.

    The setting is process-wide (ATen's global context): a float32 CUDA matmul that ANOTHER thread dispatches
    while this one is inside (a few tens of microseconds of host time: the two GEMM launches) also runs in TF32.
    """
    m = torch.backends.cuda.matmul
    if not enabled:
        yield
        return
    try:
        if m.allow_tf32:
            enabled = False
        else:
            legacy = torch.get_float32_matmul_precision()
            get = getattr(torch._C, "_get_fp32_precision_getter", None)
            new = [(b, get(b, "matmul")) for b in ("cuda", "mkldnn")] if get is not None else []
    except RuntimeError:  # mixed legacy / new API settings: leave them alone
        enabled = False
    if not enabled:
        yield
        return
    m.allow_tf32 = True
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(legacy)
        for backend, value in new:
            torch._C._set_fp32_precision_setter(backend, "matmul", value)


# crop/resize: a batch is split into this many groups of similar crop size (fewer only for fewer images), each
# padded to its largest crop; a FIXED number, so the stage's op count does not depend on the batch. More groups
# pad less but dispatch more (13 ops each). Measured on an H200 (256 ImageNet-sized JPEGs -> 224 px, TF32; host /
# device ms per batch): 1 group 2.59 / 2.59, 2 groups 2.79 / 2.31, 3 groups 3.07 / 2.19, 4 groups 3.25 / 2.22.
RESIZE_GROUPS = 2
# relative cost of one padded input pixel and channel (its gather, float32 copy and GEMM read: ~9 bytes) in
# multiply-adds of the GEMMs, for the split: about an H200's TF32 tensor-core rate over its memory bandwidth
_PIXEL_MACS = 256


def _resize_cost(hm: np.ndarray, wm: np.ndarray, oh: int, ow: int) -> tuple[np.ndarray, np.ndarray]:
    """Multiply-adds per image and channel of resizing a padded ``hm x wm`` crop to ``oh x ow``: (cheaper order's
    GEMMs + :data:`_PIXEL_MACS` per padded pixel, rows-first cheaper?). Rows first: ``(Wy X) Wx^T`` costs ``oh wm
    (hm + ow)``; columns first: ``Wy (X Wx^T)`` costs ``hm ow (wm + oh)``."""
    rows, cols = oh * wm * (hm + ow), hm * ow * (wm + oh)
    return np.minimum(rows, cols) + _PIXEL_MACS * hm * wm, rows <= cols


def _split_groups(h: np.ndarray, w: np.ndarray, size: tuple[int, int], k: int, max_bytes: int) -> list[tuple[int, int]]:
    """Split crops sorted by area (heights ``h``, widths ``w``) into ``k`` runs ``[start, end)`` minimising the
    padded resize cost (:func:`_resize_cost` of each run's largest height and width, times its crops), each
    run's float32 copy ``3 hm wm 4`` bytes per crop within ``max_bytes`` (a single crop always fits).

    Dynamic programming over run boundaries on a grid of ``ceil(n / M)``-crop cells (``M = max(64, k)``: the host
    work stays small for any batch); when no ``k`` runs fit ``max_bytes``, runs are grown greedily up to
    ``max_bytes`` instead (more runs: only for very large crops)."""
    n = len(h)
    if k == 1 and 12 * int(h.max()) * int(w.max()) * n <= max_bytes:
        return [(0, n)]
    step = max(1, n // max(64, k))
    cells = np.arange(0, n, step)
    m = len(cells)
    ends = np.append(cells[1:], n)  # cell c holds crops cells[c] .. ends[c] - 1
    hc, wc = np.maximum.reduceat(h, cells), np.maximum.reduceat(w, cells)
    upper = np.triu(np.ones((m, m), dtype=bool))  # [a, b]: the run of cells a .. b
    hm = np.maximum.accumulate(np.where(upper, hc[None, :], 0), axis=1)
    wm = np.maximum.accumulate(np.where(upper, wc[None, :], 0), axis=1)
    count = ends[None, :] - cells[:, None]
    cost = count * _resize_cost(hm, wm, *size)[0].astype(np.float64)
    cost[~upper | ((count * 12 * hm * wm > max_bytes) & (count > 1))] = np.inf
    best, arg = cost[0], [np.zeros(m, dtype=np.int64)]  # best[b]: runs ending with cell b, the first from cell 0
    for _ in range(1, k):
        prev = np.concatenate([[np.inf], best[:-1]])  # prev[a]: runs covering cells 0 .. a - 1
        total = prev[:, None] + cost
        arg.append(total.argmin(0))
        best = total[arg[-1], np.arange(m)]
    if not np.isfinite(best[-1]):  # greedy by the byte cap
        runs, start = [], 0
        while start < n:
            end, hmax, wmax = start + 1, h[start], w[start]
            while end < n and (end - start + 1) * 12 * max(hmax, h[end]) * max(wmax, w[end]) <= max_bytes:
                hmax, wmax, end = max(hmax, h[end]), max(wmax, w[end]), end + 1
            runs.append((start, end))
            start = end
        return runs
    runs, b = [], m - 1
    for a_of in reversed(arg):
        a = int(a_of[b])
        runs.append((int(cells[a]), int(ends[b])))
        b = a - 1
    return runs[::-1]


def _host_array(t: Tensor, dtype: Any) -> np.ndarray:
    """A NumPy copy of ``t`` (host or device) as ``dtype``: ``Tensor.numpy`` for host tensors (``tolist`` makes a
    Python object per element, under the GIL)."""
    return np.array(t.numpy() if t.device.type == "cpu" else t.tolist(), dtype=dtype)


def resized_crops(imgs: list[Tensor], boxes: Tensor, size: tuple[int, int], flip: Tensor | None = None,
                  max_bytes: int = 1 << 30, resized: Tensor | None = None, offsets: Tensor | None = None,
                  tf32: bool = True, groups: int = RESIZE_GROUPS, out: Tensor | None = None,
                  impl: str = "gemm") -> Tensor:
    """Crop box ``b`` of image ``b``, resize it to ``size`` (bicubic, antialiased) and flip it horizontally
    where ``flip[b]``, for a whole batch in a few batched matrix products instead of one resize per image.

    Antialiased resampling is separable: ``out = Wy @ crop @ Wx^T`` with the :func:`aa_resample_weights` matrices
    (float32; a flip reverses ``Wx``'s rows). The crops, sorted by area, are split into ``groups`` groups (fewer only
    for fewer images; more only where a group's padded float32 copy would exceed ``max_bytes``) chosen to minimise the
    padded work (:func:`_split_groups`); each group is padded to its largest crop height ``hm`` and width ``wm``
    (rounded up to a multiple of 4, as the weights' row length: the GEMMs' leading dimensions are 16-byte multiples,
    which cuBLAS's aligned TF32 kernels need) and runs two batched GEMMs in the cheaper order for those sizes: rows
    first ``(Wy X) Wx^T`` (``oh wm (hm + ow)`` multiply-adds per image and channel) or columns first ``Wy (X Wx^T)``
    (``hm ow (wm + oh)``). The three channels of a crop share its matrices: ``X`` is laid out ``[hm, 3, wm]`` so that
    each GEMM is one ``bmm`` over the group without broadcast copies.

    Equals ``torchvision.transforms.functional.resized_crop(img, *box, size, BICUBIC, antialias=True)`` on
    uint8 images (rounded and clamped to 0..255) up to float32 summation order, except for TF32 on CUDA:

    * ``tf32=True`` (default) runs the two GEMMs on CUDA with TF32 tensor cores (:func:`_tf32_matmul`, the
      caller's precision setting restored afterwards; no effect on the CPU). TF32 keeps 10 mantissa bits of
      each GEMM input: the uint8 levels (8 bits) are exact, the weights and the first GEMM's intermediate
      are rounded to ~2^-11 relative (up to ~0.1 level at 255), so a few percent of output pixels differ by
      one level after rounding, never more (H200, 256 ImageNet-sized crops to 224 px: 2.8% of pixels off by 1,
      mean -7e-4 levels; the same on noise images; ``tests/test_imagenet_gpu.py``'s CUDA test), less than the
      nvJPEG vs PIL decoder difference (+-1-2 levels) listed in the module docstring. Device time of the step
      there: 2.2-2.3 ms per batch with TF32, 3.2 ms without (float32 FFMA), 10.5 ms before the windowed weights.
    * ``tf32=False``: float32 FMA GEMMs (several times slower on the tensor-core GPUs).

    No per-image device op: the images are concatenated into one flat buffer (one call) and each group's
    padded crops are read from it with ONE ``index_select`` of crop rows from a sliding-window view of that
    buffer (row ``r`` of the view = the ``wm`` values from offset ``r`` on). Values a padded row reads beyond
    its crop (the next pixels, the next image, a zero tail) meet zero weights in ``Wx`` / ``Wy``. The row
    offsets and sizes reach the device in one transfer per call; the number of taps of the weights' windows
    is computed on the host from the sizes.

    Args:
        imgs: ``B`` uint8 ``[3, H_b, W_b]`` tensors on one device.
        boxes: int64 ``[B, 4]``: top, left, height, width of each crop in its image's pixels.
        size: output (height, width).
        flip: bool ``[B]`` or None.
        max_bytes: cap on a group's padded float32 crops (``3 hm wm 4`` bytes per image; ``impl="triton"``: on a
            run's scratch).
        resized, offsets: int64 ``[B, 2]`` or None: resize each crop to ``resized[b]`` (height, width) and
            keep the ``size`` window at ``offsets[b]`` (top, left) of it (evaluation: ``Resize`` then
            ``CenterCrop``); default: resize to ``size`` itself.
        tf32: TF32 GEMMs on CUDA (see above).
        groups: number of size groups (:data:`RESIZE_GROUPS`).
        out: float32 ``[B, 3, size[0], size[1]]`` on the images' device to write the result into (e.g. a
            buffer that CUDA graphs read), or None for a new tensor.
        impl: ``"gemm"`` (default), the batched GEMMs above; ``"triton"``, two Triton kernels over the whole
            batch (:func:`.imagenet_triton.crop_resize`: each output pixel sums its window's taps in float32, no
            TF32, no size groups or padding; ``tf32`` and ``groups`` do not apply; ``max_bytes`` caps its float32
            scratch, ``3 size[1] 4`` bytes per crop row, by running the images in more launches). Triton runs on
            CUDA, or on the CPU under ``TRITON_INTERPRET=1`` (tests).

    Returns:
        float32 ``[B, 3, size[0], size[1]]`` with integer values 0..255 (``out`` when given).

    Raises:
        ValueError: ``out`` of another shape or dtype (with ``impl="triton"``: not contiguous); ``impl`` not
            ``"gemm"`` or ``"triton"``.
    """
    if impl not in ("gemm", "triton"):
        raise ValueError(f"resized_crops: impl must be 'gemm' or 'triton'; got {impl!r}")
    n = len(imgs)
    dev = imgs[0].device if n else torch.device("cpu")
    oh, ow = size
    mo = max(oh, ow)  # rows of the weight matrices (both axes in one call)
    if out is None:
        out = torch.empty(n, 3, oh, ow, device=dev, dtype=torch.float32)
    elif out.shape != (n, 3, oh, ow) or out.dtype != torch.float32 or (impl == "triton" and not out.is_contiguous()):
        raise ValueError(f"resized_crops: out must be float32 {[n, 3, oh, ow]}" + (", contiguous" if impl == "triton"
                         else "") + f"; got {out.dtype} {list(out.shape)} strides {out.stride()}")
    if n == 0:
        return out
    bx = _host_array(boxes, np.int64).reshape(n, 4)
    hw = np.array([(im.size(-2), im.size(-1)) for im in imgs], dtype=np.int64)
    base = np.concatenate([[0], np.cumsum(3 * hw[:, 0] * hw[:, 1])[:-1]])
    rs = _host_array(resized, np.int64).reshape(n, 2) if resized is not None else np.tile([oh, ow], (n, 1))
    off = _host_array(offsets, np.int64).reshape(n, 2) if offsets is not None else np.zeros((n, 2), np.int64)
    fl = _host_array(flip, bool).reshape(n) if flip is not None else np.zeros(n, bool)
    if impl == "triton":
        return _resized_crops_triton(imgs, bx, hw, base, rs, off, fl, out, max_bytes)
    order = np.argsort(bx[:, 2] * bx[:, 3], kind="stable")  # everything below in this order
    runs = _split_groups(bx[order, 2], bx[order, 3], size, min(groups, n), max_bytes)
    t, le, h, w = bx[order].T
    base, (height, width), rs, off, fl = base[order], hw[order].T, rs[order], off[order], fl[order]
    up = _Upload()
    plan, axes = [], []
    for start, end in runs:
        s = slice(start, end)
        hm, wm = int(h[s].max()), _round4(int(w[s].max()))  # wm: the GEMMs' leading dimension, 16-byte rows
        # flat offsets of each padded crop row (rows past the crop repeat its last row: zero weights) [g, hm, 1] and
        # of each channel [g, 1, 3]
        rows = (base[s] + t[s] * width[s] + le[s])[:, None] + np.minimum(np.arange(hm), h[s, None] - 1) * width[s, None]
        chans = np.arange(3) * (height[s] * width[s])[:, None]
        axes.append(_window_axes(h[s], w[s], rs[s], off[s], fl[s], ow - mo))
        plan.append((start, end - start, hm, wm, bool(_resize_cost(np.array(hm), np.array(wm), oh, ow)[1]),
                     up.add(rows[:, :, None]), up.add(chans[:, None, :])))
    axes = np.concatenate(axes, 1)  # [4, 2 B]: group by group, its y rows then its x rows
    taps = _window_taps((axes[0] / axes[1]).max(), int(axes[0].max()))
    s_order, s_axes = up.add(order), up.add(axes)
    segs = up.to(dev)
    # planar [3, H, W] images one after another (C++ loop: one op from Python; CPU decoder's [H, W, 3]-strided
    # views are made planar there), then a zero tail for the last windows
    from torch._utils import _flatten_dense_tensors

    flat = _flatten_dense_tensors(imgs + [torch.zeros(max(p[3] for p in plan), dtype=torch.uint8, device=dev)])
    size_, res, offs, flips = segs[s_axes].unbind(0)
    wyx = aa_resample_weights(size_, mo, _round4(int(axes[0].max())), res, offs, taps, flips)  # [2 B, mo, n]
    st = wyx.stride()
    y = torch.empty(n, oh, 3, ow, device=dev, dtype=torch.float32)  # images in sorted order
    for start, g, hm, wm, rows_first, s_rows, s_chans in plan:
        starts = segs[s_rows] + segs[s_chans]  # [g, hm, 3]
        x = flat.unfold(0, wm, 1).index_select(0, starts.view(-1)).float()  # [(g, hm, 3), wm]
        # this group's matrices (one strided view each: a fixed op count, whatever the sizes)
        wy = wyx.as_strided((g, oh, hm), st, wyx.storage_offset() + 2 * start * st[0])  # [g, oh, hm]
        wxt = wyx.as_strided((g, wm, ow), (st[0], st[2], st[1]), wyx.storage_offset() + (2 * start + g) * st[0])
        yg = y.narrow(0, start, g)
        with _tf32_matmul(tf32 and dev.type == "cuda"):
            if rows_first:  # (Wy X) Wx^T: [g, oh, (3, wm)] -> [g, (oh, 3), wm] @ [g, wm, ow]
                tmp = torch.bmm(wy, x.view(g, hm, 3 * wm))
                torch.bmm(tmp.view(g, oh * 3, wm), wxt, out=yg.view(g, oh * 3, ow))
            else:  # Wy (X Wx^T): [g, (hm, 3), wm] @ [g, wm, ow] -> [g, hm, (3, ow)]
                tmp = torch.bmm(x.view(g, hm * 3, wm), wxt)
                torch.bmm(wy, tmp.view(g, hm, 3 * ow), out=yg.view(g, oh, 3 * ow))
    return out.index_copy_(0, segs[s_order], y.round_().clamp_(0, 255).permute(0, 2, 1, 3))


def _window_axes(h: np.ndarray, w: np.ndarray, rs: np.ndarray, off: np.ndarray, fl: np.ndarray,
                 flip_shift: int) -> np.ndarray:
    """int64 ``[4, 2 n]``: the arguments of :func:`aa_resample_weights` for ``n`` crops computed with ``mo = max(oh,
    ow)`` rows, their y axes then their x axes: crop size, resized size, window offset, flip. A flipped x row ``o``
    holds pixel ``off + ow - 1 - o = (off + ow - mo) + mo - 1 - o``: its offset is shifted by ``flip_shift = ow -
    mo``."""
    return np.stack([np.concatenate([h, w]), np.concatenate([rs[:, 0], rs[:, 1]]),
                     np.concatenate([off[:, 0], off[:, 1] + np.where(fl, flip_shift, 0)]),
                     np.concatenate([np.zeros_like(fl), fl]).astype(np.int64)])


def _resized_crops_triton(imgs: list[Tensor], bx: np.ndarray, hw: np.ndarray, base: np.ndarray, rs: np.ndarray,
                          off: np.ndarray, fl: np.ndarray, out: Tensor, max_bytes: int) -> Tensor:
    """:func:`resized_crops` with ``impl="triton"`` (:func:`.imagenet_triton.crop_resize`), from its host arrays:
    boxes ``bx`` ``[n, 4]``, image sizes ``hw`` ``[n, 2]``, flat offsets ``base`` ``[n]``, resized sizes ``rs`` and
    window offsets ``off`` ``[n, 2]``, flips ``fl`` ``[n]``; into ``out`` (contiguous ``[n, 3, OH, OW]``). The images
    go in runs whose float32 scratch (``3 OW`` floats per crop row) stays within ``max_bytes`` (one image at least):
    one run for a training batch (~170 MB at 224 px), more for evaluation batches of very large images."""
    from torch._utils import _flatten_dense_tensors

    from mixlab.datamodules.imagenet_triton import crop_resize

    n, _, oh, ow = out.shape
    mo = max(oh, ow)
    t, le, h, w = bx.T
    floats = 3 * ow * h  # scratch per image
    runs, start_img, used = [], 0, 0
    for k in range(n) if 4 * int(floats.sum()) > max_bytes else ():  # one run when it all fits (training batches)
        if k > start_img and 4 * (used + floats[k]) > max_bytes:
            runs.append((start_img, k))
            start_img, used = k, 0
        used += floats[k]
    runs.append((start_img, n))
    tbase = np.zeros(n, np.int64)
    for a, b in runs:
        tbase[a + 1:b] = np.cumsum(floats[a:b - 1])
    up = _Upload()
    s_meta = up.add(np.stack([base, hw[:, 1], hw[:, 0] * hw[:, 1], t, le, h, w, tbase], 1))
    axes = _window_axes(h, w, rs, off, fl, ow - mo)
    s_axes = up.add(axes)
    segs = up.to(out.device)
    size_, res, offs, flips = segs[s_axes].unbind(0)
    taps = _window_taps((axes[0] / axes[1]).max(), int(axes[0].max()))
    start, wts = aa_resample_windows(size_, mo, taps, res, offs, flips)  # [2 n, ...]: the y rows, then the x rows
    flat, meta = _flatten_dense_tensors(imgs), segs[s_meta]
    for a, b in runs:
        crop_resize(flat, meta[a:b], start[a:b], wts[a:b], start[n + a:n + b], wts[n + a:n + b], int(h[a:b].sum()),
                    int(h[a:b].max()), out[a:b])
    return out


def _gray(x: Tensor) -> Tensor:
    """PIL's ``convert('L')``: ``(19595 R + 38470 G + 7471 B + 2^15) >> 16``; x float ``[n, 3, H, W]`` in
    0..255 (integers) -> ``[n, 1, H, W]`` (exact in float32)."""
    r, g, b = x.unbind(1)
    return torch.floor((19595 * r + 38470 * g + 7471 * b + 32768) / 65536).unsqueeze(1)


def _blend(degenerate: Tensor, x: Tensor, factor: Tensor) -> Tensor:
    """PIL ``Image.blend(degenerate, x, factor)`` on 0..255 floats: ``trunc(d + f (x - d))`` clipped;
    ``factor`` float32 broadcastable to ``x`` (one per image: ``[n, 1, 1, 1]``)."""
    return (degenerate + factor * (x - degenerate)).clamp(0, 255).floor()


def _smooth(x: Tensor) -> Tensor:
    """PIL ``ImageFilter.SMOOTH`` (3x3 kernel [1 1 1; 1 5 1; 1 1 1] / 13, rounded; border pixels kept).

    The integer kernel sums exactly (also under TF32 convolutions) and is divided by 13 afterwards: a sum
    / 13 is never within 1/26 of a rounding tie, so float32 rounding cannot move the result."""
    k = torch.ones(3, 1, 3, 3, dtype=x.dtype, device=x.device)
    k[:, :, 1, 1].fill_(5)  # a Python number: `k[...] = 5` fills from a CPU 0-dim tensor, an `item()` (no device wait)
    out = x.clone()
    out[..., 1:-1, 1:-1] = torch.nn.functional.conv2d(x, k, groups=3).div_(13).add_(0.5).floor_().clamp_(0, 255)
    return out


def _pil_affine(x: Tensor, m: Tensor, modes: tuple[int, ...], fill: Tensor, mode_idx: Tensor | None = None) -> Tensor:
    """PIL ``Image.transform(size, AFFINE, m)`` for a batch: output pixel centre ``(X + .5, Y + .5)`` reads
    the input at ``(a X' + b Y' + c, d X' + e Y' + f)`` (``m`` float64 ``[n, 6]``), points outside the
    image get ``fill`` (float ``[1, 3, 1, 1]``). ``modes``: PIL resampling codes, each one ``grid_sample``
    pass over the batch; image ``b`` takes pass ``mode_idx[b]`` (int64 ``[n]``, needed when several)."""
    n, _, h, w = x.shape
    ys = torch.arange(h, device=x.device, dtype=torch.float64).add_(0.5).view(1, h, 1)
    xs = torch.arange(w, device=x.device, dtype=torch.float64).add_(0.5).view(1, 1, w)
    a, b, c, d, e, f = m.view(n, 6, 1, 1).unbind(1)
    u = a * xs + b * ys + c  # [n, h, w] input x (pixels)
    v = d * xs + e * ys + f
    grid = torch.stack([2 * u / w - 1, 2 * v / h - 1], dim=-1).to(x.dtype)
    out = None
    for k, code in enumerate(modes):
        o = torch.nn.functional.grid_sample(x, grid, mode=_PIL_MODES[code], padding_mode="border", align_corners=False)
        out = o if out is None else torch.where(mode_idx.view(n, 1, 1, 1) == k, o, out)
    inside = ((u >= 0) & (u < w) & (v >= 0) & (v < h)).unsqueeze(1)
    return torch.where(inside, out.round().clamp(0, 255), fill)


# ---------------------------------------------------------------------- RandAugment, batched per op family
# Every op of a layer falls in one of four families, each applied ONCE per layer to the images that drew
# one of its ops (``index_select`` -> batched op with per-image parameters -> ``index_copy_``):
#   affine:   Rotate, Shear*, Translate* -> one grid_sample with a per-image PIL affine matrix;
#   blend:    Color*, Sharpness* (not point ops) -> blend with a per-image degenerate (grey or smoothed);
#   lut:      the other point ops (AutoContrast, Invert, Posterize*, Solarize*, SolarizeAdd, Brightness*,
#             Contrast*) -> a per-image, per-channel 256-entry lookup table, then one ``take``;
#   equalize: Equalize, a lookup table from each channel's histogram, on its own: the histogram (atomic adds
#             over every pixel) runs on the ~1/15 of the images that drew it, not on every point-op image.
# The host (NumPy, from the workers' draws) builds each family's image indices and parameters; they reach
# the device in the stage's one upload. A layer's device ops are the same whatever the images drew (an
# empty family runs on zero images), so the stage's launches do not depend on how many ops were drawn.
_FAMILY = {name: ("affine" if name in _GEOMETRIC else "blend" if name.startswith(("Color", "Sharpness"))
                  else "equalize" if name == "Equalize" else "lut") for name in RA_OPS}
_FAMILIES = ("affine", "blend", "lut", "equalize")
# lut parameters per image: mask, threshold, factor, add, c0, c1, contrast?, autocontrast?
_LUT_IDENTITY = (255.0, 256.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0)


def _lut_params(name: str, a: np.ndarray) -> np.ndarray:
    """``[n, 8]`` float64 lut parameters of point op ``name`` with timm arguments ``a`` ``[n]`` (see
    :func:`_lut_family`): ``where(v < threshold, min(floor(clamp(d + f (v_m - d))) + add, 255), c0 + c1 v_m)``
    with ``v_m = v & mask`` and ``d`` the rounded mean grey level for Contrast, else 0."""
    p = np.tile(np.asarray(_LUT_IDENTITY), (len(a), 1))
    if name == "AutoContrast":
        p[:, 7] = 1
    elif name == "Invert":
        p[:, [1, 4, 5]] = (0.0, 255.0, -1.0)
    elif name.startswith("Posterize"):  # keep the `bits` most significant bits
        bits = np.clip(a.astype(np.int64), 0, 8)
        p[:, 0] = (255 << (8 - bits)) & 255
    elif name == "SolarizeAdd":  # add to levels < 128
        p[:, 1], p[:, 3] = 128.0, a
    elif name.startswith("Solarize"):  # invert levels >= threshold
        p[:, 1], p[:, 4], p[:, 5] = a, 255.0, -1.0
    elif name.startswith("Brightness"):  # ImageEnhance.Brightness: blend with black
        p[:, 2] = a
    elif name.startswith("Contrast"):  # ImageEnhance.Contrast: blend with the mean grey level (rounded)
        p[:, 2], p[:, 6] = a, 1
    else:
        raise NotImplementedError(f"RandAugment op {name!r}")
    return p


def _affine_params(name: str, a: np.ndarray, h: int, w: int) -> np.ndarray:
    """timm's PIL affine coefficients (float64 ``[n, 6]``) of geometric op ``name`` with arguments ``a`` ``[n]``
    on an ``h x w`` image."""
    one, zero = np.ones_like(a), np.zeros_like(a)
    if name == "ShearX":
        return np.stack([one, a, zero, zero, one, zero], 1)
    if name == "ShearY":
        return np.stack([one, zero, zero, a, one, zero], 1)
    if name in ("TranslateX", "TranslateXRel"):
        return np.stack([one, zero, a * w if name.endswith("Rel") else a, zero, one, zero], 1)
    if name in ("TranslateY", "TranslateYRel"):
        return np.stack([one, zero, zero, zero, one, a * h if name.endswith("Rel") else a], 1)
    # Rotate: PIL Image.rotate(degrees) about the centre, counter-clockwise
    t = -np.deg2rad(a)
    ca, sb, sd, ce = np.cos(t), np.sin(t), -np.sin(t), np.cos(t)
    cx, cy = w / 2.0, h / 2.0
    return np.stack([ca, sb, ca * -cx + sb * -cy + cx, sd, ce, sd * -cx + ce * -cy + cy], 1)


_WIDTH = {"affine": 6, "blend": 2, "lut": len(_LUT_IDENTITY), "equalize": 1}  # parameters per image
_IDENTITY = {"affine": (1.0, 0.0, 0.0, 0.0, 1.0, 0.0), "blend": (0.0, 1.0), "lut": _LUT_IDENTITY, "equalize": (0.0,)}


class _Layer:
    """One RandAugment layer (or colour-jitter step) for a batch: host plan + device program.

    Args:
        up: the stage's :class:`_Upload` (the plan's arrays are added to it).
        op: int ``[B]`` index in :data:`RA_OPS` per image (-1: none); arg: float ``[B]`` timm arguments;
            interp: int ``[B]`` PIL resampling codes (geometric ops).
        hw: image (height, width). families: the families to run (those the recipe's ops can reach).
        modes: PIL resampling codes the recipe's geometric ops can use (one ``grid_sample`` pass each).
        quantum: ``None``: each family runs on exactly its images. An int ``q`` (CUDA graphs,
            :class:`_AugmentGraphs`): every family's arrays get the fixed length ``ceil(B / q) q`` (a fixed
            upload layout) and the family runs on its image count rounded up to a multiple of ``q``; the
            extra entries are the scratch images ``B, B + 1, ..., B + q - 1`` of ``x`` (which then has
            ``B + q`` images) with identity parameters, so the real images' results are unchanged.

    Attributes:
        sizes: family -> number of images it runs on (padded with ``quantum``).
    """

    def __init__(self, up: _Upload, op: np.ndarray, arg: np.ndarray, interp: np.ndarray, hw: tuple[int, int],
                 families: Iterable[str], modes: tuple[int, ...], quantum: int | None = None) -> None:
        op, arg, interp = np.asarray(op, np.int64), np.asarray(arg, np.float64), np.asarray(interp, np.int64)
        n = len(op)
        self.modes, self.slots, self.sizes = tuple(modes), {}, {}
        fam = np.array([_FAMILY[name] for name in RA_OPS] + ["none"])[op]  # op -1 -> "none"
        for f in _FAMILIES:
            if f not in families:
                if (fam == f).any():
                    raise ValueError(f"RandAugment family {f!r} drawn but not planned")
                continue
            idx = np.flatnonzero(fam == f)
            par = np.zeros((len(idx), _WIDTH[f]))
            for o in np.unique(op[idx]):
                sel = op[idx] == o
                name, a = RA_OPS[o], arg[idx][sel]
                if f == "affine":
                    par[sel] = _affine_params(name, a, *hw)
                elif f == "blend":
                    par[sel] = np.stack([np.full_like(a, float(name.startswith("Sharpness"))), a], 1)
                elif f == "equalize":
                    par[sel] = 1.0  # on (padding: 0, identity)
                else:
                    par[sel] = _lut_params(name, a)
            codes = interp[idx]
            if f == "affine" and not np.isin(codes, self.modes).all():
                raise ValueError(f"RandAugment resampling {sorted(set(codes.tolist()))} not in {self.modes}")
            self.sizes[f] = len(idx)
            if quantum:  # fixed length; scratch images B .. B + q - 1 with identity parameters after the real ones
                pad = -(-n // quantum) * quantum - len(idx)
                self.sizes[f] = -(-len(idx) // quantum) * quantum
                idx = np.concatenate([idx, n + np.arange(pad) % quantum])
                par = np.concatenate([par, np.tile(_IDENTITY[f], (pad, 1))])
                codes = np.concatenate([codes, np.full(pad, self.modes[0])])
            slot = [up.add(idx), up.add(par)]
            if f == "affine" and len(self.modes) > 1:
                slot.append(up.add(np.searchsorted(np.asarray(self.modes), codes)))
            self.slots[f] = slot

    def run(self, f: str, x: Tensor, segs: list[Tensor], fill: Tensor, m: int | None = None) -> None:
        """Apply family ``f`` to its images of ``x`` (float32 ``[B, 3, H, W]`` levels, on the device; ``B + q``
        with a quantum) in place: ``index_select`` -> batched op with per-image parameters -> ``index_copy_``.
        ``fill``: float ``[1, 3, 1, 1]`` levels outside the image (geometric ops); ``m``: run on the first ``m``
        entries of the family's arrays (default :attr:`sizes`)."""
        slot, m = self.slots[f], self.sizes[f] if m is None else m
        idx, par = segs[slot[0]][:m], segs[slot[1]][:m]
        sub = x.index_select(0, idx)
        if f == "affine":
            y = _pil_affine(sub, par, self.modes, fill, segs[slot[2]][:m] if len(slot) > 2 else None)
        elif f == "blend":
            sharp, factor = par.to(x.dtype).view(m, 2, 1, 1, 1).unbind(1)
            y = _blend(torch.where(sharp > 0, _smooth(sub), _gray(sub)), sub, factor)
        elif f == "equalize":
            y = _equalize(sub, par)
        else:
            y = _lut_family(sub, par)
        x.index_copy_(0, idx, y)

    def __call__(self, x: Tensor, segs: list[Tensor], fill: Tensor) -> None:
        """Apply the layer (every family, each on its own images: they are disjoint) to ``x`` in place."""
        for f in self.slots:
            self.run(f, x, segs, fill)


AUGMENT_GRAPH_BUCKETS = 16  # image-count buckets per family: the quantum is ceil(B / 16)


class _AugmentGraphs:
    """CUDA graphs of a training stage's augmentation layers, for one batch size ``n`` and image size.

    Host time, not device time, limited the stage (issue 21: ~400 small ops per batch of 256 for two
    RandAugment layers, each launched from Python in the training process). Here each (layer, family,
    padded image count) is one CUDA graph, replayed for every batch: one launch instead of ~70 ops. All of
    them (layers x families x 16 counts) are captured at the first batch, each after a warm-up run on a
    scratch buffer, on a side stream: a capture registers the default CUDA generator, and any random number
    drawn by another thread meanwhile (the training step's dropout) would fail ("Offset increment outside
    graph capture"), so no capture may happen once training runs beside the stage
    (:class:`DevicePrefetcher` runs the first batch in the consumer's thread for this). The shapes a
    graph sees are fixed: the images live in :attr:`x` (``[n + q, 3, H, W]``, the last ``q`` rows scratch
    images for the padding of :class:`_Layer` with ``quantum=q``) and the plan in :attr:`plan` (one int64
    buffer with a fixed layout, filled by one host-to-device copy per batch; the layout follows from the
    batch size and the recipe, fixed for a pipeline, so the captures happen once). All graphs share one memory
    pool: each reads and writes only these two buffers, so no graph's memory outlives its replay and any
    replay order is safe. A batch of another size runs eagerly (the caller's choice).

    Args:
        n: images per batch; hw: (height, width); device: a CUDA device.
    """

    def __init__(self, n: int, hw: tuple[int, int], device: torch.device) -> None:
        self.n, self.hw, self.device = n, tuple(hw), device
        self.quantum = self._quantum(n)
        self.x = torch.zeros(n + (self.quantum or 0), 3, *hw, device=device)  # scratch rows stay integer levels
        self.plan: Tensor | None = None
        self.layout: tuple | None = None
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.side = torch.cuda.Stream(device)
        self.done: torch.cuda.Event | None = None

    @staticmethod
    def _quantum(n: int) -> int | None:
        """The padding quantum of the families' image counts (:class:`_Layer`'s ``quantum``)."""
        return -(-n // AUGMENT_GRAPH_BUCKETS)

    def begin(self) -> None:
        """Make the current stream wait for the previous batch's use of the buffers (another stream's)."""
        if self.done is not None:
            torch.cuda.current_stream(self.device).wait_event(self.done)

    def end(self) -> None:
        """Mark the buffers as used up to here on the current stream (see :meth:`begin`)."""
        self.done = torch.cuda.Event()
        self.done.record(torch.cuda.current_stream(self.device))

    def plan_buffer(self, layout: tuple) -> Tensor:
        """The static plan buffer for an :class:`_Upload` ``layout`` (a new layout drops the graphs captured so far)."""
        if layout != self.layout:
            self.graphs.clear()
            self.layout = layout
            total = sum(math.prod(shape) for shape, _ in layout)
            self.plan = torch.zeros(total, dtype=torch.int64, device=self.device)
        return self.plan

    def run(self, layers: list[_Layer], segs: list[Tensor], s_fill: int) -> None:
        """Apply ``layers`` to :attr:`x` (``segs``: views of :attr:`plan`; ``s_fill``: the fill colour's slot);
        the first call for a layout captures every graph the layout can need (:meth:`capture_all`)."""
        if not self.graphs:
            self.capture_all(layers, segs, s_fill)
        for k, layer in enumerate(layers):
            for f, m in layer.sizes.items():
                if m:
                    self.graphs[k, f, m].replay()

    def capture_all(self, layers: list[_Layer], segs: list[Tensor], s_fill: int) -> None:
        """Capture the graph of every (layer, family, count ``q, 2q, ..., ceil(n / q) q``)."""
        cap = -(-self.n // self.quantum) * self.quantum
        with self._capturing() as scratch:
            for k, layer in enumerate(layers):
                for f in layer.slots:
                    for m in range(self.quantum, cap + 1, self.quantum):
                        body = functools.partial(self._body, layer, f, m, segs, s_fill)
                        self.graphs[k, f, m] = self._capture(body, scratch)

    @contextlib.contextmanager
    def _capturing(self) -> Iterator[Tensor]:
        """Captures run on the side stream (after the current stream's work so far); yields a zero scratch
        batch for the warm-ups."""
        current = torch.cuda.current_stream(self.device)
        self.side.wait_stream(current)
        with torch.cuda.stream(self.side):
            yield torch.zeros_like(self.x)
        current.wait_stream(self.side)

    def _capture(self, body: Callable[[Tensor], None], scratch: Tensor) -> torch.cuda.CUDAGraph:
        body(scratch)  # lazy initialisation (kernels, cuDNN) outside the capture; x keeps its values
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        try:
            body(self.x)
        finally:
            graph.capture_end()
        return graph

    @staticmethod
    def _body(layer: _Layer, f: str, m: int, segs: list[Tensor], s_fill: int, x: Tensor) -> None:
        layer.run(f, x, segs, segs[s_fill].to(x.dtype).view(1, 3, 1, 1), m)


# the fused kernels' per-image codes (:mod:`.imagenet_triton`): op family (0: no op) and affine sampling
_KERNEL_FAMILY = {"lut": 1, "equalize": 1, "blend": 2, "affine": 3}
_KERNEL_MODE = {0: 0, 2: 1, 3: 2}  # PIL resampling code -> nearest, bilinear, bicubic


class _FusedLayer:
    """One RandAugment layer (or colour-jitter step) for the fused Triton kernels (:mod:`.imagenet_triton`):
    the same ops as :class:`_Layer`, planned per IMAGE instead of per family, so that the device work is two
    kernels over the whole batch and a few ops on its ``[n, 3, 256]`` tables, whatever the images drew.

    Args:
        up: the stage's :class:`_Upload` (the plan's arrays are added to it: a layout fixed by the batch size).
        op: int ``[B]`` index in :data:`RA_OPS` per image (-1: none); arg: float ``[B]`` timm arguments;
            interp: int ``[B]`` PIL resampling codes (geometric ops: 0, 2 or 3).
        hw: image (height, width).

    Raises:
        ValueError: a geometric op with a resampling code other than 0, 2 or 3.
    """

    def __init__(self, up: _Upload, op: np.ndarray, arg: np.ndarray, interp: np.ndarray,
                 hw: tuple[int, int]) -> None:
        op, arg, interp = np.asarray(op, np.int64), np.asarray(arg, np.float64), np.asarray(interp, np.int64)
        n = len(op)
        fam, mode, eq = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64)
        aff, blend = np.tile(_IDENTITY["affine"], (n, 1)), np.tile(_IDENTITY["blend"], (n, 1))
        lut = np.tile(_LUT_IDENTITY, (n, 1))
        for o in np.unique(op[op >= 0]):
            sel = op == o
            name, a = RA_OPS[o], arg[sel]
            family = _FAMILY[name]
            fam[sel] = _KERNEL_FAMILY[family]
            if family == "affine":
                codes = interp[sel]
                if not np.isin(codes, list(_KERNEL_MODE)).all():
                    raise ValueError(f"RandAugment resampling {sorted(set(codes.tolist()))} not in "
                                     f"{sorted(_KERNEL_MODE)}")
                aff[sel] = _affine_params(name, a, *hw)
                mode[sel] = [_KERNEL_MODE[int(k)] for k in codes]
            elif family == "blend":
                blend[sel] = np.stack([np.full_like(a, float(name.startswith("Sharpness"))), a], 1)
            elif family == "equalize":
                eq[sel] = 1
            else:
                lut[sel] = _lut_params(name, a)
        self.slots = [up.add(fam), up.add(aff), up.add(mode), up.add(blend), up.add(lut), up.add(eq)]

    def run(self, x: Tensor, out: Tensor, segs: list[Tensor], fill: Tensor, scratch: tuple[Tensor, ...]) -> None:
        """Apply the layer to ``x`` into ``out`` (float32 ``[B, 3, H, W]`` levels, contiguous, distinct memory) with
        :func:`.imagenet_triton.layer_stats`, the tables (:func:`_lut_tables`, :func:`_equalize_tables`) and
        :func:`.imagenet_triton.layer_apply`. ``fill``: float64 ``[3]`` levels outside the image (geometric ops);
        ``scratch``: the statistics buffers (:func:`fused_scratch`)."""
        from mixlab.datamodules.imagenet_triton import layer_apply, layer_stats

        fam, aff, mode, blend, lut, eq = (segs[k] for k in self.slots)
        hist, lo, hi, gsum = scratch
        hist.zero_()
        lo.fill_(255)
        hi.zero_()
        gsum.zero_()
        layer_stats(x, fam, hist, lo, hi, gsum)
        hw = x.shape[-2] * x.shape[-1]
        on = eq > 0
        tables = torch.where(on.view(-1, 1, 1), _equalize_tables(hist, on, hw),
                             _lut_tables(lut, grey_mean(gsum, hw), lo, hi))
        layer_apply(x, out, fam, aff, mode, blend, tables.contiguous(), fill)


def fused_scratch(n: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The statistics buffers of :meth:`_FusedLayer.run` for ``n`` images: histograms int32 ``[n, 3, 256]``,
    per-channel minimum and maximum int32 ``[n, 3]``, grey-level sums int32 ``[n]``."""
    return (torch.zeros(n, 3, 256, dtype=torch.int32, device=device),
            torch.zeros(n, 3, dtype=torch.int32, device=device), torch.zeros(n, 3, dtype=torch.int32, device=device),
            torch.zeros(n, dtype=torch.int32, device=device))


def run_fused_layers(layers: list[_FusedLayer], x: Tensor, spare: Tensor, segs: list[Tensor], fill: Tensor,
                     scratch: tuple[Tensor, ...]) -> Tensor:
    """Apply ``layers`` in turn, ping-ponging between ``x`` and ``spare`` (same shape); returns the one holding the
    result (``x`` after an even number of layers)."""
    for layer in layers:
        layer.run(x, spare, segs, fill, scratch)
        x, spare = spare, x
    return x


class _FusedGraphs(_AugmentGraphs):
    """:class:`_AugmentGraphs` for the fused Triton layers (:class:`_FusedLayer`): ONE CUDA graph for all the
    layers of a batch of ``n`` images (each layer's launches do not depend on what the images drew, so there is
    no per-family padding: ``quantum`` is None). The images live in :attr:`x` (``[n, 3, H, W]``) and the
    layers ping-pong with :attr:`spare`; :meth:`run` returns the buffer holding the result."""

    @staticmethod
    def _quantum(n: int) -> None:
        return None  # no scratch rows: a layer's launches cover the whole batch

    def __init__(self, n: int, hw: tuple[int, int], device: torch.device) -> None:
        super().__init__(n, hw, device)
        self.spare = torch.zeros_like(self.x)
        self.scratch = fused_scratch(n, device)
        self.result: Tensor = self.x

    def run(self, layers: list[_FusedLayer], segs: list[Tensor], s_fill: int) -> Tensor:
        if not self.graphs:
            with self._capturing() as scratch:
                body = functools.partial(self._fused_body, layers, segs, s_fill)
                self.graphs["all"] = self._capture(body, scratch)
        self.graphs["all"].replay()
        return self.result

    def _fused_body(self, layers: list[_FusedLayer], segs: list[Tensor], s_fill: int, x: Tensor) -> None:
        spare = self.spare if x is self.x else torch.zeros_like(x)
        out = run_fused_layers(layers, x, spare, segs, segs[s_fill], self.scratch)
        if x is self.x:
            self.result = out


def _lut_family(x: Tensor, par: Tensor) -> Tensor:
    """Point ops as per-image, per-channel lookup tables: x float32 ``[n, 3, H, W]`` levels, par float64
    ``[n, 8]`` (:func:`_lut_params`) -> float32 ``[n, 3, H, W]``, through :func:`_lut_tables` from the images'
    statistics. Equalize is :func:`_equalize`."""
    h, w = x.shape[-2:]
    gsum = _gray(x).sum(dim=(-3, -2, -1), dtype=torch.float64)
    lo, hi = x.amin(dim=(-2, -1)), x.amax(dim=(-2, -1))
    return _lut_tables(par, grey_mean(gsum, h * w), lo, hi).reshape(-1).take(_table_index(x))


def grey_mean(gsum: Tensor, hw: int) -> Tensor:
    """PIL ``ImageStat.Stat(img.convert('L')).mean`` rounded as ``ImageEnhance.Contrast`` does (``int(mean +
    0.5)``): gsum ``[n]`` the exact sums of the grey levels (any dtype) over ``hw`` pixels -> float32 ``[n]``."""
    return torch.floor(gsum.to(torch.float64) / hw + 0.5).to(torch.float32)


def _lut_tables(par: Tensor, mean: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    """The point ops' per-image, per-channel lookup tables (float32 ``[n, 3, 256]``) from their parameters
    (par float64 ``[n, 8]``, :func:`_lut_params`) and the images' statistics: ``mean`` the rounded mean grey level
    ``[n]`` (:func:`grey_mean`: Contrast blends with it), ``lo`` / ``hi`` each channel's minimum and maximum level
    ``[n, 3]`` (AutoContrast's range; PIL builds that LUT in float64)."""
    n = par.shape[0]
    dev = par.device
    pf = par.to(torch.float32)
    mask, t, f, add, c0, c1, is_con, is_ac = pf.view(n, 8, 1, 1).unbind(1)  # each [n, 1, 1]
    vi = torch.arange(256, device=dev)
    v = vi.to(torch.float32)
    vm = (vi & mask.to(torch.int64)).to(torch.float32)  # [n, 1, 256]
    d = mean.to(torch.float32).view(n, 1, 1) * is_con
    low = ((d + f * (vm - d)).clamp(0, 255).floor() + add).clamp(max=255)
    lut = torch.where(v < t, low, c0 + c1 * vm)  # [n, 1, 256]
    # AutoContrast: per channel lo..hi -> 0..255, int() of the LUT value (PIL builds it in float64)
    lo = lo.to(torch.float64).unsqueeze(-1)  # [n, 3, 1]
    hi = hi.to(torch.float64).unsqueeze(-1)
    vd = vi.to(torch.float64)
    scale = torch.full_like(hi, 255.0) / (hi - lo).clamp_min(1)  # not 255 / t: that is 255 * (1 / t)
    auto = torch.where(hi > lo, (vd * scale - lo * scale).floor().clamp(0, 255), vd).to(torch.float32)
    return torch.where(is_ac > 0, auto, lut)  # [n, 3, 256]


def _table_index(x: Tensor) -> Tensor:
    """Each pixel's entry in ``n * 3`` stacked 256-entry tables: x float32 ``[n, 3, H, W]`` integer levels ->
    int64 ``[n, 3, H, W]`` (``level + 256 * (3 * image + channel)``)."""
    n = x.shape[0]
    return x.to(torch.int64) + torch.arange(n * 3, device=x.device).mul_(256).view(n, 3, 1, 1)


def _equalize(x: Tensor, par: Tensor) -> Tensor:
    """Equalize (``torchvision.transforms.v2.functional.equalize``, batched): x float32 ``[n, 3, H, W]`` integer
    levels, par float64 ``[n, 1]`` (1: equalize, 0: identity, the CUDA-graph padding) -> float32 ``[n, 3, H, W]``,
    through :func:`_equalize_tables` of each channel's histogram."""
    n, _, h, w = x.shape
    dev = x.device
    flat_idx = _table_index(x)
    hist = torch.zeros(n * 3 * 256, dtype=torch.int32, device=dev)
    hist.scatter_add_(0, flat_idx.view(-1), torch.ones(1, dtype=torch.int32, device=dev).expand(flat_idx.numel()))
    return _equalize_tables(hist.view(n, 3, 256), par.view(n) > 0, h * w).reshape(-1).take(flat_idx)


def _equalize_tables(hist: Tensor, on: Tensor, hw: int) -> Tensor:
    """Equalize's lookup tables (float32 ``[n, 3, 256]``; PIL's LUT from each channel's histogram, as torchvision's
    ``equalize``; a channel with one level apart from its maximum is kept) from the histograms (int ``[n, 3,
    256]`` over ``hw`` pixels); images with ``on`` (bool ``[n]``) false get the identity."""
    n = hist.shape[0]
    dev = hist.device
    hist = hist.to(torch.int64)
    cum = hist.cumsum(dim=-1)
    step = (hw - hist.gather(-1, cum.argmax(dim=-1, keepdim=True))).div(255, rounding_mode="floor")
    eq = (cum[..., :-1] + step // 2).div(step.clamp(min=1), rounding_mode="floor").clamp(0, 255)
    eq = torch.cat([torch.zeros_like(eq[..., :1]), eq], dim=-1).to(torch.float32)
    v = torch.arange(256, device=dev, dtype=torch.float32)
    return torch.where((step != 0) & on.view(n, 1, 1), eq, v)  # [n, 3, 256]


def apply_ra_op(name: str, x: Tensor, arg: Tensor, interp: int = 3, fill: Tensor | None = None) -> Tensor:
    """One timm RandAugment op on a batch, each image with its own argument, through the batched layer the
    pipeline runs (:class:`_Layer`: every image drawing ``name``).

    Args:
        name: a timm op name (:data:`RA_OPS`).
        x: float32 ``[n, 3, H, W]``, integer levels 0..255 (a uint8 image held as float).
        arg: float64 ``[n]``: timm's level argument of each image (unused by AutoContrast/Equalize/Invert).
        interp: PIL resampling code of geometric ops (0 nearest, 2 bilinear, 3 bicubic).
        fill: float ``[3]`` levels for points outside the image (geometric ops; timm: the mean colour).

    Returns:
        float32 ``[n, 3, H, W]`` integer levels 0..255.
    """
    if name not in RA_OPS:
        raise NotImplementedError(f"RandAugment op {name!r}")
    n = x.shape[0]
    up = _Upload()
    layer = _Layer(up, np.full(n, RA_OPS.index(name)), arg.double().cpu().numpy(), np.full(n, int(interp)),
                   tuple(x.shape[-2:]), {_FAMILY[name]}, (int(interp),))
    s_fill = up.add((128.0,) * 3 if fill is None else fill.double().cpu().numpy())
    segs = up.to(x.device)
    out = x.clone()
    layer(out, segs, segs[s_fill].to(x.dtype).view(1, 3, 1, 1))
    return out


_JITTER = ("Brightness", "Contrast", "Color")  # torchvision ColorJitter fn ids 0, 1, 2 on PIL = ImageEnhance


def plan_layers(up: _Upload, p: dict[str, Tensor], hw: tuple[int, int], families: Iterable[str],
                modes: tuple[int, ...], quantum: int | None = None,
                fused: bool = False) -> list[_Layer] | list[_FusedLayer]:
    """A batch's colour-jitter steps and RandAugment layers (:class:`_Layer`, with ``quantum``; with ``fused``
    :class:`_FusedLayer`), in the CPU path's order, planned into ``up`` from the draws ``p``
    (:meth:`TrainParams.__call__`, stacked: ``[B, ...]`` host tensors) for ``hw`` (height, width) images.
    ``families`` / ``modes``: the RandAugment op families and PIL resampling codes the recipe can draw
    (:class:`TrainParams`' ``ra_families`` / ``ra_modes``)."""
    def layer(op, arg, interp, fams, mds):
        if fused:
            return _FusedLayer(up, op, arg, interp, hw)
        return _Layer(up, op, arg, interp, hw, fams, mds, quantum)

    out = []
    if "cj_order" in p:  # torchvision ColorJitter: a random order of brightness, contrast, saturation (hue unused)
        order, factor = p["cj_order"].numpy(), p["cj_factor"].numpy()
        order = order[order != 3].reshape(len(order), 3)
        jit = np.array([RA_OPS.index(n) for n in _JITTER])
        for s in range(order.shape[1]):
            f = factor[np.arange(len(order)), order[:, s]]
            op = np.where(f != 1.0, jit[order[:, s]], -1)
            out.append(layer(op, f, np.zeros_like(op), {"lut", "blend"}, (3,)))
    if "ra_op" in p:
        ops, args, interps = p["ra_op"].numpy(), p["ra_arg"].numpy(), p["ra_interp"].numpy()
        for k in range(ops.shape[1]):
            out.append(layer(ops[:, k], args[:, k], interps[:, k], families, modes))
    return out


class AugmentPlan:
    """The host half of a training batch's augmentation (:meth:`GpuPipeline._augment`): every per-batch array the
    device work reads, packed into two int64 host buffers, and the layers that read them. Made by an
    :class:`AugmentPlanner` in the DataLoader worker (:func:`collate_encoded`), so the training process does no
    planning: its Python would hold the GIL that the training step needs (BENCHMARKS.md, fortieth session).

    Attributes:
        key: ``(images, (height, width), quantum, fused)``: the stage uses the plan only for a batch of these
            (a batch with skipped images, another device setting: it plans again itself).
        data: int64 ``[P]`` host tensor, the layers' plan (:class:`_Upload`: normalisation, fill colour, layers);
            ``layout`` its slots; ``s_norm`` / ``s_fill`` the normalisation's and fill colour's slots; ``layers``
            :class:`_Layer` or :class:`_FusedLayer` objects (slot numbers only).
        erase_data: int64 ``[E]`` host tensor, the random-erasing plan (indices of the images with a box, their
            boxes) or None (no RandomErasing in the recipe); ``erase_layout`` its slots; ``erase_seed`` the
            erasing noise's seed.
    """

    def __init__(self, key: tuple, up: _Upload, s_norm: int, s_fill: int, layers: list,
                 erase: tuple[_Upload, int] | None) -> None:
        self.key, self.layout, self.s_norm, self.s_fill, self.layers = key, up.layout(), s_norm, s_fill, layers
        self.data: Tensor | None = up.host()
        self.erase_data: Tensor | None = None if erase is None else erase[0].host()
        self.erase_layout = None if erase is None else erase[0].layout()
        self.erase_seed = 0 if erase is None else erase[1]

    def _tensors(self) -> list[tuple[str, Tensor]]:
        return [(k, getattr(self, k)) for k in ("data", "erase_data") if getattr(self, k) is not None]

    def pin_memory(self) -> AugmentPlan:
        """Page-lock the host buffers (their copies to the device are then asynchronous without a staging copy)."""
        for name, t in self._tensors():
            if not t.is_pinned():
                setattr(self, name, t.pin_memory())
        return self


class AugmentPlanner:
    """Makes a training batch's :class:`AugmentPlan` from its draws (:meth:`TrainParams.__call__`, stacked), as
    :meth:`GpuPipeline._augment` would: normalisation ``mean`` / ``std`` and RandAugment ``fill`` (levels, 3 each),
    ``hw`` the output (height, width), RandAugment ``families`` / ``modes`` (:func:`plan_layers`); ``graphs``: the
    torch layers padded for CUDA graphs (:class:`_Layer`'s ``quantum``, :class:`_AugmentGraphs`); ``fused``: the
    Triton layers (:class:`_FusedLayer`). Small and picklable: :func:`collate_encoded` calls it in the workers."""

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...], fill: tuple[float, ...], hw: tuple[int, int],
                 families: Iterable[str], modes: tuple[int, ...], graphs: bool = False, fused: bool = False) -> None:
        self.mean, self.std, self.fill, self.hw = tuple(mean), tuple(std), tuple(fill), tuple(hw)
        self.families, self.modes, self.graphs, self.fused = set(families), tuple(modes), graphs, fused

    def __call__(self, p: dict[str, Tensor]) -> AugmentPlan:
        n = len(p["crop"]) if "crop" in p else 0
        quantum = _AugmentGraphs._quantum(n) if self.graphs and n else None
        up = _Upload()
        s_norm = up.add(self.mean + self.std, np.float64)
        s_fill = up.add(self.fill, np.float64)
        layers = plan_layers(up, p, self.hw, self.families, self.modes, quantum, self.fused)
        erase = None
        if "erase" in p:
            b = p["erase"].numpy()
            sel = np.flatnonzero((b[..., 2] > 0).any(1))
            eup = _Upload()
            eup.add(sel)
            eup.add(b[sel])
            erase = (eup, int(p["seed"].numpy().sum()) % 2**63)  # int64 sum, wrapping as torch's
        return AugmentPlan((n, self.hw, quantum, self.fused), up, s_norm, s_fill, layers, erase)


class GpuPipeline:
    """Accelerator side of ``decode: gpu``: :class:`EncodedBatch` -> ``(images, labels)``.

    Args:
        transform: the split's timm transform (``Compose``) as the CPU path would use it: training
            (:class:`TrainParams` reads its steps) or evaluation (its first two steps, Resize or
            ResizeKeepRatio and CenterCrop, run on the decoded tensors; then Normalize).
        train: ``transform`` is the training one (augmentation parameters in the batches) or evaluation.
        cuda_graphs: training batches on a CUDA device replay the colour-jitter / RandAugment layers as
            CUDA graphs (:class:`_AugmentGraphs`, built at the first batch, for that batch size); no effect
            on the CPU, for evaluation, or for a batch of another size (eager, the same images).
        jpeg_decoder: the JPEG decoder on CUDA (:data:`JPEG_DECODERS`, :func:`decode_jpegs`); a CPU device
            always decodes with torchvision.
        augment_impl: with ``cuda_graphs`` on CUDA, ``"torch"`` (default): the family-batched torch ops
            (:class:`_Layer`), one graph per (layer, family, image count); ``"triton"``: each layer as two Triton
            kernels over the whole batch (:class:`_FusedLayer`, :mod:`.imagenet_triton`), all layers in one CUDA
            graph, and the crop + resize (training and evaluation, CUDA) as two Triton kernels
            (:func:`resized_crops` ``impl="triton"``) instead of TF32 GEMMs. ``"triton"`` without Triton installed
            runs ``"torch"``.

    Raises:
        ValueError: ``jpeg_decoder`` not in :data:`JPEG_DECODERS`, ``augment_impl`` not in
            :data:`AUGMENT_IMPLS`.

    ``__call__(batch)`` returns images float32 ``[B', 3, H, W]`` (normalised, on ``batch.labels.device``)
    and labels int64 ``[B']``; ``B' = B`` minus images no decoder could read (counted, warned).

    Device work per batch: one batched decode, the batched crop-resize (:func:`resized_crops`), then each
    colour-jitter step / RandAugment layer as one :class:`_Layer` (a fixed sequence of ops per op family,
    whatever the images drew; replayed as CUDA graphs with ``cuda_graphs``), normalisation and random erasing;
    the parameters of all of these (built on the host with NumPy from the workers' draws) reach the device in
    two transfers (the layers' plan, the erasing boxes), and nothing in the stage waits for the device (no
    ``.item()``, ``nonzero``, blocking copy).
    """

    def __init__(self, transform: Any, train: bool, cuda_graphs: bool = True,
                 jpeg_decoder: str = "torchvision", augment_impl: str = "torch") -> None:
        if jpeg_decoder not in JPEG_DECODERS:
            raise ValueError(f"GpuPipeline: jpeg_decoder must be one of {JPEG_DECODERS}; got {jpeg_decoder!r}")
        if augment_impl not in AUGMENT_IMPLS:
            raise ValueError(f"GpuPipeline: augment_impl must be one of {AUGMENT_IMPLS}; got {augment_impl!r}")
        self.train, self.cuda_graphs, self.jpeg_decoder = train, cuda_graphs, jpeg_decoder
        self.augment_impl = augment_impl
        self._held: collections.deque = collections.deque()  # (event, images) read by queued kernels (finish)
        self._graphs: _AugmentGraphs | None = None
        self.decode_seconds = 0.0  # host wall time in decode_jpegs so far (it returns after nvJPEG's device work)
        if train:
            self.params = TrainParams(transform)
            self.size, mean, std = self.params.size, self.params.mean, self.params.std
        else:
            steps = list(transform.transforms)
            self.resize, self.crop = steps[0], steps[1]
            norm = next(t for t in steps if type(t).__name__ == "Normalize")
            mean, std = tuple(float(v) for v in norm.mean), tuple(float(v) for v in norm.std)
        self.mean, self.std = tuple(mean), tuple(std)
        if train:
            from torchvision.transforms import InterpolationMode

            interp = self.params.rrc.interpolation  # timm's RandomResizedCrop: an InterpolationMode
            self.interp = InterpolationMode(interp.value) if hasattr(interp, "value") else InterpolationMode.BICUBIC
            self.fill = tuple(getattr(self.params, "fill", (128.0,) * 3))  # RandAugment's fill colour

    def __call__(self, batch: EncodedBatch) -> tuple[Tensor, Tensor]:
        return self.finish(batch, self.decode(batch))

    def decode(self, batch: EncodedBatch) -> list[Tensor | None]:
        """The first half of ``__call__``: the batch's JPEGs (those not decoded in the workers) decoded on
        ``batch.labels.device`` by :func:`decode_jpegs`: one uint8 ``[3, H_b, W_b]`` RGB tensor per image, each
        at its own size, ``None`` for an image no decoder reads. Adds its host wall time (seconds) to
        :attr:`decode_seconds`."""
        dev = batch.labels.device
        p_n = batch.num_decoded  # the first p_n images arrive decoded (batch.pixels)
        t = time.perf_counter()
        with record_function("stage/decode"):  # phases named for profiles (scripts/bench_input.py --profile)
            imgs = (decode_jpegs(batch.data, batch.offsets, dev, batch.keys[p_n:], self.jpeg_decoder)
                    if len(batch) > p_n else [])
        self.decode_seconds += time.perf_counter() - t
        return imgs

    def finish(self, batch: EncodedBatch, imgs: list[Tensor | None]) -> tuple[Tensor, Tensor]:
        """The second half of ``__call__``: crop, resize, augment and normalise ``imgs`` (:meth:`decode` of
        ``batch``, on the device; on CUDA usable on the current stream) into ``(images, labels)``: float32
        ``[B', 3, H, W]`` normalised images and int64 ``[B']`` labels, ``B'`` = the images that decoded."""
        dev = batch.labels.device
        p_n = batch.num_decoded
        keep = list(range(p_n)) + [p_n + k for k, im in enumerate(imgs) if im is not None]
        labels = batch.labels
        params = batch.params
        if len(keep) < len(batch):
            labels = labels[torch.tensor(keep, device=dev)]
            params = {k: v[keep] for k, v in params.items()}
            imgs = [im for im in imgs if im is not None]
        graphs = self._graphs_for(len(keep), dev)
        if graphs is not None:
            graphs.begin()
        with record_function("stage/crop_resize"):
            out = None if graphs is None else graphs.x[:len(keep)]
            x = self._train(imgs, params, dev, out, batch.pixels) if self.train else self._eval(imgs)
        batch.pages_held = self._hold(imgs, dev, batch.data)
        with record_function("stage/augment"):
            x = self._augment(x, params if self.train else {}, graphs, batch.plan if len(keep) == len(batch) else None)
        if graphs is not None:
            graphs.end()
        return x, labels

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_graphs": None, "_held": collections.deque()}  # CUDA state stays in its process

    def _hold(self, imgs: list[Tensor], dev: torch.device, data: Tensor | None = None) -> bool:
        """Keep nvImageCodec's decoded images (memory of its own stream-ordered pool, which ``record_stream`` does
        not protect) and the storage of the JPEG bytes it read (``data``'s: kept alive through
        :meth:`EncodedBatch.release`, in case its device work still reads them) until the kernels queued so far on
        the current stream, the crop that reads the images, have run: an event marks that point; held images whose
        event has passed are let go (no wait). Returns whether it holds the bytes (only with nvImageCodec on CUDA)."""
        if dev.type != "cuda" or self.jpeg_decoder != "nvimgcodec" or not imgs:
            return False
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(dev))
        self._held.append((event, imgs, None if data is None else data.untyped_storage()))
        while self._held and self._held[0][0].query():
            self._held.popleft()
        return data is not None

    def _graphs_for(self, n: int, dev: torch.device) -> _AugmentGraphs | None:
        """The CUDA graphs of the augmentation (:class:`_AugmentGraphs`) for a training batch of ``n`` images
        on a CUDA device with ``cuda_graphs`` on, built for the first such batch; another ``n`` (a batch
        with skipped images) and every other case run eagerly (None)."""
        if not (self.cuda_graphs and self.train and dev.type == "cuda" and n > 0):
            return None
        if self._graphs is None:
            cls = _FusedGraphs if self._triton() else _AugmentGraphs
            self._graphs = cls(n, tuple(self.size), dev)
        return self._graphs if self._graphs.n == n else None

    def _eval(self, imgs: list[Tensor]) -> Tensor:
        """``Resize`` (short side, bicubic, antialiased) then ``CenterCrop``, batched through
        :func:`resized_crops` (a full-image box, a per-image resized size and the crop's window in it);
        another resize or an image smaller than the crop (CenterCrop pads) runs the transforms per image."""
        from torchvision.transforms import CenterCrop, InterpolationMode, Resize
        from torchvision.transforms.v2.functional._geometry import _compute_resized_output_size

        ch, cw = self.crop.size if isinstance(self.crop, CenterCrop) else (None, None)
        r = self.resize
        batched = (type(r) is Resize and r.interpolation == InterpolationMode.BICUBIC and r.antialias is not False
                   and r.max_size is None and ch is not None)
        if batched:
            size = [r.size] if isinstance(r.size, int) else list(r.size)
            hw = [tuple(im.shape[-2:]) for im in imgs]
            rs = [tuple(_compute_resized_output_size(s, size=size, max_size=None)) for s in hw]
            batched = all(rh >= ch and rw >= cw for rh, rw in rs)
        if not batched:
            return torch.stack([self.crop(self.resize(im)) for im in imgs]).float()
        boxes = torch.tensor([[0, 0, h, w] for h, w in hw], dtype=torch.int64)
        offsets = torch.tensor([[int(round((rh - ch) / 2.0)), int(round((rw - cw) / 2.0))] for rh, rw in rs],
                               dtype=torch.int64)
        return resized_crops(imgs, boxes, (ch, cw), resized=torch.tensor(rs, dtype=torch.int64), offsets=offsets,
                             impl=self._resize_impl(imgs[0].device))

    def _resize_impl(self, dev: torch.device) -> str:
        """:func:`resized_crops`'s ``impl`` for images on ``dev``: ``"triton"`` with ``augment_impl="triton"`` on CUDA
        when Triton is installed, else ``"gemm"``."""
        return "triton" if self._triton() and dev.type == "cuda" else "gemm"

    def _triton(self) -> bool:
        """``augment_impl="triton"`` and Triton installed (else the torch implementation runs)."""
        return self.augment_impl == "triton" and triton_available()

    def _train(self, imgs: list[Tensor], p: dict[str, Tensor], dev: torch.device, out: Tensor | None = None,
               pixels: Tensor | None = None) -> Tensor:
        """Crop + resize + flip (batched for bicubic, the recipe's; per image otherwise), into ``out`` if given.
        ``pixels`` (uint8 ``[P, 3, H, W]``, host): the batch's first ``P`` images, already cropped in the worker;
        they are copied in (``imgs`` and the rows of ``p`` after them are the rest)."""
        from torchvision.transforms import InterpolationMode

        if pixels is not None:
            n_p = len(pixels)
            if out is None:
                out = torch.empty(n_p + len(imgs), 3, *self.size, device=dev, dtype=torch.float32)
            out[:n_p].copy_(pixels.to(dev, non_blocking=True))
            if imgs:
                self._train(imgs, {k: p[k][n_p:] for k in ("crop", "flip")}, dev, out[n_p:])
            return out
        if self.interp == InterpolationMode.BICUBIC:
            return resized_crops(imgs, p["crop"], tuple(self.size), p["flip"], out=out, impl=self._resize_impl(dev))
        from torchvision.transforms.functional import resized_crop

        x = torch.stack([resized_crop(im, i, j, h, w, list(self.size), interpolation=self.interp, antialias=True)
                         for im, (i, j, h, w) in zip(imgs, p["crop"].tolist())])
        x = torch.where(p["flip"].to(dev, non_blocking=True).view(-1, 1, 1, 1), x.flip(-1), x).float()
        return x if out is None else out.copy_(x)

    def layers(self, up: _Upload, p: dict[str, Tensor], hw: tuple[int, int],
               quantum: int | None = None, fused: bool = False) -> list[_Layer] | list[_FusedLayer]:
        """The batch's colour-jitter steps and RandAugment layers planned into ``up`` (:func:`plan_layers` with this
        recipe's RandAugment families and resampling modes)."""
        return plan_layers(up, p, hw, self.params.ra_families, self.params.ra_modes, quantum, fused)

    def planner(self, device: torch.device | str | None) -> AugmentPlanner | None:
        """The :class:`AugmentPlanner` of this training stage on ``device`` (None for evaluation or no device): the
        plan it makes in a DataLoader worker is the one the stage would make for a full batch (CUDA graphs'
        quantum, fused Triton layers or not), so the stage uses it instead of planning in the training process."""
        if not self.train or device is None:
            return None
        graphs = self.cuda_graphs and torch.device(device).type == "cuda"
        return self._planner(tuple(self.size), graphs and not self._triton(), graphs and self._triton())

    def _planner(self, hw: tuple[int, int], graphs: bool, fused: bool) -> AugmentPlanner:
        """The :class:`AugmentPlanner` of this stage's recipe for ``hw`` images (evaluation: normalisation only)."""
        if not self.train:
            return AugmentPlanner(self.mean, self.std, (0.0,) * 3, hw, (), (3,))
        return AugmentPlanner(self.mean, self.std, self.fill, hw, self.params.ra_families, self.params.ra_modes,
                              graphs, fused)

    def _augment(self, x: Tensor, p: dict[str, Tensor], graphs: _AugmentGraphs | None = None,
                 plan: AugmentPlan | None = None) -> Tensor:
        """Colour jitter / RandAugment (training), normalisation, random erasing (training) on the batch ``x``
        (float32 ``[B, 3, H, W]`` levels, the pipeline's own: modified in place; ``graphs.x[:B]`` when
        ``graphs`` replay the layers); returns a new tensor. ``plan``: the batch's :class:`AugmentPlan` made in
        the DataLoader worker, used when it fits (its ``key``), else the plan is made here from the draws ``p``.
        Two uploads: the layers' plan (into ``graphs.plan`` with graphs) and the erasing boxes."""
        fused = isinstance(graphs, _FusedGraphs)
        key = (len(x), tuple(x.shape[-2:]), None if graphs is None else graphs.quantum, fused)
        if plan is None or plan.key != key:
            plan = self._planner(key[1], key[2] is not None, fused)(p)
        segs = _uploaded(plan.data, plan.layout, x.device, None if graphs is None else graphs.plan_buffer(plan.layout))
        if fused:
            x = graphs.run(plan.layers, segs, plan.s_fill)
        elif graphs is not None:
            graphs.run(plan.layers, segs, plan.s_fill)
        else:
            fill = segs[plan.s_fill].to(x.dtype).view(1, 3, 1, 1)
            for layer in plan.layers:
                layer(x, segs, fill)
        norm = segs[plan.s_norm].to(x.dtype).view(2, 1, 3, 1, 1)
        x = x.div(255).sub_(norm[0]).div_(norm[1])  # a new tensor: the graphs' buffer is reused by the next batch
        if plan.erase_data is not None:
            self._erase(x, plan)
        return x

    @staticmethod
    def _erase(x: Tensor, plan: AugmentPlan) -> Tensor:
        """timm RandomErasing ``mode='pixel'`` with the sampled boxes on the images that have one (``plan``'s
        erasing part, :class:`AugmentPlanner`: their indices and int64 ``[k, C, 4]`` boxes, top, left, height,
        width; height 0 = none): N(0, 1) noise (normalised units) from a generator seeded by the batch's seeds
        (``plan.erase_seed``), so a batch is erased the same way again (exact resume). The boxes reach the device in
        one transfer. Writes into ``x`` (the pipeline's own freshly normalised batch) and returns it."""
        idx, b = _uploaded(plan.erase_data, plan.erase_layout, x.device)
        n, h, w = len(idx), x.shape[-2], x.shape[-1]
        gen = torch.Generator(device=x.device)
        gen.manual_seed(plan.erase_seed)
        noise = torch.randn((n, *x.shape[1:]), generator=gen, device=x.device, dtype=x.dtype)
        ys = torch.arange(h, device=x.device).view(1, 1, h, 1)
        xs = torch.arange(w, device=x.device).view(1, 1, 1, w)
        top, left, bh, bw = (b[..., k].view(n, b.shape[1], 1, 1) for k in range(4))
        mask = ((ys >= top) & (ys < top + bh) & (xs >= left) & (xs < left + bw)).any(1, keepdim=True)
        x.index_copy_(0, idx, torch.where(mask, noise, x.index_select(0, idx)))
        return x


def quiet_profiler_without_cuda() -> None:
    """On a machine without CUDA, keep ``torch.profiler``'s tracer (kineto) from printing its harmless
    ``ERROR ... gpuGetDeviceCount failed`` line (``KINETO_LOG_LEVEL``, unless the user set it)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")


def stage_op_counts(stage: Callable[[EncodedBatch], Any], batch: EncodedBatch) -> dict[str, int]:
    """Torch ops one call of the device ``stage`` dispatches on ``batch`` (a CPU-measurable proxy of its kernel
    launches and host work), from ``torch.profiler`` on the CPU: ``ops`` = ``aten::`` ops called from Python
    (top level; each costs host time), ``compute`` = those of them that are not views or metadata (each
    launches at least one kernel on an accelerator), ``decode`` = JPEG decoder calls (``image::``: one per
    image on the CPU, one per batch on CUDA), ``syncs`` = ops that make the host wait for the device on an
    accelerator (``item``, ``nonzero``, ``unique``, ``bincount``, ``masked_select``, ... at any depth; 0
    expected). Run on CUDA tensors it also sees the CUDA-only paths: e.g. ``t[i] = 5`` on a CUDA tensor fills
    from a CPU 0-dim tensor through ``fill_`` -> ``item`` (a read of host memory, no device wait, but counted;
    ``t[i].fill_(5)`` has none). That was the train stage's 4 "syncing" ops on an H200 (0 on the CPU):
    ``item`` + ``_local_scalar_dense`` in :func:`_smooth`, once per RandAugment layer."""
    from torch.profiler import ProfilerActivity, profile

    quiet_profiler_without_cuda()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        stage(batch)
    events = prof.events()
    top = [e for e in events if e.name.startswith("aten::")  # called from Python: no parent but a phase label
           and (e.cpu_parent is None or e.cpu_parent.name.startswith("stage/"))]
    views = {"view", "reshape", "_reshape_alias", "slice", "select", "unsqueeze", "squeeze", "permute", "expand",
             "as_strided", "split", "split_with_sizes", "unbind", "unfold", "t", "transpose", "narrow", "alias",
             "detach", "flatten", "lift_fresh", "to", "contiguous", "pin_memory", "view_as", "expand_as",
             "resolve_conj", "resolve_neg"}
    compute = [e for e in top if e.name.removeprefix("aten::") not in views or any(
        c.name in ("aten::copy_", "aten::_to_copy", "aten::clone") for c in e.cpu_children)]
    syncing = {"aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::unique", "aten::_unique",
               "aten::_unique2", "aten::unique_consecutive", "aten::unique_dim", "aten::bincount",
               "aten::masked_select", "aten::nonzero_static", "aten::is_nonzero", "aten::equal"}
    return {"ops": len(top), "compute": len(compute), "decode": sum(e.name.startswith("image::") for e in events),
            "syncs": sum(e.name in syncing for e in events)}


_END = object()


def _stop_producer(thread: threading.Thread, q: queue.Queue, stop: threading.Event) -> None:
    """Set ``stop`` and join ``thread``, taking items out of ``q`` meanwhile (it may wait for room)."""
    stop.set()
    while thread.is_alive():
        try:
            q.get(timeout=0.05)
        except queue.Empty:
            pass
    thread.join()


def _put_unless(q: queue.Queue, item: Any, *stops: threading.Event) -> bool:
    """Put ``item`` into the bounded queue ``q``, waiting for room until any of ``stops`` is set (then False)."""
    while not any(e.is_set() for e in stops):
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


class DevicePrefetcher:
    """Runs the accelerator stage ``depth`` batches ahead of training, in a background thread.

    Wraps a loader of :class:`EncodedBatch` es: a thread takes each batch, calls ``stage(batch.to(device))``
    (a :class:`GpuPipeline`) on its own CUDA stream, and queues the ``(images, labels)`` with an event; the
    iterator makes the consumer's current stream wait for that event before handing the tensors out
    (``record_stream`` keeps the caching allocator from reusing their memory early). The stage's host work
    (kernel launches, JPEG parsing) then overlaps the model's step instead of adding to it, and Lightning
    sees ready ``(images, labels)`` tensors on the device. On an accelerator each batch's host memory is freed
    as soon as the stage has returned, with the GIL released (:meth:`EncodedBatch.release`): dropping the last
    reference would unmap it under the GIL, which stalls the training thread. Same batches in the same order as
    without it: resume positions count the batches the trainer processed, not the ones prefetched. The first batch of
    each pass runs in the consumer's own thread before the background thread starts (the stage's one-time
    CUDA graph captures must not overlap the training step: :class:`_AugmentGraphs`).

    Args:
        loader: iterable of :class:`EncodedBatch` (a DataLoader with :func:`collate_encoded`); ``len()``
            is forwarded.
        stage: ``EncodedBatch -> (images, labels)`` on ``device``.
        device: the training device (CUDA: side stream + events; CPU: the thread alone, for tests).
        depth: batches held ready (each costs one batch of float32 images in device memory).
        priority_consumer: CUDA: while the iterator runs, the consumer's thread (the training step) works on a
            high-priority stream (priority -1, created for the pass and made to wait for the caller's stream;
            the caller's stream is restored and made to wait for it at the end of the pass). The stage's
            streams keep the lowest priority, so the GPU's block scheduler gives the model's kernels the SMs
            first and the stage's kernels fill what the model leaves idle, instead of both time-sharing the SMs.
            No effect on a CPU device.
        decode_thread: decode the next batch (``stage.decode``: :meth:`GpuPipeline.decode`, which returns only after
            nvJPEG's device work) in a second background thread, on a stream of its own, while the stage thread
            crops and augments the current one (``stage.finish``); the stage thread's stream waits for each batch's
            decode event. Without it one thread does both, one after the other. The same batches in the same order.

    An exception in a thread (a corrupt shard, a decode error) is re-raised by the iterator.

    :meth:`timings` says where the time of the batches handed out so far went (host wall seconds, summed over
    passes): the consumer waiting for the next batch, the thread waiting for the loader, running the stage (of
    which ``decode_jpegs`` with its device wait) and waiting for room in the queue (the stage ahead of training).

    Raises:
        ValueError: ``depth < 1``; ``decode_thread`` with a stage that has no ``decode`` and ``finish``.
    """

    def __init__(self, loader: Iterable[EncodedBatch], stage: Callable[[EncodedBatch], tuple[Tensor, Tensor]],
                 device: torch.device | str, depth: int = 2, priority_consumer: bool = False,
                 decode_thread: bool = False) -> None:
        if depth < 1:
            raise ValueError(f"DevicePrefetcher: depth must be >= 1; got {depth}")
        if decode_thread and not all(callable(getattr(stage, m, None)) for m in ("decode", "finish")):
            raise ValueError("DevicePrefetcher: decode_thread needs a stage with decode() and finish() (a "
                             f"GpuPipeline); got {type(stage).__name__}")
        self.decode_thread = decode_thread
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # the thread must select the same device
            device = torch.device("cuda", torch.cuda.current_device())
        self.loader, self.stage, self.device, self.depth = loader, stage, device, depth
        self.priority_consumer = priority_consumer
        self._time = dict.fromkeys(("consumer_wait", "loader_wait", "stage", "stage_cpu", "queue_full")
                                   + (("decode_wait",) if decode_thread else ()), 0.0)
        self._batches = 0  # handed to the consumer

    def timings(self) -> dict[str, float]:
        """Host seconds so far (all passes): ``consumer_wait`` (the training loop waiting in this iterator for a
        batch), ``loader_wait`` (waiting for the loader's next batch: the DataLoader workers), ``stage`` (the stage
        thread in ``stage``, or in ``stage.finish`` with ``decode_thread``; the first batch of each pass
        included), ``stage_cpu`` (of ``stage``, the CPU time of the thread running it, ``time.thread_time``: its
        Python, op dispatch and nvJPEG's host decoding; the rest of ``stage`` it waited), ``decode`` (in
        ``decode_jpegs``, which returns after nvJPEG's device work:
        ``stage.decode_seconds``, 0 for a stage without it; part of ``stage`` without ``decode_thread``),
        ``decode_wait`` (only with ``decode_thread``: the stage thread waiting for the decode thread), ``queue_full``
        (the stage thread waiting for room: the stage ``depth`` batches ahead); and ``batches``, the batches
        handed to the consumer. Read from any thread; each value is written by one thread only."""
        return {**self._time, "decode": float(getattr(self.stage, "decode_seconds", 0.0)),
                "batches": float(self._batches)}

    def _run_stage(self, batch: EncodedBatch, imgs: list | None = None) -> tuple[Tensor, Tensor]:
        """``stage(batch)``, or ``stage.finish(batch, imgs)`` for a batch the decode thread decoded; then, on an
        accelerator, the host memory of a batch from a DataLoader worker is freed off the GIL
        (:meth:`EncodedBatch.release`; on the CPU the stage's labels are the batch's own tensor)."""
        t, cpu = time.perf_counter(), time.thread_time()
        moved = batch.to(self.device) if imgs is None else batch  # the decode thread moved its batches
        try:
            return self.stage(moved) if imgs is None else self.stage.finish(moved, imgs)
        finally:
            if isinstance(batch, EncodedBatch) and self.device.type != "cpu":
                moved.release()  # the stage marked this one if it holds the bytes (pages_held)
                batch.pages_held = moved.pages_held
                batch.release()  # the host labels the move left
            self._time["stage"] += time.perf_counter() - t
            self._time["stage_cpu"] += time.thread_time() - cpu

    def _loaded(self, it: Iterator[EncodedBatch]) -> Iterator[tuple[EncodedBatch, None]]:
        """The loader's batches, not yet decoded (one thread does the whole stage)."""
        while True:
            t = time.perf_counter()
            batch = next(it, _END)
            self._time["loader_wait"] += time.perf_counter() - t
            if batch is _END:
                return
            yield batch, None

    def _decoded(self, it: Iterator[EncodedBatch], stop: threading.Event) -> Iterator[tuple[EncodedBatch, list]]:
        """The loader's batches with their decoded images, from a decode thread one batch ahead
        (``decode_thread``); on CUDA the caller's current stream is made to wait for each batch's decode."""
        cuda = self.device.type == "cuda"
        q: queue.Queue = queue.Queue(maxsize=1)
        done = threading.Event()  # this generator has ended: the decode thread stops too

        def put(item: Any) -> bool:
            return _put_unless(q, item, stop, done)

        def decode_loop() -> None:
            try:
                if cuda:
                    torch.cuda.set_device(self.device)
                stream = torch.cuda.Stream(self.device) if cuda else None
                with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                    for batch, _ in self._loaded(it):
                        batch = batch.to(self.device)
                        imgs = self.stage.decode(batch)
                        event = torch.cuda.Event() if cuda else None
                        if event is not None:
                            event.record(stream)
                        if not put((batch, imgs, event)):
                            return
            except BaseException as exc:  # handed to the stage thread, then to the consumer
                put(exc)
            finally:
                put(_END)

        thread = threading.Thread(target=decode_loop, daemon=True, name="mixlab-device-decode")
        thread.start()
        try:
            for batch, imgs in self._handed_over(q, "decode_wait"):
                yield batch, imgs
        finally:
            _stop_producer(thread, q, done)

    def _handed_over(self, q: queue.Queue, wait: str) -> Iterator[list]:
        """The items a producer thread puts into ``q``, up to its ``_END``; an exception it put is raised. Each
        item ends with a CUDA event (or None): the current stream waits for it, and the item's tensors (in lists
        too) are marked as used by that stream; the rest of the item is yielded as a list. The time waiting for
        each item is added to ``timings()[wait]``."""
        while True:
            t = time.perf_counter()
            item = q.get()
            self._time[wait] += time.perf_counter() - t
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            *payload, event = item
            if event is not None:
                current = torch.cuda.current_stream(self.device)
                current.wait_event(event)
                for v in payload:
                    for tensor in v if isinstance(v, list) else [v]:
                        if isinstance(tensor, Tensor):
                            tensor.record_stream(current)
            yield payload

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def _work(self, it: Iterator[EncodedBatch], out: queue.Queue, stop: threading.Event) -> None:
        cuda = self.device.type == "cuda"
        try:
            if cuda:
                torch.cuda.set_device(self.device)
            stream = torch.cuda.Stream(self.device) if cuda else None
            with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                source = self._decoded(it, stop) if self.decode_thread else self._loaded(it)
                with contextlib.closing(source):  # ends the decode thread on every way out
                    for batch, imgs in source:
                        if stop.is_set():
                            return
                        x, y = self._run_stage(batch, imgs)
                        event = torch.cuda.Event() if cuda else None
                        if event is not None:
                            event.record(stream)
                        t = time.perf_counter()
                        _put_unless(out, (x, y, event), stop)
                        self._time["queue_full"] += time.perf_counter() - t
        except BaseException as exc:  # handed to the consumer
            out.put(exc)
        finally:
            out.put(_END)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        it = iter(self.loader)
        first = next(it, _END)
        if first is _END:
            return
        caller = high = None
        if self.priority_consumer and self.device.type == "cuda":
            caller = torch.cuda.current_stream(self.device)
            high = torch.cuda.Stream(self.device, priority=-1)
            high.wait_stream(caller)
            torch.cuda.set_stream(high)
        try:
            yield from self._iterate(it, first)
        finally:
            if high is not None:
                caller.wait_stream(high)
                torch.cuda.set_stream(caller)

    def _iterate(self, it: Iterator[EncodedBatch], first: EncodedBatch) -> Iterator[tuple[Tensor, Tensor]]:
        # the first batch in the consumer's thread, before the background thread starts: the stage's one-time
        # work (CUDA graph captures, which no other thread may overlap with random draws) happens here
        x, y = self._run_stage(first)
        out: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        thread = threading.Thread(target=self._work, args=(it, out, stop), daemon=True, name="mixlab-device-prefetch")
        thread.start()
        try:
            self._batches += 1
            yield x, y
            del x, y
            for x, y in self._handed_over(out, "consumer_wait"):
                self._batches += 1
                yield x, y
        finally:
            _stop_producer(thread, out, stop)
