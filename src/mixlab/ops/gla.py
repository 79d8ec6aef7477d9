"""Gated linear attention (GLA, Yang et al. 2024, arXiv 2312.06635, Eq. 3-4) and its
scalar-gate special case (simple GLA = Mamba2's SSD, Dao & Gu 2024, arXiv 2405.21060, Sec. 6).

Recurrence per head, state ``S [K, V]``::

    S_t = Diag(exp(g_t)) S_{t-1} + k_t v_t^T,    o_t = S_t^T (scale * q_t)

``g`` is the natural-log decay: ``[B, T, H, K]`` (GLA, per key channel) or ``[B, T, H]``
(simple GLA, one per head). Layout fla: q, k ``[B, T, H, K]``, v ``[B, T, H, V]``,
state ``[B, H, K, V]`` float32 (float64 for float64 inputs).

* ``*_recurrent`` - token loop (reference). * ``*_chunk`` - chunkwise torch (CPU).
* :func:`gla`, :func:`simple_gla` - dispatch (fla ``chunk_gla`` on CUDA for both: the scalar
  gate is broadcast over K, ``gk = g[..., None].expand(B, T, H, K)``, which is the same
  recurrence; fla ``chunk_simple_gla`` refuses its backward on Hopper with Triton 3.6, fla
  #640, and is reachable only by ``impl="fla_simple"``).
* :func:`mamba2_ssd_loop` - Mamba2's recurrence written out; :func:`mamba2_ssd` - the
  mapping ``simple_gla(q=C, k=B, v=dt*x, g=dt*A, scale=1)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mixlab.ops import fla

__all__ = ["gla_recurrent", "gla_chunk", "gla", "simple_gla_recurrent", "simple_gla_chunk", "simple_gla",
           "mamba2_ssd_loop", "mamba2_ssd"]


def _dt(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check(q: Tensor, k: Tensor, v: Tensor, g: Tensor, vector_gate: bool, initial_state: Tensor | None) -> None:
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"gla: q, k must be [B, T, H, K] and v [B, T, H, V]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    want = q.shape if vector_gate else q.shape[:3]
    if g.shape != want:
        raise ValueError(f"gla: g must be {list(want)} ({'per key channel' if vector_gate else 'per head'}); "
                         f"got {tuple(g.shape)}")
    if initial_state is not None and initial_state.shape != (q.shape[0], q.shape[2], q.shape[3], v.shape[3]):
        raise ValueError(f"gla: initial_state must be [B, H, K, V]; got {tuple(initial_state.shape)}")


def gla_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float | None = None,
                  initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Token loop; g ``[B, T, H, K]`` or ``[B, T, H]``. Returns ``o [B, T, H, V]`` (dtype of v), final state."""
    vector = g.dim() == 4
    _check(q, k, v, g, vector, initial_state)
    dt = _dt(q)
    b, t, h, dk = q.shape
    scale = dk ** -0.5 if scale is None else scale
    s = q.new_zeros(b, h, dk, v.shape[-1], dtype=dt) if initial_state is None else initial_state.to(dt)
    outs = []
    for i in range(t):
        decay = g[:, i].to(dt).exp()
        decay = decay.unsqueeze(-1) if vector else decay[..., None, None]
        s = decay * s + k[:, i].to(dt).unsqueeze(-1) * v[:, i].to(dt).unsqueeze(-2)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, i].to(dt) * scale, s))
    o = torch.stack(outs, 1) if outs else v.new_zeros(v.shape, dtype=dt)
    return o.to(v.dtype), s


