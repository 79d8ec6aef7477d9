"""Resuming equals the uninterrupted run, whatever the checkpoint (``mixlab.heads.common.Head`` checkpoints):

* a run stopped at ``max_steps`` inside an epoch or at its end, extended with a larger ``max_steps``
  from its ``last.ckpt`` (written at ``on_train_epoch_end`` / ``on_train_end``), trains on the
  uninterrupted run's remaining batches, in the same epochs, with the same losses;
* with gradient accumulation, validations (where checkpoints are written) fall on optimizer steps
  or the run is refused in one line;
* ``validate`` / ``test`` from a checkpoint log at the checkpoint's training step, not at step 0;
* a ``fit --ckpt_path`` with nothing left to train (``max_steps`` / ``max_epochs`` reached) prints one line and
  leaves the run folder as it was; one whose data settings changed names the options that differ.
"""

from __future__ import annotations

import random
import shutil
import warnings
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from mixlab.backbone import BackboneConfig
from mixlab.callbacks import LastCheckpoint
from mixlab.datamodules.genome import GenomeDataModule
from mixlab.distributed import ResumableDataModule
from mixlab.heads.common import Head
from mixlab.heads.lm import CausalLM
from mixlab.optim import OptimConfig


class _Index(ResumableDataModule):
    """12 training samples whose value is their index, batches of 2 (6 per epoch); 4 val samples."""

    def __init__(self, workers: int = 0):
        super().__init__()
        self.workers = workers

    def train_dataloader(self):
        return self.resumable_loader(torch.arange(12), 2, train=True, seed=1, num_workers=self.workers)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(torch.arange(4), batch_size=2)


class _Rec(Head):
    """Records ``(epoch, sample indices)`` of every training batch and the step of every validation."""

    def __init__(self):
        super().__init__()
        self.w, self.seen, self.vals = torch.nn.Parameter(torch.zeros(())), [], []

    def training_step(self, batch, i):
        self.seen.append((self.current_epoch, batch.tolist()))
        return (self.w * batch.float()).sum()

    def _eval_step(self, batch, stage):
        pass

    def _eval_epoch_end(self, stage):
        self.vals.append(self.global_step)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp: Path, mode: str, max_steps: int, ckpt: str | None = None, workers: int = 0, acc: int = 1) -> _Rec:
    """``fit`` with mixlab's LastCheckpoint in ``tmp``. ``mode``: ``"iter"`` (the CLI configs: validation
    every 4 x acc training batches across epochs) or ``"noval"`` (no validation: last.ckpt written at
    every epoch end and at the end of training)."""
    kw = dict(val_check_interval=4 * acc, check_val_every_n_epoch=None, limit_val_batches=1) if mode == "iter" \
        else dict(limit_val_batches=0, max_epochs=-1)
    model = _Rec()
    pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, callbacks=[LastCheckpoint(dirpath=tmp)],
               enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
               accumulate_grad_batches=acc, **kw).fit(model, _Index(workers), ckpt_path=ckpt)
    return model


@pytest.mark.parametrize("mode,stop,workers,acc", [("iter", 5, 0, 1), ("iter", 6, 0, 1), ("iter", 9, 2, 1),
                                                   ("noval", 4, 0, 1), ("noval", 6, 0, 1), ("iter", 4, 0, 2)])
def test_extending_a_run_stopped_at_max_steps_continues_its_epoch(tmp_path, mode, stop, workers, acc):
    """Stop at ``max_steps=stop`` (6 batches per epoch: 5 and 9 inside an epoch, 6 at its end), resume
    ``last.ckpt`` with ``max_steps=14``: the batches, their epochs and the validations equal the
    uninterrupted 14-step run's. Lightning used to count the stopped epoch as done, so the resumed run
    took the next epoch's order for the rest of it (and at an epoch end without validation trained one
    batch too many)."""
    full = _fit(tmp_path / "full", mode, 14, workers=workers, acc=acc)
    assert len(full.seen) == 14 * acc and {e for e, _ in full.seen} == {0, 1, 2} | ({3, 4} if acc > 1 else set())
    first = _fit(tmp_path / "run", mode, stop, workers=workers, acc=acc)
    rest = _fit(tmp_path / "run", mode, 14, ckpt=str(tmp_path / "run" / "last.ckpt"), workers=workers, acc=acc)
    assert first.seen + rest.seen == full.seen
    assert first.vals + rest.vals == full.vals


class _Draws(_Rec):
    """Each training step draws from torch's, NumPy's and Python's global generators (as Mixup / CutMix, dropout
    and stochastic depth do) and records the draws."""

    def __init__(self):
        super().__init__()
        self.draws = []

    def training_step(self, batch, i):
        d = (float(torch.rand(())), float(np.random.rand()), random.random())
        self.draws.append(d)
        return (self.w * batch.float()).sum() * d[0]


