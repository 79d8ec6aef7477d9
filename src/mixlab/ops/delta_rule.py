"""Gated delta rule (DeltaNet, GDN, KDA, FG²-GDN, FG²-GDN+): reference recurrence, chunkwise torch path, fla dispatch.

Notation (fla layout): B batch, T tokens, H heads, K key dim, V value dim, N packed
sequences, C chunk size. State ``S [B|N, H, K, V]``, output ``o_t = S_t^T (scale * q_t)``.

Every variant is one *kernel-level* recurrence (the KDA form)::

    S'_t = Diag(exp(g_t)) S_{t-1}                                  (g = log alpha <= 0)
    S_t  = S'_t + beta_t k_t (v_t - S'_t^T k_t)^T = (I - beta_t k_t k_t^T) S'_t + beta_t k_t v_t^T

with ``g [B, T, H, K]`` (channel-wise decay, KDA) or ``[B, T, H]`` (scalar decay, GDN;
broadcast over K), ``beta [B, T, H]`` or ``None`` (= 1). The FG² variants (paper Eqs. 10-13,
arXiv 2604.19021) are mapped onto it by the square-root folding done in
:func:`gated_delta_rule`::

    FG²-GDN:   k~ = sqrt(beta) * k, v~ = sqrt(beta) * v, kernel beta = 1    (beta [.., K], K == V)
    FG²-GDN+:  k^ = sqrt(beta^k) * k, v~ = sqrt(beta^v) * v, kernel beta = 1

so that ``(I - k~ k~^T) Diag(alpha) S + k~ v~^T`` is exactly the kernel recurrence.

Three implementations with the same signature (:func:`delta_rule_recurrent`,
:func:`delta_rule_chunk`, fla's ``chunk_kda`` on CUDA), chosen by ``impl`` in
:func:`delta_rule` (``"auto"``: fla on CUDA for fp32/bf16/fp16 inputs, the chunkwise
torch path otherwise).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from mixlab.ops import fla

__all__ = [
    "delta_rule",
    "delta_rule_recurrent",
    "delta_rule_chunk",
    "gated_delta_rule",
    "fold_write_rates",
    "sqrt_sigmoid",
    "TORCH_CHUNK_SIZES",
]

#: Chunk sizes the torch chunkwise path accepts (fla's CUDA kernels use 64 only).
TORCH_CHUNK_SIZES = (8, 16, 32, 64, 128)


# ---------------------------------------------------------------------------------- checks
def _check(q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor | None,
           initial_state: Tensor | None, cu_seqlens: Tensor | None) -> None:
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"delta_rule: q and k must both be [B, T, H, K]; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    b, t, h, dk = q.shape
    if v.dim() != 4 or v.shape[:3] != (b, t, h):
        raise ValueError(f"delta_rule: v must be [B, T, H, V] = [{b}, {t}, {h}, V]; got {tuple(v.shape)}")
    if g is not None and g.shape not in ((b, t, h), (b, t, h, dk)):
        raise ValueError(f"delta_rule: g must be [B, T, H] (scalar decay) or [B, T, H, K] = {(b, t, h, dk)}; "
                         f"got {tuple(g.shape)}")
    if beta is not None and beta.shape != (b, t, h):
        raise ValueError(f"delta_rule: beta must be [B, T, H] = {(b, t, h)} (fold channel-wise rates with "
                         f"gated_delta_rule); got {tuple(beta.shape)}")
    n = b
    if cu_seqlens is not None:
        if b != 1:
            raise ValueError(f"delta_rule: cu_seqlens needs packed inputs with B=1; got B={b}")
        bounds_ok = cu_seqlens.dim() == 1 and int(cu_seqlens[0]) == 0 and int(cu_seqlens[-1]) == t
        if not bounds_ok or bool((cu_seqlens.diff() < 0).any()):
            raise ValueError(f"delta_rule: cu_seqlens must be a non-decreasing 1-D [N+1] tensor from 0 to T={t}; "
                             f"got {cu_seqlens.tolist()}")
        n = cu_seqlens.numel() - 1
    if initial_state is not None:
        if initial_state.dtype in (torch.float16, torch.bfloat16):
            raise ValueError(f"delta_rule: initial_state is {initial_state.dtype}; recurrent states must be float32 "
                             "(or float64): half-precision states overflow/NaN over long sequences (fla #1187)")
        if initial_state.shape != (n, h, dk, v.shape[-1]):
            raise ValueError(f"delta_rule: initial_state must be [N, H, K, V] = {(n, h, dk, v.shape[-1])}; "
                             f"got {tuple(initial_state.shape)}")


def _calc_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _segments(cu_seqlens: Tensor | None, t: int) -> list[tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, t)]
    c = cu_seqlens.tolist()
    return list(zip(c[:-1], c[1:]))


# ---------------------------------------------------------------------------------- reference
def delta_rule_recurrent(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None, beta: Tensor | None = None,
    scale: float | None = None, initial_state: Tensor | None = None, output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Plain token-by-token recurrence (the reference; KDA form, module docstring).

    Args:
        q, k: ``[B, T, H, K]`` (k is used as given: normalise it beforehand).
        v: ``[B, T, H, V]``.
        g: log-decay ``[B, T, H, K]`` or ``[B, T, H]`` (<= 0), or ``None`` (no decay, DeltaNet).
        beta: writing rate ``[B, T, H]`` or ``None`` (1).
        scale: multiplies q; default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` float32/float64 (N = B, or sequences in cu_seqlens).
        output_final_state: also return ``S_T [N, H, K, V]`` (float32, float64 for float64 inputs).
        cu_seqlens: ``[N+1]`` int64 boundaries of packed sequences (B must be 1).

    Returns:
        ``(o [B, T, H, V]`` in v's dtype, final state or None).

    Raises:
        ValueError: shape mismatches, half-precision states, bad cu_seqlens.
    """
    _check(q, k, v, g, beta, initial_state, cu_seqlens)
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    calc = _calc_dtype(v)
    scale = dk ** -0.5 if scale is None else scale
    qf, kf, vf = q.to(calc) * scale, k.to(calc), v.to(calc)
    gf = None if g is None else (g.to(calc) if g.dim() == 4 else g.to(calc).unsqueeze(-1).expand(b, t, h, dk))
    bf = None if beta is None else beta.to(calc)
    outs, finals = [], []
    for n, (s0, s1) in enumerate(_segments(cu_seqlens, t)):
        rows = range(b) if cu_seqlens is None else [0]
        S = torch.zeros(len(rows), h, dk, dv, dtype=calc, device=q.device)
        if initial_state is not None:
            S = S + (initial_state.to(calc) if cu_seqlens is None else initial_state[n : n + 1].to(calc))
        o = []
        for i in range(s0, s1):
            if gf is not None:
                S = S * gf[:, i].exp().unsqueeze(-1)
            err = vf[:, i] - torch.einsum("bhk,bhkv->bhv", kf[:, i], S)
            if bf is not None:
                err = err * bf[:, i].unsqueeze(-1)
            S = S + kf[:, i].unsqueeze(-1) * err.unsqueeze(-2)
            o.append(torch.einsum("bhk,bhkv->bhv", qf[:, i], S))
        outs.append(torch.stack(o, 1) if o else vf.new_zeros(len(rows), 0, h, dv))
        finals.append(S)
    o = torch.cat(outs, 1).to(v.dtype)
    return o, (torch.cat(finals, 0) if output_final_state else None)


