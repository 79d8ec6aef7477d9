"""Registry-driven checks that every registered mixer gets for free (no per-mixer test code):

* forward is finite and every parameter receives a gradient (DDP with find_unused_parameters=False);
* token-by-token decoding through the cache equals the parallel forward (causal mixers), also after
  prefixes of every length around the mixer's window, chunk and convolution sizes;
* a state_dict round trip reproduces the output.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch

from mixlab.backbone import Backbone, BackboneConfig
from mixlab.registry import build_mixer, list_mixers

D, H = 64, 2


def _mixer(name: str, causal: bool = True):
    torch.manual_seed(0)
    return build_mixer(name, d_model=D, n_heads=H, causal=causal, layer_idx=0, n_layers=2).double()


@pytest.mark.parametrize("name", list_mixers())
def test_every_parameter_gets_a_gradient(name):
    cfg = BackboneConfig(d_model=D, n_layers=2, n_heads=H, mixer=name)
    torch.manual_seed(0)
    bb = Backbone(cfg)
    x = torch.randn(2, 13, D)
    y = bb(x)
    assert torch.isfinite(y).all()
    (y * torch.randn_like(y)).sum().backward()
    missing = [n for n, p in bb.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"{name}: parameters without gradient (breaks DDP find_unused_parameters=False): {missing}"


@pytest.mark.parametrize("name", list_mixers())
def test_cached_decoding_equals_parallel_forward(name):
    m = _mixer(name)
    m.eval()
    x = torch.randn(2, 9, D, dtype=torch.float64)
    with torch.no_grad():
        full = m(x)
        cache: dict = {}
        steps = [m(x[:, :3], cache=cache)] + [m(x[:, t : t + 1], cache=cache) for t in range(3, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-7, atol=1e-7)


# the smallest windows and chunks each mixer accepts (a mixer's option of one of these names is set)
SMALL_SIZES = {"window": 6, "chunk_size": 8, "conv_size": 3}


@pytest.mark.parametrize("name", list_mixers())
def test_cache_after_any_prefix_equals_the_parallel_forward(name):
    """Prefixes of every length 1..T-1, shorter and longer than the mixer's window, chunk and short
    convolution, then two tokens decoded one at a time: the outputs equal the parallel forward (swa's
    cache used to keep only 2n - window + 1 of the last n < window keys)."""
    from mixlab.registry import MIXERS

    sizes = {k: v for k, v in SMALL_SIZES.items() if k in (MIXERS.options(name) or [])}
    torch.manual_seed(0)
    m = build_mixer(name, d_model=32, n_heads=H, causal=True, layer_idx=0, n_layers=2, **sizes).double().eval()
    t = 12
    x = torch.randn(1, t, 32, dtype=torch.float64)
    with torch.no_grad():
        full = m(x)
        for p in range(1, t - 1):
            cache: dict = {}
            steps = [m(x[:, :p], cache=cache)] + [m(x[:, i:i + 1], cache=cache) for i in (p, p + 1)]
            torch.testing.assert_close(torch.cat(steps, 1), full[:, :p + 2], rtol=1e-7, atol=1e-7,
                                       msg=lambda s: f"{name} {sizes}, prefix {p}: {s}")


@pytest.mark.parametrize("name", list_mixers())
def test_state_dict_round_trip(name):
    a, b = _mixer(name), None
    torch.manual_seed(123)
    b = build_mixer(name, d_model=D, n_heads=H, causal=True, layer_idx=0, n_layers=2).double()
    b.load_state_dict(a.state_dict())
    x = torch.randn(1, 7, D, dtype=torch.float64)
    a.eval(), b.eval()
    with torch.no_grad():
        torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)


# ---------------------------------------------------------------------- position schemes: built like mixers
from mixlab.registry import MIXERS, POSITIONS  # noqa: E402


@pytest.mark.parametrize("name", POSITIONS.names())
def test_position_scheme_typo_is_a_one_line_error_naming_the_accepted_keys(name):
    """A typo in any scheme's ``position_args`` is an error (rope and alibi used to ignore it silently)."""
    with pytest.raises(ValueError) as info:
        build_mixer("goat", d_model=D, n_heads=H, causal=True, position=name, position_args={"n_mode": 2})
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"position_args of {name!r} got unknown key(s) 'n_mode'; it ")
    accepted = POSITIONS.options(name)
    hint = "; did you mean 'n_modes' for 'n_mode'?" if "n_modes" in accepted else ""  # the closest key, if any
    assert accepted == [] or msg.endswith("it accepts: " + ", ".join(accepted) + hint)
    assert accepted != [] or msg.endswith("it accepts no keys")


