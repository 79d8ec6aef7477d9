"""MesaNet ops (von Oswald et al., arXiv 2506.05233): locally optimal test-time regression.

Per head, with forget gate ``gamma_t = exp(g_t)`` and input gate ``beta_t``::

    H_t = gamma_t H_{t-1} + beta_t k_t k_t^T          [K, K]   (paper Eq. 7)
    G_t = gamma_t G_{t-1} + beta_t k_t v_t^T          [K, V]   (fla layout: G^T of the paper)
    (H_t + Lambda) q*_t = q_t,   o_t = G_t^T q*_t              (paper Eq. 8)

``Lambda = diag(lamb)`` with ``lamb > 0``. Negative forget gates (the MesaNet paper's parity
variant, ``gamma_t`` in ``[-1, 1]``) are passed as ``gamma_t = gate_sign_t * exp(g_t)`` with
``gate_sign [B, T, H]`` in ``{-1, +1}`` (``None``: all positive); H_t is then indefinite and
Lambda must dominate it (the paper starts Lambda at 50 I with lower bound 49). The linear system is solved by conjugate
gradient (paper Appendix C, Algorithm 1) from ``x_0 = 0`` with either a fixed iteration
count (training, 30 in the paper) or adaptive stopping ``||r_j|| <= eps ||r_0||`` with an
iteration cap (inference, eps = 1e-4).

Layout (fla): q, k ``[B, T, H, K]``; v ``[B, T, H, V]``; g, beta ``[B, T, H]`` (g is the
natural log of the forget gate, ``<= 0``, not cumsummed); lamb ``[H, K]``; states
``(h_kk [B, H, K, K], h_kv [B, H, K, V])`` float32 (float64 when inputs are float64).

Implementations (all compute in float32, or float64 for float64 inputs):

* :func:`mesa_exact` - per-token states and ``torch.linalg.solve`` (reference).
* :func:`mesa_recurrent` - per-token loop with CG (reference; also the decoding step).
* :func:`mesa_chunk` - chunkwise torch path: states at chunk boundaries, intra-chunk
  matmuls, CG over all tokens at once (paper Appendix D); adaptive CG drops finished
  chunks from the working set. Backward solves the adjoint system
  ``(H_t + Lambda) u_t = G_t do_t`` (not by differentiating CG iterations).
  The backward is written out (:func:`_chunk_backward`): batched products per chunk, the states
  carried over chunks as one product with the chunk-to-chunk decay matrix, no autograd graph.
  ``cg_impl="triton"`` (and ``"auto"`` where the kernel serves) runs both solves in one Triton
  program per chunk with per-token adaptive stopping (:mod:`mixlab.ops.mesa_triton`); its forward
  reads q, k, v in place (chunk-start states, CG and read-out in three kernels), and its backward
  carries the state gradients back by reverse Triton scans. The CG takes one float16 product per
  step for an inference forward and for bf16/fp16 inputs (output ~2e-4 from the float64 solve) and
  float32-accurate products for differentiated float32 inputs (:func:`_cg_prec`).
* :func:`mesa_net` - dispatch; on CUDA the fixed-count path goes to fla-core's
  ``chunk_mesa_net`` (fp16 q/k, CG denominators floored at 1e-5, K <= 128, K == V).
"""

from __future__ import annotations

import os
import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from mixlab.ops import fla

__all__ = [
    "conjugate_gradient",
    "mesa_states",
    "mesa_exact",
    "mesa_step",
    "mesa_step_inplace",
    "mesa_recurrent",
    "mesa_chunk",
    "mesa_net",
    "check_mesa_inputs",
    "FLA_MAX_HEAD_DIM",
]

FLA_MAX_HEAD_DIM = fla.LIMITS["mesa"]["max_dim"]
State = tuple[Tensor, Tensor]


# ---------------------------------------------------------------------------- checks

def _cg_update(x: Tensor, r: Tensor, p: Tensor, delta: Tensor, ap: Tensor, active: Tensor, tiny: float):
    """One conjugate-gradient step (Hestenes-Stiefel) for the ``active`` systems; others unchanged.

    ``x, r, p, ap [..., K]``, ``delta = r.r [...]``, ``active [...]`` bool. Returns the new
    ``(x, r, p, delta)``.
    """
    alpha = torch.where(active, delta / (p * ap).sum(-1).clamp_min(tiny), torch.zeros_like(delta))
    x = x + alpha.unsqueeze(-1) * p
    r = r - alpha.unsqueeze(-1) * ap
    delta_new = (r * r).sum(-1)
    step = torch.where(active, delta_new / delta.clamp_min(tiny), torch.zeros_like(delta))
    p = torch.where(active.unsqueeze(-1), r + step.unsqueeze(-1) * p, p)
    return x, r, p, torch.where(active, delta_new, delta)

MAX_CG_ITERS = 1000
"""The largest CG iteration count / cap taken. CG on the ``K x K`` system of a head converges in at most ``K``
iterations in exact arithmetic (the paper trains with 30 at K = 128); a count far above that only spends time
(``cg_iters: 1e9`` ran as a hang)."""


def check_solver_args(cg_iters: int, cg_eps: float | None, eps_name: str = "cg_eps") -> None:
    """Raises ValueError for a CG cap outside ``[1, MAX_CG_ITERS]`` or a non-positive tolerance (named ``eps_name``)."""
    if not isinstance(cg_iters, int) or not 1 <= cg_iters <= MAX_CG_ITERS:
        raise ValueError(f"mesa: cg_iters (CG iteration count / cap) must be an integer in [1, {MAX_CG_ITERS}] (CG "
                         f"converges in at most head_dim iterations in exact arithmetic); got {cg_iters!r}")
    if cg_eps is not None and (isinstance(cg_eps, bool) or not isinstance(cg_eps, (int, float)) or not cg_eps > 0):
        raise ValueError(f"mesa: {eps_name} (adaptive CG tolerance) must be > 0 or None (fixed count); got {cg_eps!r}")


