"""Bad input a user test found through ``python -m mixlab fit|validate|test``: one line naming where the value was
set (config file + key, or ``--option``), exit status 2, no traceback, nothing written under ``--run_root``.

* ``validate`` / ``test`` (and ``fit`` with validation) on a datamodule without that split (random images);
* ``trainer.val_check_interval`` above an epoch's batches, a float above 1, a fraction with
  ``check_val_every_n_epoch: null``;
* ``fit`` on an empty validation split (refused unless ``--trainer.limit_val_batches 0``);
* ``validate`` / ``test`` of a checkpoint with other split options (data seed, fractions) than its run's;
* ``--trainer.precision 16-mixed`` on the CPU (Lightning ran bf16-mixed instead);
* ``--seed_everything`` overflow or not a number, ``--trainer.precision ''``.

In-process calls of :func:`mixlab.cli.main`, as ``tests/test_cli_errors.py`` and ``tests/test_cli_input.py``.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from mixlab import cli

ROOT = Path(__file__).resolve().parents[1]
GENOME = str(ROOT / "configs" / "genome" / "goat.yaml")
DIGITS = str(ROOT / "configs" / "vit" / "goat_digits.yaml")
RANDOM = str(ROOT / "configs" / "data" / "random_images.yaml")
QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
TINY_LM = ["--model.init_args.backbone.d_model=32", "--model.init_args.backbone.n_layers=1",
           "--model.init_args.backbone.mixer_args={goat: {position_args: {n_modes: 1}}}",
           "--data.init_args.context_length=32", "--trainer.limit_val_batches=1", *QUIET]
TINY_VIT = ["--model.init_args.backbone.n_layers=1", *QUIET]
HINT = "(MIXLAB_TRACEBACK=1 shows the full traceback)"


def _fail(capsys, monkeypatch, *argv: str) -> list[str]:
    """Run ``python -m mixlab *argv`` in-process; return the stderr lines after exit status 2 (no traceback, none
    of Lightning's warnings about the same input)."""
    monkeypatch.setattr(sys, "argv", ["mixlab"])  # pytest's own argv is not ours
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli.main(list(argv))
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert not any("Traceback" in line or "across ranks is zero" in line or "You passed `Trainer(" in line
                   for line in err), err
    return err


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


# ---------------------------------------------------------------------- 1. a datamodule without the split
def test_a_datamodule_without_the_split_is_one_line_naming_its_config(capsys, monkeypatch, tmp_path):
    """``validate`` / ``test`` with ``configs/data/random_images.yaml`` (a training-speed overlay: no val or test
    dataloader) was Lightning's MisconfigurationException traceback; ``fit`` trained without validation after one
    warning. The line names the file that chose the datamodule; ``limit_val_batches 0`` is the way to fit."""
    runs = tmp_path / "runs"
    argv = ["--config", DIGITS, "--config", RANDOM, *TINY_VIT, "--data.init_args.num_classes=10",
            "--data.init_args.image_size=24", "--data.init_args.batch_size=8", "--run_root", str(runs)]
    for command, split in (("validate", "val"), ("test", "test")):
        err = _fail(capsys, monkeypatch, command, *argv)
        assert err[-2:] == [f"error: {RANDOM}: data.class_path: RandomImageDataModule has no {split} split (no "
                            f"{split}_dataloader): {command} would measure nothing; use a data config with a {split} "
                            f"split (e.g. the task config's own data)", HINT]
    err = _fail(capsys, monkeypatch, "fit", *argv, "--trainer.max_steps=1")
    assert err[-2:] == [f"error: {RANDOM}: data.class_path: RandomImageDataModule has no val split (no "
                        f"val_dataloader): fit would train without validation (no val metrics, no best checkpoint); "
                        f"pass --trainer.limit_val_batches 0 to train without validation", HINT]
    assert _files(runs) == []


# ---------------------------------------------------------------------- 2. val_check_interval
def test_val_check_interval_above_an_epoch_names_the_option_value_and_batches(capsys, monkeypatch, tmp_path):
    """Lightning's ValueError traceback after the model was built. The digits train split: 1797 images less
    round(0.15 * 1797) = 270 val and 270 test = 1257, in 39 full batches of 32 (the last partial one dropped)."""
    runs = tmp_path / "runs"
    argv = ["fit", "--config", DIGITS, *TINY_VIT, "--trainer.max_steps=2", "--run_root", str(runs)]
    err = _fail(capsys, monkeypatch, *argv, "--trainer.val_check_interval", "1000")
    assert err[-2:] == ["error: --trainer.val_check_interval: 1000 is more training batches than one epoch has (39); "
                        "give at most 39 (or a fraction of an epoch in (0, 1]), or set "
                        "trainer.check_val_every_n_epoch to null to count 1000 batches across epochs", HINT]
    config = tmp_path / "every.yaml"
    config.write_text("trainer:\n  val_check_interval: 50\n  limit_train_batches: 5\n")
    err = _fail(capsys, monkeypatch, *argv, "--config", str(config))
    assert err[-2:] == [f"error: {config}: trainer.val_check_interval: 50 is more training batches than one epoch "
                        f"has (5, after trainer.limit_train_batches=5); give at most 5 (or a fraction of an epoch in "
                        f"(0, 1]), or set trainer.check_val_every_n_epoch to null to count 50 batches across epochs",
                        HINT]
    assert _files(runs) == []


def test_a_float_val_check_interval_names_the_source_that_set_it(capsys, monkeypatch, tmp_path):
    """``val_check_interval 1.5`` on the genome config blamed ``configs/genome/goat.yaml:
    trainer.check_val_every_n_epoch`` (the file's ``null`` that Lightning's message mentions), whichever source
    set 1.5; on the digits config it named no source. A fraction with ``check_val_every_n_epoch: null`` names
    both places."""
    runs = tmp_path / "runs"
    second = tmp_path / "interval.yaml"
    second.write_text("trainer:\n  val_check_interval: 1.5\n")
    fraction = ("1.5 is not a fraction of an epoch in (0, 1]; give such a fraction (a float) or a number of "
                "training batches (an int >= 1)")
    for argv, place in (
            (["--config", GENOME, "--trainer.val_check_interval", "1.5"], "--trainer.val_check_interval"),
            (["--config", GENOME, "--config", str(second)], f"{second}: trainer.val_check_interval"),
            (["--config", DIGITS, "--trainer.val_check_interval=1.5"], "--trainer.val_check_interval"),
            # the command line first, the file last: the file's value is the one in effect
            (["--config", GENOME, "--trainer.val_check_interval", "0.5", "--config", str(second)],
             f"{second}: trainer.val_check_interval")):
        err = _fail(capsys, monkeypatch, "fit", *argv, "--run_root", str(runs))
        assert err[-2:] == [f"error: {place}: {fraction}", HINT]
    err = _fail(capsys, monkeypatch, "fit", "--config", GENOME, "--trainer.val_check_interval", "0.5",
                "--run_root", str(runs))
    assert err[-2:] == [f"error: --trainer.val_check_interval: 0.5 is a fraction of an epoch, but "
                        f"trainer.check_val_every_n_epoch is null (set at {GENOME}: trainer.check_val_every_n_epoch), "
                        f"which counts training batches across epochs: give a number of training batches (an int "
                        f">= 1), or set check_val_every_n_epoch (e.g. 1)", HINT]
    assert _files(runs) == []


# ---------------------------------------------------------------------- 3. an empty validation split
def test_fit_on_an_empty_val_split_is_refused_unless_validation_is_off(capsys, monkeypatch, tmp_path):
    """``fit`` with ``val_fraction 0`` (genome) or one that rounds to no image (digits) trained after Lightning's
    "Total length of DataLoader across ranks is zero" warning: no val metrics, no best checkpoint. Now one line
    naming the data argument and where it was set; ``--trainer.limit_val_batches 0`` trains without validation.
    validate / test on an empty split name their argument the same way."""
    runs = tmp_path / "runs"
    tail = ("fit would train without validation (no val metrics, no best checkpoint); give the val split data, or "
            "pass --trainer.limit_val_batches 0 to train without validation")
    genome = ["--config", GENOME, *TINY_LM, "--trainer.max_steps=1", "--run_root", str(runs)]
    err = _fail(capsys, monkeypatch, "fit", *genome, "--data.init_args.val_fraction", "0")
    assert err[-2:] == [f"error: --data.init_args.val_fraction: the val split is empty (val_fraction=0.0): {tail}",
                        HINT]
    split = tmp_path / "split.yaml"
    split.write_text("data:\n  init_args:\n    val_fraction: 0.0001\n")
    err = _fail(capsys, monkeypatch, "fit", "--config", DIGITS, "--config", str(split), *TINY_VIT,
                "--trainer.max_steps=1", "--run_root", str(runs))
    assert err[-2:] == [f"error: {split}: data.init_args.val_fraction: the val split is empty (val_fraction=0.0001): "
                        f"{tail}", HINT]
    err = _fail(capsys, monkeypatch, "test", "--config", DIGITS, *TINY_VIT, "--data.init_args.test_fraction=0",
                "--run_root", str(runs))
    assert err[-2:] == ["error: --data.init_args.test_fraction: the test split is empty (test_fraction=0.0); test "
                        "measured nothing (give the test split data)", HINT]
    assert _files(runs) == []
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    cli.main(["fit", *genome, "--data.init_args.val_fraction", "0", "--trainer.limit_val_batches", "0"])
    assert (runs / "genome" / "goat" / "version_0" / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.parametrize(("config", "argument", "task"), [("text/goat.yaml", "val_fraction", "text"),
                                                          ("synthetic/parity.yaml", "n_val", "parity")])
def test_text_and_synthetic_val_splits_may_be_empty_when_validation_is_off(capsys, monkeypatch, tmp_path, config,
                                                                          argument, task):
    """A user test: text ``val_fraction 0`` and synthetic ``n_val 0`` were refused by the datamodule even with
    ``--trainer.limit_val_batches 0`` (genome's and digits' were not). Now all follow one rule: refused by fit's
    validation check, trained without validation when it is off."""
    runs = tmp_path / "runs"
    args = ["--config", str(ROOT / "configs" / config), "--model.init_args.backbone.d_model=32",
            "--model.init_args.backbone.n_layers=1", "--trainer.max_steps=2", "--run_root", str(runs), *QUIET,
            f"--data.init_args.{argument}=0"]
    err = _fail(capsys, monkeypatch, "fit", *args)
    value = "0.0" if argument == "val_fraction" else "0"
    assert err[-2] == (f"error: --data.init_args.{argument}: the val split is empty ({argument}={value}): fit would "
                       "train without validation "
                       "(no val metrics, no best checkpoint); give the val split data, or pass "
                       "--trainer.limit_val_batches 0 to train without validation")
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    cli.main(["fit", *args, "--trainer.limit_val_batches", "0"])
    assert (runs / task / "goat" / "version_0" / "checkpoints" / "last.ckpt").is_file()
    if task == "text":  # its test split is its val split: the message names val_fraction
        err = _fail(capsys, monkeypatch, "test", *args, "--ckpt_path", "last")
        assert err[-2] == ("error: --data.init_args.val_fraction: the test split is empty (val_fraction=0.0); test "
                           "measured nothing (give the test split data)")


def test_split_arguments_and_values_printed_as_floats():
    class Data:
        hparams = {"val_fraction": 0.0, "test_fraction": 0.1, "n_val": 0, "n_test_automata": 4, "max_val_windows": 3,
                   "max_test_windows": None,
                   "max_n_fraction": 0.5, "seed": 0, "val_path": None}

    assert cli.split_arguments(Data(), "val") == {"val_fraction": 0.0, "n_val": 0, "max_val_windows": 3}
    assert cli.split_arguments(Data(), "test") == {"test_fraction": 0.1, "n_test_automata": 4}
    assert cli.split_arguments(None, "val") == {}
    # a float option prints the 0 given on the command line as 0.0: still found where it was set
    assert cli.place_value_error("the val split is empty (val_fraction=0.0)", "data",
                                 ["--data.init_args.val_fraction", "0"]) == \
        "--data.init_args.val_fraction: the val split is empty (val_fraction=0.0)"


# ---------------------------------------------------------------------- 4. a checkpoint's own split
@pytest.fixture(scope="module")
def genome_run(tmp_path_factory) -> Path:
    """A tiny genome LM's run folder (one training step) with the config's split (data seed 0, fractions 0.05)."""
    root = tmp_path_factory.mktemp("runs")
    saved = sys.argv
    sys.argv = ["mixlab"]
    try:
        cli.main(["fit", "--config", GENOME, *TINY_LM, "--trainer.max_steps=1", "--run_root", str(root)])
    finally:
        sys.argv = saved
    return root / "genome" / "goat" / "version_0"


def test_evaluating_a_checkpoint_on_another_split_is_refused(capsys, monkeypatch, tmp_path, genome_run):
    """``test`` with another data seed (or ``validate`` with other fractions) than the checkpoint's run drew
    its split from other regions, some of them trained on, without a word. Refused before anything is written,
    naming each option with both values and where this command set it; the run's own split runs."""
    runs = tmp_path / "runs"
    shutil.copytree(genome_run, runs / "genome" / "goat" / "version_0")
    run = runs / "genome" / "goat" / "version_0"
    ckpt = run / "checkpoints" / "last.ckpt"
    before = [(p, p.stat().st_size) for p in sorted(run.rglob("*"))]
    argv = ["--config", GENOME, *TINY_LM, "--ckpt_path", str(ckpt), "--run_root", str(runs)]
    err = _fail(capsys, monkeypatch, "test", *argv, "--data.init_args.seed", "1")
    assert err[-2:] == [f"error: --ckpt_path {ckpt}: the data is split otherwise than in the checkpoint's run "
                        f"(data.init_args.seed: 0 in the checkpoint, 1 now, set at --data.init_args.seed); its test "
                        f"split could hold samples the checkpoint was trained on: test on the checkpoint's own split "
                        f"(give its values)", HINT]
    fractions = tmp_path / "fractions.yaml"
    fractions.write_text("data:\n  init_args:\n    val_fraction: 0.1\n    test_fraction: 0.2\n")
    err = _fail(capsys, monkeypatch, "validate", *argv, "--config", str(fractions))
    assert err[-2:] == [f"error: --ckpt_path {ckpt}: the data is split otherwise than in the checkpoint's run "
                        f"(data.init_args.val_fraction: 0.05 in the checkpoint, 0.1 now, set at {fractions}: "
                        f"data.init_args.val_fraction; data.init_args.test_fraction: 0.05 in the checkpoint, 0.2 now, "
                        f"set at {fractions}: data.init_args.test_fraction); its val split could hold samples the "
                        f"checkpoint was trained on: validate on the checkpoint's own split (give its values)", HINT]
    assert [(p, p.stat().st_size) for p in sorted(run.rglob("*"))] == before  # nothing written
    # a checkpoint without a run record: the run's config.yaml next to it says which split it trained on
    bare = torch.load(ckpt, weights_only=False)
    bare.pop("mixlab", None)
    bare.pop("datamodule_hyper_parameters", None)
    torch.save(bare, ckpt)
    data, args = cli.run_data_arguments(str(ckpt), bare)
    assert data == "mixlab.datamodules.genome.GenomeDataModule" and args["val_fraction"] == 0.05
    err = _fail(capsys, monkeypatch, "test", *argv, "--data.init_args.seed=1")
    assert err[-2].startswith(f"error: --ckpt_path {ckpt}: the data is split otherwise than in the checkpoint's run "
                              f"(data.init_args.seed: 0 in the checkpoint, 1 now, set at --data.init_args.seed)")
    # the run's own split: the test runs
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    cli.main(["test", *argv, "--trainer.limit_test_batches=1"])
    assert (run / "config_test.yaml").is_file()


# ---------------------------------------------------------------------- 5. 16-mixed on the CPU
def test_float16_mixed_precision_on_the_cpu_is_refused(capsys, monkeypatch, tmp_path):
    """Lightning ran ``16-mixed`` on the CPU as ``bf16-mixed`` after one warning line (a user test thought it had
    measured float16)."""
    runs = tmp_path / "runs"
    line = ("{place}: {value} (float16 mixed precision) needs CUDA; on the CPU Lightning would run bf16-mixed "
            "instead: use bf16-mixed or 32-true on the CPU")
    base = ["fit", "--config", GENOME, *TINY_LM, "--trainer.max_steps=1", "--trainer.accelerator=cpu",
            "--run_root", str(runs)]
    for value in ("16-mixed", "16"):
        err = _fail(capsys, monkeypatch, *base, "--trainer.precision", value)
        assert err[-2:] == ["error: " + line.format(place="--trainer.precision", value=value), HINT]
    config = tmp_path / "half.yaml"
    config.write_text("trainer:\n  precision: 16-mixed\n")
    err = _fail(capsys, monkeypatch, *base, "--config", str(config))
    assert err[-2:] == ["error: " + line.format(place=f"{config}: trainer.precision", value="16-mixed"), HINT]
    assert _files(runs) == []
    assert cli._runs_on_cpu("cpu") and not cli._runs_on_cpu("gpu")
    assert cli._runs_on_cpu("auto") == (not torch.cuda.is_available() and not torch.backends.mps.is_available())


# ---------------------------------------------------------------------- 6. seed and precision values
def test_seed_and_precision_values_name_the_value_and_what_is_accepted(capsys, monkeypatch, tmp_path):
    """``--seed_everything abc`` read ``error: --seed_everything: Expected a <class 'bool'>``, an overflowing seed
    in a config file was blamed on ``--seed_everything``, and ``--trainer.precision ''`` read ``Expected a <class
    'int'>``: each one line naming the place, the value and what is accepted."""
    runs = tmp_path / "runs"
    base = ["fit", "--config", GENOME, *TINY_LM, "--trainer.max_steps=1", "--run_root", str(runs)]
    seeds = "a seed in [0, 4294967295] (true: a random one, false: no seeding)"
    for value in ("abc", "1e30", "1.5", ""):
        err = _fail(capsys, monkeypatch, *base, f"--seed_everything={value}")
        assert err == [f"error: --seed_everything {value or repr('')}: {seeds}"]
    err = _fail(capsys, monkeypatch, *base, "--seed_everything", str(2**64))
    assert err[-2:] == [f"error: --seed_everything {2**64}: {seeds}", HINT]
    config = tmp_path / "seed.yaml"
    config.write_text(f"seed_everything: {2**64}\n")
    err = _fail(capsys, monkeypatch, *base, "--config", str(config))
    assert err[-2:] == [f"error: {config}: seed_everything {2**64}: {seeds}", HINT]
    config.write_text("seed_everything: abc\n")
    err = _fail(capsys, monkeypatch, *base, "--config", str(config))
    assert err == [f"error: {config}: seed_everything abc: {seeds}"]
    every = ("64, 32, 16, transformer-engine, transformer-engine-float16, 16-true, 16-mixed, bf16-true, bf16-mixed, "
             "32-true, 64-true, bf16")
    for argv in (["--trainer.precision", ""], ["--trainer.precision="]):
        err = _fail(capsys, monkeypatch, *base, *argv)
        assert err == [f"error: --trainer.precision: one of {every}; got ''"]
    config.write_text("trainer:\n  precision: ''\n")
    err = _fail(capsys, monkeypatch, *base, "--config", str(config))
    assert err == [f"error: {config}: trainer.precision: one of {every}; got ''"]
    err = _fail(capsys, monkeypatch, *base, "--trainer.precision", "fp16")
    assert err == [f"error: --trainer.precision: one of {every}; got fp16"]
    assert _files(runs) == []


def test_set_at_names_the_source_in_effect():
    """The last source that sets a key wins, as jsonargparse applies them; ``init_args`` written or not."""
    words = ["fit", "--config", "a.yaml", "--trainer.precision", "32", "--config", "b.yaml"]
    trees = {"a.yaml": {"trainer": {"precision": "bf16-mixed"}},
             "b.yaml": {"data": {"init_args": {"seed": 3}}, "trainer": {"max_steps": 2}}}
    original = cli._config_trees
    try:
        cli._config_trees = lambda w: iter((p, trees[p], None) for p in cli.config_files(w))
        assert cli.set_at("trainer.precision", words) == "--trainer.precision"
        assert cli.set_at("trainer.max_steps", words) == "b.yaml: trainer.max_steps"
        assert cli.set_at("data.seed", words) == "b.yaml: data.init_args.seed"
        assert cli.set_at("trainer.precision", words[:4] + ["--config", "a.yaml"]) == "a.yaml: trainer.precision"
        assert cli.set_at("seed_everything", words) is None
    finally:
        cli._config_trees = original
    # a message that starts with its own config file is not placed again
    assert cli.place_value_error("a.yaml: trainer.precision: x=1", None, ["--config", "a.yaml", "--x=1"]) == \
        "a.yaml: trainer.precision: x=1"


def test_each_datamodule_declares_the_arguments_that_decide_its_splits():
    """``check_checkpoint_split`` compares only what the datamodule class declares (``split_arguments``): ImageNet's
    splits are files, so its ``seed`` (the shuffle) may change at test time; the genome's region hash may not."""
    from types import SimpleNamespace

    assert cli.split_deciders("mixlab.datamodules.imagenet.ImageNetDataModule") == ()
    assert cli.split_deciders("mixlab.datamodules.genome.GenomeDataModule") == (
        "seed", "region_size", "val_fraction", "test_fraction")
    assert cli.split_deciders("mixlab.datamodules.mad.MADDataModule") == ()  # seeds draw disjoint samples
    assert cli.split_deciders("mixlab.datamodules.regbench.RegBenchDataModule")[0] == "seed"  # automata pool
    assert cli.split_deciders("no.such.Module") == () and cli.split_deciders(None) == ()
    from mixlab.eval.common import run_record_of

    record = {"mixlab": {"head": "mixlab.heads.vit.ImageClassifier",
                         "data": "mixlab.datamodules.imagenet.ImageNetDataModule",
                         "data_args": {"seed": 0, "batch_size": 8}}}
    assert run_record_of(record)[1:] == ("mixlab.datamodules.imagenet.ImageNetDataModule", {"seed": 0, "batch_size": 8})
    config = SimpleNamespace(data=SimpleNamespace(class_path="mixlab.datamodules.imagenet.ImageNetDataModule",
                                                  init_args={"seed": 1, "batch_size": 8}))
    cli.check_checkpoint_split("x.ckpt", record, config, "test", [])  # no error
    record["mixlab"]["data"] = config.data.class_path = "mixlab.datamodules.genome.GenomeDataModule"
    split_error = (r"^--ckpt_path x.ckpt: the data is split otherwise than in the checkpoint's run "
                   r"\(data.init_args.seed: 0 in the checkpoint, 1 now, set at the default\)")
    with pytest.raises(ValueError, match=split_error):
        cli.check_checkpoint_split("x.ckpt", record, config, "test", [])


def test_lightnings_invalid_value_message_names_the_option_that_set_it(capsys, monkeypatch, tmp_path):
    """A user test: ``--trainer.limit_val_batches 1.5`` read ``error: trainer: You have passed invalid value 1.5 for
    limit_val_batches ...``: the group, not the option (or the config file and key)."""
    runs = tmp_path / "runs"
    base = ["fit", "--config", GENOME, *TINY_LM, "--trainer.max_steps=1", "--run_root", str(runs)]
    why = "You have passed invalid value 1.5 for limit_val_batches, it has to be in [0.0, 1.0] or an int."
    err = _fail(capsys, monkeypatch, *base, "--trainer.limit_val_batches=1.5")
    assert err[-2:] == [f"error: --trainer.limit_val_batches: {why}", HINT]
    config = tmp_path / "lv.yaml"
    config.write_text("trainer:\n  limit_val_batches: 1.5\n")
    err = _fail(capsys, monkeypatch, *base, "--config", str(config))
    assert err[-2:] == [f"error: {config}: trainer.limit_val_batches: {why}", HINT]
    assert not runs.exists()


def test_an_early_stopping_monitor_that_validation_does_not_log_is_one_line(capsys, monkeypatch, tmp_path):
    """``--trainer.callbacks+=...EarlyStopping --trainer.callbacks.monitor val_loss`` (the metric is ``val/loss``):
    Lightning raised a RuntimeError traceback at the first validation after the sanity check, the steps before it
    unsaved (a user test). Now the sanity check's validation refuses it in one line naming the metrics validation
    logs, before any training step and with nothing left in --run_root; with the sanity check off, the first
    validation does. The right name trains."""
    runs = tmp_path / "runs"
    base = ["fit", "--config", GENOME, *TINY_LM, "--trainer.max_steps=2", "--trainer.val_check_interval=1",
            "--run_root", str(runs), "--trainer.callbacks+=lightning.pytorch.callbacks.EarlyStopping"]
    err = _fail(capsys, monkeypatch, *base, "--trainer.callbacks.monitor=val_loss")
    assert err[-2] == ("error: trainer.callbacks: EarlyStopping monitor 'val_loss' is not logged by validation; did "
                       "you mean val/loss? It logs val/acc, val/bits_per_base, val/bits_per_token, val/loss, "
                       "val/ppl"), err
    assert _files(runs) == []
    err = _fail(capsys, monkeypatch, *base, "--trainer.callbacks.monitor=val_loss", "--trainer.num_sanity_val_steps=0")
    assert err[-2].startswith("error: trainer.callbacks: EarlyStopping monitor 'val_loss' is not logged"), err
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    cli.main([*base, "--trainer.callbacks.monitor=val/loss", "--run_name=ok"])
    assert (runs / "genome" / "ok" / "version_0" / "checkpoints" / "last.ckpt").is_file()


def test_checkpointing_off_root_dir_and_barebones(capsys, monkeypatch, tmp_path, caplog):
    """Trainer flags from a user test: ``enable_checkpointing: false`` was refused naming a ModelCheckpoint the user
    never added (mixlab's): now the run trains and writes no checkpoint (``--ckpt_path last`` then says so);
    ``default_root_dir`` was silently ignored: now one warning names ``--run_root`` (none when ``--run_root`` is
    given); ``barebones: true`` was refused naming mixlab's defaults: now one line says what to give instead."""
    import logging

    runs = tmp_path / "runs"
    base = ["fit", "--config", GENOME, *TINY_LM, "--trainer.max_steps=2", "--trainer.val_check_interval=1",
            "--run_root", str(runs)]
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    cli.main([*base, "--trainer.enable_checkpointing=false"])
    assert [p.name for p in runs.rglob("*.ckpt")] == []
    err = _fail(capsys, monkeypatch, *base, "--trainer.max_steps=3", "--ckpt_path=last")
    assert "last.ckpt; train first" in err[-2], err
    # resuming a run's own checkpoint without saving: its steps would be logged twice by the next resume (a user
    # test); refused in one line, a new run from it trains
    cli.main([*base, "--run_name=saved"])
    ckpt = runs / "genome" / "saved" / "version_0" / "checkpoints" / "last.ckpt"
    err = _fail(capsys, monkeypatch, *base, "--run_name=saved", "--trainer.max_steps=3", "--ckpt_path=last",
                "--trainer.enable_checkpointing=false")
    assert err[-2] == (f"error: --ckpt_path {ckpt} with trainer.enable_checkpointing false would train on in that "
                       f"run's folder without saving: its logged steps would be logged again by the next resume; turn "
                       f"checkpointing on, or give --run_name to train a new run from it"), err
    cli.main([*base, "--run_name=other", "--trainer.max_steps=3", f"--ckpt_path={ckpt}",
              "--trainer.enable_checkpointing=false"])
    assert (runs / "genome" / "other" / "version_0" / "config.yaml").is_file()
    with caplog.at_level(logging.WARNING, logger="mixlab.cli"):
        cli.main([*base, "--trainer.default_root_dir", str(tmp_path / "mine"), "--run_name=r"])
        said = [r.getMessage() for r in caplog.records if "default_root_dir" in r.getMessage()]
    assert said == [f"--trainer.default_root_dir is not where mixlab writes: every run goes to "
                    f"--run_root/<task>/<run_name>/version_N (now {runs}/...)"], said
    caplog.clear()
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="mixlab.cli"):
        cli.main([*base[:-2], "--trainer.default_root_dir", str(tmp_path / "mine"), "--run_name=r"])
        said = [r.getMessage() for r in caplog.records if "default_root_dir" in r.getMessage()]
    assert said == [f"--trainer.default_root_dir is not where mixlab writes: every run goes to "
                    f"--run_root/<task>/<run_name>/version_N (now runs/...); give --run_root {tmp_path / 'mine'} "
                    f"instead"], said
    assert (tmp_path / "runs" / "genome" / "r" / "version_1" / "checkpoints" / "last.ckpt").is_file()
    assert not (tmp_path / "mine").exists()
    err = _fail(capsys, monkeypatch, *base, "--trainer.barebones=true")
    assert err[-2] == ("error: --trainer.barebones: true turns off what a mixlab run is made of (its logger, "
                       "checkpoints, metric callbacks and progress bar); for a lean run give --trainer.logger false "
                       "--trainer.enable_checkpointing false --trainer.enable_progress_bar false"), err


def test_seed_everything_true_draws_a_random_seed_and_records_it(capsys, monkeypatch, tmp_path):
    """``--seed_everything true`` promises a random seed (mixlab's range message, LightningCLI's comment), but
    Lightning 2.6 seeded 0 ("No seed found, seed set to 0", a user test). Two runs now record two drawn seeds in
    their config.yaml; with ``PL_GLOBAL_SEED`` set (a DDP rank rerunning the command) that seed is taken."""
    import yaml

    runs = tmp_path / "runs"
    base = ["fit", "--config", GENOME, *TINY_LM, "--trainer.max_steps=1", "--trainer.limit_val_batches=0",
            "--run_root", str(runs), "--seed_everything=true"]
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    seeds = []
    for name in ("a", "b"):
        cli.main([*base, f"--run_name={name}"])
        config = runs / "genome" / name / "version_0" / "config.yaml"
        seeds.append(yaml.safe_load(config.read_text())["seed_everything"])
        monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)  # seed_everything exports it
    assert all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**32 for s in seeds), seeds
    assert seeds[0] != seeds[1]
    monkeypatch.setenv("PL_GLOBAL_SEED", "1234")
    cli.main([*base, "--run_name=c"])
    assert yaml.safe_load((runs / "genome" / "c" / "version_0" / "config.yaml").read_text())["seed_everything"] == 1234
    # resuming such a run needs its seed (true draws another): said in one line (a user test got the sampler's
    # "checkpoint seed 1700744455 != seed 1356856137"), and the seed it names resumes
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    more = [a if a != "--trainer.max_steps=1" else "--trainer.max_steps=2" for a in base]
    err = _fail(capsys, monkeypatch, *more, "--run_name=a", "--ckpt_path=last")
    assert err[-2].startswith(f"error: data: seed_everything: the checkpoint's run shuffled its data with "
                              f"seed_everything {seeds[0]}, this command with "), err
    assert err[-2].endswith(f"; resume with --seed_everything {seeds[0]} (true draws a new seed in every command)")
    cli.main([*more, "--run_name=a", "--ckpt_path=last", f"--seed_everything={seeds[0]}"])


