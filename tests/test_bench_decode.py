"""scripts/bench_decode.py --quick on CPU: a well-formed table with every mixer and dtype, ids equal to the
dict loop's (no timing is asserted)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_decode_quick_writes_a_well_formed_table(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    sys.modules.pop("bench_decode", None)
    import bench_decode

    md = bench_decode.main(["--quick", "--out", str(tmp_path / "out")])
    assert (tmp_path / "out" / "bench_decode.md").read_text() == md
    captured = capsys.readouterr()
    assert md in captured.out and "float32 goat dict" in captured.err  # table on stdout, progress on stderr
    lines = md.splitlines()
    # on CPU: the dict loop and the eager static path (no CUDA graph column)
    assert lines[0] == ("| dtype | mixer | dict loop tok/s | static eager tok/s | eager / dict | "
                        "ids = dict (eager) |")
    assert lines[1] == "|" + "---|" * (lines[0].count("|") - 1)  # one separator cell per column
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:12]]
    assert [r[:2] for r in rows] == [[d, m] for d in ("float32", "bfloat16")
                                     for m in ("goat", "rope", "nope", "kda", "mesa")]
    for _, _, old, eager, r_eager, same_eager in rows:
        assert float(old.replace(",", "")) > 0 and float(eager.replace(",", "")) > 0
        assert r_eager.endswith("x") and float(r_eager[:-1]) >= 0  # (timings are not asserted)
        assert same_eager == "1.000"  # the same greedy ids as the dict loop
    assert lines[12] == "" and "batch 2, 2 layers, d_model 64" in lines[13] and "device cpu" in lines[13]


def test_bench_decode_compile_adds_the_compiled_step_column(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    sys.modules.pop("bench_decode", None)
    import bench_decode

    md = bench_decode.main(["--quick", "--compile", "--mixers", "rope", "--dtypes", "float32"])
    head, _, row = md.splitlines()[:3]
    assert head == ("| dtype | mixer | dict loop tok/s | static eager tok/s | compiled step tok/s | eager / dict | "
                    "compiled / dict | ids = dict (eager / compiled) |")
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:2] == ["float32", "rope"] and cells[-1] == "1.000 / 1.000" and float(cells[4].replace(",", "")) > 0


def test_bench_decode_unknown_mixer_is_an_argparse_error(monkeypatch, capsys):
    import pytest

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    sys.modules.pop("bench_decode", None)
    import bench_decode

    with pytest.raises(SystemExit) as exc:
        bench_decode.main(["--quick", "--mixers", "goatt"])
    assert exc.value.code == 2 and "--mixers 'goatt'" in capsys.readouterr().err
