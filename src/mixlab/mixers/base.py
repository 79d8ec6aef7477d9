"""The one mixer contract every sequence mixer follows."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from mixlab.registry import POSITIONS

__all__ = ["Mixer", "AttentionMixer", "SubLayer", "check_choice", "check_sizes", "resolve_head_dim",
           "no_weight_decay"]


def check_sizes(mixer: str, minimum: int = 1, **sizes: int | None) -> None:
    """Raise ``ValueError`` naming the first size argument that is not ``None`` and below
    ``minimum`` (1 for widths and ranks; 0 where 0 switches a part off, e.g. ``conv_size``).

    Raises:
        ValueError: ``"<mixer> mixer: <name> must be an integer >= <minimum>; got <value>"``.
    """
    for name, value in sizes.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < minimum):
            raise ValueError(f"{mixer} mixer: {name} must be an integer >= {minimum}; got {value!r}")


def check_choice(mixer: str, name: str, value: object, choices: tuple) -> None:
    """Raise ``ValueError`` if ``value`` is not one of ``choices`` (e.g. an ``impl`` typo).

    Raises:
        ValueError: ``"<mixer> mixer: <name> must be one of (...); got <value>"``.
    """
    if value not in choices:
        raise ValueError(f"{mixer} mixer: {name} must be one of {choices}; got {value!r}")


def resolve_head_dim(mixer: str, d_model: int, n_heads: int, head_dim: int | None = None,
                     arg: str = "head_dim") -> int:
    """Per-head width: ``head_dim`` if given, else ``d_model // n_heads``.

    Raises:
        ValueError: ``head_dim`` given and not an integer >= 1; ``d_model`` not divisible by
            ``n_heads`` without ``head_dim`` (``"<mixer> mixer: d_model=.. is not divisible by
            n_heads=..; pass <arg>"``).
    """
    if head_dim is not None:
        check_sizes(mixer, **{arg: head_dim})
        return head_dim
    if d_model % n_heads:
        raise ValueError(f"{mixer} mixer: d_model={d_model} is not divisible by n_heads={n_heads}; pass {arg}")
    return d_model // n_heads


def no_weight_decay(*params: nn.Parameter | None) -> None:
    """Exclude parameters from weight decay (priors, gates, decay rates): sets the marker
    ``_no_weight_decay = True`` that :func:`mixlab.optim.param_groups` reads. ``None`` is skipped."""
    for p in params:
        if p is not None:
            p._no_weight_decay = True  # type: ignore[attr-defined]


class SubLayer(nn.Module):
    """Base of the building blocks mixers are made of that own their initialisation (short
    convolution, gated norm, position schemes).

    Like a :class:`Mixer`, the backbone calls its :meth:`reset_parameters` after the generic
    GPT init (which only touches ``nn.Linear`` layers), in module order.
    """

    def reset_parameters(self) -> None:
        """Own initialisation; a no-op by default."""


class Mixer(nn.Module):
    """Base class for all mixers (attention, delta rules, Mesa, SSMs).

    Contract::

        y = mixer(x, coords=None, cache=None)

    Args:
        x: ``[B, T, D]`` float (any dtype the weights accept under autocast).
        coords: :class:`~mixlab.coords.Coords` with ``[B|1, T, A]`` integer coordinates;
            ``None`` means ``Coords.seq(T)``. Recurrent mixers may ignore it.
        cache: ``None`` for a parallel forward, or a per-layer ``dict`` the mixer reads
            and updates in place (attention: keys/values; recurrent mixers: their state).
            Decoding token by token with a cache must equal the parallel forward.

    Returns:
        ``[B, T, D]``, same dtype as the mixer's output projection.

    Static decoding (optional, :mod:`mixlab.eval.decode`): :meth:`static_cache` turns a prefilled dict
    cache into fixed buffers and :meth:`static_step` decodes one token ``[B, D]`` on them in place at a
    device position (graph-capturable); mixers without it return None and decode with the dict cache.

    Constructor keywords shared by all mixers: ``d_model``, ``n_heads``, ``causal``,
    ``layer_idx``, ``n_layers``; the rest are the mixer's own (``mixer_args`` in configs).
    Output projections that write into the residual stream set ``_is_residual = True``
    so the backbone scales their init by ``1/sqrt(2 n_layers)`` (GPT-2 style). Parameters
    that must not be weight-decayed carry ``_no_weight_decay = True`` (set with
    :func:`no_weight_decay`). A mixer with custom initialisation overrides
    :meth:`reset_parameters`; the backbone calls it for every :class:`Mixer` (wherever the
    class is defined) after its generic init, then that of the mixer's :class:`SubLayer` s.
    """

    #: ``BackboneConfig.compile`` runs this mixer's blocks through ``torch.compile`` (checked: forward and
    #: backward equal to eager). False keeps the block eager (the recurrent mixers' chunk paths are not
    #: compile-clean: a view in the traced backward of the delta-rule chunk path fails).
    compile_safe: bool = False

    causal: bool = True
    position_axes: int | None = None
    """Coordinate axes the mixer's position scheme reads (1: sequences, 2: patch grids,
    3: text + patches); None when it reads no coordinates (recurrences, NoPE)."""

    def reset_parameters(self) -> None:
        """Mixer-specific initialisation (gates, priors) after the backbone's generic init; no-op by default."""

    def describe(self) -> dict[str, str | int | float | bool]:
        """Scalars that characterise the layer for run tables (TensorBoard HParams), e.g.
        ``{"position": "goat", "n_modes": 2}``; empty by default."""
        return {}

    def extra_metrics(self) -> dict[str, Tensor]:
        """Scalars to log after a step (e.g. Mesa CG iterations); empty by default."""
        return {}

    # ------------------------------------------------------------------ static decoding (fixed buffers)
    def static_cache(self, cache: dict, capacity: int) -> dict[str, Tensor] | None:
        """Fixed-size decoding buffers filled from a prefill ``cache`` (the dict a cached forward of the
        prompt filled), for :meth:`static_step`; ``None`` (the default) when the mixer has no static step
        (the decoder then falls back to the dict-cache loop).

        Args:
            cache: the layer's dict cache after the prompt's forward (its tensors are copied, not kept).
            capacity: token positions the buffers hold (prompt plus new tokens); a step at position
                ``>= capacity`` is an error the decoder raises before it happens.

        Returns:
            ``name -> Tensor`` buffers that :meth:`static_step` updates in place (never rebinds): shapes
            and dtypes documented by each mixer. Tensors are allocated once; CUDA graphs replay on them.
        """
        return None

    def static_cache_bytes(self, batch: int, capacity: int, dtype: torch.dtype) -> int:
        """Bytes :meth:`static_cache` allocates for ``batch`` sequences and ``capacity`` positions with
        activations in ``dtype`` (checked against free memory before allocating); 0 by default."""
        return 0

    def static_step(self, x: Tensor, state: dict[str, Tensor], pos: Tensor) -> Tensor:
        """One decoding token through fixed buffers: ``x [B, D]`` (the token's normed input) -> ``[B, D]``,
        equal to ``forward(x[:, None], cache=...)[:, 0]``.

        ``state`` (from :meth:`static_cache`) is updated in place; ``pos`` is a ``[1]`` int64 tensor on
        the model's device holding the token's position (tokens before it). No host synchronisation, no
        Python branch on device values, no new persistent allocation: the step can be captured in a
        ``torch.cuda.CUDAGraph`` and replayed.
        """
        raise NotImplementedError(f"{type(self).__name__} has no static decoding step")

    # Generic static step of mixers whose dict cache holds only fixed-size tensors (a recurrent state and
    # short-convolution tails that each cached call replaces): hawk, gla, mamba2 opt in by assigning these.
    def fixed_state_static_cache(self, cache: dict, capacity: int) -> dict[str, Tensor] | None:
        """Static buffers: a copy of every tensor of the prefilled dict ``cache`` (their shapes do not depend on
        the length decoded, so ``capacity`` is not used); None if the cache holds anything else."""
        if not cache or not all(isinstance(v, Tensor) for v in cache.values()):
            return None
        return {k: v.clone(memory_format=torch.contiguous_format) for k, v in cache.items()}

    def fixed_state_static_step(self, x: Tensor, state: dict[str, Tensor], pos: Tensor) -> Tensor:
        """One token by the mixer's own cached forward on a dict holding ``state``'s buffers, then the new
        entries copied back into the buffers (``copy_``): the dict-cache step's values, fixed addresses."""
        cache = dict(state)
        y = self(x.unsqueeze(1), None, cache)[:, 0]
        for k, buf in state.items():
            buf.copy_(cache[k])
        return y