# ---------------------------------------------------------------------------------- chunkwise
def _unit_lower_inverse(L: Tensor) -> Tensor:
    """``(I + L)^-1`` for strictly lower-triangular ``L [..., C, C]`` (C a power of two): the UT transform.

    Recursive block inversion, the blocked form of forward substitution: with
    ``I + L = [[A, 0], [L21, B]]`` the inverse is ``[[A^-1, 0], [-B^-1 L21 A^-1, B^-1]]``, built
    from 1x1 diagonal blocks up in ``log2 C`` levels of batched matmuls (every diagonal block of
    every chunk of a level in one call). Unlike a Neumann series or repeated squaring of ``L``,
    no intermediate grows beyond the inverse itself, so it stays accurate when keys inside a
    chunk are correlated and ``beta`` is up to 2 (tests/test_delta_rule.py compares it with
    ``torch.linalg.solve_triangular`` and the float64 recurrence); it is also faster on CPU than
    a batched LAPACK triangular solve of many tiny systems. Differentiable.

    Raises:
        ValueError: C is not a power of two.
    """
    C = L.shape[-1]
    if C & (C - 1):
        raise ValueError(f"_unit_lower_inverse: chunk size C={C} must be a power of two")
    blocks = torch.ones(*L.shape[:-2], C, 1, 1, dtype=L.dtype, device=L.device)  # [..., m, s, s] inverses
    s = 1
    while s < C:
        m = C // (2 * s)
        # the m diagonal blocks of size 2s of L: [..., m, 2s, 2s]
        diag = L.reshape(*L.shape[:-2], m, 2 * s, m, 2 * s).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)
        inv_a, inv_b = blocks[..., 0::2, :, :], blocks[..., 1::2, :, :]
        lower = -(inv_b @ (diag[..., s:, :s] @ inv_a))
        blocks = torch.cat([torch.cat([inv_a, torch.zeros_like(inv_a)], -1), torch.cat([lower, inv_b], -1)], -2)
        s *= 2
    return blocks.squeeze(-3)


