"""FG²-GDN gate preparation: ``k~ = sqrt(r sigma(b^k)) * k / ||k||``, ``v~ = sqrt(r sigma(b^v)) * v``.

The elementwise work between the projections and ``chunk_kda`` (paper Sec. 3.2/3.4,
Eqs. 10-13; ``r = 1``, or ``r = 2`` when negative eigenvalues are allowed). Eagerly it is
about ten small kernels forward and more backward (measured 19% over KDA at B4 T4096 H16
D128); :func:`fg2_gate_prep` runs it as one Triton kernel forward and one backward
(rows of ``K`` / ``V`` channels per program), with :func:`fg2_gate_prep_torch` as the
reference. Shapes: k, beta_k ``[B, T, H, K]``; v, beta_v ``[B, T, H, V]`` (logits, before
the sigmoid). FG²-GDN passes ``beta_v=None`` (the key rates scale v; needs K == V).

The Triton kernels have no autotuning, so they also run on CPU under
``TRITON_INTERPRET=1`` (set before Triton is imported) for tests.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["fg2_gate_prep", "fg2_gate_prep_torch", "triton_available"]


def fg2_gate_prep_torch(k: Tensor, v: Tensor, beta_k: Tensor, beta_v: Tensor | None = None,
                        max_rate: float = 1.0, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Eager reference. Returns ``(k~ [B, T, H, K], v~ [B, T, H, V])`` in k's/v's dtype.

    ``k / ||k||`` uses fla's l2norm convention ``k * rsqrt(sum k^2 + eps)``; the rates are
    ``exp(0.5 (log r + logsigmoid(b)))`` (finite gradient at rate 0).

    Raises:
        ValueError: shape mismatch; ``beta_v=None`` with K != V.
    """
    _check(k, v, beta_k, beta_v)
    kf = k.float() if k.dtype in (torch.float16, torch.bfloat16) else k
    kn = kf * torch.rsqrt((kf * kf).sum(-1, keepdim=True) + eps)
    lr = math.log(max_rate)
    sk = torch.exp(0.5 * (F.logsigmoid(beta_k.to(kn.dtype)) + lr))
    sv = sk if beta_v is None else torch.exp(0.5 * (F.logsigmoid(beta_v.to(kn.dtype)) + lr))
    return (kn * sk).to(k.dtype), (v.to(kn.dtype) * sv).to(v.dtype)


def _check(k: Tensor, v: Tensor, beta_k: Tensor, beta_v: Tensor | None) -> None:
    if beta_k.shape != k.shape:
        raise ValueError(f"fg2_gate_prep: beta_k must match k {tuple(k.shape)}; got {tuple(beta_k.shape)}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"fg2_gate_prep: k {tuple(k.shape)} and v {tuple(v.shape)} differ in leading dims")
    if beta_v is None and k.shape[-1] != v.shape[-1]:
        raise ValueError(f"FG²-GDN ties key and value writing rates: needs d_k == d_v; got d_k={k.shape[-1]}, "
                         f"d_v={v.shape[-1]} (pass beta_v: FG²-GDN+)")
    if beta_v is not None and beta_v.shape != v.shape:
        raise ValueError(f"fg2_gate_prep: beta_v must match v {tuple(v.shape)}; got {tuple(beta_v.shape)}")


def triton_available() -> bool:
    """True when Triton imports (kernels need CUDA tensors, or ``TRITON_INTERPRET=1`` on CPU)."""
    try:
        import triton  # noqa: F401
        return True
    except Exception:  # pragma: no cover
        return False


_KERNELS = None


def _kernels():
    """Build the Triton kernels lazily (Triton is imported only here)."""
    global _KERNELS
    if _KERNELS is not None:
        return _KERNELS
    import triton
    import triton.language as tl

    @triton.jit
    def _fwd(k_ptr, v_ptr, bk_ptr, bv_ptr, ko_ptr, vo_ptr, K, V, half_log_rate, eps,
             SEPARATE: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        ok = tl.arange(0, BK)
        mk = ok < K
        k = tl.load(k_ptr + row * K + ok, mask=mk, other=0.0).to(tl.float32)
        bk = tl.load(bk_ptr + row * K + ok, mask=mk, other=0.0).to(tl.float32)
        rn = 1.0 / tl.sqrt(tl.sum(k * k, axis=0) + eps)
        # logsigmoid(b) = min(b, 0) - log(1 + exp(-|b|))
        lsk = tl.minimum(bk, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(bk)))
        sk = tl.exp(0.5 * lsk + half_log_rate)
        tl.store(ko_ptr + row * K + ok, (k * rn * sk).to(ko_ptr.dtype.element_ty), mask=mk)
        ov = tl.arange(0, BV)
        mv = ov < V
        v = tl.load(v_ptr + row * V + ov, mask=mv, other=0.0).to(tl.float32)
        if SEPARATE:
            bv = tl.load(bv_ptr + row * V + ov, mask=mv, other=0.0).to(tl.float32)
        else:
            bv = tl.load(bk_ptr + row * K + ov, mask=mv, other=0.0).to(tl.float32)
        lsv = tl.minimum(bv, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(bv)))
        sv = tl.exp(0.5 * lsv + half_log_rate)
        tl.store(vo_ptr + row * V + ov, (v * sv).to(vo_ptr.dtype.element_ty), mask=mv)

    @triton.jit
    def _bwd(k_ptr, v_ptr, bk_ptr, bv_ptr, dko_ptr, dvo_ptr, dk_ptr, dv_ptr, dbk_ptr, dbv_ptr,
             K, V, half_log_rate, eps, SEPARATE: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        ok = tl.arange(0, BK)
        mk = ok < K
        k = tl.load(k_ptr + row * K + ok, mask=mk, other=0.0).to(tl.float32)
        bk = tl.load(bk_ptr + row * K + ok, mask=mk, other=0.0).to(tl.float32)
        dko = tl.load(dko_ptr + row * K + ok, mask=mk, other=0.0).to(tl.float32)
        rn = 1.0 / tl.sqrt(tl.sum(k * k, axis=0) + eps)
        kn = k * rn
        lsk = tl.minimum(bk, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(bk)))
        sk = tl.exp(0.5 * lsk + half_log_rate)
        sig_k = tl.exp(lsk)
        ov = tl.arange(0, BV)
        mv = ov < V
        v = tl.load(v_ptr + row * V + ov, mask=mv, other=0.0).to(tl.float32)
        dvo = tl.load(dvo_ptr + row * V + ov, mask=mv, other=0.0).to(tl.float32)
        if SEPARATE:
            bv = tl.load(bv_ptr + row * V + ov, mask=mv, other=0.0).to(tl.float32)
        else:
            bv = bk  # K == V
        lsv = tl.minimum(bv, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(bv)))
        sv = tl.exp(0.5 * lsv + half_log_rate)
        sig_v = tl.exp(lsv)
        # d sqrt(r sigma(b)) / db = 0.5 sqrt(r sigma(b)) (1 - sigma(b))
        dsk = dko * kn  # grad wrt sk
        dsv = dvo * v  # grad wrt sv
        dbk = 0.5 * sk * (1.0 - sig_k) * dsk
        dbv = 0.5 * sv * (1.0 - sig_v) * dsv
        # k~ = kn * sk; kn = k * rn: dk = rn (g - kn <g, kn>), g = dko * sk
        gk = dko * sk
        dk = rn * (gk - kn * tl.sum(gk * kn, axis=0))
        tl.store(dk_ptr + row * K + ok, dk.to(dk_ptr.dtype.element_ty), mask=mk)
        tl.store(dv_ptr + row * V + ov, (dvo * sv).to(dv_ptr.dtype.element_ty), mask=mv)
        if SEPARATE:
            tl.store(dbk_ptr + row * K + ok, dbk.to(dbk_ptr.dtype.element_ty), mask=mk)
            tl.store(dbv_ptr + row * V + ov, dbv.to(dbv_ptr.dtype.element_ty), mask=mv)
        else:
            tl.store(dbk_ptr + row * K + ok, (dbk + dbv).to(dbk_ptr.dtype.element_ty), mask=mk)

    _KERNELS = (triton, _fwd, _bwd)
    return _KERNELS


