"""Integer token coordinates shared by every mixer.

Notation (used in all mixlab docstrings):

====  ==========================================================
B     batch size
T     sequence length (tokens)
A     number of coordinate axes (1 for text/DNA, 2 for a patch grid, 3 for
      a sequence that mixes 1D text with 2D image patches)
D     model width ``d_model``; H heads; ``d_h`` head dim
====  ==========================================================

A token's position is a vector of integers, one per axis, plus a mask saying
which axes the token has at all. A text token in a spatial-VQA sequence has
only the sequence axis; an image patch has (cell, y, x) but may lack the
sequence axis; a ViT ``[CLS]`` token has no coordinate on any axis. Position
schemes treat a missing axis as "no positional interaction on this axis"
(GOAT zeroes that axis' lanes, RoPE uses the identity rotation there), so
one coordinate object serves 1D sequences, 2D grids and mixtures of both.

Axis 0 is, by convention, the causal *sequence* axis: it is the coordinate
that key-linear (ALiBi-like) terms and the first-token bump use.

Coordinates stay integers; an optional per-axis ``scale`` says how long one
coordinate step is in the units the position schemes were trained in. A ViT
evaluated on a patch grid twice as large as its training grid with
``patch_coords: scaled`` passes ``scale = (0.5, 0.5)``: GOAT and RoPE then read
patch ``(y, x)`` at ``(y / 2, x / 2)`` training-grid units, which is the same as
multiplying every frequency of that axis by the scale. ``None`` (the default, and
every 1D sequence) means 1 on every axis and leaves the numerics untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Coords"]

_SEQ_CACHE: dict[tuple, "Coords"] = {}  # Coords.seq memo


@dataclass
class Coords:
    """Token coordinates for one batch.

    Attributes:
        pos: ``[B or 1, T, A]`` int64, integer coordinate per axis (units:
            tokens for the sequence axis, patches for grid axes).
        mask: ``[B or 1, T, A]`` bool or ``None`` (``None`` means every token has
            every axis). ``False`` marks an axis the token does not have; its
            ``pos`` entry is then ignored (kept at 0).

    A leading dimension of 1 broadcasts over the batch, which is the common
    case (all sequences share positions) and lets position features be
    computed once per layer instead of once per sample.

    Raises:
        ValueError: if ``pos`` is not 3-D integer or ``mask`` has another shape.
    """

    pos: Tensor
    mask: Tensor | None = None
    key: tuple | None = None
    """Hashable description for coordinates made by a builder (``("seq", T, offset)``);
    position schemes cache their parameter-free features under it. ``None``: no caching."""
    scale: tuple[float, ...] | None = None
    """Per-axis length of one coordinate step in the position schemes' units (``A`` positive
    floats), or ``None`` for 1 on every axis. Set it with :meth:`with_scale` (which also
    extends ``key``): schemes read ``pos * scale`` (:meth:`values`)."""

    def __post_init__(self) -> None:
        if self.pos.dim() != 3:
            raise ValueError(f"Coords.pos must be [B, T, A]; got shape {tuple(self.pos.shape)}")
        if self.pos.dtype.is_floating_point or self.pos.dtype == torch.bool:
            raise ValueError(f"Coords.pos must be an integer tensor; got {self.pos.dtype}")
        if self.mask is not None:
            if self.mask.shape != self.pos.shape:
                raise ValueError(
                    f"Coords.mask shape {tuple(self.mask.shape)} != pos shape {tuple(self.pos.shape)}"
                )
            if self.mask.dtype != torch.bool:
                raise ValueError(f"Coords.mask must be bool; got {self.mask.dtype}")
            if bool(self.mask.all()):
                self.mask = None
        if self.scale is not None:
            self.scale = tuple(float(v) for v in self.scale)
            if len(self.scale) != self.pos.shape[-1] or not all(v > 0 for v in self.scale):
                raise ValueError(f"Coords.scale must hold {self.pos.shape[-1]} positive floats; got {self.scale}")
            if all(v == 1.0 for v in self.scale):
                self.scale = None

    def last_seq_position(self) -> int | None:
        """Largest sequence position of :meth:`seq` coordinates, read from :attr:`key` (also behind
        :meth:`with_axes`, and kept by :meth:`to`): no device read. None for other coordinates."""
        key = self.key
        while key is not None and key[0] == "axes":
            key = key[1]
        if key is None or key[0] != "seq" or key[1] < 1:
            return None
        return key[1] + key[2] - 1

    # ------------------------------------------------------------------ builders
    @staticmethod
    def seq(length: int, offset: int = 0, device: torch.device | str | None = None) -> "Coords":
        """1D positions ``offset, ..., offset + length - 1`` as ``[1, T, 1]``.

        Memoised per (length, offset, device) (last 64): layers that build their own
        coordinates every call then launch no ``arange`` kernel. Treat the result as read-only.
        """
        key = (length, offset, str(torch.device(device)) if device is not None else "cpu")
        hit = _SEQ_CACHE.get(key)
        if hit is not None:
            return hit
        pos = torch.arange(offset, offset + length, device=device, dtype=torch.long)
        out = Coords(pos.view(1, length, 1), key=("seq", length, offset))
        if len(_SEQ_CACHE) >= 64:
            _SEQ_CACHE.pop(next(iter(_SEQ_CACHE)))
        _SEQ_CACHE[key] = out
        return out

    @staticmethod
    def grid(height: int, width: int, device: torch.device | str | None = None) -> "Coords":
        """Row-major 2D patch coordinates ``(y, x)`` as ``[1, h*w, 2]``."""
        ys, xs = torch.meshgrid(
            torch.arange(height, device=device), torch.arange(width, device=device), indexing="ij"
        )
        pos = torch.stack([ys.reshape(-1), xs.reshape(-1)], dim=-1).long()
        return Coords(pos.unsqueeze(0), key=("grid", height, width))

    @staticmethod
    def empty(length: int, axes: int, device: torch.device | str | None = None) -> "Coords":
        """``length`` tokens with no coordinate on any of ``axes`` axes (e.g. ``[CLS]``)."""
        pos = torch.zeros(1, length, axes, dtype=torch.long, device=device)
        return Coords(pos, torch.zeros_like(pos, dtype=torch.bool), key=("empty", length, axes))

    @staticmethod
    def cat(parts: list["Coords"]) -> "Coords":
        """Concatenate along the token axis (all parts must have the same A)."""
        axes = {p.axes for p in parts}
        if len(axes) != 1:
            raise ValueError(f"Coords.cat: parts have different axis counts {sorted(axes)}")
        scales = {p.scale for p in parts}
        if len(scales) != 1:
            raise ValueError(f"Coords.cat: parts have different scales {sorted(map(str, scales))}; "
                             "concatenate first, then call with_scale")
        batch = max(p.pos.shape[0] for p in parts)
        pos = torch.cat([p.pos.expand(batch, -1, -1) for p in parts], dim=1)
        key = ("cat",) + tuple(p.key for p in parts) if all(p.key is not None for p in parts) else None
        mask = None
        if any(p.mask is not None for p in parts):
            mask = torch.cat([p.full_mask().expand(batch, -1, -1) for p in parts], dim=1)
        return Coords(pos, mask, key=key, scale=parts[0].scale)

    # ------------------------------------------------------------------ accessors
    @property
    def axes(self) -> int:
        return self.pos.shape[-1]

    @property
    def length(self) -> int:
        return self.pos.shape[1]

    def full_mask(self) -> Tensor:
        """``[B or 1, T, A]`` bool mask, materialised."""
        if self.mask is None:
            return torch.ones_like(self.pos, dtype=torch.bool)
        return self.mask

    def values(self, dtype: torch.dtype = torch.float64) -> Tensor:
        """``[B or 1, T, A]`` coordinates in the schemes' units, ``pos * scale``, as ``dtype``
        (``pos`` itself, converted, when ``scale`` is None)."""
        out = self.pos.to(dtype)
        if self.scale is not None:
            out = out * torch.tensor(self.scale, dtype=dtype, device=out.device)
        return out

    def with_scale(self, scale: tuple[float, ...] | list[float] | None) -> "Coords":
        """The same coordinates with per-axis ``scale`` (see :attr:`scale`); ``key`` gains the scale.

        Raises:
            ValueError: not ``A`` positive numbers.
        """
        out = Coords(self.pos, self.mask, None, scale)
        if out.scale == self.scale:
            return self
        out.key = None if self.key is None else ("scale", self.key, out.scale)
        return out

    def to(self, device: torch.device | str) -> "Coords":
        return Coords(self.pos.to(device), None if self.mask is None else self.mask.to(device), self.key, self.scale)

    def slice(self, start: int, stop: int) -> "Coords":
        """Tokens ``start:stop`` (used for chunked evaluation and decoding)."""
        key = None if self.key is None else ("slice", self.key, start, stop)
        return Coords(self.pos[:, start:stop], None if self.mask is None else self.mask[:, start:stop], key,
                      self.scale)

    def with_axes(self, axes: int) -> "Coords":
        """Pad with missing axes up to ``axes`` (a 1D sequence used by a 2-axis prior)."""
        if axes == self.axes:
            return self
        if axes < self.axes:
            raise ValueError(f"coordinates have {self.axes} axes; the position scheme expects {axes}")
        b, t, a = self.pos.shape
        pad = torch.zeros(b, t, axes - a, dtype=self.pos.dtype, device=self.pos.device)
        mask = torch.cat([self.full_mask(), pad.bool()], dim=-1)
        key = None if self.key is None else ("axes", self.key, axes)
        scale = None if self.scale is None else self.scale + (1.0,) * (axes - a)
        return Coords(torch.cat([self.pos, pad], dim=-1), mask, key, scale)
