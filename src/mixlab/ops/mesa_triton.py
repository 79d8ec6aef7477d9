"""Triton kernel of Mesa's chunkwise conjugate gradient with adaptive stopping.

Solves ``(H_t + Lambda) x_t = b_t`` for every token of a chunk (MesaNet, arXiv 2506.05233,
Appendix C Algorithm 1 and Appendix D), one program per (batch x head x chunk, block of
``bc`` tokens of the chunk): the tokens' systems are independent, so a chunk is split over
several programs. The token matrices are never formed; ``H_t p`` is the chunkwise product of
:func:`mixlab.ops.mesa._matvec_kk`::

    H_t p_t = dq_t (H_chunk p_t) + sum_{i <= t} D[t, i] (k_i . p_t) k_i

so a CG step is three ``tl.dot`` products on ``[bc, K]`` tiles. Each token stops on its own
when ``||r_j|| <= eps ||r_0||`` (``eps=None``: a fixed count; a token whose residual is
exactly 0 stops too); a program stops when all its tokens have (``while`` loop, so converged
blocks cost nothing more), and writes the per-token iteration counts. Products run at
float32 accuracy: ``fp16x3`` (three float16 tensor-core products of hi/lo halves, the
default), ``tf32x3`` or ``ieee`` (float32 FMA); plain TF32 would floor the residual near 1e-3
and adaptive stopping at 1e-4 would never trigger. An inference forward takes ``fp16``: one
float16 product per step on ``p / ||r||`` (the recursive residual still falls to ``eps``; the
output stays within ~3e-4 of the float64 solve). :func:`launch_config` picks the block size, warps
and precision. :func:`mesa_chunk_cg_triton` reads q, k, v in their ``[B, T, H, d]`` layout and
builds the decays in the program; :func:`chunk_states_triton` likewise for the chunk-start states.

Used by :func:`mixlab.ops.mesa.mesa_chunk` with ``cg_impl="triton"`` for the forward solve and
the adjoint solve of the backward (imported only then: this module imports Triton). No
autotuning, so it also runs on CPU under ``TRITON_INTERPRET=1`` (set before Triton is imported),
which is how the tests check it against the torch CG.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["mesa_cg_triton", "mesa_chunk_cg_triton", "solve_dense_triton", "chunk_states_triton", "launch_config",
           "TritonCGUnfit", "MAX_CHUNK", "MAX_HEAD_DIM"]

class TritonCGUnfit(RuntimeError):
    """The kernel does not fit the GPU at this shape and launch configuration (shared memory, registers)."""


MAX_CHUNK = 128
MAX_HEAD_DIM = 128

@triton.jit
def _split16(a):
    """``a`` float32 -> (hi, lo) float16 with ``a ~= hi + lo`` to ~22 bits (caller keeps ``a`` in range)."""
    hi = a.to(tl.float16)
    return hi, (a - hi.to(tl.float32)).to(tl.float16)

@triton.jit
def _mm(a, b, b_hi, b_lo, PREC: tl.constexpr):
    """``a @ b`` at float32 accuracy. ``fp16x3``: ``a`` scaled per row into float16's range and
    split, three float16 tensor-core products with the pre-split ``b_hi + b_lo``; ``fp16x2``: the
    same for a ``b`` that float16 holds exactly (``b_lo = 0``: bf16/fp16 inputs), two products; else
    ``tl.dot(a, b)`` with ``input_precision=PREC`` (``tf32x3`` or ``ieee``)."""
    if PREC == "fp16x3" or PREC == "fp16" or PREC == "fp16x2":
        s = tl.maximum(tl.max(tl.abs(a), axis=1), 1e-30)
        a_hi, a_lo = _split16(a / s[:, None])
        # the read-out (fp16 and fp16x3 alike): three products
        return _mm_split(a_hi, a_lo, b_hi, b_lo, "fp16x2" if PREC == "fp16x2" else "fp16x3") * s[:, None]
    else:
        return tl.dot(a, b, input_precision=PREC)

@triton.jit
def _mm_split(a_hi, a_lo, b_hi, b_lo, PREC: tl.constexpr):
    """``(a_hi + a_lo) @ (b_hi + b_lo)`` on float16 halves: three products (``fp16x3``, ``a_lo @ b_lo``
    dropped), two (``fp16x2``, ``b_lo = 0``) or one (``fp16``: ``a_hi @ b_hi``)."""
    acc = tl.dot(a_hi, b_hi, out_dtype=tl.float32)
    if PREC == "fp16x3":
        acc = tl.dot(a_hi, b_lo, acc, out_dtype=tl.float32)
    if PREC != "fp16":
        acc = tl.dot(a_lo, b_hi, acc, out_dtype=tl.float32)
    return acc


@triton.jit
def _load_chunk(h_ptrs, k_ptrs, kt_ptrs, mkk, mfk, mkf, PREC: tl.constexpr):
    """The chunk's ``H``, ``k``, ``k^T`` (and their float16 halves for ``fp16x3``)."""
    h = tl.load(h_ptrs, mask=mkk, other=0.0)
    kc = tl.load(k_ptrs, mask=mfk, other=0.0).to(tl.float32)
    kt = tl.load(kt_ptrs, mask=mkf, other=0.0).to(tl.float32)
    if PREC == "fp16x3" or PREC == "fp16":
        h_hi, h_lo = _split16(h)
        kc_hi, kc_lo = _split16(kc)
        kt_hi, kt_lo = _split16(kt)
    else:
        h_hi, h_lo, kc_hi, kc_lo, kt_hi, kt_lo = h, h, kc, kc, kt, kt
    return h, h_hi, h_lo, kc, kc_hi, kc_lo, kt, kt_hi, kt_lo


