"""Triton kernels of the ImageNet device stage (``decode: gpu`` on CUDA, ``augment_impl: triton``): one colour-jitter
step or RandAugment layer for the WHOLE batch, each image with its own op, in two launches; and the batch's crop +
resize in two more (:func:`crop_resize`, below).

:class:`mixlab.datamodules.imagenet_gpu._Layer` is the readable reference: it runs a layer per op *family*
(``index_select`` -> batched torch ops -> ``index_copy_``), about 70 small kernels per layer. Here the same layer is

1. :func:`layer_stats` (one launch): for the images of the lookup-table family, each channel's histogram, minimum
   and maximum level and the image's summed grey level (PIL ``L``), by atomics into small per-image buffers;
2. the per-image, per-channel 256-entry tables of the point ops and Equalize from those statistics (torch ops on
   ``[n, 3, 256]``, the reference's own functions :func:`~mixlab.datamodules.imagenet_gpu.point_op_tables`);
3. :func:`layer_apply` (one launch): every output pixel of every image by its image's family: a table lookup, a
   blend with the grey or smoothed image (Color, Sharpness), PIL's affine transform (Rotate, Shear, Translate) with
   ``grid_sample``'s nearest / bilinear / bicubic (a = -0.75) sampling and border taps, or a copy.

The kernels compile with ``enable_fp_fusion=False``: no multiply-add is contracted, so the blends' ``floor(d + f (x -
d))`` round as the reference's separate torch ops do and equal them exactly; the table lookups are exact as well.
The affine sampling follows ``grid_sample``'s arithmetic step by step, but torch's own kernels may contract or
vectorise it: an output level can differ by one where the sampled value lies within rounding of a half level
(tests bound it). No autotuning: the kernels also run on CPU under ``TRITON_INTERPRET=1`` (set before Triton is
imported), which the tests use.

:func:`crop_resize` is the antialiased bicubic resize of each image's crop box (RandomResizedCrop; Resize +
CenterCrop for evaluation) that ``imagenet_gpu.resized_crops`` otherwise runs as batched TF32 GEMMs: a horizontal pass
over every crop row into a float32 scratch, then a vertical pass, each output pixel the float32 sum of its window's
taps (PIL's order and weights, as torchvision's ``resized_crop`` on float images).

This module imports Triton: :mod:`~mixlab.datamodules.imagenet_gpu` imports it only
for a CUDA stage, when Triton is installed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["layer_stats", "layer_apply", "crop_resize"]
_BLOCK = 1024  # pixels per program
_TILE_ROWS, _TILE_COLS = 4, 128  # crop_resize: the output tile of one program (rows x columns)


@triton.jit
def _stats(x_ptr, fam_ptr, hist_ptr, lo_ptr, hi_ptr, gsum_ptr, HW, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    if tl.load(fam_ptr + b) == 1:
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < HW
        base = x_ptr + b * 3 * HW
        r = tl.load(base + offs, mask=m, other=0.0).to(tl.int32)
        g = tl.load(base + HW + offs, mask=m, other=0.0).to(tl.int32)
        bl = tl.load(base + 2 * HW + offs, mask=m, other=0.0).to(tl.int32)
        grey = (19595 * r + 38470 * g + 7471 * bl + 32768) >> 16
        tl.atomic_add(gsum_ptr + b, tl.sum(tl.where(m, grey, 0), axis=0))
        bins = tl.arange(0, 256)
        for c in tl.static_range(3):
            v = r if c == 0 else (g if c == 1 else bl)
            tl.atomic_min(lo_ptr + b * 3 + c, tl.min(tl.where(m, v, 255), axis=0))
            tl.atomic_max(hi_ptr + b * 3 + c, tl.max(tl.where(m, v, 0), axis=0))
            # masked-out pixels count in bin 0 (value 0): take them out again
            h = tl.histogram(v, 256) - tl.where(bins == 0, BLOCK - tl.sum(m.to(tl.int32), axis=0), 0)
            tl.atomic_add(hist_ptr + (b * 3 + c) * 256 + bins, h)

@triton.jit
def _bicubic_w(t):
    # grid_sample's cubic convolution coefficients (A = -0.75) for the taps at -1, 0, 1, 2 of fractional t
    A = -0.75
    x1 = t + 1.0
    w0 = ((A * x1 - 5.0 * A) * x1 + 8.0 * A) * x1 - 4.0 * A
    w1 = ((A + 2.0) * t - (A + 3.0)) * t * t + 1.0
    x2 = 1.0 - t
    w2 = ((A + 2.0) * x2 - (A + 3.0)) * x2 * x2 + 1.0
    x3 = x2 + 1.0
    w3 = ((A * x3 - 5.0 * A) * x3 + 8.0 * A) * x3 - 4.0 * A
    return w0, w1, w2, w3

@triton.jit
def _rint(x):
    # round half to even (torch.round), float32
    f = tl.floor(x)
    d = x - f
    even = (f - 2.0 * tl.floor(f * 0.5)) == 0.0
    return tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, tl.where(even, f, f + 1.0)))



@triton.jit
def _apply(x_ptr, y_ptr, fam_ptr, aff_ptr, mode_ptr, blend_ptr, tab_ptr, fill_ptr, H, W,
           BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    HW = H * W
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < HW
    yy = offs // W
    xx = offs % W
    src = x_ptr + b * 3 * HW
    dst = y_ptr + b * 3 * HW
    fam = tl.load(fam_ptr + b)
    if fam == 0:  # no op: a copy
        for c in tl.static_range(3):
            tl.store(dst + c * HW + offs, tl.load(src + c * HW + offs, mask=m, other=0.0), mask=m)
    elif fam == 1:  # point ops and Equalize: the image's per-channel table
        for c in tl.static_range(3):
            v = tl.load(src + c * HW + offs, mask=m, other=0.0).to(tl.int32)
            t = tl.load(tab_ptr + (b * 3 + c) * 256 + v, mask=m, other=0.0)
            tl.store(dst + c * HW + offs, t, mask=m)
    elif fam == 2:  # Color / Sharpness: PIL Image.blend(degenerate, x, factor), truncated
        sharp = tl.load(blend_ptr + 2 * b)
        f = tl.load(blend_ptr + 2 * b + 1).to(tl.float32)
        r = tl.load(src + offs, mask=m, other=0.0)
        g = tl.load(src + HW + offs, mask=m, other=0.0)
        bl = tl.load(src + 2 * HW + offs, mask=m, other=0.0)
        grey = ((19595 * r.to(tl.int32) + 38470 * g.to(tl.int32) + 7471 * bl.to(tl.int32) + 32768)
                >> 16).to(tl.float32)
        interior = m & (yy > 0) & (yy < H - 1) & (xx > 0) & (xx < W - 1)
        for c in tl.static_range(3):
            x = r if c == 0 else (g if c == 1 else bl)
            if sharp > 0:  # ImageFilter.SMOOTH: [1 1 1; 1 5 1; 1 1 1] / 13, rounded; border pixels kept
                s = 4.0 * x
                for dy in tl.static_range(3):
                    for dx in tl.static_range(3):
                        s += tl.load(src + c * HW + offs + (dy - 1) * W + (dx - 1), mask=interior, other=0.0)
                smooth = tl.minimum(tl.maximum(tl.floor(s / 13.0 + 0.5), 0.0), 255.0)
                d = tl.where(interior, smooth, x)
            else:
                d = grey
            out = tl.floor(tl.minimum(tl.maximum(d + f * (x - d), 0.0), 255.0))
            tl.store(dst + c * HW + offs, out, mask=m)
    else:  # PIL Image.transform(AFFINE) sampled as grid_sample(align_corners=False, padding_mode="border")
        a0 = tl.load(aff_ptr + 6 * b)
        a1 = tl.load(aff_ptr + 6 * b + 1)
        a2 = tl.load(aff_ptr + 6 * b + 2)
        a3 = tl.load(aff_ptr + 6 * b + 3)
        a4 = tl.load(aff_ptr + 6 * b + 4)
        a5 = tl.load(aff_ptr + 6 * b + 5)
        mode = tl.load(mode_ptr + b)
        px = xx.to(tl.float64) + 0.5
        py = yy.to(tl.float64) + 0.5
        u = a0 * px + a1 * py + a2
        v = a3 * px + a4 * py + a5
        inside = (u >= 0) & (u < W) & (v >= 0) & (v < H)
        gx = (2.0 * u / W - 1.0).to(tl.float32)
        gy = (2.0 * v / H - 1.0).to(tl.float32)
        ix = ((gx + 1.0) * W - 1.0) / 2.0  # grid_sampler_unnormalize
        iy = ((gy + 1.0) * H - 1.0) / 2.0
        for c in tl.static_range(3):
            chan = src + c * HW
            if mode == 2:  # bicubic: 4 x 4 taps, each index clamped to the image (border)
                x0 = tl.floor(ix)
                y0 = tl.floor(iy)
                wx0, wx1, wx2, wx3 = _bicubic_w(ix - x0)
                wy0, wy1, wy2, wy3 = _bicubic_w(iy - y0)
                xi = x0.to(tl.int32)
                yi = y0.to(tl.int32)
                c0 = tl.minimum(tl.maximum(xi - 1, 0), W - 1)
                c1 = tl.minimum(tl.maximum(xi, 0), W - 1)
                c2 = tl.minimum(tl.maximum(xi + 1, 0), W - 1)
                c3 = tl.minimum(tl.maximum(xi + 2, 0), W - 1)
                val = tl.zeros([BLOCK], tl.float32)
                for j in tl.static_range(4):
                    row = tl.minimum(tl.maximum(yi - 1 + j, 0), H - 1) * W
                    p0 = tl.load(chan + row + c0, mask=m, other=0.0)
                    p1 = tl.load(chan + row + c1, mask=m, other=0.0)
                    p2 = tl.load(chan + row + c2, mask=m, other=0.0)
                    p3 = tl.load(chan + row + c3, mask=m, other=0.0)
                    rv = p0 * wx0 + p1 * wx1 + p2 * wx2 + p3 * wx3
                    wy = wy0 if j == 0 else (wy1 if j == 1 else (wy2 if j == 2 else wy3))
                    val = rv * wy if j == 0 else val + rv * wy
            elif mode == 1:  # bilinear on the clipped coordinate; taps outside the image weigh nothing
                cx = tl.minimum(tl.maximum(ix, 0.0), W - 1.0)
                cy = tl.minimum(tl.maximum(iy, 0.0), H - 1.0)
                xw = tl.floor(cx)
                yn = tl.floor(cy)
                xe = xw + 1.0
                ys = yn + 1.0
                xwi = xw.to(tl.int32)
                yni = yn.to(tl.int32)
                e_ok = (xwi + 1) < W
                s_ok = (yni + 1) < H
                nw = tl.load(chan + yni * W + xwi, mask=m, other=0.0)
                ne = tl.load(chan + yni * W + xwi + 1, mask=m & e_ok, other=0.0)
                sw = tl.load(chan + (yni + 1) * W + xwi, mask=m & s_ok, other=0.0)
                se = tl.load(chan + (yni + 1) * W + xwi + 1, mask=m & e_ok & s_ok, other=0.0)
                val = nw * ((xe - cx) * (ys - cy))
                val = val + ne * ((cx - xw) * (ys - cy))
                val = val + sw * ((xe - cx) * (cy - yn))
                val = val + se * ((cx - xw) * (cy - yn))
            else:  # nearest: round half to even on the clipped coordinate
                cx = tl.minimum(tl.maximum(ix, 0.0), W - 1.0)
                cy = tl.minimum(tl.maximum(iy, 0.0), H - 1.0)
                val = tl.load(chan + _rint(cy).to(tl.int32) * W + _rint(cx).to(tl.int32), mask=m, other=0.0)
            fill = tl.load(fill_ptr + c).to(tl.float32)
            out = tl.where(inside, tl.minimum(tl.maximum(_rint(val), 0.0), 255.0), fill)
            tl.store(dst + c * HW + offs, out, mask=m)



def layer_stats(x: Tensor, fam: Tensor, hist: Tensor, lo: Tensor, hi: Tensor, gsum: Tensor) -> None:
    """Statistics of the table-family images of ``x`` for their point-op tables, accumulated into zeroed buffers.

    Args:
        x: float32 ``[n, 3, H, W]``, contiguous, integer levels 0..255.
        fam: int64 ``[n]``: the family code per image (0 no op, 1 lookup table, 2 blend, 3 affine:
            ``imagenet_gpu._KERNEL_FAMILY``); only images with code 1 are read.
        hist: int32 ``[n, 3, 256]`` zeros -> each channel's histogram.
        lo: int32 ``[n, 3]`` filled with 255 -> each channel's minimum level; hi: int32 ``[n, 3]`` zeros -> maximum.
        gsum: int32 ``[n]`` zeros -> the sum over pixels of PIL's grey level ``(19595 R + 38470 G + 7471 B + 2^15)
            >> 16`` (exact: at most 255 H W).
    """
    n, _, h, w = x.shape
    if n == 0:
        return
    _stats[(n, triton.cdiv(h * w, _BLOCK))](x, fam, hist, lo, hi, gsum, h * w, BLOCK=_BLOCK, enable_fp_fusion=False)


def layer_apply(x: Tensor, out: Tensor, fam: Tensor, aff: Tensor, mode: Tensor, blend: Tensor, tables: Tensor,
                fill: Tensor) -> None:
    """One augmentation layer over the batch ``x`` into ``out`` (both float32 ``[n, 3, H, W]``, contiguous, integer
    levels 0..255; not the same memory: the Sharpness and affine pixels read their neighbours).

    Args:
        fam: int64 ``[n]`` family codes (:func:`layer_stats`).
        aff: float64 ``[n, 6]`` PIL affine coefficients (family 3): output pixel centre ``(X + .5, Y + .5)`` reads
            the input at ``(a X' + b Y' + c, d X' + e Y' + f)``.
        mode: int64 ``[n]`` sampling of the affine images: 0 nearest, 1 bilinear, 2 bicubic (``grid_sample``'s).
        blend: float64 ``[n, 2]``: (1 Sharpness / 0 Color, factor) of the blend images (family 2).
        tables: float32 ``[n, 3, 256]`` each channel's lookup table (family 1).
        fill: float64 ``[3]`` levels of the affine images outside the input.
    """
    n, _, h, w = x.shape
    if n == 0:
        return
    _apply[(n, triton.cdiv(h * w, _BLOCK))](x, out, fam, aff, mode, blend, tables, fill, h, w, BLOCK=_BLOCK,
                                            enable_fp_fusion=False)


@triton.jit
def _resize_rows(src_ptr, meta_ptr, x0_ptr, wx_ptr, tmp_ptr, OW, MO, TAPS,
                 BLOCK_R: tl.constexpr, BLOCK_X: tl.constexpr):
    # horizontal pass: crop row r of image b, all three channels -> tmp[tbase + (3 r + c) OW + ox]
    b = tl.program_id(0).to(tl.int64)
    r0 = tl.program_id(1) * BLOCK_R
    meta = meta_ptr + b * 8
    ch = tl.load(meta + 5)
    if r0 < ch:
        base, width, plane = tl.load(meta), tl.load(meta + 1), tl.load(meta + 2)
        top, left, cw, tbase = tl.load(meta + 3), tl.load(meta + 4), tl.load(meta + 6), tl.load(meta + 7)
        rows = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
        ox = tl.program_id(2) * BLOCK_X + tl.arange(0, BLOCK_X)
        rm = rows < ch
        xm = ox < OW
        m = rm[:, None] & xm[None, :]
        x0 = tl.load(x0_ptr + b * MO + ox, mask=xm, other=0)
        src = src_ptr + (base + (top + rows) * width + left)[:, None]
        a0 = tl.zeros((BLOCK_R, BLOCK_X), dtype=tl.float32)
        a1 = tl.zeros((BLOCK_R, BLOCK_X), dtype=tl.float32)
        a2 = tl.zeros((BLOCK_R, BLOCK_X), dtype=tl.float32)
        for k in range(TAPS):
            w = tl.load(wx_ptr + (b * MO + ox) * TAPS + k, mask=xm, other=0.0)[None, :]
            p = src + tl.minimum(x0 + k, cw - 1)[None, :]  # past the window: zero weight, a pixel of the crop
            a0 += w * tl.load(p, mask=m, other=0).to(tl.float32)
            a1 += w * tl.load(p + plane, mask=m, other=0).to(tl.float32)
            a2 += w * tl.load(p + 2 * plane, mask=m, other=0).to(tl.float32)
        t = tmp_ptr + tbase + (3 * rows * OW)[:, None] + ox[None, :]
        tl.store(t, a0, mask=m)
        tl.store(t + OW, a1, mask=m)
        tl.store(t + 2 * OW, a2, mask=m)


@triton.jit
def _resize_cols(tmp_ptr, meta_ptr, y0_ptr, wy_ptr, out_ptr, OH, OW, MO, TAPS,
                 BLOCK_R: tl.constexpr, BLOCK_X: tl.constexpr):
    # vertical pass: output rows oy of image b from its tmp rows, rounded to levels 0..255
    b = tl.program_id(0).to(tl.int64)
    oy = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    ox = tl.program_id(2) * BLOCK_X + tl.arange(0, BLOCK_X)
    ym = oy < OH
    m = ym[:, None] & (ox < OW)[None, :]
    meta = meta_ptr + b * 8
    ch, tbase = tl.load(meta + 5), tl.load(meta + 7)
    y0 = tl.load(y0_ptr + b * MO + oy, mask=ym, other=0)
    a0 = tl.zeros((BLOCK_R, BLOCK_X), dtype=tl.float32)
    a1 = tl.zeros((BLOCK_R, BLOCK_X), dtype=tl.float32)
    a2 = tl.zeros((BLOCK_R, BLOCK_X), dtype=tl.float32)
    for k in range(TAPS):
        w = tl.load(wy_ptr + (b * MO + oy) * TAPS + k, mask=ym, other=0.0)[:, None]
        row = tl.minimum(y0 + k, ch - 1)
        p = tmp_ptr + tbase + (3 * row * OW)[:, None] + ox[None, :]
        a0 += w * tl.load(p, mask=m, other=0.0)
        a1 += w * tl.load(p + OW, mask=m, other=0.0)
        a2 += w * tl.load(p + 2 * OW, mask=m, other=0.0)
    o = out_ptr + b * 3 * OH * OW + (oy * OW)[:, None] + ox[None, :]
    tl.store(o, tl.minimum(tl.maximum(_rint(a0), 0.0), 255.0), mask=m)
    tl.store(o + OH * OW, tl.minimum(tl.maximum(_rint(a1), 0.0), 255.0), mask=m)
    tl.store(o + 2 * OH * OW, tl.minimum(tl.maximum(_rint(a2), 0.0), 255.0), mask=m)


def crop_resize(flat: Tensor, meta: Tensor, start_y: Tensor, w_y: Tensor, start_x: Tensor, w_x: Tensor, rows: int,
                max_rows: int, out: Tensor) -> None:
    """Antialiased separable resampling of one crop per image (``imagenet_gpu.resized_crops``'s Triton path):
    PIL's order, a horizontal pass over every crop row into float32 ``tmp``, then a vertical pass, rounded half to
    even and clamped to 0..255. Each output pixel sums its window's taps in float32 (the weights of
    ``imagenet_gpu.aa_resample_windows``); no TF32.

    Args:
        flat: uint8, the images one after another, each planar ``[3, H_b, W_b]``.
        meta: int64 ``[n, 8]`` per image: offset of its first pixel in ``flat``, ``W_b``, ``H_b W_b``, the crop's
            top and left, height ``h_b`` and width, and the offset of its rows in ``tmp`` (``3 OW`` floats per crop
            row: ``3 OW`` times the crop heights before it).
        start_y, start_x: int64 ``[n, MO]`` (rows contiguous): the first crop pixel of each output pixel's window
            along y (the first ``OH`` entries used) and along x (the first ``OW``; a flip is in them).
        w_y, w_x: float32 ``[n, MO, taps]``, contiguous: the windows' weights.
        rows: ``sum_b h_b``, the crop rows (``tmp`` holds ``3 OW rows`` floats); max_rows: ``max_b h_b``.
        out: float32 ``[n, 3, OH, OW]``, contiguous: the result.
    """
    n, _, oh, ow = out.shape
    if n == 0:
        return
    mo, taps = w_x.shape[1], w_x.shape[2]
    tmp = torch.empty(3 * ow * rows, device=out.device, dtype=torch.float32)
    cols = triton.cdiv(ow, _TILE_COLS)
    _resize_rows[(n, triton.cdiv(max_rows, _TILE_ROWS), cols)](
        flat, meta, start_x, w_x, tmp, ow, mo, taps, BLOCK_R=_TILE_ROWS, BLOCK_X=_TILE_COLS)
    _resize_cols[(n, triton.cdiv(oh, _TILE_ROWS), cols)](
        tmp, meta, start_y, w_y, out, oh, ow, mo, taps, BLOCK_R=_TILE_ROWS, BLOCK_X=_TILE_COLS)