class _FG2GatePrep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, v, beta_k, beta_v, max_rate, eps):
        triton, fwd, _ = _kernels()
        K, V = k.shape[-1], v.shape[-1]
        k, v, beta_k = k.contiguous(), v.contiguous(), beta_k.contiguous()
        sep = beta_v is not None
        bv = beta_v.contiguous() if sep else beta_k
        ko, vo = torch.empty_like(k), torch.empty_like(v)
        rows = k.numel() // K
        hl = 0.5 * math.log(max_rate)
        fwd[(rows,)](k, v, beta_k, bv, ko, vo, K, V, hl, eps, SEPARATE=sep,
                     BK=triton.next_power_of_2(K), BV=triton.next_power_of_2(V))
        ctx.save_for_backward(k, v, beta_k, bv)
        ctx.sep, ctx.hl, ctx.eps = sep, hl, eps
        return ko, vo

    @staticmethod
    def backward(ctx, dko, dvo):
        triton, _, bwd = _kernels()
        k, v, beta_k, bv = ctx.saved_tensors
        K, V = k.shape[-1], v.shape[-1]
        dko = torch.zeros_like(k) if dko is None else dko.contiguous()
        dvo = torch.zeros_like(v) if dvo is None else dvo.contiguous()
        dk, dv, dbk = torch.empty_like(k), torch.empty_like(v), torch.empty_like(beta_k)
        dbv = torch.empty_like(bv) if ctx.sep else dbk
        bwd[(k.numel() // K,)](k, v, beta_k, bv, dko, dvo, dk, dv, dbk, dbv, K, V, ctx.hl, ctx.eps,
                               SEPARATE=ctx.sep, BK=triton.next_power_of_2(K), BV=triton.next_power_of_2(V))
        return dk, dv, dbk, (dbv if ctx.sep else None), None, None


def fg2_gate_prep(k: Tensor, v: Tensor, beta_k: Tensor, beta_v: Tensor | None = None,
                  max_rate: float = 1.0, eps: float = 1e-6, impl: str = "auto") -> tuple[Tensor, Tensor]:
    """Fused gate preparation (same contract and result as :func:`fg2_gate_prep_torch`).

    Args:
        impl: ``"auto"`` (Triton for CUDA tensors, torch otherwise), ``"triton"``, ``"torch"``.

    Raises:
        ValueError: shape errors (see :func:`fg2_gate_prep_torch`); unknown impl.
    """
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"fg2_gate_prep: impl must be 'auto', 'triton' or 'torch'; got {impl!r}")
    _check(k, v, beta_k, beta_v)
    if impl == "auto":
        impl = "triton" if k.is_cuda and k.dtype != torch.float64 else "torch"
    if impl == "torch":
        return fg2_gate_prep_torch(k, v, beta_k, beta_v, max_rate, eps)
    return _FG2GatePrep.apply(k, v, beta_k, beta_v, float(max_rate), float(eps))
