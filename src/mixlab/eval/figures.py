"""The papers' analysis figures: ``python -m mixlab figure <name> --ckpt RUN.ckpt [...]``.

Each figure is a function taking a model (any mixlab head) and returning the numbers it
plots (numpy arrays, keyed as documented), writing a PNG to ``out`` and, when a
``writer`` (:class:`torch.utils.tensorboard.SummaryWriter`) is given, logging the figure
as a TensorBoard image (tag ``figures/<name>``) and its summary numbers as scalars.

=================  ========================================================================
``goat-prior``     :func:`goat_prior_figure`: the learned GOAT log-prior of one layer and
                   head, split into key-only, relative and total terms, plus for causal
                   1D priors the causal prior softmax (GOAT paper Fig. 1 style), for 1D
                   sequences (``Coords.seq(T)``) and 2D grids (``Coords.grid(h, w)``, by
                   default the model's training grid, with its patch coordinate scale: the
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
from mixlab.eval.common import (
    OneLineParser,
    check_device,
    goat_layers,
    load_run,
    output_problem,
    pyplot,
    undo_on_failure,
)

__all__ = [
    "goat_layers", "goat_prior_panels", "goat_prior_figure", "goat_spectrum", "goat_spectrum_figure", "write_rates",
    "write_rate_figure", "mesa_solver_stats", "mesa_solver_figure", "FIGURES", "heldout_batches", "main", "copy_prior",
    "prior_view", "prior_bytes", "PRIOR_MEMORY_BYTES", "DRAWN_POSITIONS",
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


PRIOR_MEMORY_BYTES = 2 * 2 ** 30
"""Most memory the goat-prior matrices may take (:func:`prior_bytes`), 2 GiB: about 5800 positions for one head
(``--length``, or ``H * W`` of ``--grid``). A picture shows some 500 positions across anyway."""


DRAWN_POSITIONS = 1024
"""Most positions a sequence panel draws per side: a longer ``--length`` draws every k-th query and key (a picture
shows some 500 across); the numbers returned are whole."""


def prior_bytes(n_tokens: int, heads: int = 1) -> int:
    """Bytes of the float64 ``[T, T]`` matrices the goat-prior figure holds for ``T = n_tokens`` positions and
    ``heads`` heads drawn: 4 per head kept (``key_only``, ``relative``, ``total``, ``causal_prior``) and 4 more
    while one head is computed and drawn (the softmax's and the masked drawing's copies)."""
    return 8 * n_tokens ** 2 * (4 * heads + 4)


def _bytes(n: float, up: bool = False) -> str:
    """``n`` bytes as a short number with a binary unit (``58.2 TiB``, ``2.0 GiB``), rounded up with ``up`` (a need
    just over a limit does not read as the limit)."""
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if n < 1024 or unit == "EiB":
            if unit == "bytes" or n >= 1e4:
                return f"{n:.3g} {unit}"
            return f"{math.ceil(n * 10) / 10 if up else n:.1f} {unit}"
        n /= 1024
    return ""


def _check_prior_size(length: int | None, grid: tuple[int, int] | None, heads: int = 1) -> None:
    """Refuse a ``--length`` / ``--grid`` whose goat-prior matrices (:func:`prior_bytes` for ``heads`` heads) are
    over :data:`PRIOR_MEMORY_BYTES`, or a size below 1; one line naming the option, the bytes and the most
    positions that fit.

    Raises:
        ValueError: ``--length 1000000: the prior matrices for 1 head need 58.3 TiB ...``.
    """
    what = f"--grid {grid[0]} {grid[1]}" if grid is not None else f"--length {length}"
    t = grid[0] * grid[1] if grid is not None else length
    if min(grid if grid is not None else (length,)) < 1:
        raise ValueError(f"{what.split()[0]} must be >= 1; got {what.split(' ', 1)[1]}")
    need = prior_bytes(t, heads)
    if need > PRIOR_MEMORY_BYTES:
        most = math.isqrt(PRIOR_MEMORY_BYTES // prior_bytes(1, heads))
        per = f"{heads} head{'s' if heads > 1 else ''}"
        raise ValueError(f"{what}: the prior matrices for {per} need {_bytes(need, up=True)} ({4 * heads + 4} float64 "
                         f"[T, T], T = {t} positions), over the {_bytes(PRIOR_MEMORY_BYTES)} limit; draw at most "
                         f"{most} positions" + (" (H * W)" if grid is not None else "")
                         + (f" with --all-heads, {math.isqrt(PRIOR_MEMORY_BYTES // prior_bytes(1))} with one --head"
                            if heads > 1 else ""))


def _prior_coords(prior: nn.Module, length: int | None, grid: tuple[int, int] | None,
                  scale: tuple[float, float] | None = None) -> Coords:
    """The coordinates goat-prior draws: ``Coords.seq(length)``, or the ``grid`` row-major ``(y, x)`` with the
    model's ``scale`` (``Coords.scale``); for a 3-axis prior (sequence, y, x: text + patches) the grid lies on
    the last two axes, without a sequence coordinate."""
    dev = prior.mode_axis.device
    if grid is None:
        return Coords.seq(length, device=dev)
    c = Coords.grid(*grid, device=dev)
    if getattr(prior, "axes", 2) == 3:
        pos = F.pad(c.pos, (1, 0))
        c = Coords(pos, torch.arange(3, device=dev).expand_as(pos) > 0)
    return c.with_scale(scale) if scale is not None and c.axes == 2 else c


@torch.no_grad()
def goat_prior_panels(prior: nn.Module, head: int, length: int | None = 64, grid: tuple[int, int] | None = None,
                      scale: tuple[float, float] | None = None) -> dict[str, np.ndarray]:
    """The numbers of the goat-prior figure for one head of a :class:`~mixlab.mixers.positions.GoatPrior`.

    Args:
        length: ``T`` of ``Coords.seq(T)`` (used when ``grid`` is None; None: 64).
        grid: ``(h, w)``: coordinates ``Coords.grid(h, w)`` (on the y, x axes of a 3-axis prior).
        scale: the grid's ``Coords.scale`` ``(sy, sx)`` (a ViT's ``patch_coords: scaled`` off its training
            grid, :meth:`~mixlab.heads.vit.MixViT.coord_scale`); None: integer patch indices.

    Returns:
        ``{"key_only", "relative", "total"}``, each float64 ``[Tq, Tk]`` (nats, additive
        log-prior before softmax, from the formula; unmasked), over ``Coords.seq(length)`` or
        ``Coords.grid(*grid)``; for a causal prior on a sequence also ``"causal_prior"``
        ``[T, T]``: ``softmax_j`` of ``total`` over ``j <= i`` (0 above the diagonal), what
        attention does with no content contrast (GOAT Theorem 5.1). Computed a block of query rows at a time
        (a few hundred MB at most besides the results).

    Raises:
        ValueError: a size below 1, or matrices over :data:`PRIOR_MEMORY_BYTES` (:func:`_check_prior_size`).
    """
    length = 64 if length is None and grid is None else length
    _check_prior_size(length, grid)
    coords = _prior_coords(prior, length, grid, scale)
    t = coords.length
    # relative_logits holds ~5 float64 [rows, T, R] arrays and prior_terms 3 [H, rows, T] ones per block
    rows = max(1, (256 * 2 ** 20) // (8 * t * (5 * max(prior.n_modes, 1) + 3 * prior.n_heads)))
    parts: dict[str, list[np.ndarray]] = {"key_only": [], "relative": [], "total": []}
    for s in range(0, t, rows):
        terms = prior.prior_terms(coords.slice(s, min(t, s + rows)), coords, torch.float64)
        for k, v in parts.items():
            v.append(terms[k][0, head].cpu().numpy())
    res = {k: np.concatenate(v) for k, v in parts.items()}
    if grid is None and prior.causal:
        total = np.where(np.tril(np.ones((t, t), dtype=bool)), res["total"], -np.inf)
        total -= total.max(-1, keepdims=True)
        p = np.exp(total, out=total)
        res["causal_prior"] = p / p.sum(-1, keepdims=True)
    return res


def _patch_layout(model: nn.Module) -> nn.Module | None:
    """The module of ``model`` that lays out its image patches (a :class:`~mixlab.heads.vit.MixViT`, with
    ``grid_size`` = the training grid ``(gh, gw)`` and ``coord_scale(gh, gw)``), or None (no image model)."""
    return next((m for m in model.modules() if hasattr(m, "grid_size") and callable(getattr(m, "coord_scale", None))),
                None)


def prior_view(model: nn.Module, prior: nn.Module, length: int | None = None, grid: tuple[int, int] | None = None
               ) -> tuple[int | None, tuple[int, int] | None, tuple[float, float] | None]:
    """``(length, grid, scale)`` that goat-prior draws for ``prior`` (a GOAT layer of ``model``) given the
    ``--length`` / ``--grid`` asked for (None: not given): the coordinates the model itself uses.

    * 1 axis (sequences): ``Coords.seq(length)``, 64 positions by default; no ``grid``.
    * 2 axes (patch grids): ``grid``, by default the model's training grid (a ViT's ``grid_size``), with the
      ``Coords.scale`` the model reads that grid with (``patch_coords: scaled`` off the training grid); no
      ``length``.
    * 3 axes (text + patches): the sequence axis by default (``length``, 64), or the patch axes with ``grid``.

    Raises:
        ValueError: ``--grid`` for a 1-axis prior, ``--length`` for a 2-axis one, both for a 3-axis one, no
            ``--grid`` for a 2-axis prior of a model that records no patch grid.
    """
    axes = getattr(prior, "axes", 1)
    vit = _patch_layout(model)
    if axes == 1:
        if grid is not None:
            raise ValueError(f"--grid {grid[0]} {grid[1]}: this model's GOAT prior has 1 axis (sequences); "
                             f"draw it with --length")
        return (64 if length is None else length), None, None
    if axes == 2:
        if length is not None:
            own = f" (default: its training grid {vit.grid_size[0]} {vit.grid_size[1]})" if vit is not None else ""
            raise ValueError(f"--length {length}: this model's GOAT prior has 2 axes (a patch grid); draw it "
                             f"with --grid H W{own}")
        if grid is None:
            if vit is None:
                raise ValueError(f"--grid: the GOAT prior of this {type(model).__name__} has 2 axes (a patch grid) "
                                 f"and the model records no training grid; give --grid H W")
            grid = (int(vit.grid_size[0]), int(vit.grid_size[1]))
        grid = (int(grid[0]), int(grid[1]))
        scale = vit.coord_scale(*grid) if vit is not None and min(grid) >= 1 else None
        return None, grid, (tuple(scale) if scale is not None else None)
    if grid is None:
        return (64 if length is None else length), None, None
    if length is not None:
        raise ValueError(f"--length {length} and --grid {grid[0]} {grid[1]}: give one (this model's GOAT prior "
                         f"has {axes} axes: --length draws the sequence axis, --grid the patch axes)")
    return None, (int(grid[0]), int(grid[1])), None


@torch.no_grad()
def goat_prior_figure(model: nn.Module, layer: int | None = None, head: int = 0, length: int | None = None,
                      grid: tuple[int, int] | None = None, out: str | Path = "figures", writer: Any = None,
                      step: int = 0) -> dict[str, np.ndarray]:
    """Learned GOAT log-prior of one layer and head (GOAT paper Sec. 4, Eqs. 11-22; Fig. 1 style), over the
    coordinates the model uses (:func:`prior_view`).

    Args:
        model: a head containing GOAT attention layers.
        layer, head: which prior to draw (``layer=None``: the first GOAT layer).
        length: ``T`` of the 1D coordinates ``Coords.seq(T)`` for a sequence prior (None: 64); refused for a
            2-axis prior.
        grid: ``(h, w)`` for a 2D prior: coordinates ``Coords.grid(h, w)`` (None: the model's training grid,
            e.g. a ViT's 6x6 patches; off it with the model's ``Coords.scale``); the figure shows the prior
            from the centre query over the grid. A ViT's ``[CLS]`` (no coordinates) is not drawn.
        out: folder of ``goat_prior_l<layer>_h<head>.png`` (overwritten by a repeated call).

    Returns:
        :func:`goat_prior_panels` (the causal mask is only drawn), ``"query"`` (the centre query index for
        grids, else ``-1``) and ``"grid"`` (``[h, w]`` int, ``[]`` for a sequence).

    Raises:
        ValueError: no GOAT layer, bad ``layer``/``head``, ``length``/``grid`` the prior does not read
            (:func:`prior_view`), a size below 1 or too large to hold (:data:`PRIOR_MEMORY_BYTES`).
    """
    layer, pos = _goat(model, layer)
    _check_head(pos, head)
    length, grid, scale = prior_view(model, pos, length, grid)
    res = goat_prior_panels(pos, head, length, grid, scale)
    plt = pyplot()
    names = {"key_only": "key-only u(j)", "relative": "relative K_rel(i, j)", "total": "total log-prior"}
    if "causal_prior" in res:
        names["causal_prior"] = "causal prior softmax(total)"
    fig, axes = plt.subplots(1, len(names), figsize=(4.4 * len(names), 4))
    if grid is None:
        every = -(-length // DRAWN_POSITIONS)  # draw every k-th position of a long sequence (the numbers are whole)
        idx = np.arange(0, length, every)
        causal = idx[None, :] > idx[:, None] if pos.causal else np.zeros((idx.size, idx.size), bool)
        ends = (-every / 2, idx.size * every - every / 2)
        for ax, k in zip(axes, names):
            img = ax.imshow(np.ma.masked_array(res[k][::every, ::every], causal), aspect="auto",
                            cmap="magma" if k == "causal_prior" else "RdBu_r", extent=(*ends, *ends[::-1]))
            ax.set(title=names[k], xlabel="key j", ylabel="query i")
            fig.colorbar(img, ax=ax, fraction=0.046)
        res["query"], res["grid"] = np.array(-1), np.zeros(0, dtype=np.int64)
        where = f"positions 0..{length - 1}" + (f", every {every}th drawn" if every > 1 else "")
    else:
        h, w = grid
        qi = (h // 2) * w + w // 2
        for ax, k in zip(axes, names):
            img = ax.imshow(res[k][qi].reshape(h, w), cmap="RdBu_r")
            ax.plot([w // 2], [h // 2], "k+")
            ax.set(title=f"{names[k]}, query at centre", xlabel="x", ylabel="y")
            fig.colorbar(img, ax=ax, fraction=0.046)
        res["query"], res["grid"] = np.array(qi), np.array([h, w], dtype=np.int64)
        where = f"{h}x{w} patch grid"
        where += f", steps ({scale[0]:.3g}, {scale[1]:.3g}) of the training grid" if scale else ""
    fig.suptitle(f"GOAT log-prior, layer {layer}, head {head} ({where})")
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
    a ``--layer`` / ``--head`` it does not have, a ``--length`` / ``--grid`` its prior does not read or that is too
    large to hold) before anything is written; fills in ``a.length`` / ``a.grid`` for goat-prior
    (:func:`prior_view`)."""
    if a.name == "goat-prior":
        _, pos = _goat(model, a.layer)
        if not a.all_heads:
            _check_head(pos, a.head)
        a.length, a.grid, _ = prior_view(model, pos, a.length, a.grid)
        _check_prior_size(a.length, a.grid, pos.n_heads if a.all_heads else 1)
    elif a.name == "goat-spectrum":
        _goat(model, None)
    elif a.name == "write-rates":
        _delta_layers(model)
    else:
        _mesa_layers(model)


