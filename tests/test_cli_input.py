"""A new user's mistakes through ``python -m mixlab``: one line, exit status 2, nothing written.

Config and command-line typos, checkpoints that do not belong to the config, missing
checkpoint files; and what a run leaves behind when it fails or is interrupted (no empty
``version_N``, ``last.ckpt`` on Ctrl-C, the run's own ``config.yaml`` kept on resume).
In-process calls of :func:`mixlab.cli.main` except where the real ``python -m mixlab`` matters.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from mixlab import cli

ROOT = Path(__file__).resolve().parents[1]
GENOME = ROOT / "configs" / "genome" / "goat.yaml"
TEXT = ROOT / "configs" / "text" / "goat.yaml"
DIGITS = ROOT / "configs" / "vit" / "goat_digits.yaml"
TINY = ["--model.init_args.backbone.d_model=32", "--model.init_args.backbone.n_layers=1",
        "--model.init_args.backbone.mixer_args={goat: {position_args: {n_modes: 1}}}",
        "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


def _main(capsys, monkeypatch, *argv: str, code: int = 2) -> list[str]:
    """Run ``python -m mixlab *argv`` in-process; return the stderr lines after exit ``code``."""
    monkeypatch.setattr(sys, "argv", ["mixlab"])  # pytest's own argv is not ours
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli.main(list(argv))
    assert info.value.code == code
    return capsys.readouterr().err.strip().splitlines()


def _typo(tmp_path: Path, source: Path, old: str, new: str) -> Path:
    path = tmp_path / f"typo_{new}.yaml"
    path.write_text(source.read_text().replace(old, new))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """``last.ckpt`` of a tiny text LM and a tiny digits ViT (one training step each)."""
    root = tmp_path_factory.mktemp("runs")
    saved = sys.argv
    sys.argv = ["mixlab"]
    try:
        cli.main(["fit", "--config", str(TEXT), *TINY, "--data.init_args.context_length=16", "--trainer.max_steps=1",
                  "--run_root", str(root)])
        cli.main(["fit", "--config", str(DIGITS), *TINY[1:2], *TINY[3:], "--trainer.max_steps=1",
                  "--data.init_args.batch_size=8", "--run_root", str(root)])
    finally:
        sys.argv = saved
    return {"text": root / "text/goat/version_0/checkpoints/last.ckpt",
            "digits": root / "digits/goat2d/version_0/checkpoints/last.ckpt", "root": root}


# ---------------------------------------------------------------------- config typos
@pytest.mark.parametrize(("old", "new", "line"), [
    ("val_check_interval", "val_check_intervall",
     "unknown key trainer.val_check_intervall; did you mean trainer.val_check_interval?"),
    ("context_length", "contxt_length",
     "unknown key data.init_args.contxt_length; did you mean data.init_args.context_length?"),
    ("n_layers", "n_layer",
     "unknown key model.init_args.backbone.n_layer; did you mean model.init_args.backbone.n_layers?"),
    ("trainer:", "trainr:", "unknown key trainr.max_steps; did you mean trainer.max_steps?"),
])
def test_yaml_typo_is_one_line_naming_file_key_and_closest_key(capsys, monkeypatch, tmp_path, old, new, line):
    config = _typo(tmp_path, GENOME, old, new)
    err = _main(capsys, monkeypatch, "fit", "--config", str(config), "--run_root", str(tmp_path / "runs"))
    assert err == [f"error: {config}: {line}"]
    assert not (tmp_path / "runs").exists()


def test_yaml_value_class_and_syntax_errors_are_one_line(capsys, monkeypatch, tmp_path):
    config = _typo(tmp_path, GENOME, "batch_size: 16", "batch_size: sixteen")
    err = _main(capsys, monkeypatch, "fit", "--config", str(config))
    assert err == [f"error: {config}: data.init_args.batch_size: expected an int; got sixteen"]
    config = _typo(tmp_path, GENOME, "mixlab.heads.CausalLM", "mixlab.heads.CausalLMM")
    err = _main(capsys, monkeypatch, "fit", "--config", str(config))
    assert err == [f"error: {config}: model.class_path: module 'mixlab.heads' has no attribute 'CausalLMM'; "
                   f"did you mean mixlab.heads.CausalLM?"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [\n")
    err = _main(capsys, monkeypatch, "fit", "--config", str(bad))
    assert err == [f"error: {bad}: not valid YAML (expected the node content, but found '<stream end>' at line 2, "
                   f"column 1)"]
    err = _main(capsys, monkeypatch, "fit", "--config", str(tmp_path / "missing.yaml"))
    assert err == [f"error: --config: File does not exist: '{tmp_path / 'missing.yaml'}'"]
    empty, listed = tmp_path / "empty.yaml", tmp_path / "listed.yaml"
    empty.write_text("")
    listed.write_text("- 1\n- 2\n")
    err = _main(capsys, monkeypatch, "fit", "--config", str(empty))
    assert err == [f"error: {empty}: the config file is empty, not a mapping of options (e.g. trainer: "
                   f"{{max_steps: 100}})"]
    err = _main(capsys, monkeypatch, "fit", "--config", str(GENOME), "--config", str(listed))
    assert err[0].startswith(f"error: {listed}: the config file holds a list, not a mapping")
    # a bad value in a second file is refused as jsonargparse reads that file, even when the command line sets
    # the key again: the error names the file that holds the value (it named the command-line option)
    second = tmp_path / "second.yaml"
    second.write_text("trainer:\n  max_steps: abc\n")
    err = _main(capsys, monkeypatch, "fit", "--config", str(GENOME), "--config", str(second),
                "--trainer.max_steps", "2")
    assert err == [f"error: {second}: trainer.max_steps: expected an int; got abc"]
    err = _main(capsys, monkeypatch, "fit", "--config", str(GENOME), "--trainer.max_steps", "abc")
    assert err == ["error: --trainer.max_steps: expected an int; got abc"]
    # a user test: a good value on the command line before a file whose 1e3 (PyYAML: a string; jsonargparse:
    # 1000.0) is refused was blamed for it
    thousand = tmp_path / "thousand.yaml"
    thousand.write_text("trainer:\n  max_steps: 1e3\n")
    err = _main(capsys, monkeypatch, "fit", "--config", str(GENOME), "--trainer.max_steps", "3", "--config",
                str(thousand))
    assert err == [f"error: {thousand}: trainer.max_steps: expected an int; got 1000.0"]
    # a Union of plain types names them all (jsonargparse named its first: "Expected a <class 'int'>", no value)
    for option, value, takes in (("--trainer.max_epochs", "abc", "an int or null"),
                                 ("--trainer.gradient_clip_val", "abc", "an int, a float or null"),
                                 ("--trainer.gradient_clip_val", "inf", "an int, a finite float or null"),
                                 ("--trainer.enable_progress_bar", "maybe", "true, false or null"),
                                 ("--model.init_args.optim.lr", "abc", "a float"),
                                 ("--model.init_args.optim.lr", "", "a float"),  # was: got NestedArg(key='lr', ...)
                                 ("--data.init_args.lowercase", "maybe", "one of fold, n, error"),
                                 ("--trainer.max_steps", "", "an int"),
                                 # containers (was: "Expected a <class 'tuple'>. Got value: 0.9")
                                 ("--model.init_args.optim.betas", "0.9", "a list such as [a, b]"),
                                 ("--model.init_args.backbone.mixer_args", "3", "a mapping such as {key: value}")):
        err = _main(capsys, monkeypatch, "fit", "--config", str(GENOME), option, value)
        assert err == [f"error: {option}: expected {takes}; got {value or repr('')}"]


def test_null_for_an_option_that_takes_none_is_one_line(capsys, monkeypatch, tmp_path):
    """A user test: ``max_steps:`` left empty in a config file, ``lr:`` empty, ``--data.init_args.batch_size null``
    and ``--trainer.devices abc`` ended in tracebacks (jsonargparse passes null on to the classes, which compare it;
    Lightning raised a TypeError). Now one line naming the file and key; nulls an option takes (the genome config's
    ``check_val_every_n_epoch: null``) are not blamed."""
    steps, lr, devices = tmp_path / "steps.yaml", tmp_path / "lr.yaml", tmp_path / "devices.yaml"
    steps.write_text("trainer:\n  max_steps:\n")
    lr.write_text("model:\n  init_args:\n    optim:\n      lr:\n")
    devices.write_text("trainer:\n  devices: abc\n")
    tail = "null is not a value this option takes; give one, or leave the key out for its default"
    runs = ["--run_root", str(tmp_path / "runs")]
    for extra, line in (([f"--config={steps}"], f"{steps}: trainer.max_steps: {tail}"),
                        (["--config", str(lr)], f"{lr}: model.init_args.optim.lr: {tail}"),
                        (["--data.init_args.batch_size", "null"], f"--data.init_args.batch_size: {tail}"),
                        (["--trainer.devices", "abc"], "--trainer.devices: `devices` selected with `CPUAccelerator` "
                                                       "should be an int > 0."),
                        (["--config", str(devices)], f"{devices}: trainer.devices: `devices` selected with "
                                                     f"`CPUAccelerator` should be an int > 0."),
                        (["--trainer.max_time", "abc"], "--trainer.max_time: `Timer(duration='abc')` is not a valid "
                                                        "duration. Expected a string in the format DD:HH:MM:SS.")):
        err = _main(capsys, monkeypatch, "fit", "--config", str(GENOME), *extra, *runs)
        assert err[-2:] == [f"error: {line}", "(MIXLAB_TRACEBACK=1 shows the full traceback)"]
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").rglob("version_*"))
    from mixlab.cli import _takes_none

    assert _takes_none("trainer.check_val_every_n_epoch", {}) is True
    assert _takes_none("model.optim.lr", {"model": "mixlab.heads.CausalLM"}) is False
    assert _takes_none("model.nothing", {"model": "mixlab.heads.CausalLM"}) is None
    # a section left empty: jsonargparse said "Unexpected config: model:" or "'NoneType' object has no attribute
    # 'keys'", naming no file
    for text, line in (("model:\n", "model: empty (null); give the options under it (e.g. model: {...}) or remove "
                                     "the key"),
                       ("data:\n  init_args:\n", "data.init_args: empty (null); give the options under it (e.g. "
                                                  "data.init_args: {...}) or remove the key"),
                       ("seed_everything:\n", "seed_everything: empty (null); give a value or remove the key")):
        empty = tmp_path / "empty_section.yaml"
        empty.write_text(text)
        err = _main(capsys, monkeypatch, "fit", "--config", str(GENOME), "--config", str(empty), *runs)
        assert err[-1] == f"error: {empty}: {line}"
    # a null for a whole group (backbone, optim) is what jsonargparse takes: the group's defaults; said, not silent
    from mixlab.cli import null_groups

    group = tmp_path / "group.yaml"
    group.write_text("model:\n  init_args:\n    backbone:\n")
    assert null_groups(["fit", "--config", str(GENOME), "--config", str(group), "--model.init_args.optim", "null",
                        "--trainer.check_val_every_n_epoch", "null"]) == [
        f"{group}: model.init_args.backbone", "--model.init_args.optim"]
    # a class's error that names the option under its parent (optim.lr) is placed at the option that set it
    err = _main(capsys, monkeypatch, "fit", "--config", str(GENOME), "--model.init_args.optim.lr", "-1", *runs)
    assert err[-2] == "error: --model.init_args.optim.lr: optim.lr must be > 0; got -1.0"
    from mixlab.cli import COMMANDS

    every = ", ".join(["fit", "validate", "test", *sorted(COMMANDS)])
    err = _main(capsys, monkeypatch, "fitt", "--config", str(GENOME))
    assert err == [f"error: unknown command 'fitt'; did you mean fit? (commands: {every})"]
    err = _main(capsys, monkeypatch, "reproducee", "mesa")  # an extra command: named too (user test)
    assert err == [f"error: unknown command 'reproducee'; did you mean reproduce? (commands: {every})"]
    err = _main(capsys, monkeypatch, "xyz")
    assert err == [f"error: unknown command 'xyz' (commands: {every})"]
    # predict was offered and failed in every config (no head has a predict step; a user test)
    err = _main(capsys, monkeypatch, "predict", "--config", str(GENOME))
    assert err == ["error: predict is not offered: no mixlab head has a predict step; use test for metrics on the "
                   "test split, or generate to sample from a language model (python -m mixlab generate --help)"]


def test_typo_through_python_dash_m_names_the_command(tmp_path):
    """The real entry point: one line on stderr, no usage dump, no ``__main__.py``."""
    config = _typo(tmp_path, GENOME, "context_length", "contxt_length")
    typo, help_ = [subprocess.Popen([sys.executable, "-m", "mixlab", *argv], stdout=subprocess.PIPE,  # side by side
                                    stderr=subprocess.PIPE, text=True, cwd=tmp_path)
                   for argv in (["fit", "--config", str(config)], ["fit", "--help"])]
    (_, err), (out, _) = typo.communicate(timeout=300), help_.communicate(timeout=300)
    assert typo.returncode == 2
    assert err.splitlines() == [
        f"error: {config}: unknown key data.init_args.contxt_length; did you mean data.init_args.context_length?"]
    assert out.startswith("usage: python -m mixlab [options] fit")


# ---------------------------------------------------------------------- checkpoints of another run
def test_checkpoint_of_another_task_or_head_is_refused_before_anything_is_written(capsys, monkeypatch, tmp_path,
                                                                                 trained):
    runs = tmp_path / "runs"
    err = _main(capsys, monkeypatch, "test", "--config", str(GENOME), "--ckpt_path", str(trained["text"]),
                "--run_root", str(runs))
    assert err[-2] == (f"error: --ckpt_path {trained['text']}: checkpoint of CausalLM on task 'text' (TextDataModule, "
                       f"vocab_size 257) does not match the config's CausalLM on task 'genome' (GenomeDataModule, "
                       f"vocab_size 5)")
    err = _main(capsys, monkeypatch, "test", "--config", str(GENOME), "--ckpt_path", str(trained["digits"]),
                "--run_root", str(runs))
    assert err[-2] == (f"error: --ckpt_path {trained['digits']}: checkpoint of ImageClassifier on task 'digits' "
                       f"(DigitsDataModule, num_classes 10) does not match the config's CausalLM on task 'genome' "
                       f"(GenomeDataModule, vocab_size 5)")
    err = _main(capsys, monkeypatch, "test", "--config", str(TEXT), "--ckpt_path", str(trained["text"]),
                "--model.init_args.vocab_size=50257", "--data.init_args.tokenizer=gpt2", "--run_root", str(runs))
    assert err[-2] == (f"error: --ckpt_path {trained['text']}: checkpoint of CausalLM on task 'text' (TextDataModule, "
                       f"vocab_size 257) does not match the config's CausalLM on task 'text' (TextDataModule, "
                       f"vocab_size 50257)")
    assert not runs.exists()


def test_checkpoint_without_a_record_is_checked_by_its_weights(capsys, monkeypatch, tmp_path, trained):
    """An old checkpoint (no run record, no class paths): its tensors must fit the config's model."""
    old = torch.load(trained["text"], weights_only=False)
    bare = {"state_dict": old["state_dict"], "global_step": old["global_step"]}
    torch.save(bare, tmp_path / "bare.ckpt")
    err = _main(capsys, monkeypatch, "test", "--config", str(GENOME), "--ckpt_path", str(tmp_path / "bare.ckpt"),
                "--run_root", str(tmp_path / "runs"))
    assert err[-2] == (f"error: --ckpt_path {tmp_path / 'bare.ckpt'}: the checkpoint does not fit the config's "
                       f"model (embed.weight has shape [257, 32] in the checkpoint but [5, 128] in the model); use "
                       f"the config it was trained with")
    assert not (tmp_path / "runs" / "genome").exists()


