"""Small building blocks shared by recurrent mixers: a depthwise causal short convolution
with a decoding cache and packed-sequence support, a per-head RMSNorm gated by a
projection (fla layer recipe), and the RMSNorm that every block and mixer uses.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixlab.mixers.base import SubLayer

__all__ = ["ShortConv", "GatedRMSNorm", "RMSNorm", "short_conv_step"]


class ShortConv(SubLayer):
    """Depthwise causal 1-D convolution over tokens, optionally followed by SiLU (fla's
    ``ShortConvolution``; Mamba's conv1d).

    ``y_t = act(sum_{j=0}^{W-1} w_j * x_{t-W+1+j} + b)`` per channel, zero history
    before the first token (kernel ``W`` = 4 by default), and before the start of each
    packed sequence given ``cu_seqlens``.

    Args:
        dim: channels C.
        kernel_size: W >= 1.
        activation: ``"silu"`` or ``None``.
        bias: learnable bias.

    Forward: ``x [B, T, C]``, optional ``cache`` dict and ``key`` (name of the entry
    holding the last ``W - 1`` inputs ``[B, W-1, C]``, updated in place), optional
    ``cu_seqlens`` ``[N + 1]`` int64 start offsets of N sequences packed along T (B = 1)
    -> ``[B, T, C]``, dtype of x. Feeding a sequence in pieces with the same cache equals
    one parallel call.

    Parameters: ``weight [C, 1, W]`` (checkpoints with the delta-rule mixers' former
    ``[C, W]`` weight load as well), ``bias [C]`` or None.

    Raises:
        ValueError: ``kernel_size < 1`` or an unknown activation.
    """

    def __init__(self, dim: int, kernel_size: int = 4, activation: str | None = "silu", bias: bool = True) -> None:
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"ShortConv kernel_size must be >= 1; got {kernel_size}")
        if activation not in ("silu", None):
            raise ValueError(f"ShortConv activation must be 'silu' or None; got {activation!r}")
        self.dim, self.kernel_size, self.activation = dim, kernel_size, activation
        self.weight = nn.Parameter(torch.empty(dim, 1, kernel_size))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / self.kernel_size ** 0.5  # nn.Conv1d default for depthwise (fan_in = W)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # noqa: ANN001
        """Also load the ``[C, W]`` weight the delta-rule mixers' own convolution had."""
        w = state_dict.get(prefix + "weight")
        if w is not None and w.dim() == 2:
            state_dict[prefix + "weight"] = w.unsqueeze(1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: Tensor, cache: dict | None = None, key: str = "conv",
                cu_seqlens: Tensor | None = None) -> Tensor:
        b, t, c = x.shape
        w = self.kernel_size - 1
        if cache is not None and key in cache:
            past = cache[key].to(x.dtype)
        else:
            past = x.new_zeros(b, w, c)
        full = torch.cat([past, x], dim=1)  # [B, W-1+T, C]
        if cache is not None:
            cache[key] = full[:, full.shape[1] - w:].detach() if w else full[:, :0]
        # sum of W shifted products (exact; avoids the slow CPU depthwise-conv kernel)
        wt = self.weight.to(x.dtype)[:, 0]  # [C, W]
        valid = None if cu_seqlens is None else _segment_masks(cu_seqlens, t, self.kernel_size, x)
        y = full[:, 0:t] * wt[:, 0]
        if valid is not None:
            y = y * valid[w]
        for j in range(1, self.kernel_size):
            term = full[:, j : j + t] * wt[:, j]  # x_{t - (w - j)}
            y = y + (term if valid is None else term * valid[w - j])
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return F.silu(y) if self.activation == "silu" else y

    def static_buffer(self, cache: dict, key: str, batch: int, dtype: torch.dtype,
                      device: torch.device) -> Tensor:
        """The decoding tail ``[B, W-1, C]`` (``dtype``) for :meth:`step`: a copy of ``cache[key]`` (what
        :meth:`forward` left there), zeros when the cache has none."""
        if key in cache:
            return cache[key].to(dtype).clone(memory_format=torch.contiguous_format)
        return torch.zeros(batch, self.kernel_size - 1, self.dim, dtype=dtype, device=device)

    @staticmethod
    def joint_static_buffers(convs: list[tuple[str, ShortConv]], cache: dict, batch: int, dtype: torch.dtype,
                             device: torch.device) -> dict[str, Tensor]:
        """Decoding buffers of several convolutions of one kernel size and activation run as one on their
        concatenated channels (:func:`short_conv_step`; the same values, one launch): ``conv [B, W-1, sum C]``
        (the tails, from ``cache[name]`` of each ``(name, conv)``), ``conv_w [sum C, W]`` and, when the
        convolutions have biases, ``conv_b [sum C]``, all in ``dtype``."""
        out = {"conv": torch.cat([c.static_buffer(cache, n, batch, dtype, device) for n, c in convs], -1),
               "conv_w": torch.cat([c.weight[:, 0] for _, c in convs]).to(dtype)}
        if convs[0][1].bias is not None:
            out["conv_b"] = torch.cat([c.bias for _, c in convs]).to(dtype)
        return out

    def step(self, x: Tensor, tail: Tensor) -> Tensor:
        """One token ``x [B, C]`` with the last ``W - 1`` inputs ``tail [B, W-1, C]`` (dtype of x, updated in
        place: shifted by one, ``x`` appended) -> ``[B, C]``; the same sums as :meth:`forward`."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return short_conv_step(x, tail, self.weight.to(x.dtype)[:, 0], bias, self.activation)


def short_conv_step(x: Tensor, tail: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None) -> Tensor:
    """One decoding token of a depthwise causal convolution (:class:`ShortConv`): ``x [B, C]``, ``tail
    [B, W-1, C]`` (the last inputs, updated in place), ``weight [C, W]``, ``bias [C]`` or None, activation
    ``"silu"`` or None -> ``[B, C]``. Elementwise per channel, so several convolutions of the same kernel
    size and activation can run as one on concatenated channels with the same values."""
    full = torch.cat([tail, x.unsqueeze(1)], dim=1)  # [B, W, C] (a temporary, not the state)
    if weight.shape[1] > 1:
        tail.copy_(full[:, 1:])
    y = full[:, 0] * weight[:, 0]
    for j in range(1, weight.shape[1]):
        y = y + full[:, j] * weight[:, j]
    if bias is not None:
        y = y + bias
    return F.silu(y) if activation == "silu" else y


def _segment_masks(cu_seqlens: Tensor, t: int, kernel_size: int, x: Tensor) -> list[Tensor]:
    """``[1, T, 1]`` masks in x's dtype, one per lag ``s < kernel_size``: 1 where token
    ``pos - s`` lies in the same packed sequence as ``pos``."""
    pos = torch.arange(t, device=x.device)
    start = cu_seqlens[:-1].to(x.device)
    seg_start = start[torch.searchsorted(start, pos, right=True) - 1]  # [T]
    return [(pos - s >= seg_start).to(x.dtype)[None, :, None] for s in range(kernel_size)]


class RMSNorm(nn.RMSNorm):
    """``torch.nn.RMSNorm`` (``y = x / sqrt(mean(x^2) + eps) * weight`` over the last dims) that takes a
    half-precision input with float32 parameters, as under ``bf16-mixed``/``16-mixed`` autocast.

    Autocast casts ``layer_norm`` to float32 but not ``rms_norm``; given a bfloat16 ``x`` and a float32
    ``weight``, torch falls back to its unfused kernels with a ``UserWarning`` ("Mismatch dtype between
    input and weight"). This normalises ``x`` in the weight's dtype with the fused kernel and returns
    x's dtype, the values torch's fallback computes (in the wider of the two dtypes).

    Forward: ``x [..., *normalized_shape]`` any float dtype -> same shape, dtype of x.
    """

    def forward(self, x: Tensor) -> Tensor:
        if self.weight is None or x.dtype == self.weight.dtype:
            return super().forward(x)
        calc = torch.promote_types(x.dtype, self.weight.dtype)
        return F.rms_norm(x.to(calc), self.normalized_shape, self.weight.to(calc), self.eps).to(x.dtype)


class GatedRMSNorm(SubLayer):
    """Per-head RMSNorm of mixer outputs, multiplied by an activated gate.

    ``y = x / sqrt(mean(x^2) + eps) * weight * act(gate)`` over the last dim (head dim),
    ``act`` = ``swish`` (GLA, GDN, Mamba2, Mesa) or ``sigmoid`` (KDA).

    Forward: ``x [..., d]``, ``gate [..., d]`` or ``None`` (plain RMSNorm) -> same shape, dtype of x;
    computed in float32 for half-precision inputs and in float64 for float64 ones (a float32
    step inside a float64 reference made its results depend on the CPU's kernels: AVX2 vs AVX-512).
    """

    def __init__(self, dim: int, eps: float = 1e-5, activation: Literal["swish", "sigmoid"] = "swish") -> None:
        super().__init__()
        if activation not in ("swish", "sigmoid"):
            raise ValueError(f"GatedRMSNorm activation must be 'swish' or 'sigmoid'; got {activation!r}")
        self.eps, self.activation = eps, activation
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor, gate: Tensor | None = None) -> Tensor:
        dtype = x.dtype
        calc = torch.promote_types(dtype, torch.float32)  # float32 for half inputs, float64 stays float64
        xf = x.to(calc)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.to(calc)
        if gate is not None:
            gf = gate.to(calc)
            y = y * (F.silu(gf) if self.activation == "swish" else torch.sigmoid(gf))
        return y.to(dtype)