@pytest.mark.parametrize("mode,stop,workers", [("iter", 5, 0), ("iter", 9, 2), ("noval", 6, 0)])
def test_a_resumed_run_draws_the_random_numbers_of_the_uninterrupted_run(tmp_path, mode, stop, workers):
    """The checkpoint holds the global random-number states and the first batch of the resumed fit restores
    them: its steps draw what the uninterrupted run's steps drew (torch, NumPy, Python), across validations and
    DataLoader workers (whose iterators draw a seed from torch's generator after the checkpoint is loaded).
    Before, a resumed ViT's Mixup / CutMix and stochastic depth drew other numbers than the uninterrupted run."""
    kw = dict(val_check_interval=4, check_val_every_n_epoch=None, limit_val_batches=1) if mode == "iter" \
        else dict(limit_val_batches=0, max_epochs=-1)

    def fit(folder, max_steps, ckpt=None):
        model = _Draws()
        pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, callbacks=[LastCheckpoint(dirpath=folder)],
                   enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                   **kw).fit(model, _Index(workers), ckpt_path=ckpt)
        return model.draws

    pl.seed_everything(3)
    full = fit(tmp_path / "full", 14)
    pl.seed_everything(3)
    first = fit(tmp_path / "run", stop)
    pl.seed_everything(3)  # a new process: its generators start where the first run's did, not at step `stop`
    rest = fit(tmp_path / "run", 14, str(tmp_path / "run" / "last.ckpt"))
    assert len(full) == 14 and first + rest == full
    state = torch.load(tmp_path / "run" / "last.ckpt", weights_only=True)["mixlab_rng"]
    assert set(state) == {"torch", "numpy", "python"}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_a_resumed_vit_with_mixup_and_stochastic_depth_has_the_uninterrupted_losses(tmp_path, device):
    """The user's case: ViT with Mixup / CutMix (NumPy draws) and stochastic depth (torch draws; on CUDA the CUDA
    generator, bf16-mixed) on the embedded digits, stopped at step 5 (inside the first epoch) and extended to 12
    from ``last.ckpt``: the losses from step 5 on equal the uninterrupted run's bit for bit (an H100: equal).
    Before, the resumed run mixed and dropped differently."""
    from mixlab.datamodules.digits import DigitsDataModule
    from mixlab.heads.vit import ImageClassifier

    def fit(folder, max_steps, ckpt=None):
        pl.seed_everything(0)
        model = ImageClassifier(num_classes=10, img_size=16, patch_size=4, label_smoothing=0.1,
                                mixup=dict(mixup_alpha=0.8, cutmix_alpha=1.0, prob=1.0, switch_prob=0.5,
                                           mode="batch"),
                                backbone=BackboneConfig(d_model=16, n_layers=2, n_heads=2, mixer="rope",
                                                        causal=False, drop_path=0.5),
                                optim=OptimConfig(lr=3e-3, warmup_steps=2, total_steps=12))
        rec = _Losses()
        gpu = dict(accelerator="gpu", devices=1, precision="bf16-mixed") if device == "cuda" else dict(
            accelerator="cpu")
        pl.Trainer(max_steps=max_steps, **gpu, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                   callbacks=[LastCheckpoint(dirpath=folder), rec]).fit(
            model, DigitsDataModule(image_size=16, batch_size=16, augment=False), ckpt_path=ckpt)
        return rec.losses

    full = fit(tmp_path / "full", 12)
    first = fit(tmp_path / "run", 5)
    rest = fit(tmp_path / "run", 12, str(tmp_path / "run" / "last.ckpt"))
    assert len(full) == 12 and first + rest == full


def _lm_data(tmp_path: Path) -> GenomeDataModule:
    g = torch.Generator().manual_seed(0)
    seq = "".join("ACGT"[int(i)] for i in torch.randint(0, 4, (1200,), generator=g))
    fasta = tmp_path / "t.fa"
    if not fasta.exists():
        fasta.write_text(">t\n" + seq + "\n")
    # 5 training batches per epoch
    return GenomeDataModule(fasta=str(fasta), context_length=16, batch_size=4, region_size=400, val_fraction=0.2,
                            test_fraction=0.2, train_stride=20)