def test_missing_or_foreign_checkpoint_file_is_one_line(capsys, monkeypatch, tmp_path):
    missing = tmp_path / "nope.ckpt"
    err = _main(capsys, monkeypatch, "test", "--config", str(GENOME), "--ckpt_path", str(missing),
                "--run_root", str(tmp_path / "runs"))
    assert err == [f"error: --ckpt_path {missing}: file not found", "(MIXLAB_TRACEBACK=1 shows the full traceback)"]
    monkeypatch.chdir(tmp_path)  # a misspelt name (user test): no such file here, so the hint
    err = _main(capsys, monkeypatch, "test", "--config", str(GENOME), "--ckpt_path", "lats",
                "--run_root", str(tmp_path / "runs"))
    assert err[-2] == ("error: --ckpt_path lats: file not found; did you mean --ckpt_path last (this run's last "
                       "checkpoint)?")
    err = _main(capsys, monkeypatch, "fit", "--config", str(GENOME), "--ckpt_path", str(GENOME),
                "--run_root", str(tmp_path / "runs"))
    assert err[-2].startswith(f"error: --ckpt_path {GENOME}: not a PyTorch Lightning checkpoint (")
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------- what a run leaves behind
def test_failed_runs_leave_no_version_folder(capsys, monkeypatch, tmp_path):
    runs = tmp_path / "runs"
    err = _main(capsys, monkeypatch, "fit", "--config", str(GENOME), "--model.init_args.vocab_size=3",
                "--run_root", str(runs))
    assert err[-2].startswith("error: model.init_args.vocab_size=3 is smaller than")
    err = _main(capsys, monkeypatch, "fit", "--config", str(GENOME), "--data.init_args.context_length=100000",
                "--run_root", str(runs))
    assert err[-2].startswith("error: --data.init_args.context_length: context_length=100000 needs")
    assert sorted(p.name for p in runs.rglob("*")) == []


