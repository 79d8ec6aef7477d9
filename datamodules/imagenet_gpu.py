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
* **the accelerator** (:class:`GpuPipeline`, called from the datamodule's ``on_after_batch_transfer``):
  ``torchvision.io.decode_jpeg(list, device=...)`` for the whole batch, the crop + bicubic (antialiased)
  resize per image, then the augmentations batched *with per-sample parameters*, normalisation and
  random erasing. The same code runs with ``device='cpu'`` (the tests).

Why not ``torchvision.transforms.v2.RandAugment`` / ``ColorJitter`` / ``RandomErasing`` on the batch: a
v2 transform draws one parameter set per call, so on a ``[B, 3, H, W]`` batch every image would get the
same op, magnitude and erasing box (a correlated batch, not the recipe), and v2's RandAugment differs from
timm's ``rand-m9-mstd0.5-inc1`` anyway (no Invert / SolarizeAdd, ops always applied instead of p=0.5, a
fixed magnitude on 31 bins instead of N(9, 0.5) on 10). Here each op is applied to the sub-batch that drew
it, with a ``[n]`` tensor of its arguments; torchvision kernels where they fit (``decode_jpeg``,
``resized_crop``, ``resize``, ``center_crop``, ``equalize``), short tensor versions of the PIL operations
timm calls otherwise (``ImageEnhance`` blends, ``ImageOps`` LUTs, ``Image.transform`` affine maps).

Differences to the CPU path (measured in ``tests/test_imagenet_gpu.py``):

* JPEG decoder: nvJPEG (or libjpeg-turbo through torchvision on CPU) vs PIL's libjpeg: +-1-2 levels;
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

import contextlib
import copy
import io
import queue
import random
import threading
from typing import Any, Callable, Iterable, Iterator

import torch
from PIL import Image
from torch import Tensor

__all__ = ["EncodedBatch", "TrainParams", "encode_sample", "collate_encoded", "GpuPipeline", "RA_OPS",
           "apply_ra_op", "decode_jpegs", "aa_resample_weights", "resized_crops", "DevicePrefetcher"]

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


