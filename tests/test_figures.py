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