class _Losses(pl.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def _lm_fit(tmp_path: Path, ckdir: Path, max_steps: int, ckpt: str | None = None, **kw) -> list[float]:
    pl.seed_everything(0)
    model = CausalLM(vocab_size=5, backbone=BackboneConfig(d_model=16, n_layers=1, n_heads=2, mixer="rope"),
                     optim=OptimConfig(lr=3e-3, warmup_steps=2, total_steps=12))  # one schedule for every max_steps
    rec = _Losses()
    args = dict(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                callbacks=[LastCheckpoint(dirpath=ckdir), rec])
    args.update(kw)
    trainer = pl.Trainer(**args)
    trainer.fit(model, _lm_data(tmp_path), ckpt_path=ckpt)
    return rec.losses


def test_extended_lm_run_has_the_uninterrupted_losses(tmp_path):
    """The issue's case on a real head and datamodule: stop at step 7 of 5-batch epochs, extend to 12 from
    ``last.ckpt``: the training losses from step 7 on equal the uninterrupted run's, bit for bit."""
    dm = _lm_data(tmp_path)
    dm.setup("fit")
    assert len(dm.train_dataloader()) == 5
    full = _lm_fit(tmp_path, tmp_path / "full", 12)
    first = _lm_fit(tmp_path, tmp_path / "run", 7)
    rest = _lm_fit(tmp_path, tmp_path / "run", 12, ckpt=str(tmp_path / "run" / "last.ckpt"))
    assert len(full) == 12 and first + rest == full


def test_resume_with_gradient_accumulation_from_a_validation_checkpoint(tmp_path):
    """``accumulate_grad_batches=2``, validation every 4 training batches (2 optimizer steps): the
    checkpoint written at the validation after batch 4 lands on an optimizer step, and the run resumed
    from it has the uninterrupted losses."""
    kw = dict(accumulate_grad_batches=2, val_check_interval=4, check_val_every_n_epoch=None, limit_val_batches=1,
              limit_train_batches=4)
    full = _lm_fit(tmp_path, tmp_path / "full", 6, **kw)
    _lm_fit(tmp_path, tmp_path / "run", 2, **kw)  # stops at step 2 = batch 4, just validated
    shutil.copy(tmp_path / "run" / "last.ckpt", tmp_path / "at4.ckpt")
    assert torch.load(tmp_path / "at4.ckpt", weights_only=False)["global_step"] == 2
    rest = _lm_fit(tmp_path, tmp_path / "run2", 6, ckpt=str(tmp_path / "at4.ckpt"), **kw)
    assert len(full) == 12 and rest == full[4:]


@pytest.mark.parametrize("kw,first", [
    (dict(val_check_interval=3, check_val_every_n_epoch=None, limit_train_batches=4), 3),
    (dict(val_check_interval=3, check_val_every_n_epoch=1), 3),
    (dict(val_check_interval=4, check_val_every_n_epoch=None), 8),  # 4 is even, but 5-batch epochs restart cycles
])
def test_validation_inside_an_accumulation_cycle_is_refused_in_one_line(tmp_path, kw, first):
    """Checkpoints written inside a cycle lost its half-summed gradient and the resumed run diverged."""
    with pytest.raises(ValueError) as info:
        _lm_fit(tmp_path, tmp_path / "run", 4, accumulate_grad_batches=2, limit_val_batches=1, **kw)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"trainer.val_check_interval={kw['val_check_interval']} counts training batches, not "
                          f"optimizer steps: with accumulate_grad_batches=2 validation and its checkpoints would "
                          f"fall inside a gradient-accumulation cycle (first after training batch {first})")
    assert msg.endswith("give val_check_interval a multiple of 2" if first != 8 else
                        "give val_check_interval a multiple of 5 or set trainer.limit_train_batches to a multiple of 2")


def test_a_schedule_whose_first_bad_validation_lies_beyond_max_steps_trains(tmp_path):
    """A user test: ``accumulate_grad_batches 3 --val_check_interval 99 --max_steps 4`` was refused for a validation
    after training batch 13563, a run of 12 batches never gets there. Here 5-batch epochs, interval 4, k=2: the first
    bad validation is after batch 8, beyond 3 steps (batches 2, 4 and the epoch's last, 5): it trains."""
    losses = _lm_fit(tmp_path, tmp_path / "run", 3, accumulate_grad_batches=2, val_check_interval=4,
                     check_val_every_n_epoch=None, limit_val_batches=1)
    assert len(losses) == 5


class _Steps(pl.loggers.Logger):
    """A logger that records ``(step, tags)`` of every ``log_metrics`` call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    name, version = "steps", 0

    def log_metrics(self, metrics, step=None):
        self.calls.append((step, sorted(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def test_validate_and_test_from_a_checkpoint_log_at_its_training_step(tmp_path):
    """``validate``/``test --ckpt_path``: the metrics land at the checkpoint's step (7), not at step 0 of
    the training run's curve."""
    _lm_fit(tmp_path, tmp_path / "run", 7)
    model = CausalLM(vocab_size=5, backbone=BackboneConfig(d_model=16, n_layers=1, n_heads=2, mixer="rope"))
    for fn, tag in (("validate", "val/loss"), ("test", "test/loss")):
        logger = _Steps()
        trainer = pl.Trainer(accelerator="cpu", logger=logger, enable_progress_bar=False, limit_val_batches=1,
                             limit_test_batches=1, enable_model_summary=False)
        getattr(trainer, fn)(model, _lm_data(tmp_path), ckpt_path=str(tmp_path / "run" / "last.ckpt"), verbose=False)
        assert [step for step, tags in logger.calls if tag in tags] == [7], (fn, logger.calls)