@triton.jit
def _halves(a, PREC: tl.constexpr):
    """``(hi, lo)`` float16 halves of a ``b`` operand of :func:`_mm` for ``fp16x3``, else ``(a, a)``."""
    if PREC == "fp16x3" or PREC == "fp16":
        hi, lo = _split16(a)
    else:
        hi, lo = a, a
    return hi, lo


@triton.jit
def _cg(h_ptr, k_ptr, d_ptr, dq_ptr, sg_ptr, lam_ptr, b_ptr, x_ptr, it_ptr, g_ptr, v_ptr, o_ptr, C, K, V, T, NH, NC,
        skb, skt, skh, sbb, sbt, sbh, svb, svt, svh, sob, sot, soh, slm, slh, max_iter, eps2, tiny,
        BC: tl.constexpr, BCF: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
        HOLD: tl.constexpr, READOUT: tl.constexpr, DECAY: tl.constexpr, HAS_SIGN: tl.constexpr):
    # program (m, j): tokens j*BC .. j*BC+BC-1 of chunk m = (batch * NH + head) * NC + chunk; their systems are
    # independent, but the intra-chunk term reads every key of the chunk (D is 0 above the diagonal). k, the
    # right-hand sides b, v and o are [batch, T, head, dim] by their strides (last dim contiguous): token
    # chunk * C + i of the sequence, masked past T. DECAY: D and dq from the log forget gate (d_ptr), beta
    # (dq_ptr) and, HAS_SIGN, the gate signs (sg_ptr), all [batch, T, head] contiguous (within-chunk
    # cumulative sums in the program); else D [M, C, C] and dq [M, C] given. Lambda: lam_ptr + m * slm + head * slh.
    m = tl.program_id(0).to(tl.int64)
    n = m % NC
    hh = (m // NC) % NH
    bb = m // (NC * NH)
    t0 = tl.program_id(1) * BC
    ot = t0 + tl.arange(0, BC)  # this program's tokens
    of = tl.arange(0, BCF)  # every token of the chunk
    ok = tl.arange(0, BK)
    mt = (ot < C) & (n * C + ot < T)
    mf = (of < C) & (n * C + of < T)
    mk = ok < K
    h_ptrs = h_ptr + m * K * K + ok[:, None] * K + ok[None, :]  # H is symmetric: H^T = H
    k_base = k_ptr + bb * skb + hh * skh + n * C * skt
    k_ptrs = k_base + of[:, None] * skt + ok[None, :]
    kt_ptrs = k_base + of[None, :] * skt + ok[:, None]
    mkk = mk[:, None] & mk[None, :]
    mfk = mf[:, None] & mk[None, :]
    mkf = mk[:, None] & mf[None, :]
    mtk = mt[:, None] & mk[None, :]
    if DECAY:  # D[t, i] = beta_i exp(gc_t - gc_i) s_t s_i (i <= t), dq_t = exp(gc_t) s_t
        g_offs = bb * T * NH + hh + (n * C + of) * NH
        gf = tl.load(d_ptr + g_offs, mask=mf, other=0.0).to(tl.float32)  # padding: g = 0, beta = 0
        btf = tl.load(dq_ptr + g_offs, mask=mf, other=0.0).to(tl.float32)
        # within-chunk cumulative log gate, for the chunk's tokens (gcf) and this program's (gct), by one rule
        gcf = tl.sum(tl.where(of[None, :] <= of[:, None], gf[None, :], 0.0), axis=1)
        upto = of[None, :] <= ot[:, None]
        gct = tl.sum(tl.where(upto, gf[None, :], 0.0), axis=1)
        causal = upto & mt[:, None] & mf[None, :]
        dd = tl.exp(tl.where(causal, gct[:, None] - gcf[None, :], float("-inf"))) * btf[None, :]
        dq = tl.where(mt, tl.exp(gct), 0.0)
        if HAS_SIGN:  # the sign products as the parity of the negative gates so far
            negf = (tl.load(sg_ptr + g_offs, mask=mf, other=1.0) < 0).to(tl.int32)
            sgf = 1.0 - 2.0 * (tl.sum(tl.where(of[None, :] <= of[:, None], negf[None, :], 0), axis=1) % 2)
            sgt = 1.0 - 2.0 * (tl.sum(tl.where(upto, negf[None, :], 0), axis=1) % 2)
            dd = dd * sgf[None, :] * sgt[:, None]
            dq = dq * sgt
    else:
        dq = tl.load(dq_ptr + m * C + ot, mask=mt, other=0.0)
        dd = tl.load(d_ptr + m * C * C + ot[:, None] * C + of[None, :], mask=mt[:, None] & mf[None, :], other=0.0)
    lam = tl.load(lam_ptr + m * slm + hh * slh + ok, mask=mk, other=0.0)
    r = tl.load(b_ptr + bb * sbb + hh * sbh + (n * C + ot[:, None]) * sbt + ok[None, :], mask=mtk,
                other=0.0).to(tl.float32)
    # float32 scalars: torch.compile hands Python floats to a user kernel as float64 (H200, torch 2.11), which
    # would promote alpha, beta and so r to float64 inside the loop (Triton refuses a loop-carried type change)
    eps2 = tl.cast(eps2, tl.float32)
    tiny = tl.cast(tiny, tl.float32)
    if HOLD:
        h, h_hi, h_lo, kc, kc_hi, kc_lo, kt, kt_hi, kt_lo = _load_chunk(h_ptrs, k_ptrs, kt_ptrs, mkk, mfk, mkf,
                                                                         PREC)
    # w_t = max_i |D[t, i]| ||k_i||: bounds the scores (p_t / ||r_t||) . k_i D[t, i] by ||p_t|| / ||r_t||
    if HOLD:
        kt0 = kt
    else:
        kt0 = tl.load(kt_ptrs, mask=mkf, other=0.0).to(tl.float32)
    knorm = tl.sqrt(tl.sum(kt0 * kt0, axis=0))
    w = tl.maximum(tl.max(tl.abs(dd) * knorm[None, :], axis=1), tiny)
    dd_w = dd / w[:, None]
    x = tl.zeros([BC, BK], dtype=tl.float32)
    p = r
    delta = tl.sum(r * r, axis=1)
    thresh = delta * eps2
    iters = tl.zeros([BC], dtype=tl.int32)
    n_active = tl.sum((delta > thresh).to(tl.int32), axis=0)
    step_no = n_active * 0
    while (step_no < max_iter) & (n_active > 0):
        if not HOLD:  # re-read from L2 each step: fewer registers, more traffic
            h, h_hi, h_lo, kc, kc_hi, kc_lo, kt, kt_hi, kt_lo = _load_chunk(h_ptrs, k_ptrs, kt_ptrs, mkk, mfk,
                                                                             mkf, PREC)
        active = delta > thresh
        if PREC == "fp16x3" or PREC == "fp16":
            # p scaled by 1/||r|| (||p|| / ||r|| stays O(sqrt(step)) in CG) and split once for both
            # products; the intra-chunk scores scaled by the per-token bound w (no max per step)
            pn = tl.sqrt(tl.maximum(delta, tiny))
            p_hi, p_lo = _split16(p / pn[:, None])
            sc = _mm_split(p_hi, p_lo, kt_hi, kt_lo, PREC) * dd_w
            s_hi, s_lo = _split16(sc)
            ap = dq[:, None] * _mm_split(p_hi, p_lo, h_hi, h_lo, PREC)
            ap += w[:, None] * _mm_split(s_hi, s_lo, kc_hi, kc_lo, PREC)
            ap = ap * pn[:, None] + lam[None, :] * p
        else:
            ap = dq[:, None] * _mm(p, h, h_hi, h_lo, PREC)
            ap += _mm(_mm(p, kt, kt_hi, kt_lo, PREC) * dd, kc, kc_hi, kc_lo, PREC)
            ap += lam[None, :] * p
        pap = tl.sum(p * ap, axis=1)
        alpha = tl.where(active, delta / tl.maximum(pap, tiny), 0.0)
        x += alpha[:, None] * p
        r -= alpha[:, None] * ap
        delta_new = tl.sum(r * r, axis=1)
        beta = tl.where(active, delta_new / tl.maximum(delta, tiny), 0.0)
        p = tl.where(active[:, None], r + beta[:, None] * p, p)
        delta = tl.where(active, delta_new, delta)
        iters += active.to(tl.int32)
        n_active = tl.sum((delta > thresh).to(tl.int32), axis=0)
        step_no += 1
    tl.store(x_ptr + m * C * K + ot[:, None] * K + ok[None, :], x, mask=(ot < C)[:, None] & mk[None, :])
    tl.store(it_ptr + m * C + ot, iters, mask=ot < C)
    if READOUT:  # o_t = dq_t (x_t^T G) + sum_i D[t, i] (x_t . k_i) v_i  (the read-out G_t^T x_t)
        ov = tl.arange(0, BV)
        mv = ov < V
        if not HOLD:
            h, h_hi, h_lo, kc, kc_hi, kc_lo, kt, kt_hi, kt_lo = _load_chunk(h_ptrs, k_ptrs, kt_ptrs, mkk, mfk, mkf,
                                                                             PREC)
        gm = tl.load(g_ptr + m * K * V + ok[:, None] * V + ov[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
        vc = tl.load(v_ptr + bb * svb + hh * svh + (n * C + of[:, None]) * svt + ov[None, :],
                     mask=mf[:, None] & mv[None, :], other=0.0).to(tl.float32)
        g_hi, g_lo = _halves(gm, PREC)
        v_hi, v_lo = _halves(vc, PREC)
        if PREC == "fp16x3" or PREC == "fp16":  # x split once for both products, at float32 accuracy
            xs = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-30)
            x_hi, x_lo = _split16(x / xs[:, None])
            o = dq[:, None] * _mm_split(x_hi, x_lo, g_hi, g_lo, "fp16x3")
            s_hi, s_lo = _split16(_mm_split(x_hi, x_lo, kt_hi, kt_lo, "fp16x3") * dd_w)
            o += w[:, None] * _mm_split(s_hi, s_lo, v_hi, v_lo, "fp16x3")
            o = o * xs[:, None]
        else:
            o = dq[:, None] * _mm(x, gm, g_hi, g_lo, PREC)
            o += _mm(_mm(x, kt, kt_hi, kt_lo, PREC) * dd, vc, v_hi, v_lo, PREC)
        o = o.to(o_ptr.dtype.element_ty, fp_downcast_rounding="rtne")  # v's dtype, rounded to nearest
        tl.store(o_ptr + bb * sob + hh * soh + (n * C + ot[:, None]) * sot + ov[None, :], o,
                 mask=mt[:, None] & mv[None, :])



@triton.jit
def _states(k_ptr, w_ptr, x_ptr, last_ptr, s0_ptr, out_ptr, fin_ptr, dot_ptr, part_ptr, g_ptr, beta_ptr, sign_ptr,
            N, C, K, X, T, NH, skb, skt, skh, sxb, sxt, sxh, HAS_S0: tl.constexpr, GATES: tl.constexpr,
            HAS_SIGN: tl.constexpr, BCF: tl.constexpr, BK: tl.constexpr, BX: tl.constexpr, PREC: tl.constexpr,
            REVERSE: tl.constexpr, DOT: tl.constexpr):
    # program (bh, i, j): tile [i*BK : i*BK+BK, j*BX : j*BX+BX] of the [K, X] state of one (batch, head),
    # carried through the N chunks: out[n] = S before chunk n; S <- last_n S + kw_n^T x_n with kw = w * k
    # (w [BH, N, C] and last [BH, N] given, or GATES: w_i = beta_i exp(gc_L - gc_i) s_L s_i and
    # last = exp(gc_L) s_L from the log gates g, beta and signs, [batch, T, head] contiguous). k and x are
    # [batch, T, head, dim] by their strides (last dim contiguous). REVERSE: chunks N-1 .. 0 (the adjoint
    # scan). DOT: part[bh, n, tile] = <out[n], dot[n]> over the tile. PREC: fp16x3, or fp16x2 for a
    # bf16/fp16 x (float16 holds it exactly).
    bh = tl.program_id(0).to(tl.int64)
    bb = bh // NH
    hh = bh % NH
    ok = tl.program_id(1) * BK + tl.arange(0, BK)
    ox = tl.program_id(2) * BX + tl.arange(0, BX)
    oc = tl.arange(0, BCF)
    mk, mx = ok < K, ox < X
    mkx = mk[:, None] & mx[None, :]
    tile = ok[:, None] * X + ox[None, :]
    if HAS_S0:
        s = tl.load(s0_ptr + bh * K * X + tile, mask=mkx, other=0.0)
    else:
        s = tl.zeros([BK, BX], dtype=tl.float32)
    n_tiles = tl.num_programs(1) * tl.num_programs(2)
    tile_no = tl.program_id(1) * tl.num_programs(2) + tl.program_id(2)
    for j in range(N):
        if REVERSE:
            n = N - 1 - j
        else:
            n = j
        base = bh * N + n
        tl.store(out_ptr + base * K * X + tile, s, mask=mkx)
        if DOT:
            d = tl.load(dot_ptr + base * K * X + tile, mask=mkx, other=0.0)
            tl.store(part_ptr + base * n_tiles + tile_no, tl.sum(tl.sum(s * d, axis=1), axis=0))
        mc = (oc < C) & (n * C + oc < T)
        kwt = tl.load(k_ptr + bb * skb + hh * skh + (n * C + oc[None, :]) * skt + ok[:, None],
                      mask=mk[:, None] & mc[None, :], other=0.0).to(tl.float32)  # [BK, C]
        if GATES:
            g_offs = bb * T * NH + hh + (n * C + oc) * NH
            gch = tl.load(g_ptr + g_offs, mask=mc, other=0.0).to(tl.float32)
            g_last = tl.sum(gch, axis=0)
            wv = tl.exp(g_last - tl.cumsum(gch, axis=0)) * tl.load(beta_ptr + g_offs, mask=mc, other=0.0)
            a = tl.exp(g_last)
            if HAS_SIGN:  # s_L s_i = (-1)^(negative gates after i), s_L = (-1)^(negative gates in the chunk)
                neg = (tl.load(sign_ptr + g_offs, mask=mc, other=1.0) < 0).to(tl.int32)
                n_neg = tl.sum(neg, axis=0)
                wv = wv * (1.0 - 2.0 * ((n_neg - tl.cumsum(neg, axis=0)) % 2))
                a = a * (1.0 - 2.0 * (n_neg % 2))
            kwt = kwt * wv[None, :]
        else:
            kwt = kwt * tl.load(w_ptr + base * C + oc, mask=mc, other=0.0)[None, :]
            a = tl.load(last_ptr + base)
        xc = tl.load(x_ptr + bb * sxb + hh * sxh + (n * C + oc[:, None]) * sxt + ox[None, :],
                     mask=mc[:, None] & mx[None, :], other=0.0).to(tl.float32)  # [C, BX]
        x_hi, x_lo = _split16(xc)
        s = a * s + _mm(kwt, xc, x_hi, x_lo, PREC)
    tl.store(fin_ptr + bh * K * X + tile, s, mask=mkx)


def solve_dense_triton(H: Tensor, lamb: Tensor, rhs: Tensor, max_iter: int, eps: float | None) -> Tensor:
    """CG on ``(H_m + Diag(lamb_m)) x_m = rhs_m`` for ``M`` dense systems (a decoding step's ``B * H``
    heads): :func:`mesa_cg_triton` on chunks of one token whose statistic is ``H`` (no intra-chunk keys,
    decay 1), so the loop and the per-system stopping run on the device, without a host sync.

    Args:
        H: ``[M, K, K]`` symmetric; lamb: ``[M, K]`` > 0; rhs: ``[M, K]``; all float32 on one device;
            max_iter, eps: as :func:`mesa_cg_triton`.

    Returns:
        ``x [M, K]`` float32.

    Raises:
        ValueError, TritonCGUnfit: as :func:`mesa_cg_triton`.
    """
    m, dk = rhs.shape
    x, _ = mesa_cg_triton(H, rhs.new_zeros(m, 1, dk), rhs.new_zeros(m, 1, 1), rhs.new_ones(m, 1), lamb,
                          rhs.view(m, 1, dk), max_iter, eps)
    return x.view(m, dk)


def chunk_states_triton(kw: Tensor, x: Tensor, last: Tensor | None, s0: Tensor | None, w: Tensor | None = None,
                        chunk_size: int | None = None, reverse: bool = False, dot: Tensor | None = None,
                        gates: tuple[Tensor, Tensor, Tensor | None] | None = None) -> tuple[Tensor, ...]:
    """Chunk-start states of Mesa's statistics (MesaNet Appendix D; fla's ``chunk_fwd_h`` in form):
    ``S_0 = s0``, ``S_{n+1} = last_n S_n + (w_n * k_n)^T x_n`` (float32, products at float32 accuracy
    via ``fp16x3``, or ``fp16x2`` for a bf16/fp16 ``x``). Not differentiable. ``reverse=True`` runs the
    chunks backwards (the adjoint scan of the backward: ``T_n = last_n T_{n+1} + (w_n * k_n)^T x_n``
    from ``T_N = s0``, returning ``T_{n+1}`` for chunk ``n`` and ``T_0``).

    Args:
        kw: the keys ``[B, T, H, K]`` (any strides, last dim contiguous, any float dtype); x: ``[B, T, H, X]``
        likewise (keys for ``H``, values for ``G``); w: ``[BH, N, C]`` the keys' weights and last:
        ``[BH, N]`` each chunk's total decay, or gates: ``(g, beta, sign)`` ``[B, T, H]`` (log forget gate,
        input gate, +-1 gate signs or None), from which the program builds the weights
        ``beta_i exp(gc_L - gc_i) s_L s_i`` and ``last`` (pass ``last=None``, ``w=None``); s0: ``[BH, K, X]``
        or None (zeros); chunk_size: C (tokens past T count as zeros); dot: ``[BH, N, K, X]`` float32 or
        None. On one CUDA device (or CPU under ``TRITON_INTERPRET=1``).

    Returns:
        ``states [BH, N, K, X]`` (the state before each chunk, in scan order), ``final [BH, K, X]``,
        and with ``dot``: ``[BH, N]`` the inner products ``<states[n], dot[n]>``.

    Raises:
        ValueError: neither ``w`` and ``last`` nor ``gates`` given.
    """
    b_, t_, nh_, dk = kw.shape
    bh, n, c = b_ * nh_, -(-t_ // chunk_size), chunk_size
    if gates is not None:
        g, beta, sign = (None if z is None else z.contiguous() for z in gates)
        w = last = g  # unused (GATES=True)
    elif w is None or last is None:
        raise ValueError("chunk_states_triton: pass the key weights w and the chunk decays last, or gates")
    else:
        w = w.contiguous()
        g = beta = sign = last = last.contiguous()  # unused (GATES=False)
    nh, t, dx = kw.shape[2], kw.shape[1], x.shape[-1]
    out = torch.empty(bh, n, dk, dx, dtype=torch.float32, device=kw.device)
    fin = torch.empty(bh, dk, dx, dtype=torch.float32, device=kw.device)
    cfg = {"bk": 64, "bx": 64, "warps": 4, "stages": 3}
    for item in filter(None, (z.strip() for z in os.environ.get("MIXLAB_MESA_STATES", "").split(","))):
        key, _, val = item.partition("=")
        if key not in cfg or not val.isdigit():
            raise ValueError(f"MIXLAB_MESA_STATES: bad entry {item!r}; keys: bk, bx, warps, stages")
        cfg[key] = int(val)
    bk, bx = min(cfg["bk"], _next_pow2(dk)), min(cfg["bx"], _next_pow2(dx))
    grid = (bh, -(-dk // bk), -(-dx // bx))
    s0c = s0.contiguous() if s0 is not None else fin
    part = torch.empty(bh, n, grid[1] * grid[2], dtype=torch.float32, device=kw.device) if dot is not None else fin
    _states[grid](kw, w, x, last, s0c, out, fin, fin if dot is None else dot.contiguous(), part, g, beta,
                  g if sign is None else sign, n, c, dk, dx, t, nh, kw.stride(0), kw.stride(1), kw.stride(2),
                  x.stride(0), x.stride(1), x.stride(2), HAS_S0=s0 is not None, GATES=gates is not None,
                  HAS_SIGN=gates is not None and sign is not None, BCF=_next_pow2(c), BK=bk, BX=bx,
                  PREC="fp16x2" if x.dtype in (torch.bfloat16, torch.float16) else "fp16x3", REVERSE=reverse,
                  DOT=dot is not None, num_warps=cfg["warps"], num_stages=cfg["stages"])
    return (out, fin) if dot is None else (out, fin, part.sum(-1))


def _next_pow2(n: int) -> int:
    return 1 << max(4, (n - 1).bit_length())


def launch_config(c: int, dk: int, prec: str | None = None) -> dict:
    """Tokens per program, warps, whether the chunk's matrices stay in registers, product precision.

    Defaults by the chunk and head size; ``MIXLAB_MESA_CG`` overrides them for benchmark sweeps
    (``"bc=32,warps=8,hold=1,prec=fp16x3"``). ``prec`` (the argument, unless the variable sets it):
    ``"fp16x3"`` (default: three float16 tensor-core products of hi/lo halves, ~22-bit accuracy,
    half the shared memory of ``tf32x3``), ``"fp16"`` (one float16 product per CG step, the right-hand
    operand scaled by ``1/||r||``: the solve's float32 output within ~3e-4 of the float64 solve on the
    checks, against fla's bf16 kernel ~7e-4; the read-out keeps three products), ``"tf32x3"`` (three
    TF32 products) or ``"ieee"`` (float32 FMA products); TF32 alone would floor the residual near
    1e-3, so it is not offered.

    Raises:
        ValueError: a malformed ``MIXLAB_MESA_CG`` (names the bad entry).
    """
    bcf = _next_pow2(c)
    prec = prec or "fp16x3"
    # one float16 product per step holds half the tiles: a whole chunk of 64 per program is fastest at K = 128
    bc = 64 if prec == "fp16" and dk > 64 else 32
    cfg = {"bc": min(bcf, bc), "warps": 4 if dk <= 64 else 8, "hold": 1, "prec": prec}
    spec = os.environ.get("MIXLAB_MESA_CG", "").strip()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, _, val = item.partition("=")
        if key not in cfg or not val:
            raise ValueError(f"MIXLAB_MESA_CG: bad entry {item!r}; keys: bc, warps, hold, prec")
        cfg[key] = val if key == "prec" else int(val)
    if (cfg["prec"] not in ("ieee", "tf32x3", "fp16x3", "fp16") or cfg["bc"] not in (16, 32, 64, 128)
            or cfg["warps"] not in (1, 2, 4, 8, 16)):
        raise ValueError(f"MIXLAB_MESA_CG: need prec ieee|tf32x3|fp16x3|fp16, bc 16|32|64|128, warps 1..16; got {cfg}")
    cfg["bc"] = min(cfg["bc"], bcf)
    return cfg


def mesa_cg_triton(H: Tensor, k: Tensor, D: Tensor, dq: Tensor, lamb: Tensor, rhs: Tensor, max_iter: int,
                   eps: float | None, prec: str | None = None) -> tuple[Tensor, Tensor]:
    """CG on ``(H_t + Lambda) x_t = rhs_t`` for every token of ``M`` chunks (float32; MesaNet
    Appendix C Algorithm 1 with per-token stopping, chunkwise products of Appendix D).

    Args:
        H: ``[M, K, K]`` chunk-start statistic (symmetric); k: ``[M, C, K]`` keys of the chunk;
        D: ``[M, C, C]`` decay-and-beta weights (lower triangular); dq: ``[M, C]`` decay from
        the chunk start; lamb: ``[M, K]`` (or ``[M, 1, K]``) regulariser diagonal, > 0;
        rhs: ``[M, C, K]`` right-hand sides; max_iter: iteration cap (fixed count when
        ``eps`` is None); eps: relative residual tolerance; prec: product precision
        (:func:`launch_config`; None: ``fp16x3``).

    Returns:
        ``x [M, C, K]`` float32 and iterations ``[M, C]`` int32 (updates applied per token).

    Raises:
        ValueError: ``C > 128`` or ``K > 128`` (one program holds the chunk's keys), or tensors
            that are not float32 on one device.
        TritonCGUnfit: the kernel needs more shared memory or registers than the GPU has at this
            shape and launch configuration (:func:`launch_config`).
    """
    m, c, dk = rhs.shape
    if c > MAX_CHUNK or dk > MAX_HEAD_DIM:
        raise ValueError(f"mesa_cg_triton: chunk size {c} and head dim {dk} must be <= {MAX_CHUNK} and "
                         f"{MAX_HEAD_DIM}; use cg_impl='torch'")
    args = [z.reshape(m, *s).contiguous() for z, s in ((H, (dk, dk)), (k, (c, dk)), (D, (c, c)), (dq, (c,)),
                                                          (lamb, (dk,)), (rhs, (c, dk)))]
    if any(z.dtype != torch.float32 or z.device != rhs.device for z in args):
        raise ValueError("mesa_cg_triton: H, k, D, dq, lamb and rhs must be float32 on one device; got "
                         f"{[(z.dtype, str(z.device)) for z in args]}")
    h_m, k_m, d_m, dq_m, lam_m, rhs_m = args
    x, iters, _ = _launch_cg(h_m, k_m.view(m, c, 1, dk), (d_m, dq_m, None), lam_m, rhs_m.view(m, c, 1, dk), None,
                             None, c, max_iter, eps, prec)
    return x, iters


def mesa_chunk_cg_triton(H: Tensor, k: Tensor, g: Tensor, beta: Tensor, sign: Tensor | None, lamb: Tensor,
                         q: Tensor, G: Tensor, v: Tensor, chunk_size: int, max_iter: int, eps: float | None,
                         prec: str | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Mesa's chunkwise forward solve and read-out straight from the ``[B, T, H, d]`` tensors (no
    chunked copies): the decays are built in the program from the gates (within-chunk cumulative
    sums) (MesaNet arXiv 2506.05233, Appendix C Algorithm 1 per token, Appendix D chunkwise products):
    ``(H_t + Lambda) x_t = q_t``, then ``o_t = G_t^T x_t``.

    Args:
        H: ``[M, K, K]`` and G: ``[M, K, V]`` chunk-start states (:func:`chunk_states_triton`),
        ``M = B * H * N`` chunks of ``chunk_size`` tokens, float32; k, q: ``[B, T, H, K]``, v:
        ``[B, T, H, V]`` (last dim contiguous, any other strides, any float dtype); g: ``[B, T, H]``
        log forget gate; beta: ``[B, T, H]`` input gate; sign: ``[B, T, H]`` +-1 gate signs or None;
        lamb: ``[H, K]`` float32 regulariser > 0; max_iter, eps, prec: as :func:`mesa_cg_triton`.

    Returns:
        ``x [M, C, K]`` float32, iterations ``[M, C]`` int32, ``o [B, T, H, V]`` in v's dtype.

    Raises:
        TritonCGUnfit: as :func:`mesa_cg_triton`.
    """
    # the program stores o in v's dtype (rounded to nearest); Triton's interpreter truncates float32 to bf16
    # on a store, so under it o comes back float32 and torch rounds it
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    o = torch.empty(v.shape, dtype=torch.float32 if interpret else v.dtype, device=v.device)
    gates = tuple(None if z is None else z.contiguous() for z in (g, beta, sign))
    x, iters, o = _launch_cg(H, k, gates, lamb.contiguous(), q, G, v, chunk_size, max_iter, eps, prec, o,
                             in_place=True)
    return x, iters, o.to(v.dtype)


def _launch_cg(H, k, decay, lamb, rhs, G, v, c, max_iter, eps, prec, o=None, in_place=False):
    """Launches :func:`_cg` on ``[B, T, H, d]`` views (``[M, C, 1, d]`` for pre-chunked tensors). ``decay``:
    ``(D, dq, None)`` and lamb ``[M, K]`` given, or, ``in_place``, the gates ``(g, beta, sign)`` ``[B, T, H]``
    and lamb ``[H, K]`` as the layer hands them over."""
    b, t, nh, dk = rhs.shape
    n = -(-t // c)
    m = b * nh * n
    x = torch.empty(m, c, dk, dtype=torch.float32, device=rhs.device)
    iters = torch.empty(m, c, dtype=torch.int32, device=rhs.device)
    readout = G is not None
    if readout:
        dv = v.shape[-1]
        if o is None:
            o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    else:
        dv, G, v, o = 1, x, rhs, rhs  # unused (READOUT=False)
    if m == 0:
        return x, iters, o
    d_p, dq_p, sg_p = decay
    cfg = launch_config(c, dk, prec)
    eps2 = 0.0 if eps is None else float(eps) ** 2
    grid = (m, -(-c // cfg["bc"]))
    slm, slh = (0, dk) if in_place else (dk, 0)
    try:
        _cg[grid](H, k, d_p, dq_p, dq_p if sg_p is None else sg_p, lamb, rhs, x, iters, G, v, o, c, dk, dv, t, nh, n,
                  k.stride(0), k.stride(1), k.stride(2), rhs.stride(0), rhs.stride(1), rhs.stride(2), v.stride(0),
                  v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2), slm, slh, int(max_iter), eps2,
                  torch.finfo(torch.float32).tiny, BC=cfg["bc"], BCF=_next_pow2(c), BK=_next_pow2(dk),
                  BV=_next_pow2(dv), PREC=cfg["prec"], HOLD=bool(cfg["hold"]), READOUT=readout,
                  DECAY=in_place, HAS_SIGN=in_place and sg_p is not None, num_warps=cfg["warps"], num_stages=1)
    except triton.runtime.errors.OutOfResources as e:
        raise TritonCGUnfit(f"mesa_cg_triton: the kernel does not fit this GPU at chunk {c}, head dim {dk}, "
                            f"config {cfg} ({e}); set MIXLAB_MESA_CG (e.g. 'hold=0,bc=16') or use impl='chunk'") from e
    return x, iters, o