#: Sub-block size of the channel-wise decay scores (pairwise ``[s, s, K]`` decays on the diagonal).
SUB_BLOCK = 8


def _vector_decay_scores(a: Tensor, b: Tensor, gc: Tensor) -> Tensor:
    """``M_ij = sum_k a_ik b_jk exp(Gamma_ik - Gamma_jk)`` for ``j <= i`` (0 above), ``[..., C, C]``.

    a, b, gc (in-chunk cumulative log-decay) ``[..., C, K]``. Rows are taken in sub-blocks of
    :data:`SUB_BLOCK`: keys before the block starting at ``i0`` factor through the reference
    ``Gamma_i0`` as ``(a_i e^{Gamma_i - Gamma_i0}) . (b_j e^{Gamma_i0 - Gamma_j})`` (one matmul;
    both exponents <= 0 since Gamma decreases, so it never overflows); keys inside the block
    use the explicit ``[s, s, K]`` decay tensor. Exact for any gates.
    """
    C = a.shape[-2]
    s = min(SUB_BLOCK, C)
    incl = torch.ones(s, s, dtype=torch.bool, device=a.device).tril()
    rows = []
    for i0 in range(0, C, s):
        i1 = i0 + s
        ai, gi = a[..., i0:i1, :], gc[..., i0:i1, :]
        dec = (gi.unsqueeze(-2) - gi.unsqueeze(-3)).masked_fill(~incl[..., None], float("-inf")).exp()
        parts = []
        if i0 > 0:
            ref = gi[..., :1, :]
            left = (ai * (gi - ref).exp()) @ (b[..., :i0, :] * (ref - gc[..., :i0, :]).exp()).transpose(-1, -2)
            parts.append(left)
        parts.append(torch.einsum("...ik,...ijk,...jk->...ij", ai, dec, b[..., i0:i1, :]))
        if i1 < C:
            parts.append(a.new_zeros(*a.shape[:-2], s, C - i1))
        rows.append(torch.cat(parts, -1))
    return torch.cat(rows, -2)