class AttentionMixer(Mixer):
    """Base of the softmax-attention mixers with a registered position scheme (``goat``, ``rope``,
    ``alibi``, ``nope`` attention and ``swa``): the scheme and the projections are built one way,
    and the mixer describes itself by its scheme."""

    def _init_projections(self, d_model: int, n_heads: int, head_dim: int, causal: bool, position: str,
                          position_args: dict[str, Any] | None, bias: bool) -> None:
        """Build ``self.pos`` (scheme ``position`` with ``position_args``; an unknown key is a one-line
        ``ValueError`` naming the accepted ones), then the packed projection ``self.qkv``
        (``D -> 3 * H * d_h``, per token ``[q | k | v]``, each ``[H, d_h]``, as in a plain layer) and
        the residual output projection ``self.proj`` (``H * d_h -> D``)."""
        self.position_name = position
        self.pos = POSITIONS.build(position, n_heads=n_heads, head_dim=head_dim, causal=causal,
                                   **(position_args or {}))
        self.qkv = nn.Linear(d_model, 3 * n_heads * head_dim, bias=bias)
        self.proj = nn.Linear(n_heads * head_dim, d_model, bias=bias)
        self.proj._is_residual = True  # type: ignore[attr-defined]

    @property
    def position_axes(self) -> int | None:
        return self.pos.axes

    def describe(self) -> dict[str, str | int | float | bool]:
        return {"position": self.position_name, **self.pos.describe()}
