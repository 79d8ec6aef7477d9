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

Implementations: :class:`GoatLanes` (torch, the reference and the CPU path) and the Triton
kernels of :mod:`mixlab.ops.goat_triton`, chosen by :func:`use_triton` (Triton is imported
only when a kernel runs).

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
from typing import Callable

import torch
from torch import Tensor

__all__ = [
    "KEY_LINEAR_BLOCK",
    "geometric_frequencies",
    "alibi_slopes",
    "fourier_angles",
    "fourier_key_lanes",
    "fourier_query_lanes",
    "key_mlp",
    "relative_logits",
    "split_key_linear",
    "abs_features",
    "param_layout",
    "use_triton",
    "packed_features",
    "triton_meta",
    "triton_lanes",
    "triton_pack_qkv",
]

KEY_LINEAR_BLOCK = 128
"""``c`` in ``j = c * j_hi + j_lo``; keeps ``lambda * j_lo`` strictly monotone in bf16."""


_ON_DEVICE: dict[tuple, Tensor] = {}


def on_device(key: tuple, make: Callable[[torch.device], Tensor], device: torch.device | str) -> Tensor:
    """A constant tensor named by ``key`` on ``device``; ``make(d)`` builds it with torch ops on device ``d``.

    On the CPU: ``make(cpu)``. On an accelerator: built on the host once per process, copied once and shared,
    since a copy from pageable host memory makes the host wait for the device, which inside every forward
    would stall the step pipeline. Under ``torch.compile``: ``make(device)`` inside the graph, built on the
    device itself (a host-to-device copy in the graph would make the host wait in every step; BENCHMARKS.md,
    sixteenth session). Callers must not write to it."""
    device = torch.device(device)
    if device.type == "cpu" or torch.compiler.is_compiling():
        return make(device)
    if (key, device) not in _ON_DEVICE:
        _ON_DEVICE[key, device] = make(torch.device("cpu")).to(device)
    return _ON_DEVICE[key, device]


def geometric_frequencies(n: int, base: float, device: torch.device | str | None = None) -> Tensor:
    """``[n]`` float64 angular frequencies ``w_r = base^(-r/(n-1))`` (radians per unit).

    ``n = 1`` gives ``[1.0]``. Same grid as the reference implementation. Computed on the host; on an
    accelerator ``device`` a shared copy made once, or computed on the device under ``torch.compile``
    (:func:`on_device`).
    """
    device = torch.device("cpu" if device is None else device)
    if device.type != "cpu":
        return on_device(("geometric_frequencies", n, float(base)), lambda d: _geometric(n, base, d), device)
    return _geometric(n, base, device)


def _geometric(n: int, base: float, device: torch.device) -> Tensor:
    if n <= 0:
        return torch.zeros(0, dtype=torch.float64, device=device)
    if n == 1:
        return torch.ones(1, dtype=torch.float64, device=device)
    r = torch.arange(n, dtype=torch.float64, device=device)
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
            large ``c`` loses phase in float32). ``GoatPrior`` passes each mode's coordinate
            scale (:attr:`mixlab.coords.Coords.scale`, 1 by default) to get ``pos_r``.
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


def fourier_key_lanes(cos: Tensor, sin: Tensor, present: Tensor) -> Tensor:
    """``k_rel(j) = [cos w_r j, sin w_r j]_r`` as ``[B, 1, T, 2R]`` (pairs interleaved per mode).

    Args:
        cos, sin, present: ``[B, T, R]`` of the key angles (:func:`fourier_angles`).
    """
    return (torch.stack([cos, sin], dim=-1) * present.unsqueeze(-1)).flatten(-2).unsqueeze(1)