def _chunk(z: Tensor, c: int) -> Tensor:
    """``[B, T, H, ...]`` -> ``[B, H, N, C, ...]`` zero-padded."""
    b, t, h = z.shape[:3]
    n = -(-t // c)
    pad = n * c - t
    if pad:
        z = F.pad(z, (0, 0) * (z.dim() - 2) + (0, pad))
    z = z.view(b, n, c, h, *z.shape[3:])
    return z.permute(0, 3, 1, 2, *range(4, z.dim()))


def gla_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float | None = None,
              initial_state: Tensor | None = None, chunk_size: int = 16) -> tuple[Tensor, Tensor]:
    """Chunkwise torch GLA (vector or scalar gate); differentiable by autograd.

    Inside a chunk ``A[t, i] = sum_k q_tk k_ik exp(G_tk - G_ik)`` (``i <= t``; ``G`` the
    within-chunk cumsum; the ``[C, C, K]`` decay tensor is formed explicitly, no division by
    decays), plus ``(q_t * exp(G_t)) S_start``; the state is carried across chunks.
    """
    vector = g.dim() == 4
    _check(q, k, v, g, vector, initial_state)
    dt = _dt(q)
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    c = max(1, min(chunk_size, t))
    qc, kc, vc = _chunk(q.to(dt) * scale, c), _chunk(k.to(dt), c), _chunk(v.to(dt), c)
    gc = _chunk(g.to(dt), c).cumsum(3)  # [B, H, N, C(, K)]
    n = qc.shape[2]
    tri = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    if vector:
        diff = (gc.unsqueeze(4) - gc.unsqueeze(3)).masked_fill(~tri[:, :, None], float("-inf"))  # [.., C, C, K]
        a = torch.einsum("bhntk,bhnik,bhntik->bhnti", qc, kc, diff.exp())
        q_in = qc * gc.exp()
        k_out = kc * (gc[:, :, :, -1:] - gc).exp()
        last = gc[:, :, :, -1].exp().unsqueeze(-1)  # [B, H, N, K, 1]
    else:
        diff = (gc.unsqueeze(4) - gc.unsqueeze(3)).masked_fill(~tri, float("-inf"))
        a = (qc @ kc.transpose(-1, -2)) * diff.exp()
        q_in = qc * gc.exp().unsqueeze(-1)
        k_out = kc * (gc[:, :, :, -1:] - gc).exp().unsqueeze(-1)
        last = gc[:, :, :, -1].exp()[..., None, None]
    intra = a @ vc  # [B, H, N, C, V]
    s = q.new_zeros(b, h, dk, dv, dtype=dt) if initial_state is None else initial_state.to(dt)
    outs = []
    for i in range(n):
        outs.append(intra[:, :, i] + q_in[:, :, i] @ s)
        s = last[:, :, i] * s + k_out[:, :, i].transpose(-1, -2) @ vc[:, :, i]
    o = torch.stack(outs, 2)  # [B, H, N, C, V]
    o = o.permute(0, 2, 3, 1, 4).reshape(b, n * c, h, dv)[:, :t]
    return o.to(v.dtype), s


def gla(q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float | None = None, initial_state: Tensor | None = None,
        impl: str = "auto", chunk_size: int = 16) -> tuple[Tensor, Tensor]:
    """GLA with a per-channel gate g ``[B, T, H, K]``; ``impl`` ``auto|chunk|recurrent|fla``
    (``"auto"``: fla ``chunk_gla`` for CUDA tensors that are not float64 and T > 1, else chunk).

    Returns ``o [B, T, H, V]`` and the final state ``[B, H, K, V]``.

    Raises:
        ValueError: shapes, unknown impl, fla without CUDA.
    """
    _check(q, k, v, g, True, initial_state)
    return _dispatch(q, k, v, g, scale, initial_state, impl, chunk_size, "chunk_gla")


def simple_gla(q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float | None = None,
               initial_state: Tensor | None = None, impl: str = "auto", chunk_size: int = 16) -> tuple[Tensor, Tensor]:
    """GLA with one gate per head g ``[B, T, H]`` (Mamba2 SSD, RetNet-like); as :func:`gla`.

    ``impl="fla"`` (and ``"auto"`` on CUDA) runs fla ``chunk_gla`` with the gate broadcast over
    the key dim (``Diag(exp(g_t) 1_K) = exp(g_t) I``: identical math). ``impl="fla_simple"``
    calls fla ``chunk_simple_gla`` directly; WARNING: its backward raises on Hopper GPUs with
    Triton 3.6 (fla #640; seen with fla-core 0.6.0 on the H200), so it is opt-in only.
    """
    _check(q, k, v, g, False, initial_state)
    return _dispatch(q, k, v, g, scale, initial_state, impl, chunk_size, "chunk_simple_gla")


def _require_cuda(q: Tensor, fla_name: str) -> None:
    if not q.is_cuda:
        raise ValueError(f"gla: impl='fla' (fla-core {fla_name}) needs CUDA tensors")


def _fla_gla(q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: float | None, initial_state: Tensor | None
             ) -> tuple[Tensor, Tensor]:
    """fla ``chunk_gla`` through the boundary of :mod:`mixlab.ops.fla` (fla layout ``[B, T, H, K]``).

    q, k, v go in one activation dtype (:func:`mixlab.ops.fla.prepare`), key/value dims
    below 16 zero-padded; a scalar per-head gate ``[B, T, H]`` is broadcast to ``[B, T, H, K]``
    (the simple-GLA / Mamba2 case; autograd sums dg over K), float32. ``scale=None`` ->
    ``K ** -0.5`` of the unpadded K (same as the torch paths); the initial state is passed as
    float32 ``[B, H, K, V]`` (fla asserts it). Returns ``o [B, T, H, V]`` (activation dtype)
    and the float32 final state ``[B, H, K, V]``.
    """
    chunk_gla = fla.import_op("ops.gla", "chunk_gla")

    dk, dv = q.shape[-1], v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    if g.dim() == 3:
        g = g.unsqueeze(-1).expand(*q.shape)
    q, k, v = fla.prepare(q, k, v)
    kp, vp = fla.padded_dim(dk, "gla"), fla.padded_dim(dv, "gla")
    q, k, g, v = fla.pad_last(q, kp), fla.pad_last(k, kp), fla.pad_last(g.float(), kp), fla.pad_last(v, vp)
    h0 = None if initial_state is None else F.pad(initial_state.float(), (0, vp - dv, 0, kp - dk))
    o, state = chunk_gla(q, k, v, g.contiguous(), scale=scale, initial_state=h0, output_final_state=True)
    return o[..., :dv], state[:, :, :dk, :dv]


