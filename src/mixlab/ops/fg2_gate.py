"""FG²-GDN gate preparation: ``k~ = sqrt(r sigma(b^k)) * k / ||k||``, ``v~ = sqrt(r sigma(b^v)) * v``.

The elementwise work between the projections and ``chunk_kda`` (paper Sec. 3.2/3.4,
Eqs. 10-13; ``r = 1``, or ``r = 2`` when negative eigenvalues are allowed). Eagerly it is
about ten small kernels forward and more backward (measured 19% over KDA at B4 T4096 H16
D128); :func:`fg2_gate_prep` runs it as one Triton kernel forward and one backward
(rows of ``K`` / ``V`` channels per program), with :func:`fg2_gate_prep_torch` as the
reference. Shapes: k, beta_k ``[B, T, H, K]``; v, beta_v ``[B, T, H, V]`` (logits, before
the sigmoid). FG²-GDN passes ``beta_v=None`` (the key rates scale v; needs K == V).

The Triton kernels live in :mod:`mixlab.ops.fg2_gate_triton` (imported only when they run);
they have no autotuning, so they also run on CPU under ``TRITON_INTERPRET=1`` (set before
Triton is imported) for tests.
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
    from mixlab.ops.fg2_gate_triton import FG2GatePrep

    return FG2GatePrep.apply(k, v, beta_k, beta_v, float(max_rate), float(eps))