def test_val_check_interval_zero_and_an_escaping_run_name_are_refused(capsys, monkeypatch, tmp_path):
    """``val_check_interval: 0`` was Lightning's ``ZeroDivisionError`` traceback after a step, ``--run_name
    ../../x`` wrote outside ``--run_root`` (second user test), and ``max_steps`` or ``max_epochs`` 0 exited 0 with
    an empty run folder: each one line, nothing written."""
    runs = tmp_path / "runs"
    err = _main(capsys, monkeypatch, "fit", "--config", str(GENOME), "--trainer.val_check_interval=0",
                "--run_root", str(runs))
    assert err[-2] == ("error: trainer.val_check_interval=0: give training batches >= 1 (an int) or a fraction of an "
                       "epoch in (0, 1] (a float)")
    for limit in ("max_steps", "max_epochs"):  # a user test: exit 0 and an empty version folder
        err = _main(capsys, monkeypatch, "fit", "--config", str(GENOME), f"--trainer.{limit}=0",
                    "--run_root", str(runs))
        assert err[-2] == f"error: trainer.{limit}=0 trains nothing: give {limit} >= 1 (-1: no limit of that kind)"
    for name in ("../../escaped", str(tmp_path / "abs"), " ", "a/b", ".."):  # a/b: `compare` found no run
        err = _main(capsys, monkeypatch, "fit", "--config", str(GENOME), "--run_name", name, "--run_root", str(runs))
        assert err[-2] == f"error: --run_name {name!r}: one folder name inside --run_root/<task> (no '/', not '..', " \
                          f"not empty, no control characters)"
    assert not runs.exists() and not (tmp_path / "abs").exists() and not (tmp_path.parent / "escaped").exists()


def test_failed_resume_leaves_no_version_folder(capsys, monkeypatch, tmp_path, trained):
    """A resume that fails while restoring (other data settings: the sampler's state does not fit)
    restores global_step > 0 first; it trained nothing in this process, so its new folder goes. The error
    names the option that changed, with both values (the checkpoint's run record), and the item counts."""
    import re

    runs = tmp_path / "runs"
    err = _main(capsys, monkeypatch, "fit", "--config", str(TEXT), *TINY, "--data.init_args.context_length=32",
                "--data.init_args.batch_size=8", "--trainer.max_steps=3", "--run_root", str(runs),
                "--ckpt_path", str(trained["text"]))
    line = re.fullmatch(r"error: data\.init_args\.context_length: 16 in the checkpoint, 32 now; the checkpoint's "
                        r"dataset has (\d+) items, this one (\d+): the data settings changed since the checkpoint",
                        err[-2])
    assert line and int(line.group(1)) > int(line.group(2)) > 0, err[-2]  # batch_size (a loader option) not named
    assert sorted(p.name for p in runs.rglob("*")) == []


def test_failed_commands_leave_an_existing_run_as_it_was(capsys, monkeypatch, tmp_path, trained):
    """In a run folder that exists, a failed resume leaves no ``config_resume_<k>.yaml`` or event file, and a
    failed ``test`` puts back the ``config_test.yaml`` of the last good test (user test: six failed commands
    left six stray files, and a failed test overwrote the good test's config)."""
    import shutil

    runs = tmp_path / "runs"
    shutil.copytree(trained["text"].parents[1], runs / "text" / "goat" / "version_0")
    run = runs / "text" / "goat" / "version_0"
    argv = ["--config", str(TEXT), *TINY, "--data.init_args.context_length=16", "--run_root", str(runs)]
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    cli.main(["test", *argv, "--ckpt_path", "last"])
    listing = lambda: sorted((str(p.relative_to(run)), p.stat().st_size) for p in run.rglob("*"))  # noqa: E731
    before, good = listing(), (run / "config_test.yaml").read_text()
    err = _main(capsys, monkeypatch, "fit", *argv[:-3], "--data.init_args.context_length=32", "--trainer.max_steps=3",
                "--run_root", str(runs), "--ckpt_path", "last")
    assert "data settings changed since the checkpoint" in err[-2]
    err = _main(capsys, monkeypatch, "test", *argv, "--ckpt_path", "last", "--data.init_args.batch_size=0")
    assert err[-2] == "error: --data.init_args.batch_size: must be >= 1; got 0"  # the option once, where it was set
    assert listing() == before and (run / "config_test.yaml").read_text() == good


def test_interrupt_saves_last_checkpoint_and_resume_keeps_the_run(capsys, monkeypatch, tmp_path):
    """Ctrl-C at step 3 of 4 before any validation: ``last.ckpt`` at step 3, exit status 1; resuming logs
    into the same ``version_0`` (``v_num=0``), keeps its ``config.yaml`` and trains the last step."""
    from lightning.pytorch.callbacks.progress.progress_bar import get_standard_metrics

    from mixlab.cli import MixlabCLI
    from mixlab.heads.lm import CausalLM

    runs = tmp_path / "runs"
    argv = ["--config", str(TEXT), *TINY, "--data.init_args.context_length=16", "--trainer.max_steps=4",
            "--trainer.val_check_interval=100", "--run_root", str(runs)]
    step = CausalLM.training_step

    def interrupted(self, batch, batch_idx):
        if self.global_step == 3:
            raise KeyboardInterrupt
        return step(self, batch, batch_idx)

    monkeypatch.setattr(CausalLM, "training_step", interrupted)
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", *argv])
    assert info.value.code == 1
    run = runs / "text" / "goat" / "version_0"
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 3
    monkeypatch.setattr(CausalLM, "training_step", step)
    first = (run / "config.yaml").read_text()
    resumed = MixlabCLI(args=["fit", *argv, "--ckpt_path", "last", "--trainer.max_steps=5"])
    assert get_standard_metrics(resumed.trainer)["v_num"] == 0
    assert resumed.trainer.global_step == 5
    assert (run / "config.yaml").read_text() == first
    assert yaml.safe_load((run / "config_resume_1.yaml").read_text())["trainer"]["max_steps"] == 5
    assert sorted(p.name for p in (runs / "text" / "goat").iterdir()) == ["version_0"]


def test_fit_from_another_models_checkpoint_is_refused(capsys, monkeypatch, tmp_path, trained):
    """A user test: ``fit --config configs/text/rope.yaml --ckpt_path <a goat run's last.ckpt>`` warned once and went
    on training goat in the goat run's folder, rewriting its ``last.ckpt``. Now one line naming what differs and the
    checkpoint's run config, nothing written; validate/test still build the checkpoint's model (with a warning)."""
    import shutil

    shutil.copytree(trained["root"] / "text", tmp_path / "a" / "text")
    run = tmp_path / "a" / "text" / "goat" / "version_0"
    ckpt = run / "checkpoints" / "last.ckpt"
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    err = _main(capsys, monkeypatch, "fit", "--config", str(TEXT), *TINY, "--data.init_args.context_length=16",
                "--model.init_args.backbone.mixer", "rope", "--ckpt_path", str(ckpt),
                "--run_root", str(tmp_path / "b"))
    assert err == [f"error: --ckpt_path {ckpt}: the checkpoint is another model than the config's (backbone.mixer "
                   f"'rope' in the config, 'goat' in the checkpoint); fit would go on training the checkpoint's model, "
                   f"in its run folder: use its run's config ({run.resolve() / 'config.yaml'}), or leave out "
                   f"--ckpt_path to train the config's model", "(MIXLAB_TRACEBACK=1 shows the full traceback)"]
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert not (tmp_path / "b").exists()


