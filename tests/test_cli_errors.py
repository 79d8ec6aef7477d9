"""Bad input through ``python -m mixlab``: one line ``error: <field>: <message>``, exit status 2.

In-process calls of :func:`mixlab.cli.main` (no subprocess): SystemExit and stderr are
captured. Config and command-line typos are one line too (``tests/test_cli_input.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mixlab import cli
from mixlab.registry import list_mixers

GOAT = str(Path(__file__).resolve().parents[1] / "configs" / "genome" / "goat.yaml")


def _fail(capsys, monkeypatch, tmp_path, *overrides: str) -> list[str]:
    """Run ``fit`` on the goat config with ``overrides``; return the stderr lines after exit 2."""
    monkeypatch.setattr(sys, "argv", ["mixlab"])  # pytest's own argv is not ours
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", "--config", GOAT, "--trainer.max_steps=1", "--run_root", str(tmp_path),
                  *overrides])
    assert info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


def test_constructor_errors_are_one_line(capsys, tmp_path, monkeypatch):
    err = _fail(capsys, monkeypatch, tmp_path, "--model.backbone.mixer=goatx")
    assert err[-2] == (f"error: --model.backbone.mixer: unknown mixer 'goatx'; registered mixers: "
                       f"{', '.join(list_mixers())}; did you mean 'goat'?")
    assert err[-1].startswith("(MIXLAB_TRACEBACK=1")
    assert not any("Union" in line or "Traceback" in line or "Namespace(" in line for line in err), err
    assert not any("unused" in line for line in err), err  # a user test: "mixer_args for 'goat' unused" came first

    err = _fail(capsys, monkeypatch, tmp_path, "--model.backbone.mixer_args={goat: {position_args: {n_modes: 20}}}")
    assert err[-2] == ("error: --model.backbone.mixer_args.goat.position_args.n_modes: head_dim=32 is too small for "
                       "GOAT with n_modes=20: needs 2R+2=42 positional lanes plus at least one content dim")


def test_a_refused_value_names_the_config_file_and_key_that_set_it(capsys, tmp_path, monkeypatch):
    """Found by a user test: a value refused by a class read ``error: backbone: ...`` without the file it came from."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  init_args:\n    backbone:\n      mixer: mesa\n      mixer_args:\n        mesa:\n"
                   "          lambda_floor: -1\n")
    err = _fail(capsys, monkeypatch, tmp_path, "--config", str(bad))
    assert err[-2] == (f"error: {bad}: model.init_args.backbone.mixer_args.mesa.lambda_floor: mixer 'mesa': "
                       "lambda_floor must be finite and > 0; got -1")
    # the command line, read after the file, sets it again: the command line is named
    err = _fail(capsys, monkeypatch, tmp_path, "--config", str(bad),
                "--model.init_args.backbone.mixer_args.mesa.lambda_floor=0")
    assert err[-2].startswith("error: --model.init_args.backbone.mixer_args.mesa.lambda_floor: mixer 'mesa': ")
    assert err[-2].endswith("got 0")
    # a cross-argument error names every place that set one of its values (d_model's default is not named)
    bad.write_text("model:\n  init_args:\n    backbone:\n      mixer: mesa\n      mixer_args:\n        mesa:\n"
                   "          lambda_floor: 0.25\n")
    err = _fail(capsys, monkeypatch, tmp_path, "--config", str(bad),
                "--model.init_args.backbone.mixer_args.mesa.lambda_init=0.1")
    assert err[-2] == (f"error: model: mesa mixer: lambda_init=0.1 must exceed lambda_floor=0.25 (set at {bad}: "
                       "model.init_args.backbone.mixer_args.mesa.lambda_floor; "
                       "--model.init_args.backbone.mixer_args.mesa.lambda_init)")


