"""Multi-head latent attention (MLA, DeepSeek-V2 Sec. 2.1) with decoupled RoPE.

Notation: B batch, T tokens, H heads, ``d_c`` KV latent rank, ``d_q`` query latent rank,
``d_n`` per-head no-position q/k dims, ``d_r`` decoupled RoPE dims, ``d_v`` value dims::

    c_kv = RMSNorm(W_dkv x)            [B, T, d_c]     (the cached latent)
    k_r  = RoPE(W_kr x)                [B, 1, T, d_r]  (shared by all heads, cached)
    k_n, v = W_ukv c_kv                [B, H, T, d_n], [B, H, T, d_v]
    q_n, q_r = W_uq RMSNorm(W_dq x)    (or one projection of x when d_q = 0)
    o = softmax([q_n, RoPE(q_r)] . [k_n, k_r] / sqrt(d_n + d_r)) v

The FG²-GDN paper's backbone (Fig. 1) is the 3:1 hybrid ``mixer: "fg2gdn*3,mla"``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

from mixlab.coords import Coords
from mixlab.mixers.base import Mixer, check_sizes, resolve_head_dim
from mixlab.mixers.layers import RMSNorm
from mixlab.mixers.positions import RotaryPositions
from mixlab.ops.attention import causal_mask, sdpa
from mixlab.registry import register_mixer

__all__ = ["MultiHeadLatentAttention"]


@register_mixer("mla")
class MultiHeadLatentAttention(Mixer):
    """MLA mixer; the cache keeps only the latent ``c_kv`` and the rotated ``k_r`` per token.

    Args:
        d_model: D. n_heads: H. causal: causal or bidirectional.
        kv_rank: ``d_c`` (default ``max(16, D // 2)``).
        q_rank: ``d_q``; 0 projects queries directly from x (the DeepSeek-V2-Lite choice).
        nope_dim: ``d_n`` (default ``d_model // n_heads``).
        rope_dim: ``d_r`` (default ``2 * max(1, nope_dim // 4)``, i.e. about half of ``d_n``).
        v_dim: ``d_v`` (default ``nope_dim``).
        rope_base: RoPE base; rope_axes: coordinate axes RoPE reads (1 for sequences).
        impl: ``"sdpa"`` (one ``scaled_dot_product_attention`` call) or ``"reference"``
            (explicit softmax; for tests).
        norm_eps: epsilon of the latent RMSNorms.

    Forward: ``x [B, T, D]``, ``coords`` (default ``Coords.seq(T, offset=cached length)``),
    optional ``cache`` dict (``c_kv [B, T_past, d_c]``, ``k_r [B, 1, T_past, d_r]``,
    ``coords``) -> ``[B, T, D]``.

    Raises:
        ValueError: bad impl, odd or too small ``rope_dim``, d_model not divisible by n_heads
            without explicit dims.
    """

    arg_bounds = {"kv_rank": ((">=", 1),), "q_rank": ((">=", 0),), "nope_dim": ((">=", 1),),
                  "rope_dim": ((">=", 2),), "v_dim": ((">=", 1),), "rope_base": ((">", 0),),
                  "rope_axes": ((">=", 1),), "norm_eps": ((">", 0),)}
    """Ranges of the numeric arguments, checked by the registry before the class is built."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        causal: bool = True,
        kv_rank: int | None = None,
        q_rank: int = 0,
        nope_dim: int | None = None,
        rope_dim: int | None = None,
        v_dim: int | None = None,
        rope_base: float = 10000.0,
        rope_axes: int = 1,
        impl: Literal["sdpa", "reference"] = "sdpa",
        norm_eps: float = 1e-6,
        layer_idx: int = 0,
        n_layers: int = 1,
    ) -> None:
        super().__init__()
        if impl not in ("sdpa", "reference"):
            raise ValueError(f"mla impl must be 'sdpa' or 'reference'; got {impl!r}")
        check_sizes("mla", kv_rank=kv_rank, nope_dim=nope_dim, rope_dim=rope_dim, v_dim=v_dim)
        check_sizes("mla", minimum=0, q_rank=q_rank)
        nope_dim = resolve_head_dim("mla", d_model, n_heads, nope_dim, arg="nope_dim")
        rope_dim = rope_dim if rope_dim is not None else 2 * max(1, nope_dim // 4)
        if rope_dim < 2 * rope_axes or rope_dim % (2 * rope_axes):
            raise ValueError(f"mla rope_dim={rope_dim} must be a positive multiple of 2*rope_axes={2 * rope_axes}")
        v_dim = nope_dim if v_dim is None else v_dim
        kv_rank = kv_rank or max(16, d_model // 2)
        h = n_heads
        self.d_model, self.n_heads, self.causal, self.impl, self.layer_idx = d_model, h, causal, impl, layer_idx
        self.nope_dim, self.rope_dim, self.v_dim, self.kv_rank, self.q_rank = nope_dim, rope_dim, v_dim, kv_rank, q_rank
        if q_rank > 0:
            self.q_a = nn.Linear(d_model, q_rank, bias=False)
            self.q_norm = RMSNorm(q_rank, eps=norm_eps)
            self.q_b = nn.Linear(q_rank, h * (nope_dim + rope_dim), bias=False)
        else:
            self.q_proj = nn.Linear(d_model, h * (nope_dim + rope_dim), bias=False)
        self.kv_a = nn.Linear(d_model, kv_rank + rope_dim, bias=False)
        self.kv_norm = RMSNorm(kv_rank, eps=norm_eps)
        self.kv_b = nn.Linear(kv_rank, h * (nope_dim + v_dim), bias=False)
        self.o_proj = nn.Linear(h * v_dim, d_model, bias=False)
        self.o_proj._is_residual = True  # type: ignore[attr-defined]
        self.rope = RotaryPositions(h, rope_dim, causal, axes=rope_axes, base=rope_base)
        self.scale = 1.0 / math.sqrt(nope_dim + rope_dim)

    @property
    def position_axes(self) -> int:
        return self.rope.axes

    def describe(self) -> dict[str, str | int]:
        return {"position": "rope"}

    def _queries(self, x: Tensor) -> tuple[Tensor, Tensor]:
        b, t, _ = x.shape
        q = self.q_b(self.q_norm(self.q_a(x))) if self.q_rank > 0 else self.q_proj(x)
        q = q.view(b, t, self.n_heads, self.nope_dim + self.rope_dim).transpose(1, 2)
        return q.split([self.nope_dim, self.rope_dim], dim=-1)  # [B, H, T, d_n], [B, H, T, d_r]

    def _latent(self, x: Tensor) -> tuple[Tensor, Tensor]:
        c, kr = self.kv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        return self.kv_norm(c), kr.unsqueeze(1)  # [B, T, d_c], [B, 1, T, d_r]

    def _expand(self, c_kv: Tensor) -> tuple[Tensor, Tensor]:
        b, t, _ = c_kv.shape
        kv = self.kv_b(c_kv).view(b, t, self.n_heads, self.nope_dim + self.v_dim).transpose(1, 2)
        return kv.split([self.nope_dim, self.v_dim], dim=-1)  # [B, H, T, d_n], [B, H, T, d_v]

    def forward(self, x: Tensor, coords: Coords | None = None, cache: dict | None = None) -> Tensor:
        b, t, _ = x.shape
        past = cache["c_kv"].shape[1] if cache is not None and "c_kv" in cache else 0
        cq = coords if coords is not None else Coords.seq(t, offset=past, device=x.device)
        qn, qr = self._queries(x)
        qr = self.rope.rotate(qr, cq)
        c_kv, kr = self._latent(x)
        kr = self.rope.rotate(kr, cq)
        if cache is not None:
            if past:
                c_kv = torch.cat([cache["c_kv"], c_kv], 1)
                kr = torch.cat([cache["k_r"], kr], 2)
                cache["coords"] = Coords.cat([cache["coords"], cq])
            else:
                cache["coords"] = cq
            cache["c_kv"], cache["k_r"] = c_kv, kr
        kn, v = self._expand(c_kv)
        tk = kn.shape[2]
        q = torch.cat([qn, qr], -1)
        k = torch.cat([kn, kr.expand(-1, self.n_heads, -1, -1)], -1)
        mask = causal_mask(t, tk, x.device) if self.causal else None
        if self.impl == "reference":
            z = (q @ k.transpose(-1, -2)) * self.scale
            if mask is not None:
                z = z.masked_fill(~mask, float("-inf"))
            y = torch.softmax(z, -1) @ v
        elif self.causal and past and t > 1:
            y = sdpa(q, k, v, cache is not None, attn_mask=mask, scale=self.scale)
        else:
            y = sdpa(q, k, v, cache is not None, is_causal=self.causal and not past, scale=self.scale)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))
