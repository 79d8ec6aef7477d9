"""How config sources combine (``mixlab.overrides``): for every option the last value given wins.

In-process ``python -m mixlab fit|test`` on the genome GOAT config with the Trainer's ``fit``/``test``
replaced by a recorder, so only parsing and construction run.
"""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from mixlab import cli
from mixlab.overrides import deep_merge

GOAT = str(Path(__file__).resolve().parents[1] / "configs" / "genome" / "goat.yaml")
MIX = "--model.init_args.backbone.mixer_args"


def _run(monkeypatch, tmp_path, *args: str, command: str = "fit") -> pl.Trainer:
    """``python -m mixlab <command> --config GOAT ... args`` up to the Trainer's call; returns the trainer
    (its ``.model`` is the built head)."""
    seen = {}

    @functools.wraps(getattr(pl.Trainer, command))  # LightningCLI reads the subcommand's arguments from it
    def record(self, model=None, *a, **k):
        seen["trainer"], self.model_built = self, model

    monkeypatch.setattr(pl.Trainer, command, record)
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    cli.main([command, "--config", GOAT, "--trainer.max_steps=1", "--run_root", str(tmp_path), *args])
    return seen["trainer"]


def _mixer_args(trainer) -> dict:
    return trainer.model_built.hparams["backbone"]["mixer_args"]


def test_deep_merge_sets_only_the_leaves_it_is_given():
    base = {"goat": {"position_args": {"n_modes": 2, "abs_scale": 256}, "impl": "auto"}, "rope": {"impl": "x"}}
    assert deep_merge(base, {"goat": {"position_args": {"n_modes": 1}}}) == \
        {"goat": {"position_args": {"n_modes": 1, "abs_scale": 256}, "impl": "auto"}, "rope": {"impl": "x"}}
    assert deep_merge(base, {"goat": {"position_args": None}})["goat"] == {"position_args": None, "impl": "auto"}
    assert base["goat"]["position_args"]["n_modes"] == 2  # not modified


def test_one_nested_mixer_option_on_the_command_line_keeps_the_others_and_its_type(monkeypatch, tmp_path):
    """``--...mixer_args.goat.impl reference`` used to replace the whole dict (the config's GOAT
    position_args gone), and ``...goat.position_args.n_modes 1`` became the dotted key
    ``"position_args.n_modes"`` holding the string ``"1"``."""
    t = _run(monkeypatch, tmp_path, f"{MIX}.goat.impl", "reference", f"{MIX}.goat.position_args.n_modes", "1",
             f"{MIX}.goat.position_args.freq_base", "1e4")
    args = _mixer_args(t)
    assert args == {"goat": {"impl": "reference",
                             "position_args": {"n_modes": 1, "abs_scale": 256, "freq_base": 10000.0}}}
    assert type(args["goat"]["position_args"]["n_modes"]) is int
    assert type(args["goat"]["position_args"]["freq_base"]) is float
    mixer = t.model_built.backbone.blocks[0].mixer
    assert mixer.impl == "reference" and mixer.pos.describe()["n_modes"] == 1


def test_null_on_the_command_line_unsets_a_nested_mixer_option(monkeypatch, tmp_path):
    """``null`` (or ``~``) reached the mixer as the string ``"None"`` (a 98-line traceback: found by a user
    test); it is None, as in a config file."""
    for null in ("null", "~"):
        t = _run(monkeypatch, tmp_path, "--model.init_args.backbone.mixer", "mesa", f"{MIX}.mesa.eval_cg_eps", null)
        assert _mixer_args(t)["mesa"] == {"eval_cg_eps": None}
        assert t.model_built.backbone.blocks[0].mixer.eval_cg_eps is None


def test_a_wrong_type_for_a_mesa_tolerance_is_one_line(monkeypatch, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        _run(monkeypatch, tmp_path, "--model.init_args.backbone.mixer", "mesa", f"{MIX}.mesa.cg_eps", "abc")
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-2] == f"error: {MIX}.mesa.cg_eps: mixer 'mesa': cg_eps must be float or null; got 'abc'"


def test_a_second_config_and_the_command_line_merge_in_the_order_given(monkeypatch, tmp_path):
    second = tmp_path / "second.yaml"
    second.write_text("model:\n  init_args:\n    backbone:\n      mixer_args:\n"
                      "        goat: {impl: reference, position_args: {n_modes: 3}}\n")
    t = _run(monkeypatch, tmp_path, "--config", str(second))
    assert _mixer_args(t) == {"goat": {"impl": "reference", "position_args": {"n_modes": 3, "abs_scale": 256}}}
    t = _run(monkeypatch, tmp_path, f"{MIX}.goat.position_args.n_modes", "1", "--config", str(second))
    assert _mixer_args(t)["goat"]["position_args"] == {"n_modes": 3, "abs_scale": 256}  # the config came last
    t = _run(monkeypatch, tmp_path, "--config", str(second), f"{MIX}.goat.position_args.n_modes", "1")
    assert _mixer_args(t)["goat"]["position_args"] == {"n_modes": 1, "abs_scale": 256}


