"""Softmax attention mixer with pluggable position schemes (GOAT, RoPE, ALiBi, NoPE).

Notation: B batch, T tokens, H heads, ``d_h`` head dim, ``d_c`` content dims of q/k
(``d_h`` minus the position scheme's lanes). Values always use all ``d_h`` dims.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from mixlab.coords import Coords
from mixlab.mixers.base import AttentionMixer, resolve_head_dim
from mixlab.ops.attention import causal_mask, sdpa
from mixlab.registry import register_mixer

__all__ = ["Attention"]


@register_mixer("goat", position="goat")
@register_mixer("rope", position="rope")
@register_mixer("alibi", position="alibi")
@register_mixer("nope", position="nope")
class Attention(AttentionMixer):
    """Multi-head softmax attention; one ``scaled_dot_product_attention`` call per layer.

    Args:
        d_model: model width D.
        n_heads: H; ``head_dim = d_model // n_heads`` unless given.
        causal: causal (decoder) or bidirectional (encoder) attention.
        position: ``goat`` | ``rope`` | ``alibi`` | ``nope``.
        position_args: keyword arguments of the scheme (e.g. GOAT ``n_modes``, ``axes``,
            ``freq_base``, ``init``; RoPE ``axes``, ``base``).
        head_dim: per-head dim ``d_h`` (default ``d_model // n_heads``).
        impl: ``"sdpa"`` (fast path: lanes packed into q/k, flash-eligible, no dense
            bias) or ``"reference"`` (explicit logits ``content / sqrt(d_c) + log-prior``,
            materialises ``[B, H, T, T]``; for tests and figures).
        bias: bias in the q/k/v and output projections.
        dropout: attention-probability dropout (training only).

    Forward: ``x [B, T, D]``, ``coords`` (default ``Coords.seq(T)``), optional ``cache``
    dict holding ``k [B, H, T_past, d_h]``, ``v`` and the key ``coords`` -> ``[B, T, D]``.

    Raises:
        ValueError: ``d_model`` not divisible by ``n_heads``; head dim too small for the
            scheme's lanes; unknown ``impl``.
    """

    compile_safe = True  # forward and backward under torch.compile equal eager (tests/test_backbone_compile.py)

    arg_bounds = {"head_dim": ((">=", 1),), "dropout": ((">=", 0), ("<", 1))}
    """Ranges of the numeric arguments, checked by the registry before the class is built."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        causal: bool = True,
        position: str = "goat",
        position_args: dict[str, Any] | None = None,
        head_dim: int | None = None,
        impl: Literal["sdpa", "reference"] = "sdpa",
        bias: bool = False,
        dropout: float = 0.0,
        layer_idx: int = 0,
        n_layers: int = 1,
    ) -> None:
        super().__init__()
        head_dim = resolve_head_dim("attention", d_model, n_heads, head_dim)
        if impl not in ("sdpa", "reference"):
            raise ValueError(f"attention impl must be 'sdpa' or 'reference'; got {impl!r}")
        if not 0 <= dropout < 1:
            raise ValueError(f"attention dropout must be in [0, 1) (a probability); got {dropout}")
        self.d_model, self.n_heads, self.head_dim, self.causal = d_model, n_heads, head_dim, causal
        self.impl, self.dropout, self.layer_idx = impl, dropout, layer_idx
        # For lane schemes the last n_lanes rows of every q/k head of qkv are inert: those outputs
        # are replaced by the lanes, so these rows get exactly zero gradient (kept at zero by
        # reset_parameters; they are included in parameter counts: 2 * H * n_lanes * (D + bias)).
        self._init_projections(d_model, n_heads, head_dim, causal, position, position_args, bias)
        self.d_c = self.pos.content_dim

    def reset_parameters(self) -> None:
        self.pos.reset_parameters()
        if self.pos.n_lanes:
            with torch.no_grad():
                rows = self.qkv.weight.view(3, self.n_heads, self.head_dim, -1)[:2, :, self.d_c:]
                rows.zero_()
                if self.qkv.bias is not None:
                    self.qkv.bias.view(3, self.n_heads, self.head_dim)[:2, :, self.d_c:].zero_()

    # ------------------------------------------------------------------ pieces
    def _split(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``x [B, T, D]`` -> content ``q, k [B, H, T, d_c]`` and ``v [B, H, T, d_h]`` (views)."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        return q[..., : self.d_c], k[..., : self.d_c], v

    @staticmethod
    def _append(cache: dict | None, name: str, new: Tensor) -> Tensor:
        """Concatenate ``new`` after the cached tensor ``name`` (token dim 2) and store it."""
        if cache is None:
            return new
        # cat (or contiguous) copies: the cache must not keep the whole packed qkv buffer alive
        new = torch.cat([cache[name], new], dim=2) if name in cache else new.contiguous()
        cache[name] = new
        return new

    def forward(self, x: Tensor, coords: Coords | None = None, cache: dict | None = None) -> Tensor:
        b, t, _ = x.shape
        past = cache["v"].shape[2] if cache is not None and "v" in cache else 0
        cq = coords if coords is not None else Coords.seq(t, offset=past, device=x.device)
        ck = cq if not past else Coords.cat([cache["coords"], cq])
        if cache is not None:
            cache["coords"] = ck
        if self.impl == "reference":
            q, k, v = self._split(x)
            v = self._append(cache, "v", v)
            p = self._probs(q, self._append(cache, "kc", k), cq, ck)
            if self.training and self.dropout:
                p = F.dropout(p, self.dropout)
            y = p @ v
        else:
            # 2-D projection: its output is a base tensor (GOAT may write lanes into it in place)
            qp, kp, v = self.pos.pack(self.qkv(x.reshape(b * t, -1)), cq, b)
            v = self._append(cache, "v", v)
            kp = self._append(cache, "k", kp)
            drop = self.dropout if self.training else 0.0
            scale = 1.0 / math.sqrt(self.d_c)  # content logits / sqrt(d_c); lanes carry sqrt(d_c)
            if self.causal and past and t > 1:
                y = sdpa(qp, kp, v, cache is not None, attn_mask=causal_mask(t, kp.shape[2], x.device),
                         dropout_p=drop, scale=scale)
            else:
                y = sdpa(qp, kp, v, cache is not None, is_causal=self.causal and not past, dropout_p=drop, scale=scale)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))

    # ------------------------------------------------------------------ static decoding
    def static_cache(self, cache: dict, capacity: int) -> dict[str, Tensor] | None:
        """Static decoding buffers (see :meth:`Mixer.static_cache`); ``None`` for ``impl="reference"`` and
        bidirectional layers.

        ``k, v [B, H, capacity, d_h]`` (dtype of the cached keys; positions ``< P`` copied from the
        prefill's ``cache``, the rest zero until written), ``slots [capacity]`` int64 (``0 .. capacity - 1``,
        compared with the position to mask unwritten slots) and the position scheme's
        :meth:`~mixlab.mixers.positions.PositionScheme.decode_tables`.
        """
        if self.impl != "sdpa" or not self.causal or "k" not in cache:
            return None
        k, v = cache["k"], cache["v"]
        b, h, p, d = v.shape
        out = {"k": k.new_zeros(b, h, capacity, d), "v": v.new_zeros(b, h, capacity, d)}
        out["k"][:, :, :p] = k
        out["v"][:, :, :p] = v
        out["slots"] = torch.arange(capacity, device=v.device)
        return {**out, **self.pos.decode_tables(capacity, v.dtype, v.device)}

    def static_cache_bytes(self, batch: int, capacity: int, dtype: torch.dtype) -> int:
        if self.impl != "sdpa" or not self.causal:
            return 0
        item = torch.empty(0, dtype=dtype).element_size()
        lanes = 2 * self.n_heads * capacity * max(self.pos.n_lanes, self.head_dim // 2)
        return (2 * batch * self.n_heads * capacity * self.head_dim + lanes) * item + 8 * capacity

    def static_step(self, x: Tensor, state: dict[str, Tensor], pos: Tensor) -> Tensor:
        """One token (see :meth:`Mixer.static_step`): q/k/v of ``x [B, D]`` at ``pos``, the key and value
        written into slot ``pos`` of ``state["k"], state["v"]`` (``index_copy_``), then one SDPA call of the
        query over all ``capacity`` slots with the mask ``slots <= pos`` (filled prefix only)."""
        b = x.shape[0]
        q, k, v = self.pos.pack_step(self.qkv(x), state, pos)  # [B, H, 1, d_h]
        state["k"].index_copy_(2, pos, k)
        state["v"].index_copy_(2, pos, v)
        mask = (state["slots"] <= pos).view(1, 1, 1, -1)  # [1, 1, 1, capacity] bool: the filled prefix
        y = sdpa(q, state["k"], state["v"], True, attn_mask=mask, scale=1.0 / math.sqrt(self.d_c))
        return self.proj(y.reshape(b, -1))

    def _probs(self, q: Tensor, k: Tensor, cq: Coords, ck: Coords) -> Tensor:
        """Explicit weights ``softmax(q_c k_c^T / sqrt(d_c) + log-prior)`` ``[B, H, Tq, Tk]``.

        GOAT/ALiBi add the prior from its formula (``PositionScheme.bias``); RoPE rotates
        content first; causal masking is lower-right aligned.
        """
        q, k = self.pos.rotate(q, cq), self.pos.rotate(k, ck)
        z = q @ k.transpose(-1, -2) / math.sqrt(self.d_c)
        bias = self.pos.bias(cq, ck, z.dtype)
        if bias is not None:
            z = z + bias
        if self.causal:
            z = z.masked_fill(~causal_mask(z.shape[-2], z.shape[-1], z.device), float("-inf"))
        return torch.softmax(z, dim=-1)

    def attention_probs(self, x: Tensor, coords: Coords | None = None) -> Tensor:
        """``[B, H, T, T]`` attention weights by the reference formula (for figures)."""
        q, k, _ = self._split(x)
        c = coords if coords is not None else Coords.seq(x.shape[1], device=x.device)
        return self._probs(q, k, c, c)
