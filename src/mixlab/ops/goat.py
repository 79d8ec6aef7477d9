"""GOAT log-prior math as pure functions (Litman & Guo, arXiv 2601.15380, Sec. 4).

Logit of query i, key j, head h (paper Eq. 11-22)::

    z_ij = q_c,i . k_c,j / sqrt(d_c) + K_rel(i - j) + u_h(j)
    K_rel(d) = sum_a sum_{r in axis a} alpha_hr cos(w_r d_a) + beta_hr sin(w_r d_a)
    u_h(j)   = lambda_h * j + g_h(phi_abs(j)) + b_h * 1{j = 0}

Lane packing (paper Eqs. 23-27): with ``d_p = 2R + 2`` positional lanes inside the
head dim ``d_h`` and ``d_c = d_h - d_p`` content dims::

    q' = [sqrt(d_h/d_c) q_c ; sqrt(d_h) q_rel(i) ; sqrt(d_h) lambda c ; sqrt(d_h)]
    k' = [k_c               ; k_rel(j)           ; j_hi              ; u_rest(j)]

so that ``q'.k' / sqrt(d_h) = z_ij`` and ONE standard SDPA call is exact.

Two-lane key-linear term (the fix for the bf16 "staircase", ../shared/design/goat.md):
``j = c * j_hi + j_lo`` with ``c = 128``. Lane ``d_p - 2`` carries ``j_hi`` (a small
integer, exact in bf16 up to 256, i.e. j < 32768), its query ``sqrt(d_h) lambda c``; lane
``d_p - 1`` carries ``lambda j_lo + g(phi(j)) + b 1{j=0}`` against a constant query
``sqrt(d_h)``. Every product is exact in the kernel's fp32 accumulator, so the recency
prior stays strictly monotone in j instead of sharing one bf16 value per 8-64 keys.
The paper's own layout uses the second spare lane as zero padding ("alignment lane").
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "KEY_LINEAR_BLOCK",
    "geometric_frequencies",
    "alibi_slopes",
    "fourier_angles",
    "fourier_key_lanes",
    "fourier_query_lanes",
    "relative_logits",
    "split_key_linear",
    "abs_features",
]

KEY_LINEAR_BLOCK = 128
"""``c`` in ``j = c * j_hi + j_lo``; keeps ``lambda * j_lo`` strictly monotone in bf16."""


def geometric_frequencies(n: int, base: float) -> Tensor:
    """``[n]`` float64 angular frequencies ``w_r = base^(-r/(n-1))`` (radians per unit).

    ``n = 1`` gives ``[1.0]``. Same grid as the reference implementation.
    """
    if n <= 0:
        return torch.zeros(0, dtype=torch.float64)
    if n == 1:
        return torch.ones(1, dtype=torch.float64)
    r = torch.arange(n, dtype=torch.float64)
    return base ** (-r / (n - 1))


def alibi_slopes(n_heads: int) -> Tensor:
    """``[H]`` float64 ALiBi slopes ``m_h`` (Press et al. 2022), geometric from 2^(-8/H)."""

    def pow2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n_heads).is_integer():
        s = pow2(n_heads)
    else:
        closest = 2 ** math.floor(math.log2(n_heads))
        s = pow2(closest) + pow2(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(s, dtype=torch.float64)


def fourier_angles(pos: Tensor, mask: Tensor | None, freqs: Tensor, mode_axis: Tensor) -> tuple[Tensor, Tensor]:
    """Angles ``w_r * c_{a(r)}`` and the per-mode presence mask.

    Args:
        pos: ``[B, T, A]`` int64 coordinates.
        mask: ``[B, T, A]`` bool or ``None``.
        freqs: ``[R]`` float angular frequencies (float64 recommended: ``w * c`` for
            large ``c`` loses phase in float32).
        mode_axis: ``[R]`` int64, the axis each mode reads.

    Returns:
        angles ``[B, T, R]`` (dtype of ``freqs``) and present ``[B, T, R]`` (same dtype, 0/1).
    """
    c = pos.to(freqs.dtype).index_select(-1, mode_axis)  # [B, T, R]
    if mask is None:
        present = torch.ones_like(c)
    else:
        present = mask.index_select(-1, mode_axis).to(freqs.dtype)
    return c * freqs, present


def fourier_key_lanes(angles: Tensor, present: Tensor) -> Tensor:
    """``k_rel(j) = [cos w_r j, sin w_r j]_r`` as ``[B, T, 2R]`` (pairs interleaved per mode)."""
    lanes = torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1) * present.unsqueeze(-1)
    return lanes.flatten(-2)


def fourier_query_lanes(angles: Tensor, present: Tensor, alpha: Tensor, beta: Tensor) -> Tensor:
    """``q_rel(i)`` as ``[B, H, T, 2R]``; ``q_rel . k_rel = sum_r alpha cos(w d) + beta sin(w d)``.

    Args:
        angles, present: ``[B, T, R]`` from :func:`fourier_angles`.
        alpha, beta: ``[H, R]`` signed amplitudes (paper Eq. 13).
    """
    cos, sin = torch.cos(angles).unsqueeze(1), torch.sin(angles).unsqueeze(1)  # [B, 1, T, R]
    a, b = alpha[None, :, None, :].to(cos.dtype), beta[None, :, None, :].to(cos.dtype)
    q0 = a * cos + b * sin
    q1 = a * sin - b * cos
    lanes = torch.stack([q0, q1], dim=-1) * present.unsqueeze(1).unsqueeze(-1)
    return lanes.flatten(-2)


def relative_logits(
    pos_q: Tensor, mask_q: Tensor | None, pos_k: Tensor, mask_k: Tensor | None,
    freqs: Tensor, mode_axis: Tensor, alpha: Tensor, beta: Tensor,
) -> Tensor:
    """Explicit ``K_rel`` as ``[B, H, Tq, Tk]`` from coordinate differences (test reference).

    ``K_rel(i, j) = sum_r m_a(i) m_a(j) [alpha_hr cos(w_r (c_ia - c_ja)) + beta_hr sin(...)]``
    where ``a = mode_axis[r]`` and ``m`` is the axis presence mask.
    """
    dt = freqs.dtype
    cq = pos_q.to(dt).index_select(-1, mode_axis)  # [B, Tq, R]
    ck = pos_k.to(dt).index_select(-1, mode_axis)
    mq = torch.ones_like(cq) if mask_q is None else mask_q.index_select(-1, mode_axis).to(dt)
    mk = torch.ones_like(ck) if mask_k is None else mask_k.index_select(-1, mode_axis).to(dt)
    d = cq[:, :, None, :] - ck[:, None, :, :]  # [B, Tq, Tk, R]
    m = mq[:, :, None, :] * mk[:, None, :, :]
    ang = d * freqs
    cos, sin = torch.cos(ang) * m, torch.sin(ang) * m
    return torch.einsum("bqkr,hr->bhqk", cos, alpha.to(dt)) + torch.einsum("bqkr,hr->bhqk", sin, beta.to(dt))


def split_key_linear(j: Tensor, block: int = KEY_LINEAR_BLOCK) -> tuple[Tensor, Tensor]:
    """``j = block * j_hi + j_lo`` with ``0 <= j_lo < block`` (integer tensors in, same out)."""
    j_hi = torch.div(j, block, rounding_mode="floor")
    return j_hi, j - block * j_hi


def abs_features(pos: Tensor, mask: Tensor | None, n_freqs: int, scale: float, dtype: torch.dtype) -> Tensor:
    """``phi_abs(c)``: per axis ``[sin(c v_m), cos(c v_m)]_m, c/scale, present`` -> ``[B, T, A*(2M+2)]``.

    ``v_m`` is a geometric grid from 1 to 1/10000 rad per unit; ``scale`` is a fixed
    normalising length (a config constant, never the current sequence length, so
    cached decoding and a full forward see identical features).
    """
    c = pos.to(torch.float64)
    present = torch.ones_like(c) if mask is None else mask.to(torch.float64)
    v = geometric_frequencies(n_freqs, 10000.0).to(c.device)
    ang = c.unsqueeze(-1) * v  # [B, T, A, M]
    feats = torch.cat([torch.sin(ang), torch.cos(ang), (c / scale).unsqueeze(-1), present.unsqueeze(-1)], dim=-1)
    feats = feats * present.unsqueeze(-1)
    return feats.flatten(-2).to(dtype)