def test_a_typo_in_a_nested_mixer_option_is_one_line(monkeypatch, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        _run(monkeypatch, tmp_path, f"{MIX}.goat.position_args.n_mode", "1")
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-2].startswith(f"error: {MIX}.goat.position_args.n_mode: position_args of 'goat' got unknown key(s) "
                              "'n_mode'; it accepts: ")
    # in a config file: the file and key (a user test: the file was not named)
    typo = tmp_path / "typo.yaml"
    typo.write_text("model:\n  init_args:\n    backbone:\n      mixer_args:\n        goat:\n"
                    "          position_args: {n_modez: 2}\n")
    with pytest.raises(SystemExit):
        _run(monkeypatch, tmp_path, "--config", str(typo))
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-2].startswith(f"error: {typo}: model.init_args.backbone.mixer_args.goat.position_args.n_modez: "
                              "position_args of 'goat' got unknown key(s) 'n_modez'; it accepts: ")
    typo.write_text("model:\n  init_args:\n    backbone:\n      mixer_args:\n        goat:\n"
                    "          position_argz: {n_modes: 2, abs_scale: 64}\n")  # a mixer-level key: named once
    with pytest.raises(SystemExit):
        _run(monkeypatch, tmp_path, "--config", str(typo))
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-2].startswith(f"error: {typo}: model.init_args.backbone.mixer_args.goat.position_argz: mixer 'goat' "
                              "got unknown argument(s) 'position_argz'; it accepts: ")