@pytest.mark.parametrize(("message", "field", "words", "line"), [
    # a value shown as 1 is not the -1 a message prints; a key is a whole word (n_heads is not heads)
    ("x: heads must be > 0; got -1", "model", ["--model.heads=1", "--model.n_heads=-1"],
     "model: x: heads must be > 0; got -1"),
    # a path is named where the message prints it whole, not as the start of a longer path
    ("no file in /data/run/x", "data", ["--data.root=/data/run"], "data: no file in /data/run/x"),
    ("no file /data/run", "data", ["--data.root=/data/run"], "--data.root: no file /data/run"),
    # command-line numbers as YAML reads them; keys of another field are not looked at
    ("lr must be > 0; got 0.0001", "model", ["--data.lr=1e-4", "--model.lr=1.0e-4"],
     "--model.lr: lr must be > 0; got 0.0001"),
    # a message that names its option itself is left as it is
    ("--ckpt_path /x: not found", None, ["--ckpt_path=/x"], "--ckpt_path /x: not found"),
])
def test_value_sources_match_whole_tokens_of_the_field(message, field, words, line):
    assert cli.place_value_error(message, field, words) == line


def test_missing_fasta_at_setup_is_one_line(capsys, tmp_path, monkeypatch):
    missing = tmp_path / "nonexistent.fa"
    err = _fail(capsys, monkeypatch, tmp_path, f"--data.fasta={missing}")
    assert err[-2] == f"error: --data.fasta: FASTA file not found: {missing}"  # the option that set it
    assert not any("Traceback" in line for line in err)


def test_command_line_typo_is_one_line_with_the_closest_option(capsys, tmp_path, monkeypatch):
    err = _fail(capsys, monkeypatch, tmp_path, "--model.backbone.d_modle=3")
    assert err == ["error: unknown option --model.backbone.d_modle; did you mean --model.backbone.d_model?"]
    # no prefix matching: a truncated option is an error (argparse would take it as --trainer.max_steps)
    err = _fail(capsys, monkeypatch, tmp_path, "--trainer.max_step", "5")
    assert err == ["error: unknown option --trainer.max_step; did you mean --trainer.max_steps?"]


def test_bad_input_error_walks_the_chain_and_skips_foreign_raises():
    from mixlab.datamodules.genome import encode_sequence

    try:
        try:
            encode_sequence("AC7", where="x.fa")  # raised in mixlab's source, no owner -> no field
        except ValueError as inner:
            raise ValueError("Does not validate against any of the Union subtypes") from inner
    except ValueError as outer:
        field, cause = cli.bad_input_error(outer)
    assert field is None and str(cause) == "x.fa: character '7' at position 3 is not a DNA letter " \
        "(expected ACGTN or IUPAC RYKMSWBDHV, any case)"
    try:
        raise ValueError("raised by a test, not by mixlab")  # a foreign raise keeps its traceback
    except ValueError as foreign:
        assert cli.bad_input_error(foreign) is None
    try:
        int("x")  # another library's ValueError
    except ValueError as foreign:
        assert cli.bad_input_error(foreign) is None


def test_an_allocation_that_fails_is_one_line_with_the_sizes_to_lower():
    """Found by a user test: ``rope head_dim 400000000`` printed the allocator's error inside jsonargparse's dump."""
    try:
        try:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                               "memory: you tried to allocate 2457600000000 bytes. Error code 12")
        except RuntimeError as inner:
            raise ValueError("Does not validate against any of the Union subtypes") from inner
    except ValueError as outer:
        field, cause = cli.bad_input_error(outer)
    assert field is None and isinstance(cause, MemoryError)
    assert str(cause).startswith("out of memory: could not allocate 2,457.6 GB on the CPU; a size in the config (")
    try:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity")
    except torch.OutOfMemoryError as err:
        assert str(cli.bad_input_error(err)[1]).startswith("out of memory: CUDA out of memory. Tried to allocate "
                                                           "20.00 GiB; a size in the config")
    try:
        raise RuntimeError("shape mismatch")  # any other RuntimeError keeps its traceback
    except RuntimeError as err:
        assert cli.bad_input_error(err) is None


def test_a_dataloader_workers_bad_input_error_is_its_own_one_line():
    """torch re-raises a worker's error with the worker's whole traceback as its message (a user test: 106 lines
    for a label out of range with num_workers 2); mixlab's own bad-input error inside it is the one line."""
    from torch._utils import ExceptionWrapper

    from mixlab.datamodules.genome import encode_sequence

    try:
        encode_sequence("AC7", where="x.fa")
    except ValueError:
        ours = ExceptionWrapper(where="in DataLoader worker process 0")
    with pytest.raises(ValueError) as info:
        ours.reraise()
    assert str(info.value).startswith("Caught ValueError in DataLoader worker process 0.")
    field, cause = cli.bad_input_error(info.value)
    assert field == "data" and type(cause) is ValueError
    assert str(cause) == "x.fa: character '7' at position 3 is not a DNA letter (expected ACGTN or IUPAC " \
        "RYKMSWBDHV, any case)"
    try:
        int("x")  # another library's error in a worker keeps its traceback
    except ValueError:
        foreign = ExceptionWrapper(where="in DataLoader worker process 1")
    with pytest.raises(ValueError) as info:
        foreign.reraise()
    assert cli.bad_input_error(info.value) is None


