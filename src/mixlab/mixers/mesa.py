"""MesaNet mixer (``mesa``): per-head regularised least squares solved by conjugate gradient.

Paper: von Oswald et al., "MesaNet: Sequence Modeling by Locally Optimal Test-Time
Training", arXiv 2506.05233 (Sec. 2, Eqs. 7-8; Appendix C-E). Math and implementations in
:mod:`mixlab.ops.mesa`.
"""

from __future__ import annotations

import math
import os
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixlab.coords import Coords
from mixlab.mixers.base import Mixer, check_choice, check_sizes, no_weight_decay, resolve_head_dim
from mixlab.mixers.layers import GatedRMSNorm, ShortConv, short_conv_step
from mixlab.ops.mesa import MAX_CG_ITERS, check_solver_args, mesa_net, mesa_step, mesa_step_inplace
from mixlab.registry import register_mixer

__all__ = ["Mesa"]


def _up(z: Tensor) -> Tensor:
    """float32 for low-precision activations; float64 stays float64 (tests)."""
    return z if z.dtype == torch.float64 else z.float()


@register_mixer("mesa")
class Mesa(Mixer):
    """Mesa layer (fla MesaNet recipe).

    ``q, k`` = SiLU short conv of linear projections, L2-normalised per head; ``v`` linear;
    forget gate ``g = logsigmoid(W_a x)``, input gate ``beta = sigmoid(W_b x)`` per head;
    ``Lambda = softplus(lambda_param) + lambda_floor`` ``[H, K]`` (initialised at
    ``lambda_init``); ``o_t = G_t^T (H_t + Lambda)^{-1} q_t`` by CG; head outputs go through
    an RMSNorm gated by ``swish(W_g x)``, then the output projection.

    Args:
        d_model, n_heads, causal, layer_idx, n_layers: backbone contract (causal only).
        head_dim: K = V per head (default ``d_model // n_heads``).
        conv_size: short-conv kernel (0 disables it).
        lambda_floor: lower bound of the regulariser diagonal (> 0; paper 0.25).
        lambda_init: initial ``Lambda`` value (> lambda_floor).
        cg_iters: CG iterations in training (fixed) and the cap in evaluation.
        cg_eps: training tolerance (``None`` = fixed count, the paper's setting).
        eval_cg_eps: evaluation/inference tolerance ``||r|| <= eps ||r_0||`` (paper 1e-4);
            ``None`` = fixed count also at evaluation.
        chunk_size: chunk of the torch path.
        impl: ``"auto"`` | ``"chunk"`` | ``"triton"`` | ``"fla"`` | ``"recurrent"`` | ``"exact"`` (see
            :func:`mixlab.ops.mesa.mesa_net`).
        negative_gates: forget gates ``gamma = 2 sigmoid(W_a x) - 1`` in ``(-1, 1)`` instead of
            ``sigmoid(W_a x)`` (MesaNet paper, parity experiments: state tracking needs sign
            flips; pair it with a large Lambda, the paper's ``lambda_init=50, lambda_floor=49``,
            so that ``H_t + Lambda`` stays positive definite). Runs the torch chunk path (fla's
            kernel takes log gates only).

    Forward: ``x [B, T, D]`` -> ``[B, T, D]``; ``cache`` holds ``state`` (h_kk, h_kv) and the
    conv tails; T = 1 steps run the per-token CG. :meth:`extra_metrics` reports the mean CG
    iterations per head of the last forward (``cg_iters/h{i}`` and ``cg_iters/mean``).

    Raises:
        ValueError: ``causal=False``; ``lambda_floor <= 0``; ``lambda_init <= lambda_floor``;
            ``cg_iters`` outside ``[1, MAX_CG_ITERS]`` (1000); ``cg_eps``/``eval_cg_eps <= 0``; bad head sizes.
    """

    arg_bounds = {"head_dim": ((">=", 1),), "conv_size": ((">=", 0),), "lambda_floor": ((">", 0),),
                  "lambda_init": ((">", 0),), "cg_iters": ((">=", 1), ("<=", MAX_CG_ITERS)), "cg_eps": ((">", 0),),
                  "eval_cg_eps": ((">", 0),), "chunk_size": ((">=", 1),), "norm_eps": ((">", 0),)}
    """Ranges of the numeric arguments, checked by the registry before the class is built."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        causal: bool = True,
        layer_idx: int = 0,
        n_layers: int = 1,
        head_dim: int | None = None,
        conv_size: int = 4,
        lambda_floor: float = 0.25,
        lambda_init: float = 1.0,
        cg_iters: int = 30,
        cg_eps: float | None = None,
        eval_cg_eps: float | None = 1e-4,
        chunk_size: int = 64,
        impl: str = "auto",
        norm_eps: float = 1e-5,
        negative_gates: bool = False,
    ) -> None:
        super().__init__()
        if not causal:
            raise ValueError("mesa mixer: causal=False is not supported (the regression is over past tokens)")
        if not lambda_floor > 0:
            raise ValueError(f"mesa mixer: lambda_floor must be > 0; got {lambda_floor}")
        if not lambda_init > lambda_floor:
            raise ValueError(f"mesa mixer: lambda_init={lambda_init} must exceed lambda_floor={lambda_floor}")
        check_solver_args(cg_iters, cg_eps)
        check_solver_args(cg_iters, eval_cg_eps, eps_name="eval_cg_eps")
        check_sizes("mesa", head_dim=head_dim, chunk_size=chunk_size)
        check_sizes("mesa", minimum=0, conv_size=conv_size)
        check_choice("mesa", "impl", impl, ("auto", "chunk", "triton", "fla", "recurrent", "exact"))
        head_dim = resolve_head_dim("mesa", d_model, n_heads, head_dim)
        self.d_model, self.n_heads, self.head_dim, self.layer_idx = d_model, n_heads, head_dim, layer_idx
        self.lambda_floor, self.lambda_init = lambda_floor, lambda_init
        self.cg_iters, self.cg_eps, self.eval_cg_eps = cg_iters, cg_eps, eval_cg_eps
        self.chunk_size, self.impl = chunk_size, impl
        self.negative_gates = negative_gates
        hk = n_heads * head_dim
        self.q_proj = nn.Linear(d_model, hk, bias=False)
        self.k_proj = nn.Linear(d_model, hk, bias=False)
        self.v_proj = nn.Linear(d_model, hk, bias=False)
        self.a_proj = nn.Linear(d_model, n_heads, bias=True)
        self.b_proj = nn.Linear(d_model, n_heads, bias=True)
        self.g_proj = nn.Linear(d_model, hk, bias=False)
        self.q_conv = ShortConv(hk, conv_size) if conv_size > 0 else None
        self.k_conv = ShortConv(hk, conv_size) if conv_size > 0 else None
        self.lambda_param = nn.Parameter(torch.empty(n_heads, head_dim))
        no_weight_decay(self.lambda_param, self.a_proj.bias, self.b_proj.bias)
        self.norm = GatedRMSNorm(head_dim, eps=norm_eps, activation="swish")
        self.o_proj = nn.Linear(hk, d_model, bias=False)
        self.o_proj._is_residual = True  # type: ignore[attr-defined]
        self._last_iters: Tensor | None = None
        self._decode_cg: str | None = None  # the static step's solve ("torch" / "triton"), set by static_cache
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            # softplus(p) + floor = lambda_init
            self.lambda_param.fill_(math.log(math.expm1(self.lambda_init - self.lambda_floor)))
            nn.init.zeros_(self.a_proj.bias)
            nn.init.zeros_(self.b_proj.bias)
        for m in (self.q_conv, self.k_conv, self.norm):
            if m is not None:
                m.reset_parameters()

    def lamb(self) -> Tensor:
        """Regulariser diagonal ``[H, K]`` float32 (float64 for float64 params):
        ``softplus(lambda_param) + lambda_floor``."""
        return F.softplus(_up(self.lambda_param)) + self.lambda_floor

    def solver(self) -> tuple[int, float | None]:
        """(iteration count / cap, tolerance) for the current mode (train / eval)."""
        return self.cg_iters, (self.cg_eps if self.training else self.eval_cg_eps)

    def _inputs(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor, Tensor]:
        """Op inputs from the (convolved) projections ``q, k, v [B, T, H*K]`` and the layer input
        ``x [B, T, D]``: L2-normalised ``q, k`` and ``v [B, T, H, K]`` (dtype of v), log forget gate ``g``,
        its sign (None without ``negative_gates``) and input gate ``beta`` ``[B, T, H]`` (float32/64),
        ``lamb [H, K]`` (dtype of g)."""
        b, t, _ = x.shape
        h, d = self.n_heads, self.head_dim
        q = F.normalize(_up(q.view(b, t, h, d)), dim=-1).to(v.dtype)
        k = F.normalize(_up(k.view(b, t, h, d)), dim=-1).to(v.dtype)
        v = v.view(b, t, h, d)
        a = _up(self.a_proj(x))
        if self.negative_gates:  # gamma = 2 sigmoid(a) - 1 = tanh(a / 2) = sign * exp(g)
            g = torch.tanh(0.5 * a).abs().clamp_min(1e-6).log()
            sign = torch.where(a >= 0, 1.0, -1.0).to(a.dtype)
        else:
            g, sign = F.logsigmoid(a), None
        beta = torch.sigmoid(_up(self.b_proj(x)))
        return q, k, v, g, sign, beta, self.lamb().to(g.dtype)

    def _output(self, o: Tensor, x: Tensor) -> Tensor:
        """Head outputs ``o [B, T, H, K]`` -> RMSNorm gated by ``swish(W_g x)`` -> output projection."""
        b, t, _ = x.shape
        h, d = self.n_heads, self.head_dim
        o = self.norm(o, self.g_proj(x).view(b, t, h, d))
        return self.o_proj(o.reshape(b, t, h * d).to(x.dtype))

    def forward(self, x: Tensor, coords: Coords | None = None, cache: dict | None = None) -> Tensor:
        t, h = x.shape[1], self.n_heads
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_conv is not None:
            q, k = self.q_conv(q, cache, "q_conv"), self.k_conv(k, cache, "k_conv")
        q, k, v, g, sign, beta, lamb = self._inputs(q, k, v, x)
        iters_n, eps = self.solver()
        state = cache.get("state") if cache is not None else None
        if cache is not None and t == 1:
            o, state, iters = mesa_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], lamb, state, iters_n, eps,
                                        None if sign is None else sign[:, 0])
            o, iters = o.unsqueeze(1).to(v.dtype), iters.unsqueeze(1)
        else:
            o, state, iters = mesa_net(q, k, v, g, beta, lamb, iters_n, eps, self.chunk_size, state,
                                       output_final_state=cache is not None, impl=self.impl, gate_sign=sign)
        if cache is not None:
            cache["state"] = tuple(s.detach() for s in state)
        if iters is None:  # fla path: fixed count
            self._last_iters = torch.full((h,), float(iters_n), device=x.device)
        else:
            self._last_iters = iters.float().mean(dim=(0, 1)).detach()
        return self._output(o, x)

    # ------------------------------------------------------------------ static decoding
    def static_cache(self, cache: dict, capacity: int) -> dict[str, Tensor] | None:
        """Static decoding buffers (see :meth:`Mixer.static_cache`; the state does not grow with
        ``capacity``): ``h_kk [B, H, K, K]`` and ``h_kv [B, H, K, K]`` float32 (float64 for a float64 model),
        copies of the prefill's state, and the q and k short convolutions side by side: tails ``conv [B, W-1,
        2*H*K]``, kernels ``conv_w [2*H*K, W]`` and biases ``conv_b [2*H*K]`` in the activation dtype."""
        if "state" not in cache:
            return None
        calc = torch.float64 if self.v_proj.weight.dtype == torch.float64 else torch.float32
        h_kk, h_kv = cache["state"]
        fixed = lambda z: z.to(calc).clone(memory_format=torch.contiguous_format)  # noqa: E731
        out = {"h_kk": fixed(h_kk), "h_kv": fixed(h_kv)}
        if self.q_conv is not None:  # the q and k convolutions side by side: one step on [q | k]
            convs = [("q_conv", self.q_conv), ("k_conv", self.k_conv)]
            out.update(ShortConv.joint_static_buffers(convs, cache, h_kk.shape[0], self.v_proj.weight.dtype,
                                                      h_kk.device))
        self._decode_cg = self._pick_decode_cg(out["h_kk"])
        return out

    def _pick_decode_cg(self, h_kk: Tensor) -> str:
        """The solve of :meth:`static_step`, chosen once per static cache (outside any graph): ``"triton"`` on
        CUDA in float32 for ``head_dim <= 128`` if a probe solve (one system of the decoding shape; it also
        compiles the kernel) fits the GPU, else ``"torch"``; ``MIXLAB_MESA_DECODE_CG=torch|triton`` forces it."""
        forced = os.environ.get("MIXLAB_MESA_DECODE_CG")
        if forced:
            return forced
        if not (h_kk.is_cuda and h_kk.dtype == torch.float32 and self.head_dim <= 128):
            return "torch"
        from mixlab.ops.mesa_triton import TritonCGUnfit, solve_dense_triton

        d = self.head_dim
        try:
            solve_dense_triton(torch.eye(d, device=h_kk.device)[None], h_kk.new_ones(1, d), h_kk.new_ones(1, d),
                               *self.solver())
        except TritonCGUnfit as err:
            warnings.warn(f"{err}; Mesa decodes with the torch CG", stacklevel=2)
            return "torch"
        return "triton"

    def static_cache_bytes(self, batch: int, capacity: int, dtype: torch.dtype) -> int:
        h, d = self.n_heads, self.head_dim
        w = self.q_conv.kernel_size - 1 if self.q_conv is not None else 0
        return 8 * batch * h * 2 * d * d + batch * w * 2 * h * d * torch.empty(0, dtype=dtype).element_size()

    def static_step(self, x: Tensor, state: dict[str, Tensor], pos: Tensor) -> Tensor:
        """One token (see :meth:`Mixer.static_step`; ``pos`` unused) by
        :func:`~mixlab.ops.mesa.mesa_step_inplace`: the state updated in place, then the solve without a
        host sync, so the step is graph-capturable. On CPU (and float64, or ``head_dim > 128``) the torch
        CG applies the adaptive tolerance by masks (a converged system stops changing: the output equals the
        early-stopping solve of the dict-cache path) and runs all ``cg_iters`` iterations on CUDA or compiled,
        but ends when every system has converged when run eagerly on a CPU; on CUDA
        in float32 one Triton kernel (:func:`~mixlab.ops.mesa_triton.mesa_cg_triton`) runs the loop and
        the per-system stopping on the device (float32-accurate, not bitwise the torch CG), unless it does
        not fit the GPU (:meth:`_pick_decode_cg`, decided when the static cache is built). Does not update
        :meth:`extra_metrics`."""
        xb = x.unsqueeze(1)  # [B, 1, D]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_conv is not None:
            qk = short_conv_step(torch.cat([q, k], -1), state["conv"], state["conv_w"], state["conv_b"], "silu")
            q, k = qk.chunk(2, -1)
        q, k, v, g, sign, beta, lamb = self._inputs(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), xb)
        iters_n, eps = self.solver()
        cg_impl = self._decode_cg or self._pick_decode_cg(state["h_kk"])
        o = mesa_step_inplace(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], lamb, (state["h_kk"], state["h_kv"]),
                              iters_n, eps, None if sign is None else sign[:, 0], cg_impl=cg_impl)
        return self._output(o.unsqueeze(1).to(v.dtype), xb)[:, 0]

    def extra_metrics(self) -> dict[str, Tensor]:
        """Mean CG iterations of the last forward: per head (``cg_iters/h{i}``) and over heads."""
        if self._last_iters is None:
            return {}
        out = {f"cg_iters/h{i}": it for i, it in enumerate(self._last_iters)}
        out["cg_iters/mean"] = self._last_iters.mean()
        return out
