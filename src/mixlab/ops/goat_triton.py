"""Triton kernels of the attention family: GOAT's lanes and the packed-qkv split every scheme uses.

Same math as ``GoatLanes`` (see its docstring and the equations in :mod:`mixlab.ops.goat`):
one kernel forward and one kernel backward, instead of ~25 + ~30 small eager kernels per
layer, which dominate a short attention layer on a fast GPU.

Four entry points share the kernels:

* :class:`GoatLanesTriton` - lanes as new tensors ``q_lanes [Bq, H, Tq, L]`` and
  ``k_lanes [Bk, H, Tk, L]`` (query and key coordinates may differ, e.g. decoding).
* :class:`GoatQKV` - the attention layer's fast path: writes the lanes straight into the
  packed ``qkv`` projection output ``[B * T, 3 * H * d_h]`` (lanes are the last ``L`` dims
  of every q and k head) and returns the SDPA inputs as views of it: no concatenation, no
  extra activation memory. Its backward builds ``d qkv`` from ``dq, dk, dv`` in one pass
  with the lane entries zeroed (the lanes overwrite those projection outputs, so the
  projection gets no gradient through them - exact), summing the lane gradients on the way;
  that pass replaces the two copies autograd makes for a plain layer's ``view -> permute ->
  unbind`` (~260 us of a ~1.2 ms layer step at B8 T2048 d768 on an H200, BENCHMARKS.md).
* :class:`GoatLanesInto` - the ``torch.compile`` path: the same in-place write as :class:`GoatQKV`, through
  the ``torch.library.triton_op`` :func:`goat_lanes_into` (Inductor traces it, launches the kernel from the
  compiled graph with no Python per call, and writes into the projection's buffer: no copy); its backward
  zeroes the lane entries of ``d qkv`` with a ``torch.where`` that Inductor fuses into the pass assembling
  ``d qkv``, and :func:`goat_lanes_backward` turns the lane gradients into the parameters'.
* :class:`QKVSplit` - the same split and one-copy backward for schemes without lanes (NoPE,
  RoPE, APE): every attention layer on CUDA builds ``d qkv`` the same way
  (:func:`mixlab.ops.attention.split_qkv`).

Kernel arguments are few on purpose (a single layer is host-bound on a fast GPU, and every
launch argument costs host time): the parameter-free position features come as ONE cached
``[B|1, T, NF]`` float32 tensor (:func:`pack_features`), the prior parameters as ONE flat
float32 vector (:func:`pack_params`), and everything fixed by the layer's configuration
(head layout, offsets, lane scale) is a compile-time constant (:func:`kernel_meta`).

Grid: (head, token block of 32 or 64, batch chunk). With coordinates shared by the batch
(the usual case) a program evaluates the lane features and the key MLP once (the MLP's
hidden layer and its weight gradient as ``tl.dot`` in IEEE float32) and loops over its
chunk's batch entries only to store (forward) or to sum lane gradients (backward). In
:class:`GoatQKV`'s backward kernel the last program of each (head, token block) to finish
turns the chunk sums into that block's parameter gradients, and the last of those sums the
blocks' rows into the flat parameter gradient; both sums run in a fixed order whoever
arrives last (deterministic), with atomic counters in a cached workspace that the kernel
resets. :class:`GoatLanesTriton`'s backward uses two kernels and a ``sum`` instead. The
launch configuration (warps, token block, batch chunks) was chosen with
``scripts/bench_goat_lanes.py`` on an H200.

Used on CUDA for float32 lane math with fixed frequencies (no gradient into cos/sin);
everything else (CPU, float64 tests, learned frequencies) uses the torch ``GoatLanes``.
Tests run these kernels on CPU under ``TRITON_INTERPRET=1`` against ``GoatLanes``.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import triton
import triton.language as tl

from mixlab.ops.compile import kernel_op, traced_launch
from mixlab.ops.goat import KEY_LINEAR_BLOCK, param_layout

__all__ = ["GoatLanesTriton", "GoatQKV", "GoatLanesInto", "QKVSplit", "kernel_meta", "pack_features", "pack_params",
           "goat_lanes_into", "goat_lanes_backward", "meta_key"]

# Launch configuration; defaults from scripts/bench_goat_lanes.py on an H200 (BENCHMARKS.md).
_BLOCK_T = None  # tokens per program; None: 32 up to 256 tokens (ViT), else 64
_PROGRAMS = 2048  # shared features: batch chunks until the grid has about this many programs
_NUM_WARPS = 4
# (prior configuration, shapes, launch configuration) -> (grid, BB, constexprs, {call: compiled kernel}); kept
# here, not on the modules, so modules stay deep-copyable and picklable
_LAUNCH: dict[tuple, tuple] = {}


# ----------------------------------------------------------------------------- device helpers
@triton.jit
def _fourier(feat, rows, rmask, l, NF: tl.constexpr, R: tl.constexpr):
    """Per-lane ``(cos, sin) * presence`` of feature rows ``rows [BT]``: ``[BT, LP]``, lane
    ``l`` reading mode ``l // 2`` (zero outside the ``2R`` relative lanes)."""
    m = rmask[:, None] & (l < 2 * R)[None, :]
    base = feat + rows[:, None] * NF + (l // 2)[None, :]
    p = tl.load(base + 2 * R, mask=m, other=0.0)
    return tl.load(base, mask=m, other=0.0) * p, tl.load(base + R, mask=m, other=0.0) * p


@triton.jit
def _column(feat, rows, rmask, C: tl.constexpr, NF: tl.constexpr):
    """Feature column ``C`` of rows ``rows [BT]`` (0 for masked rows)."""
    return tl.load(feat + rows * NF + C, mask=rmask, other=0.0)


@triton.jit
def _key_mlp(feat, rows, rmask, prm, h, NF: tl.constexpr, C_PHI: tl.constexpr, O_W1: tl.constexpr,
             O_B1: tl.constexpr, F: tl.constexpr, FP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
    """``(phi [BT, FP], pre-activation [BT, DP])`` of g_h's hidden layer: ``phi @ W1_h + b1_h``."""
    f = tl.arange(0, FP)
    d = tl.arange(0, DP)
    phi = tl.load(feat + rows[:, None] * NF + C_PHI + f[None, :], mask=rmask[:, None] & (f < F)[None, :], other=0.0)
    w1 = tl.load(prm + O_W1 + (h * F + f[:, None]) * D + d[None, :], mask=(f < F)[:, None] & (d < D)[None, :],
                 other=0.0)
    b1 = tl.load(prm + O_B1 + h * D + d, mask=d < D, other=0.0)
    return phi, tl.dot(phi, w1, input_precision="ieee") + b1[None, :]


# ----------------------------------------------------------------------------- kernels
@triton.jit(do_not_specialize=["NQ", "NK", "Tq", "Tk", "BB"])
def _lanes_fwd(featq, featk, prm, qout, kout, NQ, NK, Tq, Tk, BB,
               ROW: tl.constexpr, HD: tl.constexpr, QOFF: tl.constexpr, KOFF: tl.constexpr,
               SCALE: tl.constexpr, CBLOCK: tl.constexpr, R: tl.constexpr, L: tl.constexpr, LP: tl.constexpr,
               F: tl.constexpr, FP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, NF: tl.constexpr,
               O_BETA: tl.constexpr, O_SLOPE: tl.constexpr, O_BOS: tl.constexpr, O_DEF: tl.constexpr,
               O_B1: tl.constexpr, O_W2: tl.constexpr, O_W1: tl.constexpr, PT: tl.constexpr,
               HAS_SLOPE: tl.constexpr, HAS_BOS: tl.constexpr, HAS_DEFAULT: tl.constexpr, HAS_MLP: tl.constexpr,
               Q_BATCHED: tl.constexpr, K_BATCHED: tl.constexpr, BLOCK_T: tl.constexpr, ONE_OUT: tl.constexpr):
    """Program (head h, token block, batch chunk of BB outputs) builds the block's ``[BT, L]``
    q and k lane tiles once (per-sample features come with BB = 1) and stores each token's
    lanes as one contiguous run for every output batch of its chunk. ``ONE_OUT``: the k lanes go
    into ``qout`` too (at ``KOFF``; ``kout`` is not touched), so a buffer that the kernel writes is
    passed once (``torch.compile`` clones each written argument of a traced kernel on its own)."""
    h = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    b0 = tl.program_id(2) * BB
    l = tl.arange(0, LP)
    rel = l < 2 * R
    even = (l % 2) == 0
    lm = l < L
    a = tl.load(prm + h * R + l // 2, mask=rel, other=0.0)[None, :]
    be = tl.load(prm + O_BETA + h * R + l // 2, mask=rel, other=0.0)[None, :]
    sl = 0.0
    if HAS_SLOPE:
        sl = tl.load(prm + O_SLOPE + h)
    # ---- query lanes: scale * [q_rel(i), lambda * c, 1]
    tq = t < Tq
    rq = ((b0 if Q_BATCHED else 0) * Tq + t).to(tl.int64)
    c, s = _fourier(featq, rq, tq, l, NF, R)
    q_rel = tl.where(even[None, :], a * c + be * s, a * s - be * c)
    q_tile = tl.where(rel[None, :], q_rel, tl.where((l == 2 * R)[None, :], sl * CBLOCK, 1.0)) * SCALE
    # ---- key lanes: [k_rel(j), j_hi, u_rest(j)]
    tk = t < Tk
    rk = ((b0 if K_BATCHED else 0) * Tk + t).to(tl.int64)
    ck, sk = _fourier(featk, rk, tk, l, NF, R)
    u = tl.zeros([BLOCK_T], dtype=tl.float32)
    if HAS_MLP:
        d = tl.arange(0, DP)
        _, hp = _key_mlp(featk, rk, tk, prm, h, NF, 3 * R, O_W1, O_B1, F, FP, D, DP)
        u += tl.sum(hp * tl.sigmoid(hp) * tl.load(prm + O_W2 + h * D + d, mask=d < D, other=0.0)[None, :], axis=1)
    khi = tl.zeros([BLOCK_T], dtype=tl.float32)
    if HAS_SLOPE:
        u += sl * _column(featk, rk, tk, 3 * R + F + 1, NF)
        khi = _column(featk, rk, tk, 3 * R + F, NF)
    if HAS_BOS:
        u += tl.load(prm + O_BOS + h) * _column(featk, rk, tk, 3 * R + F + 2, NF)
    if HAS_DEFAULT:
        u += tl.load(prm + O_DEF + h) * _column(featk, rk, tk, 3 * R + F + 3, NF)
    k_tile = tl.where(rel[None, :], tl.where(even[None, :], ck, sk),
                      tl.where((l == 2 * R)[None, :], khi[:, None], u[:, None]))
    if ONE_OUT:
        kout = qout
    for i in range(0, BB):
        ob = b0 + i
        pq = qout + (ob * Tq + t).to(tl.int64) * ROW + h * HD + QOFF
        tl.store(pq[:, None] + l[None, :], q_tile, mask=(tq & (ob < NQ))[:, None] & lm[None, :])
        pk = kout + (ob * Tk + t).to(tl.int64) * ROW + h * HD + KOFF
        tl.store(pk[:, None] + l[None, :], k_tile, mask=(tk & (ob < NK))[:, None] & lm[None, :])


@triton.jit
def _reduce_batch(dq, dk, h, t, b0, BB, NQ, NK, Tq, Tk, ROW: tl.constexpr, HD: tl.constexpr, QOFF: tl.constexpr,
                  KOFF: tl.constexpr, R: tl.constexpr, L: tl.constexpr, LP: tl.constexpr, BLOCK_T: tl.constexpr):
    """Sum over outputs ``b0 .. b0 + BB - 1`` of the q-lane gradient tile ``[BT, LP]`` and of the
    k lane ``u`` that carries parameters ``[BT]``."""
    l = tl.arange(0, LP)
    lm = l < L
    tq = t < Tq
    tk = t < Tk
    gq = tl.zeros([BLOCK_T, LP], dtype=tl.float32)
    dus = tl.zeros([BLOCK_T], dtype=tl.float32)
    for i in range(0, BB):
        ob = b0 + i
        mq = (tq & (ob < NQ))[:, None] & lm[None, :]
        pq = (dq + (ob * Tq + t).to(tl.int64) * ROW + h * HD + QOFF)[:, None] + l[None, :]
        gq += tl.load(pq, mask=mq, other=0.0).to(tl.float32)
        kb = dk + (ob * Tk + t).to(tl.int64) * ROW + h * HD + KOFF
        dus += tl.load(kb + 2 * R + 1, mask=tk & (ob < NK), other=0.0).to(tl.float32)  # only u's lane has parameters
    return gq, dus


@triton.jit
def _param_grads(gq, dus, featq, featk, prm, row, h, rq, rk, tq, tk,
                 SCALE: tl.constexpr, CBLOCK: tl.constexpr, R: tl.constexpr, LP: tl.constexpr,
                 F: tl.constexpr, FP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, NF: tl.constexpr,
                 O_BETA: tl.constexpr, O_SLOPE: tl.constexpr, O_BOS: tl.constexpr, O_DEF: tl.constexpr,
                 O_B1: tl.constexpr, O_W2: tl.constexpr, O_W1: tl.constexpr,
                 HAS_SLOPE: tl.constexpr, HAS_BOS: tl.constexpr, HAS_DEFAULT: tl.constexpr, HAS_MLP: tl.constexpr):
    """Head ``h``'s parameter gradients from a token block's summed lane gradients (``gq
    [BT, LP]`` q lanes, ``dus [BT]`` the k lane ``u``), stored into ``row`` (flat layout).
    The lane gradients are linear in the parameters' features, so features and key MLP are
    evaluated once per block (rows ``rq``/``rk`` of the feature tensors)."""
    l = tl.arange(0, LP)
    even = (l % 2) == 0
    # ---- query side: alpha, beta (lane pairs) and the slope's q-lane part
    c, s = _fourier(featq, rq, tq, l, NF, R)
    ga = tl.sum(gq * tl.where(even[None, :], c, s), axis=0) * SCALE  # [LP]: per lane
    gb = tl.sum(gq * tl.where(even[None, :], s, -c), axis=0) * SCALE
    r2 = tl.arange(0, LP // 2)
    tl.store(row + h * R + r2, tl.sum(tl.reshape(ga, [LP // 2, 2]), axis=1), mask=r2 < R)
    tl.store(row + O_BETA + h * R + r2, tl.sum(tl.reshape(gb, [LP // 2, 2]), axis=1), mask=r2 < R)
    # ---- key side: u_rest = g(phi) + lambda j_lo + b 1{j=0} + default
    if HAS_SLOPE:
        g_lin = tl.sum(tl.sum(tl.where((l == 2 * R)[None, :], gq, 0.0), axis=1), axis=0)
        ds = g_lin * (SCALE * CBLOCK) + tl.sum(dus * _column(featk, rk, tk, 3 * R + F + 1, NF), axis=0)
        tl.store(row + O_SLOPE + h, ds)
    if HAS_BOS:
        tl.store(row + O_BOS + h, tl.sum(dus * _column(featk, rk, tk, 3 * R + F + 2, NF), axis=0))
    if HAS_DEFAULT:
        tl.store(row + O_DEF + h, tl.sum(dus * _column(featk, rk, tk, 3 * R + F + 3, NF), axis=0))
    if HAS_MLP:
        d = tl.arange(0, DP)
        dm = d < D
        phi, hp = _key_mlp(featk, rk, tk, prm, h, NF, 3 * R, O_W1, O_B1, F, FP, D, DP)
        sig = tl.sigmoid(hp)
        dh = dus[:, None] * tl.load(prm + O_W2 + h * D + d, mask=dm, other=0.0)[None, :] * (sig * (1 + hp * (1 - sig)))
        tl.store(row + O_B1 + h * D + d, tl.sum(dh, axis=0), mask=dm)
        tl.store(row + O_W2 + h * D + d, tl.sum(dus[:, None] * hp * sig, axis=0), mask=dm)
        f = tl.arange(0, FP)
        dw1 = tl.dot(tl.trans(phi), dh, input_precision="ieee")  # [FP, DP]
        tl.store(row + O_W1 + (h * F + f[:, None]) * D + d[None, :], dw1, mask=(f < F)[:, None] & dm[None, :])


@triton.jit(do_not_specialize=["NQ", "NK", "Tq", "Tk", "BB", "TP"])
def _lanes_bwd_reduce(dq, dk, g, NQ, NK, Tq, Tk, BB, TP,
                      ROW: tl.constexpr, HD: tl.constexpr, QOFF: tl.constexpr, KOFF: tl.constexpr,
                      R: tl.constexpr, L: tl.constexpr, LP: tl.constexpr, BLOCK_T: tl.constexpr,
                      ZERO: tl.constexpr):
    """Backward of separate lane tensors, step 1: program (head, token block, batch chunk) sums its
    chunk's lane gradients into ``g [chunks, H, TP, LP]`` fp32 (q lanes, and ``u``'s gradient in
    lane ``2R + 1``, whose q-side constant has no parameter). With ``ZERO`` (the lane dims inside ``d qkv``,
    ``dq``, at ``QOFF`` and ``KOFF``; ``dk`` is not touched: a written buffer is passed once) it then zeroes the
    lane entries it read, q's and k's, in place."""
    if ZERO:
        dk = dq
    h = tl.program_id(0)
    nb = tl.program_id(2)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    gq, dus = _reduce_batch(dq, dk, h, t, nb * BB, BB, NQ, NK, Tq, Tk, ROW, HD, QOFF, KOFF, R, L, LP, BLOCK_T)
    l = tl.arange(0, LP)
    tile = tl.where((l == 2 * R + 1)[None, :], dus[:, None], gq)
    base = g + ((nb * tl.num_programs(0) + h) * TP + t).to(tl.int64) * LP
    tl.store(base[:, None] + l[None, :], tile)
    if ZERO:
        zero = tl.zeros([BLOCK_T, LP], dtype=dq.dtype.element_ty)
        for i in range(0, BB):
            ob = nb * BB + i
            mq = ((t < Tq) & (ob < NQ))[:, None] & (l < L)[None, :]
            tl.store((dq + (ob * Tq + t).to(tl.int64) * ROW + h * HD + QOFF)[:, None] + l[None, :], zero, mask=mq)
            mk = ((t < Tk) & (ob < NK))[:, None] & (l < L)[None, :]
            tl.store((dk + (ob * Tk + t).to(tl.int64) * ROW + h * HD + KOFF)[:, None] + l[None, :], zero, mask=mk)


@triton.jit
def _chunk_params(g, featq, featk, prm, row, h, tb, c, NC, H, TP, Tq, Tk,
                  SCALE: tl.constexpr, CBLOCK: tl.constexpr, R: tl.constexpr, LP: tl.constexpr,
                  F: tl.constexpr, FP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, NF: tl.constexpr,
                  O_BETA: tl.constexpr, O_SLOPE: tl.constexpr, O_BOS: tl.constexpr, O_DEF: tl.constexpr,
                  O_B1: tl.constexpr, O_W2: tl.constexpr, O_W1: tl.constexpr,
                  HAS_SLOPE: tl.constexpr, HAS_BOS: tl.constexpr, HAS_DEFAULT: tl.constexpr, HAS_MLP: tl.constexpr,
                  Q_BATCHED: tl.constexpr, K_BATCHED: tl.constexpr, BLOCK_T: tl.constexpr):
    """Head ``h``'s parameter gradients of token block ``tb`` from the chunk sums of the lane
    gradients ``g [NC, H, TP, LP]`` into ``row`` (flat layout). Shared features: sums ``g`` over
    the ``NC`` chunks first (fixed order); per-sample features: chunk ``c`` (= sample) only,
    with that sample's features. ``g`` is read through L2 (other programs wrote it)."""
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    l = tl.arange(0, LP)
    if Q_BATCHED or K_BATCHED:
        acc = tl.load((g + ((c * H + h) * TP + t).to(tl.int64) * LP)[:, None] + l[None, :], cache_modifier=".cg")
    else:
        acc = tl.zeros([BLOCK_T, LP], dtype=tl.float32)
        for cc in range(0, NC):
            acc += tl.load((g + ((cc * H + h) * TP + t).to(tl.int64) * LP)[:, None] + l[None, :], cache_modifier=".cg")
    dus = tl.sum(tl.where((l == 2 * R + 1)[None, :], acc, 0.0), axis=1)
    gq = tl.where((l < 2 * R + 1)[None, :], acc, 0.0)
    rq = ((c if Q_BATCHED else 0) * Tq + t).to(tl.int64)
    rk = ((c if K_BATCHED else 0) * Tk + t).to(tl.int64)
    _param_grads(gq, dus, featq, featk, prm, row, h, rq, rk, t < Tq, t < Tk, SCALE, CBLOCK, R, LP, F, FP, D, DP, NF,
                 O_BETA, O_SLOPE, O_BOS, O_DEF, O_B1, O_W2, O_W1, HAS_SLOPE, HAS_BOS, HAS_DEFAULT, HAS_MLP)


@triton.jit
def _sum_rows(part, dprm, ROWS, PT: tl.constexpr, PB: tl.constexpr, RB: tl.constexpr):
    """``dprm [PT] = part[:ROWS].sum(0)`` in a fixed order (one program; ``[RB, PB]`` tiles read
    through L2, rows summed blockwise then within the tile)."""
    r = tl.arange(0, RB)
    for p0 in range(0, PT, PB):
        p = p0 + tl.arange(0, PB)
        acc = tl.zeros([RB, PB], dtype=tl.float32)
        for r0 in range(0, ROWS, RB):
            rows = r0 + r
            acc += tl.load(part + rows.to(tl.int64)[:, None] * PT + p[None, :],
                           mask=(rows < ROWS)[:, None] & (p < PT)[None, :], other=0.0, cache_modifier=".cg")
        tl.store(dprm + p, tl.sum(acc, axis=0), mask=p < PT)


@triton.jit(do_not_specialize=["B", "T", "BB", "TP"])
def _qkv_grad(dq, dk, dv, out, g, feat, prm, part, cnt, dprm, B, T, BB, TP,
              sqb, sqh, sqt, skb, skh, skt, svb, svh, svt,
              HD: tl.constexpr, HDP: tl.constexpr, DC: tl.constexpr,
              SCALE: tl.constexpr, CBLOCK: tl.constexpr, R: tl.constexpr, L: tl.constexpr, LP: tl.constexpr,
              F: tl.constexpr, FP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, NF: tl.constexpr,
              O_BETA: tl.constexpr, O_SLOPE: tl.constexpr, O_BOS: tl.constexpr, O_DEF: tl.constexpr,
              O_B1: tl.constexpr, O_W2: tl.constexpr, O_W1: tl.constexpr, PT: tl.constexpr, PB: tl.constexpr,
              HAS_SLOPE: tl.constexpr, HAS_BOS: tl.constexpr, HAS_DEFAULT: tl.constexpr, HAS_MLP: tl.constexpr,
              Q_BATCHED: tl.constexpr, K_BATCHED: tl.constexpr, BLOCK_T: tl.constexpr, LANES: tl.constexpr):
    """The whole backward of :class:`GoatQKV` (and, with ``LANES`` off, of :class:`QKVSplit`:
    step 1 only, no lane entries), one launch. Program (head h, token block, batch
    chunk of BB sequences):

    1. copies its ``dq, dk, dv [B, H, T, d_h]`` tiles (any strides, unit last stride) into the
       packed gradient ``out [B * T, 3 * H * d_h]`` as full contiguous head rows, with the q/k
       lane entries set to zero (the lanes replaced those projection outputs). This one pass
       replaces the copies autograd makes to undo ``view -> permute -> unbind`` (a ``stack`` and
       a ``contiguous``);
    2. sums the lane gradients over its chunk into ``g [chunks, H, TP, LP]`` fp32 (q lanes;
       ``u``'s gradient in lane ``2R + 1``, whose q-side constant has no parameter);
    3. the last program of a (head, token block) to finish (counter ``cnt``; with per-sample
       features every program) turns the chunk sums into that block's parameter gradients, a
       row of ``part`` (:func:`_chunk_params`);
    4. the last of those sums ``part``'s rows into ``dprm [PT]``.

    Sums run in a fixed order whichever program arrives last, so the result is deterministic;
    counters are reset by the program that consumed them (``cnt`` starts at zero)."""
    h = tl.program_id(0)
    tb = tl.program_id(1)
    c = tl.program_id(2)
    H = tl.num_programs(0)
    NT = tl.num_programs(1)
    NC = tl.num_programs(2)
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, HDP)
    l = tl.arange(0, LP)
    tm = t < T
    content = (d < DC)[None, :]
    t64 = t.to(tl.int64)
    gq = tl.zeros([BLOCK_T, LP], dtype=tl.float32)
    dus = tl.zeros([BLOCK_T], dtype=tl.float32)
    for i in range(0, BB):
        b = (c * BB + i).to(tl.int64)
        ok = tm & (b < B)
        m = ok[:, None] & (d < HD)[None, :]
        o = (out + (b * T + t64) * (3 * H * HD) + h * HD)[:, None] + d[None, :]
        pq = dq + b * sqb + h * sqh + t64 * sqt
        pk = dk + b * skb + h * skh + t64 * skt
        pv = (dv + b * svb + h * svh + t64 * svt)[:, None] + d[None, :]
        tl.store(o, tl.where(content, tl.load(pq[:, None] + d[None, :], mask=m, other=0.0), 0.0), mask=m)
        tl.store(o + H * HD, tl.where(content, tl.load(pk[:, None] + d[None, :], mask=m, other=0.0), 0.0), mask=m)
        tl.store(o + 2 * H * HD, tl.load(pv, mask=m), mask=m)
        if LANES:
            gq += tl.load(pq[:, None] + DC + l[None, :], mask=ok[:, None] & (l < L)[None, :], other=0.0).to(tl.float32)
            dus += tl.load(pk + DC + 2 * R + 1, mask=ok, other=0.0).to(tl.float32)
    if LANES:
        tile = tl.where((l == 2 * R + 1)[None, :], dus[:, None], gq)
        tl.store((g + ((c * H + h) * TP + t).to(tl.int64) * LP)[:, None] + l[None, :], tile)
        per_sample: tl.constexpr = Q_BATCHED or K_BATCHED
        if per_sample:
            params_here = True
            row = tb * NC + c
            n_rows = NT * NC
        else:
            tl.debug_barrier()  # every thread's g stores are issued before the release below
            params_here = tl.atomic_add(cnt + h * NT + tb, 1, sem="acq_rel") == NC - 1
            row = tb
            n_rows = NT
        if params_here:
            if not per_sample:
                tl.store(cnt + h * NT + tb, 0)
            _chunk_params(g, feat, feat, prm, part + row.to(tl.int64) * PT, h, tb, c, NC, H, TP, T, T,
                          SCALE, CBLOCK, R, LP, F, FP, D, DP, NF, O_BETA, O_SLOPE, O_BOS, O_DEF, O_B1, O_W2, O_W1,
                          HAS_SLOPE, HAS_BOS, HAS_DEFAULT, HAS_MLP, Q_BATCHED, K_BATCHED, BLOCK_T)
            tl.debug_barrier()
            last = H * n_rows
            if tl.atomic_add(cnt + H * NT, 1, sem="acq_rel") == last - 1:
                tl.store(cnt + H * NT, 0)
                _sum_rows(part, dprm, n_rows, PT, PB, 16)


@triton.jit(do_not_specialize=["NC", "Tq", "Tk", "TP"])
def _lanes_bwd_params(g, featq, featk, prm, part, NC, Tq, Tk, TP,
                      SCALE: tl.constexpr, CBLOCK: tl.constexpr, R: tl.constexpr, L: tl.constexpr, LP: tl.constexpr,
                      F: tl.constexpr, FP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, NF: tl.constexpr,
                      O_BETA: tl.constexpr, O_SLOPE: tl.constexpr, O_BOS: tl.constexpr, O_DEF: tl.constexpr,
                      O_B1: tl.constexpr, O_W2: tl.constexpr, O_W1: tl.constexpr, PT: tl.constexpr,
                      HAS_SLOPE: tl.constexpr, HAS_BOS: tl.constexpr, HAS_DEFAULT: tl.constexpr,
                      HAS_MLP: tl.constexpr, Q_BATCHED: tl.constexpr, K_BATCHED: tl.constexpr, BLOCK_T: tl.constexpr):
    """Backward of separate lane tensors, step 2: program (head, token block[, sample for
    per-sample features]) writes its parameter gradients (:func:`_chunk_params`) into row
    ``block * programs(2) + chunk`` of ``part``."""
    h = tl.program_id(0)
    tb = tl.program_id(1)
    c = tl.program_id(2)
    _chunk_params(g, featq, featk, prm, part + (tb * tl.num_programs(2) + c).to(tl.int64) * PT, h, tb, c, NC,
                  tl.num_programs(0), TP, Tq, Tk, SCALE, CBLOCK, R, LP, F, FP, D, DP, NF, O_BETA, O_SLOPE, O_BOS,
                  O_DEF, O_B1, O_W2, O_W1, HAS_SLOPE, HAS_BOS, HAS_DEFAULT, HAS_MLP, Q_BATCHED, K_BATCHED, BLOCK_T)


# ----------------------------------------------------------------------------- host side
def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(max(n, 1)))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kernel_meta(n_heads: int, n_modes: int, n_feat: int, hidden: int, scale: float, *, slope: bool,
                bos: bool, default: bool) -> dict:
    """Compile-time constants of one prior configuration (computed once per layer).

    Args:
        n_heads, n_modes: ``H``, ``R``.
        n_feat, hidden: ``F`` (columns of ``phi_abs``) and ``D`` (g_h's hidden width); 0 and 0
            without the key MLP.
        scale: query-lane scale (``sqrt(d_c)``, see ``PositionScheme.lane_scale``).
        slope, bos, default: which key-only terms exist.

    Returns a dict of the kernels' ``tl.constexpr`` arguments; the flat parameter layout is
    :func:`mixlab.ops.goat.param_layout` (as :func:`pack_params` writes it).
    """
    H, R, F, D = n_heads, n_modes, n_feat, hidden
    layout = param_layout(H, R, F, D, slope=slope, bos=bos, default=default)
    off = {name: o for name, (o, _) in layout.items()}  # absent terms: offset unused (their HAS_* is False)
    size = sum(math.prod(shape) for _, shape in layout.values())
    return dict(SCALE=float(scale), CBLOCK=float(KEY_LINEAR_BLOCK), R=R, L=2 * R + 2, LP=_pow2(2 * R + 2),
                F=F, FP=_pow2(F, 16), D=D, DP=_pow2(D, 16), NF=3 * R + F + 4,
                O_BETA=off["beta"], O_SLOPE=off.get("slope", 0), O_BOS=off.get("bos", 0),
                O_DEF=off.get("default", 0), O_B1=off.get("mlp_b1", 0), O_W2=off.get("mlp_w2", 0),
                O_W1=off.get("mlp_w1", 0), PT=max(size, 1),
                HAS_SLOPE=bool(slope), HAS_BOS=bool(bos), HAS_DEFAULT=bool(default), HAS_MLP=D > 0, H=H)


def pack_features(cos: torch.Tensor, sin: torch.Tensor, present: torch.Tensor, phi: torch.Tensor | None,
                  j_hi: torch.Tensor, j_lo: torch.Tensor, is_bos: torch.Tensor, is_none: torch.Tensor) -> torch.Tensor:
    """One float32 ``[B|1, T, NF]`` feature tensor, columns ``cos [R] | sin [R] | present [R] |
    phi [F] | j_hi | j_lo | is_bos | is_none`` (``NF = 3R + F + 4``); inputs ``[B|1, T, R]``,
    ``[B|1, T, F]`` or ``[B|1, T]`` as :meth:`GoatPrior._features` builds them."""
    cols = [cos, sin, present] + ([phi] if phi is not None else [])
    cols += [c.unsqueeze(-1) for c in (j_hi, j_lo, is_bos, is_none)]
    return torch.cat([c.float() for c in cols], dim=-1).contiguous()


def pack_params(alpha: torch.Tensor, beta: torch.Tensor, slope: torch.Tensor | None, bos: torch.Tensor | None,
                default: torch.Tensor | None, w1: torch.Tensor | None, b1: torch.Tensor | None,
                w2: torch.Tensor | None) -> torch.Tensor:
    """The prior parameters as one flat float32 vector (layout in :func:`kernel_meta`);
    differentiable (one ``cat``), so gradients reach the original parameters."""
    parts = [alpha, beta, slope, bos, default, b1, w2, w1]
    flat = torch.cat([p.reshape(-1) for p in parts if p is not None])
    return flat if flat.numel() else flat.new_zeros(1)


def _launch_args(meta: dict, shape_q: tuple, shape_k: tuple, NQ: int, NK: int) -> tuple:
    """``(grid, BB, constexprs, compiled kernels)``, memoised per configuration and shape: programs per (head, token
    block, batch chunk). The last entry is a dict of compiled kernels by call site (see
    :func:`_launch`) that also holds :class:`GoatQKV`'s backward workspace per device.
    ``shape_q``/``shape_k``: the feature tensors' ``(batch, T, ...)``. Shared
    features (batch 1) are split into only as many batch chunks as give the GPU ~``_PROGRAMS``
    programs; per-sample features need one program per batch entry."""
    if "_key" not in meta:  # hashable identity of the prior configuration (plain values only)
        meta["_key"] = tuple(sorted(meta.items()))
    key = (meta["_key"], shape_q[0], shape_q[1], shape_k[0], shape_k[1], NQ, NK, _PROGRAMS, _BLOCK_T, _NUM_WARPS)
    try:
        hit = _LAUNCH.get(key)
    except TypeError:  # symbolic sizes (torch.compile with dynamic shapes): not memoised
        hit = key = None
    if hit is not None:
        return hit
    H = meta["H"]
    Tq, Tk = shape_q[1], shape_k[1]
    block = _BLOCK_T or (32 if max(Tq, Tk) <= 256 else 64)
    NT = _cdiv(max(Tq, Tk), block)
    qb, kb = shape_q[0] > 1, shape_k[0] > 1
    B = max(NQ, NK)
    if qb or kb:
        BB, n_chunks = 1, B
    else:
        n = min(B, max(1, _cdiv(_PROGRAMS, H * NT)))
        BB = _cdiv(B, n)
        n_chunks = _cdiv(B, BB)
    const = {k: v for k, v in meta.items() if k not in ("H", "_key")}
    plan = ((H, NT, n_chunks), BB, dict(const, Q_BATCHED=qb, K_BATCHED=kb, BLOCK_T=block, num_warps=_NUM_WARPS), {})
    if key is not None:
        if len(_LAUNCH) >= 256:
            _LAUNCH.clear()
        _LAUNCH[key] = plan
    return plan


def _launch(fn, grid: tuple, kernels: dict, key: tuple, args: tuple, kwargs: dict) -> None:
    """``fn[grid](*args, **kwargs)``, the first time through Triton's JIT, later through the
    compiled kernel's own launcher.

    Triton's per-launch argument binding and cache lookup cost ~17 us of host time per launch
    on the H200's host (28.6 us vs 11.4 us, BENCHMARKS.md), and a GOAT layer launches three
    kernels per training step. The kernels do not specialise their integer arguments
    (``do_not_specialize``), so a compiled kernel stays valid for every call with the same
    constexprs (fixed for one ``kernels`` dict: one memoised shape), call site ``key``, device,
    tensor dtypes and 16-byte alignment. Under ``TRITON_INTERPRET`` every call goes through
    the JIT (no compiled kernel is returned). ``grid`` must have 3 entries (the compiled
    kernel's launcher does not pad it).
    """
    spec = (fn, key, args[0].device) + tuple((a.dtype, a.data_ptr() % 16 == 0) for a in args
                                             if isinstance(a, torch.Tensor))
    hit = kernels.get(spec)
    if hit is not None:
        compiled, tail = hit
        compiled[grid](*args, *tail)
        return
    compiled = fn[grid](*args, **kwargs)
    if compiled is not None and hasattr(compiled, "__getitem__"):
        kernels[spec] = (compiled, tuple(kwargs[n] for n in fn.arg_names[len(args):]))


class GoatLanesTriton(torch.autograd.Function):
    """Lanes as new tensors (Triton kernels): ``(q_lanes [Bq, H, Tq, L], k_lanes [Bk, H, Tk, L])``
    in ``out_dtype``, equal to :class:`mixlab.ops.goat.GoatLanes` (strided views of
    ``[B, T, H, L]`` buffers).

    Args: ``feat_q [Bq|1, Tq, NF]``, ``feat_k [Bk|1, Tk, NF]`` from :func:`pack_features`;
    ``params`` from :func:`pack_params`; ``meta`` from :func:`kernel_meta`; ``batch_q``,
    ``batch_k`` output batch sizes (``Bq``, ``Bk``); ``out_dtype``.
    """

    @staticmethod
    def forward(ctx, feat_q, feat_k, params, meta, batch_q, batch_k, out_dtype):
        ql, kl, plan = _lanes_forward(feat_q, feat_k, params, meta, batch_q, batch_k, out_dtype)
        ctx.save_for_backward(feat_q, feat_k, params)
        ctx.args = (plan, batch_q, batch_k)
        return ql.transpose(1, 2), kl.transpose(1, 2)

    @staticmethod
    def backward(ctx, dq_l, dk_l):
        feat_q, feat_k, params = ctx.saved_tensors
        d_params = _lanes_param_grad(dq_l.transpose(1, 2), dk_l.transpose(1, 2), feat_q, feat_k, params, *ctx.args)
        return None, None, d_params, None, None, None, None


def _lanes_forward(feat_q, feat_k, params, meta: dict, batch_q: int, batch_k: int, dtype: torch.dtype,
                   launch: Callable = _launch) -> tuple:
    """``(q_lanes [Bq, Tq, H, L], k_lanes [Bk, Tk, H, L], plan)``: the lanes as new tensors in ``dtype`` (one
    :func:`_lanes_fwd` launch; the kernel casts on store) and the launch plan (:func:`_launch_args`) for
    :func:`_lanes_param_grad`. ``launch``: :func:`_launch`, or :func:`_traced_launch` inside a traced op."""
    H, L = meta["H"], meta["L"]
    plan = grid, BB, const, kernels = _launch_args(meta, feat_q.shape, feat_k.shape, batch_q, batch_k)
    Tq, Tk = feat_q.shape[1], feat_k.shape[1]
    ql = torch.empty(batch_q, Tq, H, L, device=feat_q.device, dtype=dtype)
    kl = torch.empty(batch_k, Tk, H, L, device=feat_q.device, dtype=dtype)
    launch(_lanes_fwd, grid, kernels, ("sep",), (feat_q, feat_k, params, ql, kl, batch_q, batch_k, Tq, Tk, BB),
           dict(ROW=H * L, HD=L, QOFF=0, KOFF=0, ONE_OUT=False, **const))
    return ql, kl, plan


def _lanes_param_grad(dq_l, dk_l, feat_q, feat_k, params, plan: tuple, NQ: int, NK: int,
                      launch: Callable = _launch, head_dim: int | None = None) -> torch.Tensor:
    """Gradient ``[PT]`` float32 of the flat parameter vector from the lane gradients ``dq_l [NQ, Tq, H, L]`` and
    ``dk_l [NK, Tk, H, L]`` (any strides) of :func:`_lanes_forward`: :func:`_lanes_bwd_reduce` sums each batch
    chunk in float32, then :func:`_params_backward`. With ``head_dim``, ``dq_l`` is instead the whole
    contiguous ``d qkv [B * T, 3 * H * head_dim]`` (lanes in the last ``L`` dims of its q and k heads,
    ``dk_l`` ignored), whose lane entries the first kernel zeroes in place after reading them."""
    grid, BB, const, kernels = plan
    H, NT, NC = grid
    L, TP = const["L"], NT * const["BLOCK_T"]
    if head_dim is None:
        dq_l, dk_l = dq_l.contiguous(), dk_l.contiguous()
        layout = dict(ROW=H * L, HD=L, QOFF=0, KOFF=0, ZERO=False)
    else:
        dk_l = params  # not read: the kernel takes both lanes from dq_l (ZERO)
        layout = dict(ROW=3 * H * head_dim, HD=head_dim, QOFF=head_dim - L, KOFF=H * head_dim + head_dim - L,
                      ZERO=True)
    g = torch.empty(NC, H, TP, const["LP"], device=dq_l.device, dtype=torch.float32)
    launch(_lanes_bwd_reduce, grid, kernels, tuple(layout.values()),
           (dq_l, dk_l, g, NQ, NK, feat_q.shape[1], feat_k.shape[1], BB, TP),
           dict(**layout, R=const["R"], L=L, LP=const["LP"], BLOCK_T=const["BLOCK_T"], num_warps=const["num_warps"]))
    return _params_backward(g, grid, const, kernels, feat_q, feat_k, params, launch=launch)


def _params_backward(g, grid, const, kernels, feat_q, feat_k, params, launch: Callable = _launch) -> torch.Tensor:
    """Gradient of the flat parameter vector from the chunk sums of the lane gradients ``g
    [NC, H, TP, LP]`` (:func:`_lanes_bwd_params`, then one deterministic ``sum`` over its
    per-program partial rows); ``launch``: :func:`_launch`, or :func:`_traced_launch` inside a traced op."""
    H, NT, NC = grid
    per_sample = const["Q_BATCHED"] or const["K_BATCHED"]
    pgrid = (H, NT, NC if per_sample else 1)
    part = torch.empty(NT * pgrid[2], const["PT"], device=g.device, dtype=torch.float32)
    launch(_lanes_bwd_params, pgrid, kernels, (), (g, feat_q, feat_k, params, part, NC, feat_q.shape[1],
                                                   feat_k.shape[1], g.shape[2]), const)
    return part.sum(0)  # [PT] == params.shape


def _write_lanes(qkv, feat, params, meta, batch, head_dim, launch: Callable = _launch) -> tuple:
    """Write the lanes into the q/k heads' last ``L`` dims of ``qkv [B * T, 3 * H * d_h]`` in place (one
    :func:`_lanes_fwd` launch); returns the launch arguments ``(grid, BB, constexprs, kernels)``.
    ``launch``: :func:`_launch`, or :func:`_traced_launch` inside a traced op."""
    H, L, T = meta["H"], meta["L"], feat.shape[1]
    grid, BB, const, kernels = _launch_args(meta, feat.shape, feat.shape, batch, batch)
    d_c = head_dim - L
    layout = dict(ROW=3 * H * head_dim, HD=head_dim, QOFF=d_c, KOFF=H * head_dim + d_c)
    launch(_lanes_fwd, grid, kernels, tuple(layout.values()),
           (feat, feat, params, qkv, params, batch, batch, T, T, BB), dict(**layout, ONE_OUT=True, **const))
    return grid, BB, const, kernels


class GoatQKV(torch.autograd.Function):
    """Packed projection output -> SDPA inputs, with the GOAT lanes written in place.

    ``qkv [B * T, 3 * H * d_h]`` (per token ``[q | k | v]``, each ``[H, d_h]``) -> ``q, k, v
    [B, H, T, d_h]``, strided views of ``qkv`` whose last ``L = 2R + 2`` dims of every q and k
    head now hold ``q_lanes`` / ``k_lanes`` exactly as :class:`GoatLanes` returns them (``d_c =
    d_h - L`` content dims stay). ``feat [1|B, T, NF]`` from :func:`pack_features` (shared or
    per-sample coordinates), ``params`` from :func:`pack_params`, ``meta`` from
    :func:`kernel_meta`, ``batch = B``. Forward: one kernel (:func:`_lanes_fwd`); no copy, no
    extra activation memory.

    ``qkv`` is consumed: it must be the projection's own output, used by nothing else (its
    lane entries are overwritten without autograd's version bump, which is exact because a
    linear layer does not save its output).

    Backward: one pass writes ``d qkv`` from ``dq, dk, dv`` as contiguous rows with the lane
    entries zeroed (the projection gets no gradient through the outputs the lanes replaced)
    and sums the lane gradients over each batch chunk (:func:`_qkv_grad`; this replaces the
    ``stack`` + ``contiguous`` copies autograd makes for ``view -> permute -> unbind``); a
    second kernel turns those sums into the flat parameter gradient (:func:`_lanes_bwd_params`).

    Raises:
        ValueError: ``qkv`` not 2-D and contiguous, rows not ``batch * T``, width not
            ``3 * H * d_h``, or a leaf tensor that requires grad.
    """

    @staticmethod
    def forward(ctx, qkv, feat, params, meta, batch, head_dim):
        H, T = meta["H"], feat.shape[1]
        if qkv.dim() != 2 or not qkv.is_contiguous() or qkv.shape[0] != batch * T or qkv.shape[1] != 3 * H * head_dim:
            raise ValueError(f"GoatQKV: qkv must be a contiguous [B*T, 3*H*d_h] = [{batch}*{T}, "
                             f"{3 * H * head_dim}] matrix; got shape {tuple(qkv.shape)}, strides {qkv.stride()}")
        if qkv.is_leaf and qkv.requires_grad:
            raise ValueError("GoatQKV: qkv must be a projection output, not a leaf tensor that requires grad "
                             "(its lane entries are overwritten in place)")
        ctx.save_for_backward(feat, params)
        ctx.args = (*_write_lanes(qkv, feat, params, meta, batch, head_dim), batch, head_dim)
        return qkv.view(batch, T, 3, H, head_dim).permute(2, 0, 3, 1, 4).unbind(0)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        feat, params = ctx.saved_tensors
        d_qkv, d_params = _qkv_backward(dq, dk, dv, *ctx.args, feat, params)
        return d_qkv, None, d_params, None, None, None


def _qkv_backward(dq, dk, dv, grid, BB, const, kernels, batch, head_dim, feat=None, params=None):
    """``(d qkv [B * T, 3 * H * d_h], d params [PT] or None)`` from ``dq, dk, dv [B, H, T, d_h]``
    with one :func:`_qkv_grad` launch; with lanes (``feat`` and ``params`` given, :class:`GoatQKV`)
    also the flat parameter gradient, without (:class:`QKVSplit`) only the copy."""
    H, NT, NC = grid
    lanes = feat is not None
    T = dq.shape[2]
    dq, dk, dv = (x if x.stride(-1) == 1 else x.contiguous() for x in (dq, dk, dv))
    out = torch.empty(batch * T, 3 * H * head_dim, device=dq.device, dtype=dq.dtype)
    d_params = None
    if lanes:
        d_params = torch.empty(const["PT"], device=dq.device, dtype=torch.float32)
        ws = kernels.get(("workspace", dq.device))
        if ws is None:  # per configuration, shape and device; reused by every layer and step (stream order)
            per_sample = const["Q_BATCHED"] or const["K_BATCHED"]
            TP = NT * const["BLOCK_T"]
            ws = kernels[("workspace", dq.device)] = (
                torch.empty(NC, H, TP, const["LP"], device=dq.device, dtype=torch.float32),  # chunk sums of lane grads
                torch.empty(NT * (NC if per_sample else 1), const["PT"], device=dq.device, dtype=torch.float32),
                torch.zeros(H * NT + 1, device=dq.device, dtype=torch.int32), TP)  # counters (reset by the kernel)
        g, part, cnt, TP = ws
        tensors = (g, feat, params, part, cnt, d_params)
    else:
        tensors, TP = (out,) * 6, 0  # placeholders: the lane-free kernel does not touch them
    strides = dq.stride()[:3] + dk.stride()[:3] + dv.stride()[:3]
    _launch(_qkv_grad, grid, kernels, strides, (dq, dk, dv, out, *tensors, batch, T, BB, TP, *strides),
            dict(HD=head_dim, HDP=_pow2(head_dim), DC=head_dim - (const["L"] if lanes else 0),
                 PB=min(256, _pow2(const["PT"])), LANES=lanes, **const))
    return out, d_params


# ---------------------------------------------------------------------- torch.compile path: kernel ops
_META_BY_KEY: dict[str, dict] = {}


def meta_key(meta: dict) -> str:
    """A :func:`kernel_meta` dict as a string (ops take plain values, not dicts; a string, not an index into a
    registry, because ``torch.compile`` traces the op before any side effect of the traced code on a registry
    would have happened)."""
    return repr(sorted((k, v) for k, v in meta.items() if not k.startswith("_")))


def _meta(key: str) -> dict:
    m = _META_BY_KEY.get(key)
    if m is None:
        import ast

        m = _META_BY_KEY[key] = dict(ast.literal_eval(key))
    return m


def _traced_launch(fn, grid: tuple, kernels: dict, key: tuple, args: tuple, kwargs: dict) -> None:
    """:func:`_launch`'s signature for the bodies of the kernel ops: :func:`mixlab.ops.compile.traced_launch`
    (no cache keyed by data pointers: the op is traced with fake tensors)."""
    traced_launch(fn, grid, args, kwargs)


def _goat_lanes_into_fake(qkv, feat, params, meta, batch, head_dim):
    return None


@kernel_op("mixlab::goat_lanes_into", _goat_lanes_into_fake, mutates=("qkv",))
def goat_lanes_into(qkv: torch.Tensor, feat: torch.Tensor, params: torch.Tensor, meta: str, batch: int,
                    head_dim: int) -> None:
    """Write GOAT's lanes (paper Eqs. 23-27) into the last ``L = 2R + 2`` dims of every q and k head of the
    packed projection ``qkv [B * T, 3 * H * d_h]`` in place (``B = batch``), from ``feat [B|1, T, NF]``
    (:func:`pack_features`), ``params`` (:func:`pack_params`) and ``meta`` (:func:`meta_key`): one
    :func:`_lanes_fwd` launch, what :class:`GoatQKV` does eagerly. A ``torch.library.triton_op`` for
    ``torch.compile``; differentiable through :class:`GoatLanesInto`."""
    _write_lanes(qkv, feat, params, _meta(meta), batch, head_dim, launch=_traced_launch)


def _goat_lanes_backward_fake(grad, feat, params, meta, batch, head_dim):
    return params.new_empty(params.shape, dtype=torch.float32)


@kernel_op("mixlab::goat_lanes_backward", _goat_lanes_backward_fake, mutates=("grad",))
def goat_lanes_backward(grad: torch.Tensor, feat: torch.Tensor, params: torch.Tensor, meta: str, batch: int,
                        head_dim: int) -> torch.Tensor:
    """Backward of :func:`goat_lanes_into`: the gradient ``[PT]`` float32 of the flat parameter vector from the
    lane entries of ``grad`` (``d qkv``, contiguous ``[B * T, 3 * H * d_h]`` or ``[B, T, 3, H, d_h]``), which are
    then set to zero in place
    (the lanes replaced those projection outputs, so the projection gets no gradient there): two kernels,
    :func:`_lanes_bwd_reduce` (reads and zeroes only the lane entries) and :func:`_lanes_bwd_params`."""
    plan = _launch_args(_meta(meta), feat.shape, feat.shape, batch, batch)
    return _lanes_param_grad(grad, grad, feat, feat, params, plan, batch, batch, launch=_traced_launch,
                             head_dim=head_dim)


class GoatLanesInto(torch.autograd.Function):
    """:class:`GoatQKV` for ``torch.compile``: ``qkv [B * T, 3 * H * d_h]`` (the projection's own output) with
    the lanes written into it in place by the kernel op :func:`goat_lanes_into` (marked dirty, so autograd
    knows), returned for the caller's ``view -> permute -> unbind``. Inductor writes into the projection's
    buffer: no copy of ``qkv``, as eagerly. Backward: :func:`goat_lanes_backward` reads the lane entries of
    ``d qkv`` (assembled by Inductor from ``dq, dk, dv``) into the parameter gradient and zeroes them in place.
    Arguments: ``qkv``, ``feat``, ``params``, ``meta`` (:func:`meta_key`), ``batch``, ``head_dim``. Measured on
    an H200 (BENCHMARKS.md, seventeenth session): the ``torch.where`` placement it replaces wrote into a copy
    of ``qkv``; kernels given one written buffer twice must not be traced (each argument would be cloned on
    its own, so ``_lanes_fwd`` takes ``ONE_OUT`` and ``_lanes_bwd_reduce`` ``ZERO``)."""

    @staticmethod
    def forward(ctx, qkv, feat, params, meta, batch, head_dim):
        goat_lanes_into(qkv, feat, params, meta, batch, head_dim)
        ctx.mark_dirty(qkv)
        ctx.save_for_backward(feat, params)
        ctx.args = (meta, batch, head_dim)
        return qkv

    @staticmethod
    def backward(ctx, grad):
        feat, params = ctx.saved_tensors
        meta, batch, head_dim = ctx.args
        # [B, T, 3, H, d_h]: the shape of the buffer Inductor assembles from dq, dk, dv, so the op writes into
        # that buffer (a [B * T, 3 H d_h] view of it would be lowered as a second buffer and copied back)
        g = grad.contiguous().view(batch, feat.shape[1], 3, -1, head_dim)
        d_params = goat_lanes_backward(g, feat, params, meta, batch, head_dim)
        return g.view(grad.shape), None, d_params, None, None, None


_PLAIN_META: dict[int, dict] = {}


class QKVSplit(torch.autograd.Function):
    """Packed projection output -> SDPA inputs for schemes without lanes (NoPE, RoPE, ...).

    ``qkv [B * T, 3 * H * d_h]`` -> ``q, k, v [B, H, T, d_h]``, the same strided views as
    ``qkv.view(B, T, 3, H, d_h).permute(2, 0, 3, 1, 4).unbind(0)``; the backward builds ``d qkv``
    with ONE copy kernel (:func:`_qkv_grad` without lanes) instead of autograd's ``stack`` +
    ``contiguous``, so every attention layer pays what :class:`GoatQKV` pays for this step and
    position schemes compare on equal terms. Arguments: ``qkv`` (2-D, contiguous), ``batch``,
    ``n_heads``, ``head_dim``.
    """

    @staticmethod
    def forward(ctx, qkv, batch, n_heads, head_dim):
        T = qkv.shape[0] // batch
        meta = _PLAIN_META.get(n_heads)
        if meta is None:
            meta = _PLAIN_META[n_heads] = kernel_meta(n_heads, 0, 0, 0, 1.0, slope=False, bos=False, default=False)
        grid, BB, const, kernels = _launch_args(meta, (1, T), (1, T), batch, batch)
        ctx.args = (grid, BB, const, kernels, batch, head_dim)
        return qkv.view(batch, T, 3, n_heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        return _qkv_backward(dq, dk, dv, *ctx.args)[0], None, None, None
