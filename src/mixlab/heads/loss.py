"""The LM heads' output layer and next-token cross entropy in chunks of tokens (never the whole ``[N, V]`` logits).

An LM's last matmul ``logits = h W^T`` and its cross entropy hold ``N x V`` float32 logits (and as
many for their gradient) in training: at GPT-2's vocabulary, 8 x 2048 tokens take 6.6 GB. Computed
``chunk`` tokens at a time under :func:`torch.utils.checkpoint.checkpoint`, only one chunk's logits
exist at once: forward keeps the per-token NLL, backward recomputes each chunk's logits and turns
them into that chunk's gradients of ``h`` and ``W`` (the same ops as the plain path, once more).

The training loss (the mean NLL) takes a cheaper route, :func:`fused_linear_cross_entropy`: its
gradient is known in forward (``(softmax - onehot) / n_scored`` per token), so each chunk's logits turn
into ``d h`` and ``d W`` right away and are freed; backward only scales them by the upstream gradient.
Three matmuls per chunk as in the plain path (no recomputation), one chunk's logits alive at a time
(the technique of Liger-Kernel's and fla's fused linear cross entropy, written here in torch so that it
runs on CPU; ``kernel="fla"`` computes each chunk's cross entropy and ``G`` with fla's Triton kernels on CUDA).
It is a ``torch.library`` custom op, ``mixlab::fused_linear_cross_entropy``, so that
``torch.compile`` keeps it whole and saves only ``d h`` and ``d W`` for backward, as eager autograd does.

Notation: N tokens, D model width, V vocabulary.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from mixlab.heads.common import float_logits

__all__ = ["fused_linear_cross_entropy", "linear_cross_entropy", "token_nll", "LOSS_KERNELS"]


def token_nll(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token next-token scores: ``logits [..., V]`` float, ``targets [...]`` int64 (e.g. ``[B, T, V]``
    and ``[B, T]``) -> ``(nll [N] nats in the logits' dtype (0 where ignored), valid [N] bool, hits [N]
    bool)`` over the ``N`` flattened positions; targets equal to ``ignore_index`` are not scored."""
    logits, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    nll = F.cross_entropy(logits, targets, reduction="none", ignore_index=ignore_index)
    valid = targets != ignore_index
    hits = (logits.argmax(-1) == targets) & valid
    return nll, valid, hits