def fourier_query_lanes(cos: Tensor, sin: Tensor, present: Tensor, alpha: Tensor, beta: Tensor) -> Tensor:
    """``q_rel(i)`` as ``[B, H, T, 2R]``; ``q_rel . k_rel = sum_r alpha cos(w d) + beta sin(w d)``.

    ``q_rel = [alpha cos(w i) + beta sin(w i), alpha sin(w i) - beta cos(w i)]`` (paper Eq. 17).

    Args:
        cos, sin, present: ``[B, T, R]`` of the query angles.
        alpha, beta: ``[H, R]`` signed amplitudes (paper Eq. 13).
    """
    cos, sin, present = cos.unsqueeze(1), sin.unsqueeze(1), present.unsqueeze(1)  # [B, 1, T, R]
    a, b = alpha[None, :, None, :], beta[None, :, None, :]
    return (torch.stack([a * cos + b * sin, a * sin - b * cos], dim=-1) * present.unsqueeze(-1)).flatten(-2)


def key_mlp(phi: Tensor, w1: Tensor, b1: Tensor, w2: Tensor) -> Tensor:
    """Per-head SiLU MLP ``g_h(phi) = w2_h . silu(phi W1_h + b1_h)`` -> ``[B, H, T]``.

    Args:
        phi: ``[B, T, F]`` absolute-position features (:func:`abs_features`).
        w1: ``[H, F, hidden]``; b1: ``[H, hidden]``; w2: ``[H, hidden]``.
    """
    h = torch.nn.functional.silu(phi.unsqueeze(1) @ w1.unsqueeze(0) + b1[None, :, None])  # [B, H, T, d]
    return (h @ w2[None, :, :, None]).squeeze(-1)


def relative_logits(
    pos_q: Tensor, mask_q: Tensor | None, pos_k: Tensor, mask_k: Tensor | None,
    freqs: Tensor, mode_axis: Tensor, alpha: Tensor, beta: Tensor,
) -> Tensor:
    """Explicit ``K_rel`` as ``[B, H, Tq, Tk]`` from coordinate differences (test reference).

    ``pos_q``/``pos_k`` are integer coordinates or float ones (``Coords.values()``: scaled).

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

    ``pos`` is integer, or float when the coordinates carry a scale (``Coords.values()``).

    ``v_m`` is a geometric grid from 1 to 1/10000 rad per unit; ``scale`` is a fixed
    normalising length (a config constant, never the current sequence length, so
    cached decoding and a full forward see identical features).
    """
    c = pos.to(torch.float64)
    present = torch.ones_like(c) if mask is None else mask.to(torch.float64)
    v = geometric_frequencies(n_freqs, 10000.0, c.device)
    ang = c.unsqueeze(-1) * v  # [B, T, A, M]
    feats = torch.cat([torch.sin(ang), torch.cos(ang), (c / scale).unsqueeze(-1), present.unsqueeze(-1)], dim=-1)
    feats = feats * present.unsqueeze(-1)
    return feats.flatten(-2).to(dtype)


