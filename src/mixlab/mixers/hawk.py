"""Hawk mixer (``hawk``): Griffin's recurrent block with the RG-LRU (De et al. 2024,
"Griffin: Mixing Gated Linear Recurrences with Local Attention", arXiv 2402.19427, Sec. 2.4).

Recurrent block: ``y = W_out( GeLU(W_gate x) * RG-LRU(Conv1D(W_in x)) )`` with::

    r_t = sigmoid(W_a u_t + b_a)              recurrence gate (block-diagonal W_a, per head)
    i_t = sigmoid(W_x u_t + b_x)              input gate
    log a_t = -c * r_t * softplus(-Lambda)    (a_t = sigmoid(Lambda)^(c r_t), c = 8)
    h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t u_t)

The scan is :func:`mixlab.ops.scan.linear_scan`: the hierarchical chunked torch scan on every
device (``impl="auto"``). fla ``chunk_hgrn`` (``impl="fla"``) is opt-in only: it failed the
device check on fla-core 0.6.0 + Triton 3.6 (H200; output 12% / gradients 27% off).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixlab.coords import Coords
from mixlab.mixers.base import Mixer, check_choice, check_sizes, no_weight_decay
from mixlab.mixers.layers import ShortConv
from mixlab.ops.scan import linear_scan
from mixlab.registry import register_mixer

__all__ = ["Hawk", "rg_lru_gates"]


def rg_lru_gates(u: Tensor, r_logits: Tensor, i_logits: Tensor, lam: Tensor, c: float) -> tuple[Tensor, Tensor]:
    """RG-LRU in scan form: ``(x_t, g_t)`` with ``h_t = exp(g_t) h_{t-1} + x_t``.

    u, r_logits, i_logits ``[B, T, W]``; lam ``[W]`` (Lambda). Returns float32/64 tensors.
    """
    dt = torch.float64 if u.dtype == torch.float64 else torch.float32
    log_a = -c * torch.sigmoid(r_logits.to(dt)) * F.softplus(-lam.to(dt))
    mult = torch.sqrt((-torch.expm1(2 * log_a)).clamp_min(1e-12))
    return mult * torch.sigmoid(i_logits.to(dt)) * u.to(dt), log_a


@register_mixer("hawk")
class Hawk(Mixer):
    """Griffin recurrent block (Hawk = this mixer + the backbone's MLP).

    Args:
        d_model, n_heads, causal, layer_idx, n_layers: backbone contract (causal only);
            ``n_heads`` sets the block-diagonal gate blocks.
        lru_width: recurrence width W (default ``d_model``; Griffin uses 4/3 d_model).
        conv_size: temporal conv kernel (Griffin: 4; 0 disables).
        c: gate exponent constant (8 in the paper).
        a_min, a_max: ``a^c`` initialised uniform in [a_min, a_max] (paper 0.9, 0.999).
        impl: scan implementation: ``"auto"`` = ``"chunk"`` (torch chunked scan, every device),
            ``"loop"`` (reference), ``"fla"`` (fla ``chunk_hgrn``; WARNING: failed the device
            check on fla-core 0.6.0 + Triton 3.6 (H200), explicit opt-in for re-checks only).

    Forward: ``x [B, T, D]`` -> ``[B, T, D]``; ``cache`` holds ``state [B, W]`` and the conv tail.

    Raises:
        ValueError: ``causal=False``; ``lru_width`` not divisible by ``n_heads``; bad init range.
    """

    arg_bounds = {"lru_width": ((">=", 1),), "conv_size": ((">=", 0),), "c": ((">", 0),),
                  "a_min": ((">", 0), ("<", 1)), "a_max": ((">", 0), ("<", 1))}
    """Ranges of the numeric arguments, checked by the registry before the class is built."""

    def __init__(self, d_model: int, n_heads: int, causal: bool = True, layer_idx: int = 0, n_layers: int = 1,
                 lru_width: int | None = None, conv_size: int = 4, c: float = 8.0, a_min: float = 0.9,
                 a_max: float = 0.999, impl: str = "auto") -> None:
        super().__init__()
        if not causal:
            raise ValueError("hawk mixer: causal=False is not supported")
        check_sizes("hawk", lru_width=lru_width)
        check_sizes("hawk", minimum=0, conv_size=conv_size)
        check_choice("hawk", "impl", impl, ("auto", "chunk", "loop", "fla"))
        w = lru_width or d_model
        if w % n_heads:
            raise ValueError(f"hawk mixer: lru_width={w} is not divisible by n_heads={n_heads}")
        if not 0 < a_min < a_max < 1:
            raise ValueError(f"hawk mixer: need 0 < a_min < a_max < 1; got {a_min}, {a_max}")
        self.width, self.n_heads, self.c, self.a_min, self.a_max, self.impl = w, n_heads, c, a_min, a_max, impl
        bw = w // n_heads
        self.in_x = nn.Linear(d_model, w, bias=False)
        self.in_gate = nn.Linear(d_model, w, bias=False)
        self.conv = ShortConv(w, conv_size, activation=None) if conv_size > 0 else None
        self.gate_w = nn.Parameter(torch.empty(2, n_heads, bw, bw))  # (recurrence, input) block-diagonal
        self.gate_b = nn.Parameter(torch.zeros(2, n_heads, bw))
        self.lam = nn.Parameter(torch.empty(w))
        no_weight_decay(self.lam, self.gate_b)
        self.out = nn.Linear(w, d_model, bias=False)
        self.out._is_residual = True  # type: ignore[attr-defined]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            bw = self.gate_w.shape[-1]
            nn.init.normal_(self.gate_w, 0.0, 1.0 / math.sqrt(bw))
            nn.init.zeros_(self.gate_b)
            # a^c ~ U(a_min, a_max) -> a = u^(1/c), Lambda = logit(a)
            a = torch.empty_like(self.lam).uniform_(self.a_min, self.a_max).pow(1.0 / self.c)
            self.lam.copy_(torch.log(a) - torch.log1p(-a))
        if self.conv is not None:
            self.conv.reset_parameters()

    def _gates(self, u: Tensor) -> tuple[Tensor, Tensor]:
        b, t, _ = u.shape
        ub = u.view(b, t, self.n_heads, -1)
        z = torch.einsum("bthi,ghij->gbthj", ub, self.gate_w.to(u.dtype)) + self.gate_b.to(u.dtype)[:, None, None]
        return z[0].reshape(b, t, -1), z[1].reshape(b, t, -1)

    # static decoding: the state and conv tails are fixed-size; the dict-cache step on fixed buffers
    static_cache = Mixer.fixed_state_static_cache
    static_step = Mixer.fixed_state_static_step

    def forward(self, x: Tensor, coords: Coords | None = None, cache: dict | None = None) -> Tensor:
        gate = F.gelu(self.in_gate(x), approximate="tanh")
        u = self.in_x(x)
        if self.conv is not None:
            u = self.conv(u, cache, "conv")
        r_logits, i_logits = self._gates(u)
        xs, g = rg_lru_gates(u, r_logits, i_logits, self.lam, self.c)
        state = cache.get("state") if cache is not None else None
        h, state = linear_scan(xs, g, state, impl=self.impl)
        if cache is not None:
            cache["state"] = state.detach()
        return self.out((h.to(gate.dtype) * gate))
