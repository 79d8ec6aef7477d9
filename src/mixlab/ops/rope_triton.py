"""Triton kernels of RoPE on the packed projection: rotate q and k in place, one pass back.

Same math as :func:`mixlab.mixers.positions._rope_rotate` (GPT-NeoX half rotation per axis block:
in block ``a`` of ``d_a = d_h / A`` dims, the pair ``(x_i, x_{i + d_a/2})`` rotates by the angle
``theta_{a, i}(t)``), applied the way :class:`mixlab.ops.goat_triton.GoatQKV` writes GOAT's lanes:

* forward: ONE kernel rotates the q and k heads of the attention layer's packed projection output
  ``qkv [B * T, 3 * H * d_h]`` in place (fp32 math, stored in ``qkv``'s dtype) and ``q, k, v
  [B, H, T, d_h]`` are strided views of it: no new q/k tensors, nothing saved but the cos/sin table;
* backward: ONE kernel builds ``d qkv`` as contiguous rows from ``dq, dk, dv`` (any strides, unit
  last stride), rotating ``dq``/``dk`` back by ``-theta``; it replaces the rotation's backward and the
  copies autograd makes to undo ``view -> permute -> unbind``;
* under ``torch.compile`` (:class:`RopeQKVInto`): the forward kernel as the ``triton_op``
  ``mixlab::rope_rotate``, in place forward, and in place on ``d qkv`` (by ``-theta``) backward.

The plain path rotates q and k into new tensors (a compiled elementwise kernel each way per tensor)
after :class:`~mixlab.ops.goat_triton.QKVSplit`; issue 17 measured that RoPE layer at 1.50x a plain
layer. Selected by ``position_args: {rotary_impl: triton}`` (``auto``: on CUDA); tests run the
kernels on CPU under ``TRITON_INTERPRET=1`` against the torch rotation.
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

from mixlab.ops.compile import kernel_op, traced_launch

__all__ = ["RopeQKV", "RopeQKVInto", "rope_rotate", "pack_rope"]

_BLOCK_T = 16


@triton.jit
def _pairs(j, HALF: tl.constexpr):
    """Flat pair index ``j = a * HALF + i`` -> the two head dims it rotates (``a * 2 HALF + i``, ``+ HALF``)."""
    p1 = (j // HALF) * (2 * HALF) + j % HALF
    return p1, p1 + HALF


@triton.jit(do_not_specialize=["N", "T"])
def _rope_fwd(qkv, cos, sin, N, T, H: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr, NJ: tl.constexpr,
              JP: tl.constexpr, BATCHED: tl.constexpr, BLOCK_T: tl.constexpr, INVERSE: tl.constexpr):
    """Program (row block, head): rotate that head's q and k in rows ``r = b T + t`` of ``qkv [N, 3 H HD]``
    in place by ``cos/sin [B|1, T, NJ]`` (NJ = HD / 2 pairs); ``INVERSE``: by ``-theta`` (the backward)."""
    rb = tl.program_id(0)
    h = tl.program_id(1)
    r = (rb * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    j = tl.arange(0, JP)
    m = (r < N)[:, None] & (j < NJ)[None, :]
    crow = r if BATCHED else r % T
    c = tl.load(cos + crow[:, None] * NJ + j[None, :], mask=m, other=1.0)
    s = tl.load(sin + crow[:, None] * NJ + j[None, :], mask=m, other=0.0)
    if INVERSE:
        s = -s
    p1, p2 = _pairs(j, HALF)
    for part in range(2):  # q, then k
        base = (qkv + r * (3 * H * HD) + part * H * HD + h * HD)[:, None]
        x1 = tl.load(base + p1[None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(base + p2[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(base + p1[None, :], (x1 * c - x2 * s).to(qkv.dtype.element_ty), mask=m)
        tl.store(base + p2[None, :], (x2 * c + x1 * s).to(qkv.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["N", "T", "sqb", "sqh", "sqt", "skb", "skh", "skt", "svb", "svh", "svt"])
def _rope_bwd(dq, dk, dv, out, cos, sin, N, T, sqb, sqh, sqt, skb, skh, skt, svb, svh, svt,
              H: tl.constexpr, HD: tl.constexpr, HDP: tl.constexpr, HALF: tl.constexpr, NJ: tl.constexpr,
              JP: tl.constexpr, BATCHED: tl.constexpr, BLOCK_T: tl.constexpr):
    """Program (row block, head): ``out [N, 3 H HD]`` rows of that head = ``(R(-theta) dq, R(-theta) dk, dv)``."""
    rb = tl.program_id(0)
    h = tl.program_id(1)
    r = (rb * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    b, t = r // T, r % T
    j = tl.arange(0, JP)
    rm = r < N
    m = rm[:, None] & (j < NJ)[None, :]
    crow = r if BATCHED else t
    c = tl.load(cos + crow[:, None] * NJ + j[None, :], mask=m, other=1.0)
    s = tl.load(sin + crow[:, None] * NJ + j[None, :], mask=m, other=0.0)
    p1, p2 = _pairs(j, HALF)
    o = (out + r * (3 * H * HD) + h * HD)[:, None]
    for part in range(2):
        if part == 0:
            src = (dq + b * sqb + h * sqh + t * sqt)[:, None]
        else:
            src = (dk + b * skb + h * skh + t * skt)[:, None]
        g1 = tl.load(src + p1[None, :], mask=m, other=0.0).to(tl.float32)
        g2 = tl.load(src + p2[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(o + part * H * HD + p1[None, :], (g1 * c + g2 * s).to(out.dtype.element_ty), mask=m)
        tl.store(o + part * H * HD + p2[None, :], (g2 * c - g1 * s).to(out.dtype.element_ty), mask=m)
    d = tl.arange(0, HDP)
    mv = rm[:, None] & (d < HD)[None, :]
    pv = (dv + b * svb + h * svh + t * svt)[:, None] + d[None, :]
    tl.store(o + 2 * H * HD + d[None, :], tl.load(pv, mask=mv, other=0.0), mask=mv)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


class RopeQKV(torch.autograd.Function):
    """Packed projection output -> RoPE-rotated SDPA inputs, rotated in place.

    ``qkv [B * T, 3 * H * d_h]`` (per token ``[q | k | v]``, each ``[H, d_h]``; the projection's own
    output, used by nothing else: its q and k entries are overwritten, exact because a linear layer does
    not save its output) -> ``q, k, v [B, H, T, d_h]``, strided views of it with q and k rotated.
    ``cos, sin``: float32 ``[B|1, T, d_h / 2]`` (the scheme's angles, axis blocks flattened);
    ``axes``: number of axis blocks ``A`` (``d_h / A`` dims each).

    Raises:
        ValueError: ``qkv`` not a contiguous ``[B*T, 3*H*d_h]`` matrix, a leaf that requires grad,
            cos/sin of the wrong shape, or ``d_h`` not divisible into ``2 A`` parts.
    """

    @staticmethod
    def forward(ctx, qkv, cos, sin, batch, n_heads, head_dim, axes):
        H, HD = n_heads, head_dim
        T = cos.shape[1]
        if qkv.dim() != 2 or not qkv.is_contiguous() or qkv.shape != (batch * T, 3 * H * HD):
            raise ValueError(f"RopeQKV: qkv must be a contiguous [B*T, 3*H*d_h] = [{batch}*{T}, {3 * H * HD}] "
                             f"matrix; got shape {tuple(qkv.shape)}, strides {qkv.stride()}")
        if qkv.is_leaf and qkv.requires_grad:
            raise ValueError("RopeQKV: qkv must be a projection output, not a leaf tensor that requires grad")
        if HD % (2 * axes) or cos.shape != sin.shape or cos.shape[0] not in (1, batch) or cos.shape[2] != HD // 2:
            raise ValueError(f"RopeQKV: cos/sin must be [1|{batch}, {T}, {HD // 2}] for head_dim {HD} and {axes} "
                             f"axes; got {tuple(cos.shape)}")
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        _rotate(qkv, cos, sin, H, HD, axes)
        ctx.save_for_backward(cos, sin)
        ctx.args = (batch, H, HD, axes)
        return qkv.view(batch, T, 3, H, HD).permute(2, 0, 3, 1, 4).unbind(0)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        return _rotate_back(dq, dk, dv, cos, sin, *ctx.args), None, None, None, None, None, None


def _meta(H: int, HD: int, axes: int, batched: bool) -> dict:
    return dict(H=H, HD=HD, HALF=HD // (2 * axes), NJ=HD // 2, JP=_pow2(HD // 2), BATCHED=batched, BLOCK_T=_BLOCK_T)


def _rotate(qkv: Tensor, cos: Tensor, sin: Tensor, H: int, HD: int, axes: int, inverse: bool = False,
            launch: Callable | None = None) -> None:
    """Rotate the q and k heads of the contiguous ``qkv [B * T, 3 H HD]`` (or ``[B, T, 3, H, HD]``) in place by
    ``theta`` (``inverse``: by ``-theta``), one kernel; ``cos, sin`` float32 contiguous ``[B|1, T, HD / 2]``.
    ``launch``: None (a direct call) or :func:`mixlab.ops.compile.traced_launch` inside a traced op."""
    N, T = qkv.numel() // (3 * H * HD), cos.shape[1]
    grid, kw = (triton.cdiv(N, _BLOCK_T), H), dict(_meta(H, HD, axes, cos.shape[0] > 1), INVERSE=inverse)
    if launch is None:
        _rope_fwd[grid](qkv, cos, sin, N, T, **kw)
    else:
        launch(_rope_fwd, grid, (qkv, cos, sin, N, T), kw)


def _rotate_back(dq: Tensor, dk: Tensor, dv: Tensor, cos: Tensor, sin: Tensor, batch: int, H: int, HD: int,
                 axes: int) -> Tensor:
    """``d qkv [B * T, 3 H HD]`` (contiguous, new) from ``dq, dk, dv [B, H, T, HD]`` (any strides): dq and dk
    rotated back by ``-theta`` (one kernel)."""
    dq, dk, dv = (x if x.stride(-1) == 1 else x.contiguous() for x in (dq, dk, dv))
    T = cos.shape[1]
    N = batch * T
    out = torch.empty(N, 3 * H * HD, device=dq.device, dtype=dq.dtype)
    _rope_bwd[(triton.cdiv(N, _BLOCK_T), H)](dq, dk, dv, out, cos, sin, N, T, *dq.stride()[:3], *dk.stride()[:3],
                                              *dv.stride()[:3], HDP=_pow2(HD), **_meta(H, HD, axes, cos.shape[0] > 1))
    return out


def _rope_rotate_fake(qkv, cos, sin, n_heads, head_dim, axes, inverse):
    return None


@kernel_op("mixlab::rope_rotate", _rope_rotate_fake, mutates=("qkv",))
def rope_rotate(qkv: Tensor, cos: Tensor, sin: Tensor, n_heads: int, head_dim: int, axes: int, inverse: bool) -> None:
    """Rotate q and k of the packed ``qkv [B * T, 3 * H * d_h]`` (or ``[B, T, 3, H, d_h]``, contiguous) in place by
    ``theta`` (``inverse``: by ``-theta``, the rotation's backward): :func:`_rope_fwd` as a
    ``torch.library.triton_op`` for ``torch.compile`` (Inductor launches it and writes into the buffer it is
    given: no copy). ``cos, sin`` float32 contiguous ``[B|1, T, d_h / 2]``. Differentiable through
    :class:`RopeQKVInto`."""
    _rotate(qkv, cos, sin, n_heads, head_dim, axes, inverse, launch=traced_launch)


class RopeQKVInto(torch.autograd.Function):
    """:class:`RopeQKV` for ``torch.compile``: ``qkv [B * T, 3 * H * d_h]`` (the projection's own output) with q
    and k rotated in place by the kernel op :func:`rope_rotate` (marked dirty, so autograd knows), returned for the
    caller's ``view -> permute -> unbind``. Backward: the same op rotates the q and k entries of ``d qkv``
    (assembled by Inductor from ``dq, dk, dv``) back by ``-theta`` in place. Arguments: ``qkv``, ``cos``, ``sin``
    (float32 contiguous ``[B|1, T, d_h / 2]``), ``batch``, ``n_heads``, ``head_dim``, ``axes``."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, batch, n_heads, head_dim, axes):
        rope_rotate(qkv, cos, sin, n_heads, head_dim, axes, False)
        ctx.mark_dirty(qkv)
        ctx.save_for_backward(cos, sin)
        ctx.args = (batch, n_heads, head_dim, axes)
        return qkv

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        batch, H, d_h, axes = ctx.args
        # the [B, T, 3, H, d_h] buffer Inductor assembles from dq, dk, dv (see GoatLanesInto.backward)
        g = grad.contiguous().view(batch, cos.shape[1], 3, H, d_h)
        rope_rotate(g, cos, sin, H, d_h, axes, True)
        return g.view(grad.shape), None, None, None, None, None, None


def pack_rope(qkv: Tensor, cos: Tensor, sin: Tensor, batch: int, n_heads: int, head_dim: int,
              axes: int) -> tuple[Tensor, Tensor, Tensor]:
    """``q, k, v [B, H, T, d_h]`` of the packed projection ``qkv [B * T, 3 * H * d_h]`` with q and k rotated by
    the Triton kernels, in place: :class:`RopeQKV` eagerly; under ``torch.compile``, :class:`RopeQKVInto` (the
    kernel op :func:`rope_rotate`). ``cos, sin``: ``[B|1, T, d_h / 2]`` (the GPT-NeoX half rotation of RoPE,
    Su et al. 2021, per axis block; see the module docstring).

    Raises:
        ValueError: ``qkv`` not ``[B*T, 3*H*d_h]`` (and, eagerly, the other checks of :class:`RopeQKV`)."""
    if torch.compiler.is_compiling():
        if qkv.dim() != 2 or qkv.shape[1] != 3 * n_heads * head_dim:
            raise ValueError(f"pack_rope: qkv must be [B*T, {3 * n_heads * head_dim}]; got {tuple(qkv.shape)}")
        qkv = RopeQKVInto.apply(qkv, cos.float().contiguous(), sin.float().contiguous(), batch, n_heads, head_dim,
                                axes)
        return qkv.view(batch, cos.shape[1], 3, n_heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    return RopeQKV.apply(qkv, cos, sin, batch, n_heads, head_dim, axes)