def _dispatch(q, k, v, g, scale, initial_state, impl, chunk_size, fla_name):
    if impl == "auto":
        impl = "fla" if fla.unserved("gla", q, k, v) is None else "chunk"
    if impl == "chunk":
        return gla_chunk(q, k, v, g, scale, initial_state, chunk_size)
    if impl == "recurrent":
        return gla_recurrent(q, k, v, g, scale, initial_state)
    if impl == "fla":
        _require_cuda(q, "chunk_gla")
        return _fla_gla(q, k, v, g, scale, initial_state)
    if impl == "fla_simple" and fla_name == "chunk_simple_gla":  # opt-in: backward fails on Hopper (fla #640)
        _require_cuda(q, fla_name)
        chunk_simple_gla = fla.import_op("ops.simple_gla", "chunk_simple_gla")
        h0 = None if initial_state is None else initial_state.float()
        q, k, v = fla.prepare(q, k, v)
        return chunk_simple_gla(q, k, v, g.float().contiguous(), scale=scale, initial_state=h0,
                                output_final_state=True)
    extra = ", 'fla' or 'fla_simple'" if fla_name == "chunk_simple_gla" else " or 'fla'"
    raise ValueError(f"gla: impl must be 'auto', 'chunk', 'recurrent'{extra}; got {impl!r}")


def simple_gla_recurrent(q, k, v, g, scale=None, initial_state=None):
    """Token loop for the scalar-gate case (alias of :func:`gla_recurrent` with g ``[B, T, H]``)."""
    return gla_recurrent(q, k, v, g, scale, initial_state)


def simple_gla_chunk(q, k, v, g, scale=None, initial_state=None, chunk_size=16):
    """Chunkwise torch for the scalar-gate case (alias of :func:`gla_chunk` with g ``[B, T, H]``)."""
    return gla_chunk(q, k, v, g, scale, initial_state, chunk_size)


def mamba2_ssd_loop(x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, initial_state: Tensor | None = None
                    ) -> tuple[Tensor, Tensor]:
    """Mamba2 SSD recurrence written out (reference; Dao & Gu 2024, Eq. 1 with scalar A per head).

    ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T``, ``y_t = h_t^T C_t`` per head.

    Args:
        x: ``[B, T, H, P]``; dt: ``[B, T, H]`` (> 0, after softplus); a: ``[H]`` (< 0);
        b, c: ``[B, T, H, N]`` (groups already broadcast to heads);
        initial_state: ``[B, H, N, P]``.

    Returns:
        ``y [B, T, H, P]`` (dtype of x) and the final state ``[B, H, N, P]``.
    """
    ct = _dt(x)
    bs, t, h, p = x.shape
    s = x.new_zeros(bs, h, b.shape[-1], p, dtype=ct) if initial_state is None else initial_state.to(ct)
    ys = []
    for i in range(t):
        da = torch.exp(dt[:, i].to(ct) * a.to(ct))[..., None, None]
        s = da * s + dt[:, i].to(ct)[..., None, None] * b[:, i].to(ct).unsqueeze(-1) * x[:, i].to(ct).unsqueeze(-2)
        ys.append(torch.einsum("bhn,bhnp->bhp", c[:, i].to(ct), s))
    return torch.stack(ys, 1).to(x.dtype), s


def mamba2_ssd(x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, initial_state: Tensor | None = None,
               impl: str = "auto", chunk_size: int = 16) -> tuple[Tensor, Tensor]:
    """Mamba2 SSD through simple GLA: ``simple_gla(q=C, k=B, v=dt*x, g=dt*A, scale=1)``.

    On CUDA (``impl="auto"``/``"fla"``) this is fla ``chunk_gla`` with ``g = dt*A`` broadcast
    over the state dim N (see :func:`simple_gla`). Arguments and returns as
    :func:`mamba2_ssd_loop`."""
    v = x * dt.unsqueeze(-1).to(x.dtype)
    g = dt.float() * a.float() if x.dtype != torch.float64 else dt * a
    return simple_gla(c, b, v, g, scale=1.0, initial_state=initial_state, impl=impl, chunk_size=chunk_size)