@pytest.mark.skipif(torch.cuda.is_available() or torch.backends.mps.is_available(), reason="needs no GPU")
def test_accelerator_gpu_without_a_gpu_says_what_to_use(capsys, monkeypatch, tmp_path):
    """Lightning's "No supported gpu backend found!" (a user test) now says there is no CUDA/MPS device and what
    to give instead."""
    err = _fail(capsys, monkeypatch, "fit", "--config", GENOME, *TINY_LM, "--run_root", str(tmp_path),
                "--trainer.accelerator", "gpu")
    assert err[-2] == ("error: --trainer.accelerator: No supported gpu backend found! (this machine has no CUDA or "
                       "MPS device: use --trainer.accelerator cpu, or auto)"), err


def test_main_gives_cuda_32_work_queues_unless_the_environment_sets_them(monkeypatch, tmp_path, capsys):
    """``python -m mixlab`` sets ``CUDA_DEVICE_MAX_CONNECTIONS=32`` before anything asks CUDA (the ImageNet GPU
    stage's streams then do not share hardware queues with the training step's); a value the user exported is kept.
    Set even when the command then fails on bad input."""
    var, value = cli.CUDA_QUEUES
    assert (var, value) == ("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    monkeypatch.setenv(var, "restored at teardown")
    monkeypatch.delenv(var)
    missing = str(tmp_path / "missing.yaml")
    with pytest.raises(SystemExit):
        cli.main(["fit", "--config", missing])
    assert os.environ[var] == "32"
    monkeypatch.setenv(var, "1")
    with pytest.raises(SystemExit):
        cli.main(["fit", "--config", missing])
    assert os.environ[var] == "1"
    assert "missing.yaml" in capsys.readouterr().err
