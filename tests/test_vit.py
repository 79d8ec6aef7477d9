"""ViT head: 2D GOAT logits by formula, resolution transfer, APE resampling vs timm, timm registration."""

from __future__ import annotations

import csv
import math
import threading

import pytest
import torch
import torch.nn.functional as F
from helpers.training import direct_top1

from mixlab.backbone import BackboneConfig
from mixlab.coords import Coords
from mixlab.datamodules.digits import DigitsDataModule, load_uci_digits
from mixlab.heads.vit import ImageClassifier, MixupConfig, MixViT, vit_backbone
from mixlab.mixers.attention import Attention

D, H = 48, 2  # head_dim 24


# ---------------------------------------------------------------------- 2D GOAT by formula
@torch.no_grad()
def goat2d_explicit(m: Attention, x: torch.Tensor, gh: int, gw: int, base: float, modes_per_axis: int) -> torch.Tensor:
    """[CLS] + a gh x gw grid, z_ij = q_c.k_c/sqrt(d_c) + rel_y(dy) + rel_x(dx) + default*1{j = CLS}."""
    p = m.pos
    T = 1 + gh * gw
    dc, dh = m.d_c, m.head_dim
    qc, kc, v = (t[0].transpose(0, 1) for t in m._split(x))  # content q, k [T, H, d_c]; v [T, H, d_h]
    # the same geometric grid on each axis: w_r = base^(-r/(R_a-1)) (stored in float32 by the module,
    # so take the stored values); modes [0, R_a) are y, [R_a, 2R_a) are x
    w = [base ** (-r / (modes_per_axis - 1)) for r in range(modes_per_axis)]
    torch.testing.assert_close(p.freqs(), torch.tensor(w + w, dtype=torch.float64), rtol=1e-6, atol=0)
    w = p.freqs()[:modes_per_axis].tolist()
    yx = [None] + [(i // gw, i % gw) for i in range(gh * gw)]  # token 0 = [CLS], no coordinates
    z = torch.empty(H, T, T, dtype=torch.float64)
    for h in range(H):
        for i in range(T):
            for j in range(T):
                s = float(qc[i, h] @ kc[j, h]) / math.sqrt(dc)
                if yx[i] is not None and yx[j] is not None:
                    dy, dx = yx[i][0] - yx[j][0], yx[i][1] - yx[j][1]
                    for r in range(modes_per_axis):
                        ry, rx = r, modes_per_axis + r
                        s += float(p.alpha[h, ry]) * math.cos(w[r] * dy) + float(p.beta[h, ry]) * math.sin(w[r] * dy)
                        s += float(p.alpha[h, rx]) * math.cos(w[r] * dx) + float(p.beta[h, rx]) * math.sin(w[r] * dx)
                if yx[j] is None:
                    s += float(p.default[h])
                z[h, i, j] = s
    o = torch.softmax(z, -1) @ v.transpose(0, 1)
    return m.proj(o.transpose(0, 1).reshape(1, T, H * dh)), z


@pytest.mark.parametrize("gh,gw", [(3, 5), (4, 4), (1, 3)])
def test_goat2d_logits_equal_sum_of_y_and_x_terms_plus_cls_default(gh, gw):
    torch.manual_seed(gh * 10 + gw)
    args = dict(n_modes=6, axes=2, default_bias=True, key_mlp_hidden=0, freq_base=100.0)
    m = Attention(D, H, causal=False, position="goat", position_args=args).double()
    with torch.no_grad():
        for prm in m.pos.parameters():
            prm.copy_(torch.randn_like(prm))
    assert not m.pos.key_linear and not m.pos.use_bos  # bidirectional defaults
    # isotropic allocation: both axes get the full grid, including the highest frequency 1
    f = m.pos.freqs()
    torch.testing.assert_close(f[:3], f[3:])
    assert float(f[3]) == pytest.approx(1.0)
    coords = Coords.cat([Coords.empty(1, 2), Coords.grid(gh, gw)])
    x = torch.randn(1, coords.length, D, dtype=torch.float64)
    want, z = goat2d_explicit(m, x, gh, gw, 100.0, 3)
    torch.testing.assert_close(m(x, coords), want, rtol=1e-10, atol=1e-10)  # SDPA lanes
    m.impl = "reference"
    torch.testing.assert_close(m(x, coords), want, rtol=1e-10, atol=1e-10)
    # the prior alone (no content) from the module's formula
    prior = m.pos.prior_terms(coords, coords)["total"][0]
    qc, kc, _ = m._split(x)
    content = qc[0] @ kc[0].transpose(-1, -2) / math.sqrt(m.d_c)
    torch.testing.assert_close(prior + content, z, rtol=1e-10, atol=1e-10)


def _tiny(position: str, img: int = 16, **kw) -> MixViT:
    bb = vit_backbone(position, d_model=32, n_layers=2, n_heads=2, n_modes=4, drop_path=0.0)
    return MixViT(10, img, 4, position=position, backbone=bb, **kw)


def test_vit_goat2d_sdpa_equals_reference_through_the_model():
    torch.manual_seed(0)
    m = _tiny("goat2d").double().eval()
    with torch.no_grad():
        for mixer in m.attention_layers():
            for prm in mixer.pos.parameters():
                prm.copy_(torch.randn_like(prm))
    x = torch.randn(2, 3, 12, 20, dtype=torch.float64)  # non-square 3 x 5 grid
    fast = m(x)
    for mixer in m.attention_layers():
        mixer.impl = "reference"
    torch.testing.assert_close(fast, m(x), rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------- resolution transfer
@pytest.mark.parametrize("position", ["goat2d", "ape", "rope2d", "nope"])
def test_model_runs_at_other_resolutions_with_the_same_parameters(position):
    torch.manual_seed(1)
    m = _tiny(position)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    images, labels = load_uci_digits()
    x = F.interpolate(images[:16, None].float() / 255, size=16, mode="bilinear").expand(-1, 3, -1, -1)
    y = labels[:16]
    init = {k: v.clone() for k, v in m.state_dict().items()}
    for _ in range(2):  # "trained at 16x16": a few optimiser steps at one resolution
        loss = F.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert not torch.equal(init["head.weight"], m.state_dict()["head.weight"])
    m.eval()
    state = {k: v.clone() for k, v in m.state_dict().items()}
    ref = m(x[:4])
    for size in [(8, 8), (24, 24), (16, 32), (32, 16)]:
        xs = F.interpolate(x[:4], size=size, mode="bilinear")
        out = m(xs)
        assert out.shape == (4, 10) and torch.isfinite(out).all()
    assert set(state) == set(m.state_dict())
    for k, v in m.state_dict().items():
        assert torch.equal(v, state[k]), k
    torch.testing.assert_close(m(x[:4]), ref, rtol=0, atol=0)


@pytest.mark.parametrize("pool", ["cls", "avg"])
@pytest.mark.parametrize("position", ["goat2d", "ape", "rope2d", "nope"])
def test_every_parameter_gets_a_gradient(position, pool):
    """DDP with find_unused_parameters=False needs every parameter in the loss (GAP: no [CLS] default)."""
    torch.manual_seed(4)
    m = _tiny(position, pool=pool)
    F.cross_entropy(m(torch.randn(2, 3, 8, 12)), torch.tensor([1, 2])).backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None]
    assert not missing, missing
    if position == "goat2d":
        assert m.attention_layers()[0].pos.use_default == (pool == "cls")


def test_image_size_not_divisible_by_patch_is_a_clear_error():
    m = _tiny("nope")
    with pytest.raises(ValueError, match=r"image size 18x16 is not divisible by patch_size=4"):
        m(torch.randn(1, 3, 18, 16))
    with pytest.raises(ValueError, match="position must be one of"):
        _tiny("goat3d")
    with pytest.raises(ValueError, match="needs a 'goat' mixer"):
        MixViT(10, 16, 4, position="goat2d", backbone=vit_backbone("nope", d_model=32, n_layers=1, n_heads=2))


def test_ape_resampling_equals_timm_vision_transformer():
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(2)
    ours = _tiny("ape", img=16)
    theirs = VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=10,
                               dynamic_img_size=True, class_token=True)
    with torch.no_grad():
        theirs.patch_embed.proj.weight.copy_(ours.patch_embed.proj.weight)
        theirs.patch_embed.proj.bias.copy_(ours.patch_embed.proj.bias)
        theirs.cls_token.copy_(torch.randn_like(theirs.cls_token))
        ours.cls_token.copy_(theirs.cls_token)
        theirs.pos_embed.copy_(ours.pos_embed)
    for size in [(16, 16), (24, 24), (12, 28)]:
        x = torch.randn(2, 3, *size)
        want = theirs._pos_embed(theirs.patch_embed(x))
        got, coords = ours.tokens(x)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert coords.length == got.shape[1]


def test_timm_create_model_builds_vit_small_goat():
    import timm

    m = timm.create_model("vit_small_patch16_goat", num_classes=10)
    assert isinstance(m, MixViT)
    cfg = m.backbone_cfg
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.mlp, cfg.mlp_ratio, cfg.drop_path, cfg.causal) == \
           (384, 12, 6, "gelu", 4.0, 0.1, False)
    pos = m.attention_layers()[0].pos
    assert (pos.n_modes, pos.axes, pos.modes_per_axis, pos.use_default) == (16, 2, [8, 8], True)
    assert m.pos_embed is None and m.pool == "cls" and m.patch_size == 16
    with torch.no_grad():
        assert m(torch.randn(1, 3, 32, 48)).shape == (1, 10)
    assert all(timm.is_model(f"vit_small_patch16_{n}") for n in ("goat", "ape", "rope2d", "nope"))