def test_testing_another_runs_checkpoint_logs_into_that_run(capsys, monkeypatch, tmp_path, trained):
    """``test --config X --run_root OTHER --ckpt_path <a run's checkpoint>``: the metrics go to the
    checkpoint's own run (where ``compare`` reads them), not to a new run of X under OTHER."""
    import shutil

    from mixlab.eval.compare import load_scalars

    shutil.copytree(trained["root"] / "text", tmp_path / "a" / "text")
    ckpt = tmp_path / "a" / "text" / "goat" / "version_0" / "checkpoints" / "last.ckpt"
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    cli.main(["test", "--config", str(TEXT), *TINY, "--data.init_args.context_length=16",
              "--run_root", str(tmp_path / "other"), "--ckpt_path", str(ckpt)])
    assert not (tmp_path / "other").exists()
    run = tmp_path / "a" / "text" / "goat"
    assert sorted(p.name for p in run.iterdir()) == ["version_0"]
    assert (run / "version_0" / "config_test.yaml").is_file() and "test/loss" in load_scalars(run)


def test_validate_with_other_data_settings_than_the_checkpoints_run_warns(caplog, monkeypatch, tmp_path, trained):
    """A user test: ``fit ... --data.init_args.context_length 256`` then ``validate --ckpt_path last`` without it
    measured at the config's 128 and logged into the run's val curve unnoticed. Now one warning line names it."""
    import logging
    import shutil

    monkeypatch.setattr(sys, "argv", ["mixlab"])
    root = tmp_path / "runs"
    shutil.copytree(trained["text"].parents[4] / "text", root / "text")
    ckpt = root / "text" / "goat" / "version_0" / "checkpoints" / "last.ckpt"
    with caplog.at_level(logging.WARNING, logger="mixlab.cli"):
        cli.main(["validate", "--config", str(TEXT), *TINY, "--data.init_args.context_length=32", "--run_root",
                  str(root), "--ckpt_path", str(ckpt)])
    lines = [r.getMessage() for r in caplog.records if "other data settings" in r.getMessage()]
    assert lines == [f"--ckpt_path {ckpt}: validate measures with other data settings than the checkpoint's run "
                     f"(data.init_args.context_length: 16 in the checkpoint, 32 now); its metrics go into that run's "
                     f"curves"]


def test_ckpt_path_last_builds_the_model_from_the_checkpoint_like_a_file(caplog, monkeypatch, tmp_path, trained):
    """``--ckpt_path last`` with a model option that differs from the checkpoint: the model is built from
    the checkpoint's hyperparameters with the same warning as for the file itself (it used to keep the
    config's model: a silent mismatch, or a shape error)."""
    import logging
    import shutil

    from mixlab.heads.lm import CausalLM

    monkeypatch.setattr(sys, "argv", ["mixlab"])
    root = tmp_path / "runs"  # a copy: validate logs into the checkpoint's run
    shutil.copytree(trained["text"].parents[4] / "text", root / "text")
    ckpt_file = root / "text" / "goat" / "version_0" / "checkpoints" / "last.ckpt"
    argv = ["--config", str(TEXT), *TINY, "--data.init_args.context_length=16", "--run_root", str(root),
            "--model.init_args.backbone.d_model=48"]
    widths = []
    validate = CausalLM.validation_step

    def record(self, batch, batch_idx):
        widths.append(self.backbone.cfg.d_model)
        return validate(self, batch, batch_idx)

    monkeypatch.setattr(CausalLM, "validation_step", record)
    for ckpt in ("last", str(ckpt_file)):
        with caplog.at_level(logging.WARNING, logger="mixlab.cli"):
            caplog.clear()
            cli.main(["validate", *argv, "--ckpt_path", ckpt])
        assert f"--ckpt_path {ckpt_file}: the model is built from the checkpoint" in caplog.text
        assert "backbone.d_model: 48 -> 32" in caplog.text
    assert widths == [32, 32]


def test_sigterm_saves_last_checkpoint_and_exits_non_zero(capsys, monkeypatch, tmp_path):
    """SIGTERM (``kill``, preemption) during step 3 of 6: like Ctrl-C, ``last.ckpt`` holds the steps
    done, one line says where, and the status is 143 (128 + SIGTERM), not 0."""
    import os
    import signal

    from mixlab.heads.lm import CausalLM

    runs = tmp_path / "runs"
    step = CausalLM.training_step

    def killed(self, batch, batch_idx):
        if self.global_step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # Lightning's handler notes it; the loop stops after this batch
        return step(self, batch, batch_idx)

    monkeypatch.setattr(CausalLM, "training_step", killed)
    err = _main(capsys, monkeypatch, "fit", "--config", str(TEXT), *TINY, "--data.init_args.context_length=16",
                "--trainer.max_steps=6", "--trainer.val_check_interval=100", "--run_root", str(runs), code=143)
    ckpt = torch.load(runs / "text/goat/version_0/checkpoints/last.ckpt", weights_only=False)
    assert ckpt["global_step"] in (3, 4)  # the batch in flight may finish
    assert f"mixlab: SIGTERM at step {ckpt['global_step']}; " in "\n".join(err)
    assert "last.ckpt holds step" in "\n".join(err)


def test_a_second_sigterm_stops_a_step_that_never_ends(capsys, monkeypatch, tmp_path):
    """A user test: a stuck sample generator ignored SIGTERM (Lightning stops at the end of the running step, which
    never came). The first SIGTERM says so; a second one stops at once with status 143, saving nothing mid-step.
    SIGTERM outside Lightning's loops (the datamodule's set-up) stops at once and leaves no run folder."""
    import os
    import signal
    import threading
    import time

    from mixlab.datamodules.text import TextDataModule
    from mixlab.heads.lm import CausalLM

    runs, pid = tmp_path / "runs", os.getpid()
    step = CausalLM.training_step

    def stuck(self, batch, batch_idx):
        if self.global_step == 2:
            os.kill(pid, signal.SIGTERM)
            threading.Timer(0.5, os.kill, (pid, signal.SIGTERM)).start()
            while True:  # a generator that never returns
                time.sleep(0.01)
        return step(self, batch, batch_idx)

    monkeypatch.setattr(CausalLM, "training_step", stuck)
    before = signal.getsignal(signal.SIGTERM)
    args = ["--config", str(TEXT), *TINY, "--data.init_args.context_length=16", "--trainer.max_steps=6",
            "--trainer.val_check_interval=100", "--run_root", str(runs)]
    err = _main(capsys, monkeypatch, "fit", *args, code=143)
    assert err[-2:] == ["mixlab: SIGTERM: stopping at the end of the running step (SIGTERM again stops at once, "
                        "without saving it)",
                        "mixlab: SIGTERM again: stopping now, in the middle of the running step, which is not saved "
                        "(a checkpoint saved before stays as it was)"]
    assert signal.getsignal(signal.SIGTERM) is before
    assert (runs / "text/goat/version_0").is_dir() and not list(runs.rglob("*.ckpt"))  # 2 steps logged, none saved

    def setup(self, stage=None):
        os.kill(pid, signal.SIGTERM)
        while True:
            time.sleep(0.01)

    monkeypatch.setattr(TextDataModule, "setup", setup)
    err = _main(capsys, monkeypatch, "fit", *args[:-1], str(tmp_path / "runs2"), code=143)
    assert err[-1] == ("mixlab: SIGTERM: stopped at once (outside the training and evaluation loops: set-up or "
                       "teardown); nothing saved")
    assert not (tmp_path / "runs2").exists() or not list((tmp_path / "runs2").rglob("version_*"))
    assert signal.getsignal(signal.SIGTERM) is before
    monkeypatch.undo()

    def first(self, batch, batch_idx):  # SIGTERM before step 1 ends: Lightning stops after it, nothing is saved
        os.kill(pid, signal.SIGTERM)
        raise SIGTERMException()

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    monkeypatch.setattr(CausalLM, "training_step", first)
    err = _main(capsys, monkeypatch, "fit", *args[:-1], str(tmp_path / "runs3"), code=143)
    assert err[-1] == "mixlab: SIGTERM before the first training step ended; nothing saved"
    assert not list((tmp_path / "runs3").rglob("*.ckpt"))


