"""``python -m mixlab passkey`` / ``niah``: the wrong kind of checkpoint and bad option values are one-line
errors (exit status 2) that leave the output folders as they were."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
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
    (["--seed", "-1"], "--seed must be >= 0; got -1"),  # numpy's ValueError traceback before
    (["--lengths", "64", "96", "64"], "--lengths lists 64 twice; give each once (one row or column per value)"),
    (["--depths", "0.5", "0.5"], "--depths lists 0.5 twice; give each once (one row or column per value)"),
    (["--haystack", "noise", "--text", "prose.txt"], "--text is the prose of --haystack essay; with --haystack noise "
                                                     "it would be ignored: drop --text or use --haystack essay"),
    (["--text", "prose.txt"], "--text is the prose of --haystack essay; this checkpoint's haystack is 'noise' (no "
                              "--haystack given), so it would be ignored: drop --text or add --haystack essay"),
    (["--device", "foo"], "--device 'foo' is not a device: use cpu, cuda or cuda:N"),
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
    # the earlier events are replaced by this evaluation's (they were shown twice in TensorBoard)
    events = list((out / "tb" / "passkey_noise").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].name != "events.out.tfevents.1.host.1.0"


def test_a_repeated_evaluation_replaces_its_scalars_and_the_tables_give_units(ckpts, tmp_path, capsys):
    """A user test: every evaluation added an event file to tb/passkey_<haystack> (each scalar shown twice), and
    the tables' headers gave no units. Values: the table and CSV hold the metrics of :func:`evaluate_cell`."""
    from mixlab.eval.common import load_run
    from mixlab.eval.compare import load_scalars

    out = tmp_path / "ev"
    argv = ["--ckpt", str(ckpts["passkey"]), "--lengths", "64", "80", "--depths", "0.25", "0.75", "--samples", "2",
            "--batch-size", "2", "--device", "cpu", "--out", str(out)]
    for _ in range(2):
        res = E.passkey_main(argv)
        assert len(list((out / "tb" / "passkey_noise").glob("events.out.tfevents.*"))) == 1
        mean = load_scalars(out / "tb" / "passkey_noise")["passkey/span_acc_mean"]
        assert [step for _, step, _ in mean] == [64, 80]
    model = load_run(ckpts["passkey"]).model
    for (length, depth), m in res.items():
        again = E.evaluate_cell(model, "passkey", length, depth, 2, batch_size=2, chunk=64, seed=1234)
        assert m == pytest.approx(again)
    assert [v for _, _, v in mean] == pytest.approx([np.mean([res[(n, d)]["span_acc"] for d in (0.25, 0.75)])
                                                     for n in (64, 80)])
    md = (out / "passkey_noise.md").read_text().splitlines()
    assert md[0].startswith("Span token accuracy (fraction of answer characters right, 0-1; passkey, noise haystack, "
                            "2 samples per cell; training length 64 tokens)")
    assert md[2] == "| depth (fraction) | 64 tokens | 80 tokens |"
    assert md[4] == f"| 0.25 | {res[(64, 0.25)]['span_acc']:.3f} | {res[(80, 0.25)]['span_acc']:.3f} |"
    assert "| length (tokens) | strict accuracy (fraction) | span log-prob (nats per sample) |" in md
    rows = list(csv.reader(open(out / "passkey_noise.csv")))
    assert rows[0] == ["length (tokens)", "depth (fraction)", "span_acc (fraction)", "strict_acc (fraction)",
                       "span_logprob (nats per sample)"]
    assert rows[1] == ["64", "0.25", f"{res[(64, 0.25)]['span_acc']:.4f}", f"{res[(64, 0.25)]['strict_acc']:.4f}",
                       f"{res[(64, 0.25)]['span_logprob']:.4f}"]


def test_outputs_texts_and_sizes_are_checked_before_anything_is_written(ckpts, tmp_path, capsys, monkeypatch):
    """A user test: an --out that is a file (or under one) failed after the whole evaluation; an empty --text file
    said "haystack 'essay' needs text (essay_path)"; --lengths 100000000 was OOM-killed after 88 s at 23 GB, leaving
    --out/tb. Each is now one line before anything is written."""
    from mixlab.eval import common
    from mixlab.eval.common import load_run
    from mixlab.eval.length import forward_bytes

    (tmp_path / "afile").write_text("x")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("  \n\n")
    (tmp_path / "symbols.txt").write_text("\u00e9\u00e8\u00e0")  # no character of the retrieval alphabet
    run = ckpts["passkey"].parents[1]
    before, before_run = tree(tmp_path), tree(run)
    base = ["passkey", "--ckpt", str(ckpts["passkey"]), "--lengths", "64", "--depths", "0.5", "--samples", "1",
            "--device", "cpu"]
    out = ["--out", str(tmp_path / "out")]
    afile, empty = tmp_path / "afile", tmp_path / "empty.txt"
    for argv, message in (
            (["--out", str(afile)], f"--out {str(afile)!r} is a file; give a folder"),
            (["--out", str(afile / "sub")], f"--out {str(afile / 'sub')!r} cannot be written: {str(afile)!r} is a "
                                            "file, not a folder"),
            (["--out", ""], "--out is empty; give a folder path"),
            ([*out, "--haystack", "essay", "--text", str(empty)],
             f"--text {empty}: the file is empty; --haystack essay needs prose"),
            ([*out, "--haystack", "essay", "--text", str(tmp_path / "blank.txt")],
             f"--text {tmp_path / 'blank.txt'}: the file holds only white space; --haystack essay needs prose"),
            ([*out, "--haystack", "essay", "--text", str(tmp_path / "symbols.txt")],
             f"--text {tmp_path / 'symbols.txt'}: it holds no character of the retrieval alphabet (letters, digits, "
             "punctuation); --haystack essay needs prose"),
            ([*out, "--haystack", "essay", "--text", str(tmp_path / "none.txt")],
             f"--text {tmp_path / 'none.txt'}: not found; give a text file (prose for --haystack essay)")):
        assert _one_line_error(capsys, monkeypatch, [*base, *argv]) == f"error: {message}", argv
    model = load_run(ckpts["passkey"]).model
    free = common.free_bytes("cpu")
    need = forward_bytes(model, 1, 10**8, 64, E._PER_TOKEN)
    assert need > free
    assert _one_line_error(capsys, monkeypatch, [*base, *out, "--lengths", "100000000"]) == (
        f"error: --lengths 100000000: the evaluation needs about {need / 2**30:.3g} GiB (1 sequence(s) of 100000000 "
        f"tokens: caches, activations and logits of the chunked forward), more than the {free / 2**30:.3g} GiB free "
        "on cpu; lower --lengths")
    one, four = (forward_bytes(model, b, 256, 64, E._PER_TOKEN) for b in (1, 4))
    monkeypatch.setattr(common, "free_bytes", lambda device: four - 1)
    err = _one_line_error(capsys, monkeypatch, [*base, *out, "--lengths", "256", "--samples", "4"])
    assert err == (f"error: --lengths 256: the evaluation needs about {four / 2**30:.3g} GiB (4 sequence(s) of 256 "
                   "tokens: caches, activations and logits of the chunked forward), more than the "
                   f"{(four - 1) / 2**30:.3g} GiB free on cpu; lower --lengths or --batch-size (1 sequence at a time: "
                   f"about {one / 2**30:.3g} GiB)")
    assert tree(tmp_path) == before and tree(run) == before_run
