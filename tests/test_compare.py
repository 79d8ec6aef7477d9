"""``python -m mixlab compare`` on log directories written here, and the HParams callback."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
import yaml

from mixlab.eval.compare import TASK_METRICS, Metric, collect, compare, task_metrics

REPO = Path(__file__).resolve().parents[1]


def _write(run: Path, scalars: dict[str, list[tuple[int, float]]], t0: float = 1000.0) -> None:
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(run))
    for i, (tag, points) in enumerate(scalars.items()):
        for j, (step, value) in enumerate(points):
            w.add_scalar(tag, value, step, walltime=t0 + 10 * i + j)
    w.close()


@pytest.fixture()
def logdir(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    curve = lambda a: [(0, a), (1, a - 0.5), (2, a - 0.7)]  # noqa: E731
    _write(root / "genome/goat/version_0", {"train/loss": curve(2.0), "val/loss": [(2, 1.4)],
                                            "test/bits_per_base": [(2, 1.91)]})
    # a later version overrides the earlier final value; the earlier curve stays
    _write(root / "genome/goat/version_1", {"test/bits_per_base": [(4, 1.87)]}, t0=5000.0)
    _write(root / "genome/kda/version_0", {"train/loss": curve(2.2), "test/bits_per_base": [(2, 1.95)]})
    _write(root / "parity/goat/version_0", {"train/loss": curve(0.7), "test/acc": [(2, 0.55)]})
    _write(root / "parity/kda/version_0", {"train/loss": curve(0.7)})  # lacks test/acc
    # text: final PPL plus PPL per length from an evaluation written inside the run directory
    _write(root / "text/goat/version_0", {"test/ppl": [(3, 9.5)]})
    _write(root / "text/goat/version_0/eval/tb/goat", {"length/ppl": [(512, 9.0), (256, 8.0)]})
    return root


def test_table_values(logdir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "cmp"
    cmp = compare(logdir, out=out)
    cols = [(t, lab) for t, lab, _ in cmp.columns]
    assert cols == [("genome", "bits/base"), ("parity", "acc"), ("text", "PPL"), ("text", "PPL@256"),
                    ("text", "PPL@512")]
    assert cmp.table["goat"] == {("genome", "bits/base"): pytest.approx(1.87), ("parity", "acc"): pytest.approx(0.55),
                                 ("text", "PPL"): pytest.approx(9.5), ("text", "PPL@256"): pytest.approx(8.0),
                                 ("text", "PPL@512"): pytest.approx(9.0)}
    assert cmp.table["kda"] == {("genome", "bits/base"): pytest.approx(1.95)}
    assert "parity/kda: test/acc" in cmp.missing and "text/kda" not in " ".join(cmp.missing)
    err = capsys.readouterr().err
    assert "runs lacking a metric" in err and "parity/kda: test/acc" in err

    rows = list(csv.DictReader(open(out / "compare.csv")))
    by_mixer = {r["mixer"]: r for r in rows}
    assert float(by_mixer["goat"]["genome:bits/base"]) == pytest.approx(1.87)
    assert float(by_mixer["kda"]["genome:bits/base"]) == pytest.approx(1.95)
    assert by_mixer["kda"]["parity:acc"] == ""
    md = (out / "compare.md").read_text()
    assert "| goat | **1.87** | 0.55 | 9.5 | 8 | 9 |" in md  # best bits/base (lower) in bold
    assert "| kda | 1.95 | - | - | - | - |" in md
    for task in ("genome", "parity"):
        png = out / f"curves_{task}.png"
        assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_filters_and_errors(logdir: Path, tmp_path: Path) -> None:
    cmp = collect(logdir, tasks=["gen*"], mixers=["kda"])
    assert list(cmp.table) == ["kda"] and [c[0] for c in cmp.columns] == ["genome"]
    with pytest.raises(FileNotFoundError, match="no runs.*; tasks there: genome, parity, text$"):
        collect(logdir, tasks=["imagenet"])
    with pytest.raises(FileNotFoundError, match="did you mean 'genome' for 'genomee'\\?; did you mean 'goat' for "
                                                "'gaot'\\?$"):  # misspelt filters (a user test)
        collect(logdir, tasks=["genomee"], mixers=["gaot"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        collect(tmp_path / "nope")


def test_task_metric_table() -> None:
    assert task_metrics("vqa_digits")[0].tag == "test/acc_heldout"
    assert task_metrics("mad_in_context_recall")[0].tag == "test/acc"
    assert task_metrics("unknown_task")[0].tag == "test/loss"
    assert all(isinstance(m, Metric) for ms in TASK_METRICS.values() for m in ms)


def test_mad_score(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    _write(root / "mad_a/goat/version_0", {"test/acc": [(1, 0.4)]})
    _write(root / "mad_b/goat/version_0", {"test/acc": [(1, 0.8)]})
    _write(root / "mad_b/rope/version_0", {"test/acc": [(1, 0.5)]})
    cmp = collect(root)
    # 2 of the 6 MAD tasks: the column says so; a mixer missing one of them gets no score
    assert cmp.table["goat"][("MAD", "score (2/6 tasks)")] == pytest.approx(0.6)
    assert ("MAD", "score (2/6 tasks)") not in cmp.table["rope"]


def test_real_fit_run_and_hparams(tmp_path: Path) -> None:
    """A real 2-step genome fit + test through the CLI, then ``compare`` and the HParams session."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    from mixlab.cli import main

    cfg = yaml.safe_load(open(REPO / "configs/genome/goat.yaml"))
    # fractions: LightningCLI turns an integer 1 into the float 1.0 (= all batches)
    cfg["trainer"].update(max_steps=2, val_check_interval=2, limit_val_batches=0.01, limit_test_batches=0.01,
                          num_sanity_val_steps=0,
                          enable_progress_bar=False, enable_model_summary=False)
    bb = cfg["model"]["init_args"]["backbone"]
    bb.update(d_model=16, n_layers=1, n_heads=2)
    cfg["data"]["init_args"].update(context_length=32, batch_size=2)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    runs = tmp_path / "runs"
    main(["fit", "--config", str(path), f"--run_root={runs}"])
    main(["test", "--config", str(path), f"--run_root={runs}", "--ckpt_path=last"])

    cmp = compare(runs, out=tmp_path / "cmp")
    value = cmp.table["goat"][("genome", "bits/base")]
    acc = EventAccumulator(str(runs / "genome/goat/version_0"))
    acc.Reload()
    assert value == pytest.approx(acc.Scalars("test/bits_per_base")[-1].value)
    assert 0.5 < value < 4.0
    starts = [plugin_data_pb2.HParamsPluginData.FromString(c).session_start_info
              for c in [acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]]]
    hp = starts[0].hparams
    assert hp["mixer"].string_value == "goat" and hp["task"].string_value == "genome"
    assert hp["position"].string_value == "goat" and hp["n_modes"].number_value == 2
    assert hp["d_model"].number_value == 16 and hp["model/backbone/n_layers"].number_value == 1
    exp = plugin_data_pb2.HParamsPluginData.FromString(acc.PluginTagToContent("hparams")["_hparams_/experiment"])
    assert "test/bits_per_base" in [m.name.tag for m in exp.experiment.metric_infos]

    # figure CLI on the run's checkpoint: PNGs, and images + scalars in the run's TensorBoard dir
    from mixlab.eval.figures import heldout_batches

    ckpt = runs / "genome/goat/version_0/checkpoints/last.ckpt"
    from mixlab.eval.figures import main as figure_main

    spec = figure_main(["goat-spectrum", "--ckpt", str(ckpt), "--out", str(tmp_path / "fig")])
    main(["figure", "goat-prior", "--ckpt", str(ckpt), "--out", str(tmp_path / "fig"), "--length", "8", "--head", "1"])
    assert (tmp_path / "fig/goat_spectrum.png").stat().st_size > 1000
    assert (tmp_path / "fig/goat_prior_l0_h1.png").stat().st_size > 1000
    figs = EventAccumulator(str(runs / "genome/goat/version_0/figures"))
    figs.Reload()
    assert {"figures/goat_spectrum", "figures/goat_prior_l0_h1"} <= set(figs.Tags()["images"])
    share = figs.Scalars("figures/goat_spectrum/antisym_share")[0].value
    assert share == pytest.approx(float(spec[0]["antisym_share"]))
    batch = heldout_batches(ckpt, 1)[0]
    assert batch.dtype == torch.long and tuple(batch.shape) == (2, 33)


