"""AdamW parameter groups (decay by marker) and the warmup + cosine schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass

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
    """

    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    total_steps: int | None = None


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split trainable parameters into decay / no-decay groups.

    No decay for: parameters marked ``_no_weight_decay`` (priors, gates such as
    ``A_log``/``dt_bias``), every parameter with fewer than 2 dims (norm scales, biases),
    and embedding tables (``nn.Embedding`` weights). Everything else decays.
    """
    embed_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        ndim = getattr(p, "_mixlab_ndim", p.ndim)  # FSDP shards are 1-D (mixlab.distributed.FSDPStrategy)
        if getattr(p, "_no_weight_decay", False) or ndim < 2 or id(p) in embed_ids:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: ``(step+1)/warmup`` during warmup, then cosine from 1 to ``min_ratio``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: nn.Module, cfg: OptimConfig, total_steps: int) -> dict:
    """Lightning ``configure_optimizers`` dict: AdamW + per-step LambdaLR."""
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    total = cfg.total_steps or total_steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: warmup_cosine(s, cfg.warmup_steps, total, cfg.min_lr_ratio))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
