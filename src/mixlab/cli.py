"""``python -m mixlab fit|validate|test|predict --config configs/...yaml`` (LightningCLI).

Extra subcommands (``python -m mixlab <name> --help``) are registered in :data:`COMMANDS`
and dispatched before LightningCLI parses the arguments.

Defaults added to every run:

* a TensorBoard logger at ``<run_root>/<task>/<run_name>/version_N`` (``task`` from the
  datamodule's ``task_name``, ``run_name`` from the model's mixer pattern), unless the
  config sets ``trainer.logger``;
* checkpoints: ``last.ckpt`` with the newest state (:class:`~mixlab.callbacks.LastCheckpoint`:
  every validation and the end of training) and the best on ``val/loss``; LearningRateMonitor,
  :class:`~mixlab.callbacks.ThroughputMemory`, the progress bar;
* ``precision: bf16-mixed`` when CUDA is available, else ``32-true``;
* ``--ckpt_path last`` means the newest ``last.ckpt`` of this task and run name, and a
  run resumed, validated or tested from its own checkpoint logs into the same
  TensorBoard run directory;
* the sources of options combine as :mod:`mixlab.overrides` says: the last value given wins,
  nested mixer options (``mixer_args``) deep-merge, ``limit_*_batches: 1`` is one batch; a
  checkpoint file's hyperparameters replace the config's model options, named in one warning line.

Bad input found by mixlab's own code (a ``ValueError`` or ``OSError`` such as
FileNotFoundError raised in mixlab's source, at construction or in ``setup``) ends the run
with one line ``error: <field>: <message>`` on stderr and exit status 2, like
jsonargparse's own errors, instead of a traceback wrapped in jsonargparse's Union dump
(``<field>`` is ``model``, ``data`` or ``trainer.callbacks``). Set ``MIXLAB_TRACEBACK=1``
to get the full traceback instead.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from mixlab import overrides
from mixlab.callbacks import LastCheckpoint, MixerMetrics, ThroughputMemory
from mixlab.tb import HParams

__all__ = ["MixlabCLI", "main", "COMMANDS"]

COMMANDS: dict[str, str] = {}
"""Extra subcommand name -> ``"module:function"`` taking ``argv: list[str]``."""


def register_command(name: str, target: str) -> None:
    """Register ``python -m mixlab <name>`` to call ``target`` (``"pkg.module:func"``) with argv."""
    COMMANDS[name] = target


class MixlabCLI(LightningCLI):
    """LightningCLI with mixlab's defaults (logger layout, callbacks, precision)."""

    def __init__(self, args: list[str] | None = None, **kwargs: Any) -> None:
        overrides.install()  # nested mixer options deep-merge across sources (mixlab.overrides)
        defaults = {
            "precision": "bf16-mixed" if torch.cuda.is_available() else "32-true",
            "log_every_n_steps": 10,
            "callbacks": [
                # best on val/loss; last.ckpt = newest state (Lightning 2.6's save_last follows the best only)
                ModelCheckpoint(filename="{epoch}-{step}", monitor="val/loss", mode="min", save_top_k=1),
                LastCheckpoint(),
                LearningRateMonitor(logging_interval="step"),
                ThroughputMemory(),
                MixerMetrics(),
                HParams(),
            ],
        }
        kwargs.setdefault("trainer_defaults", defaults)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        # no argparse prefix matching: "--trainer.max_step 5" is an error, not max_steps
        kwargs.setdefault("parser_kwargs", {"allow_abbrev": False})
        super().__init__(
            pl.LightningModule,
            pl.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=args,
            **kwargs,
        )

    def setup_parser(self, *args: Any, **kwargs: Any) -> None:
        super().setup_parser(*args, **kwargs)
        for parser in [self.parser, *getattr(self, "_subcommand_parsers", {}).values()]:
            overrides.int_before_float(parser)  # limit_val_batches: 1 is one batch, 1.0 all (any source)

    def _parse_ckpt_path(self) -> None:
        """LightningCLI's: a checkpoint file's hyperparameters replace the config's model options (its
        ``mixer_args`` as a whole, not merged); each option this changes is named in one warning line."""
        sub = self.config.get("subcommand")
        before = self.config[sub].get("model") if sub else None
        with overrides.replacing_dicts():
            super()._parse_ckpt_path()
        changed = overrides.changed_leaves(before, self.config[sub].get("model") if sub else None)
        if changed:
            logging.getLogger("mixlab.cli").warning(
                "--ckpt_path %s: the model is built from the checkpoint's hyperparameters, which differ from "
                "the config: %s", self.config[sub].get("ckpt_path"), "; ".join(changed))

    def before_fit(self) -> None:
        """Silence two Lightning warnings that are wrong for mixlab's own classes: "dataloader
        is not resumable" (it checks the DataLoader object, while mixlab datamodules restore the
        train position from the checkpoint, :class:`mixlab.distributed.ResumableDataModule`) and
        "use sync_dist=True" for epoch-level eval metrics (the heads log exact sums that
        torchmetrics already reduced over all ranks)."""
        from mixlab.distributed import ResumableDataModule
        from mixlab.heads.common import Head

        if isinstance(self.datamodule, ResumableDataModule):
            warnings.filterwarnings("ignore", message=r".*your dataloader is not resumable.*")
        if isinstance(self.model, Head):
            # eval metrics are exact sums reduced across ranks by torchmetrics, identical on every rank
            warnings.filterwarnings("ignore", message=r".*sync_dist=True.*when logging on epoch level.*")

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--run_root", type=str, default="runs",
                            help="Root directory of TensorBoard runs: <run_root>/<task>/<run_name>/version_N")
        parser.add_argument("--run_name", type=str | None, default=None,
                            help="Override the run name (default: the model's mixer pattern)")

    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        cfg = self.config_init[self.subcommand] if self.subcommand else self.config_init
        if self.subcommand and self.subcommand != "fit":  # keep the training run's config.yaml
            self.save_config_kwargs["config_filename"] = f"config_{self.subcommand}.yaml"
        logger = cfg["trainer"].get("logger")
        task = getattr(self.datamodule, "task_name", type(self.datamodule).__name__.lower())
        run = cfg.get("run_name") or getattr(self.model, "run_name", type(self.model).__name__.lower())
        root, name = Path(cfg.get("run_root", "runs")), f"{task}/{run}"
        if cfg.get("ckpt_path") == "last":
            cfg["ckpt_path"] = _latest_checkpoint(root / name)
        if logger is None or logger is True:
            kwargs["logger"] = TensorBoardLogger(str(root), name=name, default_hp_metric=False,
                                                 version=_run_version(cfg.get("ckpt_path"), root / name))
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except (ValueError, MisconfigurationException) as err:  # e.g. a strategy or accelerator typo
            raise ValueError(f"trainer: {err}") from err
        from mixlab.distributed import FSDPStrategy

        if isinstance(trainer.strategy, FSDPStrategy) and trainer.accelerator.__class__.__name__ == "CPUAccelerator":
            raise ValueError("trainer: configs/trainer/fsdp.yaml (FSDP) needs CUDA GPUs; on CPU use "
                             "configs/trainer/ddp.yaml (gloo)")
        return trainer


