"""The papers' analysis figures: ``python -m mixlab figure <name> --ckpt RUN.ckpt [...]``.

Each figure is a function taking a model (any mixlab head) and returning the numbers it
plots (numpy arrays, keyed as documented), writing a PNG to ``out`` and, when a
``writer`` (:class:`torch.utils.tensorboard.SummaryWriter`) is given, logging the figure
as a TensorBoard image (tag ``figures/<name>``) and its summary numbers as scalars.

=================  ========================================================================
``goat-prior``     :func:`goat_prior_figure`: the learned GOAT log-prior of one layer and
                   head, split into key-only, relative and total terms, plus for causal
                   1D priors the causal prior softmax (GOAT paper Fig. 1 style), for 1D
                   sequences (``Coords.seq(T)``) and 2D grids (``Coords.grid(h, w)``: the
                   prior seen from the centre query). ``copy-prior`` is an alias.
``goat-spectrum``  :func:`goat_spectrum_figure`: spectral statistics of the GOAT heads
                   (GOAT "learned structure" slide): amplitude per head, the share of heads
                   dominated by antisymmetric (``beta``) coefficients, ``|beta|/|alpha|``
                   per layer.
``write-rates``    :func:`write_rate_figure`: FG²-GDN per-channel writing-rate statistics
                   per layer on held-out tokens (FG²-GDN paper Sec. 4.3, Fig. 2 style).
``mesa-solver``    :func:`mesa_solver_figure`: Mesa CG iterations and condition numbers of
                   ``H_t + Lambda`` per layer and head on held-out tokens (MesaNet Sec. 5,
                   Fig. 5 and the CG slides).
=================  ========================================================================

Hooks read from the mixers (looked up with ``getattr``, so mixers can override them):

* delta mixers (:class:`~mixlab.mixers.delta.GatedDeltaMixer`): ``writing_rates(x)`` ->
  ``{"beta_k": [B, T, H, K] or [B, T, H], "beta_v": ... (optional)}`` in ``[0, max_rate]``;
  when absent, the figure uses the public ``gates(x)`` (writing-rate logits) as
  ``sigmoid(b) * max_rate``.
* Mesa (:class:`~mixlab.mixers.mesa.Mesa`): ``solver_stats(x)`` -> ``{"cg_iters": [B, T, H],
  "cond": [B, T, H]}``; when absent, CG iterations are the per-head means of the
  forward's ``extra_metrics()`` (``cg_iters/h{i}``) and condition numbers are computed
  from ``H_t = sum_s decay * beta_s k_s k_s^T`` (:func:`mixlab.ops.mesa.mesa_states`) and
  ``Lambda = mixer.lamb()``, re-deriving ``k, g, beta`` as ``Mesa.forward`` does.

The command writes the PNGs and the TensorBoard images into the checkpoint's run folder
(``version_N/figures``; ``runs/figures/<checkpoint name>`` for a checkpoint outside one) unless
``--out`` / ``--tb`` say otherwise. A command that fails leaves those folders as they were
(:func:`undo_on_failure`): its arguments are checked against the model before anything is written,
and a later error removes the event files and PNGs it wrote and the folders it created.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import move_data_to_device
from torch import Tensor, nn

from mixlab.coords import Coords
from mixlab.eval.common import OneLineParser, goat_layers, load_run, pyplot, undo_on_failure

__all__ = [
    "goat_layers", "goat_prior_panels", "goat_prior_figure", "goat_spectrum", "goat_spectrum_figure", "write_rates",
    "write_rate_figure", "mesa_solver_stats", "mesa_solver_figure", "FIGURES", "heldout_batches", "main", "copy_prior",
]


def _save(fig, out: str | Path, name: str, writer: Any = None, step: int = 0, stats: dict | None = None,
          scalars: dict[str, Callable[[dict], Any]] | None = None) -> Path:
    """Lay out and save ``fig`` as ``<out>/<name>.png``, log it to ``writer`` as ``figures/<name>``, and
    log ``figures/<name>/<key>`` = ``fn(stats[layer])`` for each ``scalars`` entry (step = layer index)."""
    fig.tight_layout()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110)
    if writer is not None:
        writer.add_figure(f"figures/{name}", fig, global_step=step, close=False)
        writer.flush()
    pyplot().close(fig)
    if writer is not None and scalars:
        for i in sorted(stats):
            for key, fn in scalars.items():
                writer.add_scalar(f"figures/{name}/{key}", float(fn(stats[i])), i)
        writer.flush()
    return path


def _layer_of(mod: nn.Module, default: int) -> int:
    return int(getattr(mod, "layer_idx", default))


# ---------------------------------------------------------------------------- GOAT
def _goat(model: nn.Module, layer: int | None):
    """``(layer, GoatPrior)``: the given GOAT layer, or the first one for ``layer=None``."""
    layers = goat_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no GOAT attention layer (mixer 'goat')")
    layer = min(layers) if layer is None else layer
    if layer not in layers:
        raise ValueError(f"--layer {layer}: GOAT layers of this model are {sorted(layers)}")
    return layer, layers[layer]


def _check_head(prior: nn.Module, head: int) -> None:
    if not 0 <= head < prior.n_heads:
        raise ValueError(f"--head {head}: the GOAT layer has {prior.n_heads} heads")


@torch.no_grad()
def goat_prior_panels(prior: nn.Module, head: int, length: int = 64,
                      grid: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
    """The numbers of the goat-prior figure for one head of a :class:`~mixlab.mixers.positions.GoatPrior`.

    Returns:
        ``{"key_only", "relative", "total"}``, each float64 ``[Tq, Tk]`` (nats, additive
        log-prior before softmax, from the formula; unmasked), over ``Coords.seq(length)`` or
        ``Coords.grid(*grid)``; for a causal prior on a sequence also ``"causal_prior"``
        ``[T, T]``: ``softmax_j`` of ``total`` over ``j <= i`` (0 above the diagonal), what
        attention does with no content contrast (GOAT Theorem 5.1).
    """
    dev = prior.mode_axis.device
    coords = Coords.grid(*grid, device=dev) if grid is not None else Coords.seq(length, device=dev)
    terms = prior.prior_terms(coords, coords, torch.float64)
    res = {k: terms[k][0, head].cpu().numpy() for k in ("key_only", "relative", "total")}
    if grid is None and prior.causal:
        total = np.where(np.tril(np.ones((length, length), dtype=bool)), res["total"], -np.inf)
        p = np.exp(total - total.max(-1, keepdims=True))
        res["causal_prior"] = p / p.sum(-1, keepdims=True)
    return res


@torch.no_grad()
def goat_prior_figure(model: nn.Module, layer: int | None = None, head: int = 0, length: int = 64,
                      grid: tuple[int, int] | None = None, out: str | Path = "figures", writer: Any = None,
                      step: int = 0) -> dict[str, np.ndarray]:
    """Learned GOAT log-prior of one layer and head (GOAT paper Sec. 4, Eqs. 11-22; Fig. 1 style).

    Args:
        model: a head containing GOAT attention layers.
        layer, head: which prior to draw (``layer=None``: the first GOAT layer).
        length: ``T`` of the 1D coordinates ``Coords.seq(T)`` (used when ``grid`` is None).
        grid: ``(h, w)`` for a 2D model: coordinates ``Coords.grid(h, w)`` (the prior must
            read 2 axes); the figure shows the prior from the centre query over the grid.
        out: folder of ``goat_prior_l<layer>_h<head>.png``.

    Returns:
        :func:`goat_prior_panels` (the causal mask is only drawn) and ``"query"`` (the centre
        query index for grids, else ``-1``).

    Raises:
        ValueError: no GOAT layer, bad ``layer``/``head``.
    """
    layer, pos = _goat(model, layer)
    _check_head(pos, head)
    res = goat_prior_panels(pos, head, length, grid)
    plt = pyplot()
    names = {"key_only": "key-only u(j)", "relative": "relative K_rel(i, j)", "total": "total log-prior"}
    if "causal_prior" in res:
        names["causal_prior"] = "causal prior softmax(total)"
    fig, axes = plt.subplots(1, len(names), figsize=(4.4 * len(names), 4))
    if grid is None:
        causal = np.triu(np.ones((length, length), dtype=bool), 1) if pos.causal else np.zeros((length, length), bool)
        for ax, k in zip(axes, names):
            img = ax.imshow(np.ma.masked_array(res[k], causal), cmap="magma" if k == "causal_prior" else "RdBu_r",
                            aspect="auto")
            ax.set(title=names[k], xlabel="key j", ylabel="query i")
            fig.colorbar(img, ax=ax, fraction=0.046)
        res["query"] = np.array(-1)
    else:
        h, w = grid
        qi = (h // 2) * w + w // 2
        for ax, k in zip(axes, names):
            img = ax.imshow(res[k][qi].reshape(h, w), cmap="RdBu_r")
            ax.plot([w // 2], [h // 2], "k+")
            ax.set(title=f"{names[k]}, query at centre", xlabel="x", ylabel="y")
            fig.colorbar(img, ax=ax, fraction=0.046)
        res["query"] = np.array(qi)
    fig.suptitle(f"GOAT log-prior, layer {layer}, head {head}")
    _save(fig, out, f"goat_prior_l{layer}_h{head}", writer, step)
    return res


@torch.no_grad()
def goat_spectrum(model: nn.Module) -> dict[int, dict[str, np.ndarray]]:
    """Spectral statistics of the GOAT heads per layer, from ``alpha, beta [H, R]``.

    Per layer: ``amplitude`` ``[H]`` = ``sum_r sqrt(alpha_hr^2 + beta_hr^2)``; ``amplitude_max``
    ``[H]`` = ``max_r`` of the same; ``antisym`` ``[H]`` bool = ``||beta_h||_2 > ||alpha_h||_2``
    (head dominated by the antisymmetric, sine coefficients); ``ratio`` ``[H]`` =
    ``||beta_h||_2 / ||alpha_h||_2`` (inf for ``alpha_h = 0 != beta_h``, nan for both 0);
    ``antisym_share`` (scalar) = mean of ``antisym``; ``median_ratio`` (scalar, finite
    ratios; nan if none).

    Raises:
        ValueError: the model has no GOAT layer or ``R = 0``.
    """
    layers = goat_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no GOAT attention layer (mixer 'goat')")
    out = {}
    for li, pos in sorted(layers.items()):
        a, b = pos.alpha.detach().double().cpu(), pos.beta.detach().double().cpu()
        if a.shape[1] == 0:
            raise ValueError(f"GOAT layer {li} has n_modes=0: no spectrum")
        amp = torch.sqrt(a ** 2 + b ** 2)
        na, nb = a.norm(dim=1), b.norm(dim=1)
        ratio = torch.where(na > 0, nb / na.clamp_min(1e-300), torch.where(nb > 0, math.inf, math.nan))
        finite = ratio[torch.isfinite(ratio)]
        out[li] = {
            "amplitude": amp.sum(1).numpy(), "amplitude_max": amp.max(1).values.numpy(),
            "antisym": (nb > na).numpy(), "ratio": ratio.numpy(),
            "antisym_share": np.array(float((nb > na).double().mean())),
            "median_ratio": np.array(float(np.median(finite.numpy())) if finite.numel() else math.nan),
        }
    return out


def goat_spectrum_figure(model: nn.Module, out: str | Path = "figures", writer: Any = None,
                         step: int = 0) -> dict[int, dict[str, np.ndarray]]:
    """Plot :func:`goat_spectrum` (amplitude per head and layer; antisymmetric share and median
    ``|beta|/|alpha|`` per layer) into ``<out>/goat_spectrum.png``; returns its numbers."""
    stats = goat_spectrum(model)
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    ls = sorted(stats)
    amp = np.stack([stats[i]["amplitude"] for i in ls])
    img = axes[0].imshow(amp.T, aspect="auto", cmap="viridis")
    axes[0].set(title="amplitude sum_r sqrt(a^2+b^2)", xlabel="layer", ylabel="head",
                xticks=range(len(ls)), xticklabels=ls, yticks=range(amp.shape[1]))
    fig.colorbar(img, ax=axes[0], fraction=0.046)
    axes[1].bar(range(len(ls)), [float(stats[i]["antisym_share"]) for i in ls])
    axes[1].set(title="share of heads with ||beta|| > ||alpha||", xlabel="layer", ylim=(0, 1),
                xticks=range(len(ls)), xticklabels=ls)
    axes[2].plot(range(len(ls)), [float(stats[i]["median_ratio"]) for i in ls], marker="o")
    axes[2].set(title="median |beta|/|alpha| per layer", xlabel="layer", xticks=range(len(ls)), xticklabels=ls)
    _save(fig, out, "goat_spectrum", writer, step, stats, {
        "mean_amplitude": lambda s: s["amplitude"].mean(), "antisym_share": lambda s: s["antisym_share"],
        "median_ratio": lambda s: s["median_ratio"]})
    return stats


# ---------------------------------------------------------------------------- held-out forwards
def _capture_inputs(model: nn.Module, kinds: tuple[type, ...], forward: Callable[[], Any]) -> dict[int, list[Tensor]]:
    """Run ``forward()`` with pre-hooks on every mixer of type ``kinds``; ``{layer: [x [B, T, D], ...]}``."""
    caught: dict[int, list[Tensor]] = {}
    handles = []
    mods = [m for m in model.modules() if isinstance(m, kinds)]
    for i, m in enumerate(mods):
        li = _layer_of(m, i)
        handles.append(m.register_forward_pre_hook(
            lambda mod, args, li=li: caught.setdefault(li, []).append(args[0].detach())))
    try:
        forward()
    finally:
        for h in handles:
            h.remove()
    return caught


def forward_batch(model: nn.Module, batch: Any) -> Any:
    """Run a head on one batch as its ``_eval_step`` would: ``LongTensor [B, L+1]`` -> ``model(batch[:, :-1])``;
    ``(x, y)`` -> ``model(x)``; a float tensor -> ``model(batch)``; a synthetic-task dict
    (``inputs``/``targets``, :class:`~mixlab.heads.SyntheticLM`) -> ``model(batch["inputs"])`` via
    :func:`mixlab.heads.synthetic.split_batch`.

    Raises:
        ValueError: another batch type (the figure functions also take a callable).
    """
    if torch.is_tensor(batch):
        return model(batch[:, :-1] if not batch.is_floating_point() and batch.dim() == 2 else batch)
    if isinstance(batch, (tuple, list)) and batch and torch.is_tensor(batch[0]):
        return model(batch[0])
    if isinstance(batch, dict):
        from mixlab.heads.synthetic import split_batch  # the SyntheticLM batch format, as its _eval_step reads it

        return model(split_batch(batch)[0])
    raise ValueError(f"figures: cannot feed a batch of type {type(batch).__name__} to {type(model).__name__}; "
                     f"pass a callable running the model instead")


def _runner(model: nn.Module, inputs: Any) -> Callable[[], Any]:
    if callable(inputs) and not torch.is_tensor(inputs):
        return inputs
    batches = inputs if isinstance(inputs, list) else [inputs]
    return lambda: [forward_batch(model, b) for b in batches]


@torch.no_grad()
def write_rates(model: nn.Module, inputs: Any) -> dict[int, dict[str, np.ndarray]]:
    """Writing rates of every delta-rule layer on held-out ``inputs`` (FG²-GDN Sec. 4.3).

    Args:
        model: a head with :class:`~mixlab.mixers.delta.GatedDeltaMixer` layers.
        inputs: a batch (see :func:`forward_batch`), a list of batches, or a callable that
            runs the model.

    Returns:
        Per layer: ``rates`` float64 ``[N, C]`` (N tokens, C = H*K channels; C = H for a
        scalar writing rate) of ``beta^k`` in ``[0, max_rate]``; ``channel_mean`` /
        ``channel_std`` ``[C]`` (over tokens); ``token_spread`` (scalar: mean over tokens of
        the std across channels); ``between_channel_std`` (std of ``channel_mean``);
        ``quantiles`` ``[5]`` (5/25/50/75/95 % of ``channel_mean``); ``vector`` (bool: a
        channel-wise rate). ``beta_v`` entries of the same form under ``v_...`` keys for
        separate key/value rates.

    Raises:
        ValueError: no delta-rule layer.
    """
    from mixlab.mixers.delta import GatedDeltaMixer

    model.eval()
    mods = _delta_layers(model)
    caught = _capture_inputs(model, (GatedDeltaMixer,), _runner(model, inputs))
    if not caught:
        raise ValueError(f"{type(model).__name__} has no delta-rule layer (deltanet, gdn, kda, fg2gdn, ...)")
    out = {}
    for li, xs in sorted(caught.items()):
        mix = mods[li]
        parts: dict[str, list[Tensor]] = {}
        for x in xs:
            hook = getattr(mix, "writing_rates", None)
            if hook is not None:
                rates = hook(x)
            else:
                _, bk, bv = mix.gates(x)
                rates = {"beta_k": torch.sigmoid(bk) * mix.max_rate}
                if bv is not None:
                    rates["beta_v"] = torch.sigmoid(bv) * mix.max_rate
            for k, r in rates.items():
                if r is not None:
                    parts.setdefault(k, []).append(r.double().reshape(r.shape[0] * r.shape[1], -1).cpu())
        stats: dict[str, np.ndarray] = {}
        for k, rs in parts.items():
            r = torch.cat(rs)
            prefix = "" if k == "beta_k" else "v_"
            cm = r.mean(0)
            stats.update({
                f"{prefix}rates": r.numpy(), f"{prefix}channel_mean": cm.numpy(),
                f"{prefix}channel_std": r.std(0, unbiased=False).numpy(),
                f"{prefix}token_spread": np.array(float(r.std(1, unbiased=False).mean())),
                f"{prefix}between_channel_std": np.array(float(cm.std(unbiased=False))),
                f"{prefix}quantiles": torch.quantile(
                    cm, torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95], dtype=cm.dtype)).numpy(),
            })
        stats["vector"] = np.array(getattr(mix, "write", "vector") == "vector")
        out[li] = stats
    return out


def _delta_layers(model: nn.Module) -> dict[int, nn.Module]:
    """``{layer: GatedDeltaMixer}`` of ``model``; ValueError when it has none."""
    from mixlab.mixers.delta import GatedDeltaMixer

    mods = {_layer_of(m, i): m for i, m in enumerate(m for m in model.modules() if isinstance(m, GatedDeltaMixer))}
    if not mods:
        raise ValueError(f"{type(model).__name__} has no delta-rule layer (deltanet, gdn, kda, fg2gdn, ...)")
    return mods


def write_rate_figure(model: nn.Module, inputs: Any, out: str | Path = "figures", writer: Any = None,
                      step: int = 0) -> dict[int, dict[str, np.ndarray]]:
    """Plot :func:`write_rates` into ``<out>/write_rates.png`` (per layer: distribution of
    per-channel mean rates, and the across-channel spread per token); returns its numbers."""
    stats = write_rates(model, inputs)
    plt = pyplot()
    ls = sorted(stats)
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    axes[0].boxplot([stats[i]["channel_mean"] for i in ls], whis=(5, 95), showfliers=False)
    axes[0].set(title="per-channel mean writing rate", xlabel="layer", ylabel="beta", xticklabels=ls)
    axes[1].bar(range(len(ls)), [float(stats[i]["token_spread"]) for i in ls], label="within token (across channels)")
    axes[1].plot(range(len(ls)), [float(stats[i]["between_channel_std"]) for i in ls], "ko-",
                 label="between channel means")
    axes[1].set(title="std of beta across channels", xlabel="layer", xticks=range(len(ls)), xticklabels=ls)
    axes[1].legend(fontsize=8)
    first = stats[ls[0]]["rates"]
    axes[2].hist(first.ravel(), bins=50, range=(0, float(max(1.0, first.max()))))
    axes[2].set(title=f"beta over tokens and channels, layer {ls[0]}", xlabel="beta")
    _save(fig, out, "write_rates", writer, step, stats, {
        "mean": lambda s: s["channel_mean"].mean(), "token_spread": lambda s: s["token_spread"],
        "between_channel_std": lambda s: s["between_channel_std"]})
    return stats


# ---------------------------------------------------------------------------- Mesa
def _mesa_fallback_stats(mix: nn.Module, x: Tensor) -> dict[str, Tensor]:
    """Condition numbers of ``H_t + diag(Lambda)`` per token and head, ``k, g, beta`` as in ``Mesa.forward``."""
    from mixlab.ops.mesa import mesa_states

    b, t, _ = x.shape
    h, d = mix.n_heads, mix.head_dim
    up = lambda z: z if z.dtype == torch.float64 else z.float()  # noqa: E731
    k, v = mix.k_proj(x), mix.v_proj(x)
    if getattr(mix, "k_conv", None) is not None:
        k = mix.k_conv(k, None, "k_conv")
    k = F.normalize(up(k.view(b, t, h, d)), dim=-1)
    g = F.logsigmoid(up(mix.a_proj(x)))
    beta = torch.sigmoid(up(mix.b_proj(x)))
    hs, _ = mesa_states(k, up(v.view(b, t, h, d)), g, beta)
    eig = torch.linalg.eigvalsh(hs + torch.diag_embed(mix.lamb().to(hs.dtype)))  # [B, T, H, K] ascending
    return {"cond": eig[..., -1] / eig[..., 0]}


@torch.no_grad()
def mesa_solver_stats(model: nn.Module, inputs: Any) -> dict[int, dict[str, np.ndarray]]:
    """Mesa CG iterations and condition numbers per layer and head on held-out ``inputs``.

    The model runs in eval mode (the mixer's evaluation tolerance ``eval_cg_eps``, capped at
    ``cg_iters``), as in MesaNet Sec. 5 / Fig. 5.

    Returns:
        Per layer: ``cg_iters`` float64 ``[H]`` (mean CG iterations per head over the
        batches' tokens), ``cond`` float64 ``[N, H]`` (condition number
        ``lambda_max / lambda_min`` of ``H_t + diag(Lambda)`` per token and head),
        ``cond_median`` / ``cond_max`` ``[H]``, ``lamb`` ``[H, K]`` (the regulariser).

    Raises:
        ValueError: no Mesa layer.
    """
    from mixlab.mixers.mesa import Mesa

    model.eval()
    mods = _mesa_layers(model)
    iters: dict[int, list[Tensor]] = {}
    handles = [m.register_forward_hook(
        lambda mod, args, output, li=li: iters.setdefault(li, []).append(_iters_of(mod))) for li, m in mods.items()]
    try:
        caught = _capture_inputs(model, (Mesa,), _runner(model, inputs))
    finally:
        for hd in handles:
            hd.remove()
    out = {}
    for li, xs in sorted(caught.items()):
        mix = mods[li]
        hook = getattr(mix, "solver_stats", None)
        conds, its = [], []
        for x in xs:
            s = hook(x) if hook is not None else _mesa_fallback_stats(mix, x)
            conds.append(s["cond"].double().reshape(-1, mix.n_heads).cpu())
            if "cg_iters" in s:
                its.append(s["cg_iters"].double().reshape(-1, mix.n_heads).mean(0).cpu())
        its = its or iters[li]
        cond = torch.cat(conds)
        out[li] = {"cg_iters": torch.stack(its).mean(0).numpy(), "cond": cond.numpy(),
                   "cond_median": np.median(cond.numpy(), axis=0), "cond_max": cond.max(0).values.numpy(),
                   "lamb": mix.lamb().detach().double().cpu().numpy()}
    return out


def _mesa_layers(model: nn.Module) -> dict[int, nn.Module]:
    """``{layer: Mesa}`` of ``model``; ValueError when it has none."""
    from mixlab.mixers.mesa import Mesa

    mods = {_layer_of(m, i): m for i, m in enumerate(m for m in model.modules() if isinstance(m, Mesa))}
    if not mods:
        raise ValueError(f"{type(model).__name__} has no Mesa layer (mixer 'mesa')")
    return mods


def _iters_of(mix: nn.Module) -> Tensor:
    m = mix.extra_metrics()
    return torch.stack([m[f"cg_iters/h{i}"].double().cpu() for i in range(mix.n_heads)])


def mesa_solver_figure(model: nn.Module, inputs: Any, out: str | Path = "figures", writer: Any = None,
                       step: int = 0) -> dict[int, dict[str, np.ndarray]]:
    """Plot :func:`mesa_solver_stats` into ``<out>/mesa_solver.png`` (CG iterations and median /
    max condition number per layer and head); returns its numbers."""
    stats = mesa_solver_stats(model, inputs)
    plt = pyplot()
    ls = sorted(stats)
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    for ax, key, title in zip(axes, ("cg_iters", "cond_median", "cond_max"),
                              ("mean CG iterations", "median cond(H_t + Lambda)", "max cond(H_t + Lambda)")):
        m = np.stack([stats[i][key] for i in ls])
        img = ax.imshow(m.T, aspect="auto", cmap="magma", norm=None if key == "cg_iters" else _lognorm(m))
        ax.set(title=title, xlabel="layer", ylabel="head", xticks=range(len(ls)), xticklabels=ls,
               yticks=range(m.shape[1]))
        fig.colorbar(img, ax=ax, fraction=0.046)
    _save(fig, out, "mesa_solver", writer, step, stats, {
        "cg_iters": lambda s: s["cg_iters"].mean(), "cond_median": lambda s: np.median(s["cond"])})
    return stats


def _lognorm(m: np.ndarray):
    from matplotlib.colors import LogNorm

    lo, hi = float(np.nanmin(m)), float(np.nanmax(m))
    return LogNorm(vmin=max(lo, 1e-12), vmax=max(hi, lo * 1.0001, 1e-12))


# ---------------------------------------------------------------------------- CLI
FIGURES = {"goat-prior": goat_prior_figure, "goat-spectrum": goat_spectrum_figure,
           "write-rates": write_rate_figure, "mesa-solver": mesa_solver_figure}
"""Figure name (CLI) -> function."""


def heldout_batches(ckpt: str | Path, n: int) -> list[Any]:
    """First ``n`` validation batches of the datamodule recorded in ``ckpt`` (held-out tokens).

    Raises:
        ValueError: the checkpoint records no datamodule (names ``--ckpt``).
    """
    dm = load_run(ckpt).datamodule()
    if hasattr(dm, "prepare_data"):
        dm.prepare_data()
    dm.setup("validate")
    out = []
    for b in dm.val_dataloader():
        out.append(dm.on_after_batch_transfer(b, 0))  # e.g. ImageNet decode: gpu decodes here (on the CPU)
        if len(out) >= n:
            break
    return out


def _default_tb(ckpt: Path) -> Path | None:
    """``version_N/figures`` for ``.../version_N/checkpoints/x.ckpt`` (shows under the run in TensorBoard)."""
    p = ckpt.resolve()
    return p.parent.parent / "figures" if p.parent.name == "checkpoints" else None


def _check_model(a: argparse.Namespace, model: nn.Module) -> None:
    """Raise the ValueError figure ``a.name`` would raise for ``model`` (no layer of the kind it reads,
    a ``--layer`` / ``--head`` it does not have) before anything is written."""
    if a.name == "goat-prior":
        _, pos = _goat(model, a.layer)
        if not a.all_heads:
            _check_head(pos, a.head)
        axes = getattr(pos, "axes", None)
        if a.grid and axes == 1:
            raise ValueError(f"--grid {a.grid[0]} {a.grid[1]}: this model's GOAT prior has 1 axis (sequences); "
                             f"draw it with --length")
    elif a.name == "goat-spectrum":
        _goat(model, None)
    elif a.name == "write-rates":
        _delta_layers(model)
    else:
        _mesa_layers(model)


def main(argv: list[str] | None = None) -> dict:
    """CLI entry (``python -m mixlab figure <name> --ckpt ...``); returns the figure's numbers.

    Arguments are checked before anything is written: a size below 1 (``--length``, ``--grid``,
    ``--batches``) is an argparse error (exit status 2); a checkpoint that cannot be read, a model without
    the layers the figure reads, a ``--layer`` / ``--head`` it does not have, ``--grid`` for a 1-D prior,
    held-out batches that cannot be loaded raise ValueError / OSError before any folder or event file is
    created. An error while drawing leaves ``--out`` and ``--tb`` as they were (:func:`undo_on_failure`).
    """
    p = OneLineParser(prog="python -m mixlab figure", description=__doc__.split("\n\n")[0])
    p.add_argument("name", choices=sorted(FIGURES))
    p.add_argument("--ckpt", required=True, help="Lightning checkpoint of a mixlab run")
    p.add_argument("--out", default=None, help="folder of the PNGs (default: <version_N>/figures of the "
                   "checkpoint's run, else runs/figures/<checkpoint name>)")
    p.add_argument("--tb", default=None, help="TensorBoard log dir for the images "
                   "(default: <version_N>/figures of the checkpoint's run, else <out>/tb)")
    p.add_argument("--layer", type=int, default=None, help="goat-prior: layer index (default: the first GOAT layer)")
    p.add_argument("--head", type=int, default=0, help="goat-prior: head index")
    p.add_argument("--all-heads", action="store_true", help="goat-prior: one figure per head of the layer")
    p.add_argument("--length", type=int, default=64, help="goat-prior: 1D length T")
    p.add_argument("--grid", type=int, nargs=2, default=None, metavar=("H", "W"), help="goat-prior: 2D grid")
    p.add_argument("--batches", type=int, default=1, help="write-rates/mesa-solver: held-out validation batches")
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    for name, value in (("--length", [a.length]), ("--grid", a.grid or [1]), ("--batches", [a.batches])):
        if min(value) < 1:
            p.error(f"{name} must be >= 1; got {' '.join(map(str, value))}")
    from torch.utils.tensorboard import SummaryWriter

    ckpt = Path(a.ckpt)
    run = load_run(ckpt, a.device)
    model, step = run.model, run.step
    _check_model(a, model)
    batches: list[Any] = []
    if a.name in ("write-rates", "mesa-solver"):
        dev = torch.device(a.device)
        batches = [move_data_to_device(b, dev) for b in heldout_batches(ckpt, a.batches)]  # tensors, tuples, dicts
    run_tb = _default_tb(ckpt)
    a.out = a.out or str(run_tb or Path("runs") / "figures" / ckpt.stem)
    tb = Path(a.tb) if a.tb else (run_tb or Path(a.out) / "tb")
    with undo_on_failure() as note:
        note(a.out)
        writer = SummaryWriter(str(note(tb)))
        try:
            if a.name == "goat-prior":
                grid = tuple(a.grid) if a.grid else None
                heads = range(_goat(model, a.layer)[1].n_heads) if a.all_heads else [a.head]
                res = {h: goat_prior_figure(model, a.layer, h, a.length, grid, a.out, writer, step) for h in heads}
                res = res if a.all_heads else res[a.head]
            elif a.name == "goat-spectrum":
                res = goat_spectrum_figure(model, a.out, writer, step)
            else:
                res = FIGURES[a.name](model, batches, a.out, writer, step)
        finally:
            writer.close()
    print(f"wrote {a.out}/ ({a.name}) and TensorBoard images under {tb}")
    return res


def copy_prior(argv: list[str] | None = None) -> dict:
    """``python -m mixlab copy-prior ...``: an alias of ``python -m mixlab figure goat-prior ...``."""
    return main(["goat-prior", *(argv or [])])