# ---------------------------------------------------------------------- head: loss and metrics
def test_mixup_with_prob_zero_equals_label_smoothed_cross_entropy():
    torch.manual_seed(3)
    bb = vit_backbone("goat2d", d_model=32, n_layers=1, n_heads=2, n_modes=4, drop_path=0.0)
    model = ImageClassifier(10, 16, 4, position="goat2d", backbone=bb, label_smoothing=0.1,
                            mixup=MixupConfig(prob=0.0))
    model.log = lambda *a, **k: None
    x, y = torch.randn(5, 3, 16, 16), torch.randint(0, 10, (5,))  # odd batch: the last sample is dropped
    loss = model.training_step((x, y), 0)
    want = F.cross_entropy(model(x[:4]), y[:4], label_smoothing=0.1)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"label out of range \[0, 10\)"):
        model.training_step((x, torch.full((5,), 10)), 0)


def test_top1_top5_are_exact_sums():
    bb = vit_backbone("nope", d_model=32, n_layers=1, n_heads=2, drop_path=0.0)
    model = ImageClassifier(10, 16, 4, position="nope", backbone=bb)
    logits = torch.arange(10.0).repeat(3, 1)  # ranking 9 > 8 > ... > 0 for every sample
    model.model.forward = lambda images: logits[: images.shape[0]]
    logged = {}
    model.log_dict = lambda d, **k: logged.update({k2: float(v) for k2, v in d.items()})
    model._eval_step((torch.zeros(3, 3, 16, 16), torch.tensor([9, 6, 0])), "val")  # top1: 1, top5: 2
    model._eval_step((torch.zeros(1, 3, 16, 16), torch.tensor([5])), "val")  # top5 hit
    model._eval_epoch_end("val")
    assert logged["val/top1"] == pytest.approx(25.0)
    assert logged["val/top5"] == pytest.approx(75.0)
    want = F.cross_entropy(torch.arange(10.0).repeat(4, 1), torch.tensor([9, 6, 0, 5]))
    assert logged["val/loss"] == pytest.approx(float(want), rel=1e-6)


