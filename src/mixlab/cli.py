"""``python -m mixlab fit|validate|test --config configs/...yaml`` (LightningCLI).

Extra subcommands (``python -m mixlab <name> --help``) are registered in :data:`COMMANDS`
and dispatched before LightningCLI parses the arguments.

Defaults added to every run:

* a TensorBoard logger at ``<run_root>/<task>/<run_name>/version_N`` (``task`` from the
  datamodule's ``task_name``, ``run_name`` from the model's mixer pattern), unless the
  config sets ``trainer.logger``; ``trainer.logger: false`` logs no metrics (and drops the
  LearningRateMonitor, which needs a logger) but keeps the checkpoints and ``config.yaml`` in that
  same run folder (``--ckpt_path last`` finds them; Lightning alone would write them into the
  working directory);
* checkpoints: ``last.ckpt`` with the newest state (:class:`~mixlab.callbacks.LastCheckpoint`:
  every validation, the end of training and Ctrl-C) and the best one, kept by the ``checkpoint``
  group (Lightning's ``ModelCheckpoint``; default lowest ``val/loss``, ``checkpoint.monitor`` and
  ``checkpoint.mode`` change it, e.g. ``val/acc`` / ``max``); LearningRateMonitor,
  :class:`~mixlab.callbacks.ThroughputMemory`, the progress bar;
* ``precision: bf16-mixed`` when CUDA is available, else ``32-true``;
* ``CUDA_DEVICE_MAX_CONNECTIONS=32`` (:data:`CUDA_QUEUES`) unless the environment sets it: 32 hardware work queues per
  GPU instead of CUDA's 8, so that streams do not share a queue (work in one queue runs in launch order). The
  ImageNet GPU stage runs on more than 8 streams (nvJPEG's 14 for torchvision's decode, the stage's, the training
  step's); with 8 queues an image's decode could wait behind the training step's queued kernels;
* ``--ckpt_path last`` means the newest ``last.ckpt`` of this task and run name (``best``: the
  checkpoint the ``checkpoint`` group kept in that run), and a
  run resumed, validated or tested from its own checkpoint logs into the same
  TensorBoard run directory;
* the sources of options combine as :mod:`mixlab.overrides` says: the last value given wins,
  nested mixer options (``mixer_args``) deep-merge, ``limit_*_batches: 1`` is one batch; a
  checkpoint file's hyperparameters replace the config's model options, named in one warning line
  (runtime options, the kernels, ``loss_chunk_tokens`` and ``loss_kernel``, keep the config's:
  ``overrides.keep_runtime_options``).
* a resumed ``fit`` keeps the run's ``config.yaml`` and writes ``config_resume_<k>.yaml``; a
  command that fails before its new run folder holds anything (no checkpoint, no training step)
  removes that folder again. A ``fit --ckpt_path`` with nothing left to train (the checkpoint's
  step already reaches ``trainer.max_steps``, or its finished epochs ``trainer.max_epochs``:
  :func:`nothing_to_train`) writes nothing (no ``config_resume_<k>.yaml``, no event file, no
  checkpoint): it prints one line naming the limit and the checkpoint's step, e.g. ``fit: nothing
  to train: the checkpoint runs/.../last.ckpt is at step 400 and trainer.max_steps is 400; raise
  trainer.max_steps to train on (nothing written)``, and ends with exit status 0.

Bad input ends the run with one line on stderr and exit status 2 instead of a usage dump or
a traceback:

* a parse error (a misspelt key in a config file or on the command line, a value of the
  wrong type, a class path that does not import, a YAML syntax error): ``error: <file>:
  unknown key <key>; did you mean <closest key>?`` (:func:`parse_error_line`);
* a ``--ckpt_path`` that is missing, not a checkpoint, or of another head, task or
  vocabulary than the config (:func:`read_checkpoint`, :func:`check_checkpoint_config`,
  :func:`check_state_dict`), checked before anything is written;
* trainer values that parse but cannot run as asked, checked before anything is written
  (:meth:`MixlabCLI._check_trainer_values`, e.g. ``--trainer.precision: 16-mixed (float16 mixed precision) needs
  CUDA; ...`` on the CPU, a float ``val_check_interval`` above 1, ``validate`` on a datamodule without a val split),
  or once the data is read (:func:`late_value_error`: ``val_check_interval`` above an epoch's batches), each naming
  the file and key or the option that set the value (:func:`set_at`);
* an empty split: ``validate`` / ``test`` on no batch (:func:`no_batches`), and ``fit`` on an empty validation
  split unless ``trainer.limit_val_batches`` is 0 (:class:`ValSplitCheck`), naming the datamodule arguments that
  size it (``--data.init_args.val_fraction: the val split is empty (val_fraction=0.0): ...``);
* a ``validate`` / ``test`` of a checkpoint on a split other than its run's (another data seed or split
  fraction: :func:`check_checkpoint_split`);
* bad input found by mixlab's own code (a ``ValueError`` or ``OSError`` such as
  FileNotFoundError raised in mixlab's source, at construction or in ``setup``):
  ``error: <file>: <key>: <message>`` naming the config file (or ``--<key>`` on the command
  line) that set the refused value, found from the message (:func:`place_value_error`), else
  ``error: <field>: <message>`` (``<field>`` is ``model``, ``data`` or
  ``trainer.callbacks``), instead of a traceback wrapped in jsonargparse's Union dump.

Set ``MIXLAB_TRACEBACK=1`` to get jsonargparse's message or the full traceback instead.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import difflib
import importlib
import logging
import os
import re
import secrets
import shutil
import signal
import sys
import threading
import traceback
import typing
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

from mixlab import overrides
from mixlab.callbacks import (
    BestCheckpoint,
    LastCheckpoint,
    LossProgressBar,
    MixerMetrics,
    ThroughputMemory,
    final_validation,
)
from mixlab.eval.common import output_problem
from mixlab.registry import closest, load_plugins
from mixlab.tb import HParams

__all__ = ["MixlabCLI", "main", "COMMANDS"]

SEED_RANGE = f"a seed in [0, {2**32 - 1}] (true: a random one, false: no seeding)"
"""What ``seed_everything`` takes (numpy's seed range), in the one-line errors about it."""

COMMANDS: dict[str, str] = {}
"""Extra subcommand name -> ``"module:function"`` taking ``argv: list[str]``."""


def register_command(name: str, target: str) -> None:
    """Register ``python -m mixlab <name>`` to call ``target`` (``"pkg.module:func"``) with argv."""
    COMMANDS[name] = target


class MixlabCLI(LightningCLI):
    """LightningCLI with mixlab's defaults (logger layout, callbacks, precision)."""

    def __init__(self, args: list[str] | None = None, **kwargs: Any) -> None:
        overrides.install()  # nested mixer options deep-merge across sources (mixlab.overrides)
        self._words = list(sys.argv[1:] if args is None else args)
        quiet_library_notices()
        # an empty split is mixlab's one-line error (no_batches, ValSplitCheck), not Lightning's warning before it
        warnings.filterwarnings("ignore", message=r"Total length of `\w+` across ranks is zero")
        defaults = {
            "precision": "bf16-mixed" if torch.cuda.is_available() else "32-true",
            "log_every_n_steps": 10,
            "callbacks": [
                # the best checkpoint is the `checkpoint` group's (add_arguments_to_parser); last.ckpt = the
                # newest state (Lightning 2.6's save_last follows the best only)
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
        kwargs.setdefault("parser_kwargs", {"allow_abbrev": False, "prog": "python -m mixlab"})
        super().__init__(
            pl.LightningModule,
            pl.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=args,
            **kwargs,
        )

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """Lightning's ``fit``, ``validate`` and ``test``; not ``predict``: no mixlab head or datamodule has a
        predict step (``generate`` samples from a language model, ``test`` reports metrics)."""
        return {k: v for k, v in LightningCLI.subcommands().items() if k != "predict"}

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[pl.Callback]) -> pl.Trainer:
        """LightningCLI's, without the default callbacks that a trainer setting turns off: mixlab's checkpoint
        callbacks (``last.ckpt`` and the ``checkpoint`` group's best one) under ``enable_checkpointing: false``
        (Lightning refused it, naming a ModelCheckpoint the user never added), the LearningRateMonitor under
        ``logger: false`` (it needs a logger: Lightning's traceback at the first step)."""
        off = tuple(kind for kind, key in ((ModelCheckpoint, "enable_checkpointing"), (LearningRateMonitor, "logger"))
                    if config.get(key) is False)
        if off:
            callbacks = [c for c in callbacks if not isinstance(c, off)]
            self.trainer_defaults = {**self.trainer_defaults, "callbacks": [
                c for c in self.trainer_defaults.get("callbacks", []) if not isinstance(c, off)]}
        return super()._instantiate_trainer(config, callbacks)

    def _set_seed(self) -> None:
        """LightningCLI's seeding, after a one-line check of the range numpy takes (``-1`` and ``10**20`` were
        Lightning's traceback).

        Raises:
            ValueError: a seed outside ``[0, 2**32 - 1]``: ``<place> <seed>: a seed in [0, 4294967295] (true: a
                random one, false: no seeding)``, the place being ``--seed_everything`` or ``<file>:
                seed_everything`` where the value was set (:func:`set_at`).

        ``true`` draws a random seed (``secrets``; the run's ``config.yaml`` records it): Lightning 2.6 seeded 0
        for ``true`` although its CLI says "choose randomly". DDP ranks take rank 0's (``PL_GLOBAL_SEED``).
        """
        seed = self._get(self.config, "seed_everything")
        if not isinstance(seed, bool) and isinstance(seed, int) and not 0 <= seed < 2**32:
            raise ValueError(f"{set_at('seed_everything', self._words) or '--seed_everything'} {seed}: "
                             f"{SEED_RANGE}")
        if seed is True:  # Lightning 2.6 seeds 0 here ("No seed found, seed set to 0"), not a random seed
            env = os.environ.get("PL_GLOBAL_SEED")  # the seed rank 0 drew (DDP ranks rerun this command)
            seed = int(env) if env is not None and env.isdigit() else secrets.randbelow(2**32)
            (self.config[self.subcommand] if self.subcommand else self.config)["seed_everything"] = seed
        super()._set_seed()

    def setup_parser(self, *args: Any, **kwargs: Any) -> None:
        super().setup_parser(*args, **kwargs)
        for parser in [self.parser, *getattr(self, "_subcommand_parsers", {}).values()]:
            overrides.int_before_float(parser)  # limit_val_batches: 1 is one batch, 1.0 all (any source)

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

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """jsonargparse's parsing; a parse error (an unknown or misspelt key in a config file or on the
        command line, a value of the wrong type) ends the run with ONE line naming the file and key
        and the closest valid key (:func:`parse_error_line`), exit status 2, instead of the usage
        dump. ``MIXLAB_TRACEBACK=1`` keeps jsonargparse's own message."""
        from jsonargparse import ArgumentError

        if os.environ.get("MIXLAB_TRACEBACK"):
            return super().parse_arguments(parser, args)
        group = _group_not_a_mapping(self._words)
        if group:  # jsonargparse took `trainer: [1, 2]` and dropped every trainer setting before it (a user test)
            print(f"error: {group}", file=sys.stderr)
            raise SystemExit(2)
        parsers = [parser, *getattr(self, "_subcommand_parsers", {}).values()]
        for p in parsers:
            p.exit_on_error = False
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            command = next((w for w in self._words if w in self.subcommands()), "fit")
            sub = getattr(err.__cause__, "subcommand_parser", None) or self._subcommand_parsers.get(command, parser)
            print(f"error: {parse_error_line(str(err), self._words, parser_options(sub), command)}", file=sys.stderr)
            raise SystemExit(2) from None
        finally:
            for p in parsers:
                p.exit_on_error = True

    def _parse_ckpt_path(self) -> None:
        """Check ``--ckpt_path`` before LightningCLI reads its hyperparameters into the model config
        (which would silently swap in the checkpoint's model): a missing file, a file that is not a
        checkpoint, or a checkpoint of another head, task or vocabulary is a one-line error
        (:func:`read_checkpoint`, :func:`check_checkpoint_config`) before anything is written, as is a
        ``validate`` / ``test`` whose data split differs from the checkpoint's run (:func:`check_checkpoint_split`:
        its seed or split fractions). Then
        LightningCLI's step: the checkpoint's hyperparameters replace the config's model options (its
        ``mixer_args`` as a whole, not merged); each option this changes is named in one warning line."""
        sub = self.config.get("subcommand")
        path = self.config[sub].get("ckpt_path") if sub else None
        if path is not None and not str(path).strip():
            raise ValueError("--ckpt_path is empty; give a checkpoint file, or last / best (this run's checkpoints)")
        if path in ("last", "best"):  # resolve it now, so the model is built from that checkpoint as for a file
            path = self._resolve_named(sub, path) or path
            self.config[sub]["ckpt_path"] = path
        checkpoint = read_checkpoint(str(path)) if _own_checkpoint_file(path) else None
        if checkpoint is not None:
            check_checkpoint_config(str(path), checkpoint, self.config[sub])
            if sub in ("validate", "test"):
                check_checkpoint_split(str(path), checkpoint, self.config[sub], sub, self._words)
        before = self.config[sub].get("model") if sub else None
        with overrides.replacing_dicts():
            super()._parse_ckpt_path()
        if checkpoint is not None:
            self._apply_legacy_defaults(sub, checkpoint)
        after = self.config[sub].get("model") if sub else None
        if before is not None and after is not None:  # how to compute stays the config's (overrides.py)
            kept = overrides.keep_runtime_options(before, after, _pattern_mixers(after))
            if kept:
                logging.getLogger("mixlab.cli").info("--ckpt_path %s: runtime options kept from the config: %s",
                                                     path, "; ".join(kept))
        changed = overrides.changed_leaves(before, after)
        other = {k: v for k, v in overrides.changed_values(before, after).items() if k in _MODEL_IDENTITY}
        if sub == "fit" and other:
            run = Path(str(path)).resolve().parent.parent
            hint = f"use its run's config ({run / 'config.yaml'})" if (run / "config.yaml").is_file() else \
                "use the config it was trained with"
            what = "; ".join(f"{k} {old} in the config, {new} in the checkpoint"
                             for k, (old, new) in sorted(other.items()))
            raise ValueError(f"--ckpt_path {path}: the checkpoint is another model than the config's ({what}); fit "
                             f"would go on training the checkpoint's model, in its run folder: {hint}, or leave out "
                             f"--ckpt_path to train the config's model")
        if changed:
            logging.getLogger("mixlab.cli").warning(
                "--ckpt_path %s: the model is built from the checkpoint's hyperparameters, which differ from "
                "the config: %s", path, "; ".join(changed))

    def _apply_legacy_defaults(self, sub: str, checkpoint: dict) -> None:
        """Options a head added after a checkpoint was written take the value that checkpoint was trained
        with (the head's ``legacy_defaults``, e.g. the VQA head's ``causal: False``), not the config's:
        LightningCLI's hyperparameter step only replaces the options the checkpoint records."""
        hparams = checkpoint.get("hyper_parameters") or {}
        model = self.config[sub].get("model")
        cls = _import(_get(model, "class_path"))
        if cls is None or not hparams:
            return
        init = _get(model, "init_args")
        for key, value in getattr(cls, "legacy_defaults", {}).items():
            if key not in hparams and init is not None:
                init[key] = value

    def _resolve_named(self, sub: str, which: str) -> str | None:
        """The file ``--ckpt_path last|best`` names in the run this config would write (its task and
        run name come from the datamodule and model, built once here and dropped): see
        :func:`_latest_checkpoint`. None when the config does not build (its error comes later).

        Raises:
            FileNotFoundError: that run has no such checkpoint yet.
        """
        try:
            init = self.parser.instantiate_classes(self.config)[sub]
        except Exception:  # reported by the real instantiation
            return None
        cfg, model, data = self.config[sub], init.get("model"), init.get("data")
        task = getattr(data, "task_name", type(data).__name__.lower())
        run = cfg.get("run_name") or getattr(model, "run_name", type(model).__name__.lower())
        return _latest_checkpoint(Path(cfg.get("run_root") or "runs") / f"{task}/{run}", which)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--run_root", type=str, default="runs",
                            help="Root directory of TensorBoard runs: <run_root>/<task>/<run_name>/version_N")
        parser.add_argument("--run_name", type=str | None, default=None,
                            help="Override the run name (default: the model's mixer pattern)")
        # the best checkpoint: `checkpoint.monitor` / `checkpoint.mode` in a config or on the command line
        # (e.g. parity keeps its highest val/acc); `--ckpt_path best` reads the file it keeps
        parser.add_lightning_class_args(BestCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.filename": "{epoch}-{step}", "checkpoint.monitor": "val/loss",
                             "checkpoint.mode": "min", "checkpoint.save_top_k": 1})

    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        """LightningCLI's trainer with mixlab's logger (the run folder), progress bar and :class:`ValSplitCheck`
        (``fit``), after checking the trainer values and the run folder before anything is written.

        Raises:
            ValueError: one line for a trainer value Lightning would refuse with a traceback, run wrongly or
                replace (``val_check_interval`` below 1 or a float outside ``(0, 1]``, ``accumulate_grad_batches``
                below 1, ``log_every_n_steps`` below 0, a negative ``gradient_clip_val``, ``max_steps`` /
                ``max_epochs`` 0 for ``fit``, ``precision 16-mixed`` on the CPU, a datamodule without the split the
                command reads: :meth:`_check_trainer_values`), a ``--run_name`` that is not one folder name, a
                ``--run_root`` that cannot be written, a ``--ckpt_path`` whose weights do not fit the model or
                whose run cannot be resumed, and Lightning's own refusal of a strategy or accelerator
                (``trainer: ...``).
            FileNotFoundError: ``--ckpt_path last|best`` without such a checkpoint.
        """
        cfg = self.config_init[self.subcommand] if self.subcommand else self.config_init
        if self.subcommand and self.subcommand != "fit":  # keep the training run's config.yaml
            self.save_config_kwargs["config_filename"] = f"config_{self.subcommand}.yaml"
        logger = cfg["trainer"].get("logger")
        interval = cfg["trainer"].get("val_check_interval")
        if isinstance(interval, int) and not isinstance(interval, bool) and interval < 1:  # Lightning: a modulo by 0
            raise ValueError(f"trainer.val_check_interval={interval}: give training batches >= 1 (an int) or a "
                             f"fraction of an epoch in (0, 1] (a float)")
        self._check_trainer_values(cfg["trainer"])
        for place in null_groups(self._words):  # jsonargparse takes it: the group's defaults, silently
            logging.getLogger("mixlab.cli").warning(
                "%s: null replaces this whole group of options with its defaults (the values set for it before are "
                "dropped); to change one option, set that key", place)
        root_dir = set_at("trainer.default_root_dir", self._words)
        if root_dir and cfg["trainer"].get("default_root_dir") is not None:  # Lightning's folder without a logger
            logging.getLogger("mixlab.cli").warning(
                "%s is not where mixlab writes: every run goes to --run_root/<task>/<run_name>/version_N (now "
                "%s/...)%s", root_dir, cfg.get("run_root", "runs"), "" if set_at("run_root", self._words) else
                f"; give --run_root {cfg['trainer']['default_root_dir']} instead")
        if self.subcommand in ("validate", "test") and not cfg.get("ckpt_path"):
            logging.getLogger("mixlab.cli").warning(
                "%s without --ckpt_path evaluates the model's initial (untrained) weights; --ckpt_path last (or "
                "best, or a file) evaluates a trained run", self.subcommand)
        for option, least in (("accumulate_grad_batches", 1), ("log_every_n_steps", 0)):  # -1 passed, 0 divided
            value = cfg["trainer"].get(option)
            if isinstance(value, int) and not isinstance(value, bool) and value < least:
                raise ValueError(f"trainer.{option}={value}: give an integer >= {least}")
        clip = cfg["trainer"].get("gradient_clip_val")
        if clip is not None and not clip >= 0:  # Lightning clips to a negative norm without a word
            raise ValueError(f"trainer.gradient_clip_val={clip}: give a norm (or value) >= 0, or null for no clipping")
        for limit in ("max_steps", "max_epochs"):  # Lightning would "train" nothing and keep an empty run folder
            if self.subcommand == "fit" and cfg["trainer"].get(limit) == 0:
                raise ValueError(f"trainer.{limit}=0 trains nothing: give {limit} >= 1 (-1: no limit of that kind)")
        name_given = cfg.get("run_name")
        if name_given is not None and (not name_given.strip() or name_given.strip() in (".", "..")
                                       or any(c in name_given for c in "/\\") or not name_given.isprintable()):
            # one folder: `compare` and `--ckpt_path last` find runs at <run_root>/<task>/<run_name>/version_N
            raise ValueError(f"--run_name {name_given!r}: one folder name inside --run_root/<task> (no '/', not "
                             f"'..', not empty, no control characters)")
        task = getattr(self.datamodule, "task_name", type(self.datamodule).__name__.lower())
        run = cfg.get("run_name") or getattr(self.model, "run_name", type(self.model).__name__.lower())
        root, name = Path(cfg.get("run_root", "runs")), f"{task}/{run}"
        # the root, then the run's own folder <run_root>/<task>/<run_name> (a file in its place, a long name): it
        # was an OSError traceback from the logger's makedirs, after the model was built
        problem = (output_problem("--run_root", cfg.get("run_root", "runs"), folder=True)
                   or output_problem("--run_root/<task>/<run_name>", root / name, folder=True))
        if problem:
            raise ValueError(problem)
        if cfg.get("ckpt_path") in ("last", "best"):
            cfg["ckpt_path"] = _latest_checkpoint(root / name, cfg["ckpt_path"])
        checkpoint = None
        if _own_checkpoint_file(cfg.get("ckpt_path")):
            checkpoint = read_checkpoint(cfg["ckpt_path"])
            check_state_dict(cfg["ckpt_path"], checkpoint, self.model)
            if self.subcommand == "fit":
                _check_resumable(cfg["ckpt_path"], checkpoint, cfg.get("checkpoint"))
            home = _checkpoint_run(cfg["ckpt_path"], task)
            if self.subcommand in ("validate", "test") and not cfg.get("run_name") and home \
                    and home != (root.resolve(), name):
                # evaluating another run's checkpoint: its metrics belong to that run (where `compare` reads them)
                root, name = home
                logging.getLogger("mixlab.cli").info("%s: logging into the checkpoint's run %s", self.subcommand,
                                                     root / name)
        version = _run_version(cfg.get("ckpt_path"), root / name)  # the checkpoint's own run: log into it
        if self.subcommand == "fit" and cfg["trainer"].get("enable_checkpointing") is False and version is not None:
            # its steps would be logged into the run but kept by no checkpoint: a later resume logs them again
            raise ValueError(f"--ckpt_path {cfg['ckpt_path']} with trainer.enable_checkpointing false would train "
                             f"on in that run's folder without saving: its logged steps would be logged again by "
                             f"the next resume; turn checkpointing on, or give --run_name to train a new run from it")
        if logger is None or logger is True or logger is False:
            tensorboard = TensorBoardLogger(str(root), name=name, default_hp_metric=False, version=version)
            self._note_run_dir(Path(tensorboard.log_dir))
            if logger is False:  # no metrics logged (no LearningRateMonitor: _instantiate_trainer); checkpoints and
                kwargs["default_root_dir"] = tensorboard.log_dir  # config in the run folder all the same
            else:
                kwargs["logger"] = tensorboard
        given = cfg["trainer"].get("callbacks") or []
        given = given if isinstance(given, list) else [given]
        extra: list[pl.Callback] = [ValSplitCheck()] if self.subcommand == "fit" else []  # an empty val split
        first: list[pl.Callback] = [MonitorCheck()] if self.subcommand == "fit" else []  # before EarlyStopping's
        if cfg["trainer"].get("enable_progress_bar") is not False and not any(
                isinstance(c, pl.callbacks.ProgressBar) for c in given):  # train/loss on the bar without a sync
            extra.append(LossProgressBar())
        if extra or first:
            kwargs["callbacks"] = [*first, *given, *extra]
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except (ValueError, TypeError, MisconfigurationException) as err:  # e.g. a strategy or accelerator typo
            # Lightning names the argument in backticks: "`devices` selected with `CPUAccelerator` should be ..."
            names = [*re.findall(r"`(\w+)`", str(err)),
                     *(name for phrase, name in _LIGHTNING_PHRASES if phrase in str(err))]
            places = [set_at(f"trainer.{name}", self._words) for name in names]
            where = next((p for p in places if p), "trainer")
            hint = ""
            if "No supported gpu backend found" in str(err):  # Lightning's whole message, for `accelerator: gpu`
                hint = " (this machine has no CUDA or MPS device: use --trainer.accelerator cpu, or auto)"
            raise ValueError(f"{where}: {err}{hint}") from err
        from mixlab.distributed import FSDPStrategy

        if isinstance(trainer.strategy, FSDPStrategy) and trainer.accelerator.__class__.__name__ == "CPUAccelerator":
            raise ValueError("trainer: configs/trainer/fsdp.yaml (FSDP) needs CUDA GPUs; on CPU use "
                             "configs/trainer/ddp.yaml (gloo)")
        if self.subcommand == "fit" and checkpoint is not None:
            self._nothing_to_train = nothing_to_train(cfg["ckpt_path"], checkpoint, trainer)
            # a resume writes into the run's own checkpoint folder, which holds its checkpoints by design
            warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
        return trainer

    def _check_trainer_values(self, trainer: Any) -> None:
        """Trainer values that parse but that Lightning refuses with a traceback, refuses naming another option, or
        silently replaces, checked before anything is written. Each error names where the value was set
        (:func:`set_at`: ``<file>: <key>`` or ``--<key>``).

        Raises:
            ValueError: one line for

                * ``val_check_interval`` a float outside ``(0, 1]`` (Lightning's error named no file, or blamed the
                  file that set ``check_val_every_n_epoch: null``), or a float while ``check_val_every_n_epoch`` is
                  null (validation then counts training batches across epochs);
                * ``barebones: true`` (Lightning's refusal named mixlab's default logger and ``log_every_n_steps``);
                * ``precision`` ``16-mixed`` (or ``16``) on the CPU, which Lightning turns into ``bf16-mixed`` with
                  one warning: ``--trainer.precision: 16-mixed needs CUDA (...); use bf16-mixed or 32-true on the
                  CPU``;
                * ``validate`` / ``test`` with a datamodule that has no such split (no ``val_dataloader`` /
                  ``test_dataloader``, e.g. ``configs/data/random_images.yaml``: Lightning's
                  MisconfigurationException traceback), and ``fit`` with one that has no validation split unless
                  ``trainer.limit_val_batches`` is 0 (Lightning skipped validation with one warning: no val
                  metrics, no best checkpoint).
        """
        from lightning.pytorch.utilities.model_helpers import is_overridden

        where = lambda key: set_at(key, self._words) or key  # noqa: E731
        if trainer.get("barebones"):  # Lightning refused it naming settings the user never gave (mixlab's defaults)
            raise ValueError(f"{where('trainer.barebones')}: true turns off what a mixlab run is made of (its logger, "
                             f"checkpoints, metric callbacks and progress bar); for a lean run give --trainer.logger "
                             f"false --trainer.enable_checkpointing false --trainer.enable_progress_bar false")
        interval, every = trainer.get("val_check_interval"), trainer.get("check_val_every_n_epoch")
        if isinstance(interval, float) and not 0 < interval <= 1:
            raise ValueError(f"{where('trainer.val_check_interval')}: {interval} is not a fraction of an epoch in "
                             f"(0, 1]; give such a fraction (a float) or a number of training batches (an int >= 1)")
        if isinstance(interval, float) and every is None:
            raise ValueError(f"{where('trainer.val_check_interval')}: {interval} is a fraction of an epoch, but "
                             f"trainer.check_val_every_n_epoch is null (set at "
                             f"{where('trainer.check_val_every_n_epoch')}), which counts training batches across "
                             f"epochs: give a number of training batches (an int >= 1), or set "
                             f"check_val_every_n_epoch (e.g. 1)")
        float16 = float16_on_cpu(trainer.get("precision"), _runs_on_cpu(trainer.get("accelerator")))
        if float16:
            raise ValueError(f"{where('trainer.precision')}: {float16}")
        split = {"fit": "val", "validate": "val", "test": "test"}.get(self.subcommand or "")
        if split is None or self.datamodule is None or is_overridden(f"{split}_dataloader", self.datamodule):
            return
        limit = trainer.get("limit_val_batches")
        if self.subcommand == "fit" and (limit == 0 or not is_overridden("validation_step", self.model)):
            return  # training without validation, as asked
        place = set_at("data.class_path", self._words) or set_at("data", self._words) or "data.class_path"
        head = f"{place}: {type(self.datamodule).__name__} has no {split} split (no {split}_dataloader)"
        if self.subcommand == "fit":
            raise ValueError(f"{head}: fit would train without validation (no val metrics, no best checkpoint); "
                             f"pass --trainer.limit_val_batches 0 to train without validation")
        raise ValueError(f"{head}: {self.subcommand} would measure nothing; use a data config with a {split} split "
                         f"(e.g. the task config's own data)")

    # ------------------------------------------------------------------ the run folder
    _nothing_to_train: str | None = None
    _fresh_run_dir: Path | None = None
    _run_dir_before: tuple[Path, dict[Path, bytes | None]] | None = None

    def _note_run_dir(self, run_dir: Path) -> None:
        """Remember a run folder this command creates (removed again if the command fails before
        writing a checkpoint, :meth:`_run_subcommand`), or, for an existing one (a resume, an evaluation),
        which files it holds and its config files' contents (put back the same way); a resumed ``fit``
        keeps the run's ``config.yaml`` and writes its own config as ``config_resume_<k>.yaml``."""
        self._fresh_run_dir = None if run_dir.exists() else run_dir
        self._run_dir_before = None
        if run_dir.is_dir():
            self._run_dir_before = (run_dir, {
                f: f.read_bytes() if f.suffix == ".yaml" and f.parent == run_dir else None
                for f in run_dir.rglob("*") if f.is_file()})
        if self.subcommand == "fit" and (run_dir / "config.yaml").exists():
            k = 1
            while (run_dir / f"config_resume_{k}.yaml").exists():
                k += 1
            self.save_config_kwargs["config_filename"] = f"config_resume_{k}.yaml"

    def _run_subcommand(self, subcommand: str) -> None:
        """Run ``subcommand``; if it fails (an error, Ctrl-C) in a run folder it created before
        anything is kept there (no checkpoint; for ``fit``, no training step done), remove that
        folder and the parents it leaves empty, so failed attempts leave no empty ``version_N``
        behind and the next run takes its number. In a run folder that existed (a resume, an evaluation),
        the same failure removes the files the command added (``config_resume_<k>.yaml``, event files) and
        puts back the config files it rewrote (``config_test.yaml`` of the last good test).

        A ``fit`` whose checkpoint has nothing left to train (:func:`nothing_to_train`) does not run: it
        prints that line (rank 0) and returns, the run folder untouched.

        Raises:
            ValueError: the subcommand ran on no batch (:func:`no_batches`), or Lightning refused a trainer value
                only the data could refute (:func:`late_value_error`: ``val_check_interval`` above the batches of
                an epoch), in one line naming where the value was set; any other error of the subcommand as it
                was raised.
        """
        if subcommand == "fit" and self._nothing_to_train:
            if self.trainer.is_global_zero:
                print(self._nothing_to_train, flush=True)
            return
        _RUN_STARTED.set()
        sigterm = SigtermTwice(self.trainer)
        with sigterm_handler(sigterm), sigterm_handler(CtrlCTwice(self.trainer, sigterm), signal.SIGINT):
            self._run_and_undo(subcommand)

    def _run_and_undo(self, subcommand: str) -> None:
        """:meth:`_run_subcommand`'s run and, on failure, its undo of the run folder."""
        try:
            try:
                super()._run_subcommand(subcommand)
            except ValueError as err:
                late = None if os.environ.get("MIXLAB_TRACEBACK") else late_value_error(err, self.trainer, self._words)
                if late is None:
                    raise
                raise ValueError(late) from None
            empty = no_batches(subcommand, self.trainer)
            if empty:
                raise ValueError(empty)
        except BaseException:
            run_dir = self._fresh_run_dir
            trainer = getattr(self, "trainer", None)
            # trained = a step done in THIS process (a resume restores global_step before it can fail)
            last = next((c for c in getattr(trainer, "callbacks", []) if isinstance(c, LastCheckpoint)), None)
            start = last.start_step if last is not None else 0
            trained = subcommand == "fit" and trainer is not None and start is not None and trainer.global_step > start
            undo = not trained and (trainer is None or trainer.is_global_zero)
            if undo and self._run_dir_before is not None:
                _restore_run_dir(*self._run_dir_before)
            if undo and run_dir is not None and run_dir.is_dir() and not any(run_dir.rglob("*.ckpt")):
                shutil.rmtree(run_dir, ignore_errors=True)
                root = Path(self.config_init[subcommand].get("run_root", "runs")).resolve()
                for parent in run_dir.resolve().parents:
                    if parent == root or root not in parent.parents or any(parent.iterdir()):
                        break
                    parent.rmdir()
            raise