def test_trainer_misconfiguration_is_one_line(capsys, tmp_path, monkeypatch):
    err = _fail(capsys, monkeypatch, tmp_path, "--trainer.strategy=dpp")
    assert err[-2].startswith("error: --trainer.strategy: You selected an invalid strategy name: `strategy='dpp'`")
    fsdp = Path(GOAT).parents[1] / "trainer" / "fsdp.yaml"
    err = _fail(capsys, monkeypatch, tmp_path, f"--config={fsdp}", "--trainer.accelerator=cpu", "--trainer.devices=1")
    assert err[-2] == ("error: trainer: configs/trainer/fsdp.yaml (FSDP) needs CUDA GPUs; on CPU use "
                       "configs/trainer/ddp.yaml (gloo)")


def test_user_typos_and_bad_sizes_are_one_line(capsys, tmp_path, monkeypatch):
    """Found by a user test: these used to print a long traceback or train silently."""
    err = _fail(capsys, monkeypatch, tmp_path, "--model.backbone.mixer=mesa",
                "--model.backbone.mixer_args={mesa: {lamda_floor: 0}}")
    assert err[-2].startswith("error: --model.backbone.mixer_args.mesa.lamda_floor: mixer 'mesa' got unknown "
                              "argument(s) 'lamda_floor'; it accepts: ")  # the key named where it was set
    assert err[-2].endswith("; did you mean 'lambda_floor' for 'lamda_floor'?")  # the closest accepted argument
    err = _fail(capsys, monkeypatch, tmp_path, "--model.backbone.mixer_args={mesaa: {lambda_floor: 0}}")
    assert err[-2].startswith("error: backbone: mixer_args has entries for unknown mixer(s) 'mesaa'")
    err = _fail(capsys, monkeypatch, tmp_path, "--model.backbone.mixer_args={goat: {position_args: {n_mode: 2}}}")
    assert err[-2].startswith("error: --model.backbone.mixer_args.goat.position_args.n_mode: position_args of 'goat' "
                              "got unknown key(s) 'n_mode'; it accepts: ")
    assert err[-2].endswith("; did you mean 'n_modes' for 'n_mode'?") and not any("Union" in line for line in err)
    # a value of the wrong plain type was a jsonargparse "Union subtypes" traceback (TypeError inside the class)
    err = _fail(capsys, monkeypatch, tmp_path, "--model.backbone.mixer_args={goat: {position_args: {n_modes: abc}}}")
    # the line names the option that set it, inside the mapping given on the command line
    assert err[-2] == ("error: --model.backbone.mixer_args.goat.position_args.n_modes: position_args of 'goat': "
                       "n_modes must be int; got 'abc'")
    assert not any("Union" in line for line in err)
    for field, value in (("d_model", "-128"), ("n_heads", "0"), ("n_layers", "-1")):
        err = _fail(capsys, monkeypatch, tmp_path, f"--model.backbone.{field}={value}")
        assert err[-2] == f"error: --model.backbone.{field}: {field} must be an integer >= 1; got {value}"
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize(("name", "kwargs", "message"), [
    ("hawk", {"lru_width": -64}, "mixer 'hawk': lru_width must be finite and >= 1; got -64"),
    ("hawk", {"impl": "scan"}, "hawk mixer: impl must be one of"),
    ("mla", {"kv_rank": 0}, "mixer 'mla': kv_rank must be finite and >= 1; got 0"),
    ("mla", {"q_rank": -1}, "mixer 'mla': q_rank must be finite and >= 0; got -1"),
    ("gla", {"conv_size": -1}, "mixer 'gla': conv_size must be finite and >= 0; got -1"),
    ("gla", {"expand_v": 0.0}, "mixer 'gla': expand_v must be finite and > 0; got 0.0"),
    ("mamba2", {"d_state": 0}, "mixer 'mamba2': d_state must be finite and >= 1; got 0"),
    ("mamba2", {"expand": 0}, "mixer 'mamba2': expand must be finite and >= 1; got 0"),
    ("mesa", {"chunk_size": 0}, "mixer 'mesa': chunk_size must be finite and >= 1; got 0"),
    ("mesa", {"impl": "fal"},
     "mesa mixer: impl must be one of ('auto', 'chunk', 'triton', 'fla', 'recurrent', 'exact'); got 'fal'"),
    ("mesa", {"eval_cg_eps": 0.0}, "mixer 'mesa': eval_cg_eps must be finite and > 0; got 0.0"),
    ("gdn", {"chunk_sz": 16}, "mixer 'gdn' got unknown argument(s) 'chunk_sz'; it accepts: "),
    ("goat", {"n_heads": 0}, "mixer 'goat': n_heads must be an integer >= 1; got 0"),
    ("kda", {"gate_rank": 0}, "mixer 'kda': gate_rank must be finite and >= 1; got 0"),  # was silently the default
    ("kda", {"value_dim": -1}, "mixer 'kda': value_dim must be finite and >= 1; got -1"),  # a traceback
    ("mla", {"norm_eps": float("nan")}, "mixer 'mla': norm_eps must be finite and > 0; got nan"),  # trained on NaN
    ("mesa", {"norm_eps": -1.0}, "mixer 'mesa': norm_eps must be finite and > 0; got -1.0"),
    ("goat", {"position_args": {"abs_scale": 0}}, "position_args of 'goat': abs_scale must be finite and > 0; got 0"),
    ("goat", {"position_args": {"axes": 0}}, "position_args of 'goat': axes must be finite and >= 1; got 0"),
    ("rope", {"position_args": {"base": -1.0}}, "position_args of 'rope': base must be finite and > 0; got -1.0"),
    ("hawk", {"c": float("inf")}, "mixer 'hawk': c must be finite and > 0; got inf"),  # trained on NaN
    ("goat", {"position_args": {"freq_base": float("inf")}},
     "position_args of 'goat': freq_base must be finite and > 0; got inf"),  # was silently accepted
    ("mamba2", {"dt_min": 0.5, "dt_max": 0.1}, "mamba2 mixer: dt_min must be <= dt_max; got 0.5 > 0.1"),
    ("mamba2", {"a_init_range": [-1, -2]}, "mamba2 mixer: a_init_range must be [low, high] with 0 < low <= high"),
    ("gla", {"expand_v": 0.01}, "gla mixer: expand_v=0.01 leaves int(head_dim * expand_v) = 0 value channels"),
    ("goat", {"position_args": {"modes_per_axis": "abc"}},
     "modes_per_axis must be a list of 1 integer(s) >= 0 summing to n_modes=4; got 'abc'"),
    ("goat", {"dropout": 1.5}, "mixer 'goat': dropout must be finite and >= 0 and < 1; got 1.5"),
])
def test_mixer_constructors_name_the_bad_argument(name, kwargs, message):
    """Ranges declared in a class's ``arg_bounds`` are checked by the registry (NaN fails them too); the rest by
    the class."""
    from mixlab.registry import build_mixer

    args = {"d_model": 64, "n_heads": 4, "causal": True, **kwargs}
    with pytest.raises(ValueError) as info:
        build_mixer(name, **args)
    assert str(info.value).startswith(message), str(info.value)