def _latest_checkpoint(run_dir: Path) -> str:
    """``<run_dir>/version_N/checkpoints/last.ckpt`` of the highest N (``--ckpt_path last``).

    Raises:
        FileNotFoundError: no run of this task and mixer has a ``last.ckpt`` yet.
    """
    found = sorted(run_dir.glob("version_*/checkpoints/last.ckpt"),
                   key=lambda p: int(p.parent.parent.name.split("_")[-1])
                   if p.parent.parent.name.split("_")[-1].isdigit() else -1)
    if not found:
        raise FileNotFoundError(f"--ckpt_path last: no {run_dir}/version_*/checkpoints/last.ckpt; train first "
                                f"(fit) or pass the checkpoint file")
    return str(found[-1])


def _run_version(ckpt_path: str | None, run_dir: Path) -> str | None:
    """``version_N`` of ``run_dir`` holding ``ckpt_path`` (``.../version_N/checkpoints/x.ckpt``), else None.

    Resuming, validating or testing from a run's own checkpoint then logs into that same
    TensorBoard run instead of a new version.
    """
    if not ckpt_path or ckpt_path in ("last", "best", "hpc", "registry"):
        return None
    version_dir = Path(ckpt_path).resolve().parent.parent
    if Path(ckpt_path).resolve().parent.name == "checkpoints" and version_dir.parent == run_dir.resolve():
        return version_dir.name
    return None


