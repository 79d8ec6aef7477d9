"""Triton fast path for GOAT's lane construction (:class:`mixlab.ops.goat.GoatLanes`).

Same math as ``GoatLanes`` (see its docstring and the equations in :mod:`mixlab.ops.goat`):
ONE kernel forward and ONE kernel backward (plus one ``sum`` over partial rows), instead
of ~25 + ~30 small eager kernels per layer, which dominate a short attention layer on a
fast GPU.

Two entry points share the kernels:

* :class:`GoatLanesTriton` - drop-in for ``GoatLanes`` (same argument list): returns new
  ``q_lanes [Bq, H, Tq, L]`` and ``k_lanes [Bk, H, Tk, L]``.
* :class:`GoatLanesInplace` - writes the lanes straight into the packed ``qkv`` projection
  output ``[B, T, 3 * H * d_h]`` (lanes are the last ``L`` dims of every q and k head), so
  the GOAT layer costs a plain ``qkv -> SDPA -> proj`` layer plus these two kernels: no
  concatenation, no extra activation memory. Its backward zeroes the lane columns of the
  incoming gradient (the lanes overwrite those projection outputs, so the projection gets
  no gradient through them - exact).

Grid: (head, token block of 64, batch chunk). With coordinates shared by the batch (the
usual case) a program evaluates the lane features and the key MLP once and loops over its
chunk's batch entries only to store (forward) or to sum lane gradients (backward).

The backward writes per-program partial parameter gradients into rows of one flat fp32
buffer laid out as the parameters themselves (``alpha [H, R] | beta [H, R] | slope [H] |
bos [H] | default [H] | b1 [H, D] | w2 [H, D] | w1 [H, F, D]``), and one deterministic
``sum`` over rows yields every gradient as a contiguous view (no per-parameter copies).

Used on CUDA for float32 lane math with fixed frequencies (no gradient into cos/sin);
everything else (CPU, float64 tests, learned frequencies) uses the torch ``GoatLanes``.
Tests run these kernels on CPU under ``TRITON_INTERPRET=1`` against ``GoatLanes``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mixlab.ops.goat import KEY_LINEAR_BLOCK

__all__ = ["GoatLanesTriton", "GoatLanesInplace"]


@triton.jit
def _key_mlp_hidden(phi, tk, tmk, w1, b1, h, F: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
    """Pre-activation ``[BT, DP]`` of g_h's hidden layer for key rows ``tk`` (F rank-1 updates)."""
    d = tl.arange(0, DP)
    dm = d < D
    hp = tl.zeros([tk.shape[0], DP], dtype=tl.float32) + tl.load(b1 + h * D + d, mask=dm, other=0.0)[None, :]
    for f in tl.static_range(F):
        pf = tl.load(phi + tk * F + f, mask=tmk, other=0.0)
        hp += pf[:, None] * tl.load(w1 + (h * F + f) * D + d, mask=dm, other=0.0)[None, :]
    return hp


