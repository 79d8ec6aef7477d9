"""Elementwise gated linear recurrence ``h_t = exp(g_t) * h_{t-1} + x_t`` (HGRN form).

Used by Hawk's RG-LRU (Griffin, De et al. 2024, arXiv 2402.19427, Sec. 2.4), which maps
onto it exactly with ``g_t = log a_t`` and ``x_t = sqrt(1 - a_t^2) * (i_t * x_t)``.

Layout: x, g ``[B, T, D]`` (g = natural-log decay ``<= 0``), state ``[B, D]``.

* :func:`linear_scan_loop` - token loop (reference).
* :func:`linear_scan_chunk` - chunkwise torch (CPU): masked decay matrices inside a chunk,
  a carry across chunks; differentiable by autograd.
* :func:`linear_scan` - dispatch; CUDA uses fla-core ``chunk_hgrn``.
"""

from __future__ import annotations

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


def linear_scan_chunk(x: Tensor, g: Tensor, initial_state: Tensor | None = None, chunk_size: int = 16
                      ) -> tuple[Tensor, Tensor]:
    """Chunkwise scan: ``h_t = exp(G_t) h_start + sum_{i<=t} exp(G_t - G_i) x_i`` per chunk
    (``G`` = within-chunk cumsum of g), carried across chunks. Same returns as the loop."""
    _check(x, g, initial_state)
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    b, t, d = x.shape
    c = max(1, min(chunk_size, t))
    n = -(-t // c)
    pad = n * c - t
    xc = F.pad(x.to(dt), (0, 0, 0, pad)).view(b, n, c, d)
    gc = F.pad(g.to(dt), (0, 0, 0, pad)).view(b, n, c, d).cumsum(2)
    tri = torch.ones(c, c, dtype=torch.bool, device=x.device).tril()
    diff = (gc.unsqueeze(3) - gc.unsqueeze(2)).masked_fill(~tri[:, :, None], float("-inf"))  # [B, N, C, C, D]
    intra = (diff.exp() * xc.unsqueeze(2)).sum(3)  # [B, N, C, D]
    h = x.new_zeros(b, d, dtype=dt) if initial_state is None else initial_state.to(dt)
    outs = []
    for i in range(n):
        o = intra[:, i] + gc[:, i].exp() * h.unsqueeze(1)
        outs.append(o)
        h = o[:, -1]
    y = torch.stack(outs, 1).reshape(b, n * c, d)[:, :t]
    # final state of the padded tail equals the state at token t-1 (g = 0, x = 0 in the padding)
    return y.to(x.dtype), h


def linear_scan(x: Tensor, g: Tensor, initial_state: Tensor | None = None, impl: str = "auto", chunk_size: int = 16
                ) -> tuple[Tensor, Tensor]:
    """``h_t = exp(g_t) h_{t-1} + x_t``; x, g ``[B, T, D]`` -> (h ``[B, T, D]``, final state ``[B, D]``).

    ``impl``: ``"auto"`` (fla ``chunk_hgrn`` on CUDA for T > 1, else ``"chunk"``), ``"chunk"``,
    ``"loop"``, ``"fla"``.

    Raises:
        ValueError: shape mismatch or unknown impl.
    """
    _check(x, g, initial_state)
    if impl == "auto":
        impl = "fla" if x.is_cuda and x.shape[1] > 1 else "chunk"
    if impl == "chunk":
        return linear_scan_chunk(x, g, initial_state, chunk_size)
    if impl == "loop":
        return linear_scan_loop(x, g, initial_state)
    if impl == "fla":
        if not x.is_cuda:
            raise ValueError("linear_scan: impl='fla' (fla-core chunk_hgrn) needs CUDA tensors")
        from fla.ops.hgrn import chunk_hgrn  # CUDA only

        h0 = None if initial_state is None else initial_state.float()
        y, h = chunk_hgrn(x.float(), g.float(), initial_state=h0, output_final_state=True)
        return y.to(x.dtype), h
    raise ValueError(f"linear_scan: impl must be 'auto', 'chunk', 'loop' or 'fla'; got {impl!r}")
