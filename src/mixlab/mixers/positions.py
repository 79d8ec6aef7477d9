"""Position schemes for attention mixers: GOAT, ALiBi (lane form), RoPE (multi-axis), NoPE.

A scheme turns content queries/keys ``[B, H, T, d]`` plus :class:`~mixlab.coords.Coords`
into the ``q', k'`` fed to ONE ``scaled_dot_product_attention`` call, and gives the same
logits explicitly (``bias``/``rotate``) for the reference path.

* Lane schemes (GOAT, ALiBi) take ``n_lanes`` of the head dim for positional lanes;
  content uses ``d_c = d_h - n_lanes`` dims, pre-scaled by ``sqrt(d_h / d_c)``.
* RoPE rotates content (``n_lanes = 0``), axis-wise for several axes.
* NoPE does nothing.

Every scheme is registered (``@register_position("name")``, :data:`mixlab.registry.POSITIONS`)
and built as ``cls(n_heads=..., head_dim=..., causal=..., **position_args)``; an unknown key in
``position_args`` is a one-line error naming the accepted ones. Prior parameters are excluded
from weight decay (:func:`~mixlab.mixers.base.no_weight_decay`). The math and the kernel
dispatch live in :mod:`mixlab.ops.goat` and :mod:`mixlab.ops.attention`.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixlab.coords import Coords
from mixlab.mixers.base import SubLayer, no_weight_decay
from mixlab.ops import goat as G
from mixlab.ops.attention import split_qkv
from mixlab.ops.compile import cuda_compiled
from mixlab.registry import register_position

__all__ = ["PositionScheme", "GoatPrior", "AlibiPrior", "RotaryPositions", "NoPositions"]

#: Largest ``j_hi`` (+1) a lane dtype holds exactly: integers are exact up to 2^(mantissa bits + 1).
_EXACT_J_HI = {torch.bfloat16: 256, torch.float16: 2048}


def _feature_cache(module: nn.Module, coords: Coords, dtype: torch.dtype) -> tuple[tuple | None, dict]:
    """``(key, cache)`` of a scheme's per-coordinates feature cache (a plain dict outside the
    module's state). Under ``torch.compile`` there is no cache (key None): the traced graph
    computes the features itself, and Dynamo cannot trace the module ``__dict__`` access."""
    if coords.key is None or torch.compiler.is_compiling():
        return None, {}
    return (coords.key, coords.pos.device, dtype), module.__dict__.setdefault("_feature_cache", {})


def _goat_grid(modes_per_axis: tuple[int, ...], base: float, device: torch.device) -> Tensor:
    """``[R]`` float64 fixed GOAT frequencies on ``device``: one geometric grid per axis, concatenated."""
    if not modes_per_axis:
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.cat([G.geometric_frequencies(m, base, device) for m in modes_per_axis])


def _rope_inv_freq(d_a: int, base: float, device: torch.device) -> Tensor:
    """``[d_a / 2]`` float64 RoPE inverse frequencies ``base^(-2i / d_a)`` of one axis block on ``device``."""
    return base ** (-torch.arange(0, d_a, 2, dtype=torch.float64, device=device) / d_a)


class PositionScheme(SubLayer):
    """Base class. Subclasses set ``n_lanes`` and ``axes`` and override the hooks they need.

    ``axes``: coordinate axes the scheme reads (None: it reads none, NoPE).
    """

    n_lanes: int = 0
    axes: int | None = 1

    def __init__(self, n_heads: int, head_dim: int, causal: bool) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.causal = n_heads, head_dim, causal

    @property
    def content_dim(self) -> int:
        return self.head_dim - self.n_lanes

    @property
    def lane_scale(self) -> float:
        """``sqrt(d_c)``: attention calls SDPA with ``scale = 1/sqrt(d_c)`` and lanes carry
        ``sqrt(d_c)`` on the query side. Identical logits to the paper's ``sqrt(d_h/d_c) q_c``
        and ``sqrt(d_h)`` lanes under SDPA's default ``1/sqrt(d_h)`` (Eqs. 23-27), with one
        elementwise pass over q less."""
        return math.sqrt(self.content_dim)

    def lanes(self, coords_q: Coords, coords_k: Coords, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``(q_lanes [B|1, H, Tq, L], k_lanes [B|1, H|1, Tk, L])`` with ``L = n_lanes``."""
        raise NotImplementedError

    def rotate(self, x: Tensor, coords: Coords) -> Tensor:
        """Rotate ``x [B, H, T, d]`` (RoPE only); identity by default."""
        return x

    def pack(self, qkv: Tensor, coords: Coords, batch: int) -> tuple[Tensor, Tensor, Tensor]:
        """Packed projection ``qkv [B * T, 3 * H * d_h]`` (per token ``[q | k | v]``, each
        ``[H, d_h]``; ``batch = B``) -> SDPA inputs ``q, k, v [B, H, T, d_h]`` (strided views or
        new tensors).

        Lane schemes replace the last ``n_lanes`` dims of every q/k head by the lanes (the
        projection's outputs there are discarded, so they get no gradient); RoPE rotates.
        Subclasses may write the lanes in place (GOAT's Triton path): pass the projection's
        own 2-D output, not a view of it, or autograd copies the whole gradient twice.
        """
        q, k, v = split_qkv(qkv, batch, self.n_heads, self.head_dim)
        if self.n_lanes == 0:
            return self.rotate(q, coords), self.rotate(k, coords), v
        ql, kl = self.lanes(coords, coords, qkv.dtype)
        d_c = self.content_dim
        return (torch.cat([q[..., :d_c], ql.expand(batch, -1, -1, -1)], dim=-1),
                torch.cat([k[..., :d_c], kl.expand(batch, -1, -1, -1)], dim=-1), v)

    def bias(self, coords_q: Coords, coords_k: Coords, dtype: torch.dtype) -> Tensor | None:
        """Explicit additive log-prior ``[B|1, H, Tq, Tk]`` for the reference path, or None."""
        return None

    # ------------------------------------------------------------------ static decoding
    def decode_tables(self, capacity: int, dtype: torch.dtype, device: torch.device) -> dict[str, Tensor]:
        """Position features of positions ``0 .. capacity - 1``, computed once before static decoding;
        :meth:`pack_step` picks one row with a device position (no per-step feature math, no host sync).

        Lane schemes (GOAT, ALiBi): ``q_lanes [1, H, capacity, n_lanes]`` and ``k_lanes
        [1, H|1, capacity, n_lanes]`` in ``dtype`` (the same values :meth:`pack` writes at those
        positions; GOAT raises here if a bf16 key-linear lane cannot hold ``capacity``). RoPE: ``cos,
        sin [1, 1, capacity, d_h / 2]`` in ``dtype``. NoPE: none.
        """
        if self.n_lanes == 0:
            return {}
        c = Coords.seq(capacity, device=device)
        ql, kl = self.lanes(c, c, dtype)
        return {"q_lanes": ql.contiguous(), "k_lanes": kl.contiguous()}

    def pack_step(self, qkv: Tensor, tables: dict[str, Tensor], pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """One decoding token: the packed projection ``qkv [B, 3 * H * d_h]`` at position ``pos`` (``[1]``
        int64 device tensor) -> SDPA inputs ``q, k, v [B, H, 1, d_h]``, from :meth:`decode_tables`' rows."""
        b = qkv.shape[0]
        q, k, v = qkv.view(b, 1, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if self.n_lanes == 0:
            return q, k, v
        d_c = self.content_dim
        ql = tables["q_lanes"].index_select(2, pos).expand(b, self.n_heads, -1, -1)
        kl = tables["k_lanes"].index_select(2, pos).expand(b, self.n_heads, -1, -1)
        return torch.cat([q[..., :d_c], ql], dim=-1), torch.cat([k[..., :d_c], kl], dim=-1), v

    def describe(self) -> dict[str, int]:
        """Scalars for run tables (e.g. GOAT ``{"n_modes": R}``); empty by default."""
        return {}


@register_position("nope")
class NoPositions(PositionScheme):
    """NoPE: content-only attention (causal masking still orders tokens)."""

    axes = None


@register_position("goat")
class GoatPrior(PositionScheme):
    """GOAT learned log-prior (paper Sec. 4, Eqs. 11-27), for any number of coordinate axes.

    Args:
        n_heads, head_dim: attention geometry; ``head_dim >= 2 * n_modes + 2 + 1``.
        causal: causal attention (enables the key-linear term by default).
        n_modes: ``R``, total Fourier modes over all axes (paper ablates 1, 2, 4, 8).
        axes: number of coordinate axes ``A`` the prior reads (1 for sequences, 2 for
            patch grids, 3 for text + 2D patches).
        modes_per_axis: modes assigned to each axis; default splits ``R`` evenly. Each
            axis gets the same geometric grid of its size (isotropic allocation, unlike
            the reference code, which gives x only the lowest frequencies).
        freq_base: grid ``w_r = base^(-r/(R_a - 1))`` (paper: 1k / 10k / 100k).
        learned_freqs: learn ``log w_r`` (paper Table 4, "Learned").
        key_linear: include ``lambda_h * j`` (default: ``causal``).
        key_mlp_hidden: hidden width of the per-head SiLU MLP ``g_h``; 0 disables ``g``.
        key_mlp_freqs: sinusoid count per axis in ``phi_abs``.
        abs_scale: fixed length normalising the ``j / scale`` feature of ``phi_abs``.
        bos_bias: include ``b_h 1{j = 0}`` (sequence axis coordinate 0).
        default_bias: learned ``u`` for tokens without any coordinate (ViT ``[CLS]``).
        init: ``"zero"`` (all prior terms 0), ``"random"`` (amplitudes N(0, 1/R), random
            ``g``) or ``"alibi"`` (``lambda`` = ALiBi slopes: a recency warm start).
        lane_impl: how the lanes are computed and packed into q/k. ``"auto"``: the Triton kernels on CUDA
            (written into the packed ``qkv`` in place, also under ``torch.compile``), the torch lanes
            elsewhere; ``"torch"``: the torch lanes concatenated after the content dims (the reference);
            ``"triton"``: the kernels, forced; ``"where"``: the torch lanes as a per-token table put into
            the projection's output by one ``torch.where`` (:meth:`pack`), a pointwise epilogue that
            ``torch.compile(mode="max-autotune")`` can fuse into its Triton GEMM of the qkv projection;
            ``"scatter"``: the same values by ``torch.slice_scatter`` (also pointwise), whose backward reads
            only the lane columns of ``d qkv`` for the lanes' gradient (``where``'s reads all of it).

    Coordinates with a per-axis :attr:`~mixlab.coords.Coords.scale` ``s`` are read as ``s * c``
    by the Fourier modes and ``phi_abs`` (each frequency of the axis times ``s``): the ViT's
    ``patch_coords: scaled``. The key-linear term needs an unscaled sequence axis.

    Raises:
        ValueError: head_dim too small for ``2R + 2`` lanes plus one content dim; ``R``
            not divisible over the axes; bad ``init`` name.
    """

    arg_bounds = {"n_modes": ((">=", 0),), "axes": ((">=", 1),), "freq_base": ((">", 0),),
                  "key_mlp_hidden": ((">=", 0),), "key_mlp_freqs": ((">=", 0),), "abs_scale": ((">", 0),)}
    """Ranges of the numeric arguments, checked by the registry before the class is built."""

    def __init__(
        self,
        n_heads: int,
        head_dim: int,
        causal: bool = True,
        n_modes: int = 4,
        axes: int = 1,
        modes_per_axis: list[int] | None = None,
        freq_base: float = 10000.0,
        learned_freqs: bool = False,
        key_linear: bool | None = None,
        key_mlp_hidden: int = 32,
        key_mlp_freqs: int = 8,
        abs_scale: float = 1024.0,
        bos_bias: bool | None = None,
        default_bias: bool = False,
        init: Literal["zero", "random", "alibi"] = "zero",
        learn_slope: bool = True,
        lane_impl: Literal["auto", "torch", "triton", "where", "scatter"] = "auto",
    ) -> None:
        super().__init__(n_heads, head_dim, causal)
        if n_modes < 0:
            raise ValueError(f"n_modes must be >= 0; got {n_modes}")
        self.n_modes, self.axes = n_modes, axes
        self.n_lanes = 2 * n_modes + 2
        if head_dim < self.n_lanes + 1:
            raise ValueError(
                f"head_dim={head_dim} is too small for GOAT with n_modes={n_modes}: "
                f"needs 2R+2={self.n_lanes} positional lanes plus at least one content dim"
            )
        if modes_per_axis is None:
            if n_modes % axes:
                raise ValueError(f"n_modes={n_modes} does not split evenly over axes={axes}; pass modes_per_axis")
            modes_per_axis = [n_modes // axes] * axes
        if not isinstance(modes_per_axis, (list, tuple)) or len(modes_per_axis) != axes \
                or not all(isinstance(m, int) and not isinstance(m, bool) and m >= 0 for m in modes_per_axis) \
                or sum(modes_per_axis) != n_modes:
            raise ValueError(f"modes_per_axis must be a list of {axes} integer(s) >= 0 summing to n_modes={n_modes}; "
                             f"got {modes_per_axis!r}")
        if init not in ("zero", "random", "alibi"):
            raise ValueError(f"GOAT init must be 'zero', 'random' or 'alibi'; got {init!r}")
        self.modes_per_axis = list(modes_per_axis)
        self.key_linear = causal if key_linear is None else key_linear
        self.use_bos = causal if bos_bias is None else bos_bias
        self.use_default = default_bias
        self.key_mlp_freqs, self.abs_scale = key_mlp_freqs, float(abs_scale)
        self.init_name = init
        if lane_impl not in ("auto", "torch", "triton", "where", "scatter"):
            raise ValueError("GOAT lane_impl must be 'auto', 'torch', 'triton', 'where' or 'scatter'; "
                             f"got {lane_impl!r}")
        self.lane_impl = lane_impl

        freqs = _goat_grid(tuple(modes_per_axis) if n_modes else (), freq_base, torch.device("cpu"))
        if n_modes:
            mode_axis = torch.cat([torch.full((m,), a, dtype=torch.long) for a, m in enumerate(modes_per_axis)])
        else:
            mode_axis = torch.zeros(0, dtype=torch.long)
        self.register_buffer("mode_axis", mode_axis, persistent=False)
        if learned_freqs:
            self.log_freqs = nn.Parameter(freqs.log().float())
            no_weight_decay(self.log_freqs)
            self.log_freqs._lr_group = "position_prior"  # type: ignore[attr-defined]  (optim.lr_scales)
        else:
            # kept as a plain float64 tensor, not a buffer: module.to(bfloat16) must not round the grid
            self._freqs_fixed = freqs
            self._freqs_key = ("goat_freqs", tuple(modes_per_axis) if n_modes else (), float(freq_base))  # G.on_device
            self.log_freqs = None
        # Every learned term lives in ONE flat float32 vector ``prior`` in the Triton kernels'
        # layout (mixlab.ops.goat.param_layout); ``alpha``, ``slope``, ``mlp_w1``,
        # ... are views of it. One leaf instead of eight: the fast path passes it to the kernel
        # as is and gets one gradient back (no per-step concatenation, split or eight
        # gradient accumulations: a short attention layer is host-bound on a fast GPU).
        # A fixed slope (``learn_slope=False``, ALiBi) is the buffer ``fixed_slope`` instead.
        self.key_mlp_hidden = key_mlp_hidden
        H, D = n_heads, key_mlp_hidden
        n_feat = axes * (2 * key_mlp_freqs + 2) if D > 0 else 0
        self.learn_slope = learn_slope
        self._segments = G.param_layout(H, n_modes, n_feat, D, slope=self.key_linear and learn_slope,
                                        bos=self.use_bos, default=self.use_default)
        offset = sum(math.prod(shape) for _, shape in self._segments.values())
        if offset:
            self.prior = nn.Parameter(torch.zeros(offset))
            no_weight_decay(self.prior)
            self.prior._lr_group = "position_prior"  # type: ignore[attr-defined]  (optim.lr_scales)
        else:  # nothing learned (ALiBi): an empty buffer keeps the code path uniform
            self.register_buffer("prior", torch.zeros(0), persistent=False)
        if self.key_linear and not learn_slope:  # fixed slopes (ALiBi) are a buffer, saved with the model
            self.register_buffer("fixed_slope", torch.zeros(n_heads))
        self.reset_parameters()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # noqa: ANN001
        """Also load checkpoints written before the terms were packed into ``prior`` (keys
        ``alpha``, ``beta``, ``slope``, ``bos``, ``default``, ``mlp_w1``, ``mlp_b1``, ``mlp_w2``)."""
        old = [name for name in self._segments if prefix + name in state_dict]
        if prefix + "prior" not in state_dict and old:
            flat = torch.zeros_like(self.prior)
            for name, (o, shape) in self._segments.items():
                if prefix + name in state_dict:
                    flat[o:o + math.prod(shape)] = state_dict.pop(prefix + name).reshape(-1)
            state_dict[prefix + "prior"] = flat
        if "fixed_slope" in self._buffers and prefix + "slope" in state_dict:  # old ALiBi buffer name
            state_dict[prefix + "fixed_slope"] = state_dict.pop(prefix + "slope")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def reset_parameters(self) -> None:
        """Apply ``init`` (called by the backbone after its generic GPT init)."""
        with torch.no_grad():
            if self.init_name == "random":
                std = 1.0 / math.sqrt(max(self.n_modes, 1))
                self.alpha.normal_(0, std)
                self.beta.normal_(0, std)
            else:
                self.alpha.zero_()
                self.beta.zero_()
            if self.key_linear:
                if self.init_name == "alibi":
                    self.slope.copy_(G.alibi_slopes(self.n_heads).float())
                else:
                    self.slope.zero_()
            if self.use_bos:
                self.bos.zero_()
            if self.use_default:
                self.default.zero_()
            if self.key_mlp_hidden > 0:
                nn.init.normal_(self.mlp_w1, 0.0, 1.0 / math.sqrt(self.mlp_w1.shape[1]))
                self.mlp_b1.zero_()
                if self.init_name == "random":
                    self.mlp_w2.normal_(0.0, 1.0 / math.sqrt(self.key_mlp_hidden))
                else:
                    self.mlp_w2.zero_()

    # ------------------------------------------------------------------ pieces
    def freqs(self) -> Tensor:
        """``[R]`` float64 angular frequencies (radians per coordinate unit)."""
        if self.log_freqs is not None:
            return self.log_freqs.double().exp()
        return G.on_device(self._freqs_key, self._fixed_freqs_on, self.prior.device)

    def _fixed_freqs_on(self, device: torch.device) -> Tensor:
        """The fixed grid: the host tensor itself on the CPU, else built on ``device`` (:func:`G.on_device`)."""
        return self._freqs_fixed if device.type == "cpu" else _goat_grid(*self._freqs_key[1:], device)

    def _coords(self, coords: Coords) -> Coords:
        c = coords.with_axes(self.axes)
        if c.scale is not None and c.scale[0] != 1.0 and self.key_linear:
            raise ValueError(f"GOAT key_linear reads the integer sequence axis; Coords.scale={c.scale} rescales it. "
                             "Scale only axes without the key-linear term (e.g. a bidirectional ViT's patch grid)")
        return c

    def _mode_scale(self, c: Coords) -> Tensor:
        """``[R]`` float64 length of one coordinate step for each mode (``Coords.scale`` of its axis; 1 if unset)."""
        one = torch.ones(self.n_modes, dtype=torch.float64, device=c.pos.device)
        if c.scale is None:
            return one
        return one * torch.tensor(c.scale, dtype=torch.float64, device=c.pos.device)[self.mode_axis.to(c.pos.device)]

    @staticmethod
    def _abs_pos(c: Coords) -> Tensor:
        """Coordinates fed to ``phi_abs``: the integers, or ``pos * scale`` (float64) when scaled."""
        return c.pos if c.scale is None else c.values(torch.float64)

    def _features(self, coords: Coords, calc: torch.dtype) -> dict[str, Tensor]:
        """Parameter-free position features of ``coords`` (cached under ``coords.key``).

        ``pos_r``/``present`` ``[B, T, R]`` (coordinate read by each mode, times its axis'
        ``Coords.scale``: a scale multiplies that axis' Fourier frequencies), ``cos``/``sin``
        (fixed frequencies only), ``phi`` ``[B, T, F]``, ``j_hi``/``j_lo``/``is_bos``/
        ``is_none`` ``[B, T]``, all in ``calc`` dtype except ``pos_r`` (float64).
        """
        key, cache = _feature_cache(self, coords, calc)
        if key is not None and key in cache:
            return cache[key]
        c = self._coords(coords)
        mask = c.full_mask()
        pos_r, present = G.fourier_angles(c.pos, c.mask, self._mode_scale(c), self.mode_axis)
        f = {"pos_r": pos_r, "present": present.to(calc)}
        if self.log_freqs is None:
            ang = pos_r * self.freqs().to(pos_r.device)
            f["cos"], f["sin"] = torch.cos(ang).to(calc), torch.sin(ang).to(calc)
        if self.key_mlp_hidden > 0:
            f["phi"] = G.abs_features(self._abs_pos(c), c.mask, self.key_mlp_freqs, self.abs_scale, calc)
        seq, has_seq = c.pos[..., 0], mask[..., 0]
        j_hi, j_lo = G.split_key_linear(torch.where(has_seq, seq, torch.zeros_like(seq)))
        f.update(j_hi=j_hi.to(calc), j_lo=j_lo.to(calc), is_bos=((seq == 0) & has_seq).to(calc),
                 is_none=(~mask.any(-1)).to(calc))
        last = coords.last_seq_position()
        if last is not None:  # plain sequence positions: the key-range check needs no host sync
            f["j_hi_max"] = last // G.KEY_LINEAR_BLOCK
        if key is not None:
            if len(cache) >= 16:
                cache.pop(next(iter(cache)))
            cache[key] = f
        return f

    def _cos_sin(self, f: dict[str, Tensor], calc: torch.dtype) -> tuple[Tensor, Tensor]:
        if "cos" in f:
            return f["cos"], f["sin"]
        ang = f["pos_r"] * self.freqs().to(f["pos_r"].device)  # learned frequencies: differentiable
        return torch.cos(ang).to(calc), torch.sin(ang).to(calc)

    def _segment(self, name: str) -> Tensor | None:
        """View of the learned term ``name`` in ``prior`` (None if the term is absent)."""
        seg = self._segments.get(name)
        if seg is None:
            return None
        o, shape = seg
        return self.prior[o:o + math.prod(shape)].view(shape)

    alpha = property(lambda self: self._segment("alpha"), doc="``[H, R]`` cosine amplitudes (view of ``prior``).")
    beta = property(lambda self: self._segment("beta"), doc="``[H, R]`` sine amplitudes (view of ``prior``).")
    bos = property(lambda self: self._segment("bos"), doc="``[H]`` BOS bias ``b_h`` or None.")
    default = property(lambda self: self._segment("default"),
                       doc="``[H]`` default ``u`` of tokens without coordinates or None.")
    mlp_w1 = property(lambda self: self._segment("mlp_w1"), doc="``[H, F, D]`` first layer of ``g_h`` or None.")
    mlp_b1 = property(lambda self: self._segment("mlp_b1"), doc="``[H, D]`` hidden bias of ``g_h`` or None.")
    mlp_w2 = property(lambda self: self._segment("mlp_w2"), doc="``[H, D]`` output weights of ``g_h`` or None.")

    @property
    def slope(self) -> Tensor | None:
        """``[H]`` key-linear slope ``lambda_h`` (view of ``prior``, or the ``fixed_slope`` buffer), or None."""
        return self.fixed_slope if "fixed_slope" in self._buffers else self._segment("slope")

    @property
    def learned_terms(self) -> tuple[str, ...]:
        """Names of the terms stored (and trained) in ``prior``."""
        return tuple(self._segments)

    def _params(self, calc: torch.dtype) -> dict[str, Tensor | None]:
        terms = {"alpha": self.alpha, "beta": self.beta, "slope": self.slope, "bos": self.bos,
                 "default": self.default, "w1": self.mlp_w1, "b1": self.mlp_b1, "w2": self.mlp_w2}
        return {k: None if t is None else t.to(calc) for k, t in terms.items()}

    def describe(self) -> dict[str, int]:
        return {"n_modes": int(self.n_modes)}

    def key_only(self, coords: Coords, dtype: torch.dtype = torch.float64) -> Tensor:
        """``u_h(j) = lambda_h j + g_h(phi_abs(j)) + b_h 1{j=0} (+ default if no axes)``, ``[B|1, H, T]``.

        Computed directly (unsplit ``lambda j``) in ``dtype``; used by the reference path
        and the prior figures.
        """
        c = self._coords(coords)
        p = self._params(dtype)
        seq, mask = c.pos[..., 0], c.full_mask()
        u = torch.zeros(1, self.n_heads, c.length, dtype=dtype, device=c.pos.device)
        if p["w1"] is not None:
            phi = G.abs_features(self._abs_pos(c), c.mask, self.key_mlp_freqs, self.abs_scale, dtype)
            u = u + G.key_mlp(phi, p["w1"], p["b1"], p["w2"])
        if p["slope"] is not None:
            u = u + p["slope"][None, :, None] * torch.where(mask[..., 0], seq, 0).to(dtype).unsqueeze(1)
        if p["bos"] is not None:
            u = u + p["bos"][None, :, None] * ((seq == 0) & mask[..., 0]).to(dtype).unsqueeze(1)
        if p["default"] is not None:
            u = u + p["default"][None, :, None] * (~mask.any(-1)).to(dtype).unsqueeze(1)
        return u

    def _check_key_range(self, f: dict[str, Tensor], dtype: torch.dtype) -> None:
        """The key-linear lane holds ``j_hi = j // 128`` in the lane dtype: exact in bfloat16 below
        256 (keys j < 32768) and in float16 below 2048 (j < 262144), in float32 to 2^24. Past that
        the recency prior would be silently wrong, so raise instead. One host sync per new set of
        coordinates (the result is kept with the cached features).

        Raises:
            ValueError: a key position the lane dtype cannot hold exactly, naming the limit and
                the ways out (float32 precision, shorter sequences, ``key_linear: false``).
        """
        limit = _EXACT_J_HI.get(dtype)
        if not self.key_linear or limit is None:
            return
        if "j_hi_max" not in f:
            if torch.compiler.is_compiling():  # no host sync inside a graph: a device-side assert
                if f["j_hi"].numel():
                    torch._assert_async(f["j_hi"].max() < limit, "goat: a key position is beyond the key-linear "
                                        f"lane's exact range in {dtype} (positions < {limit * G.KEY_LINEAR_BLOCK})")
                return
            f["j_hi_max"] = int(f["j_hi"].max()) if f["j_hi"].numel() else 0
        if f["j_hi_max"] >= limit:
            j_max, block = limit * G.KEY_LINEAR_BLOCK, f["j_hi_max"] * G.KEY_LINEAR_BLOCK
            raise ValueError(
                f"goat: key positions reach {block}..{block + G.KEY_LINEAR_BLOCK - 1} (the last key's block); the "
                f"key-linear lane is exact in {str(dtype).replace('torch.', '')} only for positions < {j_max} (j // "
                f"{G.KEY_LINEAR_BLOCK} < {limit}); use --trainer.precision 32, sequences shorter than {j_max}, or "
                "position_args: {key_linear: false}")

    # ------------------------------------------------------------------ scheme API
    def lanes(self, coords_q: Coords, coords_k: Coords, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        calc = torch.float64 if dtype == torch.float64 else torch.float32
        fq = self._features(coords_q, calc)
        fk = fq if coords_k is coords_q else self._features(coords_k, calc)
        self._check_key_range(fk, dtype)
        if G.use_triton(self._lane_impl(fq["present"]), fq["present"], calc, self.log_freqs is not None):  # one kernel
            return G.triton_lanes(G.packed_features(fq), G.packed_features(fk), self._flat_params(),
                                  self._kernel_meta(), dtype)
        cos_q, sin_q = self._cos_sin(fq, calc)
        cos_k, sin_k = (cos_q, sin_q) if fk is fq else self._cos_sin(fk, calc)
        pres_k = fk["present"]
        if fk is fq and torch.compiler.is_compiling():  # Dynamo traces Function.apply only on distinct tensors
            cos_k, sin_k, pres_k = cos_q.clone(), sin_q.clone(), pres_k.clone()
        p = self._params(calc)
        return G.GoatLanes.apply(cos_q, sin_q, fq["present"], cos_k, sin_k, pres_k, fk.get("phi"),
                                 fk["j_hi"], fk["j_lo"], fk["is_bos"], fk["is_none"], p["alpha"], p["beta"],
                                 p["slope"], p["bos"], p["default"], p["w1"], p["b1"], p["w2"], self.lane_scale, dtype)

    # ------------------------------------------------------------------ Triton fast path inputs
    def _flat_params(self) -> Tensor:
        """The prior parameters as one flat float32 vector in the kernels' layout: ``prior``
        itself, or with the fixed slope spliced in (one ``cat``)."""
        flat = self.prior
        if "fixed_slope" in self._buffers:
            o = 2 * self.n_heads * self.n_modes
            flat = torch.cat([flat[:o], self.fixed_slope.to(flat.dtype), flat[o:]])
        return flat if flat.dtype == torch.float32 else flat.float()

    def _kernel_meta(self) -> dict:
        """Compile-time constants of the Triton kernels for this prior (computed once)."""
        meta = self.__dict__.get("_meta")
        if meta is None:
            mlp = self.key_mlp_hidden > 0
            meta = G.triton_meta(self.n_heads, self.n_modes, self._segments["mlp_w1"][1][1] if mlp else 0,
                                 self.key_mlp_hidden if mlp else 0, self.lane_scale, slope=self.key_linear,
                                 bos=self.use_bos, default=self.use_default)
            self.__dict__["_meta"] = meta
        return meta

    def pack(self, qkv: Tensor, coords: Coords, batch: int) -> tuple[Tensor, Tensor, Tensor]:
        """See :meth:`PositionScheme.pack`. On the Triton path the lanes are written into
        ``qkv``'s lane dims in place and q, k, v are views of it (:class:`~mixlab.ops.goat_triton.GoatQKV`):
        one kernel forward, two backward (one of them the pass that builds ``d qkv``), no
        concatenation and no extra saved activation."""
        if self.lane_impl in ("where", "scatter"):
            return self._pack_where(qkv, coords, batch)
        calc = torch.float64 if qkv.dtype == torch.float64 else torch.float32
        f = self._features(coords, calc)
        self._check_key_range(f, qkv.dtype)
        if (not G.use_triton(self._lane_impl(f["present"]), f["present"], calc, self.log_freqs is not None,
                             compiled_ok=True)
                or f["present"].shape[0] not in (1, batch)):
            return super().pack(qkv, coords, batch)
        return G.triton_pack_qkv(qkv, G.packed_features(f), self._flat_params(), self._kernel_meta(), batch,
                                 self.head_dim)

    def _lane_impl(self, like: Tensor) -> str:
        """``lane_impl`` for tensors on ``like``'s device: ``"triton"`` off CUDA (and outside Triton's interpreter)
        becomes ``"torch"``, with one warning, so that a model trained with the kernels forced still runs and
        evaluates on a CPU (the same values)."""
        if self.lane_impl != "triton" or like.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
            return self.lane_impl
        if not self.__dict__.get("_warned_cpu"):
            self.__dict__["_warned_cpu"] = True
            warnings.warn(f"goat: position_args.lane_impl 'triton' needs CUDA tensors; got {like.device.type}, so the "
                          "lanes are computed by torch ops (the same values; 'auto' picks this silently)", stacklevel=3)
        return "torch"

    def _pack_where(self, qkv: Tensor, coords: Coords, batch: int) -> tuple[Tensor, Tensor, Tensor]:
        """``lane_impl="where"``: ``qkv [B * T, 3 * H * d_h]`` -> ``q, k, v [B, H, T, d_h]`` (views of one new
        tensor of ``qkv``'s dtype) with the lanes (the paper's packed q/k features, Sec. 4, Eqs. 11-27: one SDPA
        call is then exact) in the last ``n_lanes`` dims of every q/k head, as :meth:`PositionScheme.pack` (the same
        values), but in
        one pointwise op: ``torch.where(lane_dims, table, qkv)``, ``table [B|1, T, 3, H, d_h]`` (the lanes,
        zeros elsewhere; broadcast over the batch when the coordinates are shared). Under
        ``torch.compile(mode="max-autotune")`` Inductor can fuse that ``where`` into the epilogue of its
        Triton GEMM of the projection: the lanes cost no pass over ``qkv`` of their own. The projection's
        outputs at the lane dims get no gradient; the table's gradient is the sum over the batch there.

        ``lane_impl="scatter"``: the same tensor by two nested ``torch.slice_scatter`` (the lanes into the q/k part's
        last ``n_lanes`` dims, that part into ``qkv``), pointwise as well; the lanes' gradient is then the sum over
        the batch of ``d qkv``'s lane columns alone (a slice), where ``where``'s sums a full-size masked table."""
        ql, kl = self.lanes(coords, coords, qkv.dtype)  # [B|1, H|1, T, n_lanes]
        h, dh, dc = self.n_heads, self.head_dim, self.content_dim
        t = qkv.shape[0] // batch
        nb = max(ql.shape[0], kl.shape[0])
        lanes = torch.stack([ql.expand(nb, h, t, -1), kl.expand(nb, h, t, -1)], dim=1).permute(0, 3, 1, 2, 4)
        # lanes [B|1, T, 2, H, L]; x [B, T, 3, H, d_h]: the lanes go to x[:, :, :2, :, d_c:]
        x = qkv.view(batch, t, 3, h, dh)
        if self.lane_impl == "scatter":
            qk = torch.slice_scatter(x[:, :, :2], lanes.expand(batch, -1, -1, -1, -1), dim=4, start=dc)
            out = torch.slice_scatter(x, qk, dim=2, start=0, end=2)
        else:
            table = F.pad(lanes, (dc, 0, 0, 0, 0, 1))  # [B|1, T, 3, H, d_h]
            which = torch.arange(3, device=qkv.device).view(3, 1, 1)
            dim = torch.arange(dh, device=qkv.device).view(1, 1, dh)
            out = torch.where((which < 2) & (dim >= dc), table, x)
        q, k, v = out.permute(2, 0, 3, 1, 4).unbind(0)
        return q, k, v

    def bias(self, coords_q: Coords, coords_k: Coords, dtype: torch.dtype) -> Tensor:
        return self.prior_terms(coords_q, coords_k, dtype)["total"]

    def prior_terms(self, coords_q: Coords, coords_k: Coords, dtype: torch.dtype = torch.float64) -> dict[str, Tensor]:
        """The log-prior split into ``relative``, ``key_only`` and ``total``, each ``[B|1, H, Tq, Tk]``.

        Computed from the formula (coordinate differences, unsplit ``lambda j``), independent
        of the lane packing: the reference path and the prior figures use it.
        """
        cq, ck = self._coords(coords_q), self._coords(coords_k)
        rel = G.relative_logits(cq.values(), cq.mask, ck.values(), ck.mask, self.freqs().to(cq.pos.device).to(dtype),
                                self.mode_axis, self.alpha.to(dtype), self.beta.to(dtype))
        u = self.key_only(ck, dtype).unsqueeze(2)  # [B, H, 1, Tk]
        u = u.expand(-1, -1, cq.length, -1)
        return {"relative": rel, "key_only": u, "total": rel + u}


@register_position("alibi")
class AlibiPrior(GoatPrior):
    """ALiBi (Press et al. 2022) in GOAT's key-linear lanes: ``-m_h (i - j) == m_h j - m_h i``.

    For causal attention the row constant ``-m_h i`` cancels in softmax, so the fixed slope
    as a key-only term gives ALiBi's weights with one flash-eligible SDPA call (2 lanes,
    ``d_c = d_h - 2``). Uses the same two-lane split, so no bf16 staircase.

    Raises:
        ValueError: for bidirectional attention (ALiBi's ``|i - j|`` is not key-only).
    """

    def __init__(self, n_heads: int, head_dim: int, causal: bool = True) -> None:
        if not causal:
            raise ValueError("position='alibi' needs causal attention: the bidirectional |i-j| bias is not key-only; "
                             "use goat, rope or nope for bidirectional mixers")
        super().__init__(n_heads, head_dim, causal=True, n_modes=0, key_linear=True, key_mlp_hidden=0,
                         bos_bias=False, init="alibi", learn_slope=False)

    def describe(self) -> dict[str, int]:
        return {}


@register_position("rope")
class RotaryPositions(PositionScheme):
    """RoPE (Su et al. 2021), axis-wise for several axes (2D axial RoPE for patches).

    The head dim is split into ``axes`` equal even parts; part ``a`` rotates with axis
    ``a``'s coordinate using frequencies ``base^(-2i/d_a)`` (GPT-NeoX half-rotation
    layout). Missing axes rotate by angle 0 (identity). A
    :attr:`~mixlab.coords.Coords.scale` multiplies each axis' angles (position interpolation).

    ``rotary_impl``: ``"auto"`` (default: ``triton`` on CUDA, under ``torch.compile`` too, else ``torch``),
    ``"torch"`` (:class:`~mixlab.ops.goat_triton.QKVSplit` views, then a compiled rotation per tensor)
    or ``"triton"`` (q and k rotated in place in the packed projection by
    :class:`~mixlab.ops.rope_triton.RopeQKV`, one kernel each way; under ``torch.compile`` the same kernel
    in place each way as the kernel op ``mixlab::rope_rotate``; on CPU tensors it warns once and
    takes the torch rotation, so a checkpoint trained with it runs anywhere: on the H200 the layer's forward +
    backward takes 1.03x the plain layer's, the torch path 1.42x; BENCHMARKS.md). Same values up to
    rounding (the kernel rotates in fp32).

    Raises:
        ValueError: if ``head_dim`` is not divisible into even parts per axis; an unknown ``rotary_impl``.
    """

    arg_bounds = {"axes": ((">=", 1),), "base": ((">", 0),)}
    """Ranges of the numeric arguments, checked by the registry before the class is built."""

    def __init__(self, n_heads: int, head_dim: int, causal: bool = True, axes: int = 1, base: float = 10000.0,
                 rotary_impl: str = "auto") -> None:
        super().__init__(n_heads, head_dim, causal)
        if head_dim % (2 * axes):
            raise ValueError(f"RoPE needs head_dim divisible by 2*axes; got head_dim={head_dim}, axes={axes}")
        if rotary_impl not in ("torch", "triton", "auto"):
            raise ValueError("rope: position_args.rotary_impl must be 'torch', 'triton' or 'auto'; "
                             f"got {rotary_impl!r}")
        self.axes, self.base, self.rotary_impl = axes, base, rotary_impl
        self._inv_freq_key = ("rope_inv_freq", head_dim // axes, float(base))  # its name for G.on_device
        # float64, not a buffer: module.to(bfloat16) must not round it
        self._inv_freq = _rope_inv_freq(*self._inv_freq_key[1:], torch.device("cpu"))

    def angles(self, coords: Coords) -> Tensor:
        """``[B|1, T, head_dim/2]`` float64 rotation angles (per axis block)."""
        c = coords.with_axes(self.axes)
        pos = c.values(torch.float64) * c.full_mask().double()
        return (pos.unsqueeze(-1) * G.on_device(self._inv_freq_key, self._inv_freq_on, pos.device)).flatten(-2)

    def _inv_freq_on(self, device: torch.device) -> Tensor:
        """``[d_a / 2]`` float64 inverse frequencies: the host tensor on the CPU, else built on ``device``."""
        return self._inv_freq if device.type == "cpu" else _rope_inv_freq(*self._inv_freq_key[1:], device)

    def _cos_sin(self, coords: Coords, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        key, cache = _feature_cache(self, coords, dtype)
        if key is not None and key in cache:
            return cache[key]
        ang = self.angles(coords).unsqueeze(1)  # [B, 1, T, d/2]
        out = (torch.cos(ang).to(dtype), torch.sin(ang).to(dtype))
        if key is not None:
            if len(cache) >= 16:
                cache.pop(next(iter(cache)))
            cache[key] = out
        return out

    def rotate(self, x: Tensor, coords: Coords) -> Tensor:
        cos, sin = self._cos_sin(coords, x.dtype)
        return _rope_rotate(x, cos, sin, self.axes)

    def pack(self, qkv: Tensor, coords: Coords, batch: int) -> tuple[Tensor, Tensor, Tensor]:
        """See :meth:`PositionScheme.pack`; with the Triton path (``rotary_impl``) q and k are rotated in
        place in ``qkv`` and returned as views of it (:class:`~mixlab.ops.rope_triton.RopeQKV`)."""
        impl = self.rotary_impl
        if impl == "triton" and not qkv.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            # same values by torch ops: a model trained with the kernel still runs (and evaluates) on a CPU
            if not self.__dict__.get("_warned_cpu"):
                self.__dict__["_warned_cpu"] = True
                warnings.warn(f"rope: position_args.rotary_impl 'triton' needs CUDA tensors; got {qkv.device.type}, "
                              "so q and k are rotated by torch ops (the same values; 'auto' picks this silently)",
                              stacklevel=2)
            impl = "torch"
        fast = impl == "triton" or (impl == "auto" and qkv.is_cuda)
        if fast and qkv.dtype != torch.float64:
            cos, sin = self._cos_sin(coords, torch.float32)  # [B|1, 1, T, d/2]
            if cos.shape[0] in (1, batch):
                from mixlab.ops.rope_triton import pack_rope

                return pack_rope(qkv, cos.squeeze(1), sin.squeeze(1), batch, self.n_heads, self.head_dim, self.axes)
        return super().pack(qkv, coords, batch)

    def decode_tables(self, capacity: int, dtype: torch.dtype, device: torch.device) -> dict[str, Tensor]:
        cos, sin = self._cos_sin(Coords.seq(capacity, device=device), dtype)  # [1, 1, capacity, d/2]
        return {"cos": cos, "sin": sin}

    def pack_step(self, qkv: Tensor, tables: dict[str, Tensor], pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """See :meth:`PositionScheme.pack_step`: q and k rotated by the ``pos`` row of the tables (the
        eager rotation: graph-capturable, the same math as the CPU path of :meth:`pack`)."""
        q, k, v = super().pack_step(qkv, tables, pos)
        cos, sin = tables["cos"].index_select(2, pos), tables["sin"].index_select(2, pos)
        return _rope_rotate.eager(q, cos, sin, self.axes), _rope_rotate.eager(k, cos, sin, self.axes), v


@cuda_compiled
def _rope_rotate(x: Tensor, cos: Tensor, sin: Tensor, axes: int) -> Tensor:
    """Rotate ``x [B, H, T, d]``: in axis block ``a``, pair ``(x_i, x_{i + d_a/2})`` by ``cos/sin [B, 1, T, d/2]``."""
    d_a = x.shape[-1] // axes
    xs = x.unflatten(-1, (axes, 2, d_a // 2))  # [B, H, T, A, 2, d_a/2]
    cos = cos.unflatten(-1, (axes, 1, d_a // 2))
    sin = sin.unflatten(-1, (axes, 1, d_a // 2))
    x1, x2 = xs[..., 0:1, :], xs[..., 1:2, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-2).flatten(-3)
