"""Scaled coordinates (``Coords.scale``) and the ViT's ``patch_coords`` option (docs/vit_resolution.md).

``scaled``: patch coordinates in training-grid units at every resolution; ``index``: integer patch
indices (the former behaviour). Checked by value: GOAT's prior against an explicit formula on
``pos * scale``, the scaled 2x grid against the training grid on the patches they share, RoPE's
angles, the ViT's coordinates and outputs, and the resolution command (recorded, honoured, overridable).
"""

from __future__ import annotations

import csv
import math

import pytest
import torch
from helpers.training import direct_top1

from mixlab.coords import Coords
from mixlab.heads.vit import ImageClassifier, MixViT, vit_backbone
from mixlab.mixers.positions import GoatPrior, RotaryPositions


# ---------------------------------------------------------------------- Coords.scale
def test_coords_scale_is_carried_and_keyed():
    g = Coords.grid(2, 3)
    s = g.with_scale((0.5, 2.0))
    assert s.scale == (0.5, 2.0) and g.scale is None
    assert s.key != g.key and s.key == Coords.grid(2, 3).with_scale([0.5, 2]).key  # feature caches tell them apart
    torch.testing.assert_close(s.values(), g.pos.double() * torch.tensor([0.5, 2.0], dtype=torch.float64))
    assert torch.equal(g.values(torch.float32), g.pos.float())
    assert g.with_scale((1.0, 1.0)) is g and g.with_scale(None) is g  # unit scale == no scale
    assert s.with_scale(None).scale is None and s.with_scale(None).key != s.key
    cat = Coords.cat([Coords.empty(1, 2), g]).with_scale((0.5, 2.0))
    assert cat.scale == (0.5, 2.0) and cat.mask is not None and not bool(cat.mask[0, 0].any())
    assert s.slice(1, 4).scale == s.scale and s.to("cpu").scale == s.scale
    assert s.with_axes(3).scale == (0.5, 2.0, 1.0)
    with pytest.raises(ValueError, match="different scales"):
        Coords.cat([Coords.empty(1, 2), s])
    with pytest.raises(ValueError, match="2 positive floats"):
        g.with_scale((0.5,))
    with pytest.raises(ValueError, match="2 positive floats"):
        g.with_scale((0.5, 0.0))


# ---------------------------------------------------------------------- GOAT on scaled coordinates, by formula
def _random_prior(seed: int, **kw) -> GoatPrior:
    torch.manual_seed(seed)
    args = dict(n_heads=2, head_dim=24, causal=False, n_modes=6, axes=2, default_bias=True, freq_base=100.0,
                key_mlp_hidden=5, key_mlp_freqs=3, abs_scale=16.0, init="random")
    args.update(kw)
    p = GoatPrior(**args).double()
    with torch.no_grad():
        p.prior.copy_(torch.randn_like(p.prior))
    return p


def _explicit_prior(p: GoatPrior, yx: list, scale: tuple[float, float]) -> torch.Tensor:
    """``[H, T, T]`` log-prior written out: tokens ``yx`` (None = [CLS]) at ``(sy * y, sx * x)``.

    K_rel = sum over axes a, modes r of axis a: alpha cos(w_r d_a) + beta sin(w_r d_a), with
    w_r = base^(-r/(R_a-1)) and d_a the scaled coordinate difference; u(j) = w2 . silu(phi(j) W1 + b1)
    with phi per axis [sin(c v_m)]_m, [cos(c v_m)]_m, c / abs_scale, 1 (v_m = 10000^(-m/(M-1)), c scaled);
    [CLS] (no coordinates) has phi = 0 and adds the default bias; it has no relative term.
    """
    H, Ra, M = p.n_heads, p.n_modes // 2, p.key_mlp_freqs
    w = [100.0 ** (-r / (Ra - 1)) for r in range(Ra)]
    v = [10000.0 ** (-m / (M - 1)) for m in range(M)]
    alpha, beta = p.alpha.detach(), p.beta.detach()
    w1, b1, w2, default = p.mlp_w1.detach(), p.mlp_b1.detach(), p.mlp_w2.detach(), p.default.detach()

    def u(h, j):
        phi = [0.0] * (2 * (2 * M + 2))  # [CLS]: no axis present, all features zero
        if yx[j] is not None:
            phi = []
            for a in range(2):
                c = scale[a] * yx[j][a]
                phi += [math.sin(c * vm) for vm in v] + [math.cos(c * vm) for vm in v] + [c / 16.0, 1.0]
        hid = torch.nn.functional.silu(torch.tensor(phi, dtype=torch.float64) @ w1[h] + b1[h])
        return float(hid @ w2[h]) + (float(default[h]) if yx[j] is None else 0.0)

    T = len(yx)
    z = torch.zeros(H, T, T, dtype=torch.float64)
    for h in range(H):
        for i in range(T):
            for j in range(T):
                s = u(h, j)
                if yx[i] is not None and yx[j] is not None:
                    for a in range(2):
                        d = scale[a] * (yx[i][a] - yx[j][a])
                        for r in range(Ra):
                            m = a * Ra + r
                            s += float(alpha[h, m]) * math.cos(w[r] * d) + float(beta[h, m]) * math.sin(w[r] * d)
                z[h, i, j] = s
    return z