def check_mesa_inputs(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, lamb: Tensor,
                      initial_state: State | None = None) -> None:
    """Shape checks shared by every Mesa implementation, and ``lamb > 0`` where that costs no host sync
    (CPU tensors, outside ``torch.compile``; on CUDA a non-positive Lambda gives NaN, unchecked).

    Raises:
        ValueError: naming the argument whose shape does not match q ``[B, T, H, K]``, an
            ``initial_state`` that is not a pair, or a non-positive ``lamb`` on the CPU.
    """
    if q.dim() != 4:
        raise ValueError(f"mesa: q must be [B, T, H, K]; got shape {tuple(q.shape)}")
    b, t, h, dk = q.shape
    if k.shape != q.shape:
        raise ValueError(f"mesa: k shape {tuple(k.shape)} != q shape {tuple(q.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"mesa: v must be [B, T, H, V] = [{b}, {t}, {h}, V]; got {tuple(v.shape)}")
    for name, z in (("g", g), ("beta", beta)):
        if z.shape != (b, t, h):
            raise ValueError(f"mesa: {name} must be [B, T, H] = [{b}, {t}, {h}]; got {tuple(z.shape)}")
    if lamb.shape != (h, dk):
        raise ValueError(f"mesa: lamb must be [H, K] = [{h}, {dk}]; got {tuple(lamb.shape)}")
    if lamb.device.type == "cpu" and not torch.compiler.is_compiling() and not bool((lamb > 0).all()):
        raise ValueError(f"mesa: lamb (the regulariser diagonal Lambda) must be > 0; got min {float(lamb.min())}")
    if initial_state is not None:
        if not (isinstance(initial_state, (tuple, list)) and len(initial_state) == 2):
            raise ValueError("mesa: initial_state must be a pair (h_kk [B, H, K, K], h_kv [B, H, K, V]); got "
                             f"{type(initial_state).__name__} of length {len(initial_state)}"
                             if isinstance(initial_state, (tuple, list)) else
                             f"mesa: initial_state must be a pair (h_kk, h_kv); got {type(initial_state).__name__}")
        h_kk, h_kv = initial_state
        if h_kk.shape != (b, h, dk, dk) or h_kv.shape != (b, h, dk, v.shape[-1]):
            raise ValueError(f"mesa: initial_state must be (h_kk [B, H, K, K], h_kv [B, H, K, V]); got "
                             f"{tuple(h_kk.shape)}, {tuple(h_kv.shape)}")


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _gamma(g: Tensor, sign: Tensor | None) -> Tensor:
    """Forget gate ``sign * exp(g)`` (``exp(g)`` without a sign)."""
    return g.exp() if sign is None else sign.to(g.dtype) * g.exp()


def _check_sign(gate_sign: Tensor | None, g: Tensor) -> None:
    if gate_sign is not None and gate_sign.shape != g.shape:
        raise ValueError(f"mesa: gate_sign must be [B, T, H] like g {tuple(g.shape)}; got {tuple(gate_sign.shape)}")


# ---------------------------------------------------------------------------- CG
def conjugate_gradient(matvec: Callable[[Tensor], Tensor], b: Tensor, max_iter: int, eps: float | None = None,
                       early_stop: bool = True) -> tuple[Tensor, Tensor]:
    """Batched conjugate gradient for SPD systems ``A x = b`` from ``x_0 = 0`` (paper Alg. 1).

    Args:
        matvec: ``p [..., K] -> A p [..., K]`` (one SPD matrix per leading index).
        b: right-hand sides ``[..., K]`` float.
        max_iter: fixed iteration count (``eps=None``) or cap (adaptive).
        eps: adaptive stopping ``||r_j|| <= eps ||r_0||`` per system; ``None`` = fixed count.
        early_stop: with ``eps``, end the loop once every system has converged (one host sync per
            iteration); ``False`` runs all ``max_iter`` iterations with converged systems masked
            (unchanged), the same result without a sync (CUDA-graph capturable).

    Returns:
        ``x [..., K]`` and iteration counts ``[...]`` int32: updates applied per system; in
        fixed-count mode, steps taken after the squared residual reached exactly 0 (e.g. by
        float32 underflow after convergence) are not counted.

    Raises:
        ValueError: ``max_iter < 1`` or ``eps <= 0``.
    """
    check_solver_args(max_iter, eps)
    tiny = torch.finfo(b.dtype).tiny
    if eps is None and not torch.is_grad_enabled():
        return _cg_fixed(matvec, b, max_iter, tiny)
    x = torch.zeros_like(b)
    r = b.clone()
    p = r.clone()
    delta = (r * r).sum(-1)
    thresh = delta * (eps * eps) if eps is not None else torch.zeros_like(delta)
    iters = torch.zeros(delta.shape, dtype=torch.int32, device=b.device)
    for _ in range(max_iter):
        active = delta > thresh
        if eps is not None and early_stop and not bool(active.any()):
            break
        x, r, p, delta = _cg_update(x, r, p, delta, matvec(p), active, tiny)
        iters += active.to(torch.int32)
    return x, iters


def _cg_fixed(matvec: Callable[[Tensor], Tensor], b: Tensor, max_iter: int, tiny: float) -> tuple[Tensor, Tensor]:
    """Fixed-count CG without masks, in place (no autograd). A system whose residual reaches
    exactly 0 keeps ``alpha = 0 / tiny = 0`` and ``p = 0`` from then on (no NaN)."""
    x = torch.zeros_like(b)
    r = b.clone()
    p = r.clone()
    delta = (r * r).sum(-1)
    iters = torch.zeros(delta.shape, dtype=torch.int32, device=b.device)
    for _ in range(max_iter):
        iters += delta > 0
        ap = matvec(p)
        alpha = (delta / (p * ap).sum(-1).clamp_min_(tiny)).unsqueeze_(-1)
        x.addcmul_(alpha, p)
        r.addcmul_(alpha, ap, value=-1.0)
        delta_new = (r * r).sum(-1)
        step = (delta_new / delta.clamp_min_(tiny)).unsqueeze_(-1)
        p.mul_(step).add_(r)
        delta = delta_new
    return x, iters


# ---------------------------------------------------------------------------- references
def mesa_states(k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: State | None = None,
                gate_sign: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per-token statistics by the recurrence (reference; ``O(T K^2)`` memory).

    ``gate_sign [B, T, H]`` (+-1) or None: forget gate ``gamma_t = gate_sign_t exp(g_t)``.

    Returns:
        ``H [B, T, H, K, K]`` and ``G [B, T, H, K, V]`` in the compute dtype.
    """
    dt = _compute_dtype(k)
    k, v, g, beta = k.to(dt), v.to(dt), g.to(dt), beta.to(dt)
    b, t, h, dk = k.shape
    if initial_state is None:
        h_kk = k.new_zeros(b, h, dk, dk)
        h_kv = k.new_zeros(b, h, dk, v.shape[-1])
    else:
        h_kk, h_kv = (s.to(dt) for s in initial_state)
    hs, gs = [], []
    for i in range(t):
        decay = _gamma(g[:, i], None if gate_sign is None else gate_sign[:, i])[..., None, None]
        kb = k[:, i] * beta[:, i, :, None]
        h_kk = decay * h_kk + kb.unsqueeze(-1) * k[:, i].unsqueeze(-2)
        h_kv = decay * h_kv + kb.unsqueeze(-1) * v[:, i].unsqueeze(-2)
        hs.append(h_kk)
        gs.append(h_kv)
    return torch.stack(hs, 1), torch.stack(gs, 1)


def mesa_exact(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, lamb: Tensor,
               initial_state: State | None = None, output_final_state: bool = False,
               gate_sign: Tensor | None = None) -> tuple[Tensor, State | None]:
    """Exact Mesa output with ``torch.linalg.solve`` per token (reference, differentiable).

    Returns:
        ``o [B, T, H, V]`` (dtype of v) and the final state or ``None``.
    """
    check_mesa_inputs(q, k, v, g, beta, lamb, initial_state)
    _check_sign(gate_sign, g)
    dt = _compute_dtype(q)
    hs, gs = mesa_states(k, v, g, beta, initial_state, gate_sign)
    a = hs + torch.diag_embed(lamb.to(dt))
    x = torch.linalg.solve(a, q.to(dt).unsqueeze(-1)).squeeze(-1)
    o = torch.einsum("bthk,bthkv->bthv", x, gs)
    final = (hs[:, -1], gs[:, -1]) if output_final_state and q.shape[1] else None
    return o.to(v.dtype), final


def mesa_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, lamb: Tensor, state: State | None,
              cg_iters: int = 30, cg_eps: float | None = None, gate_sign: Tensor | None = None
              ) -> tuple[Tensor, State, Tensor]:
    """One token: q, k ``[B, H, K]``, v ``[B, H, V]``, g, beta (and gate_sign) ``[B, H]``, lamb ``[H, K]``.

    Returns:
        ``o [B, H, V]`` (compute dtype), the new state, CG iterations ``[B, H]``.
    """
    dt = _compute_dtype(q)
    q, k, v, g, beta, lamb = (z.to(dt) for z in (q, k, v, g, beta, lamb))
    b, h, dk = q.shape
    if state is None:
        h_kk, h_kv = q.new_zeros(b, h, dk, dk), q.new_zeros(b, h, dk, v.shape[-1])
    else:
        h_kk, h_kv = (s.to(dt) for s in state)
    decay = _gamma(g, gate_sign)[..., None, None]
    kb = k * beta.unsqueeze(-1)
    h_kk = decay * h_kk + kb.unsqueeze(-1) * k.unsqueeze(-2)
    h_kv = decay * h_kv + kb.unsqueeze(-1) * v.unsqueeze(-2)
    x, iters = conjugate_gradient(lambda p: (p.unsqueeze(-2) @ h_kk).squeeze(-2) + lamb * p, q, cg_iters, cg_eps)
    o = (x.unsqueeze(-2) @ h_kv).squeeze(-2)
    return o, (h_kk, h_kv), iters


def mesa_step_inplace(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, lamb: Tensor, state: State,
                      cg_iters: int = 30, cg_eps: float | None = None, gate_sign: Tensor | None = None,
                      cg_impl: str = "torch") -> Tensor:
    """:func:`mesa_step` on fixed buffers: ``state = (h_kk [B, H, K, K], h_kv [B, H, K, V])`` (float32 /
    float64, the compute dtype) is updated in place, and the solve has no host sync, so the step can be
    captured in a CUDA graph.

    ``cg_impl="torch"``: on CUDA or under ``torch.compile`` CG always runs ``cg_iters`` iterations (with
    ``cg_eps`` the tolerance masks converged systems instead of ending the loop; same output as
    :func:`mesa_step`); eagerly on a CPU it ends once every system has converged (one host check per
    iteration; the same output). ``"triton"``: one
    launch of :func:`mixlab.ops.mesa_triton.solve_dense_triton` for all ``B * H`` systems (the loop and the
    per-system stopping run on the device; float32 only, ``K <= 128``; float32-accurate products, not
    bitwise the torch CG).

    Returns:
        ``o [B, H, V]`` in the compute dtype.
    """
    h_kk, h_kv = state
    dt = h_kk.dtype
    q, k, v, g, beta, lamb = (z.to(dt) for z in (q, k, v, g, beta, lamb))
    decay = _gamma(g, gate_sign)[..., None, None]
    kb = k * beta.unsqueeze(-1)
    h_kk.mul_(decay).add_(kb.unsqueeze(-1) * k.unsqueeze(-2))
    h_kv.mul_(decay).add_(kb.unsqueeze(-1) * v.unsqueeze(-2))
    if cg_impl == "triton":
        from mixlab.ops.mesa_triton import solve_dense_triton

        b, h, dk = q.shape
        x = solve_dense_triton(h_kk.reshape(b * h, dk, dk), lamb.expand(b, h, dk).reshape(b * h, dk),
                               q.reshape(b * h, dk), cg_iters, cg_eps).view(b, h, dk)
    else:
        # no host sync where a CUDA graph may capture the step or Dynamo traces it; on a CPU, eagerly, the loop
        # ends once every system has converged (the same output; the full cap made Mesa's static decoding
        # 0.3-0.4x the dict loop there: bench_decode.py --quick)
        stop = q.device.type == "cpu" and not torch.compiler.is_compiling()
        x, _ = conjugate_gradient(lambda p: (p.unsqueeze(-2) @ h_kk).squeeze(-2) + lamb * p, q, cg_iters, cg_eps,
                                  early_stop=stop)
    return (x.unsqueeze(-2) @ h_kv).squeeze(-2)


def mesa_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, lamb: Tensor, cg_iters: int = 30,
                   cg_eps: float | None = None, initial_state: State | None = None, output_final_state: bool = False,
                   gate_sign: Tensor | None = None) -> tuple[Tensor, State | None, Tensor]:
    """Per-token loop with CG (reference; the decoding path).

    Returns:
        ``o [B, T, H, V]`` (dtype of v), final state or ``None``, CG iterations ``[B, T, H]`` int32.
    """
    check_mesa_inputs(q, k, v, g, beta, lamb, initial_state)
    check_solver_args(cg_iters, cg_eps)
    _check_sign(gate_sign, g)
    state = initial_state
    os, its = [], []
    for i in range(q.shape[1]):
        o, state, it = mesa_step(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], lamb, state, cg_iters, cg_eps,
                                 None if gate_sign is None else gate_sign[:, i])
        os.append(o)
        its.append(it)
    o = torch.stack(os, 1).to(v.dtype)
    return o, (state if output_final_state else None), torch.stack(its, 1)


# ---------------------------------------------------------------------------- chunkwise
class _Chunks:
    """Chunked view of one Mesa call: tensors ``[M = B*H*N, C, ...]`` plus chunk-start states.

    ``D[t, i] = beta_i exp(gc_t - gc_i)`` for ``i <= t`` (0 above the diagonal; ``D0`` without beta),
    ``dq[t] = exp(gc_t)`` with ``gc`` the within-chunk cumulative log forget gate, ``w[i] = beta_i
    exp(gc_L - gc_i)`` each key's weight at the chunk end (``w0`` without beta), ``last = exp(gc_L)``
    the chunk's total decay. With negative gates, ``sc`` (the within-chunk cumulative product of the
    signs) multiplies every decay: ``D[t, i] *= sc_t sc_i``, ``dq[t] *= sc_t``, ``w[i] *= sc_L sc_i``
    (a ratio of +-1 products is their product). The chunk-start states come from
    ``S_{n+1} = last_n S_n + (k_n * w_n)^T (k_n | v_n)`` as one product with the chunk-to-chunk decay
    matrix (:meth:`scan`), or, with ``states="triton"``, from
    :func:`mixlab.ops.mesa_triton.chunk_states_triton` (float32 CUDA). Not differentiable: the
    backward of :class:`_MesaChunkFunction` is written out (:func:`_chunk_backward`).
    """

    def __init__(self, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, h0: State | None, chunk_size: int,
                 sign: Tensor | None = None, states: str = "torch") -> None:
        b, t, h, dk = k.shape
        dv = v.shape[-1]
        c = max(1, min(chunk_size, t))
        n = -(-t // c)
        pad = n * c - t
        self.shape = (b, t, h, dk, dv, c, n, pad)
        self.dtype = g.dtype  # the compute dtype; k and v may come in another float dtype
        kc, vc = (self.chunk_view(z).view(b, h, n, c, -1) for z in (k, v))
        gc, bc, sc = _chunk_gates(g, beta, sign, c)  # [B, H, N, C]
        tri = torch.ones(c, c, dtype=torch.bool, device=k.device).tril()
        diff = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(~tri, float("-inf"))
        D0, dq, w0 = diff.exp(), gc.exp(), (gc[..., -1:] - gc).exp()
        self.log_last, self.sign_last = gc[..., -1], None  # [B, H, N]
        if sc is not None:
            D0 = D0 * (sc.unsqueeze(-1) * sc.unsqueeze(-2))
            dq, w0 = dq * sc, w0 * (sc[..., -1:] * sc)
            self.sign_last = sc[..., -1]
        self.last = self.log_last.exp() if sc is None else self.log_last.exp() * self.sign_last
        m = b * h * n
        w = w0 * bc
        self.D0 = D0.reshape(m, c, c)
        self.D = (D0 * bc.unsqueeze(-2)).reshape(m, c, c)
        self.dq, self.w0, self.w = dq.reshape(m, c), w0.reshape(m, c), w.reshape(m, c)
        self._z = None
        self.triton = states == "triton"
        if states == "triton":  # float32 CUDA: one Triton scan per statistic, k and v read in place
            from mixlab.ops.mesa_triton import chunk_states_triton
            wf, lastf = w.reshape(b * h, n, c), self.last.reshape(b * h, n)
            k, v = (z if z.stride(-1) == 1 else z.contiguous() for z in (k, v))
            s0 = (None, None) if h0 is None else (h0[0].reshape(b * h, dk, dk), h0[1].reshape(b * h, dk, dv))
            hk, fk = chunk_states_triton(k, k, lastf, s0[0], w=wf, chunk_size=c)
            hv, fv = chunk_states_triton(k, v, lastf, s0[1], w=wf, chunk_size=c)
            self.final = (fk.view(b, h, dk, dk), fv.view(b, h, dk, dv))
        else:  # every chunk's own contribution in one product, then the scan over chunks as one product
            kw = kc * w.unsqueeze(-1)  # [B, H, N, C, K]
            hk, fk = self.scan(kw.transpose(-1, -2) @ kc, None if h0 is None else h0[0])
            hv, fv = self.scan(kw.transpose(-1, -2) @ vc, None if h0 is None else h0[1])
            self.final = (fk, fv)
        self.H = hk.reshape(m, dk, dk)
        self.G = hv.reshape(m, dk, dv)
        self.k = kc.reshape(m, c, dk)
        self.v = vc.reshape(m, c, dv)

    def decay(self) -> Tensor:
        """``Z [B, H, N+1, N+1]``: ``Z[p, n]`` = the decay from state ``p`` to state ``n`` (``p <= n``;
        the product of ``last`` over chunks ``p .. n-1``), 0 for ``p > n``. Exponents in float64."""
        if self._z is None:
            la = self.log_last.double()
            a = torch.cat([la.new_zeros(*la.shape[:-1], 1), la.cumsum(-1)], -1)  # [B, H, N+1]
            n1 = a.shape[-1]
            up = torch.ones(n1, n1, dtype=torch.bool, device=la.device).triu()
            z = (a.unsqueeze(-2) - a.unsqueeze(-1)).masked_fill(~up, float("-inf")).exp()
            if self.sign_last is not None:
                s = torch.cat([self.sign_last.new_ones(*la.shape[:-1], 1), self.sign_last.cumprod(-1)], -1)
                z = z * (s.unsqueeze(-1) * s.unsqueeze(-2)).double()
            self._z = z.to(self.log_last.dtype)
        return self._z

    def scan(self, u: Tensor, s0: Tensor | None) -> tuple[Tensor, Tensor]:
        """States ``S_n = sum_{j<n} Z[j+1, n] u_j + Z[0, n] s0`` for ``u [B, H, N, X, Y]``: returns the
        chunk-start states ``[B, H, N, X, Y]`` and the final state ``[B, H, X, Y]``."""
        b, h, n = u.shape[:3]
        z = self.decay()
        s = z[:, :, 1:].transpose(-1, -2) @ u.reshape(b, h, n, -1)  # [B, H, N+1, X*Y]
        if s0 is not None:
            s = s + z[:, :, 0].unsqueeze(-1) * s0.reshape(b, h, 1, -1)
        s = s.view(b, h, n + 1, *u.shape[3:])
        return s[:, :, :n], s[:, :, n]

    def scan_back(self, e: Tensor, e_final: Tensor | None) -> tuple[Tensor, Tensor]:
        """Adjoint of :meth:`scan`: given ``e [B, H, N, X, Y]`` (gradient on each chunk-start state) and
        ``e_final`` (on the final state, or None), returns the gradient on each chunk's own
        contribution ``u_n`` ``[B, H, N, X, Y]`` and on ``s0`` ``[B, H, X, Y]``."""
        b, h, n = e.shape[:3]
        z = self.decay()
        tot = z[:, :, :, :n] @ e.reshape(b, h, n, -1)  # [B, H, N+1, X*Y]: sum_{m >= p} Z[p, m] e_m
        if e_final is not None:
            tot = tot + z[:, :, :, n].unsqueeze(-1) * e_final.reshape(b, h, 1, -1)
        tot = tot.view(b, h, n + 1, *e.shape[3:])
        return tot[:, :, 1:], tot[:, :, 0]

    def chunk_view(self, z: Tensor) -> Tensor:
        """``[B, T, H, d]`` (any float dtype) -> ``[M, C, d]`` in the compute dtype, zero-padded (one copy)."""
        b, t, h, dk, dv, c, n, pad = self.shape
        out = torch.empty(b, h, n * c, z.shape[-1], dtype=self.dtype, device=z.device)
        out[:, :, :t].copy_(z.transpose(1, 2))
        if pad:
            out[:, :, t:].zero_()
        return out.view(b * h * n, c, -1)

    def token_view(self, z: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """``[M, C, ...]`` -> ``[B, T, H, ...]`` in ``dtype`` (default: z's), padding dropped (one copy)."""
        b, t, h, dk, dv, c, n, pad = self.shape
        z = z.reshape(b, h, n * c, *z.shape[2:])[:, :, :t]
        out = torch.empty(b, t, h, *z.shape[3:], dtype=dtype or z.dtype, device=z.device)
        out.copy_(z.transpose(1, 2))
        return out


def _chunk_gates(g: Tensor, beta: Tensor, sign: Tensor | None, c: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """Per-chunk gate statistics ``[B, H, N, C]`` (zero-padded past T): the within-chunk cumulative
    log forget gate, beta, and the within-chunk cumulative product of the gate signs (None without)."""
    b, t, h = g.shape
    n = -(-t // c)

    def chunk(z: Tensor) -> Tensor:
        z = F.pad(z, (0, 0, 0, n * c - t)) if n * c > t else z
        return z.reshape(b, n, c, h).permute(0, 3, 1, 2).contiguous()

    sc = None
    if sign is not None:  # padded tail: sign 0 -> 1 (a no-op step)
        sc = torch.where(chunk(sign) == 0, 1.0, chunk(sign)).to(g.dtype).cumprod(-1)
    return chunk(g).cumsum(-1), chunk(beta), sc


def _forward_triton(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, lamb: Tensor, h0: State | None,
                    sign: Tensor | None, chunk_size: int, cg_iters: int, cg_eps: float | None, prec: str | None
                    ) -> tuple[Tensor, Tensor, Tensor, State]:
    """Chunkwise forward on the Triton kernels without chunked copies of q, k, v and with the gate
    statistics built in the programs: the chunk-start states
    (:func:`~mixlab.ops.mesa_triton.chunk_states_triton`), then CG and read-out in one program
    (:func:`~mixlab.ops.mesa_triton.mesa_chunk_cg_triton`). Float32 compute.

    Returns ``o [B, T, H, V]`` in v's dtype, ``x [M, C, K]`` float32 (the solves, for the backward), CG
    iterations ``[B, T, H]`` int32 and the final state.
    """
    from mixlab.ops.mesa_triton import chunk_states_triton, mesa_chunk_cg_triton
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    c = max(1, min(chunk_size, t))
    n = -(-t // c)
    q, k, v = (z if z.stride(-1) == 1 else z.contiguous() for z in (q, k, v))  # the kernels load any float dtype
    gates = (g, beta, sign)
    s0 = (None, None) if h0 is None else (h0[0].reshape(b * h, dk, dk), h0[1].reshape(b * h, dk, dv))
    hk, fk = chunk_states_triton(k, k, None, s0[0], chunk_size=c, gates=gates)
    hv, fv = chunk_states_triton(k, v, None, s0[1], chunk_size=c, gates=gates)
    m = b * h * n
    x, iters, o = mesa_chunk_cg_triton(hk.view(m, dk, dk), k, g, beta, sign, lamb.float(), q, hv.view(m, dk, dv), v,
                                       c, cg_iters, cg_eps, prec)
    iters = iters.view(b, h, n * c)[:, :, :t].transpose(1, 2)
    return o, x, iters, (fk.view(b, h, dk, dk), fv.view(b, h, dk, dv))


def _matvec_kk(p: Tensor, H: Tensor, k: Tensor, D: Tensor, dq: Tensor) -> Tensor:
    """``H_t p_t`` for every token of the chunks: ``[M, C, K]``."""
    return torch.baddbmm(dq.unsqueeze(-1) * torch.bmm(p, H.transpose(-1, -2)), torch.bmm(p, k.transpose(-1, -2)) * D, k)


def _readout_kv(x: Tensor, G: Tensor, k: Tensor, v: Tensor, D: Tensor, dq: Tensor) -> Tensor:
    """``G_t^T x_t`` for every token: ``[M, C, V]``."""
    return torch.baddbmm(dq.unsqueeze(-1) * torch.bmm(x, G), torch.bmm(x, k.transpose(-1, -2)) * D, v)


def _chunk_cg(ch: _Chunks, lamb_m: Tensor, rhs: Tensor, cg_iters: int, cg_eps: float | None,
              cg_impl: str = "torch", prec: str | None = None) -> tuple[Tensor, Tensor]:
    """CG on ``(H_t + Lambda) x_t = rhs_t`` for all tokens; adaptive mode shrinks the working
    set to the chunks that still have unconverged tokens once half of them are done.
    ``cg_impl="triton"``: the Triton kernel (:mod:`mixlab.ops.mesa_triton`, products of precision
    ``prec``, :func:`_cg_prec`); ``"auto"``: the kernel, or the torch CG with a warning where the kernel
    does not fit the GPU.

    Returns ``x [M, C, K]`` and iterations ``[M, C]`` int32.
    """
    H, k, D, dq = ch.H, ch.k, ch.D, ch.dq
    if cg_impl in ("triton", "auto"):
        from mixlab.ops.mesa_triton import TritonCGUnfit, mesa_cg_triton
        try:
            return mesa_cg_triton(H, k, D, dq, lamb_m, rhs, cg_iters, cg_eps, prec)
        except TritonCGUnfit as e:
            if cg_impl == "triton":
                raise
            warnings.warn(f"{e}; Mesa falls back to the torch CG", stacklevel=2)
    if cg_eps is None:
        return conjugate_gradient(lambda p: _matvec_kk(p, H, k, D, dq) + lamb_m * p, rhs, cg_iters)
    check_solver_args(cg_iters, cg_eps)
    tiny = torch.finfo(rhs.dtype).tiny
    x_out = torch.zeros_like(rhs)
    it_out = torch.zeros(rhs.shape[:-1], dtype=torch.int32, device=rhs.device)
    ws = torch.arange(rhs.shape[0], device=rhs.device)
    lam = lamb_m
    x = torch.zeros_like(rhs)
    r = rhs.clone()
    p = r.clone()
    delta = (r * r).sum(-1)
    thresh = delta * (cg_eps * cg_eps)
    iters = torch.zeros_like(it_out)
    for _ in range(cg_iters):
        active = delta > thresh
        alive = active.any(-1)
        n_alive = int(alive.sum())
        if n_alive == 0:
            break
        if n_alive <= ws.numel() // 2:  # compact: keep only chunks with unconverged tokens
            x_out[ws], it_out[ws] = x, iters
            keep = alive.nonzero().squeeze(-1)
            ws = ws[keep]
            x, r, p, delta, thresh, iters, active = (z[keep] for z in (x, r, p, delta, thresh, iters, active))
            H, k, D, dq, lam = (z[keep] for z in (H, k, D, dq, lam))
        x, r, p, delta = _cg_update(x, r, p, delta, _matvec_kk(p, H, k, D, dq) + lam * p, active, tiny)
        iters += active.to(torch.int32)
    x_out[ws], it_out[ws] = x, iters
    return x_out, it_out


def _cg_prec(q: Tensor, inference: bool) -> str | None:
    """Product precision of the Triton CG (:func:`mixlab.ops.mesa_triton.launch_config`): one float16
    product per step (``"fp16"``, solves within ~3e-4 of float64) for an inference forward and for
    half-precision inputs (their own rounding is coarser: bf16 2^-9, fp16 2^-11); float32-accurate
    products (``"fp16x3"``) for float32 inputs that are differentiated."""
    return "fp16" if inference or q.dtype in (torch.float16, torch.bfloat16) else None


def _lamb_per_chunk(lamb: Tensor, ch: _Chunks) -> Tensor:
    b, t, h, dk, dv, c, n, pad = ch.shape
    return lamb.view(1, h, 1, 1, dk).expand(b, h, n, 1, dk).reshape(b * h * n, 1, dk)


class _MesaChunkFunction(torch.autograd.Function):
    """Chunkwise Mesa with the adjoint-solve backward (paper Appendix D).

    Backward: ``u_t = (H_t + Lambda)^{-1} G_t do_t`` by the same CG; then
    ``dq_t = u_t``, ``dLambda = -sum_t u_t * x_t``, and gradients for (k, v, g, beta, h0)
    are those of the surrogate ``sum_t <do_t, G_t^T x_t> - <u_t, H_t x_t>`` (+ final-state
    terms) with ``x, u`` held fixed, written out in :func:`_chunk_backward`.
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, lamb, h_kk0, h_kv0, cg_iters, cg_eps, chunk_size, sign, cg_impl, inference):
        dt = _compute_dtype(q)
        h0 = None if h_kk0 is None else (h_kk0.to(dt), h_kv0.to(dt))
        ctx.cfg = (cg_iters, cg_eps, chunk_size, cg_impl)
        solve_impl = cg_impl
        if _takes_triton(cg_impl, q, chunk_size):
            # inference or half-precision inputs: one float16 product per CG step (the fp32 output stays within
            # ~3e-4 of the float64 solve); float32 inputs that will be differentiated: float32-accurate products
            from mixlab.ops.mesa_triton import TritonCGUnfit
            try:
                o, x, iters, final = _forward_triton(q, k, v, g, beta, lamb, h0, sign, chunk_size, cg_iters, cg_eps,
                                                     _cg_prec(q, inference))
            except TritonCGUnfit as e:
                if cg_impl == "triton":
                    raise
                warnings.warn(f"{e}; Mesa falls back to the torch CG", stacklevel=2)
                solve_impl = "torch"
            else:
                ctx.save_for_backward(q, k, v, g, beta, lamb, h_kk0, h_kv0, x, sign)
                ctx.mark_non_differentiable(iters)
                return o, final[0], final[1], iters
        ch = _Chunks(k, v, g.to(dt), beta.to(dt), h0, chunk_size, sign)
        lam = _lamb_per_chunk(lamb.to(dt), ch)
        x, iters = _chunk_cg(ch, lam, ch.chunk_view(q), cg_iters, cg_eps, solve_impl, _cg_prec(q, inference))
        o = _readout_kv(x, ch.G, ch.k, ch.v, ch.D, ch.dq)
        ctx.save_for_backward(q, k, v, g, beta, lamb, h_kk0, h_kv0, x, sign)
        iters = ch.token_view(iters)
        ctx.mark_non_differentiable(iters)
        return ch.token_view(o, v.dtype), ch.final[0], ch.final[1], iters

    @staticmethod
    def backward(ctx, do, dh_kk, dh_kv, _diters):
        q, k, v, g, beta, lamb, h_kk0, h_kv0, x, sign = ctx.saved_tensors
        cg_iters, cg_eps, chunk_size, cg_impl = ctx.cfg
        dt = _compute_dtype(q)
        h0 = None if h_kk0 is None else (h_kk0.to(dt), h_kv0.to(dt))
        states = "triton" if _takes_triton(cg_impl, q, chunk_size) else "torch"
        ch = _Chunks(k, v, g.to(dt), beta.to(dt), h0, chunk_size, sign, states)
        dq, dk, dv, dg, dbeta, dlamb, dh0 = _chunk_backward(ch, lamb.to(dt), x, ch.chunk_view(do),
                                                             None if dh_kk is None else dh_kk.to(dt),
                                                             None if dh_kv is None else dh_kv.to(dt),
                                                             cg_iters, cg_eps, cg_impl, _cg_prec(q, False),
                                                             (q.dtype, k.dtype, v.dtype))
        cast = lambda gz, ref: None if ref is None or gz is None else gz.to(ref.dtype)
        return (dq, dk, dv, cast(dg, g), cast(dbeta, beta), cast(dlamb, lamb),
                cast(dh0[0], h_kk0), cast(dh0[1], h_kv0), None, None, None, None, None, None)


def _chunk_backward(ch: _Chunks, lamb: Tensor, x: Tensor, do: Tensor, dh_kk: Tensor | None, dh_kv: Tensor | None,
                    cg_iters: int, cg_eps: float | None, cg_impl: str, prec: str | None = None,
                    dtypes: tuple[torch.dtype, ...] | None = None) -> tuple:
    """Gradients of chunkwise Mesa by the adjoint solve (MesaNet Appendix D), written out.

    With ``x_t = (H_t + Lambda)^{-1} q_t`` from the forward and the adjoint ``u_t = (H_t + Lambda)^{-1}
    G_t do_t`` (same CG), the gradients on (k, v, gates, initial state) are those of the surrogate
    ``L = sum_t <do_t, G_t^T x_t> - <u_t, H_t x_t> + <dh_kk, H_final> + <dh_kv, G_final>`` with x, u
    held fixed; ``dq_t = u_t`` and ``dLambda = -sum_t u_t * x_t``. Per chunk, with
    ``H_t = dq_t S^k + sum_{i<=t} D[t, i] k_i k_i^T`` (``G_t`` likewise with ``k_i v_i^T``), scores
    ``Xk = x k^T``, ``Uk = u k^T``, ``Vd = do v^T`` ``[C, C]``:

    * ``dL/dD = Xk * (Vd - Uk)``; ``dk += (D*(Vd - Uk))^T x - (D*Xk)^T u``; ``dv += (D*Xk)^T do``;
    * ``dL/d dq_t = x_t^T S^v do_t - u_t^T S^k x_t``; ``dL/dS^k_n = -sum_t dq_t u_t x_t^T``,
      ``dL/dS^v_n = sum_t dq_t x_t do_t^T``, carried back over chunks by :meth:`_Chunks.scan_back`
      onto each chunk's contribution ``(k * w)^T (k | v)`` and the chunk decay ``last``;
    * gate gradients by the chain rule through ``D = beta_i exp(gc_t - gc_i)``, ``dq``, ``w`` and
      ``last``, then ``dg`` = the reverse within-chunk cumulative sum of ``dL/dgc``.

    Args:
        ch: the call's chunks (compute dtype); lamb: ``[H, K]``; x: ``[M, C, K]`` forward solves;
        do: ``[M, C, V]`` output gradient (chunk view); dh_kk, dh_kv: final-state gradients or None.

    Returns:
        ``dq, dk [B, T, H, K]``, ``dv [B, T, H, V]``, ``dg, dbeta [B, T, H]``, ``dlamb [H, K]``,
        ``(dh_kk0, dh_kv0)`` (``[B, H, K, K]``, ``[B, H, K, V]``), in the compute dtype (dq, dk, dv in
        ``dtypes``, the dtypes of q, k, v, when given).
    """
    b, t, h, dk_, dv_, c, n, pad = ch.shape
    k, v, D, D0, dq = ch.k, ch.v, ch.D, ch.D0, ch.dq
    Vd = do @ v.transpose(-1, -2)  # [M, C, C]
    DVd = D * Vd
    # adjoint right-hand side G_t do_t, then the adjoint solve
    rhs = torch.baddbmm(DVd @ k, dq.unsqueeze(-1) * do, ch.G.transpose(-1, -2))
    u, _ = _chunk_cg(ch, _lamb_per_chunk(lamb, ch), rhs, cg_iters, cg_eps, cg_impl, prec)
    # intra-chunk terms: dL/dD = Xk * (Vd - Uk)
    Xk = x @ k.transpose(-1, -2)
    VmU = torch.baddbmm(Vd, u, k.transpose(-1, -2), alpha=-1)  # Vd - Uk
    DVmU, DXk = D * VmU, D * Xk
    dD = Xk * VmU
    dk = torch.baddbmm(DVmU.transpose(-1, -2) @ x, DXk.transpose(-1, -2), u, alpha=-1)
    dv = DXk.transpose(-1, -2) @ do
    dDD = Xk * DVmU  # dL/dD * D
    dgc = dDD.sum(-1) - dDD.sum(-2)
    dbc = (dD * D0).sum(-2)
    # chunk-start states: dL/d dq_t = x_t^T S^v do_t - u_t^T S^k x_t
    ddq = ((x @ ch.G) * do).sum(-1) - ((x @ ch.H) * u).sum(-1)
    dgc = dgc + ddq * dq
    # dL/dS^k_n = -sum_t dq_t u_t x_t^T, dL/dS^v_n = sum_t dq_t x_t do_t^T, carried back over the chunks:
    # y_n = the gradient on chunk n's contribution (k * w)^T (k | v), da_n = dL/dlast_n = <y_n, S_n>
    if ch.triton:  # one reverse Triton scan per statistic reads u, x, do in place
        from mixlab.ops.mesa_triton import chunk_states_triton
        bh = b * h
        tv = lambda z: z.view(b, h, n * c, -1).transpose(1, 2)  # noqa: E731  [M, C, d] -> [B, N*C, H, d]
        fl = lambda z, d: None if z is None else z.reshape(bh, dk_, d)  # noqa: E731
        last, dqf = ch.last.reshape(bh, n), dq.view(bh, n, c)
        y_k, dh0_k, da_k = chunk_states_triton(tv(u), tv(x), last, fl(dh_kk, dk_), w=-dqf, chunk_size=c, reverse=True,
                                               dot=ch.H.view(bh, n, dk_, dk_))
        y_v, dh0_v, da_v = chunk_states_triton(tv(x), tv(do), last, fl(dh_kv, dv_), w=dqf, chunk_size=c,
                                               reverse=True, dot=ch.G.view(bh, n, dk_, dv_))
        dh0_k, dh0_v, da = dh0_k.view(b, h, dk_, dk_), dh0_v.view(b, h, dk_, dv_), (da_k + da_v).view(-1)
    else:
        e_k = -((u * dq.unsqueeze(-1)).transpose(-1, -2) @ x)  # [M, K, K]
        e_v = (x * dq.unsqueeze(-1)).transpose(-1, -2) @ do  # [M, K, V]
        y_k, dh0_k = ch.scan_back(e_k.view(b, h, n, dk_, dk_), dh_kk)
        y_v, dh0_v = ch.scan_back(e_v.view(b, h, n, dk_, dv_), dh_kv)
        da = (y_k.reshape(-1, dk_, dk_) * ch.H).sum((-1, -2)) + (y_v.reshape(-1, dk_, dv_) * ch.G).sum((-1, -2))
    y_k, y_v = y_k.reshape(-1, dk_, dk_), y_v.reshape(-1, dk_, dv_)
    # chunk n's contributions (k * w)^T k and (k * w)^T v, with kw = k * w
    w = ch.w.unsqueeze(-1)
    dkw = torch.baddbmm(v @ y_v.transpose(-1, -2), k, y_k.transpose(-1, -2))  # dL/d kw
    dk = dk + w * torch.baddbmm(dkw, k, y_k)
    dv = dv + w * (k @ y_v)
    dw = (dkw * k).sum(-1)  # [M, C]
    ww = dw * ch.w
    dgc = dgc - ww
    dgc[:, -1] += ww.sum(-1) + da * ch.last.reshape(-1)
    dbc = dbc + dw * ch.w0
    dg = dgc.flip(-1).cumsum(-1).flip(-1)
    dlamb = -(u * x).view(b, h, n * c, dk_).sum((0, 2))
    tok = ch.token_view
    dt_q, dt_k, dt_v = dtypes or (None, None, None)
    return (tok(u, dt_q), tok(dk, dt_k), tok(dv, dt_v), tok(dg.unsqueeze(-1)).squeeze(-1),
            tok(dbc.unsqueeze(-1)).squeeze(-1), dlamb, (dh0_k, dh0_v))


def mesa_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, lamb: Tensor, cg_iters: int = 30,
               cg_eps: float | None = None, chunk_size: int = 64, initial_state: State | None = None,
               output_final_state: bool = False, gate_sign: Tensor | None = None, cg_impl: str = "torch"
               ) -> tuple[Tensor, State | None, Tensor]:
    """Chunkwise Mesa (CPU and GPU; the adaptive-CG inference path).

    Args:
        q, k: ``[B, T, H, K]`` (normalised by the caller); v ``[B, T, H, V]``;
        g: ``[B, T, H]`` log forget gate ``<= 0``; beta: ``[B, T, H]`` input gate in [0, 1];
        lamb: ``[H, K]`` > 0; cg_iters: fixed count or cap; cg_eps: adaptive tolerance or None;
        chunk_size: tokens per chunk (any T works; the tail is zero-padded);
        initial_state: ``(h_kk [B, H, K, K], h_kv [B, H, K, V])`` or None;
        gate_sign: ``[B, T, H]`` +-1 signs of the forget gates (negative gates) or None;
        cg_impl: ``"torch"`` (batched torch CG, any device and dtype), ``"triton"`` (the
            :mod:`mixlab.ops.mesa_triton` kernel for the forward and adjoint solves: CUDA,
            float32/bf16/fp16 inputs, ``chunk_size`` and K <= 128) or ``"auto"`` (the kernel where
            it fits the GPU, else the torch CG with a warning).

    Returns:
        ``o [B, T, H, V]`` (dtype of v), final state (compute dtype) or None, CG iterations
        ``[B, T, H]`` int32. Differentiable in q, k, v, g, beta, lamb and the initial state
        through the adjoint solve.

    Raises:
        ValueError: bad shapes, ``cg_iters < 1``, ``cg_eps <= 0``, ``chunk_size`` not an integer >= 1,
            ``T = 0``, a non-positive ``lamb`` (CPU), an unknown ``cg_impl`` or inputs the Triton kernel does not take.
    """
    check_mesa_inputs(q, k, v, g, beta, lamb, initial_state)
    check_solver_args(cg_iters, cg_eps)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"mesa: chunk_size must be an integer >= 1; got {chunk_size!r}")
    if q.shape[1] == 0:
        raise ValueError("mesa: the sequence is empty (T = 0); the chunkwise path needs T >= 1")
    _check_cg_impl(cg_impl, q, chunk_size)
    _check_sign(gate_sign, g)
    h_kk0, h_kv0 = initial_state if initial_state is not None else (None, None)
    sign = None if gate_sign is None else gate_sign.detach()
    inference = not (torch.is_grad_enabled()
                     and any(z is not None and z.requires_grad for z in (q, k, v, g, beta, lamb, h_kk0, h_kv0)))
    o, h_kk, h_kv, iters = _MesaChunkFunction.apply(q, k, v, g, beta, lamb, h_kk0, h_kv0, cg_iters, cg_eps, chunk_size,
                                                    sign, cg_impl, inference)
    return o, ((h_kk, h_kv) if output_final_state else None), iters


def _takes_triton(cg_impl: str, q: Tensor, chunk_size: int) -> bool:
    """Whether the forward and the backward of :class:`_MesaChunkFunction` run on the Triton kernels."""
    return _compute_dtype(q) == torch.float32 and (
        cg_impl == "triton" or (cg_impl == "auto" and _triton_cg_serves(q, chunk_size)))


def _triton_cg_serves(q: Tensor, chunk_size: int) -> bool:
    """Whether ``impl="auto"`` takes the Triton CG kernel (CUDA, not float64, K and chunk <= 128)."""
    if not q.is_cuda or q.dtype == torch.float64 or os.environ.get("MIXLAB_MESA_TRITON") == "0":
        return False
    try:
        _check_cg_impl("triton", q, chunk_size)
    except ValueError:
        return False
    return True


def _check_cg_impl(cg_impl: str, q: Tensor, chunk_size: int) -> None:
    """Raises ValueError for an unknown ``cg_impl`` or inputs the Triton CG kernel cannot take."""
    if cg_impl not in ("torch", "triton", "auto"):
        raise ValueError(f"mesa: cg_impl must be 'torch', 'triton' or 'auto'; got {cg_impl!r}")
    if cg_impl == "triton":
        try:
            from mixlab.ops.mesa_triton import MAX_CHUNK, MAX_HEAD_DIM
        except ImportError as e:
            raise ValueError(f"mesa: impl='triton' needs Triton ({e}); use impl='chunk'") from None
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        why = ("inputs are float64 (the kernel solves in float32)" if q.dtype == torch.float64 else
               "inputs are not on CUDA" if not (q.is_cuda or interpret) else
               f"head dim {q.shape[-1]} > {MAX_HEAD_DIM}" if q.shape[-1] > MAX_HEAD_DIM else
               f"chunk_size {min(chunk_size, q.shape[1])} > {MAX_CHUNK}" if min(chunk_size, q.shape[1]) > MAX_CHUNK
               else None)
        if why is not None:
            raise ValueError(f"mesa: impl='triton' (Triton CG kernel) cannot take these inputs: {why}; "
                             "use impl='chunk' (mesa_net, the mixer) or cg_impl='torch' (mesa_chunk)")


# ---------------------------------------------------------------------------- dispatch
def mesa_fla(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, lamb: Tensor, cg_iters: int = 30,
             initial_state: State | None = None, output_final_state: bool = False) -> tuple[Tensor, State | None]:
    """fla-core ``chunk_mesa_net`` (CUDA, fixed CG count).

    Raises:
        ValueError: inputs fla does not serve (:func:`mixlab.ops.fla.unserved`: CPU, float64,
            ``K > 128``, T < 2), ``K != V``, ``cg_iters < 1``.
    """
    check_mesa_inputs(q, k, v, g, beta, lamb, initial_state)
    check_solver_args(cg_iters, None)
    dk, dv = q.shape[-1], v.shape[-1]
    if dk != dv:
        raise ValueError(f"mesa: impl='fla' needs K == V; got K={dk}, V={dv}")
    why = fla.unserved("mesa", q, k, v)
    if why is not None:
        raise ValueError(f"mesa: impl='fla' (fla-core chunk_mesa_net) cannot take these inputs: {why}; "
                         "use impl='auto' or 'chunk'")
    chunk_mesa_net = fla.import_op("ops.mesa_net", "chunk_mesa_net")

    # one activation dtype for v (fla casts q, k to fp16 itself); head dims zero-padded to 64 or 128
    # (fla.LIMITS) with Lambda = 1 on the padded channels, so their CG components stay exactly 0
    q, k, v = fla.prepare(q, k, v)
    kp = fla.padded_dim(dk, "mesa")
    q, k, v = fla.pad_last(q, kp), fla.pad_last(k, kp), fla.pad_last(v, kp)
    lamb = fla.pad_last(lamb.float(), kp, value=1.0)
    pad_state = lambda s: None if s is None else F.pad(s.float(), (0, kp - dk, 0, kp - dk))  # noqa: E731
    h_kk0, h_kv0 = (None, None) if initial_state is None else (pad_state(initial_state[0]), pad_state(initial_state[1]))
    o, h_kk, h_kv = chunk_mesa_net(q, k, v, g.float().contiguous(), beta.float().contiguous(), lamb.contiguous(),
                                   h_kk_init=h_kk0, h_kv_init=h_kv0, output_final_state=output_final_state,
                                   max_CG_iteration=cg_iters)
    final = (h_kk[:, :, :dk, :dk], h_kv[:, :, :dk, :dk]) if output_final_state else None
    return o[..., :dk], final


def mesa_net(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, lamb: Tensor, cg_iters: int = 30,
             cg_eps: float | None = None, chunk_size: int = 64, initial_state: State | None = None,
             output_final_state: bool = False, impl: str = "auto", gate_sign: Tensor | None = None
             ) -> tuple[Tensor, State | None, Tensor | None]:
    """Mesa layer core with implementation dispatch (arguments as :func:`mesa_chunk`).

    ``impl``: ``"auto"`` (fla on CUDA for a fixed count, positive gates, K == V and inputs
    :func:`mixlab.ops.fla.unserved` allows; else ``"triton"`` on CUDA where the kernel takes the
    inputs, e.g. adaptive CG at evaluation, falling back to the torch CG with a warning if the
    kernel does not fit the GPU (``MIXLAB_MESA_TRITON=0`` turns it off); else ``"chunk"``),
    ``"chunk"``, ``"triton"`` (the chunk path with the Triton adaptive-CG kernel,
    :mod:`mixlab.ops.mesa_triton`), ``"fla"``,
    ``"recurrent"``, ``"exact"``.

    Returns:
        ``o``, final state or None, CG iterations ``[B, T, H]`` (None for fla and exact).

    Raises:
        ValueError: bad shapes, solver arguments, unknown ``impl``, fla limits, ``impl="fla"``
            with negative gates (fla's kernel takes log gates only).
    """
    check_solver_args(cg_iters, cg_eps)
    if impl == "auto":
        fla_ok = (cg_eps is None and gate_sign is None and q.shape[-1] == v.shape[-1]
                  and fla.unserved("mesa", q, k, v) is None)
        impl = "fla" if fla_ok else ("auto" if _triton_cg_serves(q, chunk_size) else "chunk")
    if impl in ("chunk", "triton", "auto"):
        return mesa_chunk(q, k, v, g, beta, lamb, cg_iters, cg_eps, chunk_size, initial_state, output_final_state,
                          gate_sign, cg_impl={"chunk": "torch"}.get(impl, impl))
    if impl == "fla":
        if cg_eps is not None:
            raise ValueError("mesa: impl='fla' has a fixed CG count (an evaluation tolerance eval_cg_eps applies "
                             "too); set cg_eps and eval_cg_eps to null or use impl='auto'")
        if not q.is_cuda:
            raise ValueError(f"mesa: impl='fla' (fla-core's Triton kernel) needs CUDA tensors; got {q.device.type}. "
                             "Use impl='auto' or 'chunk'")
        if gate_sign is not None:
            raise ValueError("mesa: impl='fla' takes positive forget gates only (log gates); negative gates need "
                             "impl='auto' or 'chunk'")
        o, st = mesa_fla(q, k, v, g, beta, lamb, cg_iters, initial_state, output_final_state)
        return o, st, None
    if impl == "recurrent":
        return mesa_recurrent(q, k, v, g, beta, lamb, cg_iters, cg_eps, initial_state, output_final_state, gate_sign)
    if impl == "exact":
        o, st = mesa_exact(q, k, v, g, beta, lamb, initial_state, output_final_state, gate_sign)
        return o, st, None
    raise ValueError(f"mesa: impl must be 'auto', 'chunk', 'triton', 'fla', 'recurrent' or 'exact'; got {impl!r}")
