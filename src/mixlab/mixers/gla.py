"""Gated linear attention mixer (``gla``; Yang et al. 2024, arXiv 2312.06635, Sec. 4).

``S_t = Diag(alpha_t) S_{t-1} + k_t v_t^T``, ``o_t = S_t^T q_t / sqrt(K)`` with a per-key-
channel forget gate ``log alpha_t = logsigmoid(W2 W1 x_t + b) / gate_normalizer`` (low-rank,
the paper's tau = 16); head outputs RMSNorm-ed and gated by ``swish(W_g x)``. Kernels:
:mod:`mixlab.ops.gla` (fla ``chunk_gla`` on CUDA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixlab.coords import Coords
from mixlab.mixers.base import Mixer, check_choice, check_sizes, no_weight_decay, resolve_head_dim
from mixlab.mixers.layers import GatedRMSNorm, ShortConv
from mixlab.ops.gla import gla
from mixlab.registry import register_mixer

__all__ = ["GLA"]


@register_mixer("gla")
class GLA(Mixer):
    """GLA layer (fla recipe).

    Args:
        d_model, n_heads, causal, layer_idx, n_layers: backbone contract (causal only).
        head_dim: K per head (default ``d_model // n_heads``); ``expand_v`` scales V = K * expand_v.
        gate_low_rank: rank of the gate projection (16).
        gate_normalizer: divides ``logsigmoid`` (16).
        conv_size: optional SiLU short conv on q, k, v (0 = off, fla default).
        impl: ``"auto"`` | ``"chunk"`` | ``"recurrent"`` | ``"fla"``.
        chunk_size: torch chunk length.

    Forward: ``x [B, T, D]`` -> ``[B, T, D]``; ``cache`` holds ``state [B, H, K, V]`` (+ conv tails).

    Raises:
        ValueError: ``causal=False``; sizes not divisible.
    """

    arg_bounds = {"head_dim": ((">=", 1),), "expand_v": ((">", 0),), "gate_low_rank": ((">=", 1),),
                  "gate_normalizer": ((">", 0),), "conv_size": ((">=", 0),), "chunk_size": ((">=", 1),)}
    """Ranges of the numeric arguments, checked by the registry before the class is built."""

    def __init__(self, d_model: int, n_heads: int, causal: bool = True, layer_idx: int = 0, n_layers: int = 1,
                 head_dim: int | None = None, expand_v: float = 1.0, gate_low_rank: int = 16,
                 gate_normalizer: float = 16.0, conv_size: int = 0, impl: str = "auto", chunk_size: int = 16) -> None:
        super().__init__()
        if not causal:
            raise ValueError("gla mixer: causal=False is not supported")
        check_sizes("gla", head_dim=head_dim, gate_low_rank=gate_low_rank, chunk_size=chunk_size)
        check_sizes("gla", minimum=0, conv_size=conv_size)
        check_choice("gla", "impl", impl, ("auto", "chunk", "recurrent", "fla"))
        if not expand_v > 0:
            raise ValueError(f"gla mixer: expand_v must be > 0; got {expand_v}")
        head_dim = resolve_head_dim("gla", d_model, n_heads, head_dim)
        if int(head_dim * expand_v) < 1:
            raise ValueError(f"gla mixer: expand_v={expand_v} leaves int(head_dim * expand_v) = "
                             f"{int(head_dim * expand_v)} value channels (head_dim={head_dim}); give a larger expand_v")
        self.n_heads, self.dk, self.dv = n_heads, head_dim, int(head_dim * expand_v)
        self.gate_normalizer, self.impl, self.chunk_size = gate_normalizer, impl, chunk_size
        h = n_heads
        self.q_proj = nn.Linear(d_model, h * self.dk, bias=False)
        self.k_proj = nn.Linear(d_model, h * self.dk, bias=False)
        self.v_proj = nn.Linear(d_model, h * self.dv, bias=False)
        self.g_proj = nn.Linear(d_model, h * self.dv, bias=False)
        self.gk_proj = nn.Sequential(nn.Linear(d_model, gate_low_rank, bias=False),
                                     nn.Linear(gate_low_rank, h * self.dk, bias=True))
        no_weight_decay(self.gk_proj[1].bias)
        self.convs = nn.ModuleList(ShortConv(n, conv_size) for n in (h * self.dk, h * self.dk, h * self.dv)) \
            if conv_size > 0 else None
        self.norm = GatedRMSNorm(self.dv, activation="swish")
        self.o_proj = nn.Linear(h * self.dv, d_model, bias=False)
        self.o_proj._is_residual = True  # type: ignore[attr-defined]

    # static decoding: the state and conv tails are fixed-size; the dict-cache step on fixed buffers
    static_cache = Mixer.fixed_state_static_cache
    static_step = Mixer.fixed_state_static_step

    def forward(self, x: Tensor, coords: Coords | None = None, cache: dict | None = None) -> Tensor:
        b, t, _ = x.shape
        h = self.n_heads
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.convs is not None:
            q, k, v = (cv(z, cache, f"conv{i}") for i, (cv, z) in enumerate(zip(self.convs, (q, k, v))))
        gk = self.gk_proj(x)
        gk = F.logsigmoid(gk if gk.dtype == torch.float64 else gk.float()) / self.gate_normalizer
        state = cache.get("state") if cache is not None else None
        o, state = gla(q.view(b, t, h, self.dk), k.view(b, t, h, self.dk), v.view(b, t, h, self.dv),
                       gk.view(b, t, h, self.dk), initial_state=state, impl=self.impl, chunk_size=self.chunk_size)
        if cache is not None:
            cache["state"] = state.detach()
        o = self.norm(o, self.g_proj(x).view(b, t, h, self.dv))
        return self.o_proj(o.reshape(b, t, -1).to(x.dtype))
