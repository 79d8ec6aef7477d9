"""Mamba2 mixer (``mamba2``; Dao & Gu 2024, "Transformers are SSMs", arXiv 2405.21060, Sec. 7).

``in_proj -> (z, x, B, C, dt)``; SiLU short conv on ``(x, B, C)``; ``dt = softplus(dt + dt_bias)``,
``A = -exp(A_log)`` per head; SSD ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T``,
``y_t = h_t^T C_t + D x_t``; ``y = RMSNorm(y * silu(z))``; ``out_proj``. The SSD runs as simple
GLA (``q=C, k=B, v=dt*x, g=dt*A, scale=1``), see :func:`mixlab.ops.gla.mamba2_ssd`. On CUDA
that is fla ``chunk_gla`` with the per-head log gate broadcast over the state dim (identical
math); fla ``chunk_simple_gla`` cannot run its backward on Hopper with Triton 3.6 (fla #640).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixlab.coords import Coords
from mixlab.mixers.base import Mixer, check_choice, check_sizes, no_weight_decay
from mixlab.mixers.layers import RMSNorm, ShortConv
from mixlab.ops.gla import mamba2_ssd
from mixlab.registry import register_mixer

__all__ = ["Mamba2"]


@register_mixer("mamba2")
class Mamba2(Mixer):
    """Mamba2 block (single B/C group broadcast to all heads).

    Args:
        d_model, n_heads, causal, layer_idx, n_layers: backbone contract (causal only);
            ``n_heads`` = number of SSD heads H, head dim ``P = expand * d_model / H``.
        d_state: N (state size per head; 128 in the paper, 16-64 for small models).
        expand: inner width ``E = expand * d_model``.
        conv_size: short conv kernel (4).
        dt_min, dt_max: dt initialised log-uniform in this range (stored as inverse softplus).
        a_init_range: ``A = -exp(A_log)`` with ``exp(A_log) ~ U(a_init_range)``.
        impl: ``"auto"`` (fla ``chunk_gla`` on CUDA, torch chunk elsewhere) | ``"chunk"`` |
            ``"recurrent"`` | ``"fla"`` | ``"fla_simple"`` (fla ``chunk_simple_gla``: opt-in only,
            its backward fails on Hopper + Triton 3.6, fla #640); see :func:`mixlab.ops.gla.simple_gla`.

    Forward: ``x [B, T, D]`` -> ``[B, T, D]``; ``cache`` holds ``state [B, H, N, P]`` and the conv tail.

    Raises:
        ValueError: ``causal=False``; inner width not divisible by ``n_heads``.
    """

    arg_bounds = {"d_state": ((">=", 1),), "expand": ((">=", 1),), "conv_size": ((">=", 0),),
                  "dt_min": ((">", 0),), "dt_max": ((">", 0),), "chunk_size": ((">=", 1),)}
    """Ranges of the numeric arguments, checked by the registry before the class is built."""

    def __init__(self, d_model: int, n_heads: int, causal: bool = True, layer_idx: int = 0, n_layers: int = 1,
                 d_state: int = 64, expand: int = 2, conv_size: int = 4, dt_min: float = 1e-3, dt_max: float = 0.1,
                 a_init_range: tuple[float, float] = (1.0, 16.0), impl: str = "auto", chunk_size: int = 16) -> None:
        super().__init__()
        if not causal:
            raise ValueError("mamba2 mixer: causal=False is not supported")
        check_sizes("mamba2", d_state=d_state, expand=expand, chunk_size=chunk_size)
        check_sizes("mamba2", minimum=0, conv_size=conv_size)
        check_choice("mamba2", "impl", impl, ("auto", "chunk", "recurrent", "fla", "fla_simple"))
        e = expand * d_model
        if e % n_heads:
            raise ValueError(f"mamba2 mixer: expand*d_model={e} is not divisible by n_heads={n_heads}")
        self.n_heads, self.d_inner, self.d_state, self.head_dim = n_heads, e, d_state, e // n_heads
        if not dt_min <= dt_max:
            raise ValueError(f"mamba2 mixer: dt_min must be <= dt_max; got {dt_min} > {dt_max}")
        if len(a_init_range) != 2 or not 0 < a_init_range[0] <= a_init_range[1] < math.inf:
            raise ValueError(f"mamba2 mixer: a_init_range must be [low, high] with 0 < low <= high (finite); "
                             f"got {list(a_init_range)}")
        self.dt_min, self.dt_max, self.a_init_range = dt_min, dt_max, tuple(a_init_range)
        self.impl, self.chunk_size = impl, chunk_size
        self.in_proj = nn.Linear(d_model, 2 * e + 2 * d_state + n_heads, bias=False)
        self.conv = ShortConv(e + 2 * d_state, conv_size) if conv_size > 0 else None
        self.dt_bias = nn.Parameter(torch.empty(n_heads))
        self.A_log = nn.Parameter(torch.empty(n_heads))
        self.D = nn.Parameter(torch.ones(n_heads))
        no_weight_decay(self.dt_bias, self.A_log, self.D)
        self.norm = RMSNorm(e, eps=1e-5)
        self.out_proj = nn.Linear(e, d_model, bias=False)
        self.out_proj._is_residual = True  # type: ignore[attr-defined]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            lo, hi = math.log(self.dt_min), math.log(self.dt_max)
            dt = torch.exp(torch.empty(self.n_heads).uniform_(lo, hi)).clamp_min(1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            self.A_log.copy_(torch.empty(self.n_heads).uniform_(*self.a_init_range).log())
            self.D.fill_(1.0)
        if self.conv is not None:
            self.conv.reset_parameters()
        self.norm.reset_parameters()

    # static decoding: the state and conv tails are fixed-size; the dict-cache step on fixed buffers
    static_cache = Mixer.fixed_state_static_cache
    static_step = Mixer.fixed_state_static_step

    def forward(self, x: Tensor, coords: Coords | None = None, cache: dict | None = None) -> Tensor:
        b, t, _ = x.shape
        h, e, n, p = self.n_heads, self.d_inner, self.d_state, self.head_dim
        z, xbc, dt = self.in_proj(x).split([e, e + 2 * n, h], dim=-1)
        if self.conv is not None:
            xbc = self.conv(xbc, cache, "conv")
        xs, bm, cm = xbc.split([e, n, n], dim=-1)
        up = (lambda z_: z_) if x.dtype == torch.float64 else (lambda z_: z_.float())
        dt = F.softplus(up(dt) + self.dt_bias)
        a = -torch.exp(up(self.A_log))
        xs = xs.view(b, t, h, p)
        bm = bm.view(b, t, 1, n).expand(b, t, h, n)
        cm = cm.view(b, t, 1, n).expand(b, t, h, n)
        state = cache.get("state") if cache is not None else None
        y, state = mamba2_ssd(xs, dt, a, bm, cm, state, impl=self.impl, chunk_size=self.chunk_size)
        if cache is not None:
            cache["state"] = state.detach()
        y = y + self.D.to(y.dtype)[:, None] * xs
        y = self.norm(y.reshape(b, t, e) * F.silu(z))
        return self.out_proj(y)
