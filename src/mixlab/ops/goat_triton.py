"""Triton fast path for GOAT's lane construction (:class:`mixlab.ops.goat.GoatLanes`).

Same inputs, outputs and math as ``GoatLanes`` (see its docstring and the equations in
:mod:`mixlab.ops.goat`), but the forward is ONE kernel (grid: feature batch x heads x
token blocks) and the backward ONE kernel (grid: heads x token blocks; each program writes
partial parameter gradients, recomputing the key MLP) plus one deterministic sum over
blocks. Eagerly the lanes
cost ~25 small kernels forward and ~30 backward per layer, which dominates a short
attention layer on a fast GPU.

Used on CUDA for float32 lane math with fixed frequencies (no gradient into cos/sin);
everything else (CPU, float64 tests, learned frequencies) uses the torch ``GoatLanes``.
Tests run these kernels on CPU under ``TRITON_INTERPRET=1`` against ``GoatLanes``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mixlab.ops.goat import KEY_LINEAR_BLOCK

__all__ = ["GoatLanesTriton"]


@triton.jit
def _lanes_fwd(cosq, sinq, presq, cosk, sink, presk, phi, jhi, jlo, isbos, isnone,
               alpha, beta, slope, bos, default, w1, b1, w2, ql, kl,
               Bq, Bk, Tq, Tk, H, scale, cblock,
               R: tl.constexpr, RP: tl.constexpr, F: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
               L: tl.constexpr, BLOCK_T: tl.constexpr, HAS_SLOPE: tl.constexpr, HAS_BOS: tl.constexpr,
               HAS_DEFAULT: tl.constexpr, HAS_MLP: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    r = tl.arange(0, RP)
    rm = r < R
    a = tl.load(alpha + h * R + r, mask=rm, other=0.0)
    be = tl.load(beta + h * R + r, mask=rm, other=0.0)
    sl = 0.0
    if HAS_SLOPE:
        sl = tl.load(slope + h)
    # ---- query lanes: scale * [q_rel(i), lambda * c, 1]
    tmq = (t < Tq) & (b < Bq)
    mq = tmq[:, None] & rm[None, :]
    off = (b * Tq + t)[:, None] * R + r[None, :]
    p = tl.load(presq + off, mask=mq, other=0.0)
    c = tl.load(cosq + off, mask=mq, other=0.0) * p
    s = tl.load(sinq + off, mask=mq, other=0.0) * p
    base = ((b * H + h) * Tq + t) * L
    tl.store(ql + base[:, None] + 2 * r[None, :], (a[None, :] * c + be[None, :] * s) * scale, mask=mq)
    tl.store(ql + base[:, None] + 2 * r[None, :] + 1, (a[None, :] * s - be[None, :] * c) * scale, mask=mq)
    tl.store(ql + base + 2 * R, tl.zeros([BLOCK_T], dtype=tl.float32) + sl * cblock * scale, mask=tmq)
    tl.store(ql + base + 2 * R + 1, tl.zeros([BLOCK_T], dtype=tl.float32) + scale, mask=tmq)
    # ---- key lanes: [k_rel(j), j_hi, u_rest(j)]
    tmk = (t < Tk) & (b < Bk)
    mk = tmk[:, None] & rm[None, :]
    offk = (b * Tk + t)[:, None] * R + r[None, :]
    pk = tl.load(presk + offk, mask=mk, other=0.0)
    basek = ((b * H + h) * Tk + t) * L
    tl.store(kl + basek[:, None] + 2 * r[None, :], tl.load(cosk + offk, mask=mk, other=0.0) * pk, mask=mk)
    tl.store(kl + basek[:, None] + 2 * r[None, :] + 1, tl.load(sink + offk, mask=mk, other=0.0) * pk, mask=mk)
    tk = b * Tk + t
    u = tl.zeros([BLOCK_T], dtype=tl.float32)
    if HAS_MLP:
        d = tl.arange(0, DP)
        dm = d < D
        hp = tl.zeros([BLOCK_T, DP], dtype=tl.float32) + tl.load(b1 + h * D + d, mask=dm, other=0.0)[None, :]
        for f in tl.static_range(F):
            pf = tl.load(phi + tk * F + f, mask=tmk, other=0.0)
            hp += pf[:, None] * tl.load(w1 + (h * F + f) * D + d, mask=dm, other=0.0)[None, :]
        act = hp * tl.sigmoid(hp)
        u += tl.sum(act * tl.load(w2 + h * D + d, mask=dm, other=0.0)[None, :], axis=1)
    khi = tl.zeros([BLOCK_T], dtype=tl.float32)
    if HAS_SLOPE:
        u += sl * tl.load(jlo + tk, mask=tmk, other=0.0)
        khi = tl.load(jhi + tk, mask=tmk, other=0.0)
    if HAS_BOS:
        u += tl.load(bos + h) * tl.load(isbos + tk, mask=tmk, other=0.0)
    if HAS_DEFAULT:
        u += tl.load(default + h) * tl.load(isnone + tk, mask=tmk, other=0.0)
    tl.store(kl + basek + 2 * R, khi, mask=tmk)
    tl.store(kl + basek + 2 * R + 1, u, mask=tmk)


@triton.jit
def _lanes_bwd(dql, dkl, cosq, sinq, presq, phi, jlo, isbos, isnone, b1, w1, w2, part,
               Bq, Bk, Tq, Tk, H, NT, P, scale, cblock,
               R: tl.constexpr, RP: tl.constexpr, F: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
               L: tl.constexpr, BLOCK_T: tl.constexpr, HAS_SLOPE: tl.constexpr, HAS_BOS: tl.constexpr,
               HAS_DEFAULT: tl.constexpr, HAS_MLP: tl.constexpr):
    """Program (h, token block) writes its partial parameter gradients to ``part[h, block, :]``.

    Layout of the P entries: alpha[R], beta[R], slope, bos, default, b1[D], w2[D], w1[F*D].
    """
    h = tl.program_id(0)
    tb = tl.program_id(1)
    out = part + (h * NT + tb) * P
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    r = tl.arange(0, RP)
    rm = r < R
    acc_a = tl.zeros([RP], dtype=tl.float32)
    acc_b = tl.zeros([RP], dtype=tl.float32)
    acc_s = tl.zeros([BLOCK_T], dtype=tl.float32)
    tmq = t < Tq
    for b in range(0, Bq):
        m = tmq[:, None] & rm[None, :]
        off = (b * Tq + t)[:, None] * R + r[None, :]
        p = tl.load(presq + off, mask=m, other=0.0)
        c = tl.load(cosq + off, mask=m, other=0.0) * p
        s = tl.load(sinq + off, mask=m, other=0.0) * p
        base = ((b * H + h) * Tq + t) * L
        g0 = tl.load(dql + base[:, None] + 2 * r[None, :], mask=m, other=0.0).to(tl.float32) * scale
        g1 = tl.load(dql + base[:, None] + 2 * r[None, :] + 1, mask=m, other=0.0).to(tl.float32) * scale
        acc_a += tl.sum(g0 * c + g1 * s, axis=0)
        acc_b += tl.sum(g0 * s - g1 * c, axis=0)
        if HAS_SLOPE:
            acc_s += tl.load(dql + base + 2 * R, mask=tmq, other=0.0).to(tl.float32) * (scale * cblock)
    tl.store(out + r, acc_a, mask=rm)
    tl.store(out + R + r, acc_b, mask=rm)
    tmk = t < Tk
    du = tl.zeros([BLOCK_T], dtype=tl.float32)
    acc_bos = tl.zeros([BLOCK_T], dtype=tl.float32)
    acc_def = tl.zeros([BLOCK_T], dtype=tl.float32)
    d = tl.arange(0, DP)
    dm = d < D
    for b in range(0, Bk):
        tk = b * Tk + t
        du = tl.load(dkl + ((b * H + h) * Tk + t) * L + 2 * R + 1, mask=tmk, other=0.0).to(tl.float32)
        if HAS_SLOPE:
            acc_s += du * tl.load(jlo + tk, mask=tmk, other=0.0)
        if HAS_BOS:
            acc_bos += du * tl.load(isbos + tk, mask=tmk, other=0.0)
        if HAS_DEFAULT:
            acc_def += du * tl.load(isnone + tk, mask=tmk, other=0.0)
        if HAS_MLP:
            hp = tl.zeros([BLOCK_T, DP], dtype=tl.float32) + tl.load(b1 + h * D + d, mask=dm, other=0.0)[None, :]
            for f in tl.static_range(F):
                pf = tl.load(phi + tk * F + f, mask=tmk, other=0.0)
                hp += pf[:, None] * tl.load(w1 + (h * F + f) * D + d, mask=dm, other=0.0)[None, :]
            sig = tl.sigmoid(hp)
            dh = du[:, None] * tl.load(w2 + h * D + d, mask=dm, other=0.0)[None, :] * (sig * (1 + hp * (1 - sig)))
            o_b1 = out + 2 * R + 3
            tl.store(o_b1 + d, tl.load(o_b1 + d, mask=dm, other=0.0) + tl.sum(dh, axis=0), mask=dm)
            o_w2 = o_b1 + D
            tl.store(o_w2 + d, tl.load(o_w2 + d, mask=dm, other=0.0) + tl.sum(du[:, None] * hp * sig, axis=0), mask=dm)
            for f in tl.static_range(F):
                pf = tl.load(phi + tk * F + f, mask=tmk, other=0.0)
                o_w1 = o_w2 + D + f * D
                tl.store(o_w1 + d, tl.load(o_w1 + d, mask=dm, other=0.0) + tl.sum(pf[:, None] * dh, axis=0), mask=dm)
    tl.store(out + 2 * R, tl.sum(acc_s, axis=0))
    tl.store(out + 2 * R + 1, tl.sum(acc_bos, axis=0))
    tl.store(out + 2 * R + 2, tl.sum(acc_def, axis=0))


def _pow2(n: int) -> int:
    return max(1, triton.next_power_of_2(max(n, 1)))


class GoatLanesTriton(torch.autograd.Function):
    """Drop-in for :class:`mixlab.ops.goat.GoatLanes` (same argument list), Triton kernels.

    Requirements: float32 contiguous features, fixed frequencies (no grad to cos/sin).
    """

    BLOCK_T = 64

    @staticmethod
    def forward(ctx, cos_q, sin_q, pres_q, cos_k, sin_k, pres_k, phi, j_hi, j_lo, is_bos, is_none,
                alpha, beta, slope, bos, default, w1, b1, w2, scale, out_dtype):
        H, R = alpha.shape
        L = 2 * R + 2
        Bq, Tq = cos_q.shape[0], cos_q.shape[1]
        Bk, Tk = cos_k.shape[0], cos_k.shape[1]
        dev = cos_q.device
        F = phi.shape[-1] if w1 is not None else 0
        D = w1.shape[-1] if w1 is not None else 0
        dummy = torch.zeros(1, device=dev, dtype=torch.float32)
        opt = lambda x: x.contiguous() if x is not None else dummy
        args = [c.contiguous() for c in (cos_q, sin_q, pres_q, cos_k, sin_k, pres_k)]
        feats = [opt(phi if w1 is not None else None), j_hi.contiguous(), j_lo.contiguous(), is_bos.contiguous(), is_none.contiguous()]
        params = [alpha.contiguous(), beta.contiguous(), opt(slope), opt(bos), opt(default), opt(w1), opt(b1), opt(w2)]
        ql = torch.empty(Bq, H, Tq, L, device=dev, dtype=out_dtype)  # the kernel casts on store
        kl = torch.empty(Bk, H, Tk, L, device=dev, dtype=out_dtype)
        meta = dict(R=R, RP=_pow2(R), F=F, D=D, DP=_pow2(D), L=L, BLOCK_T=GoatLanesTriton.BLOCK_T,
                    HAS_SLOPE=slope is not None, HAS_BOS=bos is not None, HAS_DEFAULT=default is not None,
                    HAS_MLP=w1 is not None)
        grid = (max(Bq, Bk) * H, triton.cdiv(max(Tq, Tk), GoatLanesTriton.BLOCK_T))
        _lanes_fwd[grid](*args, *feats, *params, ql, kl, Bq, Bk, Tq, Tk, H, float(scale), float(KEY_LINEAR_BLOCK), **meta)
        ctx.save_for_backward(args[0], args[1], args[2], feats[0], feats[2], feats[3], feats[4], params[6], params[5], params[7])
        ctx.meta, ctx.sizes, ctx.scale = meta, (Bq, Bk, Tq, Tk, H), float(scale)
        ctx.shapes = (alpha.shape, None if slope is None else slope.shape, None if w1 is None else w1.shape)
        return ql, kl

    @staticmethod
    def backward(ctx, dq_l, dk_l):
        cos_q, sin_q, pres_q, phi, j_lo, is_bos, is_none, b1, w1, w2 = ctx.saved_tensors
        meta = ctx.meta
        Bq, Bk, Tq, Tk, H = ctx.sizes
        R, D, F = meta["R"], meta["D"], meta["F"]
        dev = cos_q.device
        NT = triton.cdiv(max(Tq, Tk), GoatLanesTriton.BLOCK_T)
        P = 2 * R + 3 + 2 * D + F * D
        part = torch.zeros(H, NT, P, device=dev, dtype=torch.float32)
        _lanes_bwd[(H, NT)](dq_l.contiguous(), dk_l.contiguous(), cos_q, sin_q, pres_q, phi, j_lo, is_bos, is_none,
                            b1, w1, w2, part, Bq, Bk, Tq, Tk, H, NT, P, ctx.scale, float(KEY_LINEAR_BLOCK), **meta)
        g = part.sum(1)  # [H, P]: deterministic two-stage reduction over token blocks
        d_alpha, d_beta = g[:, :R], g[:, R : 2 * R]
        d_slope, d_bos, d_def = g[:, 2 * R], g[:, 2 * R + 1], g[:, 2 * R + 2]
        o = 2 * R + 3
        d_b1, d_w2, d_w1 = g[:, o : o + D], g[:, o + D : o + 2 * D], g[:, o + 2 * D :].reshape(H, F, D)
        return (None, None, None, None, None, None, None, None, None, None, None,
                d_alpha, d_beta,
                d_slope if meta["HAS_SLOPE"] else None, d_bos if meta["HAS_BOS"] else None,
                d_def if meta["HAS_DEFAULT"] else None,
                d_w1 if meta["HAS_MLP"] else None, d_b1 if meta["HAS_MLP"] else None,
                d_w2 if meta["HAS_MLP"] else None, None, None)
