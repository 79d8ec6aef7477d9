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
    assert rows[0] == ["model", "train_len (tokens)", "16", "32"]  # length columns: what reproduce.py reads
    assert rows[1] == ["a", "16", "2.000", "3.500"] and rows[2] == ["b", "16", "1.250", ""]
    lines = md.splitlines()  # the Markdown table names its units: perplexity at a length in tokens
    assert lines[0].startswith("Perplexity (exp of the mean next-token NLL in nats/token")
    assert lines[2] == "| model | train length (tokens) | PPL@16 | PPL@32 |"
    assert lines[4] == "| a | 16 | 2.000 | 3.500 |" and lines[5] == "| b | 16 | 1.250 |  |"


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
    assert rows[0] == ["model", "train_len (tokens)", "16", "32"] and rows[1][0] == "tiny"


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
    (tmp_path / "p.fa").write_text(">x\nACGT\n")
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
        f"of 1600001 tokens (lower --lengths, or evaluate a longer text with --data-path)")
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


def _fit_text(ckpt: Path, steps: int = 1) -> Path:
    model = tiny_lm("goat").train()
    dm = TextDataModule(tokenizer="byte", context_length=16, batch_size=4, max_val_windows=2)
    trainer = pl.Trainer(max_steps=steps, limit_val_batches=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(model, datamodule=dm)
    trainer.save_checkpoint(ckpt)
    return ckpt


@pytest.fixture(scope="module")
def run_ckpt(tmp_path_factory) -> Path:
    """A byte-level text LM (context 16) in the CLI's run layout: ``<runs>/text/goat/version_0/checkpoints``."""
    root = tmp_path_factory.mktemp("runs")
    return _fit_text(root / "text" / "goat" / "version_0" / "checkpoints" / "last.ckpt")


def _ppl(ckpt: Path, length: int, windows: int = 2, **data) -> float:
    """exp(mean NLL) over ``windows`` val windows of ``length`` tokens, recomputed without the command."""
    from mixlab.eval.common import load_run

    dm = TextDataModule(**{"tokenizer": "byte", "context_length": 16, "max_val_windows": 2, **data})
    nll, n = L.position_nll(load_run(ckpt).model, dm.windows("val", length + 1, max_windows=windows), chunk=None)
    return math.exp(nll.sum() / (n * length))


def test_only_the_standard_protocol_is_recorded_in_the_run_folder(run_ckpt, tmp_path, capsys):
    """A user test: ``--data-path other.txt`` wrote ``length/ppl`` into the run's length_extrapolation/tb, where
    ``mixlab compare`` showed it as the text task's PPL@<len> next to PPLs on the training data; and each repeated
    evaluation added an event file (duplicated scalars). Now only the checkpoint's own data goes into the run folder
    (replacing the earlier events); other data only into --out, whose default is outside the run compare reads."""
    from mixlab.eval.compare import collect, load_scalars

    runs, run_dir = run_ckpt.parents[4], run_ckpt.parents[2]  # <runs>, <runs>/text/goat (what compare reads)
    le = run_ckpt.parents[1] / "length_extrapolation"
    base = ["--ckpt", str(run_ckpt), "--lengths", "1", "2", "--max-windows", "2", "--device", "cpu"]
    for _ in range(2):  # the second evaluation replaces the first one's events
        res = L.main(base)
        assert len(list((le / "tb").glob("events.out.tfevents.*"))) == 2  # the scalars and the figure
        ppl = load_scalars(run_dir)["length/ppl"]
        assert [step for _, step, _ in ppl] == [16, 32]
        assert [value for _, _, value in ppl] == pytest.approx([res["goat"][16], res["goat"][32]])
    assert math.isclose(res["goat"][32], _ppl(run_ckpt, 32), rel_tol=1e-4)
    own = dict(res["goat"])
    # a user test: another length alone replaced them all; now the lengths it does not measure again stay
    res = L.main([*base[:3], "1.5", *base[5:]])
    ppl = load_scalars(run_dir)["length/ppl"]
    assert sorted(step for _, step, _ in ppl) == [16, 24, 32]
    assert dict((step, value) for _, step, value in ppl) == pytest.approx({16: own[16], 24: res["goat"][24],
                                                                           32: own[32]})
    assert {tag for tag in load_scalars(run_dir) if tag.startswith("position_nll/")} == {
        "position_nll/len_16", "position_nll/len_24", "position_nll/len_32"}
    # another text: not in the run folder; the default --out is outside <runs>/text/goat; one line says why
    other = tmp_path / "other.txt"
    other.write_text((Path(L.__file__).parents[1] / "data" / "tinyshakespeare.txt").read_text()[-20000:])
    before = tree(run_dir)
    capsys.readouterr()
    res = L.main([*base, "--data-path", str(other), "--smooth", "100000"])
    stdout, stderr = capsys.readouterr()
    assert tree(run_dir) == before
    out = runs / "length_extrapolation" / "text_goat_version_0_data-other.txt"
    assert (f"not recorded for mixlab compare: measured with --data-path {other}, not on the checkpoint's own "
            f"validation data; the results are only in {out}") in stdout
    assert "note: --smooth 100000 is more than half the 32 positions of the longest windows; the NLL curve is " \
           "averaged over 16 positions" in stderr
    assert math.isclose(res["goat"][16], _ppl(run_ckpt, 16, path=str(other)), rel_tol=1e-4)
    assert res["goat"][16] != pytest.approx(own[16])
    scalars = load_scalars(out / "tb" / "goat")["length/ppl"]
    assert [step for _, step, _ in scalars] == [16, 32]
    assert [value for _, _, value in scalars] == pytest.approx([res["goat"][16], res["goat"][32]])
    table = collect(runs, tasks=["text"]).table["goat"]  # compare: the run's own PPLs only
    assert table[("text", "PPL@16")] == pytest.approx(own[16]) and table[("text", "PPL@32")] == pytest.approx(own[32])
    # --split test / --tokenizer: not the standard protocol either; an --out inside the run compare reads is refused
    for extra, why in ((["--split", "test"], "--split test"), (["--tokenizer", "byte"], "--tokenizer byte")):
        with pytest.raises(SystemExit):
            L.main([*base, *extra, "--out", str(run_dir / "le")])
        assert (f"--out {run_dir / 'le'} is inside the run folder {run_dir}, where mixlab compare reads every event "
                f"file as the run's own: a perplexity measured with {why} would sit") in capsys.readouterr().err
    assert tree(run_dir) == before


def _cli_error(capsys, monkeypatch, argv: list[str]) -> str:
    import sys

    from mixlab import cli

    monkeypatch.setattr(sys, "argv", ["mixlab"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli.main(["length-extrapolation", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert not any("Traceback" in line for line in err), err
    return err[0]


def test_bad_values_are_one_line_errors_before_anything_is_written(run_ckpt, tmp_path, capsys, monkeypatch):
    """A user test: --train-length 0 was taken as not given, --smooth 0 / -1, --labels "" and a --labels count other
    than the checkpoints' were accepted; --out that is a file (or under one) failed after the evaluation;
    --device foo, --data-path /nope, an empty --data-path file and --tokenizer gpt2 on a byte LM named internals or
    gave tracebacks."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "empty.txt").write_text("")
    before, runs = tree(tmp_path), run_ckpt.parents[4]
    before_runs = tree(runs)
    base = ["--ckpt", str(run_ckpt), "--lengths", "1", "--max-windows", "1", "--device", "cpu",
            "--out", str(tmp_path / "out")]
    prog = "python -m mixlab length-extrapolation: error: "
    for argv, message in (
            (["--train-length", "0"], "--train-length must be positive (>= 2 tokens); got 0"),
            (["--train-length", "1"], "--train-length must be positive (>= 2 tokens); got 1"),
            (["--smooth", "0"], "--smooth must be >= 1 (positions of the moving average); got 0"),
            (["--smooth", "-4"], "--smooth must be >= 1 (positions of the moving average); got -4"),
            (["--labels", ""], "--labels: label 1 ('') is empty; give each --ckpt a name"),
            (["--labels"], "--labels has 0 entries for 1 --ckpt"),
            (["--labels", "a", "b"], "--labels has 2 entries for 1 --ckpt"),
            (["--lengths", "nan"], "--lengths must be positive; got [nan]"),
            (["--lengths", "inf"], "--lengths must be finite; got [inf]"),
            (["--lengths", "1", "2", "1"], "--lengths lists 1 twice; give each multiple once"),
            (["--out", str(tmp_path / "afile")], f"--out {str(tmp_path / 'afile')!r} is a file; give a folder"),
            (["--out", str(tmp_path / "afile" / "sub")],
             f"--out {str(tmp_path / 'afile' / 'sub')!r} cannot be written: {str(tmp_path / 'afile')!r} is a file, "
             "not a folder"),
            (["--out", ""], "--out is empty; give a folder path"),
            (["--device", "foo"], "--device 'foo' is not a device: use cpu, cuda or cuda:N"),
            (["--data-path", "/nope"], "--data-path: '/nope' matches no file")):
        assert _cli_error(capsys, monkeypatch, [*base, *argv]) == f"{prog}{message} (--help lists the options)", argv
    for argv, message in (  # found once the checkpoint is read; still before anything is written
            (["--lengths", "0.01"], f"--lengths 0.01: 0 tokens at the training length 16 of --ckpt {run_ckpt}; give "
                                    "multiples of at least one token"),
            (["--lengths", "1", "1.01"], f"--lengths 1 and 1.01 are both 16 tokens at the training length 16 of --ckpt "
                                         f"{run_ckpt}; give each length once"),
            (["--tokenizer", "gpt2"], f"--tokenizer gpt2: its 50257 token ids do not fit the 257-token vocabulary of "
                                      f"--ckpt {run_ckpt} (trained with tokenizer 'byte')"),
            (["--data-path", str(tmp_path / "empty.txt")], f"--data-path {tmp_path / 'empty.txt'}: file is empty")):
        assert _cli_error(capsys, monkeypatch, [*base, *argv]) == f"error: {message}", argv
    assert tree(tmp_path) == before and tree(runs) == before_runs


def test_lengths_that_cannot_fit_in_memory_are_refused_naming_the_number(run_ckpt, tmp_path, capsys, monkeypatch):
    """A user test: ``passkey --lengths 100000000`` was OOM-killed after 88 s at 23 GB. Each length's memory is
    estimated up front (:func:`forward_bytes`) against the memory free on --device."""
    from mixlab.eval import common
    from mixlab.eval.common import load_run

    model = load_run(run_ckpt).model
    before = tree(run_ckpt.parents[4])
    base = ["--ckpt", str(run_ckpt), "--device", "cpu", "--out", str(tmp_path / "out")]
    need = L.forward_bytes(model, 2, 16 * 10**9, 16, L._PER_TOKEN)
    free = common.free_bytes("cpu")
    assert need > free
    err = _cli_error(capsys, monkeypatch, [*base, "--lengths", "1e9", "--max-windows", "4"])
    assert err == (f"error: --lengths 1e+09 (16000000000 tokens): the evaluation needs about {need / 2**30:.3g} GiB (2 "
                   f"sequence(s) of 16000000000 tokens: caches, activations and logits of the chunked forward), more "
                   f"than the {free / 2**30:.3g} GiB free on cpu; lower --lengths")
    # with a batch of 2 windows over the free memory and one window under it: --batch-size is the way out
    one, two = (L.forward_bytes(model, b, 32, 16, L._PER_TOKEN) for b in (1, 2))
    assert max(one, L.forward_bytes(model, 2, 16, 16, L._PER_TOKEN)) < two - 1
    monkeypatch.setattr(common, "free_bytes", lambda device: two - 1)
    err = _cli_error(capsys, monkeypatch, [*base, "--lengths", "1", "2", "--max-windows", "2"])
    assert err.startswith(f"error: --lengths 2 (32 tokens): the evaluation needs about {two / 2**30:.3g} GiB (2 "
                          "sequence(s) of 32 tokens") and err.endswith(
        f"; lower --lengths or --batch-size (1 sequence at a time: about {one / 2**30:.3g} GiB)")
    assert tree(run_ckpt.parents[4]) == before and not (tmp_path / "out").exists()
    res = L.main([*base, "--lengths", "1", "2", "--max-windows", "2", "--batch-size", "1"])
    assert sorted(res["goat"]) == [16, 32]


def test_forward_estimates_bound_the_caches_and_count_attention_flops(capsys):
    """:func:`forward_bytes` is at least the caches a chunked forward really holds, and not far above them;
    :func:`forward_flops` is 2 x parameters per token plus 2 d T^2 per attention layer."""
    model = tiny_lm("goat")
    b, t, c = 2, 256, 16
    caches = [{} for _ in model.backbone.blocks]
    with torch.no_grad():
        tokens = torch.randint(0, 257, (b, t))
        for s in range(0, t, c):
            model(tokens[:, s:s + c], None, caches)
    held = sum(v.numel() * v.element_size() for cache in caches for v in cache.values() if isinstance(v, torch.Tensor))
    assert held > 0
    est = L.forward_bytes(model, b, t, c)
    assert held <= est <= 4 * held + b * c * 3 * 4 * 257 + 5 * c * t + 64 * t * len(caches) + 10**6
    assert L.forward_bytes(model, 2 * b, t, c) > est  # grows with the batch and the length
    assert L.forward_bytes(model, b, 2 * t, c) > est
    params = sum(p.numel() for p in model.parameters())
    assert L.forward_flops(model, 1000) == pytest.approx(2.0 * params * 1000 + 2 * (2.0 * 32 * 1000 * 1000))
    assert not L.note_long_run("x", 5e11, "cpu") and capsys.readouterr().err == ""
    assert L.note_long_run("x", 7.2e13, "cpu")
    assert capsys.readouterr().err == ("note: x: about 7.2e+13 floating-point operations in all (attention's share "
                                       "grows with the square of the length): expect a long run (some 2 hours at "
                                       "1e+10 operations/s)\n")


def test_smoothing_wider_than_the_curve_keeps_half_of_it(tmp_path):
    """A user test: ``--smooth 100000`` drew an empty plot (a moving average as wide as the curve is one point)."""
    curve = np.linspace(3.0, 1.0, 32)
    assert L.smoothing_width(100000, 32) == 16 and L.smoothing_width(4, 32) == 4 and L.smoothing_width(5, 1) == 1
    fig = L.plot_position_nll({"a": curve}, {"a": 16}, tmp_path / "p.png", smooth=100000)
    x, y = fig.axes[0].lines[0].get_data()
    assert len(y) == 17 and y[0] == pytest.approx(curve[:16].mean()) and x[0] == pytest.approx(8.5)


def test_rows_are_labelled_by_the_run_folder(run_ckpt, tmp_path):
    """A user test: a run trained with ``--run_name base`` was labelled ``goat`` (its mixer), while ``--help`` says
    the default label is the run name."""
    import shutil

    shutil.copytree(run_ckpt.parents[2], tmp_path / "runs" / "text" / "base")
    ckpt = tmp_path / "runs" / "text" / "base" / "version_0" / "checkpoints" / run_ckpt.name
    res = L.main(["--ckpt", str(ckpt), "--lengths", "1", "--max-windows", "2", "--device", "cpu", "--out",
                  str(tmp_path / "out")])
    assert list(res) == ["base"]
