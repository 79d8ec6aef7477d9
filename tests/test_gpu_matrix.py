"""scripts/gpu_matrix.py on CPU (--quick): the real CLI per case, a pass/refused/fail table."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_matrix_quick_runs_the_cli_and_classifies_cases(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # the fork server imports gpu_matrix too
    import gpu_matrix

    rc = gpu_matrix.main(["--out", str(tmp_path / "out"), "--run-dir", str(tmp_path / "runs"), "--quick",
                          "--mixers", "goat", "kda", "--steps", "10"])
    lines = (tmp_path / "out/gpu_matrix.jsonl").read_text().splitlines()
    rows = {(r["mixer"], r["head"]): r for r in map(json.loads, lines)}
    assert rc == 0
    assert rows[("goat", "lm")]["status"] == "pass" and rows[("kda", "lm")]["status"] == "pass"
    assert rows[("goat", "lm")]["loss_last"] < rows[("goat", "lm")]["loss_first"]
    refused = rows[("kda", "vit")]  # a causal recurrence in a bidirectional ViT: one line, not a traceback
    assert refused["status"] == "refused" and refused["why"].startswith("error: ") and "causal" in refused["why"]
    md = (tmp_path / "out/gpu_matrix.md").read_text()
    assert "| kda | vit | 32 | 32 | refused |" in md and "4 cases: 3 pass, 1 refused, 0 fail" in md
