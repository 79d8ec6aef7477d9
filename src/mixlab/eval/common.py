"""Shared helpers of the evaluation commands: checkpoint loading and chunked forward."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

__all__ = ["load_model", "load_datamodule_hparams", "chunked_logits", "import_class"]


def import_class(path: str) -> type:
    """``"pkg.module.Class"`` -> the class."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def load_model(ckpt: str | Path, device: str | torch.device = "cpu") -> pl.LightningModule:
    """Load a mixlab head from a Lightning checkpoint (CLI or plain ``Trainer`` runs), in eval mode.

    Raises:
        FileNotFoundError: no such checkpoint (names the path given to ``--ckpt``).
    """
    if not Path(ckpt).is_file():
        raise FileNotFoundError(f"checkpoint not found: {ckpt} (--ckpt)")
    raw = torch.load(ckpt, map_location="cpu", weights_only=False)
    hp = raw.get("hyper_parameters", {})
    path = raw.get("mixlab_class_path") or hp.get("_class_path")
    if path:
        cls = import_class(path)
    else:
        from mixlab.heads.lm import CausalLM

        cls = CausalLM
    model = cls.load_from_checkpoint(ckpt, map_location=device, weights_only=False)
    return model.eval().to(device)


def load_datamodule_hparams(ckpt: str | Path) -> tuple[str | None, dict[str, Any]]:
    """``(class_path or None, init kwargs)`` of the datamodule saved in a checkpoint."""
    raw = torch.load(ckpt, map_location="cpu", weights_only=False)
    hp = dict(raw.get("datamodule_hyper_parameters", {}) or {})
    cls = hp.pop("_class_path", None)
    hp = {k: v for k, v in hp.items() if not k.startswith("_")}
    return cls, hp


@torch.no_grad()
def chunked_logits(model, tokens: Tensor, chunk: int | None = None):
    """Yield ``(start, logits [B, c, V])`` for ``tokens [B, T]``, ``c <= chunk`` tokens at a time.

    With ``chunk`` (and ``chunk < T``) the sequence is fed chunk by chunk through the
    per-layer caches (``caches=[{} for each layer]``), which for attention is exact and
    keeps the logits memory at ``B * chunk * V``; otherwise one plain forward.
    """
    t = tokens.shape[1]
    if not chunk or chunk >= t:
        yield 0, model(tokens)
        return
    caches = [{} for _ in model.backbone.blocks]
    for s in range(0, t, chunk):
        yield s, model(tokens[:, s:s + chunk], None, caches)