_ONLY = {"--layer": ("goat-prior",), "--head": ("goat-prior",), "--all-heads": ("goat-prior",),
         "--length": ("goat-prior",), "--grid": ("goat-prior",), "--batches": ("write-rates", "mesa-solver")}
"""Options that only some figures read (the others would ignore them): refused for the rest."""


def _parser(figure: str | None = None) -> OneLineParser:
    """The command line of ``figure`` (``figure`` None) or of its alias ``copy-prior`` (``figure="goat-prior"``:
    no figure name, no ``--batches``)."""
    if figure is None:
        p = OneLineParser(prog="python -m mixlab figure", description=__doc__.split("\n\n")[0])
        p.add_argument("name", choices=sorted(FIGURES))
    else:
        p = OneLineParser(prog="python -m mixlab copy-prior",
                          description=f"The learned GOAT log-prior of one layer and head: an alias of "
                                      f"'python -m mixlab figure {figure}' (the same options).")
    p.add_argument("--ckpt", required=True, help="Lightning checkpoint of a mixlab run")
    p.add_argument("--out", default=None, help="folder of the PNGs (default: <version_N>/figures of the "
                   "checkpoint's run, else runs/figures/<checkpoint name>)")
    p.add_argument("--tb", default=None, help="TensorBoard log dir for the images "
                   "(default: <version_N>/figures of the checkpoint's run, else <out>/tb)")
    p.add_argument("--layer", type=int, default=None, help="goat-prior: layer index (default: the first GOAT layer)")
    p.add_argument("--head", type=int, default=None, help="goat-prior: head index (default: 0)")
    p.add_argument("--all-heads", action="store_true", help="goat-prior: one figure per head of the layer")
    p.add_argument("--length", type=int, default=None, help="goat-prior, sequence priors: 1D length T (default: 64; "
                   f"at most {math.isqrt(PRIOR_MEMORY_BYTES // prior_bytes(1))} for one head)")
    p.add_argument("--grid", type=int, nargs=2, default=None, metavar=("H", "W"),
                   help="goat-prior, patch-grid priors: 2D grid (default: the model's training grid)")
    if figure is None:
        p.add_argument("--batches", type=int, default=None,
                       help="write-rates/mesa-solver: held-out validation batches (default: 1)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    return p


def main(argv: list[str] | None = None, figure: str | None = None) -> dict:
    """CLI entry (``python -m mixlab figure <name> --ckpt ...``; with ``figure``, the alias that draws that figure,
    ``copy-prior``); returns the figure's numbers.

    Arguments are checked before anything is written: a size below 1 (``--length``, ``--grid``, ``--batches``),
    an empty ``--ckpt``, an option the figure does not read (``--batches`` for goat-prior, ``--head`` for
    write-rates, ...), ``--head`` with ``--all-heads``, an ``--out`` / ``--tb`` that is a file, lies under one or
    cannot be written are argparse errors (one line, exit status 2); a ``--device`` this machine does not have, a
    checkpoint that cannot be read, a model without the layers the figure reads, a ``--layer`` / ``--head`` it
    does not have, ``--grid`` for a 1-D prior or ``--length`` for a 2-D one, prior matrices over
    :data:`PRIOR_MEMORY_BYTES`, held-out batches that cannot be loaded raise ValueError / OSError before any
    folder or event file is created. An error while drawing leaves ``--out`` and ``--tb`` as they were
    (:func:`undo_on_failure`). Run again with the same options, the command overwrites its PNGs and its new event
    file replaces the one the earlier run wrote (:func:`~mixlab.eval.common.replace_events`).
    """
    p = _parser(figure)
    a = p.parse_args(argv)
    if figure is not None:
        a.name, a.batches = figure, None
    for name, value in (("--length", [a.length] if a.length is not None else [1]), ("--grid", a.grid or [1]),
                        ("--batches", [a.batches] if a.batches is not None else [1])):
        if min(value) < 1:
            p.error(f"{name} must be >= 1; got {' '.join(map(str, value))}")
    given = {"--layer": a.layer is not None, "--head": a.head is not None, "--all-heads": a.all_heads,
             "--length": a.length is not None, "--grid": a.grid is not None, "--batches": a.batches is not None}
    for option, readers in _ONLY.items():
        if given[option] and a.name not in readers:
            p.error(f"{option} applies to {' and '.join(readers)} only, not to {a.name}")
    if a.all_heads and a.head is not None:
        p.error(f"--head {a.head} and --all-heads: give one")
    a.head = 0 if a.head is None else a.head
    a.batches = 1 if a.batches is None else a.batches
    if not a.ckpt.strip():
        p.error("--ckpt is empty; give a checkpoint file")
    dev = check_device(a.device)
    ckpt = Path(a.ckpt)
    run_tb = _default_tb(ckpt)
    out = Path(a.out) if a.out is not None else (run_tb or Path("runs") / "figures" / ckpt.stem)
    tb = Path(a.tb) if a.tb is not None else (run_tb or out / "tb")
    for option, given_path, path in (("--out", a.out, out), ("--tb", a.tb, tb)):
        problem = output_problem(option if given_path is not None else f"the default {option}",
                                 given_path if given_path is not None else path, folder=True)
        if problem:
            p.error(problem)
    from torch.utils.tensorboard import SummaryWriter

    run = load_run(ckpt, dev)
    model, step = run.model, run.step
    _check_model(a, model)
    batches: list[Any] = []
    if a.name in ("write-rates", "mesa-solver"):
        batches = [move_data_to_device(b, dev) for b in heldout_batches(ckpt, a.batches)]  # tensors, tuples, dicts
    with undo_on_failure() as note:
        note(out)
        writer = SummaryWriter(str(note(tb, replace="tags")))
        try:
            if a.name == "goat-prior":
                heads = range(_goat(model, a.layer)[1].n_heads) if a.all_heads else [a.head]
                res = {h: goat_prior_figure(model, a.layer, h, a.length, a.grid, out, writer, step) for h in heads}
                res = res if a.all_heads else res[a.head]
            elif a.name == "goat-spectrum":
                res = goat_spectrum_figure(model, out, writer, step)
            else:
                res = FIGURES[a.name](model, batches, out, writer, step)
        finally:
            writer.close()
    fewer = f"; the validation set has {len(batches)} batch(es), not {a.batches}" if len(batches) < a.batches \
        and batches else ""
    print(f"wrote {out}/ ({a.name}) and TensorBoard images under {tb}{fewer}")
    return res


def copy_prior(argv: list[str] | None = None) -> dict:
    """``python -m mixlab copy-prior ...``: an alias of ``python -m mixlab figure goat-prior ...`` with its own
    usage line (no figure name, no ``--batches``)."""
    return main(argv, figure="goat-prior")