# ---------------------------------------------------------------------- digits + resolution command
def test_uci_digits_loader():
    images, labels = load_uci_digits()
    assert images.shape == (1797, 8, 8) and images.dtype == torch.uint8
    assert int(images.max()) == 255 and int(images.min()) == 0
    assert labels.bincount().tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    assert labels[:10].tolist() == list(range(10))


def test_bad_digits_file_is_named(tmp_path):
    p = tmp_path / "d.csv"
    p.write_text("1,2,3\n")
    with pytest.raises(ValueError, match=r"d\.csv: expected 65 columns"):
        load_uci_digits(p)
    with pytest.raises(FileNotFoundError, match="UCI digits file not found"):
        load_uci_digits(tmp_path / "missing.csv")


@pytest.mark.parametrize(("val", "test"), [(-0.1, 0.3), (0.5, 0.5), (0.2, -0.1), (float("nan"), 0.1)])
def test_digits_split_fractions_out_of_range_are_refused(val, test):
    """A user test: val_fraction -0.1 with test_fraction 0.3 trained, with 1,258 of the val images also in train
    (only the sum was checked)."""
    from mixlab.datamodules.digits import DigitsDataModule

    with pytest.raises(ValueError, match=r"val_fraction and test_fraction must be in \[0, 1\) and their sum < 1; "
                                         r"got val_fraction="):
        DigitsDataModule(val_fraction=val, test_fraction=test)


