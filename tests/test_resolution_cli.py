"""``python -m mixlab resolution`` as a user test found it: what goes into the run folder for ``compare`` (the
standard protocol only, replacing earlier events), the bad input refused in one line before any evaluation, Ctrl-C,
and the units of the tables. A tiny goat2d ViT on the digits (16 px, 4 px patches), on CPU."""

from __future__ import annotations

import csv
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
from helpers.training import direct_top1

from mixlab import cli
from mixlab.eval.compare import collect
from mixlab.eval.resolution import main as resolution_main

CPU = ["--accelerator", "cpu"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A one-step goat2d ImageClassifier checkpoint (2 layers, trained at 16 px, batch size 32)."""
    import lightning.pytorch as pl

    from mixlab.datamodules.digits import DigitsDataModule
    from mixlab.heads.vit import ImageClassifier, vit_backbone

    folder = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    bb = vit_backbone("goat2d", d_model=32, n_layers=2, n_heads=2, n_modes=4, drop_path=0.0)
    model = ImageClassifier(10, 16, 4, backbone=bb)
    trainer = pl.Trainer(max_steps=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                         default_root_dir=folder)
    trainer.fit(model, DigitsDataModule(image_size=16, batch_size=32))
    trainer.save_checkpoint(folder / "last.ckpt")
    return folder / "last.ckpt"


def _in_run(tmp_path: Path, ckpt: Path) -> Path:
    """``ckpt`` copied into a run folder of the CLI's layout, ``<root>/digits/goat2d/version_0/checkpoints/``."""
    dest = tmp_path / "runs/digits/goat2d/version_0/checkpoints/last.ckpt"
    dest.parent.mkdir(parents=True)
    shutil.copy(ckpt, dest)
    return dest


def _events(folder: Path) -> list[Path]:
    return sorted(folder.glob("events.out.tfevents.*"))


def _scalars(folder: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}


def test_only_the_standard_protocol_is_recorded_for_compare(tmp_path, tiny, capsys):
    """A user test: ``--resolutions 8x40 --split test --limit-batches 1`` replaced compare's val number at 8 px."""
    ck = _in_run(tmp_path, tiny)
    record = ck.parents[1] / "resolution"
    # the standard protocol (--batch-size changes nothing): the whole val split, 270 images = 3 batches of 90
    rows = resolution_main(["--ckpt", str(ck), "--resolutions", "8", "--out", str(tmp_path / "a"), "--batch-size",
                            "90", *CPU])
    val8 = rows[0]["top1"]
    assert val8 == pytest.approx(direct_top1(str(ck), 16, 8, batches=3, batch_size=90), abs=1e-3)
    assert len(_events(record)) == 1
    assert f"goat2d: top-1 at 8 px recorded in {ck.parents[1]}/resolution for compare" in capsys.readouterr().out

    rows = resolution_main(["--ckpt", str(ck), "--resolutions", "8x40", "8", "--split", "test", "--limit-batches",
                            "1", "--out", str(tmp_path / "b"), *CPU])
    out = capsys.readouterr().out
    assert (f"goat2d: not recorded in {ck.parents[1]}/resolution for compare: --split test, --limit-batches 1, "
            f"8x40 (non-square)") in out.splitlines()
    with open(tmp_path / "b" / "resolution.csv") as f:
        assert [(r["res"], r["split"], r["limit_batches"]) for r in csv.DictReader(f)] == [("8x40", "test", "1"),
                                                                                           ("8", "test", "1")]
    md = (tmp_path / "b" / "resolution.md").read_text()
    assert md.startswith("top-1 (%) without fine-tuning: test split, the first batch;")
    assert "| run | train res (px) | top-1 @ 8x40 px (%) | top-1 @ 8 px (%) |" in md
    # --out's TensorBoard: the non-square size under its own tag, not at the step of the 8 px square
    tb = _scalars(tmp_path / "b" / "tensorboard")
    assert tb["resolution/goat2d/top1"] == {8: pytest.approx(rows[1]["top1"])}
    assert tb["resolution/goat2d/top1_width40"] == {8: pytest.approx(rows[0]["top1"])}

    cmp = collect(tmp_path / "runs")
    assert cmp.table["goat2d"] == {("digits", "top-1@8px (%)"): pytest.approx(val8, abs=1e-4)}
    assert _events(record) == _events(record)[:1] and _scalars(record)["resolution/goat2d/top1"] == \
        {8: pytest.approx(val8)}

    # a repeated evaluation replaces the earlier event file; a resolution it does not evaluate keeps its value
    rows = resolution_main(["--ckpt", str(ck), "--resolutions", "16", "--out", str(tmp_path / "c"), *CPU])
    assert "(kept from before: 8 px)" in capsys.readouterr().out
    assert len(_events(record)) == 1
    cmp = collect(tmp_path / "runs")
    assert cmp.table["goat2d"] == {("digits", "top-1@8px (%)"): pytest.approx(val8, abs=1e-4),
                                   ("digits", "top-1@16px (%)"): pytest.approx(rows[0]["top1"], abs=1e-4)}


def _error(capsys, monkeypatch, *argv: str) -> str:
    """The one ``error:`` line of ``python -m mixlab *argv`` (exit status 2)."""
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli.main(list(argv))
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    return next(line for line in lines if line.startswith("error:"))


BAD = [
    (["--batch-size", "0"], "error: --batch-size must be >= 1; got 0"),
    (["--batch-size", "-1"], "error: --batch-size must be >= 1; got -1"),
    (["--limit-batches", "0"], "error: --limit-batches must be a fraction of the batches in (0, 1) or a whole count "
                               ">= 1; got 0"),
    (["--limit-batches", "-1"], "error: --limit-batches must be a fraction of the batches in (0, 1) or a whole count "
                                ">= 1; got -1"),
    (["--limit-batches", "2.5"], "error: --limit-batches must be a fraction of the batches in (0, 1) or a whole count "
                                 ">= 1; got 2.5"),
    (["--out", "{file}"], "error: --out '{file}' is a file; give a folder"),
    (["--out", "{file}/sub"], "error: --out '{file}/sub' cannot be written: '{file}' is a file, not a folder"),
    (["--data-arg", "foo=bar"], "error: --data-arg foo: DigitsDataModule takes no argument 'foo' (it takes "
                                "image_size, eval_size, batch_size, val_fraction, test_fraction, seed, augment, "
                                "num_workers, path)"),
    (["--data-arg", "eval_size=8"], "error: --data-arg eval_size: the evaluation size is set by --resolutions"),
    (["--accelerator", "tpux"], "error: --accelerator 'tpux' is not an accelerator Lightning knows; use one of auto, "
                                "cpu, gpu, cuda, mps, tpu"),
    (["--precision", "foo"], "error: --precision 'foo' is not a Lightning precision; use one of transformer-engine, "
                             "transformer-engine-float16, 16-true, 16-mixed, bf16-true, bf16-mixed, 32-true, 64-true, "
                             "64, 32, 16, bf16"),
    (["--precision", "16-mixed"], "error: --precision 16-mixed (float16 mixed precision) needs CUDA; on the CPU "
                                  "Lightning would run bf16-mixed instead: use bf16-mixed or 32-true on the CPU"),
    (["--prior-layer", "99"], "error: --prior-layer 99: --ckpt {ckpt} has 2 layers (0..1); -1 renders none"),
    (["--prior-layer", "-2"], "error: --prior-layer must be >= -1; got -2"),
    # 16 GiB free (patched): 32 images of 3 x 40000 x 40000 float32 pixels alone are 572 GiB
    (["--resolutions", "40000"], "error: --resolutions 40000: 100,000,001 tokens per image (10000x10000 patches of "
                                 "4 px + 1 [CLS]); one batch of 32 needs at least 1,335.1 GiB (images and two "
                                 "[B, T, 32] activations), more than the 16.0 GiB free on cpu; give smaller "
                                 "resolutions or a smaller --batch-size"),
    (["--split", "test", "--out", "{run}/eval"],
     "error: --out {run}/eval is inside the run folder {run}, where compare would read these numbers (--split test) "
     "as that run's top-1@<res>px; give a folder outside the runs (e.g. runs/resolution)"),
]


@pytest.mark.parametrize(("args", "line"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_before_any_evaluation(capsys, monkeypatch, tmp_path, tiny, args, line):
    import mixlab.eval.common
    import mixlab.eval.resolution

    ck = _in_run(tmp_path, tiny)
    run = ck.parents[1]
    (tmp_path / "file").write_text("")
    fill = {"file": str(tmp_path / "file"), "ckpt": str(ck), "run": str(run)}
    monkeypatch.setattr(mixlab.eval.common, "free_bytes", lambda device: 16 * 2**30)

    def evaluated(*a, **k):
        raise AssertionError("evaluated")

    monkeypatch.setattr(mixlab.eval.resolution, "_evaluate", evaluated)
    err = _error(capsys, monkeypatch, "resolution", "--ckpt", str(ck), "--resolutions", "8", "--out",
                 str(tmp_path / "out"), *CPU, *[a.format(**fill) for a in args])
    assert err == line.format(**fill)
    assert not (tmp_path / "out").exists() and not (run / "resolution").exists() and not (run / "eval").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_gpu_on_a_machine_without_one(capsys, monkeypatch, tmp_path, tiny):
    err = _error(capsys, monkeypatch, "resolution", "--ckpt", str(tiny), "--resolutions", "8", "--out",
                 str(tmp_path / "out"), "--accelerator", "gpu")
    assert err == ("error: --accelerator gpu: this machine has no GPU (neither CUDA nor MPS is available); use "
                   "--accelerator cpu (or auto)")
    assert not (tmp_path / "out").exists()


def test_ctrl_c_exits_130_and_puts_the_outputs_back(capsys, monkeypatch, tmp_path, tiny):
    """Lightning's trainer turns Ctrl-C into ``sys.exit(1)`` (no message, SIGINT ignored from then on)."""
    from torch.utils.tensorboard import SummaryWriter

    from mixlab.heads.vit import ImageClassifier

    ck = _in_run(tmp_path, tiny)
    record = ck.parents[1] / "resolution"
    earlier = SummaryWriter(str(record))  # an earlier evaluation's value at 8 px
    earlier.add_scalar("resolution/goat2d/top1", 50.0, global_step=8)
    earlier.close()
    before = {f.name: f.read_bytes() for f in record.iterdir()}
    calls = []
    step = ImageClassifier.validation_step

    def interrupted(self, batch, batch_idx):
        calls.append(tuple(batch[0].shape[-2:]))
        if batch[0].shape[-1] == 16:  # the second resolution, after 8 px was recorded
            raise KeyboardInterrupt
        return step(self, batch, batch_idx)

    monkeypatch.setattr(ImageClassifier, "validation_step", interrupted)
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    handler = signal.getsignal(signal.SIGINT)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli.main(["resolution", "--ckpt", str(ck), "--resolutions", "8", "16", "--out", str(tmp_path / "out"), *CPU])
    assert info.value.code == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "mixlab resolution: interrupted (Ctrl-C)"
    assert calls[0] == (8, 8) and calls[-1] == (16, 16)
    assert signal.getsignal(signal.SIGINT) is handler  # not left ignored
    assert not (tmp_path / "out").exists()
    assert {f.name: f.read_bytes() for f in record.iterdir()} == before
    assert collect(tmp_path / "runs").table["goat2d"] == {("digits", "top-1@8px (%)"): 50.0}


def test_a_data_arg_that_moves_the_split_is_announced(capsys, tmp_path, tiny):
    """A user test: ``--data-arg seed=1`` evaluated a reshuffled val split (top-1 15.19 -> 10.37) with only the note
    that it is not recorded; ``validate``/``test`` refuse the same change. Now a warning line says why."""
    from mixlab.eval.resolution import main as resolution_main

    resolution_main(["--ckpt", str(tiny), "--resolutions", "16", "--out", str(tmp_path / "out"), "--limit-batches",
                     "1", "--data-arg", "seed=1", "--data-arg", "augment=false", *CPU])
    out = capsys.readouterr().out
    assert (f"warning: --data-arg seed=1 (the run's: 0) for {tiny}: the data is split otherwise than in the "
            f"checkpoint's run; the evaluated val split could hold images it was trained on") in out
    resolution_main(["--ckpt", str(tiny), "--resolutions", "16", "--out", str(tmp_path / "out2"), "--limit-batches",
                     "1", "--data-arg", "seed=0", *CPU])
    assert "warning: --data-arg" not in capsys.readouterr().out  # the run's own value


def test_an_evaluation_that_takes_hours_is_announced(capsys, monkeypatch, tmp_path, tiny):
    """On the GPU, ``--resolutions 8192`` of a digits model fitted its memory (flash attention is linear in the
    tokens) and ran with no word for hours. Now a warning line gives attention's FLOP and a lower bound on the time
    per batch, from the device's peak; the evaluation still runs."""
    from mixlab.eval import resolution
    from mixlab.eval.common import load_run
    from mixlab.heads.vit import ImageClassifier

    model = load_run(tiny, "cpu", head=ImageClassifier).model  # 2 layers of width 32, 4 px patches
    tokens = 2048 * 2048 + 1  # 8192 px, and the [CLS] token
    flop = 4 * tokens**2 * 32 * 2
    assert resolution.slow_warning(model, (8192, 8192), 32, torch.device("cuda"), None) == (
        f"warning: --resolutions 8192: 4,194,305 tokens per image; attention alone is {flop:.1e} FLOP per image, at "
        f"least {flop * 32 / 1e15 / 60:,.0f} minutes per batch of 32 at cuda's peak (1e+15 FLOP/s), for every batch "
        f"of the split (--limit-batches and --batch-size bound it)")
    assert flop * 32 / 1e15 / 60 == pytest.approx(2.4, abs=0.05)
    assert "at least 4.0 hours per batch of 32 at cpu's peak" in resolution.slow_warning(
        model, (8192, 8192), 32, torch.device("cpu"), 2)
    assert "for 2 batch(es)" in resolution.slow_warning(model, (8192, 8192), 1, torch.device("cpu"), 2)
    assert resolution.slow_warning(model, (16, 16), 32, torch.device("cpu"), None) is None
    monkeypatch.setitem(resolution.PEAK_FLOPS, "cpu", 1.0)  # a device this slow makes 16 px an hour's batch
    resolution.main(["--ckpt", str(tiny), "--resolutions", "16", "--out", str(tmp_path / "out"), "--limit-batches",
                     "0.5", *CPU])
    out = capsys.readouterr().out
    assert "warning: --resolutions 16: 17 tokens per image; attention alone is 7.4e+04 FLOP per image" in out
    assert "for 0.5 of the split's batches" in out and (tmp_path / "out" / "resolution.md").is_file()