def test_rope_and_alibi_reject_their_likely_typos():
    with pytest.raises(ValueError,
                       match=r"position_args of 'rope' got unknown key\(s\) 'bsae'; it accepts: axes, base"):
        build_mixer("rope", d_model=D, n_heads=H, causal=True, position_args={"bsae": 100.0})
    with pytest.raises(ValueError,
                       match=r"position_args of 'alibi' got unknown key\(s\) 'n_modes'; it accepts no keys"):
        build_mixer("alibi", d_model=D, n_heads=H, causal=True, position_args={"n_modes": 2})
    with pytest.raises(ValueError,
                       match="unknown position scheme 'goat2d'; registered position schemes: alibi, goat, nope"):
        build_mixer("goat", d_model=D, n_heads=H, causal=True, position="goat2d")


def test_a_position_args_key_given_at_the_mixers_level_is_pointed_to_its_place():
    """GOAT's ``lane_impl`` and RoPE's ``rotary_impl`` live in ``position_args``: given one level up, the error
    says where they go (it used to suggest the unrelated ``impl``); a plain typo still gets its "did you mean"."""
    with pytest.raises(ValueError) as info:
        build_mixer("goat", d_model=D, n_heads=H, causal=True, lane_impl="where")
    assert str(info.value) == ("mixer 'goat' got unknown argument(s) 'lane_impl'; it accepts: position, position_args, "
                               "head_dim, impl, bias, dropout; 'lane_impl' is a key of position_args: "
                               "mixer_args.goat.position_args.lane_impl")
    with pytest.raises(ValueError, match="'rotary_impl' is a key of position_args: "
                                         "mixer_args.rope.position_args.rotary_impl$"):
        build_mixer("rope", d_model=D, n_heads=H, causal=True, rotary_impl="triton")
    with pytest.raises(ValueError, match="did you mean 'impl' for 'imple'\\?$"):
        build_mixer("goat", d_model=D, n_heads=H, causal=True, imple="sdpa")
    # the other way round: a mixer's own argument given inside position_args is pointed back to the mixer's level
    with pytest.raises(ValueError) as info:
        BackboneConfig(d_model=D, n_layers=1, n_heads=H, mixer="goat",
                       mixer_args={"goat": {"position_args": {"impl": "sdpa"}}})
    assert str(info.value).endswith("'impl' is an argument of mixer 'goat': mixer_args.goat.impl")
    assert "did you mean" not in str(info.value)


@pytest.mark.parametrize("where, value, message", [
    ({"position_args": {"n_modes": "abc"}}, "abc", "position_args of 'goat': n_modes must be int; got 'abc'"),
    ({"position_args": {"n_modes": True}}, True, "position_args of 'goat': n_modes must be int; got True"),
    ({"position_args": {"learn_slope": 1}}, 1, "position_args of 'goat': learn_slope must be bool; got 1"),
    ({"position_args": {"lane_impl": "fast"}}, "fast", "position_args of 'goat': lane_impl must be 'auto' or 'torch' "
                                                        "or 'triton' or 'where' or 'scatter'; got 'fast'"),
    ({"impl": 3}, 3, "mixer 'goat': impl must be 'sdpa' or 'reference'; got 3"),
])
def test_a_value_of_the_wrong_plain_type_is_named(where, value, message):
    """Values annotated ``int``/``float``/``bool``/``str``/``Literal`` are checked by the registry before the class
    runs (a string ``n_modes`` was a TypeError deep in the constructor, which jsonargparse printed as a "Union
    subtypes" traceback), for the mixers a pattern uses and for the ones it does not."""
    for mixer in ("goat", "kda"):
        with pytest.raises(ValueError) as info:
            BackboneConfig(d_model=D, n_layers=1, n_heads=H, mixer=mixer, mixer_args={"goat": where})
        assert str(info.value) == f"backbone: mixer_args.goat: {message}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        build_mixer("goat", d_model=D, n_heads=H, causal=True, **where)
    ok = build_mixer("goat", d_model=D, n_heads=H, causal=True, position_args={"freq_base": 100, "n_modes": 2})
    assert ok.pos.n_modes == 2  # an int (freq_base: 100) where a float is annotated passes