def test_a_failed_resolution_command_leaves_every_folder_as_it_was(tmp_path, monkeypatch):
    """A user test: ``--resolutions 10`` with patch size 4 was refused without naming the option, after an
    event file had been written into ``--out`` and into the run's ``resolution`` folder. Now the sizes are
    checked before anything is written, and a later failure removes what the command wrote."""
    import lightning.pytorch as pl

    from mixlab.eval import resolution

    torch.manual_seed(0)
    model = ImageClassifier(10, 16, 4, position="ape", backbone=vit_backbone("ape", d_model=32, n_layers=1,
                                                                             n_heads=2, drop_path=0.0))
    trainer = pl.Trainer(max_steps=1, limit_val_batches=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                         default_root_dir=tmp_path)
    trainer.fit(model, DigitsDataModule(image_size=16, batch_size=32))
    ckpt = tmp_path / "runs" / "digits" / "ape" / "version_0" / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    trainer.save_checkpoint(ckpt)
    out = tmp_path / "res"

    def files():
        return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))

    before = files()
    with pytest.raises(ValueError) as err:
        resolution.main(["--ckpt", str(ckpt), "--resolutions", "16", "10", "--out", str(out), "--accelerator", "cpu"])
    assert str(err.value) == (f"--resolutions 10 for {ckpt}: image size 10x10 is not divisible by patch_size=4; "
                              f"resize/crop to multiples of 4 (e.g. 8x8)")
    assert files() == before

    def broken(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(resolution, "_write_tables", broken)  # after the evaluation wrote its scalars
    threads = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="disk full"):
        resolution.main(["--ckpt", str(ckpt), "--resolutions", "16", "--out", str(out), "--limit-batches", "1",
                         "--accelerator", "cpu"])
    assert files() == before
    # its TensorBoard writers are closed: an open one's thread flushed into the removed folders later (CI warned
    # of an unhandled exception in a thread)
    assert [t.name for t in set(threading.enumerate()) - threads] == []


def test_resolution_command_writes_table_plot_and_prior(tmp_path):
    import lightning.pytorch as pl

    from mixlab.eval.resolution import main as resolution_main

    ckpts = []
    for position in ["goat2d", "ape"]:
        torch.manual_seed(0)
        bb = vit_backbone(position, d_model=32, n_layers=2, n_heads=2, n_modes=4, drop_path=0.0)
        model = ImageClassifier(10, 16, 4, position=position, backbone=bb)
        dm = DigitsDataModule(image_size=16, batch_size=32)
        trainer = pl.Trainer(max_steps=1, limit_val_batches=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                             default_root_dir=tmp_path)
        trainer.fit(model, dm)
        path = tmp_path / f"{position}.ckpt"
        trainer.save_checkpoint(path)
        ckpts.append(str(path))
    out = tmp_path / "res"
    rows = resolution_main(["--ckpt", *ckpts, "--resolutions", "16", "24x16", "--out", str(out),
                            "--limit-batches", "2", "--batch-size", "50", "--accelerator", "cpu"])
    assert [(r["run"], r["res"]) for r in rows] == [(p, s) for p in ("goat2d", "ape") for s in ("16", "24x16")]
    for name in ["resolution.csv", "resolution.md", "resolution_top1.png", "prior_goat2d_layer0.png"]:
        assert (out / name).stat().st_size > 0, name
    assert any(p.name.startswith("events") for p in (out / "tensorboard").iterdir())
    with open(out / "resolution.csv") as f:
        got = list(csv.DictReader(f))
    assert len(got) == 4 and all(0 <= float(r["top1"]) <= 100 for r in got)
    md = (out / "resolution.md").read_text()
    assert "| goat2d | 16 |" in md and "top-1 @ 24x16" in md
    # exact: the eval on 100 samples at the training resolution matches a direct forward
    assert float(got[0]["top1"]) == pytest.approx(direct_top1(ckpts[0], 16), abs=1e-3)


