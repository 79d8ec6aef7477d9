"""The LM heads' output layer and next-token cross entropy in chunks of tokens (never the whole ``[N, V]`` logits).

An LM's last matmul ``logits = h W^T`` and its cross entropy hold ``N x V`` float32 logits (and as
many for their gradient) in training: at GPT-2's vocabulary, 8 x 2048 tokens take 6.6 GB. Computed
``chunk`` tokens at a time under :func:`torch.utils.checkpoint.checkpoint`, only one chunk's logits
exist at once: forward keeps the per-token NLL, backward recomputes each chunk's logits and turns
them into that chunk's gradients of ``h`` and ``W`` (the same ops as the plain path, once more).

Notation: N tokens, D model width, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from mixlab.heads.common import float_logits

__all__ = ["linear_cross_entropy", "token_nll"]


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
