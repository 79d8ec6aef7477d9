"""Plot a GOAT layer's learned log-prior split into key-only, relative and total terms (GOAT Fig. 1).

``python -m mixlab copy-prior --ckpt runs/copy_mixture/goat/version_0/checkpoints/last.ckpt``

For one attention layer and head (``--layer``, ``--head``; ``--all-heads`` writes one
figure per head) and ``--length`` query/key positions, the figure has four panels (rows:
query position i, columns: key position j):

1. key-only term ``u_h(j)`` (key-linear, SiLU-MLP and first-token bump);
2. relative term ``K_rel(i - j)`` (Fourier modes);
3. total log-prior (sum), masked to the causal triangle;
4. the causal prior ``softmax_j`` of the total - what attention does with no content
   contrast (Theorem 5.1).

Values come from :meth:`mixlab.mixers.positions.GoatPrior.prior_terms` (the formula, not
the lane packing). Works for any checkpoint whose layers use ``position="goat"``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from mixlab.coords import Coords
from mixlab.eval.common import load_model
from mixlab.mixers.positions import GoatPrior

__all__ = ["goat_layers", "prior_panels", "plot_prior", "main"]


def goat_layers(model) -> list[tuple[int, GoatPrior]]:
    """``[(layer index, GoatPrior)]`` of a model's backbone."""
    out = []
    for i, blk in enumerate(model.backbone.blocks):
        pos = getattr(blk.mixer, "pos", None)
        if isinstance(pos, GoatPrior) and type(pos) is GoatPrior:
            out.append((i, pos))
    return out


@torch.no_grad()
def prior_panels(prior: GoatPrior, length: int, head: int) -> dict[str, np.ndarray]:
    """``{"key_only", "relative", "total", "causal_prior"}`` ``[length, length]`` float64 arrays.

    ``total`` has ``-inf`` above the diagonal (causal mask); ``causal_prior`` rows sum to 1.
    """
    c = Coords.seq(length, device=next(iter(prior.buffers()), torch.zeros(0)).device)
    terms = prior.prior_terms(c, c, torch.float64)
    out = {k: terms[k][0, head].cpu().numpy() for k in ("key_only", "relative", "total")}
    mask = np.tril(np.ones((length, length), dtype=bool))
    total = np.where(mask, out["total"], -np.inf)
    z = total - total.max(-1, keepdims=True)
    p = np.exp(z)
    out["total"], out["causal_prior"] = total, p / p.sum(-1, keepdims=True)
    return out


def plot_prior(panels: dict[str, np.ndarray], path: Path, title: str = ""):
    """Save the 2 x 2 figure of :func:`prior_panels`; returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(8.0, 7.0))
    names = [("key_only", "key-only term u(j)"), ("relative", "relative term K_rel(i-j)"),
             ("total", "total log-prior (causal)"), ("causal_prior", "causal prior softmax(total)")]
    for ax, (k, label) in zip(axes.flat, names):
        data = np.ma.masked_invalid(panels[k])
        im = ax.imshow(data, cmap="magma" if k == "causal_prior" else "RdBu_r", interpolation="nearest")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("key position j")
        ax.set_ylabel("query position i")
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig


def main(argv: list[str] | None = None) -> list[Path]:
    """CLI entry (``python -m mixlab copy-prior``); returns the written PNG paths."""
    p = argparse.ArgumentParser(prog="python -m mixlab copy-prior", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--layer", type=int, default=None, help="backbone layer (default: the first goat layer)")
    p.add_argument("--head", type=int, default=0)
    p.add_argument("--all-heads", action="store_true", help="one figure per head of the layer")
    p.add_argument("--length", type=int, default=32, help="positions shown")
    p.add_argument("--out", default=None, help="output folder (default: <ckpt dir>/../prior)")
    args = p.parse_args(argv)
    model = load_model(args.ckpt)
    layers = dict(goat_layers(model))
    if not layers:
        raise ValueError(f"{args.ckpt}: no layer uses the goat position scheme; nothing to plot")
    layer = min(layers) if args.layer is None else args.layer
    if layer not in layers:
        raise ValueError(f"--layer {layer} is not a goat layer; goat layers: {sorted(layers)}")
    prior = layers[layer]
    heads = range(prior.n_heads) if args.all_heads else [args.head]
    out = Path(args.out) if args.out else Path(args.ckpt).resolve().parent.parent / "prior"
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for h in heads:
        if not 0 <= h < prior.n_heads:
            raise ValueError(f"--head {h} out of range (layer {layer} has {prior.n_heads} heads)")
        path = out / f"prior_layer{layer}_head{h}.png"
        plot_prior(prior_panels(prior, args.length, h), path, f"{getattr(model, 'run_name', '')}: layer {layer}, head {h}")
        paths.append(path)
        print(f"wrote {path}")
    return paths