# ---------------------------------------------------------------------- data files
def test_text_file_in_another_encoding_is_one_line_naming_file_offset_and_option(capsys, monkeypatch, tmp_path):
    latin = tmp_path / "latin.txt"
    latin.write_bytes("To be, or not to be: that is the qu\u00e9stion\n".encode("latin-1") * 40)
    argv = ["fit", "--config", str(TEXT), *TINY, "--data.init_args.context_length=16", "--trainer.max_steps=1",
            f"--data.init_args.path={latin}", "--run_root", str(tmp_path / "runs")]
    err = _main(capsys, monkeypatch, *argv)
    assert err[-2] == (f"error: --data.init_args.path: {latin}: not utf-8 text: byte 0xe9 at byte offset 35 "
                       f"(invalid continuation byte); set data.init_args.encoding (e.g. latin-1) to read it")
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    cli.main([*argv, "--data.init_args.encoding=latin-1"])  # the option it names reads the file
    assert (tmp_path / "runs" / "text" / "goat" / "version_0" / "checkpoints" / "last.ckpt").is_file()


def test_empty_text_file_is_reported_as_empty(capsys, monkeypatch, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    err = _main(capsys, monkeypatch, "fit", "--config", str(TEXT), f"--data.init_args.path={empty}",
                "--run_root", str(tmp_path / "runs"))
    assert err[-2] == f"error: --data.init_args.path: {empty}: file is empty"
    assert not (tmp_path / "runs" / "text").exists()


def test_truncated_jpeg_in_an_image_folder_is_skipped_counted_and_warned(monkeypatch, tmp_path, caplog):
    """The ImageFolder path skips a truncated JPEG like the WebDataset path (the run trains and writes
    its checkpoint; the warning names the file and the count; the fit's end gives the total in one line)."""
    from PIL import Image

    from mixlab.datamodules.digits import load_uci_digits
    from mixlab.datamodules.imagenet import SKIPPED

    images, labels = load_uci_digits()
    root = tmp_path / "images"
    for c in range(3):
        (root / f"class_{c}").mkdir(parents=True)
        for k, i in enumerate((labels == c).nonzero().flatten()[:4].tolist()):
            Image.fromarray(images[i].numpy()).convert("RGB").resize((32, 32)).save(root / f"class_{c}" / f"{k}.jpg")
    bad = root / "class_1" / "1.jpg"
    bad.write_bytes(bad.read_bytes()[:200])  # truncated
    data = tmp_path / "folder.yaml"
    data.write_text(yaml.safe_dump({"data": {"class_path": "mixlab.datamodules.imagenet.ImageNetDataModule",
                                             "init_args": {"format": "folder", "train_path": str(root),
                                                           "val_path": str(root), "num_classes": 10,
                                                           "image_size": 24, "batch_size": 4, "num_workers": 0,
                                                           "train_samples": None, "auto_augment": None,
                                                           "re_prob": 0.0, "color_jitter": 0.0}}}))
    before = SKIPPED["corrupt"]
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    with pytest.warns(RuntimeWarning, match=rf"skipped corrupt image '{bad}' \(OSError: Truncated File Read\); "
                                            r"1 corrupt image\(s\) skipped so far by this datamodule \(this process "
                                            r"and its DataLoader workers\); the next image takes its place"):
        cli.main(["fit", "--config", str(DIGITS), "--config", str(data), "--model.init_args.backbone.n_layers=1",
                  "--trainer.max_epochs=1", "--trainer.enable_progress_bar=false",
                  "--run_root", str(tmp_path / "runs")])
    assert SKIPPED["corrupt"] - before == 2  # once in training, once in validation
    assert "ImageNetDataModule: 2 corrupt image(s) skipped so far (after fit), each named in a warning above" \
        in [r.getMessage() for r in caplog.records if r.name == "mixlab.imagenet"]
    ckpt = torch.load(tmp_path / "runs/imagenet/goat2d/version_0/checkpoints/last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 3  # 12 images, batches of 4: none lost


def test_compare_finds_resolution_results_and_lists_no_output_folder(capsys, monkeypatch, trained):
    """README: ``resolution ... --out runs/resolution`` then ``compare runs``: the digits run gets its
    top-1@<res>px columns, and neither runs/resolution nor runs/compare becomes a row."""
    root = trained["root"]
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    cli.main(["resolution", "--ckpt", str(trained["digits"]), "--resolutions", "16", "24",
              "--out", str(root / "resolution"), "--batch-size", "50", "--accelerator", "cpu"])  # whole val split
    from mixlab.eval.compare import main as compare_main

    rows = list(csv.DictReader((root / "resolution" / "resolution.csv").open()))
    cmp = compare_main([str(root), "--no-plots"])
    assert sorted(cmp.table) == ["goat2d"]  # the text run logged no scalar in its one step
    top1 = {label: value for (task, label), value in cmp.table["goat2d"].items() if task == "digits"}
    assert top1 == pytest.approx({"top-1@16px (%)": float(rows[0]["top1"]),
                                  "top-1@24px (%)": float(rows[1]["top1"])}, abs=1e-4)
    compare_main([str(root), "--no-plots"])  # its own output folder is not a run either
    assert "tensorboard" not in capsys.readouterr().out


def test_figure_writes_into_the_run_folder_not_the_working_directory(monkeypatch, tmp_path, trained):
    import shutil

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    cli.main(["figure", "goat-spectrum", "--ckpt", str(trained["text"])])
    assert (trained["text"].parents[1] / "figures" / "goat_spectrum.png").stat().st_size > 0
    loose = tmp_path / "loose.ckpt"
    shutil.copy(trained["text"], loose)
    cli.main(["figure", "goat-spectrum", "--ckpt", str(loose)])
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.png")) == \
        ["runs/figures/loose/goat_spectrum.png"]


def test_commands_print_no_litlogger_tip_or_pytree_deprecation(caplog, capfd, monkeypatch, tmp_path):
    import logging
    import warnings

    caplog.set_level(logging.INFO)
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli.main(["fit", "--config", str(TEXT), *TINY, "--data.init_args.context_length=16", "--trainer.max_steps=2",
                  "--trainer.val_check_interval=1", "--run_root", str(tmp_path / "runs")])
    out = capfd.readouterr()
    assert "litlogger" not in out.out + out.err + caplog.text
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in caplog.text  # Lightning's own lines still come
    assert not [w for w in caught if "LeafSpec" in str(w.message)]


def test_ckpt_path_best_is_the_lowest_val_loss_checkpoint(capsys, monkeypatch, tmp_path):
    """``--ckpt_path best`` in a new process (e.g. ``test`` after ``fit``) is the default ModelCheckpoint's
    file of the run (lowest ``val/loss``); Lightning alone only knows it inside the fitting process.
    Before validation has run it is a one-line error (and the traceback hint)."""
    from mixlab.cli import MixlabCLI

    runs = tmp_path / "runs"
    argv = ["--config", str(TEXT), *TINY, "--data.init_args.context_length=16", "--run_root", str(runs)]
    err = _main(capsys, monkeypatch, "test", *argv, "--ckpt_path", "best")
    assert err[0].startswith("error: --ckpt_path best: no best checkpoint (best on checkpoint.monitor) in "), err
    MixlabCLI(args=["fit", *argv, "--trainer.max_steps=4", "--trainer.val_check_interval=2",
                    "--trainer.limit_val_batches=1"])
    ckpts = runs / "text" / "goat" / "version_0" / "checkpoints"
    best = [p for p in ckpts.glob("*.ckpt") if p.name != "last.ckpt"]
    assert len(best) == 1
    tested = MixlabCLI(args=["test", *argv, "--ckpt_path", "best", "--trainer.limit_test_batches=1"])
    assert tested.trainer.ckpt_path == str(best[0])
    want = torch.load(best[0], weights_only=False)["global_step"]
    assert want in (2, 4) and torch.load(ckpts / "last.ckpt", weights_only=False)["global_step"] == 4
    # a newer run that never validated: best does not fall back to the older run's file (a user test)
    MixlabCLI(args=["fit", *argv, "--trainer.max_steps=2", "--trainer.val_check_interval=100"])
    assert (runs / "text" / "goat" / "version_1" / "checkpoints" / "last.ckpt").is_file()
    err = _main(capsys, monkeypatch, "test", *argv, "--ckpt_path", "best")
    assert "--ckpt_path best: the newest run " in err[0] and "version_1" in err[0] and "has no best" in err[0], err


def test_checkpoint_monitor_and_mode_choose_the_best_checkpoint(tmp_path):
    """``checkpoint.monitor`` / ``checkpoint.mode`` (Lightning's ModelCheckpoint as a CLI group) decide
    which file is kept and what ``--ckpt_path best`` reads: here the *highest* val/loss of two validations."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from mixlab.callbacks import LastCheckpoint
    from mixlab.cli import MixlabCLI
    from mixlab.eval.compare import load_scalars

    runs = tmp_path / "runs"
    argv = ["--config", str(TEXT), *TINY, "--data.init_args.context_length=16", "--run_root", str(runs),
            "--checkpoint.monitor", "val/loss", "--checkpoint.mode", "max"]
    cli = MixlabCLI(args=["fit", *argv, "--trainer.max_steps=4", "--trainer.val_check_interval=2",
                          "--trainer.limit_val_batches=1"])
    kept = [c for c in cli.trainer.callbacks if isinstance(c, ModelCheckpoint) and not isinstance(c, LastCheckpoint)]
    assert [(c.monitor, c.mode, c.save_top_k) for c in kept] == [("val/loss", "max", 1)]
    run = runs / "text" / "goat" / "version_0"
    val = {step: v for _, step, v in load_scalars(run)["val/loss"]}
    assert len(val) == 2 and val[1] != val[3], val  # validations after steps 2 and 4 (logged at step 1 and 3)
    worst = max(val, key=val.get) + 1
    tested = MixlabCLI(args=["test", *argv, "--ckpt_path", "best", "--trainer.limit_test_batches=1"])
    assert torch.load(tested.trainer.ckpt_path, weights_only=False)["global_step"] == worst
    assert float(kept[0].best_model_score) == pytest.approx(max(val.values()), rel=1e-6)


def test_bad_checkpoint_options_are_one_line_before_training(capsys, monkeypatch, tmp_path):
    """A ``checkpoint.mode`` other than min/max, and a ``checkpoint.monitor`` that validation never logs, end
    the command with one line naming the option (Lightning raised MisconfigurationException tracebacks, the
    monitor only after training up to the first validation); the monitor is checked at the sanity check,
    before any training step, and the empty run folder is removed."""
    runs = tmp_path / "runs"
    argv = ["fit", "--config", str(TEXT), *TINY, "--data.init_args.context_length=16", "--run_root", str(runs),
            "--trainer.max_steps=2", "--trainer.val_check_interval=1"]
    err = _main(capsys, monkeypatch, *argv, "--checkpoint.mode", "best")
    assert err[0] == "error: --checkpoint.mode: must be 'min' or 'max'; got 'best'", err
    err = _main(capsys, monkeypatch, *argv, "--checkpoint.monitor", "val/acc_len_203_256")
    assert err[0] == ("error: checkpoint.monitor 'val/acc_len_203_256' is not logged by validation; it logs val/acc, "
                      "val/bits_per_byte, val/bits_per_token, val/loss, val/ppl"), err
    assert not list(runs.rglob("*.ckpt")) and not list(runs.rglob("version_*"))


def test_ckpt_path_directory_is_one_line_naming_a_checkpoint_below_it(capsys, monkeypatch, tmp_path, trained):
    """A run folder (not a sharded checkpoint) as ``--ckpt_path``: one line naming a checkpoint below it (it
    was an IsADirectoryError traceback, a user test); an empty folder says so."""
    run = trained["text"].parents[1]  # .../version_0
    argv = ["test", "--config", str(TEXT), *TINY, "--run_root", str(tmp_path / "runs")]
    err = _main(capsys, monkeypatch, *argv, "--ckpt_path", str(run))
    assert err[0].startswith("error: --ckpt_path ") and "a directory; give a checkpoint file (e.g. " in err[0], err
    assert err[0].endswith("last.ckpt)"), err
    empty = tmp_path / "empty"
    empty.mkdir()
    err = _main(capsys, monkeypatch, *argv, "--ckpt_path", str(empty))
    assert "a directory; give a checkpoint file (no .ckpt file within 4 folders below it)" in err[0], err
    assert not (tmp_path / "runs").exists()
    # a user test: --ckpt_path / walked the whole tree (15 s) and named another user's checkpoint; the search
    # goes 4 folders deep (a run root's <task>/<run>/version_N/checkpoints), no further
    deep = empty / "a" / "b" / "c" / "d" / "e"
    deep.mkdir(parents=True)
    (deep / "x.ckpt").write_bytes(b"")
    err = _main(capsys, monkeypatch, *argv, "--ckpt_path", str(empty))
    assert "(no .ckpt file within 4 folders below it)" in err[0], err
    (deep.parent / "y.ckpt").write_bytes(b"")
    err = _main(capsys, monkeypatch, *argv, "--ckpt_path", str(empty))
    assert err[0].endswith(f"(e.g. {deep.parent / 'y.ckpt'})"), err
    # an empty --ckpt_path was Lightning's ValueError traceback
    for blank in ("", " "):
        err = _main(capsys, monkeypatch, *argv, "--ckpt_path", blank)
        assert err[0] == "error: --ckpt_path is empty; give a checkpoint file, or last / best (this run's checkpoints)"
    assert not (tmp_path / "runs").exists()


def test_resume_with_another_checkpoint_monitor_is_one_line(capsys, monkeypatch, tmp_path):
    """A run whose best checkpoint was kept by ``--checkpoint.monitor val/acc --checkpoint.mode max`` (given on
    the command line) resumed without those options: one line naming both settings, nothing written (Lightning
    warned, kept a second "best" file by val/loss and ``--ckpt_path best`` became ambiguous; a user test)."""
    from mixlab.cli import MixlabCLI

    runs = tmp_path / "runs"
    argv = ["--config", str(TEXT), *TINY, "--data.init_args.context_length=16", "--run_root", str(runs),
            "--trainer.val_check_interval=2"]
    MixlabCLI(args=["fit", *argv, "--trainer.max_steps=2", "--checkpoint.monitor", "val/acc",
                    "--checkpoint.mode", "max"])
    run = runs / "text" / "goat" / "version_0"
    before = sorted(p.name for p in run.rglob("*"))
    err = _main(capsys, monkeypatch, "fit", *argv, "--trainer.max_steps=4", "--ckpt_path", "last")
    assert err[0].endswith("that run kept its best checkpoint by checkpoint.monitor val/acc (max); this command says "
                           "val/loss (min): resume with --checkpoint.monitor val/acc --checkpoint.mode max"), err
    assert sorted(p.name for p in run.rglob("*")) == before


def test_resumed_monitor_check_needs_a_kept_best_file():
    """The resume check compares the configured monitor with the one that kept a best file; a checkpoint whose
    best-checkpoint callback kept none (its monitor was never logged) does not block the corrected resume."""
    from mixlab.cli import _check_resumable

    key = "BestCheckpoint{'monitor': 'val/acc', 'mode': 'max', 'every_n_train_steps': 0}"
    group = {"monitor": "val/loss", "mode": "min"}
    _check_resumable("x.ckpt", {"callbacks": {key: {"best_model_path": ""}}}, group)
    with pytest.raises(ValueError, match=r"checkpoint.monitor val/acc \(max\); this command says val/loss \(min\)"):
        _check_resumable("x.ckpt", {"callbacks": {key: {"best_model_path": "b.ckpt"}}}, group)
    _check_resumable("x.ckpt", {"callbacks": {key: {"best_model_path": "b.ckpt"}}},
                           {"monitor": "val/acc", "mode": "max"})
    # a run without a monitor: the fix says null, as the command line reads it ("None" is a string there)
    none = "BestCheckpoint{'monitor': None, 'mode': 'min', 'every_n_train_steps': 0}"
    with pytest.raises(ValueError, match=r"monitor null \(min\); this command says val/loss \(min\): resume with "
                                         r"--checkpoint.monitor null --checkpoint.mode min$"):
        _check_resumable("x.ckpt", {"callbacks": {none: {"best_model_path": "b.ckpt"}}}, group)


def test_a_model_or_data_option_before_config_is_one_line_naming_it(capsys, monkeypatch):
    """``--model.init_args.* ... --config X``: the option's class is not known when it is read; jsonargparse's error
    blamed the config file (``X: model: unrecognized arguments``). One line names the option and the fix; trainer
    options before ``--config`` stay allowed (they apply in order: tests/test_overrides.py)."""
    err = _main(capsys, monkeypatch, "fit", "--model.init_args.backbone.n_layers", "1", "--config", str(GENOME))
    assert err[0] == ("error: --model.init_args.backbone.n_layers comes before --config, which chooses the model and "
                      "data classes its options belong to: put --config first (options apply in the order given)")
    err = _main(capsys, monkeypatch, "test", "--data.init_args.batch_size=4", "-c", str(GENOME))
    assert err[0].startswith("error: --data.init_args.batch_size comes before --config")
    assert cli._option_before_config(["fit", "--trainer.max_steps", "1", "--config", "x.yaml"]) is None
    assert cli._option_before_config(["fit", "--config", "x.yaml", "--model.init_args.d", "1"]) is None
    assert cli._option_before_config(["fit", "--model.init_args.d", "1"]) is None  # no config: jsonargparse's error


def test_fit_without_validation_does_not_warn_about_the_best_checkpoint(tmp_path):
    """A fit that ends before any validation (here ``limit_val_batches: 0``, validation due every epoch) writes
    ``last.ckpt`` and keeps no best checkpoint, without Lightning's "could not find the monitored key" warning
    (a user test saw it in every short ImageNet fit)."""
    import warnings

    from mixlab.cli import MixlabCLI

    runs = tmp_path / "runs"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        MixlabCLI(args=["fit", "--config", str(DIGITS), *TINY[1:2], *TINY[4:], "--trainer.max_steps=2",
                        "--trainer.limit_val_batches=0", "--trainer.check_val_every_n_epoch=1",
                        "--data.init_args.batch_size=8", "--run_root", str(runs)])
    assert not [str(w.message) for w in caught if "monitored key" in str(w.message)]
    ckpts = runs / "digits" / "goat2d" / "version_0" / "checkpoints"
    assert [p.name for p in ckpts.glob("*.ckpt")] == ["last.ckpt"]
    assert torch.load(ckpts / "last.ckpt", weights_only=False)["global_step"] == 2


@pytest.mark.parametrize(("option", "value", "line"), [
    ("lr", "-1", "error: --model.init_args.optim.lr: optim.lr must be > 0; got -1.0"),
    ("betas", "[0.9, 1.5]", "error: --model.init_args.optim.betas: optim.betas must be two values in [0, 1); got "
                            "(0.9, 1.5)"),  # the list given, shown as the tuple the option holds
    ("warmup_steps", "-5", "error: --model.init_args.optim.warmup_steps: optim.warmup_steps must be >= 0; got -5"),
    ("weight_decay", "-1", "error: --model.init_args.optim.weight_decay: optim.weight_decay must be >= 0; got -1.0"),
    ("min_lr_ratio", "2", "error: --model.init_args.optim.min_lr_ratio: optim.min_lr_ratio must be in [0, 1]; got "
                          "2.0"),
])
def test_bad_optimizer_values_are_one_line_errors(capsys, monkeypatch, tmp_path, option, value, line):
    """Optimizer values AdamW or the schedule cannot use end the command with a line naming the field, before
    any run folder is made (a user test got torch's ``Invalid learning rate`` traceback, or no word at all)."""
    err = _main(capsys, monkeypatch, "fit", "--config", str(TEXT), *TINY, f"--model.init_args.optim.{option}", value,
                "--trainer.max_steps=1", "--run_root", str(tmp_path / "runs"))
    assert err[0] == line, err
    assert not list((tmp_path / "runs").glob("*/*/version_*"))


def test_a_command_without_a_config_says_to_give_one(capsys, monkeypatch, tmp_path):
    """``fit`` with options but no ``--config`` listed the missing ``fit.data, fit.model`` (a user test): it now
    says to give a task config, with an example."""
    monkeypatch.chdir(tmp_path)
    err = _main(capsys, monkeypatch, "fit", "--trainer.max_steps", "2")
    assert err[-1] == ("error: the following arguments are required: fit.data, fit.model: give a task config, e.g. "
                       "python -m mixlab fit --config configs/genome/goat.yaml (configs/ holds one per task and mixer)")
    assert list(tmp_path.iterdir()) == []


def test_a_bad_precision_lists_every_value_lightning_takes(capsys, monkeypatch, tmp_path):
    """``--trainer.precision 17`` named only ``Literal[64, 32, 16]`` (a user test), not the strings the README uses."""
    err = _main(capsys, monkeypatch, "fit", "--config", str(GENOME), "--trainer.precision", "17",
                "--run_root", str(tmp_path / "runs"))
    assert err[-1].startswith("error: --trainer.precision: one of 64, 32, 16, ") and err[-1].endswith("; got 17")
    assert all(v in err[-1] for v in ("bf16-mixed", "16-mixed", "bf16-true", "32-true")), err
    assert not (tmp_path / "runs").exists()


def test_validate_without_a_checkpoint_warns_that_the_weights_are_untrained(caplog, monkeypatch, tmp_path):
    """A user test: ``validate --run_name noval`` without ``--ckpt_path`` wrote a run of an untrained model, which
    ``compare`` then listed, without a word."""
    import logging

    monkeypatch.setattr(sys, "argv", ["mixlab"])
    with caplog.at_level(logging.WARNING, logger="mixlab.cli"):
        cli.main(["validate", "--config", str(TEXT), *TINY, "--data.init_args.context_length=16",
                  "--trainer.limit_val_batches=1", "--run_root", str(tmp_path)])
    assert "validate without --ckpt_path evaluates the model's initial (untrained) weights" in caplog.text


def test_a_run_on_no_batch_is_one_line_and_leaves_no_run_folder(capsys, monkeypatch, tmp_path):
    """A user test: a batch size above the training split's size, or ``limit_train_batches 0``, ended with
    Lightning's "No training batches" (or nothing) and exit status 0, leaving a run folder without a checkpoint;
    ``validate`` on an empty val split printed no metric, exit 0."""
    runs = tmp_path / "runs"
    base = ["--config", str(GENOME), *TINY, "--trainer.max_steps=1", "--run_root", str(runs)]
    err = _main(capsys, monkeypatch, "fit", *base, "--data.init_args.batch_size=1000000000")
    assert err[-2].startswith("error: data: the train split gives no batch: its ") and err[-2].endswith(
        " samples make no batch of data.init_args.batch_size=1000000000 (the last partial batch is dropped); fit "
        "trained nothing (lower data.init_args.batch_size or give the train split data)"), err
    err = _main(capsys, monkeypatch, "fit", *base, "--trainer.limit_train_batches=0")
    assert err[-2] == "error: trainer.limit_train_batches is 0: fit ran on no batch and trained nothing"
    err = _main(capsys, monkeypatch, "validate", *base, "--trainer.limit_val_batches=0")
    assert err[-2] == "error: trainer.limit_val_batches is 0: validate ran on no batch and measured nothing"
    assert sorted(p.name for p in runs.rglob("*")) == []
    from mixlab.cli import no_batches

    class Trainer:  # a split with data
        interrupted, limit_test_batches, num_test_batches = False, 1.0, [3]

    assert no_batches("test", Trainer()) is None and no_batches("predict", Trainer()) is None
    Trainer.num_test_batches = []  # the loop did not run (a test that stubs Trainer.test): nothing to say
    assert no_batches("test", Trainer()) is None


def test_out_of_range_seed_and_trainer_counts_are_one_line(capsys, monkeypatch, tmp_path):
    """A user test: ``--seed_everything -1`` / ``10**20`` were Lightning tracebacks, ``accumulate_grad_batches 0`` a
    ZeroDivisionError, and ``-1`` for it or for ``log_every_n_steps`` trained without a word."""
    runs = tmp_path / "runs"
    base = ["--config", str(GENOME), *TINY, "--trainer.max_steps=1", "--run_root", str(runs)]
    for seed in ("-1", str(10**20)):
        err = _main(capsys, monkeypatch, "fit", *base, f"--seed_everything={seed}")
        assert err[-2] == f"error: --seed_everything {seed}: a seed in [0, 4294967295] (true: a random one, false: " \
                          "no seeding)"
    for option, value, least in (("accumulate_grad_batches", 0, 1), ("accumulate_grad_batches", -1, 1),
                                 ("log_every_n_steps", -1, 0)):
        err = _main(capsys, monkeypatch, "fit", *base, f"--trainer.{option}={value}")
        assert err[-2] == f"error: trainer.{option}={value}: give an integer >= {least}"
    assert sorted(p.name for p in runs.rglob("*")) == []


def test_sigterm_while_starting_is_one_line(tmp_path):
    """A user test: SIGTERM in the first seconds of ``python -m mixlab`` (the imports) ended the process with no word.
    Now one line and status 143, and nothing is written."""
    import signal
    import subprocess
    import time

    proc = subprocess.Popen([sys.executable, "-m", "mixlab", "fit", "--config", str(GENOME), "--run_root",
                             str(tmp_path / "runs")], stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    time.sleep(0.5)  # inside `import mixlab` (torch, Lightning)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM
    assert err.strip().splitlines()[-1] in ("mixlab: SIGTERM while starting: stopped; nothing saved",
                                            # a slow start on a busy machine: set-up had begun
                                            "mixlab: SIGTERM: stopped at once (outside the training and evaluation "
                                            "loops: set-up or teardown); nothing saved")
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").rglob("version_*"))


def test_a_group_that_is_not_a_mapping_and_a_bad_file_value_overridden_later_name_the_file(capsys, monkeypatch,
                                                                                            tmp_path):
    """User tests: ``trainer: [1, 2]`` in a config file was accepted and reset every trainer setting (a 3-step run
    trained on until killed); ``max_steps: 3.0`` in a file followed by ``--trainer.max_steps 3`` blamed the command
    line's valid 3 (jsonargparse checks each file as it reads it)."""
    listed, floated = tmp_path / "listed.yaml", tmp_path / "floated.yaml"
    listed.write_text("trainer: [1, 2]\n")
    floated.write_text("trainer:\n  max_steps: 3.0\n")
    err = _main(capsys, monkeypatch, "fit", "--config", str(GENOME), "--config", str(listed))
    assert err == [f"error: {listed}: trainer: holds a list ([1, 2]), not a mapping of options (e.g. trainer: {{...}})"]
    err = _main(capsys, monkeypatch, "fit", "--config", str(GENOME), "--config", str(floated), "--trainer.max_steps",
                "3")
    assert err == [f"error: {floated}: trainer.max_steps: expected an int; got 3.0"]


@pytest.mark.parametrize("delay", [0.5, 3.0])
def test_ctrl_c_while_starting_is_one_line(tmp_path, delay):
    """A user test: Ctrl-C about 1 s and 3-3.5 s after ``python -m mixlab fit`` started printed a 37-131 line
    traceback (the imports, jsonargparse's parser set-up). Now one ``mixlab: ...`` line and status 130 whenever
    it lands (later: Lightning's loop, which stops at the end of the step)."""
    import signal
    import subprocess
    import time

    proc = subprocess.Popen([sys.executable, "-m", "mixlab", "fit", "--config", str(GENOME), "--run_root",
                             str(tmp_path / "runs"), "--trainer.max_steps", "3"], stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=180)
    # 0: the 3 steps were done before the signal came; -SIGINT: it came while the finished process exited
    assert proc.returncode in (128 + signal.SIGINT, 0, -signal.SIGINT), err
    assert "Traceback" not in err, err
    if proc.returncode == 128 + signal.SIGINT:
        assert err.strip().splitlines()[-1].startswith("mixlab: "), err


def test_ctrl_c_to_the_process_group_stops_at_a_step_end_with_loader_workers(tmp_path):
    """A terminal's Ctrl-C reaches the whole process group: the DataLoader workers as well as the main process,
    which now stops at the end of its running step and saves it. The workers ignore it (they used to exit, and the
    main process's next batch failed) and print nothing (forked, they had inherited the main process's handler)."""
    import os
    import signal
    import subprocess
    import threading
    import time

    proc = subprocess.Popen([sys.executable, "-m", "mixlab", "fit", "--config", str(GENOME), "--run_root",
                             str(tmp_path / "runs"), "--trainer.max_steps", "100000", "--data.init_args.num_workers",
                             "2", "--trainer.enable_progress_bar", "false"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    deadline = time.monotonic() + 240
    while not any("Total Flops" in line or "Total FLOPs" in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(4)  # into the training steps
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(timeout=10)
    err = "".join(lines)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert err.count("mixlab: Ctrl-C: stopping at the end of the running step") == 1, err
    assert "Traceback" not in err and "worker" not in err.lower(), err
    ckpt = next((tmp_path / "runs").rglob("last.ckpt"))
    step = torch.load(ckpt, weights_only=False)["global_step"]
    assert f"mixlab: interrupted (Ctrl-C) at step {step}; {ckpt.relative_to(tmp_path)} holds step {step}" in err or \
        f"holds step {step}" in err, err


def test_an_unquoted_brace_pattern_in_a_config_file_gets_a_quoting_hint(capsys, monkeypatch, tmp_path):
    """A user test: ``fasta: {a,b}.fa`` in a YAML file is not valid YAML and ``fasta: {a.fa,b.fa}`` is a mapping;
    both errors now say to quote the value, with the value quoted."""
    bad, mapping = tmp_path / "bad.yaml", tmp_path / "mapping.yaml"
    bad.write_text("data:\n  init_args:\n    fasta: {x/a,x/b}.fa  # two files\n")
    mapping.write_text("data:\n  init_args:\n    fasta: {x/a.fa,x/b.fa}\n")
    hint = "a value that starts with { is a YAML mapping: quote a brace pattern, e.g. fasta: "
    (line,) = _main(capsys, monkeypatch, "fit", "--config", str(GENOME), "--config", str(bad))
    assert line.startswith(f"error: {bad}: not valid YAML (") and line.endswith(f'{hint}"{{x/a,x/b}}.fa"')
    indent = tmp_path / "indent.yaml"  # a user test: not a brace pattern, no quoting advice
    indent.write_text("trainer:\n  max_steps: 3\n limit_val_batches: [1,\n")
    (line,) = _main(capsys, monkeypatch, "fit", "--config", str(GENOME), "--config", str(indent))
    assert line.startswith(f"error: {indent}: not valid YAML (") and "brace pattern" not in line
    (line,) = _main(capsys, monkeypatch, "fit", "--config", str(GENOME), "--config", str(mapping))
    assert line == (f"error: {mapping}: data.init_args.fasta: expected a string or null; got a YAML mapping "
                    f"{{'x/a.fa': None, 'x/b.fa': None}}; {hint}\"{{x/a.fa,x/b.fa}}\"")


def test_null_one_level_inside_an_init_args_field_unsets_it(capsys, monkeypatch):
    """``--model.init_args.optim.total_steps null`` was refused (``expected an int or null; got None``, a user
    test: jsonargparse re-reads the value from text, where null became ``None``). It now unsets the value and keeps
    the field's other values; ``--key=~`` too. An option that takes no null still says so."""
    head = ["fit", "--config", str(GENOME)]
    rest = ["--model.init_args.backbone.d_model", "null", "--trainer.max_steps", "null"]  # an int; not nested
    words = head + ["--model.init_args.optim.total_steps", "null", "--model.init_args.optim.fused=~"] + rest
    assert cli.nested_nulls(words) == head + ["--model.init_args.optim", '{"total_steps": null}',
                                              "--model.init_args.optim", '{"fused": null}'] + rest
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", "--config", str(GENOME), "--model.init_args.optim.total_steps", "9",
                  "--model.init_args.optim.fused", "true", "--model.init_args.optim.total_steps", "null",
                  "--model.init_args.optim.fused=~", "--print_config"])
    assert info.value.code in (0, None)
    optim = yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]["optim"]
    assert optim["total_steps"] is None and optim["fused"] is None
    assert (optim["lr"], optim["weight_decay"], optim["warmup_steps"]) == (2e-3, 0.1, 60)  # the config's, kept
    err = _main(capsys, monkeypatch, "fit", "--config", str(GENOME), "--model.init_args.backbone.d_model", "null")
    assert err[-1] == ("error: --model.init_args.backbone.d_model: null is not a value this option takes; give one, "
                       "or leave the key out for its default")