def _chunk_scores(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int) -> tuple[Tensor, ...]:
    # [n, V] logits: bf16 matmul under autocast, scored in float32
    return token_nll(float_logits(F.linear(hidden, weight)), targets, ignore_index)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int = -100,
                         chunk: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token NLL of ``softmax(hidden @ weight^T)`` at ``targets``, ``chunk`` tokens at a time.

    Equal to ``F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="none",
    ignore_index=ignore_index)`` (the logits in float32, float64 for float64 inputs), in value and in
    the gradients of ``hidden`` and ``weight``; under autocast the matmul runs in the autocast dtype
    as it would there. With gradients enabled each chunk runs under
    :func:`torch.utils.checkpoint.checkpoint` (non-reentrant): its logits are freed after forward and
    recomputed in backward, so at most one chunk's ``[chunk, V]`` logits and their gradient are alive.

    Args:
        hidden: ``[N, D]`` final hidden states (float32, bf16 or float64).
        weight: ``[V, D]`` output matrix (the LM head's ``nn.Linear.weight``; no bias).
        targets: ``[N]`` int64 token ids; ``ignore_index`` marks unscored positions.
        ignore_index: target id that is not scored (NLL 0, no gradient, never a hit).
        chunk: tokens per chunk (``None`` or ``>= N``: one plain pass, no recomputation). Need not
            divide ``N``: the last chunk is shorter.

    Returns:
        ``(nll [N] float32 nats (float64 for float64 inputs; 0 where ignored), valid [N] bool,
        hits [N] bool)``: ``hits`` is top-1 next-token correctness at scored positions.

    Raises:
        ValueError: ``chunk < 1``; ``hidden`` not 2-D; ``targets`` not ``[N]``.
    """
    if chunk is not None and chunk < 1:
        raise ValueError(f"linear_cross_entropy: chunk must be >= 1 tokens or None; got {chunk}")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"linear_cross_entropy: expected hidden [N, D] and targets [N]; got "
                         f"{tuple(hidden.shape)} and {tuple(targets.shape)}")
    n = hidden.shape[0]
    if chunk is None or chunk >= n:
        return _chunk_scores(hidden, weight, targets, ignore_index)
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    parts = []
    for s in range(0, n, chunk):
        args = (hidden[s:s + chunk], weight, targets[s:s + chunk], ignore_index)
        parts.append(checkpoint(_chunk_scores, *args, use_reentrant=False) if recompute else _chunk_scores(*args))
    nll, valid, hits = (torch.cat(p) for p in zip(*parts))
    return nll, valid, hits


@torch.library.custom_op("mixlab::fused_linear_cross_entropy", mutates_args=())
def _fused_forward(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, chunk: int,
                   mm: torch.dtype, kernel: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, nll, valid, hits, d hidden, d weight)`` of the mean NLL, chunk by chunk, matmuls in ``mm``;
    each chunk's cross entropy and ``G`` in torch (``kernel="torch"``) or fla's Triton kernels (``"fla"``).

    A ``torch.library`` op, opaque to ``torch.compile``: its partitioner then keeps what eager autograd
    keeps for backward (``d hidden`` and ``d weight``). Traced through, it kept every chunk's partial
    ``d weight`` (``[V, D]`` each) and slices of ``G`` instead, above the plain model's memory.
    """
    n = hidden.shape[0]
    acc = torch.float64 if mm == torch.float64 else torch.float32  # logits and the d W accumulator
    # the gradient products: float16 would flush (softmax - onehot) / n_scored to zero, since no loss
    # scale has reached it yet in forward (bf16 has float32's range)
    gmm = acc if mm == torch.float16 else mm
    h_mm, w_mm = hidden.to(mm), weight.to(mm)
    h_g, w_g = (h_mm, w_mm) if gmm == mm else (hidden.to(gmm), weight.to(gmm))
    valid = targets != ignore_index
    n_scored = valid.sum().clamp_min(1)
    nll = torch.empty(n, dtype=acc, device=hidden.device)
    hits = torch.empty(n, dtype=torch.bool, device=hidden.device)
    grad_h = torch.empty(hidden.shape, dtype=gmm, device=hidden.device)
    grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
    if kernel == "fla":
        from fla.modules.fused_cross_entropy.ops import cross_entropy_bwd, cross_entropy_fwd

        d_nll = (1.0 / n_scored.to(torch.float32)).expand(min(chunk, n))  # d mean / d nll_i, stride 0
    with torch.autocast(hidden.device.type, enabled=False):
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            t, v = targets[s:e], valid[s:e]
            if kernel == "fla":  # 3 passes over the [n_c, V] logits in ``mm`` (torch: ~10 in float32)
                logits = h_mm[s:e] @ w_mm.t()  # [n_c, V]
                hits[s:e] = (logits.argmax(-1) == t) & v  # = the float32 copy's argmax: the cast is exact
                # fla: per-row NLL (0 where ignored) and log-sum-exp in float32 from the mm-dtype logits, then
                # G = (softmax - onehot) * d_nll written over the logits (one rounding to ``mm``, as below)
                nll[s:e], _, lse, _, _ = cross_entropy_fwd(logits, t, ignore_index=ignore_index)
                g = cross_entropy_bwd(logits, t, lse, d_nll[:e - s], ignore_index=ignore_index,
                                      inplace_backward=True)
            else:
                logits = (h_mm[s:e] @ w_mm.t()).to(acc)  # [n_c, V]
                lse = torch.logsumexp(logits, dim=-1)
                t_safe = torch.where(v, t, 0)
                nll[s:e] = torch.where(v, lse - logits.gather(1, t_safe[:, None])[:, 0], 0)
                hits[s:e] = (logits.argmax(-1) == t) & v
                # d mean NLL / d logits = (softmax - onehot) / n_scored at scored tokens, 0 elsewhere,
                # in place in the logits' buffer (one [n_c, V] float32 tensor alive, not three)
                g = logits.sub_(lse[:, None]).exp_()
                g.scatter_add_(1, t_safe[:, None], torch.full_like(lse, -1.0)[:, None])
                g = g.mul_((v.to(acc) / n_scored)[:, None]).to(gmm)
            grad_h[s:e] = g @ w_g
            grad_w += (g.t() @ h_g[s:e]).to(acc)
    return nll.sum() / n_scored, nll, valid, hits, grad_h, grad_w


@_fused_forward.register_fake
def _(hidden, weight, targets, ignore_index, chunk, mm, kernel):
    acc = torch.float64 if mm == torch.float64 else torch.float32
    gmm = acc if mm == torch.float16 else mm
    n = hidden.shape[0]
    return (hidden.new_empty((), dtype=acc), hidden.new_empty(n, dtype=acc),
            hidden.new_empty(n, dtype=torch.bool), hidden.new_empty(n, dtype=torch.bool),
            hidden.new_empty(hidden.shape, dtype=gmm), weight.new_empty(weight.shape, dtype=acc))


def _fused_setup_context(ctx, inputs, output):
    hidden, weight = inputs[:2]
    ctx.save_for_backward(output[4], output[5])
    ctx.dtypes = (hidden.dtype, weight.dtype)
    ctx.set_materialize_grads(False)


def _fused_backward(ctx, g_loss, *_unused):
    grad_h, grad_w = ctx.saved_tensors
    h_dtype, w_dtype = ctx.dtypes
    if g_loss is None:
        return None, None, None, None, None, None, None
    return (grad_h * g_loss).to(h_dtype), (grad_w * g_loss).to(w_dtype), None, None, None, None, None


_fused_forward.register_autograd(_fused_backward, setup_context=_fused_setup_context)


#: Choices of :func:`fused_linear_cross_entropy`'s ``kernel`` (``loss_kernel`` of :class:`~mixlab.heads.lm.CausalLM`).
LOSS_KERNELS = ("torch", "fla", "auto")


def fused_linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int = -100,
                               chunk: int = 4096, kernel: str = "torch") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Mean next-token NLL of ``softmax(hidden @ weight^T)`` over scored tokens, with the gradients of
    ``hidden`` and ``weight`` computed during forward, ``chunk`` tokens at a time.

    ``loss`` equals ``F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=ignore_index)``
    (mean over scored tokens; 0 when none is scored) in value and gradients, up to the summation order of
    ``d weight`` over chunks. Per chunk: logits (one matmul in the autocast dtype, or the inputs'),
    log-sum-exp and NLL in float32 (float64 for float64 inputs), then ``G = (softmax - onehot) / n`` and
    ``d hidden = G W``, ``d weight += G^T hidden`` (float32 accumulator; the two gradient products in
    float32 under float16 autocast, where ``G`` would underflow before any loss scale reaches it): three
    matmuls per chunk, as the
    plain path's forward + backward, and at most one chunk's ``[chunk, V]`` logits alive at a time.
    Backward multiplies the kept gradients by the upstream scalar. The per-token outputs carry no
    gradient: use :func:`linear_cross_entropy` where a loss weights tokens differently.

    Args:
        hidden: ``[N, D]`` final hidden states (float32, bf16 or float64).
        weight: ``[V, D]`` output matrix (no bias).
        targets: ``[N]`` int64 token ids; ``ignore_index`` marks unscored positions.
        ignore_index: target id that is not scored.
        chunk: tokens per chunk (>= 1; need not divide ``N``).
        kernel: each chunk's cross entropy and ``G``: ``"torch"`` (float32 logits, ~10 elementwise passes
            over them; any device); ``"fla"`` (flash-linear-attention's Triton cross-entropy kernels, the
            Liger-Kernel technique: log-sum-exp and NLL in one pass over the ``mm``-dtype logits, ``G``
            written over them in a second; CUDA, or Triton's interpreter with ``TRITON_INTERPRET=1``;
            bf16 or float32 matmuls); ``"auto"``: ``"fla"`` where it applies on CUDA, else ``"torch"``.
            The two agree to float32 rounding in ``loss`` and to one ``mm`` rounding of ``G`` in the
            gradients.

    Returns:
        ``(loss [] float32 (float64 for float64 inputs), nll [N] (0 where ignored), valid [N] bool,
        hits [N] bool)``; only ``loss`` is differentiable.

    Raises:
        ValueError: ``chunk < 1``; ``hidden`` not 2-D; ``targets`` not ``[N]``; ``kernel`` not one of
            :data:`LOSS_KERNELS`, or ``"fla"`` off CUDA (without the interpreter) or with float16/float64
            matmuls.
    """
    if chunk < 1:
        raise ValueError(f"fused_linear_cross_entropy: chunk must be >= 1 tokens; got {chunk}")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"fused_linear_cross_entropy: expected hidden [N, D] and targets [N]; got "
                         f"{tuple(hidden.shape)} and {tuple(targets.shape)}")
    # the matmul dtype: autocast's where it is on (as F.linear would run), else the inputs'; read here,
    # outside the op, where torch.compile's tracer sees the autocast state
    mm = hidden.dtype
    if hidden.dtype != torch.float64 and torch.is_autocast_enabled(hidden.device.type):
        mm = torch.get_autocast_dtype(hidden.device.type)
    loss, nll, valid, hits, _, _ = _fused_forward(hidden, weight, targets, ignore_index, chunk, mm,
                                                  _loss_kernel(kernel, hidden, mm))
    return loss, nll.detach(), valid, hits  # the op's backward serves the mean loss only


def _loss_kernel(kernel: str, hidden: Tensor, mm: torch.dtype) -> str:
    """``"torch"`` or ``"fla"`` for :func:`fused_linear_cross_entropy`'s ``kernel`` (see there)."""
    if kernel not in LOSS_KERNELS:
        raise ValueError(f"fused_linear_cross_entropy: kernel must be one of {', '.join(LOSS_KERNELS)}; got {kernel!r}")
    fla_device = hidden.is_cuda or (kernel == "fla" and os.environ.get("TRITON_INTERPRET") == "1")
    fla_ok = fla_device and mm in (torch.bfloat16, torch.float32)
    if kernel == "fla" and not fla_ok:
        raise ValueError(f"fused_linear_cross_entropy: kernel 'fla' needs CUDA tensors (or TRITON_INTERPRET=1) and "
                         f"bf16 or float32 matmuls; got {hidden.device.type} and {mm}: use kernel 'torch' or 'auto'")
    return "fla" if kernel == "fla" or (kernel == "auto" and fla_ok) else "torch"
