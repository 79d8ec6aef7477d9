"""TensorBoard HParams for every run, so the HParams tab filters by mixer, position scheme, R and dataset.

:class:`HParams` (a default callback of the CLI) writes one HParams session per run at fit
start (and at test/validate start for runs that did not fit): flat, filterable keys

========================  ====================================================================
``mixer``                 the run name (mixer pattern, e.g. ``goat``, ``kdax3-mla``)
``task``                  the datamodule's ``task_name`` (``genome``, ``vqa_digits``, ...)
``dataset``               the datamodule class name
``position``              position schemes of the attention layers (``goat``, ``rope+goat``,
                          ``none`` without attention)
``n_modes``               GOAT ``R`` (0 without GOAT)
``n_params``              trainable parameters
``d_model``, ``n_layers``,  backbone width, depth, heads and the peak learning rate (when the
``n_heads``, ``lr``         head has ``backbone.cfg`` / ``optim_cfg``)
``model/...``,            every scalar hyperparameter of the model and the datamodule,
``data/...``              flattened with ``/`` (``model/backbone/d_model``, ``model/optim/lr``)
========================  ====================================================================

and declares the metrics the tab shows as columns (``val/loss``, ``test/loss``, the task's
:data:`mixlab.eval.metrics.TASK_METRICS` tags, ``perf/tokens_per_s``). Position schemes and
``n_modes`` come from each mixer's :meth:`~mixlab.mixers.base.Mixer.describe`. The summary is written
without logging metric values (the tab reads the run's own scalars of those tags), so no
fake point appears at step 0.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger

from mixlab.eval.metrics import task_metrics
from mixlab.mixers.base import Mixer

__all__ = ["HParams", "flatten_hparams", "run_hparams"]

_SCALAR = (int, float, str, bool)


def flatten_hparams(d: Any, prefix: str = "") -> dict[str, int | float | str | bool]:
    """Nested dicts/lists/dataclass-likes -> ``{"a/b/c": scalar}``; other values become ``str``;
    ``None`` -> ``"None"``."""
    out: dict[str, Any] = {}
    if hasattr(d, "__dataclass_fields__"):
        d = {k: getattr(d, k) for k in d.__dataclass_fields__}
    if isinstance(d, dict):
        for k, v in d.items():
            if str(k).startswith("_"):
                continue
            out.update(flatten_hparams(v, f"{prefix}{k}/"))
        return out
    key = prefix.rstrip("/")
    if isinstance(d, (list, tuple)):
        out[key] = ",".join(map(str, d)) if all(isinstance(v, _SCALAR) for v in d) else str(list(d))
    elif isinstance(d, _SCALAR):
        out[key] = d
    else:
        out[key] = str(d)
    return out


def run_hparams(pl_module: pl.LightningModule, datamodule: Any = None) -> dict[str, int | float | str | bool]:
    """The flat HParams of a run (see the module docstring for the keys)."""
    positions, n_modes = [], 0
    for m in pl_module.modules():
        if not isinstance(m, Mixer):
            continue
        info = m.describe()
        if "position" in info and info["position"] not in positions:
            positions.append(info["position"])
        n_modes = max(n_modes, int(info.get("n_modes", 0)))
    hp = {
        "mixer": str(getattr(pl_module, "run_name", type(pl_module).__name__.lower())),
        "task": str(getattr(datamodule, "task_name", "none")) if datamodule is not None else "none",
        "dataset": type(datamodule).__name__ if datamodule is not None else "none",
        "position": "+".join(positions) if positions else "none",
        "n_modes": n_modes,
        "n_params": int(sum(p.numel() for p in pl_module.parameters() if p.requires_grad)),
    }
    cfg = getattr(getattr(pl_module, "backbone", None), "cfg", None)
    for key in ("d_model", "n_layers", "n_heads"):
        if hasattr(cfg, key):
            hp[key] = int(getattr(cfg, key))
    lr = getattr(getattr(pl_module, "optim_cfg", None), "lr", None)
    if isinstance(lr, (int, float)):
        hp["lr"] = float(lr)
    hp.update(flatten_hparams(dict(getattr(pl_module, "hparams", {}) or {}), "model/"))
    if datamodule is not None:
        hp.update(flatten_hparams(dict(getattr(datamodule, "hparams", {}) or {}), "data/"))
    return hp


def _metric_tags(task: str) -> list[str]:
    tags = ["val/loss", "test/loss"]
    tags += [m.tag for m in task_metrics(task) if not m.by_step and "*" not in m.tag]
    tags += ["perf/tokens_per_s", "perf/peak_mem_gb"]
    return list(dict.fromkeys(tags))


class HParams(pl.Callback):
    """Write the run's HParams session summary to every :class:`TensorBoardLogger` (once per log dir).

    Other loggers are ignored. See the module docstring for the keys and metrics.
    """

    def __init__(self) -> None:
        self._done: set[str] = set()
        self.logged: dict[str, Any] = {}

    def _write(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank != 0:
            return
        from torch.utils.tensorboard.summary import hparams

        for logger in trainer.loggers:
            if not isinstance(logger, TensorBoardLogger) or logger.log_dir in self._done:
                continue
            self._done.add(logger.log_dir)
            hp = run_hparams(pl_module, trainer.datamodule)
            metrics = {t: float("nan") for t in _metric_tags(str(hp["task"]))}
            exp, ssi, sei = hparams(hp, metrics)
            writer = logger.experiment._get_file_writer()
            for s in (exp, ssi, sei):
                writer.add_summary(s)
            writer.flush()
            self.logged = hp

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write(trainer, pl_module)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write(trainer, pl_module)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "validate":
            self._write(trainer, pl_module)