class GoatLanes(torch.autograd.Function):
    """Build GOAT's ``2R + 2`` query/key lanes in one autograd node (analytic backward).

    Forward inputs (``B`` may be 1 and broadcast):
        cos_q, sin_q, pres_q: ``[B, Tq, R]`` query angles' cos/sin and axis presence.
        cos_k, sin_k, pres_k: ``[B, Tk, R]`` the same for keys.
        phi: ``[B, Tk, F]`` absolute features or None; j_hi, j_lo, is_bos, is_none: ``[B, Tk]``.
        alpha, beta: ``[H, R]``; slope, bos, default: ``[H]`` or None; w1 ``[H, F, d]``,
        b1 ``[H, d]``, w2 ``[H, d]`` or None (no key MLP).
        scale: ``sqrt(d_c)``; out_dtype: dtype of the returned lanes.

    Returns:
        q_lanes ``[B, H, Tq, 2R+2]`` = ``scale * [q_rel(i), lambda c, 1]`` and
        k_lanes ``[B, H, Tk, 2R+2]`` = ``[k_rel(j), j_hi, u_rest(j)]`` with
        ``u_rest = g(phi) + lambda j_lo + b 1{j=0} + default 1{no axes}``, so that
        ``q_lanes . k_lanes / scale = K_rel(i, j) + u(j)`` (paper Eqs. 17-27).

    Eagerly the same math is ~25 small autograd ops per layer, whose launch and
    bookkeeping cost dominates a short attention layer on a fast GPU; here it is one
    forward and one backward node. Gradients are checked against autograd through the
    explicit formula in tests/test_attention.py.
    """

    @staticmethod
    def forward(ctx, cos_q, sin_q, pres_q, cos_k, sin_k, pres_k, phi, j_hi, j_lo, is_bos, is_none,
                alpha, beta, slope, bos, default, w1, b1, w2, scale, out_dtype):
        with torch.autocast(cos_q.device.type, enabled=False):  # lanes are built in fp32/fp64
            return GoatLanes._forward(ctx, cos_q, sin_q, pres_q, cos_k, sin_k, pres_k, phi, j_hi, j_lo, is_bos,
                                      is_none, alpha, beta, slope, bos, default, w1, b1, w2, scale, out_dtype)

    @staticmethod
    def _forward(ctx, cos_q, sin_q, pres_q, cos_k, sin_k, pres_k, phi, j_hi, j_lo, is_bos, is_none,
                 alpha, beta, slope, bos, default, w1, b1, w2, scale, out_dtype):
        H, R = alpha.shape
        pq = pres_q.unsqueeze(1)
        cq, sq = cos_q.unsqueeze(1) * pq, sin_q.unsqueeze(1) * pq  # [B, 1, Tq, R]
        a, b = alpha[None, :, None, :], beta[None, :, None, :]
        bq, tq = cq.shape[0], cq.shape[2]
        q_l = cq.new_empty(bq, H, tq, 2 * R + 2)
        q_l[..., 0 : 2 * R : 2] = (a * cq + b * sq) * scale
        q_l[..., 1 : 2 * R : 2] = (a * sq - b * cq) * scale
        q_l[..., 2 * R] = 0.0 if slope is None else (slope * (KEY_LINEAR_BLOCK * scale))[None, :, None]
        q_l[..., 2 * R + 1] = scale

        bk, tk = cos_k.shape[0], cos_k.shape[1]
        u = cos_k.new_zeros(bk, H, tk)
        h_pre = None
        if w1 is not None:
            h_pre = phi.unsqueeze(1) @ w1.unsqueeze(0) + b1[None, :, None]  # [B, H, Tk, d]
            u = u + (torch.nn.functional.silu(h_pre) @ w2[None, :, :, None]).squeeze(-1)
        if slope is not None:
            u = u + slope[None, :, None] * j_lo.unsqueeze(1)
        if bos is not None:
            u = u + bos[None, :, None] * is_bos.unsqueeze(1)
        if default is not None:
            u = u + default[None, :, None] * is_none.unsqueeze(1)
        k_l = cos_k.new_empty(bk, H, tk, 2 * R + 2)
        k_l[..., 0 : 2 * R : 2] = (cos_k * pres_k).unsqueeze(1)
        k_l[..., 1 : 2 * R : 2] = (sin_k * pres_k).unsqueeze(1)
        k_l[..., 2 * R] = 0.0 if slope is None else j_hi.unsqueeze(1)
        k_l[..., 2 * R + 1] = u

        ctx.save_for_backward(cq, sq, pq, pres_k, phi, h_pre, j_lo, is_bos, is_none, alpha, beta, w1, w2)
        ctx.flags = (slope is not None, bos is not None, default is not None, w1 is not None)
        ctx.scale = scale
        return q_l.to(out_dtype), k_l.to(out_dtype)

    @staticmethod
    def backward(ctx, dq_l, dk_l):
        cq, sq, pq, pres_k, phi, h_pre, j_lo, is_bos, is_none, alpha, beta, w1, w2 = ctx.saved_tensors
        has_slope, has_bos, has_default, has_mlp = ctx.flags
        scale, R = ctx.scale, alpha.shape[1]
        dq_l, dk_l = dq_l.to(cq.dtype), dk_l.to(cq.dtype)
        dq0, dq1 = dq_l[..., 0 : 2 * R : 2] * scale, dq_l[..., 1 : 2 * R : 2] * scale  # [B, H, Tq, R]
        d_alpha = (dq0 * cq + dq1 * sq).sum((0, 2))
        d_beta = (dq0 * sq - dq1 * cq).sum((0, 2))
        du = dk_l[..., 2 * R + 1]  # [B, H, Tk]
        d_slope = d_bos = d_default = d_w1 = d_b1 = d_w2 = None
        if has_slope:
            d_slope = dq_l[..., 2 * R].sum((0, 2)) * (KEY_LINEAR_BLOCK * scale) + (du * j_lo.unsqueeze(1)).sum((0, 2))
        if has_bos:
            d_bos = (du * is_bos.unsqueeze(1)).sum((0, 2))
        if has_default:
            d_default = (du * is_none.unsqueeze(1)).sum((0, 2))
        if has_mlp:
            sig = torch.sigmoid(h_pre)
            act = h_pre * sig
            d_w2 = (du.unsqueeze(-2) @ act).sum(0).squeeze(-2)  # [H, d]
            dh = du.unsqueeze(-1) * w2[None, :, None, :] * (sig * (1 + h_pre * (1 - sig)))
            d_w1 = (phi.transpose(-1, -2).unsqueeze(1) @ dh).sum(0)  # [H, F, d]
            d_b1 = dh.sum((0, 2))
        d_cos_q = d_sin_q = d_cos_k = d_sin_k = None
        need = ctx.needs_input_grad
        if need[0] or need[1]:
            a, b = alpha[None, :, None, :], beta[None, :, None, :]
            d_cos_q = ((dq0 * a - dq1 * b) * pq).sum(1)
            d_sin_q = ((dq0 * b + dq1 * a) * pq).sum(1)
        if need[3] or need[4]:
            d_cos_k = (dk_l[..., 0 : 2 * R : 2].sum(1) * pres_k)
            d_sin_k = (dk_l[..., 1 : 2 * R : 2].sum(1) * pres_k)
        return (d_cos_q, d_sin_q, None, d_cos_k, d_sin_k, None, None, None, None, None, None,
                d_alpha, d_beta, d_slope, d_bos, d_default, d_w1, d_b1, d_w2, None, None)


