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
and adaptive stopping at 1e-4 would never trigger. :func:`launch_config` picks the block size, warps and precision.

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

__all__ = ["mesa_cg_triton", "solve_dense_triton", "chunk_states_triton", "launch_config", "TritonCGUnfit", "MAX_CHUNK",
           "MAX_HEAD_DIM"]

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
    split, three float16 tensor-core products with the pre-split ``b_hi + b_lo``; else
    ``tl.dot(a, b)`` with ``input_precision=PREC`` (``tf32x3`` or ``ieee``)."""
    if PREC == "fp16x3":
        s = tl.maximum(tl.max(tl.abs(a), axis=1), 1e-30)
        a_hi, a_lo = _split16(a / s[:, None])
        acc = tl.dot(a_hi, b_hi, out_dtype=tl.float32)
        acc = tl.dot(a_hi, b_lo, acc, out_dtype=tl.float32)
        acc = tl.dot(a_lo, b_hi, acc, out_dtype=tl.float32)
        return acc * s[:, None]
    else:
        return tl.dot(a, b, input_precision=PREC)

@triton.jit
def _load_chunk(h_ptrs, k_ptrs, kt_ptrs, mkk, mfk, mkf, PREC: tl.constexpr):
    """The chunk's ``H``, ``k``, ``k^T`` (and their float16 halves for ``fp16x3``)."""
    h = tl.load(h_ptrs, mask=mkk, other=0.0)
    kc = tl.load(k_ptrs, mask=mfk, other=0.0)
    kt = tl.load(kt_ptrs, mask=mkf, other=0.0)
    if PREC == "fp16x3":
        h_hi, h_lo = _split16(h)
        kc_hi, kc_lo = _split16(kc)
        kt_hi, kt_lo = _split16(kt)
    else:
        h_hi, h_lo, kc_hi, kc_lo, kt_hi, kt_lo = h, h, kc, kc, kt, kt
    return h, h_hi, h_lo, kc, kc_hi, kc_lo, kt, kt_hi, kt_lo


@triton.jit
def _halves(a, PREC: tl.constexpr):
    """``(hi, lo)`` float16 halves of a ``b`` operand of :func:`_mm` for ``fp16x3``, else ``(a, a)``."""
    if PREC == "fp16x3":
        hi, lo = _split16(a)
    else:
        hi, lo = a, a
    return hi, lo


