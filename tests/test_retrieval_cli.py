"""``python -m mixlab passkey`` / ``niah``: the wrong kind of checkpoint and bad option values are one-line
errors (exit status 2) that leave the output folders as they were."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers.failures import fail_on_call, tree

from mixlab import cli
from mixlab.backbone import BackboneConfig
from mixlab.datamodules import retrieval as RT
from mixlab.datamodules.text import TextDataModule
from mixlab.eval import retrieval as E
from mixlab.heads.lm import CausalLM
from mixlab.heads.synthetic import SyntheticLM
from mixlab.optim import OptimConfig

GENOME = Path(__file__).parent / "fixtures" / "genome_fg2gdn_goat.ckpt"


def _fit(model, dm, ckpt: Path) -> Path:
    trainer = pl.Trainer(max_steps=1, limit_val_batches=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(model, datamodule=dm)
    trainer.save_checkpoint(ckpt)
    return ckpt


def _backbone() -> BackboneConfig:
    return BackboneConfig(d_model=16, n_layers=1, n_heads=2, mixer="goat",
                          mixer_args={"goat": {"position_args": {"n_modes": 2}}})


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    torch.manual_seed(0)
    passkey = _fit(SyntheticLM(75, _backbone(), OptimConfig(lr=1e-2, warmup_steps=1), span_weight=10.0),
                   RT.RetrievalDataModule("passkey", context_length=64, batch_size=4, n_train=8, n_val=4, n_test=4),
                   root / "pk" / "checkpoints" / "last.ckpt")
    text = _fit(CausalLM(vocab_size=257, backbone=_backbone(), optim=OptimConfig(lr=1e-2, warmup_steps=1)),
                TextDataModule(tokenizer="byte", context_length=16, batch_size=4, max_val_windows=2),
                root / "text" / "checkpoints" / "last.ckpt")
    return {"passkey": passkey, "text": text}


def _one_line_error(capsys, monkeypatch, argv: list[str]) -> str:
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert not any("Traceback" in line for line in err), err
    return err[0]


def test_a_checkpoint_that_is_no_retrieval_lm_is_refused_before_anything_is_written(ckpts, tmp_path, capsys,
                                                                                     monkeypatch):
    """A user test: a genome LM gave an IndexError traceback and left tb/passkey_noise/events...; a byte-level
    text LM silently wrote a table of zeros."""
    before = tree(ckpts["text"].parents[1])
    for task in ("passkey", "niah"):
        for ckpt, what in ((GENOME, "a GenomeDataModule run"), (ckpts["text"], "a TextDataModule run")):
            out = tmp_path / "out"
            err = _one_line_error(capsys, monkeypatch, [task, "--ckpt", str(ckpt), "--lengths", "128",
                                                        "--out", str(out), "--device", "cpu"])
            assert err == (f"error: --ckpt {ckpt}: {what}; {task} needs a decoder LM trained on the character-level "
                           f"retrieval data (mixlab.datamodules.retrieval.RetrievalDataModule, e.g. python -m mixlab "
                           f"fit --config configs/synthetic/{task}.yaml)")
            assert not out.exists()
    err = _one_line_error(capsys, monkeypatch, ["passkey", "--ckpt", str(ckpts["text"]), "--device", "cpu"])
    assert "a TextDataModule run; passkey needs a decoder LM trained on" in err
    assert tree(ckpts["text"].parents[1]) == before  # no <run>/retrieval


@pytest.mark.parametrize("argv,message", [
    (["--samples", "0"], "--samples must be >= 1; got 0"),
    (["--batch-size", "0"], "--batch-size must be >= 1; got 0"),
    (["--chunk", "-1"], "--chunk must be >= 0; got -1"),
    (["--depths", "-0.5"], "--depths must be fractions in [0, 1] (of the haystack before the needle); got -0.5"),
    (["--depths", "0.5", "1.5"], "--depths must be fractions in [0, 1] (of the haystack before the needle); got 1.5"),
    (["--depths", "nan"], "--depths must be fractions in [0, 1] (of the haystack before the needle); got nan"),
    (["--lengths", "64", "0"], "--lengths must be >= 1 token each; got 0"),
    (["--lengths", "20"], "--lengths 20: passkey: length 20 is too short for the needle and question (50 characters)"),
])
def test_bad_option_values_are_one_line_errors_that_write_nothing(ckpts, capsys, monkeypatch, argv, message):
    run = ckpts["passkey"].parents[1]
    before = tree(run)
    err = _one_line_error(capsys, monkeypatch, ["passkey", "--ckpt", str(ckpts["passkey"]), "--lengths", "64",
                                                "--device", "cpu", *argv])
    assert err == f"error: {message}"
    assert tree(run) == before and not (run / "retrieval").exists()
    with pytest.raises(ValueError, match="^" + message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        E.passkey_main(["--ckpt", str(ckpts["passkey"]), "--lengths", "64", "--device", "cpu", *argv])


def test_a_failed_evaluation_leaves_the_output_folder_as_it_was(ckpts, capsys, monkeypatch):
    run = ckpts["passkey"].parents[1]
    out = run / "retrieval"
    (out / "tb" / "passkey_noise").mkdir(parents=True)
    (out / "tb" / "passkey_noise" / "events.out.tfevents.1.host.1.0").write_bytes(b"earlier events")
    (out / "passkey_noise.md").write_text("earlier table")
    before = tree(run)
    real = E.evaluate_cell
    calls = fail_on_call(monkeypatch, E, "evaluate_cell")
    with pytest.raises(RuntimeError, match="^evaluation failed$"):
        E.passkey_main(["--ckpt", str(ckpts["passkey"]), "--lengths", "64", "--depths", "0.2", "0.8",
                        "--samples", "1", "--device", "cpu"])
    assert len(calls) == 2 and tree(run) == before
    monkeypatch.setattr(E, "evaluate_cell", real)
    res = E.passkey_main(["--ckpt", str(ckpts["passkey"]), "--lengths", "64", "--depths", "0", "1",
                          "--samples", "1", "--device", "cpu"])  # the ends of [0, 1] are valid depths
    assert sorted(res) == [(64, 0.0), (64, 1.0)]
    assert (out / "passkey_noise.md").read_text() != "earlier table"
    assert len(list((out / "tb" / "passkey_noise").glob("events.out.tfevents.*"))) == 2
