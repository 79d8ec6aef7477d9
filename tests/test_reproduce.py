"""``python -m mixlab reproduce SUITE --quick`` on CPU: every experiment of the suite runs through the
CLI for a few steps and the table is produced and well formed (the numbers are not checked)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mixlab.eval import reproduce

ROOT = Path(__file__).resolve().parent.parent
VERDICTS = {"reproduced", "same direction", "not reproduced"}


@pytest.mark.parametrize("suite", ["goat", "fg2", "mesa"])
def test_quick_suite_writes_a_well_formed_table(suite, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    rows = reproduce.main([suite, "--quick", "--out", str(tmp_path), "--workers", "2"])
    exps = reproduce.SUITES[suite]()
    assert {r["experiment"] for r in rows} == {e.title for e in exps}  # every experiment has its rows
    md = (tmp_path / f"REPRODUCTION_{suite}.md").read_text()
    assert md.startswith(f"# Reproduction: {suite} suite") and "Not finished" not in md
    lines = [ln for ln in md.splitlines() if ln.startswith("| ") and not ln.startswith("| experiment")]
    assert len(lines) == len(rows)
    for line, row in zip(lines, rows):
        cells = line.split(" | ")
        assert len(cells) == 6 and row["verdict"] in VERDICTS and f"**{row['verdict']}**" in line
        assert re.search(r"`python -m mixlab fit --config configs/\S+\.yaml", line), line
        assert "runs that failed" not in row["mixlab"], row  # every run trained and tested
    dump = json.loads((tmp_path / f"reproduce_{suite}.json").read_text())
    for exp in exps:
        for spec in (s for s in exp.runs if s.in_quick):
            assert dump[exp.name][spec.name]["fit_rc"] == 0 and dump[exp.name][spec.name]["test_rc"] == 0


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
    with pytest.raises(SystemExit):
        reproduce.main(["mesa", "--max-minutes", "0", "--out", str(tmp_path)])
    assert "--max-minutes must be > 0; got 0.0" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing written on bad input


def test_runs_filter_and_wall_time_cap():
    chosen = reproduce.select(["mesa", "fg2"], None, ["goat_no_bos_bias", "deltanet_neg"])
    assert {x: [e.name for e in exps] for x, exps in chosen.items()} == {"mesa": ["mad_recall", "parity"]}
    spec = next(s for e in chosen["mesa"] for s in e.runs if s.name == "goat_no_bos_bias")
    argv = reproduce.fit_argv(spec, Path("runs"), quick=False, scale=0.5, max_minutes=7.5)
    assert argv[argv.index("--trainer.max_steps") + 1] == "4000"
    assert argv[argv.index("--trainer.max_time") + 1] == "00:00:07:30"
    assert argv[argv.index("--model.init_args.backbone.mixer_args.goat.position_args.bos_bias") + 1] == "false"


def test_a_tie_is_not_a_direction():
    tie = {"eval": {"goat": {"24": 50.0, "48": 12.5}, "ape": {"24": 50.0, "48": 12.5}}}
    assert [r[3] for r in reproduce._resolution_rows(tie)] == ["not reproduced", "not reproduced"]
    ahead = {"eval": {"goat": {"24": 50.0, "48": 40.0}, "ape": {"24": 50.0, "48": 30.0}}}
    assert [r[3] for r in reproduce._resolution_rows(ahead)] == ["reproduced", "same direction"]
