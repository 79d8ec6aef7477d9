"""Triton kernels of the FG²-GDN gate preparation (:func:`mixlab.ops.fg2_gate.fg2_gate_prep`).

One program per row of ``K`` key / ``V`` value channels (a token and head), forward and
backward; Triton is imported when a kernel is first built (:func:`_kernels`). No autotuning,
so the kernels also run on CPU under ``TRITON_INTERPRET=1`` (set before Triton is imported).
"""

from __future__ import annotations

import math

import torch

__all__ = ["FG2GatePrep"]


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


class FG2GatePrep(torch.autograd.Function):
    """``(k~, v~) = FG2GatePrep.apply(k, v, beta_k, beta_v, max_rate, eps)``: one Triton kernel
    forward, one backward; contract and result of :func:`mixlab.ops.fg2_gate.fg2_gate_prep_torch`
    (k, beta_k ``[B, T, H, K]``; v, beta_v ``[B, T, H, V]`` or ``beta_v=None``)."""

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
