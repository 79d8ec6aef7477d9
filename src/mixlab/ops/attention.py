"""Softmax-attention math and kernel dispatch shared by the attention mixers (``goat``/``rope``/
``alibi``/``nope``, ``swa``, ``mla``): masks, the SDPA call, FlexAttention sliding windows, the
packed-projection split.

Notation: B batch, H heads, Tq / Tk query / key tokens, ``d_h`` head dim.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["causal_mask", "sdpa", "band_mask", "flex_sliding_window", "split_qkv"]


def causal_mask(t_q: int, t_k: int, device: torch.device) -> Tensor:
    """``[t_q, t_k]`` bool mask, lower-right aligned (query i sees keys ``<= t_k - t_q + i``).

    SDPA's ``is_causal`` aligns top-left when ``t_q != t_k`` (pytorch #115111); cached
    decoding and chunked evaluation need this one.
    """
    return torch.ones(t_q, t_k, dtype=torch.bool, device=device).tril(diagonal=t_k - t_q)


_DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: Tensor, k: Tensor, v: Tensor, decoding: bool, **kwargs: Any) -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, **kwargs)`` (q ``[B, H, Tq, d]``, k/v
    ``[B, H, Tk, d]`` -> ``[B, H, Tq, d_v]``); while ``decoding`` with a cache on CUDA, without
    the cuDNN backend.

    cuDNN's SDPA builds a new graph for every new key length, i.e. at every decoding step:
    measured on an H200 (torch 2.11), 4 cached layers decoded ~100 tokens/s with the default
    backends and ~1,600 tokens/s with flash / efficient / math only (BENCHMARKS.md, issue 4).
    """
    if not (decoding and q.is_cuda):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    with sdpa_kernel(_DECODE_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def band_mask(q_idx: Tensor, k_idx: Tensor, window: int, causal: bool = True) -> Tensor:
    """``[Tq, Tk]`` bool: True where query token ``q_idx[i]`` may see key ``k_idx[j]``
    (``q_idx [Tq]``, ``k_idx [Tk]`` absolute token positions): ``0 <= i - j < window`` (causal)
    or ``|i - j| < window``. A window beyond any position difference (up to ``2**62``) is full attention: it is
    clamped there, so any Python int is taken (``window: 1e20`` raised an OverflowError)."""
    window = min(window, 2**62)
    d = q_idx[:, None] - k_idx[None, :]
    return (d >= 0) & (d < window) if causal else d.abs() < window


_FLEX: dict[str, Any] = {}


def flex_sliding_window(q: Tensor, k: Tensor, v: Tensor, window: int, causal: bool) -> Tensor:
    """Sliding-window attention by FlexAttention with a block mask (the :func:`band_mask` rule):
    q, k, v ``[B, H, T, d]`` -> ``[B, H, T, d]``. CUDA; compiled once per process, the block
    mask rebuilt when ``(T, window, causal, device)`` changes."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    t = q.shape[2]
    window = min(window, t)  # |qi - ki| < t: a longer window is full attention (and stays an int32 in the mask)

    def mask_mod(b, h, qi, ki):
        d = qi - ki
        return ((d >= 0) & (d < window)) if causal else ((d < window) & (d > -window))

    key = (t, window, causal, q.device)
    if _FLEX.get("mask_key") != key:
        _FLEX["mask"] = create_block_mask(mask_mod, B=None, H=None, Q_LEN=t, KV_LEN=t, device=q.device)
        _FLEX["mask_key"] = key
    return _FLEX["fn"](q, k, v, block_mask=_FLEX["mask"])


def split_qkv(qkv: Tensor, batch: int, n_heads: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """``qkv [B * T, 3 * H * d_h]`` (per token ``[q | k | v]``) -> ``q, k, v [B, H, T, d_h]`` (strided views).

    On CUDA (eager) through :class:`~mixlab.ops.goat_triton.QKVSplit`, whose backward builds
    ``d qkv`` in one copy kernel, as GOAT's fast path does, instead of autograd's two copies
    for ``view -> permute -> unbind``: every position scheme pays the same for this step.
    """
    if qkv.is_cuda and qkv.dim() == 2 and qkv.is_contiguous() and not torch.compiler.is_compiling():
        from mixlab.ops.goat_triton import QKVSplit

        return QKVSplit.apply(qkv, batch, n_heads, head_dim)
    return qkv.view(batch, qkv.shape[0] // batch, 3, n_heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