def _chunk_one(q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor | None,
               S: Tensor, C: int) -> tuple[Tensor, Tensor]:
    """Chunkwise WY/UT form for one batch of equal-length sequences, in the calc dtype.

    q, k ``[B, T, H, K]`` (q already scaled), v ``[B, T, H, V]``, g ``[B, T, H(, K)]`` or None,
    beta ``[B, T, H]`` or None, S ``[B, H, K, V]``. T is padded to a multiple of C with
    zero keys/values and zero log-decay (a no-op step), then cut.

    Within a chunk (positions i, j; Gamma = cumsum of g inside the chunk), the pseudo-values
    ``u_i = beta_i (v_i - S'_i^T k_i)`` solve the unit lower-triangular system
    ``(I + diag(beta) A) u = diag(beta) (v - (k * e^Gamma) S_0)`` with
    ``A_ij = k_i^T Diag(e^{Gamma_i - Gamma_j}) k_j`` (j < i): the UT transform of the WY
    representation. Then ``o_i = (q_i e^Gamma_i)^T S_0 + sum_{j<=i} q_i^T Diag(e^{Gamma_i-Gamma_j}) k_j u_j``
    and ``S_C = Diag(e^Gamma_C) S_0 + sum_j Diag(e^{Gamma_C - Gamma_j}) k_j u_j^T``. Decay
    ratios are formed as exponentials of differences (never ``e^Gamma / e^Gamma``), so
    extreme gates cannot overflow.
    """
    b, t, h, dk = k.shape
    pad = (-t) % C
    if pad:
        z = lambda x: F.pad(x, [0, 0] * (x.dim() - 2) + [0, pad])  # noqa: E731
        q, k, v = z(q), z(k), z(v)
        g = None if g is None else z(g)
        beta = None if beta is None else z(beta)
    n = (t + pad) // C
    # [B, H, n, C, d]
    ch = lambda x: x.reshape(b, n, C, h, *x.shape[3:]).transpose(1, 3).transpose(2, 3)  # noqa: E731
    qc, kc, vc = ch(q), ch(k), ch(v)
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    if g is None:
        kk = kc @ kc.transpose(-1, -2)  # [B, H, n, C, C]
        qk = qc @ kc.transpose(-1, -2)
        kd, qd, kl = kc, qc, kc  # k e^Gamma, q e^Gamma, k e^(Gamma_C - Gamma)
        last = None
    else:
        gc = ch(g).cumsum(3)  # [B, H, n, C(, K)]
        if g.dim() == 3:  # scalar decay: [C, C] decay matrix
            diff = gc.unsqueeze(-1) - gc.unsqueeze(-2)  # [B, H, n, C, C]
            dec = diff.masked_fill(~incl, float("-inf")).exp()
            kk = (kc @ kc.transpose(-1, -2)) * dec
            qk = (qc @ kc.transpose(-1, -2)) * dec
            e = gc.exp().unsqueeze(-1)
            kd, qd = kc * e, qc * e
            kl = kc * (gc[..., -1:] - gc).exp().unsqueeze(-1)
            last = gc[..., -1].exp()[..., None, None]  # [B, H, n, 1, 1]
        else:  # channel-wise decay: sub-blocked pairwise decays
            kk = _vector_decay_scores(kc, kc, gc)
            qk = _vector_decay_scores(qc, kc, gc)
            e = gc.exp()
            kd, qd = kc * e, qc * e
            kl = kc * (gc[..., -1:, :] - gc).exp()
            last = gc[..., -1, :].exp().unsqueeze(-1)  # [B, H, n, K, 1]
    A = kk.masked_fill(~strict, 0.0)
    if beta is not None:
        bc = ch(beta).unsqueeze(-1)  # [B, H, n, C, 1]
        A = A * bc
    Tinv = _unit_lower_inverse(A)  # (I + diag(beta) A)^-1, the UT transform
    rhs_w, rhs_u = (kd, vc) if beta is None else (kd * bc, vc * bc)
    w = Tinv @ rhs_w  # [B, H, n, C, K]
    U = Tinv @ rhs_u  # [B, H, n, C, V]
    qk = qk.masked_fill(~incl, 0.0)
    outs = []
    for c in range(n):
        u = U[:, :, c] - w[:, :, c] @ S
        outs.append(qd[:, :, c] @ S + qk[:, :, c] @ u)
        decayed = S if last is None else S * last[:, :, c]
        S = decayed + kl[:, :, c].transpose(-1, -2) @ u
    o = torch.stack(outs, 2)  # [B, H, n, C, V]
    o = o.transpose(2, 3).transpose(1, 3).reshape(b, n * C, h, -1)[:, :t]
    return o, S


