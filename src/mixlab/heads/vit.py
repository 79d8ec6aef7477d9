"""Vision Transformer head: patch embedding + bidirectional :class:`~mixlab.backbone.Backbone` + classifier.

Two layers:

* :class:`MixViT` - a plain ``nn.Module`` (``images [B, C, H, W] -> logits [B, num_classes]``),
  registered with timm as ``vit_small_patch16_goat`` (and ``_ape``/``_rope2d``/``_nope``), so
  ``import mixlab.heads.vit; timm.create_model("vit_small_patch16_goat")`` works.
* :class:`ImageClassifier` - the LightningModule (losses, Mixup/CutMix, top-1/top-5, optimiser).

The position scheme is stated once, by the backbone's mixer (as for every head), plus the
head's own embedding-side option ``ape`` (as the LM's ``abs_pos_len``). All are
resolution-agnostic (any image whose sides are multiples of the patch size runs with the same
parameters); the four presets (:data:`PRESETS`, the run names and timm entrypoints) are:

* ``goat2d`` (``mixer: goat``): the GOAT log-prior (Litman & Guo, Sec. 4; 2D form of Eq. 12/20:
  the relative term is the SUM of a y-part and an x-part) on integer patch coordinates
  ``(y, x)``. Modes are split evenly over the axes and each axis gets the same geometric
  frequency grid (isotropic; the reference code gives x only the lowest frequencies).
  ``[CLS]`` has no coordinates: its key gets a learned per-head default bias
  (``default_bias``) and no relative term.
* ``ape`` (``mixer: nope``, ``ape: true``): learned absolute embeddings (timm layout,
  ``[1, 1 + gh*gw, D]`` with a ``[CLS]`` slot) resampled bicubically to other grids with
  :func:`timm.layers.resample_abs_pos_embed` (identical to timm's
  ``VisionTransformer(dynamic_img_size=True)``).
* ``rope2d`` (``mixer: rope``): 2D axial RoPE (half the head dim rotates with y, half with x;
  ``[CLS]`` unrotated).
* ``nope`` (``mixer: nope``): no positional information.

Patch coordinates at other resolutions (``patch_coords``, GOAT and RoPE; APE resamples instead):

* ``scaled`` (default): coordinates are measured in units of the TRAINING grid. On a
  ``gh x gw`` grid, patch ``(y, x)`` sits at ``(y * g0h / gh, x * g0w / gw)`` where ``g0`` is
  the grid of ``img_size``: the image always spans the extent the prior was trained on, and a
  2x larger image has patches half a unit apart (implemented as ``Coords.scale``, i.e. every
  Fourier and key-feature frequency of an axis times ``g0 / g``; no fractional integers). This is
  what APE's bicubic resampling does to APE. At the training grid it is the same as ``index``.
* ``index``: coordinates are the integer patch indices ``0 .. g-1`` at every resolution: a
  larger image has more patches one unit apart, so the prior meets relative distances and
  absolute positions it never saw in training (the convention before the option existed).

See docs/vit_resolution.md for the measurement behind the default.

The mixer pattern can name any registered mixer; position schemes that read coordinates get
``axes: 2`` (and GOAT ``default_bias: true`` with a ``[CLS]`` token) unless set
(:meth:`~mixlab.backbone.BackboneConfig.with_position_axes`). The former head option
``position: goat2d|ape|rope2d|nope`` (configs and checkpoints written before ``ape``) is still
accepted and mapped once to ``ape`` and a check of the mixer (:func:`legacy_position`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from timm.layers import PatchEmbed, resample_abs_pos_embed, trunc_normal_
from torch import Tensor, nn
from torchmetrics import SumMetric

from mixlab.backbone import Backbone, BackboneConfig, mixer_names, pattern_name
from mixlab.coords import Coords
from mixlab.heads.common import Head, as_config, float_logits, plain_hparams
from mixlab.optim import OptimConfig

__all__ = ["MixViT", "ImageClassifier", "MixupConfig", "vit_backbone", "PRESETS", "POSITIONS", "PATCH_COORDS",
           "check_patch_coords", "legacy_position", "position_label", "to_hw"]

PRESETS = {"goat2d": ("goat", False), "ape": ("nope", True), "rope2d": ("rope", False), "nope": ("nope", False)}
"""Preset name -> (attention mixer, ``ape``): run names, :func:`vit_backbone` and the timm entrypoints."""

POSITIONS = tuple(PRESETS)
"""The preset names (the former ``position`` option's values)."""

PATCH_COORDS = ("scaled", "index")
"""Values of the ``patch_coords`` option (module docstring); the first is the default."""


def check_patch_coords(value: str) -> str:
    """``value`` if it is one of :data:`PATCH_COORDS`; else ValueError naming them."""
    if value not in PATCH_COORDS:
        raise ValueError(f"patch_coords must be one of {PATCH_COORDS}; got {value!r}")
    return value


def to_hw(size: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    """``224 -> (224, 224)``; ``[192, 256] -> (192, 256)``. Raises ValueError otherwise."""
    if isinstance(size, int):
        return size, size
    size = tuple(int(s) for s in size)
    if len(size) != 2:
        raise ValueError(f"image size must be an int or [height, width]; got {size}")
    return size  # type: ignore[return-value]


def vit_backbone(position: str = "goat2d", d_model: int = 384, n_layers: int = 12, n_heads: int = 6,
                 n_modes: int = 16, drop_path: float = 0.1, **kw: Any) -> BackboneConfig:
    """ViT-S/16 defaults as timm's ``vit_small_patch16_224`` (dim 384, depth 12, 6 heads, LayerNorm
    eps 1e-6, MLP ratio 4 GELU, biases in qkv/proj/MLP, drop-path 0.1, bidirectional) with the
    attention mixer of preset ``position`` (:data:`PRESETS`; GOAT: ``n_modes`` Fourier modes over
    2 axes). The ``ape`` preset's learned embeddings are the head's (``MixViT(ape=True)``).

    Raises:
        ValueError: unknown preset.
    """
    mixer = _preset(position)[0]
    args: dict[str, dict] = {mixer: {"bias": True}}
    if mixer == "goat":
        args[mixer]["position_args"] = {"n_modes": n_modes}
    kw.setdefault("norm", "layernorm")
    return BackboneConfig(d_model=d_model, n_layers=n_layers, n_heads=n_heads, mixer=mixer, mixer_args=args,
                          causal=False, mlp="gelu", mlp_ratio=4.0, drop_path=drop_path, bias=True, **kw)


def _preset(position: str) -> tuple[str, bool]:
    if position not in PRESETS:
        raise ValueError(f"position must be one of {POSITIONS}; got {position!r}")
    return PRESETS[position]


def legacy_position(position: str | None, ape: bool, backbone: BackboneConfig | None) -> tuple[bool, BackboneConfig]:
    """Map the former ``position`` option once: ``(ape, backbone config)``.

    ``position=None`` (current configs): ``ape`` as given, default backbone the ``goat2d`` preset
    (``ape`` preset with ``ape=True``). A preset name sets ``ape`` for ``"ape"``, gives the
    preset's backbone when none is given, and checks that the given pattern has the preset's
    attention mixer (``goat2d`` needs ``goat``, ``rope2d`` needs ``rope``).

    Raises:
        ValueError: unknown preset; a pattern without the preset's mixer.
    """
    if position is None:
        return ape, backbone or vit_backbone("ape" if ape else "goat2d")
    mixer, preset_ape = _preset(position)
    if backbone is None:
        return ape or preset_ape, vit_backbone(position)
    if mixer != "nope" and mixer not in mixer_names(backbone.mixer):
        raise ValueError(f"position={position!r} needs a {mixer!r} mixer in backbone.mixer; got {backbone.mixer!r}")
    return ape or preset_ape, backbone


def position_label(mixer: str | list[str], ape: bool) -> str:
    """The preset name that describes a ViT (``ape``; else ``goat2d`` / ``rope2d`` when the pattern
    has that mixer; else ``nope``): the ``position`` column of resolution tables."""
    names = set(mixer_names(mixer))
    return "ape" if ape else "goat2d" if "goat" in names else "rope2d" if "rope" in names else "nope"


def run_name(mixer: str | list[str], ape: bool) -> str:
    """Run directory name: the preset name when the pattern is the preset's own mixer (``goat2d``,
    ``ape``, ``rope2d``, ``nope``), else ``<pattern>-<preset>`` (``goat-nope-goat2d``)."""
    label, base = position_label(mixer, ape), pattern_name(mixer)
    return label if base == PRESETS[label][0] else f"{base}-{label}"


class MixViT(nn.Module):
    """ViT with a mixlab backbone: ``images [B, C, H, W] float -> logits [B, num_classes] float32``
    (float64 for a float64 model).

    Args:
        num_classes: classifier outputs (0 = return pooled features ``[B, D]``).
        img_size: training resolution ``S`` or ``(H, W)``; sets the APE grid. Other
            resolutions run unchanged (GOAT/RoPE/NoPE need nothing; APE is resampled).
        patch_size: ``P``; image sides must be multiples of ``P`` (else ValueError: no silent crop
            - the datamodules' center crop produces valid sizes).
        in_chans: image channels.
        position: former option, a preset name or None (see :func:`legacy_position`).
        pool: ``cls`` (the ``[CLS]`` token) or ``avg`` (global average over patch tokens; no
            ``[CLS]`` token is added).
        backbone: :class:`BackboneConfig` (its mixer is the position scheme); default ViT-S/16
            with GOAT (:func:`vit_backbone`). Made bidirectional, with 2-axis position schemes.
        ape: learned absolute position embeddings added to the tokens.
        patch_coords: ``scaled`` (patch coordinates in training-grid units at every resolution) or
            ``index`` (integer patch indices); see the module docstring. An attribute: the
            resolution evaluation may switch it on a trained model.
        **_: ignored keywords timm passes to model constructors (``pretrained_cfg`` ...).

    Shapes: ``T = n_prefix + (H/P)(W/P)`` tokens with ``n_prefix = 1`` for ``cls`` pooling.

    Raises:
        ValueError: bad ``pool`` or ``patch_coords``; a bad legacy ``position`` (:func:`legacy_position`).
    """

    def __init__(self, num_classes: int = 1000, img_size: int | tuple[int, int] = 224, patch_size: int = 16,
                 in_chans: int = 3, position: str | None = None, pool: Literal["cls", "avg"] = "cls",
                 backbone: BackboneConfig | None = None, ape: bool = False,
                 patch_coords: Literal["scaled", "index"] = "scaled", **_: Any) -> None:
        super().__init__()
        if pool not in ("cls", "avg"):
            raise ValueError(f"pool must be 'cls' or 'avg'; got {pool!r}")
        self.patch_coords = check_patch_coords(patch_coords)
        ape, cfg = legacy_position(position, ape, backbone)
        # GOAT's default_bias (the [CLS] key's default) exists only with a [CLS] token, so no
        # parameter goes unused under DDP with global average pooling
        has_cls = pool == "cls"
        cfg = cfg.with_position_axes(2, defaults={"default_bias": True} if has_cls else None,
                                     force=None if has_cls else {"default_bias": False})
        cfg.causal = False
        d = cfg.d_model
        self.num_classes, self.pool, self.ape = num_classes, pool, ape
        self.position = position_label(cfg.mixer, ape)
        self.img_size, self.patch_size = to_hw(img_size), int(patch_size)
        self.num_prefix_tokens = 1 if pool == "cls" else 0
        self.embed_dim = self.num_features = d
        self.patch_embed = PatchEmbed(self.img_size, patch_size, in_chans, d, output_fmt="NHWC", strict_img_size=False)
        self.grid_size = self.patch_embed.grid_size
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d)) if pool == "cls" else None
        self.pos_embed = None
        if ape:
            n = self.num_prefix_tokens + self.grid_size[0] * self.grid_size[1]
            self.pos_embed = nn.Parameter(torch.zeros(1, n, d))
            trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        self.backbone = Backbone(cfg)
        self.head = nn.Linear(d, num_classes) if num_classes > 0 else nn.Identity()
        if num_classes > 0:
            trunc_normal_(self.head.weight, std=0.02)
            nn.init.zeros_(self.head.bias)
        self.backbone_cfg = cfg
        self._coords_cache: dict[tuple, Coords] = {}

    # ------------------------------------------------------------------ pieces
    def grid(self, height: int, width: int) -> tuple[int, int]:
        """Patch grid ``(gh, gw)`` of an image; ValueError if a side is not a multiple of P."""
        p = self.patch_size
        if height < p or width < p:
            raise ValueError(f"image size {height}x{width} is smaller than one patch (patch_size={p}): give a "
                             f"patch_size <= {min(height, width)} or larger images")
        if height % p or width % p:
            raise ValueError(f"image size {height}x{width} is not divisible by patch_size={p}; "
                             f"resize/crop to multiples of {p} (e.g. {height // p * p}x{width // p * p})")
        return height // p, width // p

    def coord_scale(self, gh: int, gw: int) -> tuple[float, float] | None:
        """``Coords.scale`` of a ``gh x gw`` grid: ``(g0h / gh, g0w / gw)`` (training grid ``g0``) with
        ``patch_coords="scaled"``; None (integer patch indices) with ``"index"`` or at the training grid."""
        g0h, g0w = self.grid_size
        if self.patch_coords == "index" or (gh, gw) == (g0h, g0w):
            return None
        return g0h / gh, g0w / gw

    def coords(self, gh: int, gw: int, device: torch.device) -> Coords:
        """``[1, T, 2]`` coordinates: ``[CLS]`` without axes (when pooling by CLS), then row-major ``(y, x)``,
        with :meth:`coord_scale` (``patch_coords``)."""
        key = (gh, gw, str(device), self.patch_coords)
        if key not in self._coords_cache:
            parts = [Coords.grid(gh, gw, device=device)]
            if self.num_prefix_tokens:
                parts.insert(0, Coords.empty(self.num_prefix_tokens, 2, device=device))
            c = Coords.cat(parts) if len(parts) > 1 else parts[0]
            self._coords_cache[key] = c.with_scale(self.coord_scale(gh, gw))
        return self._coords_cache[key]

    def resampled_pos_embed(self, gh: int, gw: int) -> Tensor:
        """APE for a ``gh x gw`` grid, ``[1, n_prefix + gh*gw, D]`` (timm's bicubic resampling)."""
        return resample_abs_pos_embed(self.pos_embed, new_size=(gh, gw), old_size=self.grid_size,
                                      num_prefix_tokens=self.num_prefix_tokens)

    def tokens(self, images: Tensor) -> tuple[Tensor, Coords]:
        """Embedded tokens ``[B, T, D]`` (CLS first, APE added) and their coordinates."""
        if images.dim() != 4:
            raise ValueError(f"MixViT expects images [B, C, H, W]; got shape {tuple(images.shape)}")
        gh, gw = self.grid(images.shape[-2], images.shape[-1])
        x = self.patch_embed(images).flatten(1, 2)  # [B, gh*gw, D]
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)
        if self.pos_embed is not None:
            x = x + self.resampled_pos_embed(gh, gw).to(x.dtype)
        return x, self.coords(gh, gw, images.device)

    def forward_features(self, images: Tensor) -> Tensor:
        """``[B, D]`` pooled features (after the backbone's final norm)."""
        x, coords = self.tokens(images)
        x = self.backbone(x, coords)
        return x[:, 0] if self.pool == "cls" else x[:, self.num_prefix_tokens:].mean(1)

    def forward(self, images: Tensor) -> Tensor:
        return float_logits(self.head(self.forward_features(images)))

    def attention_layers(self) -> list[nn.Module]:
        return [blk.mixer for blk in self.backbone.blocks]

    @property
    def reads_patch_coords(self) -> bool:
        """Whether any layer's position scheme reads the patch coordinates (GOAT, RoPE): only then
        does ``patch_coords`` change the model's output."""
        return any(getattr(getattr(m, "pos", None), "axes", None) for m in self.attention_layers())

    def log_prior_image(self, layer: int = 0, grid: tuple[int, int] | None = None,
                        query: tuple[int, int] | None = None) -> Tensor:
        """A GOAT layer's learned 2D log-prior as images ``[H, gh, gw]`` float64.

        Entry ``[h, y, x]`` is the prior logit (relative + key-only terms) that head ``h`` adds when
        the patch at ``query`` (default: the grid centre) attends to the patch at ``(y, x)``; a
        ``grid`` other than the training grid is read with ``patch_coords``.

        Raises:
            ValueError: the layer's mixer has no GOAT prior.
        """
        mixer = self.attention_layers()[layer]
        pos = getattr(mixer, "pos", None)
        if pos is None or not hasattr(pos, "prior_terms"):
            raise ValueError(f"layer {layer} ({type(mixer).__name__}) has no GOAT log-prior to render")
        gh, gw = grid or self.grid_size
        qy, qx = query or (gh // 2, gw // 2)
        scale = self.coord_scale(gh, gw)
        g = Coords.grid(gh, gw, device=pos.alpha.device).with_scale(scale)
        q = Coords(torch.tensor([[[qy, qx]]], device=g.pos.device), scale=scale)
        with torch.no_grad():
            total = pos.prior_terms(q, g, torch.float64)["total"]  # [1, H, 1, gh*gw]
        return total[0, :, 0].reshape(-1, gh, gw).cpu()


@dataclass
class MixupConfig:
    """timm Mixup/CutMix (DeiT recipe: mixup 0.8, cutmix 1.0, switch 0.5, label smoothing 0.1).

    Attributes:
        mixup_alpha / cutmix_alpha: Beta parameters (0 disables each; both 0 disables Mixup).
        prob: probability of mixing a batch; switch_prob: CutMix instead of Mixup.
        mode: ``batch`` | ``pair`` | ``elem`` (timm).
    """

    mixup_alpha: float = 0.8
    cutmix_alpha: float = 1.0
    prob: float = 1.0
    switch_prob: float = 0.5
    mode: str = "batch"


class ImageClassifier(Head):
    """Image classification with :class:`MixViT` (batches ``(images [B, C, H, W] float, labels [B] int64)``).

    Loss: cross-entropy with ``label_smoothing``; with ``mixup`` set, timm ``Mixup`` (which folds
    in the label smoothing) + ``SoftTargetCrossEntropy`` on training batches. timm asserts an even
    batch: an odd training batch drops its last sample.

    Logged: ``train/loss``, ``train/top1`` (against the unmixed label), ``val/loss``, ``val/top1``,
    ``val/top5`` (and ``test/...``) - exact sums over all samples (SumMetric), in percent.

    Args:
        num_classes: classes (checked against the datamodule's ``num_classes``).
        img_size, patch_size, in_chans, pool, backbone, ape, patch_coords: see :class:`MixViT` (the
            backbone's mixer is the position scheme; ``causal`` is forced False). ``patch_coords`` is
            saved with the hyperparameters, so an evaluation from the checkpoint reads patches the
            same way; checkpoints written before the option existed load as ``index``, their
            convention then.
        position: former option (``goat2d``, ``ape``, ``rope2d``, ``nope``), kept for configs and
            checkpoints written before ``ape``; mapped once by :func:`legacy_position`.
        optim: :class:`OptimConfig` (AdamW, no decay on 1-D and prior parameters).
        label_smoothing: label smoothing (DeiT: 0.1).
        mixup: :class:`MixupConfig` or None.

    Raises:
        ValueError: see :class:`MixViT`; in ``setup``, a datamodule whose ``num_classes`` differs or
            whose ``image_size`` / ``eval_size`` is not a multiple of the patch size.
    """

    def __init__(
        self,
        num_classes: int = 1000,
        img_size: int | list[int] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        position: str | None = None,
        pool: Literal["cls", "avg"] = "cls",
        backbone: BackboneConfig | None = None,
        optim: OptimConfig | None = None,
        label_smoothing: float = 0.1,
        mixup: MixupConfig | None = None,
        ape: bool = False,
        patch_coords: Literal["scaled", "index"] = "scaled",
    ) -> None:
        super().__init__()
        if not 0 <= label_smoothing < 1:
            raise ValueError(f"model.init_args.label_smoothing must be in [0, 1); got {label_smoothing}")
        self.save_hyperparameters()
        plain_hparams(self)  # checkpoints reload with weights_only=True
        backbone = None if backbone is None else as_config(BackboneConfig, backbone)
        optim = None if optim is None else as_config(OptimConfig, optim)
        mixup = None if mixup is None else as_config(MixupConfig, mixup)
        self.model = MixViT(num_classes, to_hw(img_size), patch_size, in_chans, position, pool, backbone, ape,
                            patch_coords)
        self.num_classes, self.position = num_classes, self.model.position
        self.optim_cfg = optim or OptimConfig(lr=5e-4, weight_decay=0.05, betas=(0.9, 0.999), warmup_steps=100)
        self.label_smoothing = label_smoothing
        self._labels_checked = False  # an accelerator batch's labels were read once (_check_labels)
        self.mixup_fn = None
        if mixup is not None and (mixup.mixup_alpha > 0 or mixup.cutmix_alpha > 0):
            from timm.data import Mixup

            self.mixup_fn = Mixup(mixup_alpha=mixup.mixup_alpha, cutmix_alpha=mixup.cutmix_alpha, prob=mixup.prob,
                                  switch_prob=mixup.switch_prob, mode=mixup.mode, label_smoothing=label_smoothing,
                                  num_classes=num_classes)
        self.run_name = run_name(self.model.backbone_cfg.mixer, self.model.ape)
        self.top_k = min(5, num_classes)
        self.metric_sums = nn.ModuleDict(
            {f"{s}_{k}": SumMetric() for s in ("val", "test") for k in ("nll", "count", "top1", "top5")})

    def forward(self, images: Tensor) -> Tensor:
        """``images [B, C, H, W]`` -> logits ``[B, num_classes]`` float32."""
        return self.model(images)

    throughput_unit = "images"  # the throughput callback logs perf/images_per_s

    @staticmethod
    def batch_tokens(batch) -> int:
        """Images in a batch (the throughput callback's unit for this head: ``throughput_unit``)."""
        return int(batch[0].shape[0])

    def _check_labels(self, y: Tensor) -> None:
        """Raises ValueError for a label outside ``[0, num_classes)``. Host tensors are checked every batch; on an
        accelerator only the first batch of the process is (reading a device tensor makes the host wait for the
        device, which on every step would stall the step pipeline): the datamodules check each label on the host
        (``ImageNetDataModule`` names the shard and key), and ``setup`` matches ``num_classes`` to theirs."""
        if not y.numel() or (y.device.type != "cpu" and self._labels_checked):
            return
        self._labels_checked = True
        lo, hi = int(y.min()), int(y.max())
        if lo < 0 or hi >= self.num_classes:
            raise ValueError(f"label out of range [0, {self.num_classes}): got [{lo}, {hi}]; "
                             "check model.init_args.num_classes against the dataset")

    # ------------------------------------------------------------------ Lightning hooks
    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """A checkpoint written before ``patch_coords`` existed was evaluated with integer patch indices:
        keep ``index`` for it (a checkpoint that records the option is built with its value)."""
        super().on_load_checkpoint(checkpoint)
        if "patch_coords" not in (checkpoint.get("hyper_parameters") or {}):
            self.model.patch_coords = "index"

    def setup(self, stage: str) -> None:
        bs = self.data_attr("batch_size")
        if stage == "fit" and self.mixup_fn is not None and isinstance(bs, int) and bs < 2:
            raise ValueError(f"data.init_args.batch_size={bs}: Mixup/CutMix mixes the images of a batch in pairs, so "
                             "training needs batches of at least 2; raise it or set model.init_args.mixup: null")
        n = self.data_attr("num_classes")
        if n is not None and n != self.num_classes:
            raise ValueError(f"model.init_args.num_classes={self.num_classes} but the datamodule "
                             f"{type(self.data).__name__} has num_classes={n}; set model.init_args.num_classes: {n}")
        for name in ("image_size", "eval_size"):  # before the model summary and the first batch
            size = self.data_attr(name)
            if size is not None:
                try:
                    self.model.grid(*((size, size) if isinstance(size, int) else size))
                except ValueError as err:
                    raise ValueError(f"data.init_args.{name}={size}: {err}") from None
        size = self.data_attr("image_size")
        if stage == "fit" and size is not None and to_hw(size) != self.model.img_size:
            rank_zero_warn(f"data.init_args.image_size={size} trains at another resolution than "
                           f"model.init_args.img_size={list(self.model.img_size)} (the APE grid and the patch "
                           f"coordinates' unit); set model.init_args.img_size: {size} unless this is a fine-tune "
                           "at a new resolution")

    def training_step(self, batch, batch_idx: int) -> Tensor:
        x, y = batch
        self._check_labels(y)
        if self.mixup_fn is not None:
            if x.shape[0] % 2:
                x, y = x[:-1], y[:-1]
            xm, ym = self.mixup_fn(x, y)
            logits = self(xm)
            loss = torch.sum(-ym * F.log_softmax(logits, dim=-1), dim=-1).mean()  # SoftTargetCrossEntropy
        else:
            logits = self(x)
            loss = F.cross_entropy(logits, y, label_smoothing=self.label_smoothing)
        self.log_train_loss(loss)
        self.log("train/top1", (logits.argmax(-1) == y).float().mean() * 100)
        return loss

    def _eval_step(self, batch, stage: str) -> None:
        x, y = batch
        self._check_labels(y)
        logits = self(x)
        nll = F.cross_entropy(logits, y, reduction="sum")
        topk = logits.topk(self.top_k, dim=-1).indices
        hit = topk == y[:, None]
        s = self.metric_sums
        s[f"{stage}_nll"].update(nll.double())
        s[f"{stage}_count"].update(torch.tensor(float(y.numel()), dtype=torch.float64, device=y.device))
        s[f"{stage}_top1"].update(hit[:, 0].sum().double())
        s[f"{stage}_top5"].update(hit.any(-1).sum().double())

    def _eval_epoch_end(self, stage: str) -> None:
        s = {k: self.metric_sums[f"{stage}_{k}"] for k in ("nll", "count", "top1", "top5")}
        n = s["count"].compute().clamp_min(1)
        metrics = {f"{stage}/loss": s["nll"].compute() / n, f"{stage}/top1": 100 * s["top1"].compute() / n,
                   f"{stage}/top5": 100 * s["top5"].compute() / n}
        self.log_dict({k: v.float() for k, v in metrics.items()}, prog_bar=stage == "val")
        for m in s.values():
            m.reset()


# ---------------------------------------------------------------------- timm registration
def _register_timm() -> None:
    from timm.models import register_model

    def make(position: str, doc: str):
        def fn(pretrained: bool = False, **kwargs: Any) -> MixViT:
            if pretrained:
                raise ValueError("no pretrained weights exist for mixlab ViTs (offline project); use pretrained=False")
            n_modes = kwargs.pop("n_modes", 16)
            drop_path = kwargs.pop("drop_path_rate", 0.1)
            for k in ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir"):
                kwargs.pop(k, None)
            kwargs.setdefault("backbone", vit_backbone(position, n_modes=n_modes, drop_path=drop_path))
            kwargs.setdefault("ape", PRESETS[position][1])
            return MixViT(patch_size=16, **kwargs)

        fn.__name__ = f"vit_small_patch16_{'goat' if position == 'goat2d' else position}"
        fn.__qualname__ = fn.__name__
        fn.__doc__ = doc
        fn.__module__ = __name__
        return fn

    from timm.models import is_model

    for position in POSITIONS:
        f = make(position, f"ViT-S/16 (384, 12 layers, 6 heads) with mixlab {position} positions.")
        if not is_model(f.__name__):
            register_model(f)


_register_timm()