@triton.jit
def _cg(h_ptr, k_ptr, d_ptr, dq_ptr, lam_ptr, b_ptr, x_ptr, it_ptr, g_ptr, v_ptr, o_ptr, C, K, V, max_iter, eps2,
        tiny, BC: tl.constexpr, BCF: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
        HOLD: tl.constexpr, READOUT: tl.constexpr):
    # program (m, j): tokens j*BC .. j*BC+BC-1 of chunk m; their systems are independent, but
    # the intra-chunk term reads every key of the chunk (D is 0 above the diagonal)
    m = tl.program_id(0).to(tl.int64)
    t0 = tl.program_id(1) * BC
    ot = t0 + tl.arange(0, BC)  # this program's tokens
    of = tl.arange(0, BCF)  # every token of the chunk
    ok = tl.arange(0, BK)
    mt = ot < C
    mf = of < C
    mk = ok < K
    h_ptrs = h_ptr + m * K * K + ok[:, None] * K + ok[None, :]  # H is symmetric: H^T = H
    k_ptrs = k_ptr + m * C * K + of[:, None] * K + ok[None, :]
    kt_ptrs = k_ptr + m * C * K + of[None, :] * K + ok[:, None]
    mkk = mk[:, None] & mk[None, :]
    mfk = mf[:, None] & mk[None, :]
    mkf = mk[:, None] & mf[None, :]
    tk = m * C * K + ot[:, None] * K + ok[None, :]
    mtk = mt[:, None] & mk[None, :]
    dq = tl.load(dq_ptr + m * C + ot, mask=mt, other=0.0)
    lam = tl.load(lam_ptr + m * K + ok, mask=mk, other=0.0)
    dd = tl.load(d_ptr + m * C * C + ot[:, None] * C + of[None, :], mask=mt[:, None] & mf[None, :], other=0.0)
    r = tl.load(b_ptr + tk, mask=mtk, other=0.0)
    # float32 scalars: torch.compile hands Python floats to a user kernel as float64 (H200, torch 2.11), which
    # would promote alpha, beta and so r to float64 inside the loop (Triton refuses a loop-carried type change)
    eps2 = tl.cast(eps2, tl.float32)
    tiny = tl.cast(tiny, tl.float32)
    if HOLD:
        h, h_hi, h_lo, kc, kc_hi, kc_lo, kt, kt_hi, kt_lo = _load_chunk(h_ptrs, k_ptrs, kt_ptrs, mkk, mfk, mkf,
                                                                         PREC)
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
    tl.store(x_ptr + tk, x, mask=mtk)
    tl.store(it_ptr + m * C + ot, iters, mask=mt)
    if READOUT:  # o_t = dq_t (x_t^T G) + sum_i D[t, i] (x_t . k_i) v_i  (the read-out G_t^T x_t)
        ov = tl.arange(0, BV)
        mv = ov < V
        if not HOLD:
            h, h_hi, h_lo, kc, kc_hi, kc_lo, kt, kt_hi, kt_lo = _load_chunk(h_ptrs, k_ptrs, kt_ptrs, mkk, mfk, mkf,
                                                                             PREC)
        gm = tl.load(g_ptr + m * K * V + ok[:, None] * V + ov[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
        vc = tl.load(v_ptr + m * C * V + of[:, None] * V + ov[None, :], mask=mf[:, None] & mv[None, :], other=0.0)
        g_hi, g_lo = _halves(gm, PREC)
        v_hi, v_lo = _halves(vc, PREC)
        o = dq[:, None] * _mm(x, gm, g_hi, g_lo, PREC)
        o += _mm(_mm(x, kt, kt_hi, kt_lo, PREC) * dd, vc, v_hi, v_lo, PREC)
        tl.store(o_ptr + m * C * V + ot[:, None] * V + ov[None, :], o, mask=mt[:, None] & mv[None, :])



@triton.jit
def _states(kw_ptr, x_ptr, last_ptr, s0_ptr, out_ptr, fin_ptr, N, C, K, X, HAS_S0: tl.constexpr,
            BCF: tl.constexpr, BK: tl.constexpr, BX: tl.constexpr, PREC: tl.constexpr):
    # program (bh, i, j): tile [i*BK : i*BK+BK, j*BX : j*BX+BX] of the [K, X] state of one (batch, head),
    # carried through the N chunks: out[n] = S before chunk n; S <- last_n S + kw_n^T x_n
    bh = tl.program_id(0).to(tl.int64)
    ok = tl.program_id(1) * BK + tl.arange(0, BK)
    ox = tl.program_id(2) * BX + tl.arange(0, BX)
    oc = tl.arange(0, BCF)
    mk, mx, mc = ok < K, ox < X, oc < C
    mkx = mk[:, None] & mx[None, :]
    tile = ok[:, None] * X + ox[None, :]
    if HAS_S0:
        s = tl.load(s0_ptr + bh * K * X + tile, mask=mkx, other=0.0)
    else:
        s = tl.zeros([BK, BX], dtype=tl.float32)
    for n in range(N):
        base = bh * N + n
        tl.store(out_ptr + base * K * X + tile, s, mask=mkx)
        kwt = tl.load(kw_ptr + base * C * K + oc[None, :] * K + ok[:, None], mask=mk[:, None] & mc[None, :],
                      other=0.0)  # [BK, C]
        xc = tl.load(x_ptr + base * C * X + oc[:, None] * X + ox[None, :], mask=mc[:, None] & mx[None, :],
                     other=0.0)  # [C, BX]
        x_hi, x_lo = _split16(xc)
        a = tl.load(last_ptr + base)
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


def chunk_states_triton(kw: Tensor, x: Tensor, last: Tensor, s0: Tensor | None) -> tuple[Tensor, Tensor]:
    """Chunk-start states of Mesa's statistics (MesaNet Appendix D; fla's ``chunk_fwd_h`` in form):
    ``S_0 = s0``, ``S_{n+1} = last_n S_n + kw_n^T x_n`` (float32, products at float32 accuracy via
    ``fp16x3``). Forward only: :class:`mixlab.ops.mesa._Chunks` uses it outside autograd.

    Args:
        kw: ``[BH, N, C, K]`` keys weighted by their decay to the chunk end and beta; x: ``[BH, N, C, X]``
        (keys for ``H``, values for ``G``); last: ``[BH, N]`` each chunk's total decay; s0: ``[BH, K, X]``
        or None (zeros). All float32 on one CUDA device (or CPU under ``TRITON_INTERPRET=1``).

    Returns:
        ``states [BH, N, K, X]`` (the state before each chunk) and ``final [BH, K, X]``.
    """
    bh, n, c, dk = kw.shape
    dx = x.shape[-1]
    kw, x, last = kw.contiguous(), x.contiguous(), last.contiguous()
    out = torch.empty(bh, n, dk, dx, dtype=torch.float32, device=kw.device)
    fin = torch.empty(bh, dk, dx, dtype=torch.float32, device=kw.device)
    bk, bx = min(64, _next_pow2(dk)), min(64, _next_pow2(dx))
    s0c = s0.contiguous() if s0 is not None else fin
    _states[(bh, -(-dk // bk), -(-dx // bx))](kw, x, last, s0c, out, fin, n, c, dk, dx, HAS_S0=s0 is not None,
                                               BCF=_next_pow2(c), BK=bk, BX=bx, PREC="fp16x3", num_warps=4,
                                               num_stages=1)
    return out, fin


def _next_pow2(n: int) -> int:
    return 1 << max(4, (n - 1).bit_length())


def launch_config(c: int, dk: int) -> dict:
    """Tokens per program, warps, whether the chunk's matrices stay in registers, product precision.

    Defaults by the chunk and head size; ``MIXLAB_MESA_CG`` overrides them for benchmark sweeps
    (``"bc=32,warps=8,hold=1,prec=fp16x3"``). ``prec``: ``"fp16x3"`` (default: three float16
    tensor-core products of hi/lo halves, ~22-bit accuracy, half the shared memory of
    ``tf32x3``), ``"tf32x3"`` (three TF32 products) or ``"ieee"`` (float32 FMA products); TF32
    alone would floor the residual near 1e-3, so it is not offered.

    Raises:
        ValueError: a malformed ``MIXLAB_MESA_CG`` (names the bad entry).
    """
    bcf = _next_pow2(c)
    cfg = {"bc": min(bcf, 32), "warps": 4 if dk <= 64 else 8, "hold": 1, "prec": "fp16x3"}
    spec = os.environ.get("MIXLAB_MESA_CG", "").strip()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, _, val = item.partition("=")
        if key not in cfg or not val:
            raise ValueError(f"MIXLAB_MESA_CG: bad entry {item!r}; keys: bc, warps, hold, prec")
        cfg[key] = val if key == "prec" else int(val)
    if (cfg["prec"] not in ("ieee", "tf32x3", "fp16x3") or cfg["bc"] not in (16, 32, 64, 128)
            or cfg["warps"] not in (1, 2, 4, 8, 16)):
        raise ValueError(f"MIXLAB_MESA_CG: need prec ieee|tf32x3|fp16x3, bc 16|32|64|128, warps 1..16; got {cfg}")
    cfg["bc"] = min(cfg["bc"], bcf)
    return cfg


def mesa_cg_triton(H: Tensor, k: Tensor, D: Tensor, dq: Tensor, lamb: Tensor, rhs: Tensor, max_iter: int,
                   eps: float | None, readout: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, ...]:
    """CG on ``(H_t + Lambda) x_t = rhs_t`` for every token of ``M`` chunks (float32).

    Args:
        H: ``[M, K, K]`` chunk-start statistic (symmetric); k: ``[M, C, K]`` keys of the chunk;
        D: ``[M, C, C]`` decay-and-beta weights (lower triangular); dq: ``[M, C]`` decay from
        the chunk start; lamb: ``[M, K]`` (or ``[M, 1, K]``) regulariser diagonal, > 0;
        rhs: ``[M, C, K]`` right-hand sides; max_iter: iteration cap (fixed count when
        ``eps`` is None); eps: relative residual tolerance; readout: ``(G [M, K, V], v [M, C, V])``
        to also return the read-out ``o_t = G_t^T x_t`` (:func:`mixlab.ops.mesa._readout_kv`)
        computed in the same program.

    Returns:
        ``x [M, C, K]`` float32 and iterations ``[M, C]`` int32 (updates applied per token), then
        ``o [M, C, V]`` float32 when ``readout`` is given.

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
    x = torch.empty_like(args[-1])
    iters = torch.empty(m, c, dtype=torch.int32, device=rhs.device)
    if readout is not None:
        dv = readout[0].shape[-1]
        if dv > MAX_HEAD_DIM:
            raise ValueError(f"mesa_cg_triton: value head dim {dv} must be <= {MAX_HEAD_DIM}")
        g_m, v_m = (z.reshape(m, *sh).contiguous() for z, sh in zip(readout, ((dk, dv), (c, dv))))
        if any(z.dtype != torch.float32 or z.device != rhs.device for z in (g_m, v_m)):
            raise ValueError("mesa_cg_triton: the read-out's G and v must be float32 on the device of rhs")
        o = torch.empty(m, c, dv, dtype=torch.float32, device=rhs.device)
    else:
        dv, g_m, v_m, o = 1, x, x, x  # unused (READOUT=False)
    if m == 0:
        return (x, iters) if readout is None else (x, iters, o)
    cfg = launch_config(c, dk)
    eps2 = 0.0 if eps is None else float(eps) ** 2
    grid = (m, -(-c // cfg["bc"]))
    try:
        _cg[grid](*args, x, iters, g_m, v_m, o, c, dk, dv, int(max_iter), eps2, torch.finfo(torch.float32).tiny,
                  BC=cfg["bc"], BCF=_next_pow2(c), BK=_next_pow2(dk), BV=_next_pow2(dv), PREC=cfg["prec"],
                  HOLD=bool(cfg["hold"]), READOUT=readout is not None, num_warps=cfg["warps"], num_stages=1)
    except triton.runtime.errors.OutOfResources as e:
        raise TritonCGUnfit(f"mesa_cg_triton: the kernel does not fit this GPU at chunk {c}, head dim {dk}, "
                            f"config {cfg} ({e}); set MIXLAB_MESA_CG (e.g. 'hold=0,bc=16') or use impl='chunk'") from e
    return (x, iters) if readout is None else (x, iters, o)