def test_mixer_args_of_a_mixer_outside_the_pattern_are_checked_and_said_unused(caplog):
    """A shared ``mixer_args`` block may hold entries for mixers the pattern does not use (one config, several
    runs): their keys are checked like the used ones' (a typo is an error naming the entry) and one INFO line says
    they are unused; their values are not built, so they are not checked."""
    with pytest.raises(ValueError, match="^backbone: mixer_args.rope: mixer 'rope' got unknown argument\\(s\\) "
                                         "'bogus_top'"):
        BackboneConfig(d_model=D, n_layers=1, n_heads=H, mixer="goat", mixer_args={"rope": {"bogus_top": 1}})
    with pytest.raises(ValueError, match="^backbone: mixer_args.rope: position_args of 'rope' got unknown key\\(s\\) "
                                         "'bogus'; it accepts: axes, base"):
        BackboneConfig(d_model=D, n_layers=1, n_heads=H, mixer="goat",
                       mixer_args={"rope": {"position_args": {"bogus": 1}}})
    with pytest.raises(ValueError, match="^backbone: mixer_args.goat must be a mapping of goat's options .*; got 5$"):
        BackboneConfig(d_model=D, n_layers=1, n_heads=H, mixer="goat", mixer_args={"goat": 5})
    with pytest.raises(ValueError, match="^backbone: mixer_args.goat.position_args must be a mapping .*; got 5$"):
        BackboneConfig(d_model=D, n_layers=1, n_heads=H, mixer="goat", mixer_args={"goat": {"position_args": 5}})
    assert BackboneConfig(d_model=D, n_layers=1, n_heads=H, mixer="goat", mixer_args={"goat": None}).mixer_args == \
        {"goat": {}}  # null: the defaults
    with caplog.at_level(logging.INFO, logger="mixlab.backbone"):
        BackboneConfig(d_model=D, n_layers=1, n_heads=H, mixer="kda*1,goat",
                       mixer_args={"goat": {}, "mesa": {"cg_iters": 15}, "swa": {"window": 8}})
    assert "backbone: mixer_args for 'mesa', 'swa' unused: the mixer pattern 'kda*1,goat' has no such layer" \
        in caplog.text


@pytest.mark.parametrize("name", POSITIONS.names())
def test_every_position_scheme_describes_the_axes_it_reads(name):
    m = build_mixer("goat", d_model=D, n_heads=H, causal=True, position=name).double()
    assert m.describe()["position"] == name
    assert m.position_axes == (None if name == "nope" else 1)
    assert Backbone(BackboneConfig(d_model=D, n_layers=1, n_heads=H, mixer="goat",
                                   mixer_args={"goat": {"position": name}})).position_axes() == \
        (set() if name == "nope" else {1})


