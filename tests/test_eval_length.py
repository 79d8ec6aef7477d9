"""Length-extrapolation evaluation: chunked (cached) NLL equals the plain forward; CLI outputs."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.failures import fail_on_call, tree

from mixlab.backbone import BackboneConfig
from mixlab.datamodules.text import TextDataModule
from mixlab.eval import length as L
from mixlab.eval.common import chunked_logits
from mixlab.heads.lm import CausalLM
from mixlab.optim import OptimConfig


def tiny_lm(mixer: str, vocab: int = 257) -> CausalLM:
    torch.manual_seed(0)
    bb = BackboneConfig(d_model=32, n_layers=2, n_heads=2, mixer=mixer,
                        mixer_args={"goat": {"position_args": {"n_modes": 2, "init": "random"}}})
    return CausalLM(vocab_size=vocab, backbone=bb, optim=OptimConfig(lr=1e-2, warmup_steps=1)).eval()


@pytest.mark.parametrize("mixer", ["goat", "rope"])
def test_chunked_position_nll_equals_plain_and_manual(mixer):
    model = tiny_lm(mixer)
    g = torch.Generator().manual_seed(1)
    windows = [torch.randint(0, 257, (24,), generator=g) for _ in range(3)]
    plain, n = L.position_nll(model, windows, batch_size=2, chunk=None)
    chunked, n2 = L.position_nll(model, windows, batch_size=2, chunk=7)  # 23 tokens, chunk 7: 7+7+7+2
    assert n == n2 == 3 and plain.shape == (23,)
    np.testing.assert_allclose(chunked, plain, rtol=1e-5, atol=1e-5)
    batch = torch.stack(windows)
    with torch.no_grad():
        nll = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten(), reduction="none")
    np.testing.assert_allclose(plain, nll.view(3, 23).sum(0).double().numpy(), rtol=1e-5, atol=1e-5)


def test_length_table_values():
    md, rows = L.length_table({"a": {16: 2.0, 32: 3.5}, "b": {16: 1.25}}, {"a": 16, "b": 16})
    assert rows[0] == ["model", "train_len", "16", "32"]
    assert rows[1] == ["a", "16", "2.000", "3.500"] and rows[2] == ["b", "16", "1.250", ""]
    assert md.splitlines()[2] == "| a | 16 | 2.000 | 3.500 |"


def test_length_extrapolation_cli_on_trained_checkpoint(tmp_path):
    model = tiny_lm("goat").train()
    dm = TextDataModule(tokenizer="byte", context_length=16, batch_size=4, max_val_windows=2)
    trainer = pl.Trainer(max_steps=3, limit_val_batches=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(model, datamodule=dm)
    ckpt = tmp_path / "tiny.ckpt"
    trainer.save_checkpoint(ckpt)
    out = tmp_path / "le"
    res = L.main(["--ckpt", str(ckpt), "--lengths", "1", "2", "--max-windows", "2", "--out", str(out),
                  "--smooth", "4", "--labels", "tiny"])
    assert sorted(res["tiny"]) == [16, 32]
    for f in ("length_extrapolation.md", "length_extrapolation.csv", "position_nll.png", "position_nll.csv"):
        assert (out / f).is_file() and (out / f).stat().st_size > 0
    assert list((out / "tb" / "tiny").glob("events.out.tfevents.*"))
    # the table's 2x perplexity equals exp(mean position NLL) recomputed independently
    windows = dm.windows("val", 33, max_windows=2)
    nll, n = L.position_nll(model.eval(), windows, chunk=None)
    assert math.isclose(res["tiny"][32], math.exp(nll.sum() / (n * 32)), rel_tol=1e-4)
    rows = list(csv.reader(open(out / "length_extrapolation.csv")))
    assert rows[0] == ["model", "train_len", "16", "32"] and rows[1][0] == "tiny"


def test_bad_arguments_and_non_text_runs_are_one_line_errors(tmp_path, capsys):
    fixtures = Path(__file__).parent / "fixtures"
    for argv, msg in ((["--chunk", "-3"], "--chunk must be >= 0 (0: no chunking); got -3"),
                      (["--lengths", "0"], "--lengths must be positive; got [0.0]"),
                      (["--max-windows", "0"], "--max-windows must be positive; got 0")):
        with pytest.raises(SystemExit):
            L.main(["--ckpt", str(fixtures / "genome_fg2gdn_goat.ckpt"), "--out", str(tmp_path / "x"), *argv])
        assert msg in capsys.readouterr().err
    assert not (tmp_path / "x").exists()  # nothing written on bad input
    # a genome run (with or without --data-path): one line, no TypeError from the datamodule's constructor
    for extra in ([], ["--data-path", str(tmp_path / "p.fa")]):
        with pytest.raises(ValueError, match="a GenomeDataModule run; length extrapolation evaluates decoder LMs "
                                             "trained on text"):
            L.main(["--ckpt", str(fixtures / "genome_fg2gdn_goat.ckpt"), "--out", str(tmp_path / "y"), *extra])
    with pytest.raises(ValueError, match="chunk must be >= 0 tokens"):
        next(chunked_logits(tiny_lm("rope"), torch.zeros(1, 4).long(), -1))


def test_a_failed_length_extrapolation_leaves_the_run_folder_as_it_was(tmp_path, capsys, monkeypatch):
    """A user test: a failed command (a length the data is too short for, an error during the evaluation, a
    second checkpoint that is no text LM) left a new event file in the run's length_extrapolation/tb. Now a
    too short split is found before the writer exists, and a later error removes what the command wrote (an
    overwritten table comes back) and the folders it made."""
    import shutil
    import sys

    from mixlab import cli

    model = tiny_lm("goat").train()
    dm = TextDataModule(tokenizer="byte", context_length=16, batch_size=4, max_val_windows=2)
    trainer = pl.Trainer(max_steps=1, limit_val_batches=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(model, datamodule=dm)
    ckpt = tmp_path / "v0" / "checkpoints" / "tiny.ckpt"
    trainer.save_checkpoint(ckpt)
    le = tmp_path / "v0" / "length_extrapolation"  # an earlier evaluation: table, event file, an empty folder
    (le / "tb").mkdir(parents=True)
    (le / "keep").mkdir()
    (le / "tb" / "events.out.tfevents.1.host.1.0").write_bytes(b"earlier events")
    (le / "length_extrapolation.md").write_text("earlier table")
    before = tree(tmp_path)
    args = ["--max-windows", "1", "--device", "cpu", "--ckpt", str(ckpt)]
    # a multiple the val split is too short for: one line naming --lengths, before any writer
    n_val = sum(len(a) for a in dm.token_splits()["val"])
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli.main(["length-extrapolation", *args, "--lengths", "1", "100000"])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[0] == (
        f"error: --lengths 100000 (1600000 tokens): text val split has {n_val} tokens; too short for one window "
        f"of 1600001 tokens (lower data.init_args.context_length or add data)")
    assert tree(tmp_path) == before
    # an error during the evaluation of the second length: the first one's scalars were written by then
    real = L.position_nll
    calls = fail_on_call(monkeypatch, L, "position_nll")
    with pytest.raises(RuntimeError, match="^evaluation failed$"):
        L.main([*args, "--lengths", "1", "2"])
    assert len(calls) == 2 and tree(tmp_path) == before
    monkeypatch.setattr(L, "position_nll", real)
    # a second checkpoint that is no text LM: the first one's evaluation was written by then
    genome = Path(__file__).parent / "fixtures" / "genome_fg2gdn_goat.ckpt"
    with pytest.raises(ValueError, match="a GenomeDataModule run; length extrapolation evaluates decoder LMs"):
        L.main([*args, str(genome), "--lengths", "1"])
    assert tree(tmp_path) == before
    # in a run without length_extrapolation/ and with a new --out: both folders go again
    shutil.rmtree(le)
    before = tree(tmp_path)
    for extra in ([], ["--out", str(tmp_path / "new" / "le")]):
        with pytest.raises(ValueError, match="a GenomeDataModule run"):
            L.main([*args, str(genome), "--lengths", "1", *extra])
        assert tree(tmp_path) == before, extra
    res = L.main([*args, "--lengths", "1", "--labels", "tiny"])  # the same command without the error writes
    assert sorted(res["tiny"]) == [16]
    assert sorted(p.name for p in le.iterdir()) == ["length_extrapolation.csv", "length_extrapolation.md",
                                                    "position_nll.csv", "position_nll.png", "tb"]
    assert len(list((le / "tb").glob("events.out.tfevents.*"))) == 2  # the scalars and the figure


def test_split_is_restricted_to_the_text_splits(tmp_path, capsys):
    """A user test: ``--split trian`` silently evaluated the val split (TextDataModule.windows reads every
    split name but "train" as val). Now argparse refuses it in one line, before anything is read or written;
    --help says that test is the same data as val."""
    with pytest.raises(SystemExit) as info:
        L.main(["--ckpt", str(tmp_path / "none.ckpt"), "--split", "trian", "--out", str(tmp_path / "x")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "argument --split: invalid choice: 'trian'" in err[0]
    assert not (tmp_path / "x").exists()
    with pytest.raises(SystemExit):
        L.main(["--help"])
    assert "test is the same data as val" in " ".join(capsys.readouterr().out.split())
