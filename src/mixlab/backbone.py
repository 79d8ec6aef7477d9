"""Pre-norm residual backbone: ``x + mixer(norm(x))``, ``x + mlp(norm(x))``, per-layer mixer pattern.

Heads own their input embedding (tokens, patches, text + patches) and output layer; the
backbone maps ``[B, T, D]`` and :class:`~mixlab.coords.Coords` to ``[B, T, D]``. It owns the
mixer-pattern grammar (:func:`mixer_names`, :func:`parse_pattern`, :func:`pattern_name`) and
answers what heads need to know about its layers (:meth:`Backbone.position_axes`,
:meth:`BackboneConfig.with_position_axes`), so heads never import mixer internals.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from timm.layers import Mlp, SwiGLUPacked
from torch import Tensor, nn

from mixlab.coords import Coords
from mixlab.mixers import Mixer, SubLayer, build_mixer, get_mixer_cls, list_mixers
from mixlab.mixers.layers import RMSNorm
from mixlab.registry import MIXERS, POSITIONS, did_you_mean

log = logging.getLogger("mixlab.backbone")
_NOTED: set[str] = set()  # notes logged once per process

__all__ = ["BackboneConfig", "Backbone", "Block", "parse_pattern", "mixer_names", "pattern_name"]


def _items(pattern: str | list[str]) -> list[str]:
    """The stripped, non-empty comma items of a pattern (``"kda*3, mla"`` -> ``["kda*3", "mla"]``)."""
    items = pattern.split(",") if isinstance(pattern, str) else list(pattern)
    return [item.strip() for item in items if item.strip()]


def mixer_names(pattern: str | list[str]) -> list[str]:
    """The mixer pattern grammar: one name per entry, repeats expanded, before tiling.

    ``pattern`` is a name (``"goat"``), a comma list (``"kda,kda,kda,mla"``), with optional
    repeats (``"kda*3,mla"`` -> ``["kda", "kda", "kda", "mla"]``), or a list of names. Names are
    not checked against the registry here.

    Raises:
        ValueError: an item ``name*count`` whose count is not an integer; a pattern naming no mixer.
    """
    names: list[str] = []
    for item in _items(pattern):
        if "*" in item:
            name, _, rep = item.partition("*")
            if not rep.strip().isdigit():
                raise ValueError(f"mixer pattern item {item!r}: expected 'name*count'")
            names += [name.strip()] * int(rep)
        else:
            names.append(item)
    if not names:
        raise ValueError(f"mixer pattern {pattern!r} names no mixer")
    return names


def parse_pattern(pattern: str | list[str], n_layers: int) -> list[str]:
    """Expand a mixer pattern (see :func:`mixer_names`) to one name per layer; a pattern shorter
    than ``n_layers`` is tiled (``"kda*3,mla"`` over 12 layers is the 3:1 hybrid).

    Raises:
        ValueError: bad pattern (:func:`mixer_names`), ``n_layers`` not a multiple of the
            pattern length, or an unknown mixer name (the message lists the registered ones).
    """
    names = mixer_names(pattern)
    for name in dict.fromkeys(names):  # a misspelt name first: it may be why the count is off
        get_mixer_cls(name)
    if n_layers % len(names):
        raise ValueError(f"mixer pattern {pattern!r} has {len(names)} entries; n_layers={n_layers} is not a multiple")
    return names * (n_layers // len(names))


def pattern_name(pattern: str | list[str]) -> str:
    """Short run name (a directory name safe in a shell) for a mixer pattern: ``"goat"``,
    ``"kda*3,mla"`` -> ``"kdax3-mla"``."""
    return "-".join(item.replace("*", "x") for item in _items(pattern))


@dataclass
class BackboneConfig:
    """Architecture of the shared backbone (serialisable; used in YAML configs).

    Attributes:
        d_model: width D.
        n_layers: number of blocks.
        n_heads: heads per mixer.
        mixer: per-layer pattern (see :func:`parse_pattern`).
        mixer_args: keyword arguments per mixer name, e.g.
            ``{"goat": {"position_args": {"n_modes": 2}}}``.
        causal: causal (LMs) or bidirectional (ViT, VQA).
        mlp: ``"swiglu"`` (timm ``SwiGLUPacked``: the gate and value projections as one ``fc1`` of
            ``2 x`` the branch width, one matmul) or ``"gelu"`` (timm Mlp), hidden ``mlp_ratio * D``
            (SwiGLU uses ``2/3`` of it per branch to match parameters).
        mlp_ratio: MLP expansion.
        norm: ``"rmsnorm"`` (default, LM practice) or ``"layernorm"`` (ViT/DeiT practice, as
            timm's ViT), used for both pre-norms and the final norm.
        norm_eps: norm epsilon.
        drop_path: stochastic depth, linearly increasing to this value.
        bias: biases in MLP linears.
        init_std: std of the N(0, std) GPT-style init; residual output projections use
            ``std / sqrt(2 n_layers)``.
        compile: run each block through ``torch.compile`` in parallel forwards on CUDA (training,
            validation, prefill), for mixers marked ``compile_safe`` (the attention mixers: GOAT's
            lane kernels stay on their Triton path inside the graph, the kernel ops
            ``mixlab::goat_lanes_into`` / ``mixlab::goat_lanes_backward``); other blocks, CPU forwards and
            cached decoding stay eager. The parameters and checkpoint keys are unchanged.
    """

    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    mixer: str | list[str] = "goat"
    mixer_args: dict[str, Any] = field(default_factory=dict)
    causal: bool = True
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    mlp_ratio: float = 4.0
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_eps: float = 1e-6
    drop_path: float = 0.0
    bias: bool = False
    init_std: float = 0.02
    compile: bool = False

    def __post_init__(self) -> None:
        """Raises ValueError for sizes < 1, a non-positive ``mlp_ratio``, ``drop_path``
        outside [0, 1), ``mixer_args`` keyed by a name that is not a registered mixer (a
        typo there would otherwise be ignored silently), or a key that mixer (or its position
        scheme) does not take, also for a mixer the pattern does not use (its values are not
        checked; one INFO line says the entry is unused)."""
        for name in ("d_model", "n_layers", "n_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"backbone: {name} must be an integer >= 1; got {value!r}")
        if not self.mlp_ratio > 0:
            raise ValueError(f"backbone: mlp_ratio must be > 0; got {self.mlp_ratio}")
        if not 0 <= self.drop_path < 1:
            raise ValueError(f"backbone: drop_path must be in [0, 1); got {self.drop_path}")
        if not isinstance(self.mixer_args or {}, dict):
            raise ValueError(f"backbone: mixer_args must map mixer names to their options; got {self.mixer_args!r}")
        self.mixer_args = {k: {} if v is None else v for k, v in (self.mixer_args or {}).items()}  # null: defaults
        for name, given in self.mixer_args.items():
            if not isinstance(given, dict):
                raise ValueError(f"backbone: mixer_args.{name} must be a mapping of {name}'s options (e.g. "
                                 f"{{impl: reference}}); got {given!r}")
            if given.get("position_args") is not None and not isinstance(given["position_args"], dict):
                raise ValueError(f"backbone: mixer_args.{name}.position_args must be a mapping of the position "
                                 f"scheme's options (e.g. {{n_modes: 4}}); got {given['position_args']!r}")
        unknown = sorted(set(self.mixer_args) - set(list_mixers()))
        if unknown:
            raise ValueError(f"backbone: mixer_args has entries for unknown mixer(s) {', '.join(map(repr, unknown))}; "
                             f"registered mixers: {', '.join(list_mixers())}{did_you_mean(unknown, list_mixers())}")
        unused = sorted(set(self.mixer_args) - set(mixer_names(self.mixer)))
        for name in self.mixer_args:  # keys and plain value types, used or not (a typo in a shared block is an error)
            try:
                MIXERS.check_keys(name, self.mixer_args[name], deep=True)
            except ValueError as err:
                raise ValueError(f"backbone: mixer_args.{name}: {err}") from None
        if unused and set(mixer_names(self.mixer)) <= set(list_mixers()):  # (a misspelt mixer: its own error)
            note = (f"backbone: mixer_args for {', '.join(map(repr, unused))} unused: the mixer pattern "
                    f"{self.mixer!r} has no such layer")
            if note not in _NOTED:  # once per process; info: a block shared by runs of several mixers is normal
                _NOTED.add(note)
                log.info(note)

    def with_position_axes(self, axes: int, defaults: dict[str, Any] | None = None,
                           force: dict[str, Any] | None = None) -> BackboneConfig:
        """Copy whose position schemes read ``axes`` coordinate axes (ViT: 2, mixed text + patches: 3).

        Applies to every mixer of the pattern that takes a position scheme (constructor arguments
        ``position`` and ``position_args``) whose scheme reads coordinates (has an ``axes``
        option): ``axes`` and ``defaults`` fill its ``position_args`` where unset, ``force``
        overrides them; keys a scheme does not accept are skipped (e.g. GOAT's ``default_bias``
        for RoPE). MLA's ``rope_axes`` is set to ``axes`` where unset. Mixers without a position
        scheme are left as they are.

        Raises:
            ValueError: an unknown mixer or position scheme name.
        """
        cfg = copy.deepcopy(self)
        args = {k: dict(v) for k, v in (cfg.mixer_args or {}).items()}
        for name in dict.fromkeys(mixer_names(cfg.mixer)):
            params = inspect.signature(get_mixer_cls(name).__init__).parameters
            given = args.get(name, {})
            if "rope_axes" in params:  # MLA: its decoupled RoPE part reads the coordinates
                args[name] = {**given, "rope_axes": given.get("rope_axes", axes)}
                continue
            if "position" not in params or "position_args" not in params:
                continue
            scheme = {**MIXERS.defaults(name), **given}.get("position", params["position"].default)
            accepted = POSITIONS.options(scheme) or []
            if "axes" not in accepted:
                continue
            pargs = dict(given.get("position_args") or {})
            for key, value in {"axes": axes, **(defaults or {})}.items():
                if key in accepted:
                    pargs.setdefault(key, value)
            pargs.update({k: v for k, v in (force or {}).items() if k in accepted})
            args[name] = {**given, "position_args": pargs}
        cfg.mixer_args = args
        return cfg


def make_norm(cfg: BackboneConfig) -> nn.Module:
    """:class:`~mixlab.mixers.layers.RMSNorm` or ``nn.LayerNorm`` over ``d_model`` as ``cfg.norm`` says.

    Raises:
        ValueError: unknown ``cfg.norm``.
    """
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    if cfg.norm == "layernorm":
        return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
    raise ValueError(f"BackboneConfig.norm must be 'rmsnorm' or 'layernorm'; got {cfg.norm!r}")


class DropPath(nn.Module):
    """Stochastic depth (Huang et al., 2016, "Deep Networks with Stochastic Depth"; timm's ``DropPath``): in
    training, each sample's residual branch ``x [B, ...]`` (any dtype) is zeroed with probability ``drop_prob``
    and the kept ones are scaled by ``1 / (1 - drop_prob)``; in evaluation ``x`` is returned as it is.

    As timm's, except that ``1 - drop_prob`` lives in a 0-dim float32 buffer (not saved in checkpoints) instead of a
    Python float: ``torch.compile`` then does not guard on the rate, so blocks that differ only in their rate share
    one graph. With a float, each block of a linearly increasing schedule needed a graph of its own, and Dynamo's
    recompile limit (8 graphs per code object) left blocks 9-12 of ViT-S eager (BENCHMARKS.md, thirty-fifth
    session). The mask is drawn in float32 (``bernoulli_`` with the buffer as probability) and cast to ``x``'s dtype
    after the scaling.

    Raises:
        ValueError: ``drop_prob`` outside ``[0, 1)``.
    """

    def __init__(self, drop_prob: float) -> None:
        super().__init__()
        if not 0 <= drop_prob < 1:
            raise ValueError(f"DropPath: drop_prob must be in [0, 1); got {drop_prob}")
        self.drop_prob = drop_prob
        self.register_buffer("keep", torch.tensor(1.0 - drop_prob), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            return x
        mask = torch.empty((x.shape[0],) + (1,) * (x.dim() - 1), device=x.device).bernoulli_(self.keep)
        return x * (mask / self.keep).to(x.dtype)

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob:g}"


class Block(nn.Module):
    """``x = x + drop_path(mixer(norm1(x)))``; ``x = x + drop_path(mlp(norm2(x)))``."""

    def __init__(self, cfg: BackboneConfig, mixer_name: str, layer_idx: int, drop_path: float) -> None:
        super().__init__()
        d = cfg.d_model
        self.mixer_name = mixer_name
        self.norm1 = make_norm(cfg)
        self.mixer = build_mixer(mixer_name, d_model=d, n_heads=cfg.n_heads, causal=cfg.causal,
                                 layer_idx=layer_idx, n_layers=cfg.n_layers, **cfg.mixer_args.get(mixer_name, {}))
        self.norm2 = make_norm(cfg)
        hidden = int(cfg.mlp_ratio * d)
        if cfg.mlp == "swiglu":
            hidden = 8 * math.ceil(2 * hidden / 3 / 8)
            self.mlp = SwiGLUPacked(d, 2 * hidden, bias=cfg.bias)  # silu(fc1[:h]) * fc1[h:] -> fc2
        elif cfg.mlp == "gelu":
            self.mlp = Mlp(d, hidden, bias=cfg.bias)
        else:
            raise ValueError(f"BackboneConfig.mlp must be 'swiglu' or 'gelu'; got {cfg.mlp!r}")
        self.mlp.fc2._is_residual = True  # type: ignore[attr-defined]
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # noqa: ANN001
        """Also load checkpoints written before the SwiGLU was packed (timm ``SwiGLU``: separate
        ``mlp.fc1_g`` and ``mlp.fc1_x``, now the two halves of ``mlp.fc1``; the same function)."""
        for kind in ("weight", "bias"):
            gate, value = f"{prefix}mlp.fc1_g.{kind}", f"{prefix}mlp.fc1_x.{kind}"
            if gate in state_dict and value in state_dict:
                state_dict[f"{prefix}mlp.fc1.{kind}"] = torch.cat([state_dict.pop(gate), state_dict.pop(value)])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: Tensor, coords: Coords | None, cache: dict | None = None) -> Tensor:
        x = x + self.drop_path(self.mixer(self.norm1(x), coords, cache))
        return x + self.drop_path(self.mlp(self.norm2(x)))

    def step(self, x: Tensor, state: dict[str, Tensor], pos: Tensor) -> Tensor:
        """One decoding token ``x [B, D]`` through the mixer's static step
        (:meth:`~mixlab.mixers.base.Mixer.static_step`, ``state`` updated in place) -> ``[B, D]``."""
        x = x + self.mixer.static_step(self.norm1(x), state, pos)
        return x + self.mlp(self.norm2(x))


class Backbone(nn.Module):
    """Stack of :class:`Block` with a final norm.

    Forward: ``x [B, T, D]``, ``coords`` (default 1D positions), optional ``caches``
    (a list with one dict per layer, filled in place for decoding) -> ``[B, T, D]``.
    """

    def __init__(self, cfg: BackboneConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.pattern = parse_pattern(cfg.mixer, cfg.n_layers)
        dpr = [cfg.drop_path * i / max(cfg.n_layers - 1, 1) for i in range(cfg.n_layers)]
        self.blocks = nn.ModuleList(Block(cfg, name, i, dpr[i]) for i, name in enumerate(self.pattern))
        self.norm = make_norm(cfg)
        self.apply(self._init_linear)
        for m in self.modules():  # mixer-specific init (gates, priors, convolutions) after the generic one
            if isinstance(m, (Mixer, SubLayer)):
                m.reset_parameters()

    def _init_linear(self, m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            std = self.cfg.init_std
            if getattr(m, "_is_residual", False):
                std = std / math.sqrt(2 * self.cfg.n_layers)
            nn.init.normal_(m.weight, 0.0, std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def position_axes(self) -> set[int]:
        """Coordinate axes read by the layers that have a position scheme (``{1}`` for a GOAT
        LM, ``{2}`` for a ViT, ``{3}`` for mixed VQA); empty when no layer reads coordinates."""
        return {blk.mixer.position_axes for blk in self.blocks} - {None}

    def compile_notice(self, device: torch.device) -> None:
        """Say once (INFO) that ``compile: true`` has no effect on ``device`` when it is not CUDA. Called by the
        first forward, and by :meth:`mixlab.heads.common.Head.on_fit_start` so that the line comes before the
        progress bars."""
        if self.cfg.compile and device.type != "cuda" and not self.__dict__.get("_said_eager"):
            self.__dict__["_said_eager"] = True
            log.info("backbone.compile: true has no effect on %s: the blocks run eagerly (compiled on CUDA only)",
                     device)

    def forward(self, x: Tensor, coords: Coords | None = None, caches: list[dict] | None = None) -> Tensor:
        if self.cfg.compile and not x.is_cuda:
            self.compile_notice(x.device)
        blocks = self._compiled_blocks() if self.cfg.compile and x.is_cuda and caches is None else self.blocks
        for i, blk in enumerate(blocks):
            x = blk(x, coords, None if caches is None else caches[i])
        return self.norm(x)

    def _compiled_blocks(self) -> list:
        """``torch.compile`` of each block whose mixer is ``compile_safe`` (the others as they are), built
        once and kept out of the module tree (no new state keys)."""
        compiled = self.__dict__.get("_compiled")
        if compiled is None:
            compiled = self.__dict__["_compiled"] = [torch.compile(blk, dynamic=False) if blk.mixer.compile_safe
                                                     else blk for blk in self.blocks]
            eager = [i for i, blk in enumerate(self.blocks) if not blk.mixer.compile_safe]
            if eager:
                log.info("backbone.compile: blocks %s stay eager (mixers that are not compile_safe: %s)", eager,
                         sorted({self.pattern[i] for i in eager}))
        return compiled

    def step(self, x: Tensor, states: list[dict[str, Tensor]], pos: Tensor) -> Tensor:
        """One decoding token ``x [B, D]`` at position ``pos`` (``[1]`` int64 device tensor) through every
        block's static step (``states``: one :meth:`~mixlab.mixers.base.Mixer.static_cache` per layer,
        updated in place) and the final norm -> ``[B, D]``; equals :meth:`forward` of the token with dict
        caches."""
        for blk, state in zip(self.blocks, states):
            x = blk.step(x, state, pos)
        return self.norm(x)