@contextlib.contextmanager
def sigterm_handler(handler: Callable[[int, Any], None], signum: int = signal.SIGTERM) -> Iterator[None]:
    """``handler`` as the handler of ``signum`` (SIGTERM) inside (the one before it restored after); a no-op outside
    the main thread, where Python cannot set signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signum, handler)
    try:
        yield
    finally:
        signal.signal(signum, previous)


_LIGHTNING_PHRASES = (("No supported gpu backend", "accelerator"), ("Timer(duration=", "max_time"))
"""Lightning errors that name their trainer argument without backticks: (phrase, argument)."""


class TerminatedMidStep(BaseException):
    """A second SIGTERM during ``fit``/``validate``/``test`` (:class:`SigtermTwice`): the command stops where it
    is, without saving the step in flight; a BaseException, as KeyboardInterrupt, and not Lightning's
    ``SIGTERMException``, which :class:`~mixlab.callbacks.LastCheckpoint` answers with a save."""


class SigtermTwice:
    """mixlab's SIGTERM handler during ``fit``/``validate``/``test`` (installed by
    :meth:`MixlabCLI._run_subcommand`). While Lightning's loops run, Lightning calls it after its own handler, which
    stops the loop at the end of the running step (``last.ckpt`` saved): the first SIGTERM prints that line; a second
    one raises :class:`TerminatedMidStep` at once, so a step that never ends (a stuck sample generator, a
    ``cg_iters`` of 1e9) can be stopped without SIGKILL, its outputs kept or put back as for any failure. Outside
    Lightning's loops (datamodule set-up, building the model) the first SIGTERM raises Lightning's
    ``SIGTERMException`` at once (status 143; it was the default action, which killed the process without putting
    back its outputs). During ``fit``'s last validation (``trainer``:
    :func:`mixlab.callbacks.final_validation`) the first SIGTERM lets it finish and the run end as it would have."""

    def __init__(self, trainer: pl.Trainer | None = None) -> None:
        self.received, self.trainer = 0, trainer

    def __call__(self, signum: int, frame: Any) -> None:
        self.received += 1
        if signal.getsignal(signal.SIGTERM) is self:  # Lightning's loops do not listen
            print("mixlab: SIGTERM: stopped at once (outside the training and evaluation loops: set-up or "
                  "teardown); nothing saved", file=sys.stderr, flush=True)
            raise SIGTERMException()
        if self.received == 1 and self.trainer is not None and final_validation(self.trainer):
            self.trainer._signal_connector.received_sigterm = False  # Lightning's notifier set it: unset
            print("mixlab: SIGTERM during the last validation: the run finishes with it (SIGTERM again stops at "
                  "once, without saving it)", file=sys.stderr, flush=True)
            return
        if self.received == 1:
            print("mixlab: SIGTERM: stopping at the end of the running step (SIGTERM again stops at once, without "
                  "saving it)", file=sys.stderr, flush=True)
            return
        print("mixlab: SIGTERM again: stopping now, in the middle of the running step, which is not saved (a "
              "checkpoint saved before stays as it was)", file=sys.stderr, flush=True)
        raise TerminatedMidStep()


_CTRL_C_STOP = threading.Event()
"""Set by :class:`CtrlCTwice` when its Ctrl-C stopped ``fit`` through Lightning's SIGTERM route: :func:`main`'s exit
status is then 130 (128 + SIGINT), not 143."""


_RUN_STARTED = threading.Event()
"""Set when ``fit``/``validate``/``test`` begins to run (config read, classes built): a Ctrl-C :func:`main` catches
after that is not "while starting"."""


class InterruptedMidStep(TerminatedMidStep):
    """A second Ctrl-C during ``fit`` (:class:`CtrlCTwice`): as :class:`TerminatedMidStep`, exit status 130."""


class CtrlCTwice:
    """mixlab's SIGINT handler during ``fit``/``validate``/``test`` (installed by :meth:`MixlabCLI._run_subcommand`).

    While ``fit`` trains or validates, the first Ctrl-C asks Lightning to stop as for SIGTERM: at the end of the
    running training step (or between two validation batches; the validation restarts whole on resume), which
    ``last.ckpt`` then holds, in the loop state that resumes exactly. Lightning's own KeyboardInterrupt lands
    anywhere in a step, and the checkpoint of such a moment resumed with the validations one step early (a user
    test). A second Ctrl-C raises :class:`InterruptedMidStep` at once, nothing saved. Elsewhere (set-up, the sanity
    check, ``validate``/``test``) Ctrl-C raises KeyboardInterrupt as Python's default handler does. ``sigterm``:
    the :class:`SigtermTwice` installed with it (while it is the SIGTERM handler, Lightning's loops do not run)."""

    def __init__(self, trainer: pl.Trainer | None, sigterm: SigtermTwice) -> None:
        self.trainer, self.sigterm, self.received, self.pid = trainer, sigterm, 0, os.getpid()

    def __call__(self, signum: int, frame: Any) -> None:
        from lightning.pytorch.trainer.states import RunningStage

        if os.getpid() != self.pid:  # a forked DataLoader worker (a terminal's Ctrl-C reaches the whole group)
            return
        self.received += 1
        trainer = self.trainer
        running = (trainer is not None and signal.getsignal(signal.SIGTERM) is not self.sigterm
                   and trainer.state.fn == "fit" and trainer.state.stage in (RunningStage.TRAINING,
                                                                            RunningStage.VALIDATING))
        if not running:
            raise KeyboardInterrupt
        if self.received == 1 and final_validation(trainer):
            if trainer.is_global_zero:
                print("mixlab: Ctrl-C during the last validation: the run finishes with it (Ctrl-C again stops at "
                      "once, without saving it)", file=sys.stderr, flush=True)
            return
        if self.received == 1:
            if trainer.is_global_zero:
                print("mixlab: Ctrl-C: stopping at the end of the running step, which is saved (Ctrl-C again stops "
                      "at once, without saving it)", file=sys.stderr, flush=True)
            trainer.mixlab_stop_signal = "interrupted (Ctrl-C)"
            _CTRL_C_STOP.set()
            trainer._signal_connector.received_sigterm = True  # Lightning's stop: at the end of the step
            return
        print("mixlab: Ctrl-C again: stopping now, in the middle of the running step, which is not saved (a "
              "checkpoint saved before stays as it was)", file=sys.stderr, flush=True)
        raise InterruptedMidStep()


def float16_on_cpu(precision: Any, on_cpu: bool) -> str | None:
    """Why ``precision`` cannot run on the CPU (``on_cpu``), or None: ``16-mixed`` (or ``16``), which Lightning
    turns into ``bf16-mixed`` there with one warning. Used by ``fit``/``validate``/``test`` and ``resolution``."""
    if str(precision) in ("16-mixed", "16") and on_cpu:
        return (f"{precision} (float16 mixed precision) needs CUDA; on the CPU Lightning would run bf16-mixed "
                f"instead: use bf16-mixed or 32-true on the CPU")
    return None


def _runs_on_cpu(accelerator: Any) -> bool:
    """Whether a ``trainer.accelerator`` value puts the run on the CPU: ``cpu`` (or a CPUAccelerator), or
    ``auto`` / unset on a machine without CUDA or MPS."""
    from lightning.pytorch.accelerators import CPUAccelerator

    if isinstance(accelerator, CPUAccelerator) or str(accelerator) == "cpu":
        return True
    mps = getattr(torch.backends, "mps", None)
    return accelerator in (None, "auto") and not torch.cuda.is_available() and not (mps and mps.is_available())


def no_batches(subcommand: str, trainer: pl.Trainer, split: str | None = None) -> str | None:
    """Why ``subcommand`` ran (or, for ``fit``'s ``split="val"``, would run) on no data, in one line, or None.
    Lightning ends such a ``fit`` with "No training batches" and such a ``validate`` / ``test`` with no metrics,
    both with exit status 0 (a user test: a ``batch_size`` above the training split's size, ``limit_train_batches
    0``, ``val_fraction 0``), and trains a ``fit`` whose validation split is empty without validation (one
    warning). ``split``: ``train`` for ``fit``, ``val`` for ``validate``, ``test`` for ``test`` unless given. An
    empty split names the datamodule's arguments that size it (:func:`split_arguments`, e.g. ``val_fraction=0.0``),
    which :func:`place_value_error` turns into the file or option that set them."""
    split = split or {"fit": "train", "validate": "val", "test": "test"}.get(subcommand)
    if split is None or trainer.interrupted:
        return None
    done = "trained" if subcommand == "fit" and split == "train" else "measured"
    if getattr(trainer, f"limit_{split}_batches") == 0:  # Lightning skips the loop: its batch count stays unset
        return f"trainer.limit_{split}_batches is 0: {subcommand} ran on no batch and {done} nothing"
    # counts Lightning sets once the loop has read its dataloaders (unset: inf for fit, [] for validate/test)
    counts = [trainer.num_training_batches] if split == "train" else list(getattr(trainer, f"num_{split}_batches"))
    if not counts or any(counts):
        return None
    loaders = getattr(trainer, f"{split}_dataloader" if split == "train" else f"{split}_dataloaders")
    loader = loaders[0] if isinstance(loaders, (list, tuple)) and loaders else loaders
    size = batch = None
    with contextlib.suppress(TypeError, AttributeError):
        size, batch = len(loader.dataset), loader.batch_size
    if size and batch:
        what = (f"the {split} split gives no batch: its {size} samples make no batch of "
                f"data.init_args.batch_size={batch}"
                + (" (the last partial batch is dropped)" if getattr(loader, "drop_last", False) else ""))
        fix = f"lower data.init_args.batch_size or give the {split} split data"
    else:
        args = split_arguments(getattr(trainer, "datamodule", None), split)
        what = f"the {split} split is empty" + (f" ({', '.join(f'{k}={v!r}' for k, v in args.items())})"
                                                if args else "")
        fix = f"give the {split} split data"
    if subcommand == "fit" and split == "val":
        return (f"data: {what}: fit would train without validation (no val metrics, no best checkpoint); {fix}, or "
                f"pass --trainer.limit_val_batches 0 to train without validation")
    return f"data: {what}; {subcommand} {done} nothing ({fix})"


def split_arguments(datamodule: Any, split: str) -> dict[str, Any]:
    """The datamodule arguments (its ``hparams``) that size ``split`` (``val``, ``test``): a fraction or a count
    named after it (``val_fraction``, ``n_val``, ``n_test_automata``, ``max_val_windows``,
    ``test_image_fraction``), those set (not None); {} without such arguments. A datamodule whose ``split_aliases``
    maps ``split`` to another (text: ``{"test": "val"}``, its test split is its val split) gives that one's."""
    split = (getattr(datamodule, "split_aliases", None) or {}).get(split, split)
    hparams = getattr(datamodule, "hparams", None) or {}
    return {k: v for k, v in hparams.items() if isinstance(k, str) and split in k.split("_") and v is not None
            and (k.endswith("_fraction") or k.startswith(("n_", "max_")))}


class ValSplitCheck(pl.Callback):
    """Added by :class:`MixlabCLI` to every ``fit`` (and not listed in ``trainer.callbacks``): at the start of
    fit, after the datamodule's ``setup``, load the validation dataloaders as Lightning's fit loop does for its
    progress bar (they are then the ones validation uses) and refuse a validation split with no batch.

    Raises:
        ValueError: the validation split is empty, unless ``trainer.limit_val_batches`` is 0 (the user's way to
            train without validation): one line from :func:`no_batches` naming the datamodule arguments that
            size it (``data: the val split is empty (val_fraction=0.0): fit would train without validation ...``).
    """

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning.pytorch.utilities.model_helpers import is_overridden

        data = trainer.datamodule
        if (trainer.limit_val_batches == 0 or not is_overridden("validation_step", pl_module) or data is None
                or not is_overridden("val_dataloader", data)):
            return
        trainer.validating = True  # as the fit loop's on_run_start loads them (Lightning 2.x)
        try:
            trainer.fit_loop.epoch_loop.val_loop.setup_data()
        finally:
            trainer.training = True
        empty = no_batches("fit", trainer, split="val")
        if empty:
            raise ValueError(empty)


class MonitorCheck(pl.Callback):
    """Added by :class:`MixlabCLI` to every ``fit``, first among the callbacks (and not listed in
    ``trainer.callbacks``): at the first validation that logs metrics (the sanity check when it runs, before any
    training step), refuse an ``EarlyStopping`` callback whose ``monitor`` validation does not log. Lightning raised
    a ``RuntimeError`` traceback there, at the first validation after the sanity check, with the steps trained
    before it unsaved. (The ``checkpoint`` group's ``monitor`` is checked by
    :class:`~mixlab.callbacks.BestCheckpoint`.)

    Raises:
        ValueError: ``trainer.callbacks: EarlyStopping monitor 'val_loss' is not logged by validation; did you
            mean val/loss? It logs val/acc, val/loss, ...``.
    """

    def __init__(self) -> None:
        self.checked = False

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning.pytorch.callbacks import EarlyStopping

        logged = trainer.callback_metrics
        names = sorted(k for k in logged if k.startswith("val/"))
        if self.checked or not names:
            return
        self.checked = True
        for cb in trainer.callbacks:
            if isinstance(cb, EarlyStopping) and not cb._check_on_train_epoch_end and cb.monitor not in logged:
                near = difflib.get_close_matches(str(cb.monitor), names, n=1)
                raise ValueError(f"trainer.callbacks: EarlyStopping monitor {cb.monitor!r} is not logged by "
                                 f"validation" + (f"; did you mean {near[0]}?" if near else "")
                                 + f" It logs {', '.join(names)}")


_LATE_INTERVAL = re.compile(r"`val_check_interval` \((\d+)\) must be less than or equal to the number of the "
                            r"training batches \((\d+)\)")
"""Lightning's error for an int ``val_check_interval`` above an epoch's batches (``fit_loop.setup_data``)."""


def late_value_error(err: BaseException, trainer: pl.Trainer | None, words: list[str]) -> str | None:
    """One line for a Lightning error about a trainer value that only the data could refute, naming where the
    value was set (:func:`set_at`), or None: an int ``val_check_interval`` above the batches of one training epoch
    while ``check_val_every_n_epoch`` is set, e.g. ``--trainer.val_check_interval: 1000 is more training batches
    than one epoch has (39); give at most 39 (or a fraction of an epoch in (0, 1]), or set
    trainer.check_val_every_n_epoch to null to count 1000 batches across epochs``."""
    m = _LATE_INTERVAL.search(str(err)) if isinstance(err, ValueError) else None
    if m is None:
        return None
    interval, batches = m.groups()
    limit = getattr(trainer, "limit_train_batches", None)
    after = "" if limit is None or (isinstance(limit, float) and limit == 1.0) else \
        f", after trainer.limit_train_batches={limit}"
    return (f"{set_at('trainer.val_check_interval', words) or 'trainer.val_check_interval'}: {interval} is more "
            f"training batches than one epoch has ({batches}{after}); give at most {batches} (or a fraction of an "
            f"epoch in (0, 1]), or set trainer.check_val_every_n_epoch to null to count {interval} batches across "
            f"epochs")


def _restore_run_dir(run_dir: Path, before: dict[Path, bytes | None]) -> None:
    """Put an existing run folder back as ``before`` recorded it (file -> its bytes for the config files,
    else None): files added since are removed (checkpoints excepted), folders they leave empty as well, and
    config files that were rewritten get their old contents back."""
    if not run_dir.is_dir():
        return
    for f in sorted(run_dir.rglob("*"), reverse=True):  # files before their folders
        if f.is_file() and f not in before and f.suffix != ".ckpt":
            f.unlink(missing_ok=True)
        elif f.is_dir() and not any(f.iterdir()) and not any(p.is_relative_to(f) for p in before):
            f.rmdir()
    for f, data in before.items():
        if data is not None and (not f.exists() or f.read_bytes() != data):
            f.write_bytes(data)


def _latest_checkpoint(run_dir: Path, which: str = "last") -> str:
    """The checkpoint ``--ckpt_path last|best`` names, in ``<run_dir>/version_N/checkpoints/`` of the
    highest N holding one: ``last.ckpt`` (the newest state), or for ``best`` the file the ``checkpoint``
    group's ``ModelCheckpoint`` keeps (its ``monitor``, default lowest ``val/loss``; ``epoch=E-step=S.ckpt``,
    the one checkpoint there not named ``last*``) of the highest N holding any checkpoint (never an older
    run's).

    Raises:
        FileNotFoundError: no run of this task and run name has such a checkpoint yet (for ``best``:
            validation never ran in the newest run), or ``best`` is ambiguous (several candidates: pass the
            file).
    """
    def version(p: Path) -> int:
        tail = p.parent.parent.name.split("_")[-1]
        return int(tail) if tail.isdigit() else -1

    if which == "last":
        found = sorted(run_dir.glob("version_*/checkpoints/last.ckpt"), key=version)
        if not found:
            raise FileNotFoundError(f"--ckpt_path last: no {run_dir}/version_*/checkpoints/last.ckpt; train "
                                    f"first (fit) or pass the checkpoint file")
        return str(found[-1])
    every = sorted(run_dir.glob("version_*/checkpoints/*.ckpt"), key=version)
    if not every:
        raise FileNotFoundError(f"--ckpt_path best: no best checkpoint (best on checkpoint.monitor) in "
                                f"{run_dir}/version_*/checkpoints/; it is written at validation: train with "
                                f"validation first, or pass the checkpoint file")
    # the newest version's, as for last (an older version's best would silently test another run)
    newest = [p for p in every if version(p) == version(every[-1]) and not p.name.startswith("last")]
    if not newest:
        raise FileNotFoundError(f"--ckpt_path best: the newest run {every[-1].parent} has no best checkpoint "
                                f"(best on checkpoint.monitor, kept at validation: none ran there, or "
                                f"checkpoint.save_top_k is 0); pass a file")
    if len(newest) > 1:
        raise FileNotFoundError(f"--ckpt_path best: {len(newest)} candidate checkpoints in {newest[0].parent} "
                                f"({', '.join(p.name for p in newest)}); pass the file")
    return str(newest[0])


def _check_resumable(path: str, checkpoint: dict, group: Any) -> None:
    """Refuse to resume ``fit`` from a checkpoint whose training state this command cannot continue:

    * written before the SwiGLU's gate and value projections were packed into one ``mlp.fc1`` (its weights
      load, :meth:`mixlab.backbone.Block._load_from_state_dict`, but its optimizer state has one tensor more
      per block);
    * its best-checkpoint callback watched another metric or direction than this command's ``checkpoint``
      group (options given on the command line of the first fit and left out of the resume): Lightning
      would warn, keep a second "best" file by the other rule, and ``--ckpt_path best`` would be ambiguous.

    Raises:
        ValueError: one line naming the reason (both settings for the second).
    """
    if any(".mlp.fc1_g." in k for k in checkpoint.get("state_dict") or {}):
        raise ValueError(f"--ckpt_path {path}: written before the SwiGLU's gate and value projections were packed "
                         "into one (mlp.fc1_g / fc1_x -> mlp.fc1); its weights load for validate, test and "
                         "generate, but fit cannot resume its optimizer state")
    for key, state in (checkpoint.get("callbacks") or {}).items():
        if not (isinstance(key, str) and key.startswith(f"{BestCheckpoint.__name__}{{")):
            continue
        if not (isinstance(state, dict) and state.get("best_model_path")):
            continue  # it kept no file (e.g. a monitor that was never logged): nothing to be consistent with
        try:
            was = ast.literal_eval(key[len(BestCheckpoint.__name__):])
        except (ValueError, SyntaxError):
            continue
        now = {"monitor": _get(group, "monitor"), "mode": _get(group, "mode")}
        if (was.get("monitor"), was.get("mode")) != (now["monitor"], now["mode"]):
            def arg(v: Any) -> str:  # as the command line reads it back (None -> null)
                return "null" if v is None else str(v)

            raise ValueError(f"--ckpt_path {path}: that run kept its best checkpoint by checkpoint.monitor "
                             f"{arg(was.get('monitor'))} ({was.get('mode')}); this command says "
                             f"{arg(now['monitor'])} ({now['mode']}): resume with --checkpoint.monitor "
                             f"{arg(was.get('monitor'))} --checkpoint.mode {was.get('mode')}")


def nothing_to_train(path: str, checkpoint: dict, trainer: pl.Trainer) -> str | None:
    """The line ``fit --ckpt_path path`` prints instead of running when ``checkpoint`` has nothing left to train under
    ``trainer``'s limits (as Lightning's fit loop stops: ``max_steps`` not -1 and the checkpoint's ``global_step``
    at or past it, ``max_time`` and the checkpoint's training time (its Timer state) at or past it, or
    ``max_epochs`` not -1 and the checkpoint's finished epochs at or past it), else None. Finished epochs: the fit
    loop's ``epoch_progress.current.processed``, plus the epoch in progress when its last batch is done (a
    checkpoint written at the end of an epoch's last batch, :func:`mixlab.distributed.as_batch_end_checkpoint`).
    E.g. ``fit: nothing to train: the checkpoint x.ckpt is at step 400 and trainer.max_steps is 400; raise
    trainer.max_steps to train on (nothing written)``."""
    step = int(checkpoint.get("global_step") or 0)
    max_steps, max_epochs = trainer.max_steps, trainer.max_epochs
    dev_run = getattr(trainer, "fast_dev_run", False)
    if dev_run and max_steps is not None and step >= max_steps:  # fast_dev_run sets max_steps, not the user
        return (f"fit: nothing to train: trainer.fast_dev_run stops Lightning at step {max_steps} and the "
                f"checkpoint {path} is at step {step}; to try a resume, give --trainer.max_steps {step + 1} "
                f"instead (nothing written)")
    if max_steps is not None and max_steps != -1 and step >= max_steps:
        return (f"fit: nothing to train: the checkpoint {path} is at step {step} and trainer.max_steps is "
                f"{max_steps}; raise trainer.max_steps to train on (nothing written)")
    from lightning.pytorch.callbacks import Timer

    timer = next((c for c in getattr(trainer, "callbacks", None) or [] if isinstance(c, Timer)), None)
    if timer is not None and timer._duration is not None:  # trainer.max_time: the run's training time so far
        state = (checkpoint.get("callbacks") or {}).get(timer.state_key) or {}
        elapsed = float((state.get("time_elapsed") or {}).get("train") or 0.0)
        if elapsed >= timer._duration:
            import datetime

            return (f"fit: nothing to train: the checkpoint {path} (step {step}) has trained for {elapsed:.0f} s and "
                    f"trainer.max_time is {datetime.timedelta(seconds=timer._duration)}; raise trainer.max_time to "
                    f"train on (nothing written)")
    loops = (checkpoint.get("loops") or {}).get("fit_loop") or {}
    epochs = (loops.get("epoch_progress") or {}).get("current")
    if max_epochs is None or max_epochs == -1 or not isinstance(epochs, dict):
        return None
    batches = loops.get("epoch_loop.batch_progress") or {}
    done = int(epochs.get("processed", 0))
    if batches.get("is_last_batch") and done < int(epochs.get("started", 0)):
        done += 1  # the epoch in progress has had its last batch
    if done >= max_epochs:
        return (f"fit: nothing to train: the checkpoint {path} (step {step}) has finished {done} epoch(s) and "
                f"trainer.max_epochs is {max_epochs}; raise trainer.max_epochs to train on (nothing written)")
    return None


def _checkpoint_run(ckpt_path: str, task: str) -> tuple[Path, str] | None:
    """``(run_root, "<task>/<run>")`` of a checkpoint in mixlab's layout
    ``<run_root>/<task>/<run>/version_N/checkpoints/x.ckpt`` for this ``task``, else None."""
    parts = Path(ckpt_path).resolve().parts
    if len(parts) >= 6 and parts[-2] == "checkpoints" and parts[-5] == task:
        return Path(*parts[:-5]), f"{task}/{parts[-4]}"
    return None


def _run_version(ckpt_path: str | None, run_dir: Path) -> int | str | None:
    """The version of ``run_dir`` holding ``ckpt_path`` (``.../version_N/checkpoints/x.ckpt``), else None.

    ``N`` as an int for ``version_N`` (the progress bar then shows ``v_num=N``), other folder
    names as they are. Resuming, validating or testing from a run's own checkpoint then logs
    into that same TensorBoard run instead of a new version.
    """
    if not ckpt_path or ckpt_path in ("last", "best", "hpc", "registry"):
        return None
    version_dir = Path(ckpt_path).resolve().parent.parent
    if Path(ckpt_path).resolve().parent.name == "checkpoints" and version_dir.parent == run_dir.resolve():
        number = re.fullmatch(r"version_(\d+)", version_dir.name)
        return int(number.group(1)) if number else version_dir.name
    return None


def _our_roots() -> tuple[str, ...]:
    """Source folders of mixlab and mixlab.datamodules (each ending in a path separator)."""
    import mixlab
    import mixlab.datamodules
    return tuple(os.path.join(os.path.realpath(p), "") for p in
                 [*mixlab.__path__, *mixlab.datamodules.__path__])


_WORKER_RERAISE = re.compile(r"Caught \w+ in DataLoader worker process \d+\.\nOriginal Traceback "
                             r"\(most recent call last\):\n(.*)", re.S)


def _worker_error(exc: BaseException, roots: tuple[str, ...]) -> BaseException | None:
    """The original error of a DataLoader worker, when ``exc`` is torch's re-raise of one (the same type, its
    message the worker's formatted traceback) and the worker's error was a ``ValueError`` / ``OSError`` raised in
    mixlab's source: a new exception of that type holding only the worker's own message. Else None."""
    m = _WORKER_RERAISE.match(str(exc))
    if m is None or not isinstance(exc, (ValueError, OSError)):
        return None
    lines = m.group(1).splitlines()
    last = max((i for i, line in enumerate(lines) if line.startswith('  File "')), default=None)
    if last is None:
        return None
    path = re.match(r'  File "([^"]+)"', lines[last]).group(1)
    if not os.path.realpath(path).startswith(roots):
        return None
    text = "\n".join(line for line in lines[last + 1:] if not line.startswith("    ")).strip()
    return type(exc)(re.sub(r"^[\w.]+: ", "", text))


def bad_input_error(exc: BaseException) -> tuple[str | None, BaseException] | None:
    """``(config field or None, error)`` when ``exc`` is, or was raised from, bad input found by mixlab.

    Walks the exception chain (``__cause__``, else ``__context__``), as jsonargparse wraps a
    constructor's error in its Union error ``from`` the original, and returns the first
    ``ValueError`` / ``OSError`` whose ``raise`` statement is in mixlab's source. The field is
    ``model``, ``data`` or ``trainer.callbacks`` from the innermost LightningModule,
    LightningDataModule or Callback method on its traceback. Else an allocation that failed
    (:func:`_memory_error`: one line on how much was asked for). None for anything else (bugs,
    errors of other libraries): those keep their traceback.
    """
    roots, first = _our_roots(), exc
    for exc in _chain(first):
        worker = _worker_error(exc, roots)
        if worker is not None:
            return "data", worker
        frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
        if (isinstance(exc, (ValueError, OSError)) and frames
                and os.path.realpath(frames[-1].f_code.co_filename).startswith(roots)):
            return _owner_field(frames), exc
    return _memory_error(first)


def _owner_field(frames: list[Any]) -> str | None:
    """``model``, ``data`` or ``trainer.callbacks``: the innermost LightningModule / LightningDataModule / Callback
    method among traceback ``frames``; None for none (or mixlab's own best-checkpoint callback); ``data`` for the
    CLI's :class:`ValSplitCheck` (its errors are about the data)."""
    for frame in reversed(frames):
        owner = frame.f_locals.get("self")
        for cls, field in ((pl.LightningModule, "model"), (pl.LightningDataModule, "data"),
                           (BestCheckpoint, None), (ValSplitCheck, "data"), (pl.Callback, "trainer.callbacks")):
            if isinstance(owner, cls):
                return field
    return None


_ALLOC = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes|out of memory", re.I)


def _memory_error(exc: BaseException | None) -> tuple[str | None, BaseException] | None:
    """``(field, MemoryError)`` when ``exc``'s chain holds an allocation that failed (``MemoryError``,
    ``torch.OutOfMemoryError``, the CPU allocator's RuntimeError), e.g. a size in the config far too large; its
    message says how much was asked for and which sizes to lower. Else None."""
    for exc in _chain(exc):
        text = str(exc).strip()
        m = _ALLOC.search(text)
        if isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or (isinstance(exc, RuntimeError) and m):
            frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
            if m and m.group(1):
                asked = f"could not allocate {int(m.group(1)) / 1e9:,.1f} GB on the CPU"
            else:
                asked = (text.splitlines() or [type(exc).__name__])[0].split(". GPU")[0][:200]
            return _owner_field(frames), MemoryError(
                f"out of memory: {asked}; a size in the config (d_model, head_dim, n_modes, n_layers, vocab_size, "
                f"chunk_size, data batch_size or context_length) needs more memory than this machine has")
    return None


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from: ``__cause__``, else ``__context__`` unless suppressed (``raise
    ... from None``), as a traceback prints them; each once."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)


# ---------------------------------------------------------------------- --ckpt_path checks
_CKPT_NAMES = ("last", "best", "hpc", "registry")
"""``--ckpt_path`` names rather than files (mixlab resolves ``last`` and ``best``: :func:`_latest_checkpoint`)."""

_SIZE_KEYS = ("vocab_size", "num_classes")
"""Head hyperparameters that fix the output vocabulary; a checkpoint must agree with the config on them."""


def _pattern_mixers(model: Any) -> set[str] | None:
    """The mixer names of a model config's ``backbone.mixer`` pattern, or None where it has none."""
    from mixlab.backbone import mixer_names

    backbone = _get(_get(model, "init_args"), "backbone")
    pattern = _get(backbone, "mixer")
    try:
        return set(mixer_names(pattern)) if pattern else None
    except (ValueError, TypeError):
        return None


_MODEL_IDENTITY = ("backbone.mixer", "backbone.d_model", "backbone.n_layers", "backbone.n_heads")
"""Model options (dotted, ``init_args.`` left out) whose difference between a config and a ``fit --ckpt_path``
checkpoint makes it another model: refused, where ``validate``/``test`` build the checkpoint's model and warn."""


def _own_checkpoint_file(path: Any) -> bool:
    """True for a ``--ckpt_path`` that mixlab checks before Lightning reads it: a file, or a folder that is
    not a sharded (FSDP) checkpoint, which :func:`read_checkpoint` refuses in one line; not ``best``/``hpc``/...
    """
    if not path or str(path) in _CKPT_NAMES:
        return False
    folder = Path(str(path))
    sharded = folder.is_dir() and ((folder / "meta.pt").is_file() or (folder / ".metadata").is_file())
    return not sharded


def read_checkpoint(path: str) -> dict:
    """The checkpoint dict at ``--ckpt_path path``: :func:`mixlab.eval.common.read_checkpoint`; a missing
    ``path`` that looks like a misspelt ``last`` or ``best`` says so."""
    from mixlab.eval.common import read_checkpoint as read

    try:
        return read(path, "--ckpt_path")
    except FileNotFoundError as err:
        near = closest(str(path), ["last", "best"]) if not Path(str(path)).exists() else None
        if near is None:
            raise
        raise FileNotFoundError(f"{err}; did you mean --ckpt_path {near} (this run's {near} checkpoint)?") from None


def _get(node: Any, key: str) -> Any:
    if node is None:
        return None
    return node.get(key) if hasattr(node, "get") else getattr(node, key, None)


def _import(path: str | None) -> Any:
    try:
        module, _, name = str(path).rpartition(".")
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def _same_class(a: str | None, b: str | None) -> bool:
    """Class paths naming the same class (``mixlab.heads.CausalLM`` = ``mixlab.heads.lm.CausalLM``)."""
    ca, cb = _import(a), _import(b)
    if ca is not None and cb is not None:
        return ca is cb
    return str(a).rpartition(".")[2] == str(b).rpartition(".")[2]


def _describe(head: str | None, data: str | None, data_args: dict, sizes: dict) -> str:
    cls = _import(data)
    task = data_args.get("task") or getattr(cls, "task_name", None)
    task = task if isinstance(task, str) else None
    inner = ", ".join([*([data.rpartition(".")[2]] if data else []), *(f"{k} {v}" for k, v in sizes.items())])
    return (f"{str(head).rpartition('.')[2]}" + (f" on task '{task}'" if task else "")
            + (f" ({inner})" if inner else ""))


def check_checkpoint_config(path: str, checkpoint: dict, config: Any) -> None:
    """Refuse a checkpoint whose head, task or vocabulary differs from the config's.

    Compares the checkpoint's run record (:func:`mixlab.eval.common.run_record_of`: head class,
    datamodule class and arguments; older checkpoints: LightningCLI's ``_class_path`` entries)
    and its ``vocab_size`` / ``num_classes`` hyperparameters with ``config`` (the subcommand's
    parsed config: ``model`` and ``data``). Whatever one side does not record is not compared.

    Raises:
        ValueError: one line naming both sides, e.g. ``--ckpt_path x.ckpt: checkpoint of CausalLM
            on task 'text' (TextDataModule, vocab_size 257) does not match the config's CausalLM
            on task 'genome' (GenomeDataModule, vocab_size 5)``.
    """
    from mixlab.eval.common import run_record_of

    head, data, data_args = run_record_of(checkpoint)
    hparams = checkpoint.get("hyper_parameters") or {}
    model, dm = _get(config, "model"), _get(config, "data")
    cfg_head, cfg_data = _get(model, "class_path"), _get(dm, "class_path")
    cfg_args = _get(dm, "init_args")
    cfg_args = dict(vars(cfg_args)) if hasattr(cfg_args, "__dict__") else dict(cfg_args or {})
    init = _get(model, "init_args")
    sizes = {k: hparams[k] for k in _SIZE_KEYS if hparams.get(k) is not None}
    cfg_sizes = {k: _get(init, k) for k in _SIZE_KEYS if _get(init, k) is not None}
    mismatch = ((head and cfg_head and not _same_class(head, cfg_head))
                or (data and cfg_data and not _same_class(data, cfg_data))
                or ("task" in data_args and "task" in cfg_args and data_args["task"] != cfg_args["task"])
                or any(sizes[k] != cfg_sizes[k] for k in sizes.keys() & cfg_sizes.keys()))
    if mismatch:
        raise ValueError(f"--ckpt_path {path}: checkpoint of {_describe(head, data, data_args, sizes)} does not "
                         f"match the config's {_describe(cfg_head, cfg_data, cfg_args, cfg_sizes)}")


def split_deciders(class_path: str | None) -> tuple[str, ...]:
    """The ``split_arguments`` the datamodule class at ``class_path`` declares (which arguments decide the samples
    of each split: :attr:`mixlab.distributed.ResumableDataModule.split_arguments`); ``()`` for none, or for a class
    that cannot be imported."""
    from mixlab.eval.common import import_class

    if not class_path:
        return ()
    try:
        return tuple(getattr(import_class(class_path), "split_arguments", ()))
    except (ImportError, AttributeError, ValueError):
        return ()


def run_data_arguments(path: str, checkpoint: dict) -> tuple[str | None, dict[str, Any]]:
    """``(datamodule class path or None, its arguments)`` of the run that wrote the checkpoint at ``path``: its run
    record (:func:`mixlab.eval.common.run_record_of`), else, for a checkpoint without one, ``data`` of the run's
    ``config.yaml`` next to it (``<run>/version_N/config.yaml`` for ``<run>/version_N/checkpoints/x.ckpt``);
    ``(None, {})`` when neither says."""
    import yaml

    from mixlab.eval.common import run_record_of

    _, data, recorded = run_record_of(checkpoint)
    if recorded:
        return data, recorded
    config = Path(path).resolve().parent.parent / "config.yaml"
    if Path(path).resolve().parent.name != "checkpoints" or not config.is_file():
        return None, {}
    try:
        tree = yaml.safe_load(config.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None, {}
    node = tree.get("data") if isinstance(tree, dict) else None
    args = node.get("init_args") if isinstance(node, dict) else None
    return (node.get("class_path"), dict(args)) if isinstance(args, dict) else (None, {})


def check_checkpoint_split(path: str, checkpoint: dict, config: Any, subcommand: str, words: list[str]) -> None:
    """Refuse to ``validate`` / ``test`` a checkpoint on a split other than its run's.

    Compares the datamodule's :func:`split_deciders` of the run that wrote the checkpoint
    (:func:`run_data_arguments`) with the config's ``data.init_args`` (options either side does not record are not
    compared): another data seed or split fraction moves samples between the splits, so the evaluated split could
    hold samples the checkpoint was trained on. The standard protocol is the checkpoint's own split. Sizes of
    generated splits (``n_test``), windows and loader options are not compared: they change what is measured, not
    which samples the run trained on.

    Raises:
        ValueError: one line naming each differing option with both values and where this command set it
            (:func:`set_at`; ``the default`` when nothing did), e.g. ``--ckpt_path x.ckpt: the data is split
            otherwise than in the checkpoint's run (data.init_args.seed: 0 in the checkpoint, 1 now, set at
            --data.init_args.seed); its test split could hold samples the checkpoint was trained on: test on the
            checkpoint's own split (give its values)``.
    """
    from mixlab.distributed import LOADER_OPTIONS, changed_data_options

    data = _get(config, "data")
    args = _get(data, "init_args")
    now = args.as_dict() if hasattr(args, "as_dict") else dict(vars(args)) if hasattr(args, "__dict__") else \
        dict(args or {})
    cls, was = run_data_arguments(path, checkpoint)
    if cls and _get(data, "class_path") and not _same_class(cls, _get(data, "class_path")):
        return  # another datamodule: its options mean other things (check_checkpoint_config names a mismatch)
    keys = split_deciders(_get(data, "class_path") or cls)
    changed = changed_data_options({k: v for k, v in was.items() if k in keys},
                                   {k: v for k, v in now.items() if k in keys})
    if not changed:
        other = [line for line in changed_data_options(was, now)
                 if line.split(":")[0].removeprefix("data.init_args.").split(".")[0] not in LOADER_OPTIONS]
        if other:  # a user test: a context_length given to fit and not to validate went unnoticed
            logging.getLogger("mixlab.cli").warning(
                "--ckpt_path %s: %s measures with other data settings than the checkpoint's run (%s); its metrics go "
                "into that run's curves", path, subcommand, "; ".join(other))
        return
    split = "test" if subcommand == "test" else "val"
    shown = [f"{line}, set at {set_at(line.split(':')[0], words) or 'the default'}" for line in changed]
    raise ValueError(f"--ckpt_path {path}: the data is split otherwise than in the checkpoint's run "
                     f"({'; '.join(shown)}); its {split} split could hold samples the checkpoint was trained on: "
                     f"{subcommand} on the checkpoint's own split (give its values)")


def check_state_dict(path: str, checkpoint: dict, model: torch.nn.Module) -> None:
    """Refuse a checkpoint whose weights do not fit ``model`` (names, shapes), before anything is written.

    Loads the weights with ``model.load_state_dict`` (so the modules' own conversions of older
    checkpoints apply; Lightning loads them again when the run starts).

    Raises:
        ValueError: one line naming the first differing tensor and both shapes, or the tensors
            only one side has.
    """
    try:
        model.load_state_dict(dict(checkpoint.get("state_dict") or {}), strict=getattr(model, "strict_loading", True))
    except RuntimeError as err:
        raise ValueError(f"--ckpt_path {path}: the checkpoint does not fit the config's model "
                         f"({state_dict_mismatch(err)}); use the config it was trained with") from None


def state_dict_mismatch(err: RuntimeError) -> str:
    """The first difference ``load_state_dict``'s error lists, in one phrase: the tensor and both shapes, or how
    many tensors only one side has (with one name)."""
    lines = [line.strip() for line in str(err).splitlines()[1:] if line.strip()] or [str(err)]
    lines.sort(key=lambda line: not line.startswith("size mismatch"))  # a shape says most
    size = re.match(r"size mismatch for (\S+): copying a param with shape torch.Size\((\[.*?\])\) from "
                    r"checkpoint, the shape in current model is torch.Size\((\[.*?\])\)", lines[0])
    if size:
        return f"{size.group(1)} has shape {size.group(2)} in the checkpoint but {size.group(3)} in the model"
    keys = re.match(r"(Missing|Unexpected) key\(s\) in state_dict: (.*)", lines[0])
    names = re.findall(r'"([^"]+)"', keys.group(2)) if keys else []
    where = "of the model missing from the checkpoint" if keys and keys.group(1) == "Missing" else \
        "of the checkpoint not in the model"
    return f"{len(names)} tensor(s) {where}, e.g. {names[0]}" if names else lines[0].rstrip(".")


# ---------------------------------------------------------------------- bad config and command-line keys
_NOISE = ("Does not validate against any of the Union subtypes", "Subtypes:", "Errors:", "Given value",
          "Expected a <class 'NoneType'>")


def config_files(words: list[str]) -> list[str]:
    """The ``--config`` / ``-c`` files among command-line ``words``, in order."""
    found = []
    for i, word in enumerate(words):
        if word in ("--config", "-c") and i + 1 < len(words):
            found.append(words[i + 1])
        elif word.startswith("--config="):
            found.append(word.split("=", 1)[1])
    return found


def _plain(key: str) -> str:
    """``data.init_args.context_length`` -> ``data.context_length`` (how keys are compared)."""
    return ".".join(p for p in key.split(".") if p != "init_args")


def _flat_keys(tree: Any, prefix: str = "") -> list[str]:
    if not isinstance(tree, dict):
        return []
    keys = []
    for k, v in tree.items():
        key = f"{prefix}{k}"
        keys += [key, *_flat_keys(v, key + ".")]
    return keys


def _config_trees(words: list[str]) -> Iterator[tuple[str, Any, Exception | None]]:
    """``(path, parsed YAML or None, YAML error or None)`` for each ``--config`` file of ``words`` in order;
    files that cannot be read are left out (their error is the parser's own)."""
    import yaml

    for path in config_files(words):
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError):
            continue
        try:
            yield path, yaml.safe_load(text), None
        except yaml.YAMLError as err:
            yield path, None, err


def _group_not_a_mapping(words: list[str]) -> str | None:
    """``<file>: trainer: holds a list ([1, 2]), not a mapping of options ...`` for the first ``--config`` file whose
    ``trainer`` or ``checkpoint`` is not a mapping, or whose ``model`` / ``data`` is neither a mapping nor a class
    path; else None. jsonargparse accepted a list there and reset the group to its defaults."""
    for path, tree, err in _config_trees(words):
        if err is not None or not isinstance(tree, dict):
            continue
        for key in ("trainer", "checkpoint", "model", "data"):
            value = tree.get(key)
            if value is None or isinstance(value, dict) or (key in ("model", "data") and isinstance(value, str)):
                continue
            return (f"{path}: {key}: holds a {type(value).__name__} ({value!r}), not a mapping of options (e.g. "
                    f"{key}: {{...}})")
    return None


def _where(key: str, words: list[str], value: str | None = None) -> tuple[str | None, str]:
    """``(config file or None, key as the user wrote it)`` for the dotted ``key`` of a parse error.

    The command line wins over the files (it is read last); among the files the last one
    holding the key wins, as jsonargparse merges them. With ``value`` (the error's ``Got value: ...``),
    the source that gives the key that value comes first: jsonargparse checks each ``--config`` file as
    it reads it, so a bad value in a file is refused even when the command line sets the key again.
    None: not found (shown as ``--key``).
    """
    plain = _plain(key)
    found: list[tuple[str | None, str, Any]] = []  # (file or None, key as written, its value), first wins
    for i, word in enumerate(words):
        name, eq, given = word[2:].partition("=")
        if word.startswith("--") and _plain(name) == plain:
            found.append((None, name, given if eq else (words[i + 1] if i + 1 < len(words) else None)))
    for path, tree, _ in reversed(list(_config_trees(words))):
        hit = next((k for k in _flat_keys(tree) if _plain(k) == plain), None)
        if hit is not None:
            leaf = tree
            for part in hit.split("."):
                leaf = leaf[part]
            found.append((path, hit, leaf))
    if value is not None:  # the same text first (a file's 3.0 over the command line's 3), then the same number
        found.sort(key=lambda f: 0 if str(f[2]) == value else 1 if _same_value(f[2], value) else 2)  # stable
    return (found[0][0], found[0][1]) if found else (None, key)


def _same_value(given: Any, shown: str) -> bool:
    """Whether a value as a config file or the command line gives it equals ``shown``, as a parse error prints it:
    the same text, or the same number (``1e3``, which PyYAML reads as a string, is jsonargparse's ``1000.0``)."""
    if str(given) == shown:
        return True
    try:
        return float(str(given)) == float(shown)
    except ValueError:
        return False


def _latest_leaves(words: list[str]) -> dict[str, tuple[str | None, str, Any]]:
    """``{plain key: (config file or None, key as written, value)}`` of the value in effect for every option ``words``
    set (:func:`_set_leaves`, the last setting of a key winning, as jsonargparse applies them)."""
    return {_plain(key): (source, key, value) for source, key, value in _set_leaves(words)}


def _set_leaves(words: list[str]) -> Iterator[tuple[str | None, str, Any]]:
    """``(config file or None, key as written, value)`` of every value ``words`` set, in the order jsonargparse
    applies them (each ``--config`` file's leaves where it stands, command-line options where they stand; a later
    one wins). Command-line values are the strings given (a YAML mapping such as ``--x {a: 1}`` gives its leaves,
    ``x.a``); ``--config`` itself is not a leaf."""
    trees = iter(_config_trees(words))
    for i, word in enumerate(words):
        name, eq, given = word[2:].partition("=")
        if word in ("--config", "-c") or word.startswith("--config="):
            path = word.split("=", 1)[1] if eq else (words[i + 1] if i + 1 < len(words) else None)
            tree = next((t for p, t, _ in trees if p == path), None)
            yield from ((path, key, leaf) for key, leaf in _leaves(tree))
        elif word.startswith("--") and name:
            value = given if eq else (words[i + 1] if i + 1 < len(words) else None)
            tree = _yaml_mapping(value)
            yield from ((None, f"{name}.{key}", leaf) for key, leaf in _leaves(tree)) if tree else [(None, name, value)]


def _yaml_mapping(text: str | None) -> dict | None:
    """A command-line value written as a YAML mapping (``{mesa: {cg_iters: 0}}``), parsed; else None."""
    import yaml

    if not (text or "").lstrip().startswith("{"):
        return None
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError:
        return None
    return tree if isinstance(tree, dict) else None


def _leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` of each non-mapping value of a parsed YAML tree."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)]


def _forms(value: Any) -> set[str]:
    """How an error message may print a config ``value``: ``str``/``repr``, for a command-line string also as
    YAML reads it (``--x 1e-4`` is shown as ``0.0001``), and an integer also as the float a ``float`` option made of
    it (``--data.init_args.val_fraction 0`` is shown as ``0.0``)."""
    import yaml

    forms = {str(value), repr(value)}
    read = value
    if isinstance(value, str):
        with contextlib.suppress(yaml.YAMLError):
            read = yaml.safe_load(value)
            forms |= {str(read), repr(read)}
    if isinstance(read, int) and not isinstance(read, bool):  # a float option shows 0 as 0.0
        forms.add(str(float(read)))
    if isinstance(read, list):  # a tuple option shows [1.0, 0.1] as (1.0, 0.1)
        forms |= {str(tuple(read)), repr(tuple(read))}
    return {f for f in forms if f}


def _names_value(message: str, name: str, value: Any) -> bool:
    """Whether ``message`` refuses option ``name`` set to ``value``: ``name=value``, ``name must ...; got value``
    (``name`` also after its parents: ``optim.lr``),
    ``unknown name value``, Lightning's ``invalid value value for name``, or, for a file path (a string with a
    ``/``), the path itself (``FASTA file not found: data/x.fa``)."""
    key = rf"(?<![\w.])(?:\w+\.)*{re.escape(name)}"  # also dotted: "optim.lr must be > 0; got -1.0"
    for form in _forms(value):
        shown = rf"(?<![\w.\-]){re.escape(form)}(?!\w|\.\w)"
        if re.search(rf"{key}\s*=\s*{shown}|{key}\s+must\b.*?\bgot\s+{shown}|\bunknown\s+{key}\s+{shown}"
                     rf"|\binvalid value\s+{shown}\s+for\s+{key}", message) \
                or (isinstance(value, str) and "/" in value and form == value
                    and re.search(rf"(?<![\w./-]){re.escape(value)}(?![\w./-])", message)):
            return True
    return False


def value_sources(message: str, field: str | None, words: list[str]) -> list[tuple[str | None, str]]:
    """Where the values named in a class's error ``message`` were set: ``(config file or None for the command line,
    key as written)`` for each option under ``field`` (``model``, ``data``, ...; None: any) that ``message`` names
    with the value it was last set to (:func:`_names_value`: ``lambda_floor must be > 0; got -1``). Values left at
    their defaults are not found, nor options the message names itself (``--ckpt_path x: ...``). Used to point a
    constructor's error at the file and key."""
    return [(source, key) for plain, (source, key, value) in _latest_leaves(words).items()
            if (not field or (plain + ".").startswith(_plain(field) + "."))
            and not re.search(rf"(?<![\w.-])(--)?({re.escape(key)}|{re.escape(plain)})(?![\w.])", message)  # named
            and _names_value(message, plain.rsplit(".", 1)[-1], value)]


def null_value_error(err: BaseException, words: list[str]) -> str | None:
    """One line for a null value given to an option that takes none, or None. jsonargparse passes ``null`` (an empty
    YAML value, ``--x null``) through to a class's ``__init__`` for options of model and data classes and of config
    files, where a comparison then raises ``TypeError: '<' not supported between instances of 'NoneType' and 'int'``
    (a user test: ``max_steps:`` left empty in a config, ``--data.init_args.batch_size null``). When ``err``'s chain
    holds such a TypeError, the line names every option whose value in effect is null (:func:`_set_leaves`):
    ``<file>: trainer.max_steps: null is not a value this option takes; give one, or leave the key out for its
    default``."""
    if not any(isinstance(e, TypeError) and "NoneType" in str(e) for e in _chain(err)):
        return None
    nulls = [place for place, annotation in _null_settings(words) if _annotation_takes_none(annotation) is False]
    if not nulls:
        return None
    return (f"{', '.join(nulls)}: null is not a value {'this option takes' if len(nulls) == 1 else 'these take'}; "
            f"give one, or leave the key out for its default")


def _is_null(value: Any, from_file: bool) -> bool:
    """Whether a value set in a config file (YAML's null, an empty key) or on the command line (``null``, ``None``,
    ``~``) is null."""
    return value is None if from_file else str(value).strip().lower() in ("null", "none", "~")


def _class_paths(last: dict[str, tuple[str | None, str, Any]]) -> dict[str, Any]:
    """``{"model": class path, "data": class path}``, those of the two the settings ``last`` (:func:`_latest_leaves`)
    give."""
    return {k.split(".")[0]: v for k, (_, _, v) in last.items() if k in ("model.class_path", "data.class_path")}


def _null_settings(words: list[str]) -> list[tuple[str, Any]]:
    """``(place, annotation)`` of each option whose value in effect on the command line ``words`` is null: where it
    was set (``<file>: <key>`` / ``--<key>``) and its annotation (:func:`_option_annotation`)."""
    last = _latest_leaves(words)
    class_paths = _class_paths(last)
    return [(f"{source}: {written}" if source else f"--{written}", _option_annotation(key, class_paths))
            for key, (source, written, value) in last.items() if _is_null(value, source is not None)]


def _takes_none(key: str, class_paths: dict[str, Any]) -> bool | None:
    """Whether the option ``key`` (plain: ``model.optim.lr``) is annotated to take None (:func:`_option_annotation`);
    None when that cannot be told."""
    return _annotation_takes_none(_option_annotation(key, class_paths))


def _annotation_takes_none(annotation: Any) -> bool | None:
    """Whether an option's ``annotation`` (:func:`_option_annotation`) takes None; None when it is unknown."""
    if annotation is _UNKNOWN:
        return None
    if annotation is Any:
        return True
    return annotation is type(None) or type(None) in typing.get_args(annotation)


_UNKNOWN = object()


def null_groups(words: list[str]) -> list[str]:
    """Where ``words`` set a whole group of options to null (``backbone:`` left empty, ``--model.init_args.optim
    null``): the places (``<file>: <key>`` / ``--<key>``) of null values for options annotated with a dataclass, which
    jsonargparse takes, so that the group's defaults replace it and every value set for it before is dropped."""
    return [place for place, annotation in _null_settings(words) if annotation is not _UNKNOWN
            and any(dataclasses.is_dataclass(a) for a in (typing.get_args(annotation) or (annotation,)))]


def _option_annotation(key: str, class_paths: dict[str, Any]) -> Any:
    """The annotation of option ``key`` (plain: ``model.optim.lr``, ``trainer.max_steps``), from the signatures of
    ``pl.Trainer``, the model and data classes (``class_paths``: ``model``/``data`` -> class path) and the
    dataclasses or classes their arguments are annotated with; ``_UNKNOWN`` when that cannot be told."""

    parts = key.split(".")
    if parts[0] == "trainer":
        owner: Any = pl.Trainer
    elif parts[0] in class_paths and isinstance(class_paths[parts[0]], str):
        try:
            module, _, name = class_paths[parts[0]].rpartition(".")
            owner = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError):
            return _UNKNOWN
    else:
        return _UNKNOWN
    annotation: Any = _UNKNOWN
    for i, name in enumerate(parts[1:]):
        try:
            hints = typing.get_type_hints(owner if dataclasses.is_dataclass(owner) else owner.__init__)
        except Exception:  # an annotation that does not resolve
            return _UNKNOWN
        if name not in hints:
            return _UNKNOWN
        annotation = hints[name]
        if i < len(parts) - 2:  # go into the class the argument is annotated with (Optional[X] -> X)
            inner = [a for a in (typing.get_args(annotation) or (annotation,)) if isinstance(a, type)
                     and a is not type(None)]
            if len(inner) != 1:
                return _UNKNOWN
            owner = inner[0]
    return annotation


def set_at(key: str, words: list[str]) -> str | None:
    """Where the value in effect for the dotted option ``key`` (``trainer.precision``, ``data.class_path``; with or
    without ``init_args``) was set on the command line ``words``: ``<file>: <key as written>`` for a ``--config``
    file, ``--<key as written>`` for the command line; the last source that sets it (:func:`_set_leaves`, as
    jsonargparse applies them). None when nothing sets it (its default). Used to name the place in a one-line
    error about a value that parsed but cannot run (``--trainer.precision 16-mixed`` on the CPU)."""
    hit = _latest_leaves(words).get(_plain(key))
    return None if hit is None else f"{hit[0]}: {hit[1]}" if hit[0] else f"--{hit[1]}"


def place_named_error(message: str, words: list[str]) -> str:
    """A class's error that starts with its own option, dotted (``data.init_args.batch_size must be >= 1; got 0``),
    as ``<file>: <key>: must be ...`` / ``--<key>: must be ...`` where the command line ``words`` set that option;
    ``message`` as it is otherwise (a default value, an option the message only mentions)."""
    lead = re.match(r"((?:data|model|trainer|checkpoint)\.[\w.]+) (?=must )", message)
    place = set_at(lead.group(1), words) if lead else None
    return f"{place}: {message[lead.end():]}" if place else message


def place_value_error(message: str, field: str | None, words: list[str]) -> str:
    """A class's error ``message`` (raised for ``field``) as one line that names where the value was set.

    One option found by :func:`value_sources`: ``<file>: <key>: <message>`` (``--<key>: <message>`` for the command
    line), the message's leading ``part:`` labels that the key already spells dropped. Several:
    ``<field>: <message> (set at <file>: <key>; --<key>)``. None, or a message that starts with its own place
    (``--<key>``, or one of the ``--config`` files of ``words``: :func:`set_at`): ``<field>: <message>``.
    """
    own = re.match(r"--\w", message) or any(message.startswith(f"{path}: ") for path in config_files(words))
    sources = value_sources(message, field, words) if not own else []  # it names its option
    unknown = re.search(r"unknown (?:key|argument)\(s\) ('[^']+'(?:, '[^']+')*)", message)
    if not own and not sources and unknown:  # a misspelt key inside a nested mapping (mixer_args): where it was set
        names = set(re.findall(r"'([^']+)'", unknown.group(1)))
        found: dict[tuple[str | None, str], None] = {}  # (source, key up to the misspelt part), in order
        for source, key, _ in _set_leaves(words):
            parts = key.split(".")
            hit = next((i for i, part in enumerate(parts) if part in names), None)
            if hit is not None and (not field or field in _plain(key).split(".")):
                found[(source, ".".join(parts[:hit + 1]))] = None
        latest = {_plain(key): (source, key) for source, key in found}  # a later setting of the same key wins
        sources = list(latest.values())
    places = [f"{src}: {key}" if src else f"--{key}" for src, key in sources]
    head = f"{field}: " if field else ""
    if len(places) == 1:
        parts = _plain(sources[0][1]).split(".")
        while (m := re.match(r"([\w.]+): ", message)) and any(
                parts[i:i + len(m.group(1).split("."))] == m.group(1).split(".") for i in range(len(parts))):
            message = message[m.end():]
        return f"{places[0]}: {message}"
    return f"{head}{message} (set at {'; '.join(places)})" if places else f"{head}{message}"


def _accepted(class_path: str) -> list[str]:
    """Constructor keywords (dataclass fields) of ``class_path``; [] when it does not import."""
    import dataclasses
    import inspect

    try:
        module, _, name = class_path.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return []
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    try:
        params = inspect.signature(cls.__init__).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _is_dataclass_path(class_path: str) -> bool:
    import dataclasses

    try:
        module, _, name = class_path.rpartition(".")
        return dataclasses.is_dataclass(getattr(importlib.import_module(module), name))
    except (ImportError, AttributeError, ValueError):
        return False


def _parse_leaf(message: str) -> tuple[list[str], str, str | None]:
    """Walk jsonargparse's nested error text: ``(key path, innermost error, class path holding the key)``.

    ``Parser key "x":`` lines add ``x`` to the path, ``Problem with given class_path 'C':`` adds
    ``init_args`` (nothing for a dataclass); the innermost other line (not a Union alternative
    ``Expected a <class 'NoneType'>``) is the error.
    """
    stack: list[tuple[int, str | None, str | None]] = []  # (indent, key segment, class path)
    for raw in message.splitlines():
        line = raw.strip().removeprefix("- ").strip()
        if not line or line.startswith(_NOISE):
            continue
        indent = len(raw) - len(raw.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        inline = re.fullmatch(r'Parser key "([^"]+)": (.+)', line)
        if inline:  # 'Parser key "config": File does not exist: ...' on one line
            stack.append((indent, inline.group(1), None))
            line = inline.group(2)
        key = None if inline else re.fullmatch(r'Parser key "(.+)":', line)
        cls = re.fullmatch(r"Problem with given class_path '(.+)':", line)
        if key:
            stack.append((indent, key.group(1), None))
        elif cls:
            stack.append((indent, None if _is_dataclass_path(cls.group(1)) else "init_args", cls.group(1)))
        else:
            owner = next((c for _, _, c in reversed(stack) if c), None)
            return [s for _, s, _ in stack if s], line, owner
    return [], message.strip().splitlines()[0] if message.strip() else message, None


def _yaml_error(words: list[str]) -> str | None:
    """``<file>: not valid YAML (<problem> at line L, column C)`` for the first ``--config`` file
    that does not parse, else None."""
    for path, _, err in _config_trees(words):
        if err is not None:
            mark = getattr(err, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            return f"{path}: not valid YAML ({getattr(err, 'problem', None) or err}{at})" + _flow_hint(path, mark)
    return None


_QUOTE_HINT = "a value that starts with {{ is a YAML mapping: quote a brace pattern, e.g. {key}: \"{value}\""


def _flow_hint(path: str, mark: Any) -> str:
    """``; a value that starts with { is a YAML mapping: quote ...`` when the line of a YAML error holds an unquoted
    brace pattern followed by more text (``fasta: {a,b}.fa``), else ``""``."""
    try:
        line = Path(path).read_text().splitlines()[mark.line]
    except (OSError, IndexError, AttributeError, UnicodeDecodeError):
        return ""
    found = re.match(r"\s*(?:-\s+)?([\w.]+):\s+(\{[^{}]*,[^{}]*\}[^\s#,]\S*)\s*(?:#.*)?$", line)
    return f"; {_QUOTE_HINT.format(key=found.group(1), value=found.group(2))}" if found else ""


def _not_a_mapping(words: list[str]) -> str | None:
    """``<file>: empty ...`` / ``<file>: holds a <type>, not ...`` for the first ``--config`` file that does
    not hold a mapping of options, else None."""
    for path, tree, err in _config_trees(words):
        if err is None and not isinstance(tree, dict):
            what = "is empty" if tree is None else f"holds a {type(tree).__name__}"
            return f"{path}: the config file {what}, not a mapping of options (e.g. trainer: {{max_steps: 100}})"
    return None


def _empty_section(words: list[str], name: str | None = None) -> str | None:
    """``<file>: <key>: empty (null); ...`` for the first key of a ``--config`` file that is left empty (``model:``,
    ``init_args:``; with ``name``: only keys of that name), which jsonargparse reports as ``Unexpected config:
    model:`` or a ``'NoneType' object has no attribute 'keys'`` of its own; else None."""
    for path, tree, err in _config_trees(words):
        if err is None and isinstance(tree, dict):
            for key, value in _leaves(tree):
                if value is None and (name is None and "." not in key or key.rsplit(".", 1)[-1] == name):
                    if key in ("seed_everything", "ckpt_path", "run_root", "run_name"):
                        return f"{path}: {key}: empty (null); give a value or remove the key"
                    return (f"{path}: {key}: empty (null); give the options under it (e.g. {key}: {{...}}) or "
                            f"remove the key")
    return None


def _precision_values() -> list:
    """Every value Lightning's ``trainer.precision`` takes (a union of literals; jsonargparse's error names the
    first only)."""
    from lightning.fabric.connector import _PRECISION_INPUT

    def flat(t: Any) -> list:
        return [v for a in typing.get_args(t) for v in (flat(a) if typing.get_origin(a) is not None else [a])]

    return list(dict.fromkeys(map(str, flat(_PRECISION_INPUT))))


_TYPE_WORDS = {"int": ["an int"], "float": ["a float"], "bool": ["true", "false"], "str": ["a string"],
               "NoneType": ["null"], "tuple": ["a list such as [a, b]"], "list": ["a list such as [a, b]"],
               "dict": ["a mapping such as {key: value}"]}
"""What a plain type takes, in a parse error (``--trainer.max_epochs: expected an int or null; got abc``)."""


def _expected_types(message: str, leaf: str, value: str | None, key: str = "") -> str | None:
    """``expected an int, a float or null; got abc`` for jsonargparse's error on a value of the wrong plain type
    (``Expected a <class 'int'>. Got value: abc``, or a Union whose ``Subtypes:`` line lists plain types, whose
    first alternative's error jsonargparse names alone), else None. ``key``: the dotted option, for a quoting hint."""
    literal = re.match(r"Expected a typing\.Literal\[(.*)\]", leaf)
    if literal:  # Literal['fold', 'n', 'error']
        try:
            choices = ast.literal_eval(f"[{literal.group(1)}]")
        except (ValueError, SyntaxError):
            return None
        return f"expected one of {', '.join(map(str, choices))}" + (f"; got {value}" if value is not None else "")
    if not leaf.startswith("Expected a <class '"):
        return None
    types = leaf.split(".", 1)[0]
    if "Got value:" not in leaf:  # a Union's first alternative: its types are on the closest Subtypes line above
        above = re.findall(r"^\s*Subtypes: \[(.+)\]\s*$", message[:message.find(leaf)], re.M)
        types = above[-1] if above else types
    names = re.findall(r"<class '([\w.]+)'>", types)
    if not names or any(n not in _TYPE_WORDS for n in names):
        return None
    words = [w for n in dict.fromkeys(names) for w in _TYPE_WORDS[n]]
    if "null" not in words and value is not None and _is_null(value, from_file=False):  # as null_value_error says
        return "null is not a value this option takes; give one, or leave the key out for its default"
    if "a string" in words and re.fullmatch(r"\{.*: None\}", str(value)):  # fasta: {a.fa,b.fa} read as a mapping
        try:
            typed = "{" + ",".join(map(str, ast.literal_eval(str(value)))) + "}"
        except (ValueError, SyntaxError):
            typed = "{a,b}"
        return (f"expected {' or '.join(words)}; got a YAML mapping {value}; "
                + _QUOTE_HINT.format(key=key.rsplit(".", 1)[-1] or "key", value=typed))
    if "a float" in words and str(value).strip().lower().lstrip("+-.") in ("inf", "infinity", "nan"):
        words[words.index("a float")] = "a finite float"  # jsonargparse refuses inf and nan for a float
    return f"expected {' or '.join([', '.join(words[:-1]), words[-1]] if len(words) > 1 else words)}" + (
        f"; got {value}" if value is not None else "")


def parse_error_line(message: str, words: list[str], options: list[str], command: str = "fit") -> str:
    """One line for a jsonargparse parse error ``message`` (what follows ``error:``).

    Names the config file (or the command-line option) and the key, and for an unknown key the
    closest valid one (:func:`difflib.get_close_matches`): ``<file>: unknown key <key>; did you
    mean <key>?``. A value of the wrong type names the value and what the key takes:
    ``--trainer.precision: one of 64, 32, ...; got ''`` (every value Lightning takes),
    ``--seed_everything abc: a seed in [0, 4294967295] (true: a random one, false: no seeding)``.
    ``words``: the command line; ``options``: the parser's dotted option names;
    ``command``: the subcommand (for the ``--help`` hint).
    """
    hint = f"python -m mixlab {command} --help lists the options"
    if message.startswith("Problems parsing config"):
        return _yaml_error(words) or " ".join(line.strip() for line in message.splitlines())
    if message.startswith("Unexpected config"):  # a file that is empty or holds no mapping of options
        return _not_a_mapping(words) or _empty_section(words) or message.strip()
    if "'NoneType' object has no attribute" in message:  # `init_args:` left empty
        found = _empty_section(words, "init_args")
        if found:
            return found
    required = re.fullmatch(r"the following arguments are required: (.+)", message.strip())
    if required and {"data", "model"} & {a.strip().split(".")[-1] for a in required.group(1).split(",")}:
        return (f"{message.strip()}: give a task config, e.g. python -m mixlab {command} --config "
                f"configs/genome/goat.yaml (configs/ holds one per task and mixer)")
    choice = re.fullmatch(r"argument subcommand: invalid choice: '(.+)' \(choose from (.+)\)", message.strip())
    if choice:
        near = closest(choice.group(1), re.findall(r"'([^']+)'", choice.group(2)))
        return message.strip() + (f"; did you mean {near}?" if near else "")
    top = re.fullmatch(r"Subcommand '\w+' does not accept option '(.+)'", message.strip())
    extra = re.fullmatch(r"unrecognized arguments: (.+)", message.strip())
    path, leaf, owner = _parse_leaf(message)
    if top or extra:
        if top:
            key = top.group(1)
        else:
            key = next((w[2:].split("=", 1)[0] for w in extra.group(1).split() if w.startswith("--")),
                       extra.group(1).split()[0])
        suggestion, candidates = closest(key, options), options
    else:
        unknown = re.fullmatch(r"Option '(.+)' is not accepted", leaf)
        if unknown is None:
            key = ".".join(path)
            got = re.search(r"Got value: (.+)$", leaf) or re.search(r"^\s*Given value: ?(.*)$", message, re.M)
            value = got.group(1).strip() if got else None  # a Union's errors name no value: its "Given value" line
            nested = re.fullmatch(r"NestedArg\(key='[^']*', val='(.*)'\)", value or "")
            value = nested.group(1) if nested else value  # a subclass option's value: NestedArg(key='lr', val='')
            where, shown = _where(key, words, value) if key else (None, "")
            typed = [v for src, k, v in _set_leaves(words) if src is None and where is None and _plain(k) == key]
            value = typed[-1] if typed and isinstance(typed[-1], str) else value  # as typed: 1e30, not 1e+30
            shown_value = value or repr(value or "")  # an empty value as ''
            if key == "trainer.precision":  # a union of literals: its first error names one kind (or int) only
                leaf = f"one of {', '.join(_precision_values())}" + (f"; got {shown_value}" if got else "")
            if key == "seed_everything" and got:  # a union of bool and int: "Expected a <class 'bool'>"
                return f"{f'{where}: {shown}' if where else f'--{shown}'} {shown_value}: {SEED_RANGE}"
            leaf = _expected_types(message, leaf, shown_value if got or "Got value:" in leaf else None, key) or leaf
            missing = re.fullmatch(r"module '(.+)' has no attribute '(.+)'", leaf)
            if missing:  # a class_path typo
                try:
                    names = [n for n in dir(importlib.import_module(missing.group(1))) if n[:1].isupper()]
                except ImportError:
                    names = []
                near = closest(missing.group(2), names)
                leaf += f"; did you mean {missing.group(1)}.{near}?" if near else ""
                shown = shown.removesuffix(".init_args") + ".class_path" if shown else shown
            place = f"{where}: {shown}" if where else (f"--{shown}" if shown else "")
            return f"{place}: {leaf}" if place else leaf
        key = ".".join([*path, unknown.group(1)])
        candidates = _accepted(owner) if owner else []
        near = closest(unknown.group(1), candidates)
        suggestion = ".".join([*path, near]) if near else None
    where, shown = _where(key, words)
    if suggestion is not None and not (top or extra):  # in the user's spelling (with or without init_args)
        parts, new = shown.split("."), suggestion.split(".")[-1]
        suggestion = ".".join([*parts[:-1], new]) if parts[-1] == key.split(".")[-1] else suggestion
    if where is None:
        shown, suggestion = f"--{shown}", suggestion and f"--{suggestion}"
        head = f"unknown option {shown}"
    else:
        head = f"{where}: unknown key {shown}"
    if suggestion:
        return f"{head}; did you mean {suggestion}?"
    short = sorted({c.split(".")[-1] for c in candidates}) if not (top or extra) else []
    return f"{head}; valid keys there: {', '.join(short)}" if 0 < len(short) <= 20 else f"{head}; {hint}"


def parser_options(parser: Any) -> list[str]:
    """Dotted option names of a jsonargparse parser (``trainer.max_steps``, ``data``, ...)."""
    skip = ("help", "config", "print_config")
    return [a.dest for a in parser._actions
            if a.dest not in skip and not a.dest.endswith(".help") and a.dest != argparse.SUPPRESS]


# ---------------------------------------------------------------------- library notices
_LITLOGGER_TIP = "💡 Tip: For seamless cloud logging"


class _DropNotice(logging.Filter):
    """Drops log records starting with :data:`_LITLOGGER_TIP`, and Lightning's ``[rank: 0] Received SIGTERM: 15``
    (mixlab's SIGTERM handler says what happens next in its own line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not (msg.startswith(_LITLOGGER_TIP) or "Received SIGTERM: " in msg)


def quiet_library_notices() -> None:
    """Silence the notices mixlab commands printed and no user can act on: Lightning's
    litlogger advert (logged by every ``Trainer`` whose logger is not a LitLogger: mixlab's
    TensorBoard default, or none in the evaluation commands), torch's FutureWarning
    ``isinstance(treespec, LeafSpec) is deprecated`` raised inside Lightning's own CombinedLoader,
    and torch >= 2.14's rename notice for DDP's ``broadcast_buffers`` (the DDP config's option, kept
    under its old name so that older torch versions take it), and Lightning's "Received SIGTERM" next to mixlab's
    own line. Only these messages; idempotent."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                 "lightning.pytorch.trainer.connectors.signal_connector"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropNotice) for f in log.filters):
            log.addFilter(_DropNotice())
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning)
    # configs/trainer/ddp.yaml's `broadcast_buffers: false`: the name every torch >= 2.5 takes; torch 2.14 renamed
    # it `forward_sync_buffers` (same meaning) and warns on every rank
    warnings.filterwarnings("ignore", message=r"`broadcast_buffers` is deprecated")


def _resolve(target: str) -> Callable[[list[str]], Any]:
    module, _, fn = target.partition(":")
    return getattr(importlib.import_module(module), fn)


def _option_before_config(words: list[str]) -> str | None:
    """The first ``--model.init_args.*`` / ``--data.init_args.*`` option on the command line ``words``
    that precedes every ``--config`` (and every ``--model`` / ``--data`` class given on the command line),
    else None. Such an option cannot be placed: the class it belongs to is not known yet, and
    jsonargparse's error then names the config file that follows."""
    for word in words[1:]:
        key = word[2:].split("=", 1)[0] if word.startswith("--") else ""
        if key in ("config", "model", "data", "model.class_path", "data.class_path") or word == "-c":
            return None
        if key.startswith(("model.init_args.", "data.init_args.")):
            return f"--{key}" if config_files(words) else None
    return None


class _StderrHandler(logging.StreamHandler):
    """A stream handler that writes to the ``sys.stderr`` of the moment (as :data:`logging.lastResort`), not the
    one current when it was made: one process may call :func:`main` several times (tests, notebooks) with
    stderr redirected in between."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


_NESTED_FIELD = re.compile(r"--((?:\w+\.)*init_args\.\w+)\.(\w+)")
"""An option one level inside a field of a class's ``init_args`` (``--model.init_args.optim.total_steps``)."""


def nested_nulls(words: list[str]) -> list[str]:
    """The command line ``words`` with each YAML null (``null``, ``Null``, ``NULL``, ``~``) given to an option one
    level inside a field of ``init_args`` (:data:`_NESTED_FIELD`: ``--model.init_args.optim.total_steps null``, also
    ``--key=null``) whose annotation admits None (:func:`_option_annotation`) written as a mapping on that field
    (``--model.init_args.optim {"total_steps": null}``), which jsonargparse merges into the field's other values.
    jsonargparse 4.53 re-reads such an option's value from its text form, where null has become the string
    ``None``, and refuses it (``expected an int or null; got None``). Options at other depths, options that do not
    take null (their parse error says so) and other values pass unchanged."""
    last = _latest_leaves(words)
    class_paths = _class_paths(last)

    def takes_null(key: str) -> bool:
        annotation = _option_annotation(_plain(key), class_paths)
        return annotation is not _UNKNOWN and type(None) in typing.get_args(annotation)

    out, i = [], 0
    while i < len(words):
        key, eq, value = words[i].partition("=")
        field = _NESTED_FIELD.fullmatch(key)
        if field and not eq and i + 1 < len(words):
            value = words[i + 1]
        if field and (eq or i + 1 < len(words)) and value.strip() in ("null", "Null", "NULL", "~") \
                and takes_null(key[2:]):
            out += [f"--{field.group(1)}", f'{{"{field.group(2)}": null}}']
            i += 1 if eq else 2
            continue
        out.append(words[i])
        i += 1
    return out


CUDA_QUEUES = ("CUDA_DEVICE_MAX_CONNECTIONS", "32")
"""The CUDA setting :func:`main` makes unless the environment has one: hardware work queues per GPU (1-32, CUDA's
default 8), read when the process's CUDA context is created (the module docstring says why)."""


def main(argv: list[str] | None = None) -> None:
    """Entry point: an extra subcommand from :data:`COMMANDS`, else LightningCLI."""
    os.environ.setdefault(*CUDA_QUEUES)  # before anything asks CUDA (the user's own value is kept)
    words = list(sys.argv[1:] if argv is None else argv)
    _CTRL_C_STOP.clear()
    _RUN_STARTED.clear()
    quiet_library_notices()
    log = logging.getLogger("mixlab")  # data summaries (records read, regions dropped) at INFO
    if not log.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    if words[:1] in (["-h"], ["--help"]) or not words:
        print("mixlab: python -m mixlab {fit,validate,test} --config configs/<task>/<name>.yaml [...]\n"
              f"extra commands: {', '.join(sorted(COMMANDS))} (python -m mixlab <command> --help)\n"
              "model options: python -m mixlab fit --model.help mixlab.heads.CausalLM\n")
    try:
        load_plugins()  # the user's own mixers and position schemes ($MIXLAB_IMPORT, entry points)
    except ImportError as err:
        if os.environ.get("MIXLAB_TRACEBACK"):
            raise
        print(f"error: {err}\n(MIXLAB_TRACEBACK=1 shows the full traceback)", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        import mixlab

        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is mixlab._interrupted_while_starting:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # from here a Ctrl-C is one line (below)
        with one_line_errors(None if words[:1] and words[0] in COMMANDS else words):
            if words and words[0] in COMMANDS:
                _run_command(words[0], words[1:])
                return
            lightning = list(MixlabCLI.subcommands())  # fit, validate, test
            if words[:1] == ["predict"]:
                print("error: predict is not offered: no mixlab head has a predict step; use test for metrics on the "
                      "test split, or generate to sample from a language model (python -m mixlab generate --help)",
                      file=sys.stderr)
                raise SystemExit(2)
            if words and not words[0].startswith("-") and words[0] not in lightning:
                close = difflib.get_close_matches(words[0], [*lightning, *COMMANDS], n=1)
                print(f"error: unknown command {words[0]!r}" + (f"; did you mean {close[0]}?" if close else "")
                      + f" (commands: {', '.join([*lightning, *sorted(COMMANDS)])})", file=sys.stderr)
                raise SystemExit(2)
            early = _option_before_config(words)
            if early is not None:
                print(f"error: {early} comes before --config, which chooses the model and data classes its "
                      f"options belong to: put --config first (options apply in the order given)", file=sys.stderr)
                raise SystemExit(2)
            with sigterm_handler(SigtermTwice()):  # SIGTERM while the config is read and the classes are built
                nulls = nested_nulls(words)
                with warnings.catch_warnings():  # Lightning's note on args given next to sys.argv: they are sys.argv's
                    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
                    MixlabCLI(args=nulls if nulls != words else argv)  # None: LightningCLI reads sys.argv itself
    except InterruptedMidStep:
        raise SystemExit(128 + signal.SIGINT) from None
    except KeyboardInterrupt:  # outside Lightning's loops (which end a Ctrl-C themselves): reading the config, set-up
        if os.environ.get("MIXLAB_TRACEBACK"):
            raise
        where = ("outside the training and evaluation loops" if _RUN_STARTED.is_set()
                 else "while starting; nothing saved")
        print(f"mixlab: interrupted (Ctrl-C) {where}", file=sys.stderr)
        raise SystemExit(128 + signal.SIGINT) from None
    except (SIGTERMException, TerminatedMidStep):  # a SystemExit without a code (status 0): killed is not finished
        raise SystemExit(128 + (signal.SIGINT if _CTRL_C_STOP.is_set() else signal.SIGTERM)) from None


class CommandTerminated(BaseException):
    """SIGTERM during an extra command (:data:`COMMANDS`), raised by its signal handler so that the command's
    ``undo_on_failure`` puts its outputs back, as for Ctrl-C; a BaseException, as KeyboardInterrupt."""


def _terminated(signum: int, frame: Any) -> None:
    raise CommandTerminated()


def _run_command(name: str, args: list[str]) -> None:
    """Run the extra command ``name``. Ctrl-C and SIGTERM end it in one line (``mixlab <name>: interrupted
    (Ctrl-C)`` / ``terminated (SIGTERM)``) with exit status 130 / 143, after the command has put back the outputs
    it had begun (with ``MIXLAB_TRACEBACK=1``: the traceback)."""
    try:
        with sigterm_handler(_terminated):
            _resolve(COMMANDS[name])(args)
    except (KeyboardInterrupt, CommandTerminated) as err:
        if os.environ.get("MIXLAB_TRACEBACK"):
            raise
        term = isinstance(err, CommandTerminated)
        print(f"mixlab {name}: {'terminated (SIGTERM)' if term else 'interrupted (Ctrl-C)'}", file=sys.stderr)
        raise SystemExit(128 + (signal.SIGTERM if term else signal.SIGINT)) from None


@contextlib.contextmanager
def one_line_errors(words: list[str] | None = None) -> Iterator[None]:
    """Bad input inside (what :func:`bad_input_error` recognises: a config value a class refuses, a missing file)
    leaves as one ``error: <field>: <cause>`` line on stderr and ``SystemExit(2)``; anything else, or any error with
    ``MIXLAB_TRACEBACK=1``, propagates with its traceback. With the command line ``words``, the line names the
    config file (or command-line option) and key that set the refused value (:func:`place_value_error`). Used by
    :func:`main` and by ``scripts/bench_input.py``'s up-front check of extra CLI arguments (the classes built, the
    subcommand not run)."""
    try:
        yield
    except SIGTERMException:
        raise
    except Exception as err:
        null = None if os.environ.get("MIXLAB_TRACEBACK") or words is None else null_value_error(err, words)
        if null is not None:
            print(f"error: {null}\n(MIXLAB_TRACEBACK=1 shows the full traceback)", file=sys.stderr)
            raise SystemExit(2) from None
        found = None if os.environ.get("MIXLAB_TRACEBACK") else bad_input_error(err)
        if found is None:
            raise
        field, cause = found
        named = re.match(r"(trainer|model|data|checkpoint)\.", str(cause))  # the message names its option itself
        line = place_named_error(str(cause), words or []) if named else \
            place_value_error(str(cause), field, words or [])
        print(f"error: {line}\n(MIXLAB_TRACEBACK=1 shows the full traceback)", file=sys.stderr)
        raise SystemExit(2) from None


register_command("length-extrapolation", "mixlab.eval.length:main")
register_command("passkey", "mixlab.eval.retrieval:passkey_main")
register_command("niah", "mixlab.eval.retrieval:niah_main")
register_command("resolution", "mixlab.eval.resolution:main")
register_command("compare", "mixlab.eval.compare:main")
register_command("figure", "mixlab.eval.figures:main")
register_command("copy-prior", "mixlab.eval.figures:copy_prior")  # alias of "figure goat-prior"
register_command("reproduce", "mixlab.eval.reproduce:main")
register_command("generate", "mixlab.eval.generate:main")
register_command("mixers", "mixlab.mixers:main")
