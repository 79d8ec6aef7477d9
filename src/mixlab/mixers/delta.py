"""Gated delta-rule mixers: DeltaNet, GDN, KDA, FG²-GDN, FG²-GDN+ and the FG² paper's Table-4 ablations.

One layer class, :class:`GatedDeltaMixer`, with the standard fla recipe (q/k/v projections,
depthwise causal short convolution with SiLU, l2-normalised q/k, decay
``g = -exp(A_log) * softplus(proj(x) + dt_bias)``, output RMSNorm gated by a projection)
and two switches:

=================  ===============  ==================  =======================================
name               decay alpha      writing rate beta   notes
=================  ===============  ==================  =======================================
``deltanet``       none (1)         scalar              Schlag et al. / Yang et al. 2024
``gdn``            scalar           scalar              Gated DeltaNet (Yang et al. 2025)
``kda``            channel-wise     scalar              Kimi Delta Attention
``fg2gdn``         channel-wise     channel-wise        FG²-GDN, Eqs. 10-11 (needs d_k == d_v)
``fg2gdn_plus``    channel-wise     separate k / v      FG²-GDN+, Eq. 13
``fgbgdn``         scalar           channel-wise        Table 4: scalar alpha, vector beta
``kda_kvbeta``     channel-wise     separate scalar     Table 4: vector alpha, scalar beta^k, beta^v
=================  ===============  ==================  =======================================

Channel-wise writing rates come from a low-rank projection ``D -> r -> H*K`` of the token
(paper Sec. 3.5). ``allow_neg_eigval=True`` maps rates to ``[0, 2)`` (state tracking).
Math and kernels: :mod:`mixlab.ops.delta_rule`; fused FG² gate prep: :mod:`mixlab.ops.fg2_gate`.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixlab.coords import Coords
from mixlab.mixers.base import Mixer, no_weight_decay, resolve_head_dim
from mixlab.mixers.layers import RMSNorm, ShortConv, short_conv_step
from mixlab.ops.delta_rule import TORCH_CHUNK_SIZES, delta_rule, sqrt_sigmoid
from mixlab.ops.fg2_gate import fg2_gate_prep
from mixlab.registry import register_mixer

__all__ = ["GatedDeltaMixer"]


@register_mixer("deltanet", decay="none", write="scalar")
@register_mixer("gdn", decay="scalar", write="scalar")
@register_mixer("kda", decay="vector", write="scalar")
@register_mixer("fg2gdn", decay="vector", write="vector")
@register_mixer("fg2gdn_plus", decay="vector", write="vector", separate_kv_write=True)
@register_mixer("fgbgdn", decay="scalar", write="vector")
@register_mixer("kda_kvbeta", decay="vector", write="scalar", separate_kv_write=True)
class GatedDeltaMixer(Mixer):
    """Gated delta-rule layer (see the module table for the registered variants).

    Args:
        d_model: D. n_heads: H.
        causal: must be True (recurrent memories are causal).
        decay: ``"none"`` | ``"scalar"`` (one alpha per head) | ``"vector"`` (per key channel).
        write: ``"scalar"`` | ``"vector"`` writing rate beta.
        separate_kv_write: separate key-side ``beta^k`` and value-side ``beta^v`` (FG²-GDN+).
        allow_neg_eigval: rates in ``[0, 2)`` instead of ``(0, 1)`` (transition eigenvalues
            in ``(-1, 1]``; needed for parity-like state tracking).
        head_dim: key dim K per head (default ``d_model // n_heads``).
        value_dim: value dim V per head (default K). ``fg2gdn`` needs K == V.
        conv_size: short-convolution width (0 disables the convolution).
        gate_rank: rank r of the low-rank projections (channel-wise decay, channel-wise
            writing rates, KDA-style output gate); default V.
        output_gate: ``"swish"`` (GDN) or ``"sigmoid"`` (KDA); default sigmoid for
            channel-wise decay, swish otherwise.
        chunk_size: C of the torch chunkwise path (fla on CUDA always uses 64).
        impl: ``"auto"`` | ``"chunk"`` | ``"recurrent"`` | ``"fla"`` (see
            :func:`mixlab.ops.delta_rule.delta_rule`).
        gate_impl: fused FG² gate preparation ``"auto"`` | ``"triton"`` | ``"torch"``.
        norm_eps: epsilon of the gated output RMSNorm.

    Forward: ``x [B, T, D]`` (coords ignored), optional ``cache`` dict (keys ``state``
    ``[B, H, K, V]`` float32/float64 and ``conv_q/k/v``), optional ``cu_seqlens [N+1]``
    for packed sequences (B = 1) -> ``[B, T, D]``. Cached calls continue the recurrence
    (any number of tokens per call).

    Raises:
        ValueError: ``causal=False``; d_model not divisible by n_heads without head_dim;
            unknown decay/write/output_gate; unsupported chunk_size; ``write="vector"`` without separate rates and
            K != V; a half-precision cached state; ``cu_seqlens`` together with a cache.
    """

    arg_bounds = {"head_dim": ((">=", 1),), "value_dim": ((">=", 1),), "conv_size": ((">=", 0),),
                  "gate_rank": ((">=", 1),), "chunk_size": ((">=", 1),), "norm_eps": ((">", 0),)}
    """Ranges of the numeric arguments, checked by the registry before the class is built."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        causal: bool = True,
        decay: Literal["none", "scalar", "vector"] = "vector",
        write: Literal["scalar", "vector"] = "vector",
        separate_kv_write: bool = False,
        allow_neg_eigval: bool = False,
        head_dim: int | None = None,
        value_dim: int | None = None,
        conv_size: int = 4,
        gate_rank: int | None = None,
        output_gate: Literal["swish", "sigmoid"] | None = None,
        chunk_size: int = 64,
        impl: Literal["auto", "chunk", "recurrent", "fla"] = "auto",
        gate_impl: Literal["auto", "triton", "torch"] = "auto",
        norm_eps: float = 1e-5,
        layer_idx: int = 0,
        n_layers: int = 1,
    ) -> None:
        super().__init__()
        if not causal:
            raise ValueError("delta-rule mixers are causal recurrences: causal=False is not supported "
                             "(use an attention mixer for bidirectional models)")
        if decay not in ("none", "scalar", "vector"):
            raise ValueError(f"decay must be 'none', 'scalar' or 'vector'; got {decay!r}")
        if write not in ("scalar", "vector"):
            raise ValueError(f"write must be 'scalar' or 'vector'; got {write!r}")
        if chunk_size not in TORCH_CHUNK_SIZES:
            raise ValueError(f"chunk_size={chunk_size} is not supported by the chunkwise path; "
                             f"choose from {TORCH_CHUNK_SIZES}")
        head_dim = resolve_head_dim("delta-rule", d_model, n_heads, head_dim)
        value_dim = head_dim if value_dim is None else value_dim
        if write == "vector" and not separate_kv_write and head_dim != value_dim:
            raise ValueError(f"FG²-GDN (write='vector' with tied key/value rates) needs d_k == d_v; got "
                             f"head_dim={head_dim}, value_dim={value_dim} (use fg2gdn_plus for d_k != d_v)")
        output_gate = output_gate or ("sigmoid" if decay == "vector" else "swish")
        if output_gate not in ("swish", "sigmoid"):
            raise ValueError(f"output_gate must be 'swish' or 'sigmoid'; got {output_gate!r}")
        h, K, V = n_heads, head_dim, value_dim
        r = gate_rank or V
        self.d_model, self.n_heads, self.head_dim, self.value_dim = d_model, h, K, V
        self.decay, self.write, self.separate = decay, write, separate_kv_write
        self.max_rate = 2.0 if allow_neg_eigval else 1.0
        self.chunk_size, self.impl, self.gate_impl = chunk_size, impl, gate_impl
        self.output_gate, self.layer_idx, self.causal = output_gate, layer_idx, True

        self.q_proj = nn.Linear(d_model, h * K, bias=False)
        self.k_proj = nn.Linear(d_model, h * K, bias=False)
        self.v_proj = nn.Linear(d_model, h * V, bias=False)
        self.conv_size = conv_size
        if conv_size > 0:
            self.q_conv, self.k_conv, self.v_conv = (ShortConv(n, conv_size, bias=False) for n in (h * K, h * K, h * V))
        # decay alpha = exp(g), g = -exp(A_log) * softplus(a + dt_bias)
        if decay == "scalar":
            self.a_proj = nn.Linear(d_model, h, bias=False)
            self.A_log = nn.Parameter(torch.empty(h))
            self.dt_bias = nn.Parameter(torch.empty(h))
        elif decay == "vector":
            self.a_proj = nn.Sequential(nn.Linear(d_model, r, bias=False), nn.Linear(r, h * K, bias=False))
            self.A_log = nn.Parameter(torch.empty(h))
            self.dt_bias = nn.Parameter(torch.empty(h * K))
        if decay != "none":
            no_weight_decay(self.A_log, self.dt_bias)
        # writing rates (logits)
        self.b_proj = self._rate_proj(d_model, h, K, r, write)
        if separate_kv_write:
            self.bv_proj = self._rate_proj(d_model, h, V, r, write)
        # output: RMSNorm over V gated by a projection (low-rank for KDA-style layers)
        if decay == "vector":
            self.g_proj = nn.Sequential(nn.Linear(d_model, r, bias=False), nn.Linear(r, h * V, bias=True))
        else:
            self.g_proj = nn.Linear(d_model, h * V, bias=False)
        self.o_norm = RMSNorm(V, eps=norm_eps)
        self.o_proj = nn.Linear(h * V, d_model, bias=False)
        self.o_proj._is_residual = True  # type: ignore[attr-defined]
        self.reset_parameters()

    @staticmethod
    def _rate_proj(d_model: int, h: int, dim: int, r: int, write: str) -> nn.Module:
        if write == "scalar":
            return nn.Linear(d_model, h, bias=False)
        return nn.Sequential(nn.Linear(d_model, r, bias=False), nn.Linear(r, h * dim, bias=True))

    def reset_parameters(self) -> None:
        """fla init: A ~ U(1, 16) (U(0, 16) for GDN), dt log-uniform in [1e-3, 0.1] stored as inverse softplus."""
        if self.decay == "none":
            return
        with torch.no_grad():
            lo = 1.0 if self.decay == "vector" else 0.0
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(lo, 16).clamp_min(1e-4).log())
            dt = torch.exp(torch.rand_like(self.dt_bias) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            dt = dt.clamp_min(1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    # ------------------------------------------------------------------ pieces
    def gates(self, x: Tensor) -> tuple[Tensor | None, Tensor, Tensor | None]:
        """Log-decay ``g`` and writing-rate logits ``(b^k, b^v)`` from ``x [B, T, D]``.

        Returns ``g`` ``[B, T, H]`` / ``[B, T, H, K]`` / None, ``b^k`` ``[B, T, H]`` /
        ``[B, T, H, K]``, ``b^v`` None / ``[B, T, H]`` / ``[B, T, H, V]`` (float32 or float64).
        """
        b, t, _ = x.shape
        h = self.n_heads
        calc = torch.float64 if x.dtype == torch.float64 else torch.float32
        g = None
        if self.decay != "none":
            a = self.a_proj(x).to(calc)
            if self.decay == "vector":
                a = (a + self.dt_bias.to(calc)).view(b, t, h, self.head_dim)
                g = -self.A_log.to(calc).exp()[:, None] * F.softplus(a)
            else:
                g = -self.A_log.to(calc).exp() * F.softplus(a + self.dt_bias.to(calc))
        shape = lambda z, d: z.view(b, t, h) if self.write == "scalar" else z.view(b, t, h, d)  # noqa: E731
        bk = shape(self.b_proj(x).to(calc), self.head_dim)
        bv = shape(self.bv_proj(x).to(calc), self.value_dim) if self.separate else None
        return g, bk, bv

    def forward(self, x: Tensor, coords: Coords | None = None, cache: dict | None = None,
                cu_seqlens: Tensor | None = None) -> Tensor:
        if cu_seqlens is not None and cache is not None:
            raise ValueError(f"{type(self).__name__}: cu_seqlens (packed training/prefill) cannot be combined with a "
                             "decoding cache; decode packed sequences one batch row each")
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.conv_size > 0:
            q = self.q_conv(q, cache, "conv_q", cu_seqlens)
            k = self.k_conv(k, cache, "conv_k", cu_seqlens)
            v = self.v_conv(v, cache, "conv_v", cu_seqlens)
        q, k, v, g, beta = self._rule_inputs(q, k, v, x)
        state = None if cache is None else cache.get("state")
        if state is not None and state.dtype in (torch.float16, torch.bfloat16):
            raise ValueError(f"{type(self).__name__}: cached recurrent state is {state.dtype}; keep it float32")
        o, new_state = delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=cache is not None,
                                  cu_seqlens=cu_seqlens, chunk_size=self.chunk_size, impl=self.impl)
        if cache is not None:
            cache["state"] = new_state
        return self._output(o, x)

    def _rule_inputs(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
        """Kernel-level inputs from the (convolved) projections ``q, k [B, T, H*K]``, ``v [B, T, H*V]`` and
        the layer input ``x [B, T, D]``: normalised ``q, k [B, T, H, K]``, ``v [B, T, H, V]`` (write rates
        folded in where they are channel-wise or separate), log-decay ``g`` and scalar rate ``beta``
        (``[B, T, H]`` or None), as :func:`~mixlab.ops.delta_rule.delta_rule` takes them."""
        b, t, _ = x.shape
        h, K, V = self.n_heads, self.head_dim, self.value_dim
        q, k, v = q.view(b, t, h, K), k.view(b, t, h, K), v.view(b, t, h, V)
        g, bk, bv = self.gates(x)
        q = F.normalize(q, dim=-1, eps=1e-6)  # fla: x * rsqrt(sum x^2 + eps) ~ normalize
        beta = None
        if self.write == "vector":
            k, v = fg2_gate_prep(k, v, bk, bv, max_rate=self.max_rate, impl=self.gate_impl)
        else:
            k = F.normalize(k, dim=-1, eps=1e-6)
            if self.separate:  # scalar beta^k, beta^v: fold square roots
                k = k * sqrt_sigmoid(bk, self.max_rate).unsqueeze(-1).to(k.dtype)
                v = v * sqrt_sigmoid(bv, self.max_rate).unsqueeze(-1).to(v.dtype)
            else:
                beta = torch.sigmoid(bk) * self.max_rate
        return q, k, v, g, beta

    def _output(self, o: Tensor, x: Tensor) -> Tensor:
        """Head outputs ``o [B, T, H, V]`` -> gated RMSNorm -> output projection ``[B, T, D]``."""
        b, t, _ = x.shape
        gate = self.g_proj(x).view(b, t, self.n_heads, self.value_dim)
        o = self.o_norm(o.to(gate.dtype))
        o = o * (F.silu(gate) if self.output_gate == "swish" else torch.sigmoid(gate))
        return self.o_proj(o.reshape(b, t, self.n_heads * self.value_dim))

    # ------------------------------------------------------------------ static decoding
    def static_cache(self, cache: dict, capacity: int) -> dict[str, Tensor] | None:
        """Static decoding buffers (see :meth:`Mixer.static_cache`; the state does not grow with
        ``capacity``): ``state [B, H, K, V]`` float32 (float64 for a float64 model), a copy of the
        prefill's final state; with a short convolution, the q/k/v tails side by side ``conv [B, W-1,
        2*H*K + H*V]`` and the three kernels the same way, ``conv_w [2*H*K + H*V, W]``, in the activation
        dtype (the three depthwise convolutions run as one: the same values, a third of the launches)."""
        if "state" not in cache:
            return None
        state = cache["state"]
        dt = self.v_proj.weight.dtype
        calc = torch.float64 if dt == torch.float64 else torch.float32
        out = {"state": state.to(calc).clone(memory_format=torch.contiguous_format)}
        if self.conv_size > 0:
            convs = [("conv_q", self.q_conv), ("conv_k", self.k_conv), ("conv_v", self.v_conv)]
            out.update(ShortConv.joint_static_buffers(convs, cache, state.shape[0], dt, state.device))
        return out

    def static_cache_bytes(self, batch: int, capacity: int, dtype: torch.dtype) -> int:
        h, K, V, w = self.n_heads, self.head_dim, self.value_dim, max(self.conv_size - 1, 0)
        return 8 * batch * h * K * V + batch * w * h * (2 * K + V) * torch.empty(0, dtype=dtype).element_size()

    def static_step(self, x: Tensor, state: dict[str, Tensor], pos: Tensor) -> Tensor:
        """One token (see :meth:`Mixer.static_step`; ``pos`` unused): the recurrence of
        :func:`~mixlab.ops.delta_rule.delta_rule_recurrent` on ``state["state"]`` in place::

            S <- Diag(exp(g)) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T (q / sqrt(K))
        """
        xb = x.unsqueeze(1)  # [B, 1, D]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [B, H*K], [B, H*K], [B, H*V]
        if self.conv_size > 0:  # the three short convolutions (SiLU, no bias) as one on [q | k | v]
            qkv = short_conv_step(torch.cat([q, k, v], -1), state["conv"], state["conv_w"], None, "silu")
            q, k, v = qkv.split([q.shape[-1], k.shape[-1], v.shape[-1]], -1)
        q, k, v, g, beta = self._rule_inputs(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), xb)
        S = state["state"]
        calc = S.dtype
        qf, kf, vf = q[:, 0].to(calc) * self.head_dim ** -0.5, k[:, 0].to(calc), v[:, 0].to(calc)
        if g is not None:  # [B, H, K] or [B, H] -> decay of the state's key rows
            S.mul_(g[:, 0].to(calc).exp().unsqueeze(-1) if g.dim() == 4 else g[:, 0].to(calc).exp()[..., None, None])
        err = vf - torch.einsum("bhk,bhkv->bhv", kf, S)
        if beta is not None:
            err = err * beta[:, 0].to(calc).unsqueeze(-1)
        S.add_(kf.unsqueeze(-1) * err.unsqueeze(-2))
        o = torch.einsum("bhk,bhkv->bhv", qf, S).to(v.dtype)  # [B, H, V]
        return self._output(o.unsqueeze(1), xb)[:, 0]