def test_run_names_are_shell_safe():
    from mixlab.backbone import pattern_name

    assert pattern_name("kda*3,mla") == "kdax3-mla"
    assert pattern_name(["goat", "mla"]) == "goat-mla"


def test_resolution_command_bad_input_is_one_line(capsys, tmp_path, monkeypatch):
    """``python -m mixlab resolution``: argparse errors for bad sizes, one line for a checkpoint of
    another task (found by a user test: a 61-line torch traceback, and Lightning's class error)."""
    import torch

    monkeypatch.setattr(sys, "argv", ["mixlab"])
    with pytest.raises(SystemExit) as info:
        cli.main(["resolution", "--ckpt", "x.ckpt", "--resolutions", "0"])
    assert info.value.code == 2
    assert "argument --resolutions: '0': height and width must be >= 1" in capsys.readouterr().err
    ckpt = tmp_path / "lm.ckpt"
    torch.save({"hyper_parameters": {"_class_path": "mixlab.heads.CausalLM"}, "state_dict": {}}, ckpt)
    with pytest.raises(SystemExit) as info:
        cli.main(["resolution", "--ckpt", str(ckpt), "--resolutions", "16", "--out", str(tmp_path / "out")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-2] == (f"error: --ckpt {ckpt}: a mixlab.heads.CausalLM checkpoint; the resolution evaluation "
                       f"needs an ImageClassifier run (e.g. configs/vit/*.yaml)")
    with pytest.raises(SystemExit) as info:
        cli.main(["resolution", "--ckpt", str(tmp_path / "missing.ckpt"), "--resolutions", "16",
                  "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-2] == f"error: --ckpt {tmp_path / 'missing.ckpt'}: file not found"


def test_image_size_not_divisible_by_patch_is_one_line_before_training(capsys, tmp_path, monkeypatch):
    """Checked in ``ImageClassifier.setup`` (a user test found it only at the first batch)."""
    digits = str(Path(GOAT).parents[1] / "vit" / "goat_digits.yaml")
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", "--config", digits, "--trainer.max_steps=1", "--run_root", str(tmp_path),
                  "--data.init_args.image_size=26"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-2] == ("error: data.init_args.image_size=26: image size 26x26 is not divisible by patch_size=4; "
                       "resize/crop to multiples of 4 (e.g. 24x24)")


def test_every_extra_command_name_resolves():
    """The README's commands keep their names after the evaluation wing moved into ``mixlab.eval``."""
    assert sorted(cli.COMMANDS) == ["compare", "copy-prior", "figure", "generate", "length-extrapolation", "mixers",
                                    "niah", "passkey", "reproduce", "resolution"]
    # the evaluation wing, and the mixer registry's listing (python -m mixlab mixers)
    assert all(t.startswith(("mixlab.eval.", "mixlab.mixers:")) and callable(cli._resolve(t))
               for t in cli.COMMANDS.values())


def _fit_refuses_in_one_line(config: str, override: str, message: str, capsys, run_root: Path) -> None:
    """``fit --config config override`` exits with status 2 and ``message`` as its one error line, no traceback."""
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", "--config", config, "--trainer.max_steps=1", "--run_root", str(run_root), override])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-2] == message and not any("Traceback" in line for line in err), err


def test_bad_values_that_failed_at_the_first_step_are_one_line_before_training(capsys, tmp_path, monkeypatch):
    """A user test: these trained into a raw traceback at the first step (label smoothing, a zero image size), gave
    nonsense advice (a patch larger than the image: "e.g. 0x0"), or trained silently (a negative clip norm)."""
    digits = str(Path(GOAT).parents[1] / "vit" / "goat_digits.yaml")
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    for override, message in (
            ("--model.init_args.label_smoothing=2",
             "error: --model.init_args.label_smoothing: must be in [0, 1); got 2.0"),
            ("--data.init_args.image_size=0", "error: --data.init_args.image_size: must be >= 1; got 0"),
            ("--model.init_args.patch_size=50", "error: data.init_args.image_size=24: image size 24x24 is smaller than "
                                                "one patch (patch_size=50): give a patch_size <= 24 or larger images"),
            ("--trainer.gradient_clip_val=-1", "error: trainer.gradient_clip_val=-1: give a norm (or value) >= 0, or "
                                               "null for no clipping")):
        _fit_refuses_in_one_line(digits, override, message, capsys, tmp_path)
    assert not list(tmp_path.rglob("version_*"))  # nothing written


def test_imagenet_transform_names_and_a_tuple_value_are_one_line_naming_the_option(capsys, tmp_path, monkeypatch):
    """A user test: an unknown ``auto_augment`` policy or ``interpolation`` crashed in timm's transforms with a long
    traceback when the first loader was built; a bad ``scale`` named ``data:`` instead of its option (the message
    shows the list the user gave as a tuple)."""
    imagenet = str(Path(GOAT).parents[1] / "vit" / "goat_imagenet.yaml")
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    for override, message in (
            ("--data.init_args.auto_augment=bogus-m9", "error: --data.init_args.auto_augment: ImageNetDataModule: "
             "auto_augment must be a timm policy string such as 'rand-m9-mstd0.5-inc1' or 'augmix-m5-w4-d2' (or "
             "null); got 'bogus-m9' (AssertionError: Unknown AutoAugment config section)"),
            ("--data.init_args.interpolation=cubicc", "error: --data.init_args.interpolation: ImageNetDataModule: "
             "interpolation must be one of nearest, bilinear, bicubic, box, hamming, lanczos; got 'cubicc'"),
            ("--data.init_args.scale=[1.0, 0.1]", "error: --data.init_args.scale: ImageNetDataModule: scale must be "
             "(min, max) with 0 < min <= max <= 1; got (1.0, 0.1)")):
        _fit_refuses_in_one_line(imagenet, override, message, capsys, tmp_path)
    assert not list(tmp_path.rglob("version_*"))  # nothing written


def test_an_evaluation_commands_checkpoint_with_a_missing_weight_is_one_line(tmp_path):
    """A user test: ``generate --ckpt`` of a checkpoint missing a tensor gave load_state_dict's raw traceback."""
    import torch

    from mixlab.eval.common import load_run
    from mixlab.heads.lm import CausalLM

    model = CausalLM(vocab_size=8, backbone={"d_model": 16, "n_layers": 1, "n_heads": 2, "mixer": "nope"})
    ckpt = {"state_dict": {k: v for k, v in model.state_dict().items() if k != "embed.weight"},
            "hyper_parameters": dict(model.hparams), "pytorch-lightning_version": "2.6.0", "global_step": 3}
    torch.save(ckpt, tmp_path / "x.ckpt")
    with pytest.raises(ValueError, match=r"--ckpt .*x.ckpt: its weights do not fit the mixlab.heads.lm.CausalLM it "
                                         r"records \(1 tensor\(s\) of the model missing from the checkpoint, e.g. "
                                         r"embed.weight\)"):
        load_run(tmp_path / "x.ckpt", head=CausalLM)


def test_ctrl_c_in_an_evaluation_command_is_one_line(capsys, monkeypatch):
    """A user test: Ctrl-C in ``length-extrapolation`` printed a 20-line KeyboardInterrupt traceback."""
    import signal

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_resolve", lambda target: interrupted)
    monkeypatch.delenv("MIXLAB_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as info:
        cli.main(["length-extrapolation", "--ckpt", "x.ckpt"])
    assert info.value.code == 128 + signal.SIGINT
    assert capsys.readouterr().err.strip() == "mixlab length-extrapolation: interrupted (Ctrl-C)"


def test_sigterm_in_an_evaluation_command_puts_its_outputs_back_and_is_one_line(capsys, monkeypatch, tmp_path):
    """A user test: SIGTERM (``timeout``, a batch system) ended passkey and length-extrapolation silently, leaving a
    partial event file that ``compare`` then read. The command's ``undo_on_failure`` now runs, as for Ctrl-C."""
    import os
    import signal

    from mixlab.eval.common import undo_on_failure

    out = tmp_path / "out"

    def command(argv):
        with undo_on_failure() as note:
            note(out).mkdir()
            (out / "events.out.tfevents.1").write_bytes(b"partial")
            os.kill(os.getpid(), signal.SIGTERM)  # delivered to the main thread: the handler raises here

    monkeypatch.setattr(cli, "_resolve", lambda target: command)
    monkeypatch.delenv("MIXLAB_TRACEBACK", raising=False)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as info:
        cli.main(["passkey", "--ckpt", "x.ckpt"])
    assert info.value.code == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip() == "mixlab passkey: terminated (SIGTERM)"
    assert not out.exists()  # the folder it created is gone
    assert signal.getsignal(signal.SIGTERM) is before  # the process's own handler is back


def test_a_repeated_evaluation_replaces_its_earlier_events_only_when_it_succeeds(tmp_path):
    """``note(folder, replace=True)``: a second call's scalars replace the first call's (TensorBoard showed both,
    and ``compare`` took the newest by wall time); a failed call keeps them."""
    from mixlab.eval.common import undo_on_failure

    tb = tmp_path / "tb"
    tb.mkdir()
    (tb / "events.out.tfevents.1").write_bytes(b"first")
    (tb / "notes.txt").write_text("kept")
    with pytest.raises(RuntimeError), undo_on_failure() as note:
        note(tb, replace=True)
        (tb / "events.out.tfevents.2").write_bytes(b"failed")
        raise RuntimeError("evaluation failed")
    assert sorted(p.name for p in tb.iterdir()) == ["events.out.tfevents.1", "notes.txt"]
    with undo_on_failure() as note:
        note(tb, replace=True)
        (tb / "events.out.tfevents.3").write_bytes(b"second")
    assert sorted(p.name for p in tb.iterdir()) == ["events.out.tfevents.3", "notes.txt"]


def test_replace_by_tags_keeps_event_files_with_other_tags(tmp_path):
    """``note(folder, replace="tags")`` (a run's shared TensorBoard folder, e.g. ``figure``): after success only the
    earlier event files whose tags the new files all hold again go; training logs, another figure's tags and
    unreadable files stay; an unknown ``replace`` is refused."""
    import time

    from torch.utils.tensorboard import SummaryWriter

    from mixlab.eval.common import undo_on_failure

    tb = tmp_path / "tb"

    def write(*tags):
        with SummaryWriter(str(tb)) as w:
            for t in tags:
                w.add_scalar(t, 1.0, 0)
        time.sleep(1.1)  # one event file per second and host
        return max(tb.glob("events.out.tfevents.*"), key=lambda f: f.stat().st_mtime_ns)

    train = write("train/loss", "val/loss")
    figure = write("goat_prior/layer0")
    other = write("goat_prior/layer0", "write_rates/layer0")
    (tb / "events.out.tfevents.broken").write_bytes(b"not an event file")
    with undo_on_failure() as note:
        note(tb, replace="tags")
        new = write("goat_prior/layer0")
    assert set(tb.glob("events.out.tfevents.*")) == {train, other, new, tb / "events.out.tfevents.broken"}
    assert figure not in set(tb.iterdir())
    with pytest.raises(ValueError, match="replace must be False, True or 'tags'; got 'all'"), \
            undo_on_failure() as note:
        note(tb, replace="all")


def test_an_unwritable_run_root_is_one_line(capsys, tmp_path, monkeypatch):
    """``--run_root`` under a file, a file, or empty: one line naming it (was the logger's OSError traceback after
    the model was built), and nothing is written."""
    afile = tmp_path / "afile"
    afile.write_text("keep")
    err = _fail(capsys, monkeypatch, tmp_path, "--run_root", str(afile / "runs"))
    assert err[-2] == (f"error: --run_root {str(afile / 'runs')!r} cannot be written: {str(afile)!r} is a file, "
                       "not a folder")
    err = _fail(capsys, monkeypatch, tmp_path, "--run_root", str(afile))
    assert err[-2] == f"error: --run_root {str(afile)!r} is a file; give a folder"
    err = _fail(capsys, monkeypatch, tmp_path, "--run_root", "")
    assert err[-2] == "error: --run_root is empty; give a folder path"
    assert afile.read_text() == "keep" and sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
    # a file where the run's own folder goes (<run_root>/<task>, <run_root>/<task>/<run_name>), a name over 255
    # bytes: Lightning's / TensorBoard's NotADirectoryError, FileExistsError, "File name too long" tracebacks
    (tmp_path / "genome").write_text("keep")
    err = _fail(capsys, monkeypatch, tmp_path)
    assert err[-2] == (f"error: --run_root/<task>/<run_name> {str(tmp_path / 'genome' / 'goat')!r} cannot be written: "
                       f"{str(tmp_path / 'genome')!r} is a file, not a folder")
    (tmp_path / "genome").unlink()
    (tmp_path / "genome").mkdir()
    (tmp_path / "genome" / "goat").write_text("keep")
    err = _fail(capsys, monkeypatch, tmp_path)
    assert err[-2] == (f"error: --run_root/<task>/<run_name> {str(tmp_path / 'genome' / 'goat')!r} is a file; "
                       "give a folder")
    err = _fail(capsys, monkeypatch, tmp_path, "--run_root", str(tmp_path / ("b" * 300)))
    assert err[-2].endswith(f"cannot be written: the name {'b' * 20!r}... is over 255 bytes")
    err = _fail(capsys, monkeypatch, tmp_path, "--run_name", "a" * 300)
    assert err[-2].endswith(f"cannot be written: the name {'a' * 20!r}... is over 255 bytes")
    err = _fail(capsys, monkeypatch, tmp_path, "--run_name", "a\nb")
    assert err[-2].startswith("error: --run_name 'a\\nb': one folder name inside --run_root/<task>")
    assert (tmp_path / "genome" / "goat").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["afile", "genome", "goat"]