def test_registry_names_its_entries_and_refuses_a_second_registration():
    assert {"goat", "rope", "alibi", "nope"} <= set(list_mixers())
    assert POSITIONS.names() == ["alibi", "goat", "nope", "rope"]
    with pytest.raises(ValueError, match="mixer 'goat' is already registered"):
        MIXERS.register("goat")(type("Other", (), {}))
    with pytest.raises(ValueError, match="unknown mixer 'gaot'; registered mixers: alibi, deltanet.*; did you mean "
                                         "'goat'\\?$"):
        MIXERS.get("gaot")
    with pytest.raises(ValueError, match="registered mixers: [a-z0-9_, ]+$"):  # nothing close: no suggestion
        MIXERS.get("transformer")
    with pytest.raises(ValueError, match="mixer\\(s\\) 'mesaa'; registered mixers: .*; did you mean 'mesa' for "
                                         "'mesaa'\\?$"):
        BackboneConfig(mixer="goat", mixer_args={"mesaa": {}})


# ---------------------------------------------------------------------- init by type, also for mixers outside mixlab
USER_PACKAGE = '''
import torch
from torch import nn

from mixlab.mixers.base import Mixer
from mixlab.registry import register_mixer


@register_mixer("user_gate")
class UserGate(Mixer):
    def __init__(self, d_model, n_heads, causal=True, layer_idx=0, n_layers=1, scale=0.5):
        super().__init__()
        self.proj = nn.Linear(d_model, d_model)
        self.gate = nn.Parameter(torch.empty(d_model))
        self.scale = scale
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            self.gate.fill_(self.scale)
            self.proj.weight.copy_(torch.eye(self.proj.weight.shape[0]))  # its own init of its linear layer

    def forward(self, x, coords=None, cache=None):
        return self.proj(x) * self.gate
'''