@triton.jit
def _lane_features(cos, sin, pres, row, tmask, l, R: tl.constexpr):
    """Per-lane ``(cos, sin)`` of token rows ``row [BT]`` times axis presence: ``[BT, LP]``,
    lane ``l`` reading mode ``l // 2`` (zero outside the ``2R`` relative lanes)."""
    m = tmask[:, None] & (l < 2 * R)[None, :]
    off = row[:, None] * R + (l // 2)[None, :]
    p = tl.load(pres + off, mask=m, other=0.0)
    return tl.load(cos + off, mask=m, other=0.0) * p, tl.load(sin + off, mask=m, other=0.0) * p


@triton.jit
def _lanes_fwd(cosq, sinq, presq, cosk, sink, presk, phi, jhi, jlo, isbos, isnone,
               alpha, beta, slope, bos, default, w1, b1, w2,
               qout, q_off, sqb, sqh, sqt, kout, k_off, skb, skh, skt,
               NQ, NK, Tq, Tk, BB, scale, cblock,
               R: tl.constexpr, L: tl.constexpr, LP: tl.constexpr, F: tl.constexpr, D: tl.constexpr,
               DP: tl.constexpr, BLOCK_T: tl.constexpr, Q_BATCHED: tl.constexpr, K_BATCHED: tl.constexpr,
               HAS_SLOPE: tl.constexpr, HAS_BOS: tl.constexpr, HAS_DEFAULT: tl.constexpr, HAS_MLP: tl.constexpr):
    """Program (head h, token block, batch chunk of BB outputs) builds the block's ``[BT, L]``
    q and k lane tiles once (per-sample features come with BB = 1) and stores each token's
    lanes as one contiguous run for every output batch of its chunk."""
    h = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    b0 = tl.program_id(2) * BB
    l = tl.arange(0, LP)
    rel = l < 2 * R
    even = (l % 2) == 0
    lm = l < L
    a = tl.load(alpha + h * R + l // 2, mask=rel, other=0.0)[None, :]
    be = tl.load(beta + h * R + l // 2, mask=rel, other=0.0)[None, :]
    sl = 0.0
    if HAS_SLOPE:
        sl = tl.load(slope + h)
    # ---- query lanes: scale * [q_rel(i), lambda * c, 1]
    tq = t < Tq
    c, s = _lane_features(cosq, sinq, presq, (b0 if Q_BATCHED else 0) * Tq + t, tq, l, R)
    q_rel = tl.where(even[None, :], a * c + be * s, a * s - be * c)
    q_tile = tl.where(rel[None, :], q_rel, tl.where((l == 2 * R)[None, :], sl * cblock, 1.0)) * scale
    # ---- key lanes: [k_rel(j), j_hi, u_rest(j)]
    tk_ok = t < Tk
    tk = (b0 if K_BATCHED else 0) * Tk + t
    ck, sk = _lane_features(cosk, sink, presk, tk, tk_ok, l, R)
    u = tl.zeros([BLOCK_T], dtype=tl.float32)
    if HAS_MLP:
        d = tl.arange(0, DP)
        hp = _key_mlp_hidden(phi, tk, tk_ok, w1, b1, h, F, D, DP)
        u += tl.sum(hp * tl.sigmoid(hp) * tl.load(w2 + h * D + d, mask=d < D, other=0.0)[None, :], axis=1)
    khi = tl.zeros([BLOCK_T], dtype=tl.float32)
    if HAS_SLOPE:
        u += sl * tl.load(jlo + tk, mask=tk_ok, other=0.0)
        khi = tl.load(jhi + tk, mask=tk_ok, other=0.0)
    if HAS_BOS:
        u += tl.load(bos + h) * tl.load(isbos + tk, mask=tk_ok, other=0.0)
    if HAS_DEFAULT:
        u += tl.load(default + h) * tl.load(isnone + tk, mask=tk_ok, other=0.0)
    k_tile = tl.where(rel[None, :], tl.where(even[None, :], ck, sk),
                      tl.where((l == 2 * R)[None, :], khi[:, None], u[:, None]))
    for i in range(0, BB):
        ob = b0 + i
        tmq = tq & (ob < NQ)
        qb = qout + q_off + ob.to(tl.int64) * sqb + h * sqh + t.to(tl.int64) * sqt
        tl.store(qb[:, None] + l[None, :], q_tile, mask=tmq[:, None] & lm[None, :])
        tmk = tk_ok & (ob < NK)
        kb = kout + k_off + ob.to(tl.int64) * skb + h * skh + t.to(tl.int64) * skt
        tl.store(kb[:, None] + l[None, :], k_tile, mask=tmk[:, None] & lm[None, :])


@triton.jit
def _lanes_bwd(dq, q_off, sqb, sqh, sqt, dk, k_off, skb, skh, skt,
               cosq, sinq, presq, phi, jlo, isbos, isnone, b1, w1, w2, part, PT,
               o_alpha, o_beta, o_slope, o_bos, o_def, o_b1, o_w2, o_w1,
               NQ, NK, Tq, Tk, BB, scale, cblock,
               R: tl.constexpr, L: tl.constexpr, LP: tl.constexpr, F: tl.constexpr, D: tl.constexpr,
               DP: tl.constexpr, BLOCK_T: tl.constexpr,
               Q_BATCHED: tl.constexpr, K_BATCHED: tl.constexpr, ZERO: tl.constexpr,
               HAS_SLOPE: tl.constexpr, HAS_BOS: tl.constexpr, HAS_DEFAULT: tl.constexpr, HAS_MLP: tl.constexpr):
    """Program (head h, token block, batch chunk of BB outputs) writes its partial parameter
    gradients into one row of ``part`` (flat parameter layout, see module docstring).

    The lane gradients are linear in the parameters' features, which are shared by the
    chunk (per-sample features come with BB = 1), so the chunk's ``[BT, L]`` lane-gradient
    tiles are summed first and the features (and the key MLP) are evaluated once. With
    ``ZERO`` the lane entries of ``dq``/``dk`` are zeroed after they are read, through the
    same pointer tiles and after a block barrier (no read/write race between threads)."""
    h = tl.program_id(0)
    tb = tl.program_id(1)
    nb = tl.program_id(2)
    row = part + (tb * tl.num_programs(2) + nb).to(tl.int64) * PT
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    b0 = nb * BB
    l = tl.arange(0, LP)
    rel = l < 2 * R
    even = (l % 2) == 0
    lm = l < L
    tq = t < Tq
    tk_ok = t < Tk
    gq = tl.zeros([BLOCK_T, LP], dtype=tl.float32)
    dus = tl.zeros([BLOCK_T], dtype=tl.float32)
    for i in range(0, BB):
        ob = b0 + i
        mq = (tq & (ob < NQ))[:, None] & lm[None, :]
        pq = (dq + q_off + ob.to(tl.int64) * sqb + h * sqh + t.to(tl.int64) * sqt)[:, None] + l[None, :]
        gq += tl.load(pq, mask=mq, other=0.0).to(tl.float32)
        mk = (tk_ok & (ob < NK))[:, None] & lm[None, :]
        pk = (dk + k_off + ob.to(tl.int64) * skb + h * skh + t.to(tl.int64) * skt)[:, None] + l[None, :]
        gk = tl.load(pk, mask=mk, other=0.0).to(tl.float32)
        dus += tl.sum(tl.where((l == 2 * R + 1)[None, :], gk, 0.0), axis=1)
        if ZERO:
            tl.debug_barrier()
            tl.store(pq, tl.zeros([BLOCK_T, LP], dtype=tl.float32), mask=mq)
            tl.store(pk, tl.zeros([BLOCK_T, LP], dtype=tl.float32), mask=mk)
    # ---- query side: alpha, beta (lane pairs) and the slope's q-lane part
    c, s = _lane_features(cosq, sinq, presq, (b0 if Q_BATCHED else 0) * Tq + t, tq, l, R)
    ga = tl.sum(gq * tl.where(even[None, :], c, s), axis=0) * scale  # [LP]: per lane
    gb = tl.sum(gq * tl.where(even[None, :], s, -c), axis=0) * scale
    r2 = tl.arange(0, LP // 2)
    tl.store(row + o_alpha + h * R + r2, tl.sum(tl.reshape(ga, [LP // 2, 2]), axis=1), mask=r2 < R)
    tl.store(row + o_beta + h * R + r2, tl.sum(tl.reshape(gb, [LP // 2, 2]), axis=1), mask=r2 < R)
    # ---- key side: u_rest = g(phi) + lambda j_lo + b 1{j=0} + default
    tk = (b0 if K_BATCHED else 0) * Tk + t
    if HAS_SLOPE:
        g_lin = tl.sum(tl.sum(tl.where((l == 2 * R)[None, :], gq, 0.0), axis=1), axis=0)
        ds = g_lin * (scale * cblock) + tl.sum(dus * tl.load(jlo + tk, mask=tk_ok, other=0.0), axis=0)
        tl.store(row + o_slope + h, ds)
    if HAS_BOS:
        tl.store(row + o_bos + h, tl.sum(dus * tl.load(isbos + tk, mask=tk_ok, other=0.0), axis=0))
    if HAS_DEFAULT:
        tl.store(row + o_def + h, tl.sum(dus * tl.load(isnone + tk, mask=tk_ok, other=0.0), axis=0))
    if HAS_MLP:
        d = tl.arange(0, DP)
        dm = d < D
        hp = _key_mlp_hidden(phi, tk, tk_ok, w1, b1, h, F, D, DP)
        sig = tl.sigmoid(hp)
        dh = dus[:, None] * tl.load(w2 + h * D + d, mask=dm, other=0.0)[None, :] * (sig * (1 + hp * (1 - sig)))
        tl.store(row + o_b1 + h * D + d, tl.sum(dh, axis=0), mask=dm)
        tl.store(row + o_w2 + h * D + d, tl.sum(dus[:, None] * hp * sig, axis=0), mask=dm)
        for f in tl.static_range(F):
            pf = tl.load(phi + tk * F + f, mask=tk_ok, other=0.0)
            tl.store(row + o_w1 + (h * F + f) * D + d, tl.sum(pf[:, None] * dh, axis=0), mask=dm)


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(max(n, 1)))


_DUMMY: dict[torch.device, torch.Tensor] = {}
_BLOCK_T = 64


def _dummy(dev: torch.device) -> torch.Tensor:
    if dev not in _DUMMY:
        _DUMMY[dev] = torch.zeros(16, device=dev, dtype=torch.float32)
    return _DUMMY[dev]


def _inputs(cos_q, sin_q, pres_q, cos_k, sin_k, pres_k, phi, j_hi, j_lo, is_bos, is_none,
            alpha, beta, slope, bos, default, w1, b1, w2):
    """Contiguous kernel arguments (dummies for absent terms) and compile-time metadata."""
    dev = cos_q.device
    dummy = _dummy(dev)
    opt = lambda x: x.contiguous() if x is not None else dummy
    H, R = alpha.shape
    F = phi.shape[-1] if w1 is not None else 0
    D = w1.shape[-1] if w1 is not None else 0
    feats_q = [c.contiguous() for c in (cos_q, sin_q, pres_q)]
    feats_k = [c.contiguous() for c in (cos_k, sin_k, pres_k)]
    feats = [opt(phi if w1 is not None else None), j_hi.contiguous(), j_lo.contiguous(), is_bos.contiguous(),
             is_none.contiguous()]
    params = [alpha.contiguous(), beta.contiguous(), opt(slope), opt(bos), opt(default), opt(w1), opt(b1), opt(w2)]
    meta = dict(R=R, L=2 * R + 2, LP=_pow2(2 * R + 2), F=F, D=D, DP=_pow2(D), BLOCK_T=_BLOCK_T,
                HAS_SLOPE=slope is not None, HAS_BOS=bos is not None, HAS_DEFAULT=default is not None,
                HAS_MLP=w1 is not None)
    return feats_q, feats_k, feats, params, meta, H


def _chunks(B: int, H: int, NT: int, batched: bool) -> tuple[int, int]:
    """``(BB, n_chunks)``: outputs per program and batch chunks; per-sample features need BB = 1,
    shared ones are split only as far as needed to give the GPU ~512 programs."""
    if batched:
        return 1, B
    n = min(B, max(1, triton.cdiv(512, H * NT)))
    bb = triton.cdiv(B, n)
    return bb, triton.cdiv(B, bb)


def _forward(ctx, dest_q, q_off, q_strides, dest_k, k_off, k_strides, NQ, NK, inputs, scale):
    """Launch the forward kernel and save what the backward needs on ``ctx``."""
    (fq, fk, feats, params, meta, H) = inputs
    Tq, Tk = fq[0].shape[1], fk[0].shape[1]
    Bqf, Bkf = fq[0].shape[0], fk[0].shape[0]
    meta = dict(meta, Q_BATCHED=Bqf > 1, K_BATCHED=Bkf > 1)
    NT = triton.cdiv(max(Tq, Tk), _BLOCK_T)
    BB, n_chunks = _chunks(max(NQ, NK), H, NT, Bqf > 1 or Bkf > 1)
    _lanes_fwd[(H, NT, n_chunks)](*fq, *fk, *feats, *params, dest_q, q_off, *q_strides, dest_k, k_off, *k_strides,
                                  NQ, NK, Tq, Tk, BB, float(scale), float(KEY_LINEAR_BLOCK), **meta)
    ctx.save_for_backward(*fq, feats[0], feats[2], feats[3], feats[4], params[6], params[5], params[7])
    ctx.meta, ctx.sizes, ctx.scale = meta, (NQ, NK, Tq, Tk, H), float(scale)


def _backward(ctx, grad_q, q_off, q_strides, grad_k, k_off, k_strides, zero: bool):
    """Launch the backward kernel; returns the parameter gradients (None where absent)."""
    cos_q, sin_q, pres_q, phi, j_lo, is_bos, is_none, b1, w1, w2 = ctx.saved_tensors
    meta = ctx.meta
    NQ, NK, Tq, Tk, H = ctx.sizes
    R, D, F = meta["R"], meta["D"], meta["F"]
    sizes = [H * R, H * R, H if meta["HAS_SLOPE"] else 0, H if meta["HAS_BOS"] else 0,
             H if meta["HAS_DEFAULT"] else 0] + ([H * D, H * D, H * F * D] if meta["HAS_MLP"] else [0, 0, 0])
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    PT = max(sum(sizes), 1)
    NT = triton.cdiv(max(Tq, Tk), _BLOCK_T)
    BB, n_chunks = _chunks(max(NQ, NK), H, NT, meta["Q_BATCHED"] or meta["K_BATCHED"])
    part = torch.empty(NT * n_chunks, PT, device=cos_q.device, dtype=torch.float32)
    _lanes_bwd[(H, NT, n_chunks)](grad_q, q_off, *q_strides, grad_k, k_off, *k_strides,
                                  cos_q, sin_q, pres_q, phi, j_lo, is_bos, is_none, b1, w1, w2, part, PT,
                                  *offsets, NQ, NK, Tq, Tk, BB, ctx.scale, float(KEY_LINEAR_BLOCK),
                                  ZERO=zero, **meta)
    g = part.sum(0)  # deterministic reduction over (token block, batch chunk) rows
    out = [g[o:o + n] for o, n in zip(offsets, sizes)]
    d_alpha, d_beta = out[0].view(H, R), out[1].view(H, R)
    d_mlp = (out[7].view(H, F, D), out[5].view(H, D), out[6].view(H, D)) if meta["HAS_MLP"] else (None, None, None)
    return (d_alpha, d_beta, out[2] if meta["HAS_SLOPE"] else None, out[3] if meta["HAS_BOS"] else None,
            out[4] if meta["HAS_DEFAULT"] else None) + d_mlp


class GoatLanesTriton(torch.autograd.Function):
    """Drop-in for :class:`mixlab.ops.goat.GoatLanes` (same arguments and returns), Triton kernels.

    Requirements: float32 features, fixed frequencies (no grad to cos/sin).
    """

    @staticmethod
    def forward(ctx, cos_q, sin_q, pres_q, cos_k, sin_k, pres_k, phi, j_hi, j_lo, is_bos, is_none,
                alpha, beta, slope, bos, default, w1, b1, w2, scale, out_dtype):
        inputs = _inputs(cos_q, sin_q, pres_q, cos_k, sin_k, pres_k, phi, j_hi, j_lo, is_bos, is_none,
                         alpha, beta, slope, bos, default, w1, b1, w2)
        H, L = alpha.shape[0], 2 * alpha.shape[1] + 2
        Bq, Tq, Bk, Tk = cos_q.shape[0], cos_q.shape[1], cos_k.shape[0], cos_k.shape[1]
        ql = torch.empty(Bq, H, Tq, L, device=cos_q.device, dtype=out_dtype)  # the kernel casts on store
        kl = torch.empty(Bk, H, Tk, L, device=cos_q.device, dtype=out_dtype)
        _forward(ctx, ql, 0, ql.stride()[:3], kl, 0, kl.stride()[:3], Bq, Bk, inputs, scale)
        return ql, kl

    @staticmethod
    def backward(ctx, dq_l, dk_l):
        dq_l, dk_l = dq_l.contiguous(), dk_l.contiguous()
        grads = _backward(ctx, dq_l, 0, dq_l.stride()[:3], dk_l, 0, dk_l.stride()[:3], zero=False)
        return (None,) * 11 + grads + (None, None)


class GoatLanesInplace(torch.autograd.Function):
    """Write GOAT lanes into the packed projection output ``qkv [B * T, 3 * H * d_h]`` in place.

    Per token the layout is ``[q | k | v]``, each ``[H, d_h]``; the last ``L = 2R + 2`` dims
    of every q and k head receive ``q_lanes`` / ``k_lanes`` exactly as :class:`GoatLanes`
    returns them (``d_c = d_h - L`` content dims stay). ``batch`` is ``B``; feature tensors
    have batch 1 (shared coordinates) or ``B``. Returns ``qkv`` (marked dirty). ``qkv``
    should be the projection's own output, not a view (autograd would otherwise wrap this
    node in a CopySlices that clones the whole gradient).

    Backward: parameter gradients from the lane entries of ``d qkv``, which are then set to
    zero in place (the forward overwrote those projection outputs).

    Raises:
        ValueError: ``qkv`` not 2-D with a unit last stride, or rows not divisible by ``batch``.
    """

    @staticmethod
    def forward(ctx, qkv, batch, cos, sin, pres, phi, j_hi, j_lo, is_bos, is_none,
                alpha, beta, slope, bos, default, w1, b1, w2, scale, head_dim):
        if qkv.dim() != 2 or qkv.stride(-1) != 1 or qkv.shape[0] % batch:
            raise ValueError(f"GoatLanesInplace: qkv must be [B*T, N] with unit last stride and B={batch} "
                             f"dividing its rows; got shape {tuple(qkv.shape)}, strides {qkv.stride()}")
        inputs = _inputs(cos, sin, pres, cos, sin, pres, phi, j_hi, j_lo, is_bos, is_none,
                         alpha, beta, slope, bos, default, w1, b1, w2)
        H, L = alpha.shape[0], 2 * alpha.shape[1] + 2
        T = qkv.shape[0] // batch
        strides = (T * qkv.stride(0), head_dim, qkv.stride(0))
        d_c = head_dim - L
        _forward(ctx, qkv, d_c, strides, qkv, H * head_dim + d_c, strides, batch, batch, inputs, scale)
        ctx.mark_dirty(qkv)
        ctx.offsets = (d_c, H * head_dim + d_c, head_dim, T)
        return qkv

    @staticmethod
    def backward(ctx, grad):
        if not grad.is_contiguous():  # e.g. an expanded gradient: never write into shared memory
            grad = grad.contiguous()
        q_off, k_off, head_dim, T = ctx.offsets
        strides = (T * grad.stride(0), head_dim, grad.stride(0))
        grads = _backward(ctx, grad, q_off, strides, grad, k_off, strides, zero=True)
        return (grad,) + (None,) * 9 + grads + (None, None)