def delta_rule_chunk(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None, beta: Tensor | None = None,
    scale: float | None = None, initial_state: Tensor | None = None, output_final_state: bool = False,
    cu_seqlens: Tensor | None = None, chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None]:
    """Chunkwise-parallel torch path (WY representation, UT transform); same contract as
    :func:`delta_rule_recurrent`, differentiable, any T (padded internally).

    Cost per chunk: ``O(C^2 K)`` for channel-wise decay (the pairwise decay tensor
    ``[C, C, K]`` is materialised for numerical safety) plus ``O(C K V)``; the state
    recurrence is a Python loop over ``T / C`` chunks.

    Args:
        chunk_size: C, one of :data:`TORCH_CHUNK_SIZES`.

    Raises:
        ValueError: unsupported chunk size; everything :func:`delta_rule_recurrent` raises.
    """
    if chunk_size not in TORCH_CHUNK_SIZES:
        raise ValueError(f"delta_rule_chunk: chunk_size={chunk_size} is not supported; choose from {TORCH_CHUNK_SIZES}")
    _check(q, k, v, g, beta, initial_state, cu_seqlens)
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    calc = _calc_dtype(v)
    scale = dk ** -0.5 if scale is None else scale
    cvt = lambda x: None if x is None else x.to(calc)  # noqa: E731
    qf, kf, vf, gf, bf = q.to(calc) * scale, cvt(k), cvt(v), cvt(g), cvt(beta)
    outs, finals = [], []
    for n, (s0, s1) in enumerate(_segments(cu_seqlens, t)):
        rows = b if cu_seqlens is None else 1
        S = torch.zeros(rows, h, dk, dv, dtype=calc, device=q.device)
        if initial_state is not None:
            S = S + (initial_state.to(calc) if cu_seqlens is None else initial_state[n : n + 1].to(calc))
        if s1 == s0:
            outs.append(vf[:, s0:s1])
            finals.append(S)
            continue
        sl = lambda x: None if x is None else x[:, s0:s1]  # noqa: E731
        o, S = _chunk_one(sl(qf), sl(kf), sl(vf), sl(gf), sl(bf), S, chunk_size)
        outs.append(o)
        finals.append(S)
    o = torch.cat(outs, 1).to(v.dtype)
    return o, (torch.cat(finals, 0) if output_final_state else None)