def _our_roots() -> tuple[str, ...]:
    """Source folders of mixlab and mixlab.datamodules (each ending in a path separator)."""
    import mixlab
    import mixlab.datamodules
    return tuple(os.path.join(os.path.realpath(p), "") for p in
                 [*mixlab.__path__, *mixlab.datamodules.__path__])


def bad_input_error(exc: BaseException) -> tuple[str | None, BaseException] | None:
    """``(config field or None, error)`` when ``exc`` is, or was raised from, bad input found by mixlab.

    Walks the exception chain (``__cause__``, else ``__context__``), as jsonargparse wraps a
    constructor's error in its Union error ``from`` the original, and returns the first
    ``ValueError`` / ``OSError`` whose ``raise`` statement is in mixlab's source. The field is
    ``model``, ``data`` or ``trainer.callbacks`` from the innermost LightningModule,
    LightningDataModule or Callback method on its traceback. None for anything else (bugs,
    errors of other libraries): those keep their traceback.
    """
    roots, seen = _our_roots(), set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
        if (isinstance(exc, (ValueError, OSError)) and frames
                and os.path.realpath(frames[-1].f_code.co_filename).startswith(roots)):
            for frame in reversed(frames):
                owner = frame.f_locals.get("self")
                for cls, field in ((pl.LightningModule, "model"), (pl.LightningDataModule, "data"),
                                   (pl.Callback, "trainer.callbacks")):
                    if isinstance(owner, cls):
                        return field, exc
            return None, exc
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return None


def _resolve(target: str) -> Callable[[list[str]], Any]:
    module, _, fn = target.partition(":")
    return getattr(importlib.import_module(module), fn)


def main(argv: list[str] | None = None) -> None:
    """Entry point: an extra subcommand from :data:`COMMANDS`, else LightningCLI."""
    words = list(sys.argv[1:] if argv is None else argv)
    log = logging.getLogger("mixlab")  # data summaries (records read, regions dropped) at INFO
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    if words[:1] in (["-h"], ["--help"]) or not words:
        print("mixlab: python -m mixlab {fit,validate,test,predict} --config configs/<task>/<name>.yaml [...]\n"
              f"extra commands: {', '.join(sorted(COMMANDS))} (python -m mixlab <command> --help)\n"
              "model options: python -m mixlab fit --model.help mixlab.heads.CausalLM\n")
    try:
        if words and words[0] in COMMANDS:
            _resolve(COMMANDS[words[0]])(words[1:])
            return
        MixlabCLI(args=argv)  # None: LightningCLI reads sys.argv itself
    except Exception as err:
        found = None if os.environ.get("MIXLAB_TRACEBACK") else bad_input_error(err)
        if found is None:
            raise
        field, cause = found
        print(f"error: {field + ': ' if field else ''}{cause}\n(MIXLAB_TRACEBACK=1 shows the full traceback)",
              file=sys.stderr)
        raise SystemExit(2) from None


register_command("length-extrapolation", "mixlab.eval.length:main")
register_command("passkey", "mixlab.eval.retrieval:passkey_main")
register_command("niah", "mixlab.eval.retrieval:niah_main")
register_command("resolution", "mixlab.eval.resolution:main")
register_command("compare", "mixlab.eval.compare:main")
register_command("figure", "mixlab.eval.figures:main")
register_command("copy-prior", "mixlab.eval.figures:copy_prior")  # alias of "figure goat-prior"
register_command("reproduce", "mixlab.eval.reproduce:main")