def param_layout(n_heads: int, n_modes: int, n_feat: int, hidden: int, *, slope: bool, bos: bool,
                 default: bool) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Layout of the prior's parameters in one flat vector: ``name -> (offset, shape)`` in the
    order ``alpha [H, R] | beta [H, R] | slope [H] | bos [H] | default [H] | mlp_b1 [H, D] |
    mlp_w2 [H, D] | mlp_w1 [H, F, D]``; absent terms (flag False, or ``hidden = 0`` for the
    key MLP) take no space. Used by ``GoatPrior.prior`` and the Triton lane kernels."""
    H, R, F, D = n_heads, n_modes, n_feat, hidden
    shapes = {"alpha": (H, R), "beta": (H, R), "slope": (H,) if slope else None, "bos": (H,) if bos else None,
              "default": (H,) if default else None, "mlp_b1": (H, D) if D > 0 else None,
              "mlp_w2": (H, D) if D > 0 else None, "mlp_w1": (H, F, D) if D > 0 else None}
    layout, offset = {}, 0
    for name, shape in shapes.items():
        if shape is not None:
            layout[name] = (offset, shape)
            offset += math.prod(shape)
    return layout


# ---------------------------------------------------------------------- dispatch: torch lanes or Triton kernels
def use_triton(impl: str, present: Tensor, calc: torch.dtype, learned_freqs: bool, compiled_ok: bool = False) -> bool:
    """Whether the lanes go through the Triton kernels.

    Forced by ``impl="triton"``; with ``impl="auto"``: CUDA tensors (``present`` is any feature
    tensor of the coordinates), fp32 lane math (``calc``) and fixed frequencies (learned
    frequencies need gradients into cos/sin), and outside ``torch.compile`` unless the caller has
    a compile-safe path (``compiled_ok``: :func:`triton_pack_qkv`'s custom op); otherwise
    ``torch.compile`` compiles the torch lanes. ``"torch"``, ``"where"`` and ``"scatter"``: never.

    Raises:
        ValueError: ``impl="triton"`` with learned frequencies.
    """
    if impl == "triton":
        if learned_freqs:
            raise ValueError("GOAT lane_impl='triton' does not support learned_freqs=True; use 'auto' or 'torch'")
        return True
    return (impl == "auto" and present.is_cuda and calc == torch.float32 and not learned_freqs
            and (compiled_ok or not torch.compiler.is_compiling()))


def packed_features(f: dict[str, Tensor]) -> Tensor:
    """``[B|1, T, NF]`` float32 features of the Triton kernels from a feature dict (``cos``, ``sin``,
    ``present``, ``phi``, ``j_hi``, ``j_lo``, ``is_bos``, ``is_none``), cached in it under ``"packed"``."""
    if "packed" not in f:
        from mixlab.ops.goat_triton import pack_features

        f["packed"] = pack_features(f["cos"], f["sin"], f["present"], f.get("phi"), f["j_hi"], f["j_lo"],
                                    f["is_bos"], f["is_none"])
    return f["packed"]


def triton_meta(n_heads: int, n_modes: int, n_feat: int, hidden: int, scale: float, *, slope: bool, bos: bool,
                default: bool) -> dict:
    """Compile-time constants of the Triton kernels (:func:`mixlab.ops.goat_triton.kernel_meta`)."""
    from mixlab.ops.goat_triton import kernel_meta

    return kernel_meta(n_heads, n_modes, n_feat, hidden, scale, slope=slope, bos=bos, default=default)


def triton_lanes(feat_q: Tensor, feat_k: Tensor, params: Tensor, meta: dict,
                 dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Lanes ``(q [Bq, H, Tq, L], k [Bk, H, Tk, L])`` in ``dtype`` by the Triton kernels
    (:class:`~mixlab.ops.goat_triton.GoatLanesTriton`); ``feat_*`` from :func:`packed_features`,
    ``params`` the flat float32 prior vector (layout :func:`param_layout`)."""
    from mixlab.ops.goat_triton import GoatLanesTriton

    return GoatLanesTriton.apply(feat_q, feat_k, params, meta, feat_q.shape[0], feat_k.shape[0], dtype)


def triton_pack_qkv(qkv: Tensor, feat: Tensor, params: Tensor, meta: dict, batch: int,
                    head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Write the lanes into the packed projection ``qkv [B * T, 3 * H * d_h]`` in place and return
    ``q, k, v [B, H, T, d_h]`` as views of it (:class:`~mixlab.ops.goat_triton.GoatQKV`).

    Under ``torch.compile`` the same kernel runs as the operator ``mixlab::goat_lanes_into`` inside
    :class:`~mixlab.ops.goat_triton.GoatLanesInto` (Inductor launches it and writes into the projection's
    buffer: no copy); ``mixlab::goat_lanes_backward`` reads the lane entries of ``d qkv`` into the parameter
    gradient and zeroes them in place (the projection gets no gradient under the lanes)."""
    from mixlab.ops.goat_triton import GoatLanesInto, GoatQKV, meta_key

    if torch.compiler.is_compiling():
        T = feat.shape[1]
        qkv = GoatLanesInto.apply(qkv, feat, params, meta_key(meta), batch, head_dim)
        return qkv.view(batch, T, 3, meta["H"], head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    return GoatQKV.apply(qkv, feat, params, meta, batch, head_dim)