def _record_op(name: str):
    from timm.data.auto_augment import _interpolation

    def fn(rec: _Recorder, *args, **kwargs) -> _Recorder:
        # geometric ops draw the interpolation (random.choice when a list) as timm's _check_args_tf does
        resample = int(_interpolation(dict(kwargs))) if name in _GEOMETRIC else 0
        rec.append((name, float(args[0]) if args else 0.0, resample))
        return rec
    return fn


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
                    op.aug_fn = _record_op(op.name)
                    ops.append(op)
                self.ra = RandAugment(ops, t.num_layers, t.choice_weights)
                self.ra_layers = int(t.num_layers)
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
        if self.ra is not None:
            rec = self.ra(_Recorder())
            op = torch.full((self.ra_layers,), -1, dtype=torch.int64)
            arg = torch.zeros(self.ra_layers, dtype=torch.float64)
            interp = torch.zeros(self.ra_layers, dtype=torch.int64)
            for k, (name, a, r) in enumerate(rec):
                op[k], arg[k], interp[k] = RA_OPS.index(name), a, r
            out.update(ra_op=op, ra_arg=arg, ra_interp=interp)
        if self.jitter is not None:
            t = self.jitter
            order, b, c, s, _ = t.get_params(t.brightness, t.contrast, t.saturation, t.hue)
            out["cj_order"] = order.to(torch.int64)
            out["cj_factor"] = torch.tensor([1.0 if v is None else float(v) for v in (b, c, s)] + [0.0],
                                            dtype=torch.float64)
        if self.eraser is not None:
            rec = _Recorder()
            self.eraser._erase(rec, 3, self.size[0], self.size[1], torch.float32)
            boxes = torch.zeros(self.max_erase, 4, dtype=torch.int64)
            for k, box in enumerate(rec):
                boxes[k] = torch.tensor(box)
            out["erase"] = boxes
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
        data: uint8 ``[N]``, the JPEG files one after another; offsets: int64 ``[B + 1]`` (image ``b`` is
            ``data[offsets[b]:offsets[b + 1]]``).
        labels: int64 ``[B]``. keys: ``B`` names (``'key' in shard``) for warnings.
        params: name -> ``[B, ...]`` tensor (:meth:`TrainParams.__call__`); empty for evaluation.
        train: whether ``params`` hold training augmentation.

    A plain class, not a tuple or dataclass: Lightning's input conversion and device transfer leave it
    alone; the datamodule's ``transfer_batch_to_device`` moves ``labels`` only (``decode_jpeg`` reads CPU
    bytes) and ``on_after_batch_transfer`` turns it into ``(images, labels)``.
    """

    def __init__(self, data: Tensor, offsets: Tensor, labels: Tensor, keys: list[str], params: dict[str, Tensor],
                 train: bool) -> None:
        self.data, self.offsets, self.labels, self.keys, self.params, self.train = (data, offsets, labels, keys,
                                                                                      params, train)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def pin_memory(self) -> EncodedBatch:  # the DataLoader's pin_memory thread calls this
        return self

    def to(self, device: torch.device | str) -> EncodedBatch:
        """The batch with ``labels`` on ``device`` (bytes and parameters stay on the CPU)."""
        return EncodedBatch(self.data, self.offsets, self.labels.to(device, non_blocking=True), self.keys,
                            self.params, self.train)


def collate_encoded(samples: list[dict]) -> EncodedBatch:
    """DataLoader ``collate_fn`` for :func:`encode_sample` outputs: bytes concatenated (one tensor per batch
    through the worker queue instead of ``B``), parameters stacked."""
    jpegs = [s["jpeg"] for s in samples]
    offsets = torch.zeros(len(jpegs) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor([len(j) for j in jpegs]).cumsum(0)
    names = [k for k in samples[0] if k not in ("jpeg", "label", "key") and not k.startswith("__")]  # wds adds __key__
    params = {k: torch.stack([s[k] for s in samples]) for k in names}
    return EncodedBatch(torch.cat(jpegs), offsets, torch.tensor([s["label"] for s in samples], dtype=torch.int64),
                        [s["key"] for s in samples], params, train=bool(names))


# ---------------------------------------------------------------------- accelerator side
def decode_jpegs(data: Tensor, offsets: Tensor, device: torch.device, keys: list[str]) -> list[Tensor | None]:
    """Decode a batch of JPEGs to RGB uint8 ``[3, H_b, W_b]`` tensors on ``device``.

    One batched ``torchvision.io.decode_jpeg`` call; when it raises (it fails for the whole batch), each
    image alone, then with PIL; an image no decoder reads is skipped with a counted warning and its entry
    is ``None``.
    """
    from torchvision.io import ImageReadMode, decode_jpeg

    from mixlab.datamodules.imagenet import _skip_corrupt

    bounds = offsets.tolist()
    chunks = [data[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
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

def _cubic_aa(x: Tensor) -> Tensor:
    """The bicubic filter of antialiased resampling (Keys, ``a = -0.5``: PIL's and torch's ``antialias=True``)."""
    a = -0.5
    x = x.abs()
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return torch.where(x < 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


def aa_resample_weights(in_sizes: Tensor, out_size: int, n_max: int, resized: Tensor | None = None,
                        offsets: Tensor | None = None) -> Tensor:
    """Resampling matrices of ``interpolate(mode="bicubic", antialias=True, align_corners=False)`` along one
    axis: ``[n, out_size, n_max]`` (row ``o`` of matrix ``b`` holds the weights of input pixels ``0 ..
    in_sizes[b] - 1`` for output pixel ``o``; zero beyond ``in_sizes[b]``), on ``in_sizes``' device and in
    float32. With ``resized`` (int ``[n]``) and ``offsets`` (int ``[n]``) the input is resized to
    ``resized[b]`` pixels and rows ``offsets[b] .. offsets[b] + out_size - 1`` of that are returned (a resize
    followed by a crop, as ``Resize`` + ``CenterCrop``).

    The filter support, window and normalisation follow ATen's ``_compute_indices_min_size_weights_aa``
    (PIL's ``ImagingResample``): scale ``s = in / out``, centre ``c = s (o + 1/2)``, support ``2 max(s, 1)``,
    window ``[trunc(c - support + 1/2), trunc(c + support + 1/2))`` clipped to the image, weights
    ``cubic((j - c + 1/2) / max(s, 1))`` normalised to sum 1.
    """
    dev = in_sizes.device
    size = in_sizes.to(torch.float64).view(-1, 1, 1)
    scale = size / (out_size if resized is None else resized.to(dev, torch.float64).view(-1, 1, 1))
    stretch = scale.clamp_min(1.0)  # support / 2 and the filter's stretch: max(s, 1)
    o = torch.arange(out_size, device=dev, dtype=torch.float64).view(1, -1, 1)
    if offsets is not None:
        o = o + offsets.to(dev, torch.float64).view(-1, 1, 1)
    centre = scale * (o + 0.5)
    lo = (centre - 2 * stretch + 0.5).trunc().clamp_min(0)
    hi = torch.minimum((centre + 2 * stretch + 0.5).trunc(), size)
    j = torch.arange(n_max, device=dev, dtype=torch.float64).view(1, 1, -1)
    w = _cubic_aa((j - centre + 0.5) / stretch) * ((j >= lo) & (j < hi))
    return (w / w.sum(-1, keepdim=True)).to(torch.float32)


def resized_crops(imgs: list[Tensor], boxes: Tensor, size: tuple[int, int], flip: Tensor | None = None,
                  max_bytes: int = 1 << 30, resized: Tensor | None = None, offsets: Tensor | None = None) -> Tensor:
    """Crop box ``b`` of image ``b``, resize it to ``size`` (bicubic, antialiased) and flip it horizontally
    where ``flip[b]``, for a whole batch in a few batched matrix products instead of one resize per image.

    Equals ``torchvision.transforms.functional.resized_crop(img, *box, size, BICUBIC, antialias=True)`` on
    uint8 images (rounded and clamped to 0..255) up to float32 summation order (and TF32 where the matmul
    precision allows it): antialiased resampling is separable, ``out = Wy @ crop @ Wx^T`` with the
    :func:`aa_resample_weights` matrices; a flip reverses ``Wx``'s rows. Images are processed in groups of
    similar crop size, each padded to its largest crop, at most ``max_bytes`` of float32 per group.

    Args:
        imgs: ``B`` uint8 ``[3, H_b, W_b]`` tensors on one device.
        boxes: int64 ``[B, 4]``: top, left, height, width of each crop in its image's pixels.
        size: output (height, width).
        flip: bool ``[B]`` or None.
        resized, offsets: int64 ``[B, 2]`` or None: resize each crop to ``resized[b]`` (height, width) and
            keep the ``size`` window at ``offsets[b]`` (top, left) of it (evaluation: ``Resize`` then
            ``CenterCrop``); default: resize to ``size`` itself.

    Returns:
        float32 ``[B, 3, size[0], size[1]]`` with integer values 0..255.
    """
    n = len(imgs)
    dev = imgs[0].device if n else torch.device("cpu")
    oh, ow = size
    out = torch.empty(n, 3, oh, ow, device=dev, dtype=torch.float32)
    if n == 0:
        return out
    bx = boxes.tolist()
    order = sorted(range(n), key=lambda b: bx[b][2] * bx[b][3])
    start = 0
    while start < n:
        end, hm, wm = start, 0, 0
        while end < n:  # grow the group while its padded float32 copy fits max_bytes
            _, _, h, w = bx[order[end]]
            h2, w2 = max(hm, h), max(wm, w)
            if end > start and (end - start + 1) * 3 * h2 * w2 * 4 > max_bytes:
                break
            hm, wm, end = h2, w2, end + 1
        idx = order[start:end]
        x = torch.zeros(len(idx), 3, hm, wm, device=dev, dtype=torch.uint8)
        for k, b in enumerate(idx):
            t, le, h, w = bx[b]
            x[k, :, :h, :w] = imgs[b][:, t:t + h, le:le + w]
        sizes = torch.tensor([[bx[b][2], bx[b][3]] for b in idx], dtype=torch.int64).to(dev, non_blocking=True)
        rs = None if resized is None else resized[idx].to(dev, non_blocking=True)
        off = None if offsets is None else offsets[idx].to(dev, non_blocking=True)
        wy = aa_resample_weights(sizes[:, 0], oh, hm, None if rs is None else rs[:, 0],
                                 None if off is None else off[:, 0])  # [g, oh, hm]
        wx = aa_resample_weights(sizes[:, 1], ow, wm, None if rs is None else rs[:, 1],
                                 None if off is None else off[:, 1])  # [g, ow, wm]
        if flip is not None:
            f = flip[idx].to(dev).view(-1, 1, 1)
            wx = torch.where(f, wx.flip(1), wx)
        y = torch.matmul(torch.matmul(wy.unsqueeze(1), x.float()), wx.transpose(1, 2).unsqueeze(1))
        out[torch.tensor(idx).to(dev, non_blocking=True)] = y.round_().clamp_(0, 255)
        start = end
    return out


def _gray(x: Tensor) -> Tensor:
    """PIL's ``convert('L')``: ``(19595 R + 38470 G + 7471 B + 2^15) >> 16``; x float ``[n, 3, H, W]`` in
    0..255 (integers) -> ``[n, 1, H, W]`` (exact in float32)."""
    r, g, b = x.unbind(1)
    return torch.floor((19595 * r + 38470 * g + 7471 * b + 32768) / 65536).unsqueeze(1)


def _blend(degenerate: Tensor, x: Tensor, factor: Tensor) -> Tensor:
    """PIL ``Image.blend(degenerate, x, factor)`` on 0..255 floats: ``trunc(d + f (x - d))`` clipped."""
    return (degenerate + factor.view(-1, 1, 1, 1) * (x - degenerate)).clamp(0, 255).floor()


def _smooth(x: Tensor) -> Tensor:
    """PIL ``ImageFilter.SMOOTH`` (3x3 kernel [1 1 1; 1 5 1; 1 1 1] / 13, rounded; border pixels kept)."""
    k = torch.ones(3, 3, dtype=x.dtype, device=x.device)
    k[1, 1] = 5
    k = (k / 13).expand(3, 1, 3, 3)
    out = x.clone()
    out[..., 1:-1, 1:-1] = torch.nn.functional.conv2d(x, k, groups=3).add(0.5).floor().clamp(0, 255)
    return out


def _pil_affine(x: Tensor, m: Tensor, mode: str, fill: Tensor) -> Tensor:
    """PIL ``Image.transform(size, AFFINE, m)`` for a batch: output pixel centre ``(X + .5, Y + .5)`` reads
    the input at ``(a X' + b Y' + c, d X' + e Y' + f)`` (``m`` float64 ``[n, 6]``), points outside the
    image get ``fill`` (``[3]``); ``grid_sample`` interpolation ``mode``."""
    n, _, h, w = x.shape
    ys = torch.arange(h, device=x.device, dtype=torch.float64) + 0.5
    xs = torch.arange(w, device=x.device, dtype=torch.float64) + 0.5
    m = m.to(x.device).view(n, 6, 1, 1)
    u = m[:, 0] * xs.view(1, 1, w) + m[:, 1] * ys.view(1, h, 1) + m[:, 2]  # [n, h, w] input x (pixels)
    v = m[:, 3] * xs.view(1, 1, w) + m[:, 4] * ys.view(1, h, 1) + m[:, 5]
    grid = torch.stack([2 * u / w - 1, 2 * v / h - 1], dim=-1).to(x.dtype)
    out = torch.nn.functional.grid_sample(x, grid, mode=mode, padding_mode="border", align_corners=False)
    inside = ((u >= 0) & (u < w) & (v >= 0) & (v < h)).unsqueeze(1)
    return torch.where(inside, out.round().clamp(0, 255), fill.view(1, 3, 1, 1))


def _affine_matrix(name: str, arg: Tensor, h: int, w: int) -> Tensor:
    """timm's PIL affine coefficients (float64 ``[n, 6]``) of a geometric op with arguments ``arg`` ``[n]``."""
    one, zero = torch.ones_like(arg), torch.zeros_like(arg)
    if name == "ShearX":
        return torch.stack([one, arg, zero, zero, one, zero], 1)
    if name == "ShearY":
        return torch.stack([one, zero, zero, arg, one, zero], 1)
    if name in ("TranslateX", "TranslateXRel"):
        px = arg * w if name.endswith("Rel") else arg
        return torch.stack([one, zero, px, zero, one, zero], 1)
    if name in ("TranslateY", "TranslateYRel"):
        px = arg * h if name.endswith("Rel") else arg
        return torch.stack([one, zero, zero, zero, one, px], 1)
    # Rotate: PIL Image.rotate(degrees) about the centre, counter-clockwise
    t = -torch.deg2rad(arg)
    a, b, d, e = torch.cos(t), torch.sin(t), -torch.sin(t), torch.cos(t)
    cx, cy = w / 2.0, h / 2.0
    return torch.stack([a, b, a * -cx + b * -cy + cx, d, e, d * -cx + e * -cy + cy], 1)


def apply_ra_op(name: str, x: Tensor, arg: Tensor, interp: int = 3, fill: Tensor | None = None) -> Tensor:
    """One timm RandAugment op on a sub-batch, each image with its own argument.

    Args:
        name: a timm op name (:data:`RA_OPS`).
        x: float32 ``[n, 3, H, W]``, integer levels 0..255 (a uint8 image held as float).
        arg: float64 ``[n]``: timm's level argument of each image (unused by AutoContrast/Equalize/Invert).
        interp: PIL resampling code of geometric ops (0 nearest, 2 bilinear, 3 bicubic).
        fill: float ``[3]`` levels for points outside the image (geometric ops; timm: the mean colour).

    Returns:
        float32 ``[n, 3, H, W]`` integer levels 0..255.
    """
    dev = x.device
    a = arg.to(dev, torch.float32)
    if name == "AutoContrast":  # ImageOps.autocontrast: per channel lo..hi -> 0..255, int() of the LUT value
        xd = x.double()  # PIL builds the LUT in double precision
        lo = xd.amin(dim=(-2, -1), keepdim=True)
        hi = xd.amax(dim=(-2, -1), keepdim=True)
        scale = torch.full_like(hi, 255.0) / (hi - lo).clamp_min(1)  # not 255 / t: that is 255 * (1 / t)
        return torch.where(hi > lo, (xd * scale - lo * scale).floor().clamp(0, 255), xd).to(x.dtype)
    if name == "Equalize":
        from torchvision.transforms.v2.functional import equalize

        return equalize(x.to(torch.uint8)).to(x.dtype)
    if name == "Invert":
        return 255 - x
    if name.startswith("Posterize"):  # keep the `bits` most significant bits
        bits = arg.to(torch.int64).clamp(0, 8)
        mask = ((255 << (8 - bits)) & 255).to(dev, torch.uint8).view(-1, 1, 1, 1)
        return (x.to(torch.uint8) & mask).to(x.dtype)
    if name.startswith("Solarize") and name != "SolarizeAdd":  # invert levels >= threshold
        t = a.view(-1, 1, 1, 1)
        return torch.where(x < t, x, 255 - x)
    if name == "SolarizeAdd":  # add to levels < 128
        return torch.where(x < 128, (x + a.view(-1, 1, 1, 1)).clamp(max=255), x)
    if name.startswith("Color"):  # ImageEnhance.Color: blend with the grey image
        return _blend(_gray(x).expand_as(x), x, a)
    if name.startswith("Contrast"):  # ImageEnhance.Contrast: blend with the mean grey level (rounded)
        mean = torch.floor(_gray(x).mean(dim=(-3, -2, -1), keepdim=True) + 0.5)
        return _blend(mean.expand_as(x), x, a)
    if name.startswith("Brightness"):  # ImageEnhance.Brightness: blend with black
        return _blend(torch.zeros_like(x), x, a)
    if name.startswith("Sharpness"):  # ImageEnhance.Sharpness: blend with the smoothed image
        return _blend(_smooth(x), x, a)
    if name in _GEOMETRIC:
        fill = torch.full((3,), 128.0) if fill is None else fill
        m = _affine_matrix(name, arg.to(torch.float64), x.shape[-2], x.shape[-1])
        return _pil_affine(x, m, _PIL_MODES[int(interp)], fill.to(dev, x.dtype))
    raise NotImplementedError(f"RandAugment op {name!r}")


_JITTER = ("Brightness", "Contrast", "Color")  # torchvision ColorJitter fn ids 0, 1, 2 on PIL = ImageEnhance


class GpuPipeline:
    """Accelerator side of ``decode: gpu``: :class:`EncodedBatch` -> ``(images, labels)``.

    Args:
        transform: the split's timm transform (``Compose``) as the CPU path would use it: training
            (:class:`TrainParams` reads its steps) or evaluation (its first two steps, Resize or
            ResizeKeepRatio and CenterCrop, run on the decoded tensors; then Normalize).

    ``__call__(batch)`` returns images float32 ``[B', 3, H, W]`` (normalised, on ``batch.labels.device``)
    and labels int64 ``[B']``; ``B' = B`` minus images no decoder could read (counted, warned).
    """

    def __init__(self, transform: Any, train: bool) -> None:
        self.train = train
        if train:
            self.params = TrainParams(transform)
            self.size, mean, std = self.params.size, self.params.mean, self.params.std
        else:
            steps = list(transform.transforms)
            self.resize, self.crop = steps[0], steps[1]
            norm = next(t for t in steps if type(t).__name__ == "Normalize")
            mean, std = tuple(float(v) for v in norm.mean), tuple(float(v) for v in norm.std)
        self.mean, self.std = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
        if train:
            from torchvision.transforms import InterpolationMode

            interp = self.params.rrc.interpolation  # timm's RandomResizedCrop: an InterpolationMode
            self.interp = InterpolationMode(interp.value) if hasattr(interp, "value") else InterpolationMode.BICUBIC
            self.fill = torch.tensor(getattr(self.params, "fill", (128.0,) * 3))  # RandAugment's fill colour

    def __call__(self, batch: EncodedBatch) -> tuple[Tensor, Tensor]:
        dev = batch.labels.device
        imgs = decode_jpegs(batch.data, batch.offsets, dev, batch.keys)
        keep = [k for k, im in enumerate(imgs) if im is not None]
        labels = batch.labels
        params = batch.params
        if len(keep) < len(imgs):
            labels = labels[torch.tensor(keep, device=dev)]
            params = {k: v[keep] for k, v in params.items()}
            imgs = [imgs[k] for k in keep]
        x = self._train(imgs, params, dev) if self.train else self._eval(imgs)
        x = (x / 255 - self.mean.to(dev)) / self.std.to(dev)
        if self.train and "erase" in params:
            x = self._erase(x, params["erase"], params["seed"])
        return x, labels

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
        return resized_crops(imgs, boxes, (ch, cw), resized=torch.tensor(rs, dtype=torch.int64), offsets=offsets)

    def _train(self, imgs: list[Tensor], p: dict[str, Tensor], dev: torch.device) -> Tensor:
        from torchvision.transforms import InterpolationMode

        if self.interp == InterpolationMode.BICUBIC:  # crop + resize + flip, batched
            x = resized_crops(imgs, p["crop"], tuple(self.size), p["flip"])
        else:
            from torchvision.transforms.functional import resized_crop

            x = torch.stack([resized_crop(im, i, j, h, w, list(self.size), interpolation=self.interp, antialias=True)
                             for im, (i, j, h, w) in zip(imgs, p["crop"].tolist())])
            x = torch.where(p["flip"].to(dev).view(-1, 1, 1, 1), x.flip(-1), x).float()
        if "cj_order" in p:
            for step in range(p["cj_order"].shape[1]):
                fn = p["cj_order"][:, step]
                for f in range(3):
                    idx = (fn == f).nonzero().flatten()
                    factor = p["cj_factor"][idx, f]
                    idx, factor = idx[factor != 1.0], factor[factor != 1.0]
                    if len(idx):
                        di = idx.to(dev)
                        x[di] = apply_ra_op(_JITTER[f], x[di], factor)
        if "ra_op" in p:
            x = self._rand_augment(x, p["ra_op"], p["ra_arg"], p["ra_interp"], dev)
        return x

    def _rand_augment(self, x: Tensor, ops: Tensor, args: Tensor, interps: Tensor, dev: torch.device) -> Tensor:
        """timm RandAugment with per-image ops: layer by layer, each (op, interpolation) group of images in
        one call. The groups are formed on the host from the ``[B, L]`` draws and their image indices and
        arguments reach the device in one copy each (no per-group transfer or synchronisation)."""
        groups: list[tuple[int, int, list[int], int]] = []  # (op, interp, images, layer)
        ops_l, interp_l = ops.tolist(), interps.tolist()
        for layer in range(ops.shape[1]):
            by_op: dict[tuple[int, int], list[int]] = {}
            for b, (row, irow) in enumerate(zip(ops_l, interp_l)):
                if row[layer] >= 0:
                    by_op.setdefault((row[layer], irow[layer]), []).append(b)
            groups += [(op, ip, imgs, layer) for (op, ip), imgs in sorted(by_op.items())]
        if not groups:
            return x
        flat = torch.tensor([b for _, _, imgs, _ in groups for b in imgs], dtype=torch.int64)
        layers = torch.tensor([layer for _, _, imgs, layer in groups for _ in imgs], dtype=torch.int64)
        idx_dev = flat.to(dev, non_blocking=True)
        arg_dev = args[flat, layers].to(dev, non_blocking=True)
        fill = self.fill.to(x.device, x.dtype)
        pos = 0
        for op, ip, imgs, _ in groups:
            di, a = idx_dev[pos:pos + len(imgs)], arg_dev[pos:pos + len(imgs)]
            pos += len(imgs)
            x[di] = apply_ra_op(RA_OPS[op], x[di], a, ip, fill)
        return x

    @staticmethod
    def _erase(x: Tensor, boxes: Tensor, seeds: Tensor) -> Tensor:
        """timm RandomErasing ``mode='pixel'`` with the sampled ``boxes`` int64 ``[B, C, 4]`` (top, left,
        height, width; height 0 = none): N(0, 1) noise (normalised units) from a generator seeded by the
        batch's ``seeds``, so a batch is erased the same way again (exact resume). Writes into ``x`` (the
        pipeline's own freshly normalised batch) and returns it."""
        any_box = (boxes[..., 2] > 0).any(1)
        if not bool(any_box.any()):
            return x
        n, _, h, w = x.shape
        gen = torch.Generator(device=x.device)
        gen.manual_seed(int(seeds.sum()) % 2**63)
        idx = any_box.nonzero().flatten()
        noise = torch.randn((len(idx), *x.shape[1:]), generator=gen, device=x.device, dtype=x.dtype)
        b = boxes[idx].to(x.device)  # [n_e, C, 4]
        ys = torch.arange(h, device=x.device).view(1, 1, h, 1)
        xs = torch.arange(w, device=x.device).view(1, 1, 1, w)
        top, left, bh, bw = (b[..., k].view(len(idx), -1, 1, 1) for k in range(4))
        mask = ((ys >= top) & (ys < top + bh) & (xs >= left) & (xs < left + bw)).any(1, keepdim=True)
        di = idx.to(x.device)
        x[di] = torch.where(mask, noise, x[di])
        return x


_END = object()


class DevicePrefetcher:
    """Runs the accelerator stage ``depth`` batches ahead of training, in a background thread.

    Wraps a loader of :class:`EncodedBatch` es: a thread takes each batch, calls ``stage(batch.to(device))``
    (a :class:`GpuPipeline`) on its own CUDA stream, and queues the ``(images, labels)`` with an event; the
    iterator makes the consumer's current stream wait for that event before handing the tensors out
    (``record_stream`` keeps the caching allocator from reusing their memory early). The stage's host work
    (kernel launches, JPEG parsing) then overlaps the model's step instead of adding to it, and Lightning
    sees ready ``(images, labels)`` tensors on the device. Same batches in the same order as without it:
    resume positions count the batches the trainer processed, not the ones prefetched.

    Args:
        loader: iterable of :class:`EncodedBatch` (a DataLoader with :func:`collate_encoded`); ``len()``
            is forwarded.
        stage: ``EncodedBatch -> (images, labels)`` on ``device``.
        device: the training device (CUDA: side stream + events; CPU: the thread alone, for tests).
        depth: batches held ready (each costs one batch of float32 images in device memory).

    An exception in the thread (a corrupt shard, a decode error) is re-raised by the iterator.

    Raises:
        ValueError: ``depth < 1``.
    """

    def __init__(self, loader: Iterable[EncodedBatch], stage: Callable[[EncodedBatch], tuple[Tensor, Tensor]],
                 device: torch.device | str, depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"DevicePrefetcher: depth must be >= 1; got {depth}")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # the thread must select the same device
            device = torch.device("cuda", torch.cuda.current_device())
        self.loader, self.stage, self.device, self.depth = loader, stage, device, depth

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def _work(self, it: Iterator[EncodedBatch], out: queue.Queue, stop: threading.Event) -> None:
        cuda = self.device.type == "cuda"
        try:
            if cuda:
                torch.cuda.set_device(self.device)
            stream = torch.cuda.Stream(self.device) if cuda else None
            with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                for batch in it:
                    if stop.is_set():
                        return
                    x, y = self.stage(batch.to(self.device))
                    event = torch.cuda.Event() if cuda else None
                    if event is not None:
                        event.record(stream)
                    while not stop.is_set():
                        try:
                            out.put((x, y, event), timeout=0.1)
                            break
                        except queue.Full:
                            continue
        except BaseException as exc:  # handed to the consumer
            out.put(exc)
        finally:
            out.put(_END)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        out: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        thread = threading.Thread(target=self._work, args=(iter(self.loader), out, stop), daemon=True,
                                  name="mixlab-device-prefetch")
        thread.start()
        try:
            while True:
                item = out.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                x, y, event = item
                if event is not None:
                    current = torch.cuda.current_stream(self.device)
                    current.wait_event(event)
                    x.record_stream(current)
                    y.record_stream(current)
                yield x, y
        finally:
            stop.set()
            while thread.is_alive():  # unblock a producer waiting on a full queue
                try:
                    out.get(timeout=0.05)
                except queue.Empty:
                    pass
            thread.join()