def test_a_mixer_registered_outside_mixlab_gets_its_own_reset_parameters(tmp_path, monkeypatch):
    """The backbone selects mixers by type (``isinstance(m, Mixer)``), not by module path: a user's
    mixer gets its own init after the generic one, which would otherwise overwrite its linear layers."""
    (tmp_path / "my_lab_mixers.py").write_text(USER_PACKAGE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(MIXERS, "_classes", dict(MIXERS._classes))  # registrations of this test are undone
    monkeypatch.setattr(MIXERS, "_defaults", dict(MIXERS._defaults))
    import importlib

    mod = importlib.import_module("my_lab_mixers")
    monkeypatch.delitem(__import__("sys").modules, "my_lab_mixers")
    assert mod.UserGate.__module__ == "my_lab_mixers"
    torch.manual_seed(0)
    bb = Backbone(BackboneConfig(d_model=8, n_layers=2, n_heads=2, mixer="user_gate,nope",
                                 mixer_args={"user_gate": {"scale": 0.25}}))
    mixer = bb.blocks[0].mixer
    assert torch.equal(mixer.gate, torch.full((8,), 0.25))
    assert torch.equal(mixer.proj.weight, torch.eye(8))  # not the generic N(0, 0.02) init
    x = torch.randn(1, 3, 8)
    torch.testing.assert_close(mixer(x), x @ torch.eye(8).T * 0.25 + mixer.proj.bias * 0.25)


def test_the_cli_imports_a_users_mixer_package_named_in_mixlab_import(tmp_path):
    """``MIXLAB_IMPORT=my_lab_mixers python -m mixlab fit ... --model.init_args.backbone.mixer user_gate``
    trains with the user's mixer (its gate, initialised to 0.5, is in the checkpoint); a module that does not import
    is one line naming the variable, exit 2."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "my_lab_mixers.py").write_text(USER_PACKAGE)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
           "MIXLAB_IMPORT": "my_lab_mixers"}
    argv = [sys.executable, "-m", "mixlab", "fit", "--config", str(root / "configs/genome/goat.yaml"),
            "--model.init_args.backbone.mixer", "user_gate", "--model.init_args.backbone.d_model", "16",
            "--model.init_args.backbone.n_layers", "1", "--data.init_args.context_length", "32",
            "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false",
            "--run_root", str(tmp_path / "runs")]
    # both commands side by side (each pays the interpreter's start-up): the good one, and one whose list of
    # modules names one that does not import
    done, bad = [subprocess.Popen(argv, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
                 for e in (env, {**env, "MIXLAB_IMPORT": "my_lab_mixers, no_such_pkg"})]
    (_, done_err), (_, bad_err) = done.communicate(timeout=600), bad.communicate(timeout=600)
    assert done.returncode == 0, done_err[-2000:]
    ckpt = torch.load(next((tmp_path / "runs").rglob("last.ckpt")), weights_only=False)
    gate = ckpt["state_dict"]["backbone.blocks.0.mixer.gate"]  # its own init (0.5), moved by 2 training steps
    torch.testing.assert_close(gate, torch.full((16,), 0.5), atol=2e-3, rtol=0)
    assert not torch.equal(gate, torch.full((16,), 0.5))
    assert bad.returncode == 2
    assert bad_err.splitlines()[0] == ("error: MIXLAB_IMPORT=my_lab_mixers, no_such_pkg: cannot import "
                                       "'no_such_pkg': ModuleNotFoundError: No module named 'no_such_pkg'")


def test_mixers_command_prints_each_mixers_defaults_as_a_mixer_args_block(capsys, caplog):
    """``python -m mixlab mixers NAME...`` (``--print_config`` shows ``mixer_args: {}`` for a config that
    keeps every default): its YAML is valid ``mixer_args``, building each mixer with it equals the default
    build, and the values are the constructors' defaults (spot checks)."""
    import yaml

    from mixlab.cli import main as cli_main

    names = list_mixers()
    cli_main(["mixers", *names])
    block = yaml.safe_load(capsys.readouterr().out)["mixer_args"]
    assert list(block) == names
    for name in names:
        torch.manual_seed(0)
        spelled = build_mixer(name, d_model=D, n_heads=H, causal=True, layer_idx=0, n_layers=2, **block[name])
        plain = _mixer(name).float()
        assert {k: v.shape for k, v in spelled.state_dict().items()} == \
            {k: v.shape for k, v in plain.state_dict().items()}, name
        for (k, a), b in zip(spelled.state_dict().items(), plain.state_dict().values()):
            torch.testing.assert_close(a.float(), b.float(), msg=f"{name}.{k}")
    assert "position" not in block["goat"] and block["goat"]["position_args"]["n_modes"] == 4
    assert "decay" not in block["deltanet"]  # set by the name: deltanet with decay scalar is a GDN layer
    with caplog.at_level(logging.WARNING, logger="mixlab.registry"):
        for _ in range(2):
            build_mixer("deltanet", d_model=D, n_heads=H, decay="scalar")
    assert [r.getMessage() for r in caplog.records] == [
        "mixer 'deltanet': decay='scalar' replaces the decay='none' its name sets; the run is still named after "
        "'deltanet'"]
    assert block["mesa"]["cg_iters"] == 30 and block["deltanet"]["allow_neg_eigval"] is False
    cli_main(["mixers"])
    listing = capsys.readouterr().out
    assert all(f"\n{n} " in "\n" + listing for n in names) and "python -m mixlab mixers NAME" in listing
    with pytest.raises(SystemExit) as info:
        cli_main(["mixers", "gdnn"])
    assert info.value.code == 2 and "unknown mixer 'gdnn'" in capsys.readouterr().err


def test_a_misspelt_mixer_in_a_pattern_is_named_before_the_layer_count():
    """``kda*3,mlx`` on 2 layers: the unknown ``mlx`` (with its "did you mean") comes first, not the count."""
    from mixlab.backbone import parse_pattern

    with pytest.raises(ValueError, match="unknown mixer 'mlx'.*did you mean 'mla'\\?$"):
        parse_pattern("kda*3,mlx", 2)
    with pytest.raises(ValueError, match="has 4 entries; n_layers=2 is not a multiple$"):
        parse_pattern("kda*3,mla", 2)


def test_closest_ignores_letter_case():
    """A user test: ``--ckpt_path LAST`` got no "did you mean last" (``lastt`` did)."""
    from mixlab.registry import closest

    assert closest("LAST", ["last", "best"]) == "last"
    assert closest("Goat", ["goat", "rope"]) == "goat" and closest("lastt", ["last", "best"]) == "last"
    assert closest("zzz", ["last", "best"]) is None