def test_percent_units_and_a_file_or_bad_out_is_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    """A user test: the tables named no units; ``compare <file>`` said "does not exist"."""
    import sys

    from mixlab import cli

    root = tmp_path / "runs"
    _write(root / "digits/goat2d/version_0", {"test/top1": [(30, 91.5)]})
    _write(root / "digits/goat2d/version_0/resolution", {"resolution/goat2d/top1": [(8, 40.0), (16, 80.0)]})
    cmp = compare(root, out=tmp_path / "cmp", plots=False)
    assert [(t, lab) for t, lab, _ in cmp.columns] == [("digits", "top-1 (%)"), ("digits", "top-1@8px (%)"),
                                                      ("digits", "top-1@16px (%)")]
    assert cmp.table["goat2d"] == {("digits", "top-1 (%)"): 91.5, ("digits", "top-1@8px (%)"): 40.0,
                                   ("digits", "top-1@16px (%)"): 80.0}
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| mixer | digits: top-1 (%) | digits: top-1@8px (%) | digits: top-1@16px (%) |" in md
    assert next(csv.reader(open(tmp_path / "cmp" / "compare.csv"))) == [
        "mixer", "digits:top-1 (%)", "digits:top-1@8px (%)", "digits:top-1@16px (%)"]

    afile = tmp_path / "compare.md"
    afile.write_text("")
    with pytest.raises(NotADirectoryError, match="is a file; compare needs the run root folder"):
        collect(afile)
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    for argv, line in (([str(afile)], f"error: compare: {afile} is a file; compare needs the run root folder, "
                                      f"<logdir>/<task>/<mixer>/version_N (e.g. runs/)"),
                       ([str(root), "--out", str(afile)], f"error: --out {str(afile)!r} is a file; give a folder")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as info:
            cli.main(["compare", *argv])
        assert info.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[0] == line
    assert afile.read_text() == ""


def test_runs_that_logged_nothing_are_named_not_dropped(logdir: Path, tmp_path: Path, capsys) -> None:
    """A user test's short runs (fewer steps than ``log_every_n_steps``, no validation: an event file without
    scalars) and a ``trainer.logger: false`` run (a version folder, no event file) vanished from compare without a
    word. Now one line names them (stderr and compare.md); with no other run the error names them, and its "tasks
    there" leaves out compare's own output folder."""
    from torch.utils.tensorboard import SummaryWriter

    SummaryWriter(str(logdir / "parity/short/version_0")).close()  # an event file, no scalar
    (logdir / "parity/nolog/version_0/checkpoints").mkdir(parents=True)
    out = tmp_path / "cmp"
    cmp = compare(logdir, out=out, plots=False)
    assert cmp.empty == ["parity/nolog", "parity/short"]
    assert "nolog" not in cmp.table and "short" not in cmp.table
    line = ("runs that logged no scalar (fewer steps than trainer.log_every_n_steps and no validation, or "
            "trainer.logger: false), left out: parity/nolog, parity/short")
    assert line in capsys.readouterr().err.splitlines()
    assert line in (out / "compare.md").read_text()
    only = tmp_path / "only"
    SummaryWriter(str(only / "parity/short/version_0")).close()
    (only / "compare").mkdir()  # an earlier compare's output folder
    (only / "compare" / "compare.md").write_text("")
    with pytest.raises(FileNotFoundError) as info:
        collect(only)
    assert str(info.value) == (
        f"compare: no runs with TensorBoard event files under {only}/<task>/<mixer>/ (tasks=all, mixers=all); "
        "runs that logged no scalar (fewer steps than trainer.log_every_n_steps and no validation, or "
        "trainer.logger: false): parity/short; tasks there: parity")


def test_curves_keep_one_colour_per_run_in_every_panel(tmp_path: Path) -> None:
    """A user test: each panel chose its colours over the runs it holds, so a run without ``train/loss`` shifted the
    others' colours in the ``val/loss`` panel, where the only legend (the first panel's) then named the wrong runs.
    Now a run has one colour in every panel, and the legend names every run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    root = tmp_path / "runs"
    _write(root / "parity/a/version_0", {"train/loss": [(0, 1.0), (1, 0.9)], "val/loss": [(1, 0.8)]})
    _write(root / "parity/b/version_0", {"val/loss": [(1, 0.7), (2, 0.6)]})  # no train/loss
    _write(root / "parity/c/version_0", {"train/loss": [(0, 1.2), (1, 1.1)], "val/loss": [(1, 0.9)]})
    seen = {}
    orig = plt.Figure.savefig

    def grab(fig, *args, **kwargs):
        for ax in fig.axes:
            for line in ax.get_lines():
                seen.setdefault(line.get_label(), set()).add((matplotlib.colors.to_hex(line.get_color()),
                                                              line.get_linestyle()))
            legend = ax.get_legend()
            if legend is not None:
                seen["legend"] = [t.get_text() for t in legend.get_texts()]
        return orig(fig, *args, **kwargs)

    plt.Figure.savefig = grab
    try:
        compare(root, out=tmp_path / "out")
    finally:
        plt.Figure.savefig = orig
    assert seen["legend"] == ["a", "b", "c"]
    assert all(len(seen[m]) == 1 for m in "abc"), seen  # one style per run across the panels
    assert len({next(iter(seen[m])) for m in "abc"}) == 3