@pytest.mark.parametrize("args,expected", [
    (["--trainer.limit_val_batches", "1"], 1),
    (["--trainer.limit_val_batches=1.0"], 1.0),
    (["--trainer.limit_val_batches", "4", "--trainer.limit_val_batches", "1.0"], 1.0),
    (["--trainer.limit_val_batches", "1", "--config", "{tmp}/half.yaml"], 0.5),
    (["--config", "{tmp}/one.yaml"], 1),
    (["--config", "{tmp}/one.yaml", "--trainer.limit_val_batches", "1.0"], 1.0),
])
def test_the_last_batch_count_given_wins_and_1_is_one_batch_in_every_source(args, expected, monkeypatch,
                                                                                 tmp_path):
    """mixlab used to re-apply the last *integer* command-line value after parsing, so a later ``1.0``
    or a later ``--config`` with 0.5 lost; and ``1`` in a YAML file became ``1.0`` (all batches)."""
    (tmp_path / "half.yaml").write_text("trainer:\n  limit_val_batches: 0.5\n")
    (tmp_path / "one.yaml").write_text("trainer:\n  limit_val_batches: 1\n  limit_train_batches: 1\n")
    t = _run(monkeypatch, tmp_path, *[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert t.limit_val_batches == expected and type(t.limit_val_batches) is type(expected)
    if "one.yaml" in " ".join(args):
        assert t.limit_train_batches == 1 and type(t.limit_train_batches) is int


def test_test_with_a_checkpoint_says_when_its_hyperparameters_replace_the_given_ones(monkeypatch, tmp_path,
                                                                                      caplog):
    """``test --ckpt_path X --model.init_args.backbone.d_model 48``: LightningCLI builds the model from
    the checkpoint's hyperparameters (d_model 64 here, and its own mixer_args, not merged with the
    config's); one warning line names what differs."""
    backbone = {"d_model": 64, "n_layers": 1, "n_heads": 2, "mixer": "goat",
                "mixer_args": {"goat": {"position_args": {"n_modes": 1}}}}
    hparams = {"_class_path": "mixlab.heads.CausalLM", "vocab_size": 5, "backbone": backbone}
    ckpt = tmp_path / "run.ckpt"
    from mixlab.backbone import BackboneConfig
    from mixlab.heads import CausalLM

    weights = CausalLM(vocab_size=5, backbone=BackboneConfig(**backbone)).state_dict()  # a checkpoint with weights
    torch.save({"hyper_parameters": hparams, "state_dict": weights}, ckpt)
    with caplog.at_level(logging.WARNING, logger="mixlab"):
        t = _run(monkeypatch, tmp_path, "--ckpt_path", str(ckpt), "--model.init_args.backbone.d_model", "48",
                 command="test")
    bb = t.model_built.hparams["backbone"]
    assert bb["d_model"] == 64 and bb["n_layers"] == 1
    assert bb["mixer_args"] == {"goat": {"position_args": {"n_modes": 1}}}  # the checkpoint's, whole
    lines = [r.getMessage() for r in caplog.records if "--ckpt_path" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert lines[0].startswith(f"--ckpt_path {ckpt}: the model is built from the checkpoint's hyperparameters")
    assert "backbone.d_model: 48 -> 64" in lines[0] and "backbone.n_layers: 4 -> 1" in lines[0]
    assert "backbone.mixer_args.goat.position_args.abs_scale: 256 -> unset" in lines[0]


def test_runtime_options_given_for_a_checkpoint_are_kept(monkeypatch, tmp_path, caplog):
    """``validate/test --ckpt_path X`` builds the model from X's hyperparameters, but the options that only
    choose how it computes (a kernel ``impl``, ``loss_chunk_tokens``, ``backbone.compile``) keep the values
    given now (a user test: a checkpoint trained with ``rotary_impl: triton`` on a GPU, or with one loss
    chunk size, could not be evaluated otherwise); what the config does not set stays the checkpoint's."""
    from mixlab.backbone import BackboneConfig
    from mixlab.heads import CausalLM
    from mixlab.overrides import is_runtime_option

    backbone = {"d_model": 32, "n_layers": 1, "n_heads": 2, "mixer": "goat", "compile": True,
                "mixer_args": {"goat": {"impl": "reference", "position_args": {"n_modes": 1, "lane_impl": "triton"}}}}
    hparams = {"_class_path": "mixlab.heads.CausalLM", "vocab_size": 5, "backbone": backbone, "loss_chunk_tokens": 100}
    ckpt = tmp_path / "run.ckpt"
    weights = CausalLM(vocab_size=5, backbone=BackboneConfig(**backbone)).state_dict()
    torch.save({"hyper_parameters": hparams, "state_dict": weights}, ckpt)
    with caplog.at_level(logging.INFO, logger="mixlab"):
        t = _run(monkeypatch, tmp_path, "--ckpt_path", str(ckpt), "--model.init_args.loss_chunk_tokens", "7",
                 f"{MIX}.goat.impl", "sdpa", command="test")
    h = t.model_built.hparams
    assert h["loss_chunk_tokens"] == 7 and h["backbone"]["compile"] is False  # given now / the config's default
    assert h["backbone"]["mixer_args"]["goat"]["impl"] == "sdpa"
    assert h["backbone"]["mixer_args"]["goat"]["position_args"] == {"n_modes": 1, "lane_impl": "triton"}  # unset now
    assert h["backbone"]["d_model"] == 32  # a model option: the checkpoint's
    kept = [r.getMessage() for r in caplog.records if "runtime options kept" in r.getMessage()]
    assert len(kept) == 1 and "loss_chunk_tokens: 7" in kept[0] and "backbone.compile: False" in kept[0]
    assert [is_runtime_option(k) for k in ("a.impl", "b.rotary_impl", "loss_chunk_tokens", "x.backbone.compile",
                                           "loss_kernel", "init_args.compile", "compile", "backbone.d_model",
                                           "mixer_args.goat.position_args.n_modes")] == \
        [True, True, True, True, True, True, True, False, False]


def test_a_mixer_runtime_option_reaches_a_checkpoint_trained_with_the_defaults(monkeypatch, tmp_path):
    """A checkpoint trained with the defaults records ``mixer_args: {}``; a kernel choice given now for one
    of its mixers is added (it was dropped: a fresh-clone user test), one for a mixer it does not use is not."""
    from mixlab.backbone import BackboneConfig
    from mixlab.heads import CausalLM

    backbone = {"d_model": 32, "n_layers": 1, "n_heads": 2, "mixer": "goat", "mixer_args": {}}
    ckpt = tmp_path / "run.ckpt"
    weights = CausalLM(vocab_size=5, backbone=BackboneConfig(**backbone)).state_dict()
    torch.save({"hyper_parameters": {"_class_path": "mixlab.heads.CausalLM", "vocab_size": 5, "backbone": backbone},
                "state_dict": weights}, ckpt)
    t = _run(monkeypatch, tmp_path, "--ckpt_path", str(ckpt), f"{MIX}.goat.position_args.lane_impl", "torch",
             f"{MIX}.rope.position_args.rotary_impl", "torch", command="test")
    assert _mixer_args(t) == {"goat": {"position_args": {"lane_impl": "torch"}}}
    assert t.model_built.backbone.blocks[0].mixer.pos.lane_impl == "torch"


def test_a_quoted_yaml_string_on_the_command_line_is_that_string(monkeypatch, tmp_path):
    """``...mixer_args.goat.impl '"reference"'`` is the string ``reference``, as in a config file (jsonargparse kept
    the quotes: ``impl must be 'sdpa' or 'reference'; got '"reference"'``)."""
    for quoted in ('"reference"', "'reference'"):
        t = _run(monkeypatch, tmp_path, f"{MIX}.goat.impl", quoted)
        assert _mixer_args(t)["goat"]["impl"] == "reference"