@pytest.mark.parametrize("scale", [(0.5, 0.5), (2 / 3, 1.25)])
def test_goat_prior_on_scaled_coords_equals_the_formula_in_both_paths(scale):
    p = _random_prior(0)
    gh, gw = 3, 4
    coords = Coords.cat([Coords.empty(1, 2), Coords.grid(gh, gw)]).with_scale(scale)
    want = _explicit_prior(p, [None] + [(i // gw, i % gw) for i in range(gh * gw)], scale)
    # formula path (the reference attention and the prior figures)
    torch.testing.assert_close(p.prior_terms(coords, coords)["total"][0], want, rtol=1e-10, atol=1e-10)
    # lane path (what SDPA sees): q_lanes . k_lanes / sqrt(d_c)
    ql, kl = p.lanes(coords, coords, torch.float64)
    torch.testing.assert_close((ql @ kl.transpose(-1, -2))[0] / p.lane_scale, want, rtol=1e-10, atol=1e-10)


def test_scaled_double_grid_reproduces_the_training_grid_prior_on_shared_patches():
    """What ``scaled`` means: on a 2x grid with scale 1/2, patch (2y, 2x) IS training patch (y, x)."""
    p = _random_prior(1)
    train = Coords.cat([Coords.empty(1, 2), Coords.grid(3, 3)])
    big = Coords.cat([Coords.empty(1, 2), Coords.grid(6, 6)]).with_scale((0.5, 0.5))
    idx = [0] + [1 + (2 * y) * 6 + 2 * x for y in range(3) for x in range(3)]  # [CLS] + the even patches
    small = p.prior_terms(train, train)["total"][0]
    ql, kl = p.lanes(big, big, torch.float64)
    lanes_big = (ql @ kl.transpose(-1, -2))[0] / p.lane_scale
    torch.testing.assert_close(lanes_big[:, idx][:, :, idx], small, rtol=1e-10, atol=1e-10)
    # integer patch indices (index) on the 2x grid do not: the prior sees distances twice as long
    ql, kl = p.lanes(big.with_scale(None), big.with_scale(None), torch.float64)
    assert ((ql @ kl.transpose(-1, -2))[0] / p.lane_scale)[:, idx][:, :, idx].sub(small).abs().max() > 1e-2


def test_unit_scale_leaves_goat_numerics_unchanged_and_key_linear_refuses_a_scaled_sequence():
    p = _random_prior(2, causal=True, axes=1, n_modes=3, default_bias=False)
    c = Coords.seq(9)
    ql, kl = p.lanes(c, c, torch.float64)
    c1 = Coords(c.pos, scale=(1.0,))
    assert c1.scale is None
    ql1, kl1 = p.lanes(c1, c1, torch.float64)
    assert torch.equal(ql, ql1) and torch.equal(kl, kl1)
    with pytest.raises(ValueError, match="key_linear reads the integer sequence axis"):
        p.lanes(c.with_scale((0.5,)), c.with_scale((0.5,)), torch.float64)


def test_rope_angles_use_scaled_coordinates():
    r = RotaryPositions(n_heads=2, head_dim=16, causal=False, axes=2)
    c = Coords.cat([Coords.empty(1, 2), Coords.grid(2, 3)]).with_scale((0.5, 0.25))
    inv = [10000.0 ** (-2 * i / 8) for i in range(4)]
    want = torch.zeros(1, 7, 8, dtype=torch.float64)
    for t in range(1, 7):
        y, x = (t - 1) // 3, (t - 1) % 3
        want[0, t] = torch.tensor([0.5 * y * f for f in inv] + [0.25 * x * f for f in inv], dtype=torch.float64)
    torch.testing.assert_close(r.angles(c), want, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------- the ViT option
def _vit(position: str = "goat2d", **kw) -> MixViT:
    torch.manual_seed(0)
    bb = vit_backbone(position, d_model=32, n_layers=2, n_heads=2, n_modes=4, drop_path=0.0)
    m = MixViT(10, 16, 4, backbone=bb, ape=position == "ape", **kw).double().eval()
    with torch.no_grad():
        for mixer in m.attention_layers():
            for prm in getattr(mixer, "pos", torch.nn.Module()).parameters():
                prm.copy_(torch.randn_like(prm))
    return m


def test_vit_patch_coords_scale_per_grid_and_default():
    m = _vit()
    assert m.patch_coords == "scaled"
    assert m.coords(4, 4, torch.device("cpu")).scale is None  # training grid 16 / 4
    assert m.coords(8, 6, torch.device("cpu")).scale == (0.5, 4 / 6)
    assert m.coord_scale(2, 2) == (2.0, 2.0)
    old = _vit(patch_coords="index")
    assert old.coords(8, 6, torch.device("cpu")).scale is None
    assert old.coords(8, 6, torch.device("cpu")).key == Coords.cat([Coords.empty(1, 2), Coords.grid(8, 6)]).key
    with pytest.raises(ValueError, match="patch_coords must be one of"):
        _vit(patch_coords="normalised")


@pytest.mark.parametrize("position", ["goat2d", "rope2d"])
def test_vit_scaled_and_index_agree_at_the_training_grid_only(position):
    m = _vit(position)
    x16, x32 = torch.randn(2, 3, 16, 16, dtype=torch.float64), torch.randn(2, 3, 32, 24, dtype=torch.float64)
    scaled16, scaled32 = m(x16), m(x32)
    m.patch_coords = "index"
    assert torch.equal(m(x16), scaled16)
    assert (m(x32) - scaled32).abs().max() > 1e-4
    assert m.reads_patch_coords and not _vit("ape").reads_patch_coords


def test_vit_scaled_log_prior_image_on_a_double_grid_samples_the_training_image():
    m = _vit()
    small = m.log_prior_image(0, grid=(4, 4), query=(2, 2))
    big = m.log_prior_image(0, grid=(8, 8), query=(4, 4))
    torch.testing.assert_close(big[:, ::2, ::2], small, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------- resolution command
def _fit_tiny(tmp_path, **kw) -> str:
    import lightning.pytorch as pl

    from mixlab.datamodules.digits import DigitsDataModule

    torch.manual_seed(0)
    bb = vit_backbone("goat2d", d_model=32, n_layers=2, n_heads=2, n_modes=4, drop_path=0.0)
    model = ImageClassifier(10, 16, 4, backbone=bb, **kw)
    with torch.no_grad():  # a prior far from zero, so the convention matters for the numbers
        for mixer in model.model.attention_layers():
            mixer.pos.prior.copy_(torch.randn_like(mixer.pos.prior))
    trainer = pl.Trainer(max_steps=1, limit_val_batches=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                         default_root_dir=tmp_path)
    trainer.fit(model, DigitsDataModule(image_size=16, batch_size=32))
    path = tmp_path / f"goat_{kw.get('patch_coords', 'default')}.ckpt"
    trainer.save_checkpoint(path)
    return str(path)


def test_resolution_command_honours_records_and_overrides_patch_coords(tmp_path):
    from mixlab.eval.resolution import main as resolution_main

    ck_default, ck_index = _fit_tiny(tmp_path), _fit_tiny(tmp_path, patch_coords="index")
    assert torch.load(ck_default, weights_only=False)["hyper_parameters"]["patch_coords"] == "scaled"
    assert ImageClassifier.load_from_checkpoint(ck_index, weights_only=False).model.patch_coords == "index"
    common = ["--resolutions", "16", "32", "--limit-batches", "2", "--batch-size", "50", "--accelerator", "cpu"]
    rows = resolution_main(["--ckpt", ck_default, ck_index, "--out", str(tmp_path / "a"), *common])
    assert [(r["run"], r["patch_coords"], r["res"]) for r in rows] == [
        ("goat2d", "scaled", "16"), ("goat2d", "scaled", "32"),
        ("goat2d-2", "index", "16"), ("goat2d-2", "index", "32")]
    for r, ck, pc in zip(rows[1::2], (ck_default, ck_index), ("scaled", "index")):
        assert r["top1"] == pytest.approx(direct_top1(ck, 16, 32, pc), abs=1e-3)
    with open(tmp_path / "a" / "resolution.csv") as f:
        assert [r["patch_coords"] for r in csv.DictReader(f)] == ["scaled", "scaled", "index", "index"]
    # the study override: both conventions of one checkpoint, as two runs
    rows = resolution_main(["--ckpt", ck_index, "--out", str(tmp_path / "b"), "--patch-coords", "index", "scaled",
                            *common])
    assert [(r["run"], r["patch_coords"]) for r in rows] == [("goat2d-index", "index")] * 2 + \
        [("goat2d-scaled", "scaled")] * 2
    assert rows[0]["top1"] == rows[2]["top1"]  # the training resolution: the same model
    assert rows[3]["top1"] == pytest.approx(direct_top1(ck_index, 16, 32, "scaled"), abs=1e-3)
    assert "| goat2d-scaled | 16 |" in (tmp_path / "b" / "resolution.md").read_text()