# ---------------------------------------------------------------------- one knob: the mixer states the scheme, plus ape
@pytest.mark.parametrize("preset", ["goat2d", "ape", "rope2d", "nope"])
@pytest.mark.parametrize("pool", ["cls", "avg"])
def test_former_position_option_maps_to_the_mixer_and_ape(preset, pool):
    """``position: <preset>`` (configs and checkpoints before ``ape``) builds the same model as the
    mixer + ``ape`` form, with the same run name, parameters and outputs."""
    mixer = {"goat2d": "goat", "rope2d": "rope", "ape": "nope", "nope": "nope"}[preset]
    old_args = {"goat": {"bias": True, "position_args": {"n_modes": 4, "axes": 2, "default_bias": True}},
                "rope": {"bias": True, "position_args": {"axes": 2}}, "nope": {"bias": True}}[mixer]
    kw = dict(d_model=32, n_layers=2, n_heads=2, causal=False, mlp="gelu", norm="layernorm", bias=True)
    torch.manual_seed(0)
    old = ImageClassifier(10, 16, 4, position=preset, pool=pool,
                          backbone=BackboneConfig(mixer=mixer, mixer_args={mixer: old_args}, **kw))
    torch.manual_seed(0)
    new_args = {"bias": True, "position_args": {"n_modes": 4}} if mixer == "goat" else {"bias": True}
    new = ImageClassifier(10, 16, 4, pool=pool, ape=preset == "ape",
                          backbone=BackboneConfig(mixer=mixer, mixer_args={mixer: new_args}, **kw))
    assert new.run_name == old.run_name == preset and new.position == old.position == preset
    assert old.model.ape == new.model.ape == (preset == "ape")
    sd_old, sd_new = old.state_dict(), new.state_dict()
    assert list(sd_old) == list(sd_new) and all(torch.equal(sd_old[k], sd_new[k]) for k in sd_old)
    x = torch.randn(2, 3, 16, 12)
    torch.testing.assert_close(old.eval()(x), new.eval()(x), rtol=0, atol=0)
    if mixer == "goat":
        assert new.model.attention_layers()[0].pos.axes == 2
        assert new.model.attention_layers()[0].pos.use_default == (pool == "cls")


@pytest.mark.parametrize("name", ["goat", "ape", "rope2d", "nope"])
def test_shipped_digits_configs_keep_their_run_names_and_old_form_builds_the_same(name, tmp_path):
    from pathlib import Path

    from mixlab.cli import MixlabCLI

    cfg = str(Path(__file__).resolve().parents[1] / "configs" / "vit" / f"{name}_digits.yaml")
    small = ["--run_root", str(tmp_path), "--model.init_args.backbone.n_layers", "1"]
    new = MixlabCLI(args=["--config", cfg, *small], run=False).model
    preset = {"goat": "goat2d"}.get(name, name)
    assert new.run_name == preset  # runs/digits/<preset>/..., as the README's resolution command expects
    old_form = ["--model.init_args.position", preset]
    if name == "goat":
        old_form += ["--model.init_args.backbone.mixer_args",
                     "{goat: {position_args: {n_modes: 8, axes: 2, default_bias: true, freq_base: 100.0}}}"]
    if name == "ape":
        old_form += ["--model.init_args.ape", "false"]
    old = MixlabCLI(args=["--config", cfg, *small, *old_form], run=False).model
    assert old.run_name == preset and old.model.ape == new.model.ape
    assert all(torch.equal(a, b) for a, b in zip(old.state_dict().values(), new.state_dict().values()))


def test_training_at_another_resolution_than_img_size_warns_naming_both_fields():
    """A user test: ``data.init_args.image_size: 32`` with ``model.init_args.img_size: 16`` trained without a
    word (the patch coordinates' unit and the APE grid come from ``img_size``)."""
    import types
    import warnings

    model = ImageClassifier(10, 16, 4, backbone=vit_backbone("nope", d_model=32, n_layers=1, n_heads=2))
    model._trainer = types.SimpleNamespace(datamodule=types.SimpleNamespace(num_classes=10, image_size=32))
    with pytest.warns(UserWarning, match=r"data.init_args.image_size=32 trains at another resolution than "
                                         r"model.init_args.img_size=\[16, 16\].*set model.init_args.img_size: 32"):
        model.setup("fit")
    model._trainer.datamodule.image_size = [16, 16]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.setup("fit")
        model._trainer.datamodule.image_size = 32
        model.setup("validate")  # evaluating at another resolution is what the resolution transfer does
