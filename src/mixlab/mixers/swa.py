"""Sliding-window softmax attention (``swa``; the MesaNet paper's SWA-w baselines, Sec. 4).

Query ``i`` attends to keys ``j`` with ``i - window < j <= i`` (causal) or ``|i - j| < window``
(bidirectional), RoPE (default) or NoPE positions. The KV cache keeps only the last
``window - 1`` keys, so decoding memory is constant.

Implementations: ``"mask"`` (SDPA with a boolean band mask; CPU default), ``"flex"``
(FlexAttention with a sliding-window block mask, compiled; CUDA default for a parallel
forward), ``"reference"`` (explicit ``softmax(q k^T / sqrt(d) + band mask) v`` in float).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mixlab.coords import Coords
from mixlab.mixers.base import AttentionMixer, resolve_head_dim
from mixlab.ops.attention import band_mask, flex_sliding_window
from mixlab.registry import register_mixer

__all__ = ["SlidingWindowAttention"]


@register_mixer("swa")
class SlidingWindowAttention(AttentionMixer):
    """Multi-head sliding-window attention.

    Args:
        d_model, n_heads, causal, layer_idx, n_layers: backbone contract.
        window: keys per query including itself (>= 1; paper SWA-1024, SWA-4, ...).
        position: ``"rope"`` or ``"nope"``; position_args: e.g. RoPE ``base``.
        head_dim: default ``d_model // n_heads``.
        impl: ``"auto"`` (flex on CUDA for a parallel forward, else mask) | ``"mask"`` |
            ``"flex"`` | ``"reference"``.
        bias: bias in the projections.

    Forward: ``x [B, T, D]``, ``coords`` (default ``Coords.seq``; the window is on token
    index), ``cache`` with ``k, v [B, H, min(window - 1, n), d]`` and the absolute position ``n``.

    Raises:
        ValueError: ``window < 1``; a position scheme with lanes or a bias (GOAT/ALiBi);
            bad sizes; unknown impl.
    """

    arg_bounds = {"window": ((">=", 1),), "head_dim": ((">=", 1),)}
    """Ranges of the numeric arguments, checked by the registry before the class is built."""

    def __init__(self, d_model: int, n_heads: int, causal: bool = True, layer_idx: int = 0, n_layers: int = 1,
                 window: int = 128, position: str = "rope", position_args: dict[str, Any] | None = None,
                 head_dim: int | None = None, impl: str = "auto", bias: bool = False) -> None:
        super().__init__()
        if window < 1:
            raise ValueError(f"swa mixer: window must be >= 1; got {window}")
        if position not in ("rope", "nope"):
            raise ValueError(f"swa mixer: position must be 'rope' or 'nope'; got {position!r}")
        if impl not in ("auto", "mask", "flex", "reference"):
            raise ValueError(f"swa mixer: impl must be 'auto', 'mask', 'flex' or 'reference'; got {impl!r}")
        head_dim = resolve_head_dim("swa", d_model, n_heads, head_dim)
        self.n_heads, self.head_dim, self.window, self.causal, self.impl = n_heads, head_dim, window, causal, impl
        self._init_projections(d_model, n_heads, head_dim, causal, position, position_args, bias)

    def qkv_heads(self, x: Tensor, coords: Coords) -> tuple[Tensor, Tensor, Tensor]:
        """Rotated ``q, k`` and ``v`` as ``[B, H, T, d]``."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return self.pos.rotate(q, coords), self.pos.rotate(k, coords), v

    def forward(self, x: Tensor, coords: Coords | None = None, cache: dict | None = None) -> Tensor:
        b, t, _ = x.shape
        past = int(cache.get("n", 0)) if cache is not None else 0
        if coords is None:
            coords = Coords.seq(t, offset=past, device=x.device)
        q, k, v = self.qkv_heads(x, coords)
        k_start = past
        if cache is not None and "k" in cache:
            k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
            k_start = past - cache["k"].shape[2]
        q_idx = torch.arange(past, past + t, device=x.device)
        k_idx = torch.arange(k_start, k_start + k.shape[2], device=x.device)
        impl = self.impl
        if impl == "auto":
            impl = "flex" if x.is_cuda and cache is None and t > 1 else "mask"
        if impl == "flex" and k.shape[2] != t:
            impl = "mask"  # flex path is for a parallel forward without cached keys
        if impl == "flex":
            y = flex_sliding_window(q, k, v, self.window, self.causal)
        elif impl == "mask":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=band_mask(q_idx, k_idx, self.window, self.causal))
        else:
            ct = torch.float64 if q.dtype == torch.float64 else torch.float32
            z = (q.to(ct) @ k.to(ct).transpose(-1, -2)) / math.sqrt(self.head_dim)
            z = z.masked_fill(~band_mask(q_idx, k_idx, self.window, self.causal), float("-inf"))
            y = (torch.softmax(z, dim=-1) @ v.to(ct)).to(v.dtype)
        if cache is not None:  # the last min(window - 1, keys so far) keys: all a later query can see
            start = max(0, k.shape[2] - (self.window - 1))
            cache["k"], cache["v"] = k[:, :, start:], v[:, :, start:]
            cache["n"] = past + t
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))
