"""Analysis figures: each function on a tiny model writes a PNG, and its numbers match values
computed here from the model's parameters."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mixlab.backbone import Backbone, BackboneConfig
from mixlab.eval.figures import goat_prior_figure, goat_spectrum_figure, mesa_solver_figure, write_rate_figure
from mixlab.heads.lm import CausalLM


def _png(path: Path) -> None:
    assert path.stat().st_size > 1000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _lm(mixer: str, args: dict, n_layers: int = 1) -> CausalLM:
    torch.manual_seed(0)
    cfg = BackboneConfig(d_model=16, n_layers=n_layers, n_heads=2, mixer=mixer, mixer_args={mixer: args})
    return CausalLM(vocab_size=5, backbone=cfg).double().eval()


def _randomise_goat(pos) -> None:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name in ("alpha", "beta", "slope", "bos"):
            if name in pos.learned_terms:
                p = getattr(pos, name)
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))


def test_goat_prior_1d(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    model = _lm("goat", {"position_args": {"n_modes": 2, "key_mlp_hidden": 0}})
    pos = model.backbone.blocks[0].mixer.pos
    _randomise_goat(pos)
    writer = SummaryWriter(str(tmp_path / "tb"))
    res = goat_prior_figure(model, layer=0, head=1, length=9, out=tmp_path, writer=writer)
    writer.close()
    _png(tmp_path / "goat_prior_l0_h1.png")
    i, j = np.meshgrid(np.arange(9), np.arange(9), indexing="ij")
    w = pos.freqs().numpy()
    a, b = pos.alpha[1].detach().double().numpy(), pos.beta[1].detach().double().numpy()
    rel = sum(a[r] * np.cos(w[r] * (i - j)) + b[r] * np.sin(w[r] * (i - j)) for r in range(2))
    key = pos.slope[1].item() * j + pos.bos[1].item() * (j == 0)
    np.testing.assert_allclose(res["relative"], rel, atol=1e-10)
    np.testing.assert_allclose(res["key_only"], key, atol=1e-10)
    np.testing.assert_allclose(res["total"], rel + key, atol=1e-10)
    assert any(p.name.startswith("events") for p in (tmp_path / "tb").iterdir())
    with pytest.raises(ValueError, match="--layer 3"):
        goat_prior_figure(model, layer=3, out=tmp_path)


def test_goat_prior_2d(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = BackboneConfig(d_model=16, n_layers=1, n_heads=2, mixer="goat", causal=False,
                         mixer_args={"goat": {"position_args": {"n_modes": 2, "axes": 2, "key_mlp_hidden": 0}}})
    model = Backbone(cfg).double()
    pos = model.blocks[0].mixer.pos
    _randomise_goat(pos)
    res = goat_prior_figure(model, head=0, grid=(3, 4), out=tmp_path)
    _png(tmp_path / "goat_prior_l0_h0.png")
    ys, xs = np.divmod(np.arange(12), 4)
    w, a, b = pos.freqs().numpy(), pos.alpha[0].detach().numpy(), pos.beta[0].detach().numpy()
    d = [ys[:, None] - ys[None, :], xs[:, None] - xs[None, :]]  # mode r reads axis r (one mode per axis)
    rel = sum(a[r] * np.cos(w[r] * d[r]) + b[r] * np.sin(w[r] * d[r]) for r in range(2))
    np.testing.assert_allclose(res["relative"], rel, atol=1e-10)
    np.testing.assert_allclose(res["key_only"], 0.0)  # bidirectional, no key MLP: no key-only term
    assert int(res["query"]) == 1 * 4 + 2


def test_goat_spectrum(tmp_path: Path) -> None:
    model = _lm("goat", {"position_args": {"n_modes": 2}}, n_layers=2)
    layers = [blk.mixer.pos for blk in model.backbone.blocks]
    with torch.no_grad():
        layers[0].alpha.copy_(torch.tensor([[3.0, 0.0], [1.0, 1.0]]))
        layers[0].beta.copy_(torch.tensor([[4.0, 0.0], [2.0, 2.0]]))
        layers[1].alpha.copy_(torch.tensor([[0.0, 0.0], [0.0, 2.0]]))
        layers[1].beta.copy_(torch.tensor([[0.0, 0.0], [0.0, 1.0]]))
    stats = goat_spectrum_figure(model, out=tmp_path)
    _png(tmp_path / "goat_spectrum.png")
    for li, pos in enumerate(layers):
        a, b = pos.alpha.detach().double().numpy(), pos.beta.detach().double().numpy()
        amp = np.sqrt(a ** 2 + b ** 2)
        np.testing.assert_allclose(stats[li]["amplitude"], amp.sum(1))
        np.testing.assert_allclose(stats[li]["amplitude_max"], amp.max(1))
    np.testing.assert_allclose(stats[0]["amplitude"], [5.0, 2 * math.sqrt(5)])
    assert stats[0]["antisym"].tolist() == [True, True] and float(stats[0]["antisym_share"]) == 1.0
    np.testing.assert_allclose(stats[0]["ratio"], [4 / 3, 2.0])
    assert float(stats[0]["median_ratio"]) == pytest.approx(5 / 3)
    assert stats[1]["antisym"].tolist() == [False, False] and float(stats[1]["antisym_share"]) == 0.0
    assert math.isnan(stats[1]["ratio"][0]) and stats[1]["ratio"][1] == pytest.approx(0.5)


def test_write_rates(tmp_path: Path) -> None:
    model = _lm("fg2gdn", {"chunk_size": 8})
    mix = model.backbone.blocks[0].mixer
    with torch.no_grad():  # spread the rates so channels differ
        mix.b_proj[1].bias.copy_(torch.linspace(-3, 3, mix.b_proj[1].bias.numel()))
    tokens = torch.randint(0, 5, (2, 7), generator=torch.Generator().manual_seed(0))
    stats = write_rate_figure(model, tokens, out=tmp_path)
    _png(tmp_path / "write_rates.png")
    with torch.no_grad():
        x = model.backbone.blocks[0].norm1(model.embed(tokens[:, :-1]))
        rates = torch.sigmoid(mix.b_proj(x)).reshape(12, 16)  # 2 x 6 tokens, H*K = 16 channels
    np.testing.assert_allclose(stats[0]["rates"], rates.numpy(), atol=1e-12)
    np.testing.assert_allclose(stats[0]["channel_mean"], rates.mean(0).numpy(), atol=1e-12)
    assert float(stats[0]["token_spread"]) == pytest.approx(rates.std(1, unbiased=False).mean().item())
    assert float(stats[0]["between_channel_std"]) == pytest.approx(rates.mean(0).std(unbiased=False).item())
    assert bool(stats[0]["vector"])
    with pytest.raises(ValueError, match="no delta-rule layer"):
        write_rate_figure(_lm("goat", {"position_args": {"n_modes": 2}}), tokens, out=tmp_path)


def test_mesa_solver(tmp_path: Path) -> None:
    model = _lm("mesa", {"cg_iters": 6, "chunk_size": 4, "eval_cg_eps": 1e-3})
    mix = model.backbone.blocks[0].mixer
    tokens = torch.randint(0, 5, (2, 7), generator=torch.Generator().manual_seed(0))
    stats = mesa_solver_figure(model, tokens, out=tmp_path)
    _png(tmp_path / "mesa_solver.png")
    with torch.no_grad():
        x = model.backbone.blocks[0].norm1(model.embed(tokens[:, :-1]))
        model(tokens[:, :-1])
        iters = [mix.extra_metrics()[f"cg_iters/h{i}"].item() for i in range(2)]
        # H_t = sum_s (prod of decays after s) beta_s k_s k_s^T, Lambda = softplus(param) + floor
        k = F.normalize(mix.k_conv(mix.k_proj(x), None, "k_conv").view(2, 6, 2, 8), dim=-1)
        decay = torch.sigmoid(mix.a_proj(x))
        beta = torch.sigmoid(mix.b_proj(x))
        lamb = F.softplus(mix.lambda_param) + mix.lambda_floor
        conds = []
        h = torch.zeros(2, 2, 8, 8, dtype=torch.float64)
        for t in range(6):
            kk = k[:, t, :, :, None] * k[:, t, :, None, :]
            h = decay[:, t, :, None, None] * h + beta[:, t, :, None, None] * kk
            conds.append(torch.linalg.cond(h + torch.diag_embed(lamb)))
        cond = torch.stack(conds, 1).reshape(12, 2)  # [B*T, H]
    np.testing.assert_allclose(stats[0]["cond"], cond.numpy(), rtol=1e-8)
    np.testing.assert_allclose(stats[0]["cg_iters"], iters)
    assert 1 <= min(iters) and max(iters) <= 6
    np.testing.assert_allclose(stats[0]["cond_median"], np.median(cond.numpy(), axis=0), rtol=1e-8)
    np.testing.assert_allclose(stats[0]["lamb"], lamb.numpy())


# ---------------------------------------------------------------------------- a failed command
FIXTURES = Path(__file__).parent / "fixtures"


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under ``root``, by relative path."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def _cli(capsys, monkeypatch, *argv: str) -> str:
    """``python -m mixlab *argv`` in-process, expected to fail with status 2; its one stderr line with
    ``error:`` (before the MIXLAB_TRACEBACK hint)."""
    import sys

    from mixlab import cli

    monkeypatch.setattr(sys, "argv", ["mixlab"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli.main(list(argv))
    assert info.value.code == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    return line


def test_a_failed_figure_command_leaves_the_run_folder_as_it_was(tmp_path: Path, capsys, monkeypatch) -> None:
    """A user test: a bad --head (found after the TensorBoard writer was made) or an error while drawing left a
    new event file in the run's figures/ folder. Now bad arguments are found before anything is written, and
    a later error removes what the command wrote (also an overwritten PNG comes back) and the folders it made."""
    import shutil

    from mixlab.eval import figures

    monkeypatch.chdir(tmp_path)  # a checkpoint outside a run would write runs/figures/ here
    (tmp_path / "v0" / "checkpoints").mkdir(parents=True)
    ckpt = tmp_path / "v0" / "checkpoints" / "goat.ckpt"
    shutil.copy(FIXTURES / "copy_mixture_goat.ckpt", ckpt)  # SyntheticLM, one GOAT layer (0) of 2 heads
    fig = tmp_path / "v0" / "figures"  # an earlier figure run: event file, PNG, an empty folder
    (fig / "keep").mkdir(parents=True)
    (fig / "events.out.tfevents.1.host.1.0").write_bytes(b"earlier events")
    (fig / "goat_prior_l0_h0.png").write_bytes(b"earlier png")
    before = _tree(tmp_path)
    # bad arguments: one line, nothing written
    fig_error, see_help = "python -m mixlab figure: error:", "(--help lists the options)"
    for argv, says in ((["--head", "9"], "error: --head 9: the GOAT layer has 2 heads"),
                       (["--layer", "3"], "error: --layer 3: GOAT layers of this model are [0]"),
                       (["--length", "0"], f"{fig_error} --length must be >= 1; got 0 {see_help}"),
                       (["--grid", "4", "0"], f"{fig_error} --grid must be >= 1; got 4 0 {see_help}"),
                       (["--grid", "4", "4"], "error: --grid 4 4: this model's GOAT prior has 1 axis (sequences); "
                                              "draw it with --length")):
        assert _cli(capsys, monkeypatch, "figure", "goat-prior", "--ckpt", str(ckpt), *argv) == says, argv
        assert _tree(tmp_path) == before, argv
    for name, says in (("write-rates", "error: SyntheticLM has no delta-rule layer (deltanet, gdn, kda, fg2gdn, ...)"),
                       ("mesa-solver", "error: SyntheticLM has no Mesa layer (mixer 'mesa')")):
        assert _cli(capsys, monkeypatch, "figure", name, "--ckpt", str(ckpt)) == says
        assert _tree(tmp_path) == before, name
    # an error while drawing the second head: head 0's PNG and the event file were written by then (and
    # another process wrote a file into a subfolder meanwhile: not the command's, so it stays)
    real, failing = figures.goat_prior_panels, {1}

    def fail_on_head(prior, head, *args):
        if head in failing:
            if (fig / "keep").is_dir():
                (fig / "keep" / "other.txt").write_text("not ours")
            raise RuntimeError("drawing failed")
        return real(prior, head, *args)

    monkeypatch.setattr(figures, "goat_prior_panels", fail_on_head)
    with pytest.raises(RuntimeError, match="^drawing failed$"):
        figures.main(["goat-prior", "--ckpt", str(ckpt), "--all-heads"])
    assert _tree(tmp_path) == {**before, "v0/figures/keep/other.txt": b"not ours"}
    (fig / "keep" / "other.txt").unlink()
    # folders the command created (--out, --tb, runs/figures/<name> for a checkpoint outside a run) go again
    failing.add(0)  # fails on the first head, after the writer made its event file
    shutil.rmtree(fig)
    shutil.copy(ckpt, tmp_path / "loose.ckpt")
    before = _tree(tmp_path)
    for argv in (["--ckpt", str(ckpt)], ["--ckpt", str(ckpt), "--out", "new/png", "--tb", "new/tb"],
                 ["--ckpt", str(tmp_path / "loose.ckpt")]):
        with pytest.raises(RuntimeError, match="^drawing failed$"):
            figures.main(["goat-prior", *argv])
        assert _tree(tmp_path) == before, argv
    failing.clear()  # and without the error, the same command writes
    figures.main(["goat-prior", "--head", "1", "--ckpt", str(ckpt)])
    assert sorted(p.name for p in fig.iterdir() if not p.name.startswith("events.")) == ["goat_prior_l0_h1.png"]
    assert len(list(fig.glob("events.out.tfevents.*"))) == 1


# ---------------------------------------------------------------------------- SyntheticLM checkpoints
@pytest.mark.parametrize("name, mixer", [("write-rates", "fg2gdn"), ("mesa-solver", "mesa")])
def test_figure_on_a_synthetic_checkpoint(tmp_path: Path, monkeypatch, name: str, mixer: str) -> None:
    """A user test: write-rates / mesa-solver failed on every SyntheticLM checkpoint ("cannot feed a batch of
    type dict"); the held-out dict batches now go through the head's own split_batch, as its _eval_step."""
    import sys

    from mixlab import cli
    from mixlab.eval import figures

    monkeypatch.setattr(sys, "argv", ["mixlab"])
    monkeypatch.chdir(tmp_path)
    cfg = str(Path(__file__).resolve().parents[1] / "configs" / "synthetic" / "mad_in_context_recall.yaml")
    cli.main(["fit", "--config", cfg, "--run_root", str(tmp_path / "runs"), "--trainer.max_steps=2",
              "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1", "--trainer.accelerator=cpu",
              f"--model.backbone.mixer={mixer}", "--model.backbone.d_model=16", "--model.backbone.n_heads=2",
              "--model.backbone.n_layers=1", "--data.seq_len=16", "--data.batch_size=4", "--data.n_train=16",
              "--data.n_val=8", "--data.n_test=8"])
    (ckpt,) = sorted((tmp_path / "runs").rglob("last.ckpt"))
    out = tmp_path / "fig"
    stats = figures.main([name, "--ckpt", str(ckpt), "--out", str(out), "--tb", str(tmp_path / "tb")])
    _png(out / ("write_rates.png" if name == "write-rates" else "mesa_solver.png"))
    (layer,) = stats.values()
    n = figures.heldout_batches(ckpt, 1)[0]["inputs"].numel()  # tokens of the one held-out dict batch
    if name == "write-rates":
        rates = np.asarray(layer["rates"])
        assert rates.shape[0] == n and np.isfinite(rates).all() and (rates >= 0).all() and (rates <= 2).all()
        np.testing.assert_allclose(layer["channel_mean"], rates.mean(0), rtol=1e-6)
    else:
        cond, iters = np.asarray(layer["cond"]), np.asarray(layer["cg_iters"])
        assert cond.shape[0] == n and np.isfinite(cond).all() and (cond >= 1 - 1e-6).all()
        assert np.isfinite(iters).all() and (iters >= 0).all()
        assert np.isfinite(layer["lamb"]).all() and (np.asarray(layer["lamb"]) > 0).all()


# ---------------------------------------------------------------------------- user test: figure / copy-prior
def _lane_prior(pos, coords) -> np.ndarray:
    """``[H, T, T]`` log-prior the attention adds on ``coords``: the q.k of the GOAT lanes over SDPA's ``sqrt(d_c)``
    (the forward's path, not the formula :func:`goat_prior_panels` reads)."""
    with torch.no_grad():
        ql, kl = pos.lanes(coords, coords, torch.float64)
        return (ql @ kl.transpose(-1, -2) / math.sqrt(pos.content_dim))[0].numpy()


def _vit_ckpt(tmp_path: Path) -> Path:
    """The digits goat2d fixture (ViT, 6x6 patches + [CLS], one GOAT layer of 2 heads, integer patch coordinates)
    with a random prior, in a run folder ``v0/checkpoints``."""
    ck = torch.load(FIXTURES / "digits_goat2d.ckpt", map_location="cpu", weights_only=False)
    key = "model.backbone.blocks.0.mixer.pos.prior"
    g = torch.Generator().manual_seed(3)
    ck["state_dict"][key] = 0.5 * torch.randn(ck["state_dict"][key].shape, generator=g)
    (tmp_path / "v0" / "checkpoints").mkdir(parents=True)
    torch.save(ck, tmp_path / "v0" / "checkpoints" / "vit.ckpt")
    return tmp_path / "v0" / "checkpoints" / "vit.ckpt"


def test_goat_prior_of_a_2d_checkpoint_is_drawn_on_its_own_grid(tmp_path: Path, capsys, monkeypatch) -> None:
    """A user test: without --grid, a 2-D ViT checkpoint's prior was drawn over a 1-D sequence of 64 positions
    (only its y modes); it is now drawn on the model's 6x6 training grid, with the values its attention adds."""
    from mixlab.eval import figures
    from mixlab.eval.common import load_run

    monkeypatch.chdir(tmp_path)
    ckpt = _vit_ckpt(tmp_path)
    res = figures.main(["goat-prior", "--ckpt", str(ckpt), "--head", "1"])
    assert res["grid"].tolist() == [6, 6] and int(res["query"]) == 3 * 6 + 3 and res["total"].shape == (36, 36)
    _png(tmp_path / "v0" / "figures" / "goat_prior_l0_h1.png")
    vit = load_run(ckpt).model.model
    pos = vit.backbone.blocks[0].mixer.pos
    own = vit.log_prior_image(0)[1].numpy()  # the model's own rendering, from the centre patch
    assert np.abs(own).max() > 0.1  # a prior worth comparing
    np.testing.assert_allclose(res["total"][21].reshape(6, 6), own, atol=1e-12)
    lanes = _lane_prior(pos, vit.coords(6, 6, torch.device("cpu")))[1]  # [CLS] + 36 patches
    np.testing.assert_allclose(res["total"], lanes[1:, 1:], atol=1e-6)
    np.testing.assert_allclose(res["key_only"] + res["relative"], res["total"], atol=1e-12)
    # another grid, and the alias
    other = figures.copy_prior(["--ckpt", str(ckpt), "--head", "1", "--grid", "3", "5", "--out", str(tmp_path / "cp")])
    assert other["grid"].tolist() == [3, 5] and int(other["query"]) == 1 * 5 + 2
    np.testing.assert_allclose(other["total"][7].reshape(3, 5), vit.log_prior_image(0, (3, 5))[1].numpy(), atol=1e-12)
    # --length is refused for a 2-D prior, as --grid is for a 1-D one; nothing written
    before = _tree(tmp_path)
    assert _cli(capsys, monkeypatch, "figure", "goat-prior", "--ckpt", str(ckpt), "--length", "10") == (
        "error: --length 10: this model's GOAT prior has 2 axes (a patch grid); draw it with --grid H W (default: its "
        "training grid 6 6)")
    assert _tree(tmp_path) == before


def test_goat_prior_of_a_scaled_vit_off_its_training_grid(tmp_path: Path) -> None:
    """``patch_coords: scaled``: off the training grid the ViT reads patch (y, x) as training-grid units; the figure
    draws that prior (not the one of integer patch indices)."""
    from mixlab.eval.figures import goat_prior_figure, goat_prior_panels
    from mixlab.heads.vit import ImageClassifier

    torch.manual_seed(0)
    cfg = BackboneConfig(d_model=32, n_layers=1, n_heads=2, mixer="goat", causal=False,
                         mixer_args={"goat": {"position_args": {"n_modes": 4, "key_mlp_hidden": 4}}})
    model = ImageClassifier(num_classes=3, img_size=12, patch_size=4, in_chans=1, backbone=cfg).double().eval()
    vit = model.model
    pos = vit.backbone.blocks[0].mixer.pos
    with torch.no_grad():
        pos.prior.copy_(torch.randn(pos.prior.shape, generator=torch.Generator().manual_seed(2), dtype=pos.prior.dtype))
    res = goat_prior_figure(model, head=0, out=tmp_path)  # the training grid: 3x3
    assert res["grid"].tolist() == [3, 3]
    np.testing.assert_allclose(res["total"][4].reshape(3, 3), vit.log_prior_image(0)[0].numpy(), atol=1e-12)
    res = goat_prior_figure(model, head=0, grid=(6, 6), out=tmp_path)
    _png(tmp_path / "goat_prior_l0_h0.png")
    assert vit.coord_scale(6, 6) == (0.5, 0.5)
    np.testing.assert_allclose(res["total"][21].reshape(6, 6), vit.log_prior_image(0, (6, 6))[0].numpy(), atol=1e-12)
    np.testing.assert_allclose(res["total"], _lane_prior(pos, vit.coords(6, 6, torch.device("cpu")))[0, 1:, 1:],
                               atol=1e-6)
    integer = goat_prior_panels(pos, 0, None, (6, 6))  # what the figure drew before: integer indices
    assert np.abs(integer["relative"] - res["relative"]).max() > 0.1
    with pytest.raises(ValueError, match=r"^--length 8: this model's GOAT prior has 2 axes .* training grid 3 3\)$"):
        goat_prior_figure(model, length=8, out=tmp_path)
    bare = Backbone(cfg.with_position_axes(2)).double()  # a 2-axis prior in a model that records no patch grid
    assert bare.blocks[0].mixer.pos.axes == 2
    with pytest.raises(ValueError, match=r"^--grid: the GOAT prior of this Backbone has 2 axes .*give --grid H W$"):
        goat_prior_figure(bare, out=tmp_path)


def test_goat_prior_of_a_3_axis_prior_reads_the_sequence_or_the_patch_axes(tmp_path: Path) -> None:
    """Text + patches (``axes: 3``, coordinates (sequence, y, x)): ``length`` draws the sequence axis, ``grid`` the
    y, x axes (before, a grid's y was read as the sequence axis and its x as y)."""
    from mixlab.eval.figures import goat_prior_panels

    torch.manual_seed(0)
    cfg = BackboneConfig(d_model=32, n_layers=1, n_heads=2, mixer="goat", causal=False,
                         mixer_args={"goat": {"position_args": {"n_modes": 3, "axes": 3, "key_mlp_hidden": 0}}})
    pos = Backbone(cfg).double().blocks[0].mixer.pos
    _randomise_goat(pos)
    w, a, b = pos.freqs().numpy(), pos.alpha[1].detach().numpy(), pos.beta[1].detach().numpy()  # mode r: axis r
    term = lambda r, d: a[r] * np.cos(w[r] * d) + b[r] * np.sin(w[r] * d)  # noqa: E731
    seq = goat_prior_panels(pos, 1, 5)
    i = np.arange(5)
    np.testing.assert_allclose(seq["relative"], term(0, i[:, None] - i[None, :]), atol=1e-12)
    grid = goat_prior_panels(pos, 1, None, (2, 3))
    ys, xs = np.divmod(np.arange(6), 3)
    rel = term(1, ys[:, None] - ys[None, :]) + term(2, xs[:, None] - xs[None, :])
    np.testing.assert_allclose(grid["relative"], rel, atol=1e-12)


def test_figure_refuses_bad_outputs_devices_sizes_and_options_in_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    """A user test: an --out / --tb that is a file or lies under one gave NotADirectoryError / FileExistsError
    tracebacks, --length 1000000 tried to allocate 16 TB, options another figure reads were silently ignored.
    Each is now one line before anything is written."""
    import shutil

    from mixlab.eval.figures import PRIOR_MEMORY_BYTES, goat_prior_panels, prior_bytes

    monkeypatch.chdir(tmp_path)
    (tmp_path / "v0" / "checkpoints").mkdir(parents=True)
    ckpt = tmp_path / "v0" / "checkpoints" / "goat.ckpt"
    shutil.copy(FIXTURES / "copy_mixture_goat.ckpt", ckpt)  # SyntheticLM, one causal GOAT layer (0) of 2 heads
    (tmp_path / "afile").write_text("not a folder")
    fig = "python -m mixlab figure: error:"
    most = math.isqrt(PRIOR_MEMORY_BYTES // prior_bytes(1))
    assert prior_bytes(10 ** 6) == 8 * 10 ** 12 * 8 and most == 5792
    cases = [
        (["--out", "afile"], f"{fig} --out 'afile' is a file; give a folder"),
        (["--out", "afile/png"], f"{fig} --out 'afile/png' cannot be written: 'afile' is a file, not a folder"),
        (["--tb", "afile"], f"{fig} --tb 'afile' is a file; give a folder"),
        (["--tb", "afile/tb"], f"{fig} --tb 'afile/tb' cannot be written: 'afile' is a file, not a folder"),
        (["--out", ""], f"{fig} --out is empty; give a folder path"),
        (["--tb", " "], f"{fig} --tb is empty; give a folder path"),
        (["--device", "foo"], "error: --device 'foo' is not a device: use cpu, cuda or cuda:N"),
        (["--length", "1000000"], "error: --length 1000000: the prior matrices for 1 head need 58.3 TiB (8 float64 "
                                  "[T, T], T = 1000000 positions), over the 2.0 GiB limit; draw at most 5792 "
                                  "positions"),
        (["--length", "5793"], "error: --length 5793: the prior matrices for 1 head need 2.1 GiB (8 float64 [T, T], "
                               "T = 5793 positions), over the 2.0 GiB limit; draw at most 5792 positions"),
        (["--all-heads", "--length", "5000"], "error: --length 5000: the prior matrices for 2 heads need 2.3 GiB "
                                              "(12 float64 [T, T], T = 5000 positions), over the 2.0 GiB limit; draw "
                                              "at most 4729 positions with --all-heads, 5792 with one --head"),
        (["--head", "1", "--all-heads"], f"{fig} --head 1 and --all-heads: give one"),
        (["--batches", "2"], f"{fig} --batches applies to write-rates and mesa-solver only, not to goat-prior"),
    ]
    before = _tree(tmp_path)
    for argv, says in cases:
        assert _cli(capsys, monkeypatch, "figure", "goat-prior", "--ckpt", str(ckpt), *argv) == \
            says + (" (--help lists the options)" if says.startswith(fig) else ""), argv
        assert _tree(tmp_path) == before, argv
    for argv, says in ((["goat-spectrum", "--head", "1"], "--head applies to goat-prior only, not to goat-spectrum"),
                       (["write-rates", "--layer", "0"], "--layer applies to goat-prior only, not to write-rates"),
                       (["mesa-solver", "--grid", "2", "2"], "--grid applies to goat-prior only, not to mesa-solver"),
                       (["goat-spectrum", "--all-heads"], "--all-heads applies to goat-prior only, not to "
                                                          "goat-spectrum"),
                       (["write-rates", "--batches", "-1"], "--batches must be >= 1; got -1"),
                       (["goat-spectrum", "--ckpt", ""], "--ckpt is empty; give a checkpoint file")):
        line = _cli(capsys, monkeypatch, "figure", argv[0], "--ckpt", str(ckpt), *argv[1:])
        assert line == f"{fig} {says} (--help lists the options)", argv
        assert _tree(tmp_path) == before, argv
    # the run's default figures/ folder is a file: named as the default
    (tmp_path / "v0" / "figures").write_text("a file")
    default = str(tmp_path / "v0" / "figures")
    assert _cli(capsys, monkeypatch, "figure", "goat-spectrum", "--ckpt", str(ckpt)) == \
        f"{fig} the default --out {default!r} is a file; give a folder (--help lists the options)"
    from mixlab.eval.common import load_run

    pos = next(iter(load_run(ckpt).model.backbone.blocks)).mixer.pos
    for length in (0, -2):
        with pytest.raises(ValueError, match=f"^--length must be >= 1; got {length}$"):
            goat_prior_panels(pos, 0, length)
    with pytest.raises(ValueError, match=r"^--grid 3000 3000: the prior matrices for 1 head need 4.7 PiB \(8 float64 "):
        goat_prior_panels(pos, 0, None, (3000, 3000))


def test_copy_prior_has_its_own_usage(capsys, monkeypatch) -> None:
    """A user test: ``copy-prior --help`` printed figure's usage with its required ``{goat-prior,...}`` name."""
    import sys

    from mixlab import cli

    monkeypatch.setattr(sys, "argv", ["mixlab"])
    with pytest.raises(SystemExit) as info:
        cli.main(["copy-prior", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m mixlab copy-prior [-h] --ckpt CKPT ")
    assert "{goat-prior" not in out and "--batches" not in out and "alias of 'python -m mixlab figure goat-prior'" \
        in " ".join(out.split())
    with pytest.raises(SystemExit) as info:
        cli.main(["copy-prior", "goat-prior", "--ckpt", "x.ckpt"])
    assert info.value.code == 2
    assert capsys.readouterr().err == ("python -m mixlab copy-prior: error: unrecognized arguments: goat-prior "
                                       "(--help lists the options)\n")


def test_a_repeated_figure_command_replaces_its_events_and_pngs(tmp_path: Path, monkeypatch) -> None:
    """A user test: running a figure twice into the same folder added another TensorBoard event file (each scalar
    and image twice). The new event file now replaces the earlier one of the same figure; other figures' and other
    writers' event files stay, and the PNGs are overwritten."""
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from mixlab.eval import figures

    monkeypatch.chdir(tmp_path)
    (tmp_path / "v0" / "checkpoints").mkdir(parents=True)
    ckpt = tmp_path / "v0" / "checkpoints" / "goat.ckpt"
    shutil.copy(FIXTURES / "copy_mixture_goat.ckpt", ckpt)
    fig = tmp_path / "v0" / "figures"
    other = SummaryWriter(str(fig))  # another writer's events in the same folder
    other.add_scalar("train/loss", 1.5, 0)
    other.close()
    (fig / "goat_prior_l0_h1.png").write_bytes(b"old png")

    def events() -> dict[str, int]:
        """How many times each scalar and image tag shows in TensorBoard (all the folder's event files)."""
        acc = EventAccumulator(str(fig))
        acc.Reload()
        return {**{t: len(acc.Scalars(t)) for t in acc.Tags()["scalars"]},
                **{t: len(acc.Images(t)) for t in acc.Tags()["images"]}}

    for _ in range(2):
        spec = figures.main(["goat-spectrum", "--ckpt", str(ckpt)])
        figures.main(["goat-prior", "--ckpt", str(ckpt), "--head", "1"])
    _png(fig / "goat_prior_l0_h1.png")
    assert len(list(fig.glob("events.out.tfevents.*"))) == 3
    assert events() == {"train/loss": 1, "figures/goat_spectrum/mean_amplitude": 1, "figures/goat_spectrum": 1,
                        "figures/goat_spectrum/antisym_share": 1, "figures/goat_spectrum/median_ratio": 1,
                        "figures/goat_prior_l0_h1": 1}  # one GOAT layer: one step per scalar
    acc = EventAccumulator(str(fig))
    acc.Reload()
    assert acc.Scalars("figures/goat_spectrum/antisym_share")[0].value == pytest.approx(float(spec[0]["antisym_share"]))
    figures.main(["goat-prior", "--ckpt", str(ckpt), "--all-heads"])  # rewrites head 1: replaces that file
    assert len(list(fig.glob("events.out.tfevents.*"))) == 3
    assert events()["figures/goat_prior_l0_h0"] == events()["figures/goat_prior_l0_h1"] == 1
    figures.main(["goat-prior", "--ckpt", str(ckpt), "--head", "0"])  # head 1 of the --all-heads file stays
    assert len(list(fig.glob("events.out.tfevents.*"))) == 4
    assert sorted(p.name for p in fig.glob("*.png")) == ["goat_prior_l0_h0.png", "goat_prior_l0_h1.png",
                                                          "goat_spectrum.png"]


def test_a_long_sequence_prior_is_drawn_thinned_with_whole_numbers(tmp_path: Path, monkeypatch) -> None:
    """Past :data:`DRAWN_POSITIONS` a sequence panel draws every k-th position (a picture shows some 500 across;
    drawing 5000^2 pixels took minutes); the numbers returned are whole."""
    from mixlab.eval import figures

    model = _lm("goat", {"position_args": {"n_modes": 2, "key_mlp_hidden": 0}})
    pos = model.backbone.blocks[0].mixer.pos
    _randomise_goat(pos)
    monkeypatch.setattr(figures, "DRAWN_POSITIONS", 8)
    res = figures.goat_prior_figure(model, head=1, length=20, out=tmp_path)
    _png(tmp_path / "goat_prior_l0_h1.png")
    whole = figures.goat_prior_panels(pos, 1, 20)
    assert res["total"].shape == (20, 20)
    for k in ("key_only", "relative", "total", "causal_prior"):
        np.testing.assert_allclose(res[k], whole[k], atol=1e-12)
    np.testing.assert_allclose(res["causal_prior"].sum(1), 1.0)
    assert (res["causal_prior"][np.triu_indices(20, 1)] == 0).all()