@pytest.mark.parametrize("val_every", [5, 4])
def test_a_resumed_run_logs_at_the_steps_of_the_uninterrupted_run(tmp_path, val_every):
    """Stopped at step 10 and extended to 20 through the CLI, the run's TensorBoard curves hold one point per
    step 0..19 (train) and the validations at the uninterrupted run's steps. The stop's ``last.ckpt`` is
    written by the validation at step 10 (``val_every`` 5: the resumed run logged every step one too early
    and overwrote step 9, a user test) or at the end of training (4)."""
    from mixlab.cli import MixlabCLI
    from mixlab.eval.compare import load_scalars

    root = Path(__file__).resolve().parents[1]
    argv = ["--config", str(root / "configs/synthetic/parity.yaml"), "--run_root", str(tmp_path),
            "--trainer.val_check_interval", str(val_every), "--trainer.log_every_n_steps", "1",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--trainer.limit_val_batches", "1", "--trainer.num_sanity_val_steps", "0",
            "--model.init_args.backbone.d_model", "32", "--model.init_args.backbone.n_layers", "1",
            "--data.init_args.num_workers", "0", "--data.init_args.n_train", "2560", "--data.init_args.batch_size", "8"]
    MixlabCLI(args=["fit", *argv, "--trainer.max_steps", "10"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        MixlabCLI(args=["fit", *argv, "--trainer.max_steps", "20", "--ckpt_path", "last"])
    said = [str(w.message) for w in caught]  # the run's own checkpoint folder is not news on a resume
    assert not [m for m in said if "Checkpoint directory" in m], said
    scalars = load_scalars(next(tmp_path.glob("*/*/version_0")))
    assert [s for _, s, _ in scalars["train/loss"]] == list(range(20))
    assert [s for _, s, _ in scalars["val/loss"]] == list(range(val_every - 1, 20, val_every))


# ---------------------------------------------------------------------- resumes that cannot train on
def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# a tiny configs/synthetic/parity.yaml run through the CLI (add the subcommand, --run_root and the limits)
_TINY_PARITY = ["--config", str(Path(__file__).resolve().parents[1] / "configs/synthetic/parity.yaml"),
                "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
                "--trainer.limit_val_batches", "1", "--trainer.num_sanity_val_steps", "0",
                "--model.init_args.backbone.d_model", "32", "--model.init_args.backbone.n_layers", "1",
                "--data.init_args.num_workers", "0", "--data.init_args.n_train", "256",
                "--data.init_args.batch_size", "8"]


@pytest.mark.parametrize("limit,first,more", [
    ("max_steps", ["--trainer.max_steps", "4"], ["--trainer.max_steps", "6"]),
    ("max_epochs", ["--trainer.max_steps", "-1", "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "3"],
     ["--trainer.max_steps", "-1", "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "3"]),
])
def test_a_resume_with_nothing_left_to_train_says_so_and_writes_nothing(tmp_path, capsys, monkeypatch, limit, first,
                                                                        more):
    """``fit --ckpt_path last`` after the run reached ``trainer.max_steps`` (or ``max_epochs``): one line naming the
    limit and the checkpoint's step, exit status 0 (``main`` returns), the run folder byte for byte as it was (a
    user test found a ``config_resume_1.yaml`` there). A larger limit still resumes and trains."""
    import sys

    from mixlab import cli

    argv = ["fit", *_TINY_PARITY, "--run_root", str(tmp_path), "--trainer.val_check_interval", "2"]
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    cli.main([*argv, *first])
    run = next(tmp_path.glob("parity/*/version_0"))
    ckpt = run / "checkpoints" / "last.ckpt"
    before = _files(tmp_path)
    capsys.readouterr()
    cli.main([*argv, *first, "--ckpt_path", "last"])  # returns: exit status 0
    out = capsys.readouterr().out.strip().splitlines()
    if limit == "max_steps":
        line = (f"fit: nothing to train: the checkpoint {ckpt} is at step 4 and trainer.max_steps is 4; raise "
                f"trainer.max_steps to train on (nothing written)")
    else:
        line = (f"fit: nothing to train: the checkpoint {ckpt} (step 3) has finished 1 epoch(s) and "
                f"trainer.max_epochs is 1; raise trainer.max_epochs to train on (nothing written)")
    assert out == [line]
    assert _files(tmp_path) == before
    cli.main([*argv, *more, "--ckpt_path", "last"])
    assert (run / "config_resume_1.yaml").is_file()
    assert torch.load(ckpt, weights_only=False)["global_step"] == 6


def test_nothing_to_train_counts_finished_epochs(tmp_path):
    """Stopped inside the second 5-batch epoch (step 7) the run has one finished epoch, at step 10 two (the
    checkpoint written at the end of the last batch, :func:`mixlab.distributed.as_batch_end_checkpoint`);
    ``max_steps`` is compared with the checkpoint's ``global_step``; -1 means no limit."""
    from types import SimpleNamespace

    from mixlab.cli import nothing_to_train

    _lm_fit(tmp_path, tmp_path / "mid", 7)
    _lm_fit(tmp_path, tmp_path / "end", 10)
    mid, end = (torch.load(tmp_path / d / "last.ckpt", weights_only=False) for d in ("mid", "end"))
    limits = lambda steps, epochs: SimpleNamespace(max_steps=steps, max_epochs=epochs)  # noqa: E731
    assert nothing_to_train("m.ckpt", mid, limits(-1, 2)) is None
    assert nothing_to_train("m.ckpt", mid, limits(-1, 1)).startswith(
        "fit: nothing to train: the checkpoint m.ckpt (step 7) has finished 1 epoch(s) and trainer.max_epochs is 1")
    assert nothing_to_train("e.ckpt", end, limits(-1, 2)).startswith(
        "fit: nothing to train: the checkpoint e.ckpt (step 10) has finished 2 epoch(s) and trainer.max_epochs is 2")
    assert nothing_to_train("e.ckpt", end, limits(-1, 3)) is None
    assert nothing_to_train("e.ckpt", end, limits(-1, -1)) is None
    assert nothing_to_train("m.ckpt", mid, limits(7, -1)) == (
        "fit: nothing to train: the checkpoint m.ckpt is at step 7 and trainer.max_steps is 7; raise "
        "trainer.max_steps to train on (nothing written)")
    assert nothing_to_train("m.ckpt", mid, limits(8, -1)) is None


# ---------------------------------------------------------------------- resumes whose data settings changed
class _Sized(ResumableDataModule):
    """``n`` training samples (their index), batches of 2; records its arguments as every mixlab datamodule."""

    def __init__(self, n: int = 12, seed: int = 1, num_workers: int = 0, extra: dict | None = None):
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self):
        return self.resumable_loader(torch.arange(self.hparams.n), 2, train=True, seed=self.hparams.seed,
                                     num_workers=self.hparams.num_workers)


class _Unrecorded(_Index):
    """:class:`_Index` with ``n`` samples and no recorded arguments (no ``save_hyperparameters``)."""

    def __init__(self, n: int = 12):
        super().__init__()
        self.n = n

    def train_dataloader(self):
        return self.resumable_loader(torch.arange(self.n), 2, train=True, seed=1)


def _fit_data(ckdir: Path, data: pl.LightningDataModule, max_steps: int, ckpt: str | None = None) -> None:
    pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, callbacks=[LastCheckpoint(dirpath=ckdir)],
               enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
               max_epochs=-1).fit(_Rec(), data, ckpt_path=ckpt)


@pytest.mark.parametrize("now,line", [
    (dict(n=10), "data.init_args.n: 12 in the checkpoint, 10 now; the checkpoint's dataset has 12 items, this one 10"),
    # a loader option that changed too is not named: it does not change the dataset
    (dict(n=10, num_workers=1, extra={"a": 1, "b": "x"}),
     "data.init_args.n: 12 in the checkpoint, 10 now; data.init_args.extra.b: 'y' in the checkpoint, 'x' now; "
     "the checkpoint's dataset has 12 items, this one 10"),
    (dict(seed=2), f"data.init_args.seed: 1 in the checkpoint, 2 now; the checkpoint's sample-order seed is "
                   f"{ResumableDataModule.order_seed(1)}, this one {ResumableDataModule.order_seed(2)}"),
])
def test_a_resume_with_other_data_settings_names_the_options(tmp_path, now, line):
    """The checkpoint records the datamodule's arguments (``checkpoint["mixlab"]["data_args"]``); a resume whose
    training set (or sample order) no longer fits the checkpoint's names each option that differs, both values,
    and the item counts (or seeds), in one line (a user test got only the counts)."""
    _fit_data(tmp_path, _Sized(extra={"a": 1, "b": "y"}), 3)
    with pytest.raises(ValueError) as info:
        _fit_data(tmp_path, _Sized(**{"extra": {"a": 1, "b": "y"}, **now}), 6, ckpt=str(tmp_path / "last.ckpt"))
    assert str(info.value) == f"{line}: the data settings changed since the checkpoint"


def test_a_resume_with_other_data_settings_and_nothing_recorded_keeps_the_sampler_message(tmp_path):
    """Without recorded datamodule arguments nothing can be named: the sampler's own message, as before."""
    _fit_data(tmp_path, _Unrecorded(12), 3)
    with pytest.raises(ValueError) as info:
        _fit_data(tmp_path, _Unrecorded(10), 6, ckpt=str(tmp_path / "last.ckpt"))
    assert str(info.value) == ("ResumableSampler.load_state_dict: the checkpoint's dataset has 12 items, this one 10; "
                               "the data settings changed since the checkpoint")


def test_changed_data_options():
    from mixlab.distributed import changed_data_options

    assert changed_data_options(None, {"n": 1}) == [] and changed_data_options({"n": 1}, {"n": 1}) == []
    assert changed_data_options({"n": 1, "_class_path": "a", "old": 3}, {"n": 2, "_class_path": "b", "new": 4}) == [
        "data.init_args.n: 1 in the checkpoint, 2 now"]  # only options both sides set
    assert changed_data_options({"sizes": (1, 2), "batch_size": 4}, {"sizes": [1, 2], "batch_size": 8}) == [
        "data.init_args.batch_size: 4 in the checkpoint, 8 now"]  # a loader option when nothing else differs
    assert changed_data_options({"fasta": "a.fa", "k": {"x": None}}, {"fasta": "b.fa", "k": {"x": 1}}) == [
        "data.init_args.fasta: 'a.fa' in the checkpoint, 'b.fa' now",
        "data.init_args.k.x: None in the checkpoint, 1 now"]


def test_the_progress_bar_of_a_resume_inside_an_epoch_counts_on_from_the_checkpoint(tmp_path, capsys):
    """Lightning skips ``on_train_epoch_start`` on a resume inside an epoch, so the bar read ``Training: 15/?`` with
    a rate counted from batch 0 (a user test). mixlab's bar now reads ``Epoch 0`` and ends at ``15/15``."""
    from mixlab.cli import MixlabCLI

    root = Path(__file__).resolve().parents[1]
    argv = ["--config", str(root / "configs/synthetic/parity.yaml"), "--run_root", str(tmp_path),
            "--trainer.val_check_interval", "5", "--trainer.limit_val_batches", "1", "--trainer.num_sanity_val_steps",
            "0", "--trainer.enable_model_summary", "false", "--trainer.max_epochs", "-1",
            "--model.init_args.backbone.d_model", "32", "--model.init_args.backbone.n_layers", "1",
            "--data.init_args.num_workers", "0", "--data.init_args.n_train", "2560", "--data.init_args.batch_size", "8"]
    MixlabCLI(args=["fit", *argv, "--trainer.max_steps", "10"])
    capsys.readouterr()
    MixlabCLI(args=["fit", *argv, "--trainer.max_steps", "15", "--ckpt_path", "last"])
    bars = [b for b in capsys.readouterr().out.replace("\r", "\n").splitlines() if b.startswith(("Epoch", "Training"))]
    counting = [b for b in bars if not b.startswith("Training: |          | 0/?")]  # the bar drawn before step 1
    assert counting and all(b.startswith("Epoch 0: ") for b in counting), bars[:4]
    assert "10/15 " in counting[0] and "15/15 " in counting[-1], (counting[0], counting[-1])


# ---------------------------------------------------------------------- interrupts
@pytest.mark.parametrize("where,how", [("train", "raise"), ("train", "ctrl_c"), ("val", "raise"), ("val", "ctrl_c"),
                                       ("last_val", "raise"), ("last_val", "ctrl_c")])
def test_an_interrupted_run_resumes_with_the_uninterrupted_schedule_and_metrics(tmp_path, monkeypatch, where, how):
    """A user test: Ctrl-C at step 35 of a genome run, resumed, validated at steps 38 and 58 instead of 39 and 59 (and
    an interrupt inside a validation reran it on part of its batches, with another val/loss, and logged every later
    step one too late). Interrupted inside a training step (a KeyboardInterrupt raised there, or a real Ctrl-C,
    which now stops at the end of the step) or inside the validation at step 10 (at its second batch), then resumed
    to step 20: train/loss at steps 0..19 once each, and val/loss at the uninterrupted run's steps with its values."""
    import os
    import signal

    from mixlab.cli import MixlabCLI
    from mixlab.eval.compare import load_scalars
    from mixlab.heads.synthetic import SyntheticLM

    root = Path(__file__).resolve().parents[1]
    argv = ["--config", str(root / "configs/synthetic/parity.yaml"), "--run_root", str(tmp_path),
            "--trainer.val_check_interval", "5", "--trainer.log_every_n_steps", "1", "--trainer.max_steps", "20",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--trainer.limit_val_batches", "2", "--trainer.num_sanity_val_steps", "0",
            "--model.init_args.backbone.d_model", "32", "--model.init_args.backbone.n_layers", "1",
            "--data.init_args.num_workers", "0", "--data.init_args.n_train", "2560", "--data.init_args.batch_size", "8"]
    MixlabCLI(args=["fit", *argv, "--run_name", "ref"])
    train_step, eval_step, calls = SyntheticLM.training_step, SyntheticLM._eval_step, []

    def stop():
        if how == "raise":
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGINT)  # mixlab's handler: stop at the end of the running step

    def training_step(self, batch, batch_idx):
        if where == "train" and self.global_step == 7:
            stop()
        return train_step(self, batch, batch_idx)

    def _eval_step(self, batch, stage):
        calls.append(self.global_step)
        if where != "train" and calls.count(10 if where == "val" else 20) == 2:
            stop()
        return eval_step(self, batch, stage)

    monkeypatch.setattr(SyntheticLM, "training_step", training_step)
    monkeypatch.setattr(SyntheticLM, "_eval_step", _eval_step)
    if (where, how) == ("last_val", "ctrl_c"):  # the last validation finishes, and so does the run (status 0)
        MixlabCLI(args=["fit", *argv, "--run_name", "cut"])
    else:
        with pytest.raises(SystemExit):
            MixlabCLI(args=["fit", *argv, "--run_name", "cut"])
    monkeypatch.setattr(SyntheticLM, "training_step", train_step)
    monkeypatch.setattr(SyntheticLM, "_eval_step", eval_step)
    ckpt = torch.load(tmp_path / "parity/cut/version_0/checkpoints/last.ckpt", weights_only=False)
    # inside the last validation, a hard stop saves nothing: last.ckpt stays at the validation before (step 15), as
    # a resume from a checkpoint at step 20 would have nothing to train and never run that validation
    assert ckpt["global_step"] == {"train": {"raise": 7, "ctrl_c": 8}, "val": {"raise": 10, "ctrl_c": 10},
                                   "last_val": {"raise": 15, "ctrl_c": 20}}[where][how]
    if ckpt["global_step"] < 20:
        MixlabCLI(args=["fit", *argv, "--run_name", "cut", "--ckpt_path", "last"])
    ref, cut = (load_scalars(tmp_path / "parity" / name / "version_0") for name in ("ref", "cut"))
    if (where, how) == ("last_val", "raise"):  # steps 15-19 trained (and logged) again, as after a crash
        newest = {step: point for point in cut["train/loss"] for step in [point[1]]}  # sorted by wall time
        assert len(cut["train/loss"]) == 25
        cut["train/loss"] = [newest[step] for step in sorted(newest)]
    assert [s for _, s, _ in cut["train/loss"]] == list(range(20))
    assert [s for _, s, _ in cut["val/loss"]] == [s for _, s, _ in ref["val/loss"]] == [4, 9, 14, 19]
    torch.testing.assert_close([v for *_, v in cut["val/loss"]], [v for *_, v in ref["val/loss"]], rtol=1e-6,
                               atol=1e-6)
    torch.testing.assert_close([v for *_, v in cut["train/loss"]], [v for *_, v in ref["train/loss"]], rtol=1e-6,
                               atol=1e-6)


def test_a_run_without_a_logger_keeps_its_folder_and_resumes(tmp_path, monkeypatch):
    """``--trainer.logger false`` (a user's smoke test): it crashed at the first step with Lightning's
    LearningRateMonitor traceback ("Cannot use `LearningRateMonitor` callback with `Trainer` that has no logger")
    after writing ``config.yaml`` into the working directory. Now it trains, logs no metrics (no event file), keeps
    ``config.yaml`` and ``last.ckpt`` in the run folder, where ``--ckpt_path last`` resumes it and ``test`` reads it,
    and writes nothing into the working directory."""
    import sys

    from mixlab import cli

    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    argv = [*_TINY_PARITY, "--run_root", str(tmp_path / "runs"), "--trainer.logger", "false"]
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    cli.main(["fit", *argv, "--trainer.max_steps", "3"])
    run = next((tmp_path / "runs").glob("parity/*/version_0"))
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 3
    cli.main(["fit", *argv, "--trainer.max_steps", "5", "--ckpt_path", "last"])
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 5
    cli.main(["test", *argv, "--ckpt_path", "last", "--trainer.limit_test_batches", "1"])
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.yaml", "config_resume_1.yaml",
                                                    "config_test.yaml"]
    assert list(work.iterdir()) == []
    assert not list((tmp_path / "runs").rglob("events.out.tfevents.*"))


@pytest.mark.parametrize("mode,stops", [("iter", (6, 12, 16)), ("iter", (5, 9, 14)), ("noval", (6, 12, 16)),
                                        ("noval", (4, 9, 16)), ("iter", (3, 8, 13, 16))])
def test_a_run_resumed_again_after_crossing_an_epoch_continues_its_epoch(tmp_path, mode, stops):
    """Resumed twice or more, each resumed run crossing an epoch boundary (6 batches per epoch): the batches, their
    epochs and the validations equal the uninterrupted run's. A user test found the second resume a whole epoch
    behind: after a resume Lightning no longer counts the epochs it starts (``epoch_progress.started`` stays at the
    restored value), and the checkpoint's epoch was taken from that count, so every checkpoint of the resumed run
    said epoch 0 and the next resume replayed the epoch."""
    full = _fit(tmp_path / "full", mode, stops[-1])
    seen, vals = [], []
    ckpt = None
    for stop in stops:
        part = _fit(tmp_path / "run", mode, stop, ckpt=ckpt)
        seen, vals, ckpt = seen + part.seen, vals + part.vals, str(tmp_path / "run" / "last.ckpt")
        assert torch.load(ckpt, weights_only=False)["epoch"] == (stop - 1) // 6
    assert seen == full.seen
    assert vals == full.vals


def test_max_epochs_resumes_count_the_epochs(tmp_path):
    """``max_epochs`` 1, then ``fit --ckpt_path`` with ``max_epochs`` 2 twice, then 3: the first resume trains epoch 1,
    the second has nothing to train (the resumed checkpoint said epoch 0 and trained one more epoch on every call),
    the third trains epoch 2; the batches are the uninterrupted 3-epoch run's."""
    from types import SimpleNamespace

    from mixlab.cli import nothing_to_train

    def fit(max_epochs, ckpt=None):
        model = _Rec()
        trainer = pl.Trainer(max_epochs=max_epochs, accelerator="cpu", logger=False, enable_progress_bar=False,
                             callbacks=[LastCheckpoint(dirpath=tmp_path / "run")], enable_model_summary=False,
                             num_sanity_val_steps=0, limit_val_batches=1, check_val_every_n_epoch=1)
        trainer.fit(model, _Index(), ckpt_path=ckpt)
        return model

    full = _Rec()
    pl.Trainer(max_epochs=3, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
               num_sanity_val_steps=0, limit_val_batches=1, check_val_every_n_epoch=1,
               enable_checkpointing=False).fit(full, _Index())
    last = str(tmp_path / "run" / "last.ckpt")
    seen = fit(1).seen + fit(2, last).seen
    state = torch.load(last, weights_only=False)
    assert (state["epoch"], state["global_step"]) == (1, 12)
    assert nothing_to_train(last, state, SimpleNamespace(max_epochs=2, max_steps=-1)) is not None
    seen += fit(3, last).seen
    assert seen == full.seen and len(seen) == 18


def test_nothing_to_train_under_fast_dev_run_names_it():
    """``fit --trainer.fast_dev_run true --ckpt_path last`` (a user's smoke test of a resume): Lightning's
    fast_dev_run sets ``max_steps`` 1, and the line named ``trainer.max_steps is 1``, which the user never set."""
    from types import SimpleNamespace

    from mixlab.cli import nothing_to_train

    ckpt = {"global_step": 4}
    line = nothing_to_train("x.ckpt", ckpt, SimpleNamespace(max_steps=1, max_epochs=-1, fast_dev_run=1))
    assert line == ("fit: nothing to train: trainer.fast_dev_run stops Lightning at step 1 and the checkpoint x.ckpt "
                    "is at step 4; to try a resume, give --trainer.max_steps 5 instead (nothing written)")
    assert nothing_to_train("x.ckpt", ckpt, SimpleNamespace(max_steps=4, max_epochs=-1, fast_dev_run=False)) == (
        "fit: nothing to train: the checkpoint x.ckpt is at step 4 and trainer.max_steps is 4; raise "
        "trainer.max_steps to train on (nothing written)")


def test_nothing_to_train_when_max_time_is_spent():
    """``fit --ckpt_path last`` with the ``trainer.max_time`` its run already used (a user test): Lightning said
    "Time limit reached" but wrote a ``config_resume_1.yaml`` and an empty event file first. Now the line says so
    and nothing is written; time left, or no max_time, trains."""
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import Timer

    from mixlab.cli import nothing_to_train

    ckpt = {"global_step": 7, "callbacks": {"Timer": {"time_elapsed": {"train": 2.4, "validate": 0.3}}}}
    spent = SimpleNamespace(max_steps=100, max_epochs=-1, callbacks=[Timer(duration="00:00:00:02")])
    assert nothing_to_train("x.ckpt", ckpt, spent) == (
        "fit: nothing to train: the checkpoint x.ckpt (step 7) has trained for 2 s and trainer.max_time is 0:00:02; "
        "raise trainer.max_time to train on (nothing written)")
    left = SimpleNamespace(max_steps=100, max_epochs=-1, callbacks=[Timer(duration="00:00:00:03")])
    assert nothing_to_train("x.ckpt", ckpt, left) is None
    assert nothing_to_train("x.ckpt", ckpt, SimpleNamespace(max_steps=100, max_epochs=-1, callbacks=[])) is None
