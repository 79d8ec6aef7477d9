"""AdamW parameter groups (decay by marker) and the warmup + cosine schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["OptimConfig", "param_groups", "build_optimizer", "warmup_cosine"]


@dataclass
class OptimConfig:
    """AdamW + linear warmup + cosine decay.

    Attributes:
        lr: peak learning rate.
        weight_decay: decoupled weight decay on matrices only (see :func:`param_groups`).
        betas: AdamW betas.
        eps: AdamW epsilon.
        warmup_steps: linear warmup length (optimizer steps).
        min_lr_ratio: final lr as a fraction of ``lr``.
        total_steps: cosine horizon; ``None`` uses the trainer's estimated total steps.
        lr_scales: learning-rate multipliers per parameter group name: parameters marked
            ``_lr_group = name`` (e.g. ``"position_prior"``: GOAT's flat prior, its learned
            frequencies) train at ``lr * lr_scales[name]`` under the same schedule. A bias term
            that must reach logits of order 10 (a previous-token head) moves only ~lr per Adam
            step, so at ``lr=5e-4`` it needs tens of thousands of steps; a multiplier lets the
            prior keep pace with the content weights, whose logits grow multiplicatively.
        fused: ``torch.optim.AdamW``'s ``fused``: true updates all parameters of a group in one fused kernel
            (less host work per step than the multi-tensor ``foreach`` path that torch picks on CUDA by default;
            the same update up to float rounding); null leaves torch's choice.

    Raises:
        ValueError: a value AdamW or the schedule cannot use, naming the field (``optim.lr`` ...): ``lr`` or
            ``eps`` <= 0, a beta outside [0, 1), ``weight_decay`` or ``warmup_steps`` < 0, ``min_lr_ratio``
            outside [0, 1], ``total_steps`` < 1, ``fused`` not true, false or null.
    """

    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    total_steps: int | None = None
    lr_scales: dict[str, float] = field(default_factory=dict)
    fused: bool | None = None

    def __post_init__(self) -> None:
        checks = [("lr", self.lr > 0, "> 0"), ("eps", self.eps > 0, "> 0"),
                  ("betas", len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "two values in [0, 1)"),
                  ("weight_decay", self.weight_decay >= 0, ">= 0"), ("warmup_steps", self.warmup_steps >= 0, ">= 0"),
                  ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "in [0, 1]"),
                  ("total_steps", self.total_steps is None or self.total_steps >= 1, ">= 1 (or null)"),
                  ("fused", self.fused is None or isinstance(self.fused, bool), "true, false or null")]
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"optim.{name} must be {want}; got {getattr(self, name)!r}")


def param_groups(model: nn.Module, weight_decay: float, lr: float | None = None,
                 lr_scales: dict[str, float] | None = None) -> list[dict]:
    """Split trainable parameters into decay / no-decay groups (and scaled-lr groups).

    No decay for: parameters marked ``_no_weight_decay`` (priors, gates such as
    ``A_log``/``dt_bias``), every parameter with fewer than 2 dims (norm scales, biases),
    and embedding tables (``nn.Embedding`` weights). Everything else decays. A parameter
    marked ``_lr_group = name`` with ``name`` in ``lr_scales`` goes into a group of its own
    with ``lr = lr * lr_scales[name]`` (same decay rule).

    Raises:
        ValueError: a non-positive multiplier, or ``lr_scales`` without ``lr``.
    """
    lr_scales = lr_scales or {}
    for name, scale in lr_scales.items():
        if not scale > 0:
            raise ValueError(f"optim.lr_scales[{name!r}] must be > 0; got {scale}")
    if lr_scales and lr is None:
        raise ValueError("param_groups: lr_scales needs the base lr")
    embed_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    groups: dict[tuple[bool, str | None], list] = {}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        ndim = getattr(p, "_mixlab_ndim", p.ndim)  # FSDP shards are 1-D (mixlab.distributed.FSDPStrategy)
        decays = not (getattr(p, "_no_weight_decay", False) or ndim < 2 or id(p) in embed_ids)
        name = getattr(p, "_lr_group", None)
        groups.setdefault((decays, name if name in lr_scales else None), []).append(p)
    out = [{"params": groups.pop((True, None), []), "weight_decay": weight_decay},
           {"params": groups.pop((False, None), []), "weight_decay": 0.0}]
    for (decays, name), params in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        out.append({"params": params, "weight_decay": weight_decay if decays else 0.0, "lr": lr * lr_scales[name]})
    return out


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: ``(step+1)/warmup`` during warmup, then cosine from 1 to ``min_ratio``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: nn.Module, cfg: OptimConfig, total_steps: int) -> dict:
    """Lightning ``configure_optimizers`` dict: AdamW + per-step LambdaLR."""
    groups = param_groups(model, cfg.weight_decay, cfg.lr, cfg.lr_scales)
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=cfg.fused)
    total = cfg.total_steps or total_steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: warmup_cosine(s, cfg.warmup_steps, total, cfg.min_lr_ratio))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
