"""Checkpoints written before the issue-19 refactor still load and reproduce their numbers.

``tests/fixtures/*.ckpt`` were written by commit 7b5e0fd (one per head: CausalLM on the genome
task with a delta-rule + GOAT hybrid, SyntheticLM, ImageClassifier with the old ``position``
knob (goat2d and ape), SpatialVQA); ``expected.json`` holds what that code computed from them
(``make_fixtures.py``). Each is read back through the evaluation loader and the CLI ``test``
command, and every number must match.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures"
ROOT = FIXTURES.parents[1]
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
NAMES = [n for n in EXPECTED if n != "resolution"]

_spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
make_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_fixtures)


def _close(got, want, what: str) -> None:
    torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64),
                               rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", NAMES)
def test_old_checkpoint_loads_and_reproduces_its_forward(name):
    from mixlab.eval.common import load_run

    exp = EXPECTED[name]
    run = load_run(FIXTURES / f"{name}.ckpt")
    model = run.model
    assert f"{type(model).__module__}.{type(model).__qualname__}" == exp["head"]
    assert run.data == exp["data"]  # recorded by LightningCLI (SpatialVQADataModule kept no hparams then: None)
    assert all(run.data_args[k] == v for k, v in exp["data_args"].items())
    assert model.run_name == exp["run_name"]
    assert sum(p.numel() for p in model.parameters()) == exp["n_params"]
    x = make_fixtures.fixed_input(name, model, exp["data_args"])
    y = make_fixtures.forward(name, model, x)
    assert list(y.shape) == exp["forward_shape"]
    _close(y.flatten(), exp["forward"], f"{name} forward")


@pytest.mark.parametrize("name", NAMES)
def test_old_checkpoint_through_the_cli_test_command(name, tmp_path):
    from mixlab.cli import MixlabCLI

    exp = EXPECTED[name]
    cli = MixlabCLI(args=["test", "--config", str(ROOT / exp["config"]), *exp["overrides"], *make_fixtures.TINY,
                          *make_fixtures.TEST_BATCHES, "--run_root", str(tmp_path),
                          "--ckpt_path", str(FIXTURES / f"{name}.ckpt")])
    got = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
    assert sorted(got) == sorted(exp["test_metrics"])
    _close([got[k] for k in sorted(got)], [exp["test_metrics"][k] for k in sorted(got)], f"{name} test metrics")


def test_old_synthetic_checkpoint_prior_panels(tmp_path):
    from mixlab.eval.figures import copy_prior

    exp = EXPECTED["copy_mixture_goat"]["prior_panels"]
    panels = copy_prior(["--ckpt", str(FIXTURES / "copy_mixture_goat.ckpt"), "--layer", str(exp["layer"]),
                         "--head", str(exp["head"]), "--length", str(exp["length"]), "--out", str(tmp_path)])
    for k in ("key_only", "relative", "causal_prior"):
        _close(panels[k], exp[k], f"prior panel {k}")


def test_old_vit_checkpoints_through_the_resolution_command(tmp_path):
    from mixlab.eval.resolution import main as resolution_main

    rows = resolution_main(["--ckpt", str(FIXTURES / "digits_goat2d.ckpt"), str(FIXTURES / "digits_ape.ckpt"),
                            "--resolutions", "16", "24", "--out", str(tmp_path), "--split", "val",
                            "--batch-size", "50", "--limit-batches", "2", "--accelerator", "cpu"])
    assert [(r["run"], r["position"], r["res"]) for r in rows] == \
        [(r["run"], r["position"], r["res"]) for r in EXPECTED["resolution"]]
    assert [r["patch_coords"] for r in rows] == ["index"] * 4  # written before patch_coords: integer indices
    for got, want in zip(rows, EXPECTED["resolution"]):
        _close([got["top1"], got["top5"], got["loss"]], [want["top1"], want["top5"], want["loss"]], str(want))
    assert (tmp_path / "prior_goat2d_layer0.png").stat().st_size > 0


def test_fit_refuses_to_resume_a_checkpoint_with_the_separate_swiglu_projections(tmp_path, capsys, monkeypatch):
    """The fixtures predate the packed SwiGLU (``mlp.fc1_g``/``fc1_x``): their weights load for test (above), but
    ``fit --ckpt_path`` cannot restore their optimizer state: one line, exit status 2, no run folder left."""
    import sys

    from mixlab import cli

    exp = EXPECTED["genome_fg2gdn_goat"]
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", "--config", str(ROOT / exp["config"]), *exp["overrides"], *make_fixtures.TINY,
                  "--run_root", str(tmp_path / "runs"), "--ckpt_path", str(FIXTURES / "genome_fg2gdn_goat.ckpt")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert info.value.code == 2 and "written before the SwiGLU's gate and value projections were packed" in err[0]
    assert "fit cannot resume its optimizer state" in err[0] and not list((tmp_path / "runs").rglob("version_*"))