# ---------------------------------------------------------------------------------- CUDA
def _delta_rule_fla(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    """fla ``chunk_kda`` through the dtype/head-dim boundary of :mod:`mixlab.ops.fla`.

    q, k, v are cast to one activation dtype (bf16 under bf16 autocast, also when
    normalisation or rate folding left q/k in float32) and key/value dims below 16 are
    zero-padded; g is float32 ``[B, T, H, K]`` (scalar decay broadcast along K: GDN through KDA,
    since fla's ``chunk_gated_delta_rule`` backward refuses on Hopper with Triton < 3.7.1, fla
    #640); ``beta=None`` becomes ones in the activation dtype; the kernel's l2norm, gate and
    beta-sigmoid flags stay off (inputs are already prepared). Returns ``o [B, T, H, V]`` in
    the activation dtype and the float32 final state ``[N, H, K, V]`` or None.
    """
    chunk_kda = fla.import_op("ops.kda", "chunk_kda")

    b, t, h, dk = q.shape
    dv = v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    q, k, v = fla.prepare(q, k, v)
    if g is None:
        g = q.new_zeros(b, t, h, dk, dtype=torch.float32)
    elif g.dim() == 3:
        g = g.unsqueeze(-1).expand(b, t, h, dk)
    beta = q.new_ones(b, t, h) if beta is None else beta.to(q.dtype)
    kp, vp = fla.padded_dim(dk), fla.padded_dim(dv)
    q, k, g = fla.pad_last(q, kp), fla.pad_last(k, kp), fla.pad_last(g.float(), kp)
    v = fla.pad_last(v, vp)
    if initial_state is not None:
        initial_state = F.pad(initial_state.float(), (0, vp - dv, 0, kp - dk))
    o, state = chunk_kda(q, k, v, g.contiguous(), beta.contiguous(), scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=False,
                         cu_seqlens=None if cu_seqlens is None else cu_seqlens.long())
    return o[..., :dv], (None if state is None else state[:, :, :dk, :dv])


def delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None, beta: Tensor | None = None,
    scale: float | None = None, initial_state: Tensor | None = None, output_final_state: bool = False,
    cu_seqlens: Tensor | None = None, chunk_size: int = 64,
    impl: Literal["auto", "chunk", "recurrent", "fla"] = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Kernel-level gated delta rule with automatic dispatch (contract of :func:`delta_rule_recurrent`).

    ``impl="auto"``: fla ``chunk_kda`` where :func:`mixlab.ops.fla.unserved` allows (CUDA, not
    float64, head dims and sequence length it serves), else the torch chunkwise path (the
    recurrence for T <= 4, i.e. decoding steps). ``"fla"`` always uses fla's chunk size 64
    (``chunk_size`` applies to the torch path only, so one config serves CPU and GPU).

    Raises:
        ValueError: unknown impl, ``"fla"`` for inputs fla does not serve (CPU, float64, float32
            with head dim > 64, ...), and everything the chosen path raises.
    """
    if impl not in ("auto", "chunk", "recurrent", "fla"):
        raise ValueError(f"delta_rule: impl must be 'auto', 'chunk', 'recurrent' or 'fla'; got {impl!r}")
    if impl == "auto":  # decoding steps (T <= 4): the recurrence, no chunk padding
        impl = "fla" if fla.unserved("kda", q, k, v) is None else ("recurrent" if q.shape[1] <= 4 else "chunk")
    if impl == "fla":
        why = fla.unserved("kda", q, k, v)
        if why is not None:
            raise ValueError(f"delta_rule: impl='fla' cannot take these inputs: {why}; use impl='auto' or 'chunk'")
        _check(q, k, v, g, beta, initial_state, cu_seqlens)
        return _delta_rule_fla(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    if impl == "recurrent":
        return delta_rule_recurrent(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    return delta_rule_chunk(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size)


# ---------------------------------------------------------------------------------- variants
def sqrt_sigmoid(x: Tensor, max_rate: float = 1.0) -> Tensor:
    """``sqrt(max_rate * sigmoid(x))`` as ``exp(0.5 (log max_rate + logsigmoid(x)))`` (finite gradient everywhere)."""
    return torch.exp(0.5 * (F.logsigmoid(x) + math.log(max_rate)))


def fold_write_rates(k: Tensor, v: Tensor, beta: Tensor, beta_v: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Square-root folding of channel-wise (or separate key/value) writing rates.

    Args:
        k: normalised keys ``[B, T, H, K]``; v: ``[B, T, H, V]``.
        beta: rates in ``[0, 2)``: ``[B, T, H, K]`` (channel-wise) or ``[B, T, H]``.
        beta_v: value-side rates ``[B, T, H, V]`` / ``[B, T, H]`` (FG²-GDN+), or ``None``:
            then ``beta`` scales both sides (FG²-GDN; channel-wise needs K == V).

    Returns:
        ``(k~ = sqrt(beta) * k, v~ = sqrt(beta_v or beta) * v)``; the kernel then runs with beta = 1.

    Raises:
        ValueError: channel-wise beta with K != V and no ``beta_v``.
    """
    expand = lambda r: r if r.dim() == 4 else r.unsqueeze(-1)  # noqa: E731
    if beta_v is None:
        if beta.dim() == 4 and k.shape[-1] != v.shape[-1]:
            raise ValueError(f"FG²-GDN ties the key and value writing rates: needs d_k == d_v; got d_k={k.shape[-1]}, "
                             f"d_v={v.shape[-1]} (use separate beta_v, FG²-GDN+)")
        beta_v = beta
    return k * expand(beta).sqrt(), v * expand(beta_v).sqrt()


def gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor, beta_v: Tensor | None = None,
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    """Any member of the family from its paper-level gates (k normalised by the caller).

    ``S_t = (I - k^_t k^_t^T) Diag(alpha_t) S_{t-1} + k^_t v~_t^T`` with ``k^ = sqrt(beta) k``,
    ``v~ = sqrt(beta_v) v``; for a scalar ``beta [B, T, H]`` and no ``beta_v`` this is the
    classic ``(I - beta k k^T) Diag(alpha) S + beta k v^T`` and beta is passed to the kernel
    directly (no folding).

    Args:
        g: log alpha ``[B, T, H, K]`` / ``[B, T, H]`` / None.
        beta: ``[B, T, H]`` or ``[B, T, H, K]``; beta_v: None, ``[B, T, H]`` or ``[B, T, H, V]``.
        kwargs: forwarded to :func:`delta_rule` (scale, initial_state, output_final_state,
            cu_seqlens, chunk_size, impl).
    """
    if beta.dim() == 3 and beta_v is None:
        return delta_rule(q, k, v, g, beta, **kwargs)
    kt, vt = fold_write_rates(k, v, beta, beta_v)
    return delta_rule(q, kt, vt, g, None, **kwargs)
