"""Elementwise gated linear recurrence ``h_t = exp(g_t) * h_{t-1} + x_t`` (HGRN form).

Used by Hawk's RG-LRU (Griffin, De et al. 2024, arXiv 2402.19427, Sec. 2.4), which maps
onto it exactly with ``g_t = log a_t`` and ``x_t = sqrt(1 - a_t^2) * (i_t * x_t)``.

Layout: x, g ``[B, T, D]`` (g = natural-log decay ``<= 0``), state ``[B, D]``.

* :func:`linear_scan_loop` - token loop (reference).
* :func:`linear_scan_chunk` - hierarchical chunked torch scan (every device, the default):
  a C-step scan inside all chunks at once, then the same scan over the chunk-end states
  (recursively, ``ceil(log_C T)`` levels), so the Python work is ``O(C log_C T)`` steps and
  never a loop over T; differentiable by autograd, memory ``O(B T D)``.
* :func:`linear_scan` - dispatch; ``"auto"`` is the chunked torch scan on every device.
  fla-core ``chunk_hgrn`` (``impl="fla"``) is opt-in only: it FAILED the device check on
  fla-core 0.6.0 + Triton 3.6 (H200; see :func:`linear_scan`).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["linear_scan_loop", "linear_scan_chunk", "linear_scan"]


def _check(x: Tensor, g: Tensor, initial_state: Tensor | None) -> None:
    if x.dim() != 3 or g.shape != x.shape:
        raise ValueError(f"linear_scan: x and g must both be [B, T, D]; got {tuple(x.shape)} and {tuple(g.shape)}")
    if initial_state is not None and initial_state.shape != (x.shape[0], x.shape[2]):
        raise ValueError(f"linear_scan: initial_state must be [B, D]; got {tuple(initial_state.shape)}")


def linear_scan_loop(x: Tensor, g: Tensor, initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Reference loop. Returns ``h [B, T, D]`` (dtype of x) and the final state ``[B, D]`` (float32/64)."""
    _check(x, g, initial_state)
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = x.new_zeros(x.shape[0], x.shape[2], dtype=dt) if initial_state is None else initial_state.to(dt)
    out = []
    for t in range(x.shape[1]):
        h = g[:, t].to(dt).exp() * h + x[:, t].to(dt)
        out.append(h)
    return torch.stack(out, 1).to(x.dtype) if out else x.clone(), h


