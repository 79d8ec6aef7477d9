"""``python -m mixlab reproduce SUITE --quick`` on CPU: every experiment of the suite runs through the
CLI for a few steps and the table is produced and well formed (the numbers are not checked)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mixlab.eval import reproduce

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("suite", ["goat", "fg2", "mesa"])
def test_quick_suite_writes_a_well_formed_table(suite, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    rows = reproduce.main([suite, "--quick", "--out", str(tmp_path), "--workers", "2"])
    exps = [e for e in reproduce.SUITES[suite]() if not e.optional]  # optional ones run with --only only
    assert {r["experiment"] for r in rows} == {e.title for e in exps}  # every experiment has its rows
    md = (tmp_path / f"REPRODUCTION_{suite}.md").read_text()
    assert md.startswith(f"# Reproduction: {suite} suite") and "Not finished" not in md
    assert "one representative per row, so a cell of a run it skips reads n/a" in md  # why some cells are n/a
    lines = [ln for ln in md.splitlines() if ln.startswith("| ") and not ln.startswith("| experiment")]
    assert len(lines) == len(rows)
    for line, row in zip(lines, rows):
        cells = line.split(" | ")
        assert len(cells) == 6 and row["verdict"] == reproduce.QUICK_VERDICT and f"**{row['verdict']}**" in line
        assert re.search(r"`python -m mixlab fit --config configs/\S+\.yaml", line), line
        assert "runs that failed" not in row["mixlab"], row  # every run trained and tested
    dump = json.loads((tmp_path / f"reproduce_{suite}.json").read_text())
    for exp in exps:
        for spec in (s for s in exp.runs if s.in_quick):
            entry = dump[exp.name][spec.name]
            assert entry["fit_rc"] == 0 and entry["test_rc"] == 0
            for key in ("fit_time", "test_time"):  # the launcher's seconds per command
                assert entry[key]["wall_s"] > 0 and entry[key]["start_s"] >= 0, entry[key]
            assert entry["test_time"]["start_s"] >= entry["fit_time"]["start_s"] + entry["fit_time"]["wall_s"] - 0.2
    finished = re.search(r"Finished after: ([^.]+)\.", md).group(1)  # every experiment's end, in seconds
    assert sorted(x.rsplit(" ", 2)[0] for x in finished.split(", ")) == sorted(e.name for e in exps)


def test_unknown_suite_and_experiment_names_are_one_line_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit):
        reproduce.main(["goatt"])
    assert "invalid choice: 'goatt'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        reproduce.main(["goat", "--only", "vqaa", "--out", str(tmp_path)])
    assert "--only vqaa matches no experiment of goat; they have genome, text_length" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        reproduce.main(["mesa", "--runs", "goat_key_lin", "--out", str(tmp_path)])
    assert "--runs 'goat_key_lin' is no run of the chosen experiments; they have" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:  # a real run that --quick skips: it trained nothing and exited 0
        reproduce.main(["mesa", "--quick", "--runs", "mesa_neg_s1", "--out", str(tmp_path)])
    assert info.value.code == 2 and "--runs 'mesa_neg_s1' is not run by --quick (it runs one representative per " \
        "row: " in (err := capsys.readouterr().err) and "drop --quick to run it" in err and "mesa_neg," in err
    for bad, msg in [(["--max-minutes", "0"], "--max-minutes must be a finite number of at least 1/60"),
                     (["--max-minutes", "inf"], "--max-minutes must be a finite number"),
                     (["--max-minutes", "nan"], "--max-minutes must be a finite number"),
                     (["--max-minutes", "0.001"], "at least 1/60 (one second); got 0.001"),
                     (["--workers", "0"], "--workers must be >= 1; got 0"),
                     (["--timeout", "-5"], "--timeout must be a finite number of seconds > 0; got -5.0"),
                     (["--scale", "inf"], "--scale must be a finite number > 0; got inf")]:
        with pytest.raises(SystemExit) as info:
            reproduce.main(["mesa", *bad, "--out", str(tmp_path)])
        assert info.value.code == 2 and msg in capsys.readouterr().err, bad
    assert not any(tmp_path.iterdir())  # nothing written on bad input
    afile = tmp_path / "notes.txt"  # --out a file, or below one: tracebacks before (a user test)
    afile.write_text("x")
    for out, msg in ((afile, "is a file; give a folder"), (afile / "x", ": Not a directory")):
        with pytest.raises(SystemExit) as info:
            reproduce.main(["mesa", "--quick", "--only", "parity", "--out", str(out)])
        assert info.value.code == 2 and f"--out {out}" in (err := capsys.readouterr().err) and msg in err, err


def test_failed_runs_mark_their_own_rows_and_the_exit_status(tmp_path, monkeypatch, capsys):
    """A run whose test fails (fit fine) counts as failed; each row shows its own runs' command and
    failures (the Mesa parity row is not labelled with DeltaNet's command); the command exits 1."""
    exp = next(e for e in reproduce.SUITES["mesa"]() if e.name == "parity")
    res = {n: {"command": f"python -m mixlab fit {n}", "fit_rc": 0, "test_rc": 0, "test": {"test/acc": 0.5}}
           for n in ("deltanet_neg", "deltanet", "mesa_neg", "mesa")}
    res["mesa_neg"]["test_rc"] = 1
    res["deltanet_neg"]["test"].update({"test/acc": 0.97, "test/acc_len_40_93": 1.0, "test/acc_len_203_256": 0.96})
    assert reproduce.failed_runs(exp, res) == ["mesa_neg"]
    rows = reproduce._rows(exp, res)
    assert rows[0]["commands"][0] == "python -m mixlab fit deltanet_neg" and "failed" not in rows[0]["mixlab"]
    assert "lengths 203..256: 0.960" in rows[0]["mixlab"] and rows[0]["verdict"] == "reproduced"
    # DeltaNet is tested at its best validation checkpoint: the row names its step and shows the test command
    res["deltanet_neg"].update(ckpt="runs/parity/deltanet_neg/version_0/checkpoints/epoch=3-step=3000.ckpt",
                               test_command="python -m mixlab test deltanet_neg --ckpt_path best")
    best = reproduce._rows(exp, res)[0]
    assert best["mixlab"].startswith("with: median 0.970 (lengths 203..256: 0.960); without: median 0.500. "
                                     "With: seed 0: 0.970 (0.960, step 3000). Without: seed 0: 0.500 (n/a, last)")
    assert best["commands"] == ["python -m mixlab fit deltanet_neg",
                                "python -m mixlab test deltanet_neg --ckpt_path best",
                                "python -m mixlab fit deltanet", "... (2 runs)"]  # the control's config differs
    # several model seeds: the row reports the seed with the highest best val/acc (model selection on
    # validation; the test set plays no part) and the median over the seeds (each shown)
    seeds = dict(res)
    seeds["deltanet_neg"] = {**res["deltanet_neg"], "val_max": {"val/acc": 0.97}}
    for k, (a, lg, val) in ((1, (0.90, 0.80, 0.91)), (2, (0.99, 0.97, 0.985))):
        seeds[f"deltanet_neg_s{k}"] = {"command": "c", "fit_rc": 0, "test_rc": 0, "val_max": {"val/acc": val},
                                       "test": {"test/acc": a, "test/acc_len_203_256": lg}}
    med = reproduce._rows(exp, seeds)[0]
    assert med["mixlab"].startswith(
        "with: seed 2 (chosen on validation, val/acc 0.985 at last): 0.990 (lengths 203..256: 0.970); median "
        "0.970 (lengths 203..256: 0.960); without: median 0.500. With: seed 0: 0.970 (0.960, step 3000, val 0.970); "
        "seed 1: 0.900 (0.800, last, val 0.910); seed 2: 0.990 (0.970, last, val 0.985)"), med["mixlab"]
    assert med["verdict"] == "reproduced" and med["commands"][-1] == "... (4 runs)"
    seeds["deltanet_neg_s2"]["test"]["test/acc_len_203_256"] = 0.94  # the chosen seed misses 0.95 at 203..256
    assert reproduce._rows(exp, seeds)[0]["verdict"] == "same direction"
    seeds["deltanet_neg_s1"]["val_max"]["val/acc"] = 0.99  # validation now picks seed 1 (0.900 / 0.800)
    assert "with: seed 1 (chosen on validation" in (row := reproduce._rows(exp, seeds)[0])["mixlab"]
    assert row["verdict"] == "same direction"
    seeds["deltanet"]["test"]["test/acc"] = 0.98  # without negative eigenvalues better than with: no direction
    assert reproduce._rows(exp, seeds)[0]["verdict"] == "not reproduced"
    # a row whose runs were all left out by --runs says so (it said "not reproduced")
    only_delta = {n: res[n] for n in ("deltanet_neg", "deltanet")}
    mesa_row = reproduce._rows(exp, only_delta)[1]
    assert mesa_row["verdict"] == "not run" and mesa_row["mixlab"] == "not run (left out by --runs)"
    assert mesa_row["commands"] == []
    assert rows[1]["commands"][0] == "python -m mixlab fit mesa_neg"
    assert "runs that failed: mesa_neg" in rows[1]["mixlab"]
    # the Mesa row chooses its seed on validation the same way
    mesa = {**res, "mesa_neg": {**res["mesa_neg"], "test_rc": 0, "val_max": {"val/acc": 0.76},
                                "test": {"test/acc": 0.74, "test/acc_len_203_256": 0.52}},
            "mesa_neg_s2": {"command": "c", "fit_rc": 0, "test_rc": 0, "val_max": {"val/acc": 0.994},
                            "test": {"test/acc": 0.99, "test/acc_len_203_256": 0.96}}}
    row = reproduce._rows(exp, mesa)[1]
    assert row["mixlab"].startswith("with: seed 2 (chosen on validation, val/acc 0.994 at last): 0.990 (lengths "
                                    "203..256: 0.960); median 0.865"), row["mixlab"]
    assert row["verdict"] == "reproduced" and row["commands"][-1] == "... (3 runs)"

    def fake_run_suites(suites, *a, **k):
        return rows

    monkeypatch.setattr(reproduce, "run_suites", fake_run_suites)
    with pytest.raises(SystemExit) as info:
        reproduce.main(["mesa", "--out", str(tmp_path)])
    assert info.value.code == 1 and "1 run(s) failed or were stopped by --timeout (3600 s) (parity/mesa_neg)" in \
        capsys.readouterr().err


def test_runs_filter_and_wall_time_cap():
    chosen = reproduce.select(["mesa", "fg2"], None, ["swa", "deltanet_neg"])
    assert {x: [e.name for e in exps] for x, exps in chosen.items()} == {"mesa": ["mad_recall", "parity"]}
    spec = next(s for e in chosen["mesa"] for s in e.runs if s.name == "swa")
    argv = reproduce.fit_argv(spec, Path("runs"), quick=False, scale=0.5, max_minutes=7.5)
    assert argv[argv.index("--trainer.max_steps") + 1] == "4000"
    assert argv[argv.index("--trainer.max_time") + 1] == "00:00:07:30"
    assert argv[argv.index("--model.init_args.backbone.mixer") + 1] == "swa"
    spec = next(s for e in reproduce.select(["mesa"], ["mad_recall_ablation"])["mesa"] for s in e.runs
                if s.name == "goat_no_bos_bias")
    argv = reproduce.fit_argv(spec, Path("runs"), quick=False, scale=1.0, max_minutes=None)
    assert argv[argv.index("--model.init_args.backbone.mixer_args.goat.position_args.bos_bias") + 1] == "false"


def test_resume_continues_the_runs_that_have_a_last_checkpoint(tmp_path):
    """``--resume``: a run with ``last.ckpt`` under ``--out`` is fit with ``--ckpt_path last``, the others start."""
    exp = next(e for e in reproduce.SUITES["mesa"]() if e.name == "parity")
    ckpts = tmp_path / "runs" / "parity" / "parity" / "deltanet_neg" / "version_0" / "checkpoints"
    ckpts.mkdir(parents=True)
    (ckpts / "last.ckpt").write_bytes(b"")
    seen = {}

    def launch(argv, log, priority=0.0):
        if argv[0] == "fit":
            seen[argv[argv.index("--run_name") + 1]] = argv
        return 0, ""

    for resume in (False, True):
        reproduce.run_experiment(exp, tmp_path, launch, False, 1.0, 2, ["deltanet_neg", "deltanet"], resume=resume)
        assert ("--ckpt_path" in seen["deltanet_neg"]) is resume and "--ckpt_path" not in seen["deltanet"]
    assert seen["deltanet_neg"][-2:] == ["--ckpt_path", "last"]


def test_a_tie_is_not_a_direction():
    tie = {"eval": {"goat": {"24": 50.0, "48": 12.5}, "ape": {"24": 50.0, "48": 12.5}}}
    assert [r[3] for r in reproduce._resolution_rows(tie)] == ["not reproduced", "not reproduced"]
    ahead = {"eval": {"goat": {"24": 50.0, "48": 40.0}, "ape": {"24": 50.0, "48": 30.0}}}
    assert [r[3] for r in reproduce._resolution_rows(ahead)] == ["reproduced", "same direction"]


def test_optional_experiments_run_only_when_named():
    names = [e.name for e in reproduce.select(["mesa"], None)["mesa"]]
    assert "mad_recall_ablation" not in names and "mad_recall" in names and "parity" in names
    chosen = reproduce.select(["mesa"], ["mad_recall_ablation", "cg_iters"])["mesa"]
    assert [e.name for e in chosen] == ["mad_recall_ablation", "cg_iters"] and chosen[0].optional
    assert [s.name for s in chosen[0].runs] == ["goat", "goat_key_linear", "goat_no_bos_bias"]
    res = {"goat": {"test": {"test/acc": 0.9998}}, "goat_key_linear": {"test": {"test/acc": 0.896}}}
    (row,) = chosen[0].rows(res)
    assert row[2] == "goat 1.000, goat_key_linear 0.896, goat_no_bos_bias n/a"
    assert row[3] == reproduce.ABLATION_VERDICT



def test_an_unknown_only_name_next_to_a_known_one_is_an_error():
    with pytest.raises(ValueError, match="--only nosuch matches no experiment of mesa; they have cg_iters"):
        reproduce.select(["mesa"], ["parity", "nosuch"])


def test_a_second_call_into_the_same_out_keeps_the_first_calls_experiments(tmp_path, monkeypatch, capsys):
    """``--only a`` then ``--only b`` into one ``--out``: the table and JSON hold both (same mode); a result of
    another mode (``--quick`` vs full) is not mixed in; an unreadable result file is an error, not overwritten."""
    monkeypatch.chdir(ROOT)

    def fake(exp, out, launch, quick, scale, *args, **kwargs):
        return {"mode": reproduce._mode(quick, scale),
                **{s.name: {"command": f"python -m mixlab fit {s.name}", "fit_rc": 0, "test_rc": 0,
                            "test": {"test/acc": 0.5}, "val": {"cg_iters/mean": 7.0}} for s in exp.runs}}

    monkeypatch.setattr(reproduce, "run_experiment", fake)
    reproduce.run_suites(["mesa"], tmp_path, only=["cg_iters"], workers=1)
    reproduce.run_suites(["mesa"], tmp_path, only=["regbench"], workers=1)
    dump = json.loads((tmp_path / "reproduce_mesa.json").read_text())
    md = (tmp_path / "REPRODUCTION_mesa.md").read_text()
    assert list(dump) == ["regbench", "cg_iters"]  # the suite's order
    assert "Kept from an earlier call into this folder: cg_iters." in md and "| RegBench" in md and "CG" in md
    reproduce.run_suites(["mesa"], tmp_path, only=["parity"], workers=1, quick=True)  # another mode
    assert list(json.loads((tmp_path / "reproduce_mesa.json").read_text())) == ["parity"]
    assert "not kept in the new table (another mode than 'quick', or none recorded): regbench, cg_iters" in \
        capsys.readouterr().out
    (tmp_path / "reproduce_mesa.json").write_text("{not json")
    with pytest.raises(ValueError, match="reproduce_mesa.json is not a result file of an earlier call"):
        reproduce.run_suites(["mesa"], tmp_path, only=["parity"], workers=1)
    assert (tmp_path / "reproduce_mesa.json").read_text() == "{not json"  # nothing lost


def test_results_come_from_the_newest_run_version_only(tmp_path):
    run = tmp_path / "deltanet"
    for v in (0, 2, 10):
        (run / f"version_{v}").mkdir(parents=True)
    assert reproduce._newest_version(run) == run / "version_10"
    assert reproduce._newest_version(tmp_path) == tmp_path  # no version folders


def test_cg_row_without_validation_is_not_run():
    exp = next(e for e in reproduce.SUITES["mesa"]() if e.name == "cg_iters")
    (row,) = exp.rows({"mesa": {"val": {}}})
    assert row[2] == "mean n/a, heads n/a" and row[3] == "not run"


def test_rows_name_runs_stopped_by_the_timeout_apart_from_failures():
    exp = next(e for e in reproduce.SUITES["mesa"]() if e.name == "parity")
    res = {"deltanet_neg": {"command": "c", "fit_rc": 124}, "deltanet": {"command": "c", "fit_rc": 1},
           "mesa_neg": {"command": "c", "fit_rc": 124}, "mesa": {"command": "c", "fit_rc": 0, "test_rc": 0}}
    rows = reproduce._rows(exp, res)
    assert "With: none tested" in rows[0]["mixlab"]
    assert "(runs stopped by --timeout: deltanet_neg; see logs/) (runs that failed: deltanet; see logs/)" in \
        rows[0]["mixlab"]
    assert rows[1]["mixlab"].endswith("(runs stopped by --timeout: mesa_neg; see logs/)")