def _scan_levels(x: Tensor, g: Tensor, h0: Tensor | None, c: int) -> tuple[Tensor, Tensor]:
    """Chunked scan on ``[B, T, D]`` (compute dtype); ``h0 [B, D]`` or None. Returns all states, final state."""
    b, t, d = x.shape
    if t <= c:  # base level: at most c steps
        h = x.new_zeros(b, d) if h0 is None else h0
        hs = []
        for i in range(t):
            h = g[:, i].exp() * h + x[:, i]
            hs.append(h)
        return torch.stack(hs, 1), h
    n = -(-t // c)
    pad = n * c - t  # padding has g = 0, x = 0: the state passes through unchanged
    xc = F.pad(x, (0, 0, 0, pad)).view(b, n, c, d)
    gc = F.pad(g, (0, 0, 0, pad)).view(b, n, c, d)
    # 1. scan inside every chunk at once, from a zero state (c steps over [B, N, D] slices)
    h = xc[:, :, 0]
    hs = [h]
    for i in range(1, c):
        h = gc[:, :, i].exp() * h + xc[:, :, i]
        hs.append(h)
    local = torch.stack(hs, 2)  # [B, N, C, D]
    gcum = gc.cumsum(2)  # within-chunk log decay from the chunk start (<= 0)
    # 2. states at chunk ends: S_j = exp(sum_chunk g) S_{j-1} + local_end_j, the same scan over N
    ends, h_final = _scan_levels(local[:, :, -1], gcum[:, :, -1], h0, c)
    start = torch.cat([(x.new_zeros(b, 1, d) if h0 is None else h0.unsqueeze(1)), ends[:, :-1]], 1)  # [B, N, D]
    # 3. h_t = local_t + exp(G_t) * S_start  (G_t = decay from the chunk start to t)
    y = local + gcum.exp() * start.unsqueeze(2)
    return y.reshape(b, n * c, d)[:, :t], h_final


def linear_scan_chunk(x: Tensor, g: Tensor, initial_state: Tensor | None = None, chunk_size: int = 16
                      ) -> tuple[Tensor, Tensor]:
    """Hierarchical chunked scan (any device; float32 compute, float64 for float64 inputs).

    Level 1 runs the recurrence for the C positions of all chunks at once from a zero state
    (``local``); the chunk-end states obey the same recurrence with the chunk's summed decay,
    ``S_j = exp(sum_{i in j} g_i) S_{j-1} + local_{j,end}``, solved by recursing on length
    ``ceil(T / C)``; then ``h_t = local_t + exp(G_t) S_{j-1}`` with ``G_t`` the within-chunk
    cumsum of g (``<= 0``: no division by decays, no overflow). ``C log_C T`` small steps, no
    ``[C, C]`` decay tensors. Same returns as :func:`linear_scan_loop`.

    Raises:
        ValueError: shape mismatch; ``chunk_size < 2``.
    """
    _check(x, g, initial_state)
    if chunk_size < 2:
        raise ValueError(f"linear_scan_chunk: chunk_size must be >= 2; got {chunk_size}")
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    h0 = None if initial_state is None else initial_state.to(dt)
    if x.shape[1] == 0:
        return x.clone(), (x.new_zeros(x.shape[0], x.shape[2], dtype=dt) if h0 is None else h0)
    y, h = _scan_levels(x.to(dt), g.to(dt), h0, chunk_size)
    return y.to(x.dtype), h


_FLA_WARNED = False


def linear_scan(x: Tensor, g: Tensor, initial_state: Tensor | None = None, impl: str = "auto", chunk_size: int = 16
                ) -> tuple[Tensor, Tensor]:
    """``h_t = exp(g_t) h_{t-1} + x_t``; x, g ``[B, T, D]`` -> (h ``[B, T, D]``, final state ``[B, D]``).

    ``impl``: ``"auto"`` / ``"chunk"`` (:func:`linear_scan_chunk`, on every device),
    ``"loop"`` (reference), ``"fla"`` (fla-core ``chunk_hgrn``, explicit opt-in only).

    Warning:
        ``impl="fla"`` FAILED ``scripts/check_gpu_paths.py`` on fla-core 0.6.0 + Triton 3.6
        (H200): with fla's autotuning the float32 output was 12% off the float64 reference;
        pinned to one kernel config the output matched (2e-6) but parameter gradients were
        27% off. It is kept only to re-check newer fla releases; do not train with it.

    Raises:
        ValueError: shape mismatch, unknown impl, ``"fla"`` without CUDA.
    """
    global _FLA_WARNED
    _check(x, g, initial_state)
    if impl in ("auto", "chunk"):
        return linear_scan_chunk(x, g, initial_state, chunk_size)
    if impl == "loop":
        return linear_scan_loop(x, g, initial_state)
    if impl == "fla":
        if not x.is_cuda:
            raise ValueError("linear_scan: impl='fla' (fla-core chunk_hgrn) needs CUDA tensors")
        if not _FLA_WARNED:
            warnings.warn("linear_scan: impl='fla' (fla chunk_hgrn) failed the device check on fla-core 0.6.0 + "
                          "Triton 3.6 (H200: output 12% / grads 27% off); use impl='auto'", stacklevel=2)
            _FLA_WARNED = True
        from fla.ops.hgrn import chunk_hgrn  # CUDA only

        h0 = None if initial_state is None else initial_state.float()
        y, h = chunk_hgrn(x.float(), g.float(), initial_state=h0, output_final_state=True)
        return y.to(x.dtype), h
    raise ValueError(f"linear_scan: impl must be 'auto', 'chunk', 'loop' or 'fla'; got {impl!r}")
