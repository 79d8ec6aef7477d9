"""Resolution-transfer evaluation: top-1 of image classifiers at resolutions they were not trained at.

``python -m mixlab resolution --ckpt A.ckpt B.ckpt --resolutions 224 288 384 448 512 --out runs/resolution``

Each checkpoint (an :class:`~mixlab.heads.vit.ImageClassifier`) is evaluated without fine-tuning at
every resolution: the datamodule stored in the checkpoint is rebuilt with ``eval_size`` set to the
resolution (ImageNet: resize to ``res * 256/224`` then center crop; digits: upsample). A resolution
is ``S`` (square) or ``HxW`` (non-square, e.g. ``224x320``).

Patch coordinates (GOAT, RoPE) follow the checkpoint's ``patch_coords`` (``scaled``: training-grid
units; ``index``: integer patch indices; checkpoints from before the option: ``index``).
``--patch-coords index scaled`` overrides it for a study: each GOAT/RoPE run is then evaluated once
per listed convention, as runs ``<run>-index`` and ``<run>-scaled`` (runs whose scheme reads no
coordinates, e.g. APE, once).

Outputs in ``--out``:

* ``resolution.csv`` - one row per (run, resolution): run, position, patch_coords, train_res, res, top1, top5,
  loss, ckpt;
* ``resolution.md`` - Markdown table of top-1 (%) with one row per run and one column per resolution;
* ``resolution_top1.png`` - top-1 against resolution, one line per run;
* ``prior_<run>_layer<L>.png`` - the learned 2D log-prior of layer ``L`` of each GOAT run (one panel
  per head, query at the grid centre);
* a TensorBoard event file in ``tensorboard/`` (scalars ``resolution/<run>/top1`` stepped by
  resolution, the figures, the Markdown table as text).

For a checkpoint inside a run folder (``.../version_N/checkpoints/x.ckpt``) the scalars
``resolution/<run>/top1`` and ``top5`` also go into that run's ``version_N/resolution/`` (whatever
``--out`` is), where ``python -m mixlab compare`` finds them as the task's ``top-1@<res>px`` columns.
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
import re
from pathlib import Path
from typing import Any

import torch

from mixlab.eval.common import OneLineParser, load_run, pyplot, undo_on_failure

__all__ = ["parse_resolution", "evaluate_resolutions", "render_log_prior", "main"]


def parse_resolution(text: str) -> tuple[int, int]:
    """``"224" -> (224, 224)``, ``"224x320" -> (224, 320)`` (height x width).

    Raises:
        ValueError: anything else.
    """
    m = re.fullmatch(r"\s*(\d+)\s*(?:[xX]\s*(\d+))?\s*", str(text))
    if not m:
        raise ValueError(f"--resolutions entry {text!r}: expected S or HxW (e.g. 224 or 224x320)")
    h = int(m.group(1))
    w = int(m.group(2) or h)
    if h < 1 or w < 1:
        raise ValueError(f"--resolutions entry {text!r}: height and width must be >= 1")
    return h, w


def _resolution_arg(text: str) -> tuple[int, int]:
    try:
        return parse_resolution(text)
    except ValueError as err:  # argparse prints "argument --resolutions: <message>"
        raise argparse.ArgumentTypeError(str(err).removeprefix("--resolutions entry ")) from None


def _res_label(hw: tuple[int, int]) -> str:
    return str(hw[0]) if hw[0] == hw[1] else f"{hw[0]}x{hw[1]}"


def _parse_kv(items: list[str]) -> dict[str, Any]:
    import yaml

    out = {}
    for it in items or []:
        if "=" not in it:
            raise ValueError(f"--data-arg {it!r}: expected key=value")
        k, _, v = it.partition("=")
        out[k.strip()] = yaml.safe_load(v)
    return out


def render_log_prior(model, layer: int, path: Path, grid: tuple[int, int] | None = None, title: str = ""):
    """Save a layer's 2D log-prior (:meth:`MixViT.log_prior_image`) as a PNG; returns the figure."""
    plt = pyplot()
    img = model.log_prior_image(layer, grid).numpy()  # [H, gh, gw]
    qy, qx = img.shape[1] // 2, img.shape[2] // 2  # log_prior_image's default query
    n = img.shape[0]
    cols = min(n, 6)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.2 * cols, 2.2 * rows + 0.4), squeeze=False)
    for h in range(rows * cols):
        ax = axes[h // cols][h % cols]
        ax.axis("off")
        if h < n:
            im = ax.imshow(img[h], cmap="viridis")
            ax.plot([qx], [qy], marker="x", color="red", markersize=6)
            ax.set_title(f"head {h}", fontsize=8)
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.suptitle(title or f"layer {layer} log-prior (query x at centre)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig


def evaluate_resolutions(ckpts: list[str], resolutions: list[tuple[int, int]], out: str | Path,
                         split: str = "val", batch_size: int | None = None, limit_batches: int | float | None = None,
                         prior_layer: int | None = 0, data_args: dict[str, Any] | None = None,
                         accelerator: str = "auto", precision: str | None = None,
                         patch_coords: list[str] | None = None) -> list[dict]:
    """Evaluate each checkpoint at each resolution; write CSV, Markdown, PNG and TensorBoard logs.

    Args:
        ckpts: ImageClassifier checkpoint paths.
        resolutions: ``(H, W)`` pairs (multiples of the patch size; others raise ValueError).
        out: output directory (created).
        split: ``val`` or ``test`` dataloader of the stored datamodule.
        batch_size: override the datamodule's batch size.
        limit_batches: Lightning ``limit_val_batches`` / ``limit_test_batches``.
        prior_layer: render this layer's log-prior for GOAT runs (None: skip).
        data_args: extra datamodule arguments (e.g. ``{"val_path": ...}`` when data moved).
        accelerator / precision: Lightning Trainer settings (precision default: bf16-mixed on CUDA).
        patch_coords: conventions to evaluate GOAT/RoPE runs with (``scaled``, ``index``); None: each
            checkpoint's own. With several, run names get ``-<convention>``.

    Returns:
        the CSV rows (dicts).

    Raises:
        ValueError: a checkpoint that is not an ImageClassifier run, a resolution that is not a multiple of
            a checkpoint's patch size (``--resolutions HxW for <ckpt>: ...``), a bad ``split`` or
            ``patch_coords``; all checked before anything is written. A later failure leaves ``out`` and the
            runs' ``resolution`` folders as they were (:func:`mixlab.eval.common.undo_on_failure`).
    """
    from mixlab.heads.vit import ImageClassifier, check_patch_coords

    if split not in ("val", "test"):
        raise ValueError(f"--split must be 'val' or 'test'; got {split!r}")
    for pc in patch_coords or []:
        check_patch_coords(pc)
    out = Path(out)
    if precision is None:
        precision = "bf16-mixed" if torch.cuda.is_available() and accelerator != "cpu" else "32-true"
    # every checkpoint loaded and every resolution checked before anything is written
    runs = []
    for path in ckpts:
        run = load_run(path, "cpu", head=ImageClassifier,
                       hint="the resolution evaluation needs an ImageClassifier run (e.g. configs/vit/*.yaml)")
        for hw in resolutions:
            try:
                run.model.model.grid(*hw)
            except ValueError as err:
                raise ValueError(f"--resolutions {_res_label(hw)} for {path}: {err}") from None
        runs.append((path, run))
    with undo_on_failure() as note:
        note(out)
        out.mkdir(parents=True, exist_ok=True)
        return _evaluate(runs, resolutions, out, split, batch_size, limit_batches, prior_layer, data_args,
                         accelerator, precision, patch_coords, note)


def _evaluate(runs, resolutions, out, split, batch_size, limit_batches, prior_layer, data_args, accelerator,
              precision, patch_coords, note) -> list[dict]:
    """The body of :func:`evaluate_resolutions` on loaded, checked runs; ``note``: its undo callback."""
    import lightning.pytorch as pl
    from torch.utils.tensorboard import SummaryWriter

    rows: list[dict] = []
    writer = SummaryWriter(str(note(out / "tensorboard")))
    # one Trainer per (run, resolution): Lightning's "GPU available" / tip lines once, not every time
    lightning_info = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    info_level = lightning_info.level
    names_seen: dict[str, int] = {}
    for path, run in runs:
        ck = Path(path).resolve()
        # the run's own folder too (where `mixlab compare` looks), whatever --out is
        run_writer = (SummaryWriter(str(note(ck.parent.parent / "resolution")))
                      if ck.parent.name == "checkpoints" else None)
        model = run.model
        base = model.run_name
        names_seen[base] = names_seen.get(base, 0) + 1
        if names_seen[base] > 1:
            base = f"{base}-{names_seen[base]}"
        train_res = _res_label(model.model.img_size)
        conventions = list(dict.fromkeys(patch_coords or [model.model.patch_coords]))
        if not model.model.reads_patch_coords:
            conventions = [model.model.patch_coords]
        for pc, hw in ((pc, hw) for pc in conventions for hw in resolutions):
            model.model.patch_coords = pc
            name = f"{base}-{pc}" if len(conventions) > 1 else base
            over = {"eval_size": list(hw), **(data_args or {})}
            if batch_size:
                over["batch_size"] = batch_size
            dm = run.datamodule(**over)
            kw = {f"limit_{split}_batches": limit_batches} if limit_batches else {}
            trainer = pl.Trainer(accelerator=accelerator, devices=1, precision=precision, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                 **kw)
            fn = trainer.validate if split == "val" else trainer.test
            metrics = fn(model, datamodule=dm, verbose=False)[0]
            lightning_info.setLevel(max(lightning_info.level, logging.WARNING))
            row = {"run": name, "position": model.position, "patch_coords": pc, "train_res": train_res,
                   "res": _res_label(hw),
                   "height": hw[0], "width": hw[1], "top1": float(metrics[f"{split}/top1"]),
                   "top5": float(metrics[f"{split}/top5"]), "loss": float(metrics[f"{split}/loss"]),
                   "ckpt": str(path)}
            rows.append(row)
            for w in (writer, run_writer) if run_writer is not None else (writer,):
                w.add_scalar(f"resolution/{name}/top1", row["top1"], global_step=hw[0])
                w.add_scalar(f"resolution/{name}/top5", row["top5"], global_step=hw[0])
            print(f"{name:>16s} @ {row['res']:>9s}: top-1 {row['top1']:6.2f}  top-5 {row['top5']:6.2f}  "
                  f"loss {row['loss']:.4f}")
        if prior_layer is not None and model.position == "goat2d":
            try:
                fig = render_log_prior(model.model, prior_layer, out / f"prior_{base}_layer{prior_layer}.png",
                                       title=f"{base}: layer {prior_layer} learned 2D log-prior (query: red x)")
                writer.add_figure(f"prior/{base}/layer{prior_layer}", fig)
            except ValueError as exc:  # a non-GOAT layer in a hybrid pattern
                print(f"{base}: no prior image ({exc})")
        if run_writer is not None:
            run_writer.close()
    lightning_info.setLevel(info_level)
    _write_tables(rows, out, writer)
    writer.close()
    return rows


def _write_tables(rows: list[dict], out: Path, writer) -> None:
    plt = pyplot()
    fields = ["run", "position", "patch_coords", "train_res", "res", "height", "width", "top1", "top5", "loss",
              "ckpt"]
    with open(out / "resolution.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{r[k]:.4f}" if isinstance(r[k], float) else r[k]) for k in fields})
    runs = list(dict.fromkeys(r["run"] for r in rows))
    res = list(dict.fromkeys(r["res"] for r in rows))
    table = {(r["run"], r["res"]): r for r in rows}
    lines = ["| run | train res | " + " | ".join(f"top-1 @ {x}" for x in res) + " |",
             "|---|---|" + "---:|" * len(res)]
    for run in runs:
        tr = next(r["train_res"] for r in rows if r["run"] == run)
        cells = [f"{table[(run, x)]['top1']:.2f}" if (run, x) in table else "" for x in res]
        lines.append(f"| {run} | {tr} | " + " | ".join(cells) + " |")
    md = "\n".join(lines) + "\n"
    (out / "resolution.md").write_text(md)
    print(md)
    writer.add_text("resolution/table", md)
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for run in runs:  # square resolutions as a line (sorted); non-square ones as unconnected crosses
        rr = [r for r in rows if r["run"] == run]
        sq = sorted((r for r in rr if r["height"] == r["width"]), key=lambda r: r["height"])
        line = ax.plot([r["height"] for r in sq], [r["top1"] for r in sq], marker="o", label=run)[0]
        ns = [r for r in rr if r["height"] != r["width"]]
        if ns:
            ax.scatter([math.sqrt(r["height"] * r["width"]) for r in ns], [r["top1"] for r in ns], marker="x",
                       color=line.get_color(), label=f"{run} (non-square, at sqrt(HW))")
    ax.set_xlabel("eval resolution (pixels)")
    ax.set_ylabel("top-1 (%)")
    ax.set_title("Resolution transfer (no fine-tuning)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "resolution_top1.png", dpi=120)
    writer.add_figure("resolution/top1", fig)


def main(argv: list[str] | None = None) -> list[dict]:
    """``python -m mixlab resolution --ckpt ... --resolutions 224 288 384`` (see module docstring)."""
    p = OneLineParser(prog="python -m mixlab resolution", description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ckpt", nargs="+", required=True, help="ImageClassifier checkpoints (one per run)")
    p.add_argument("--resolutions", nargs="+", required=True, type=_resolution_arg,
                   help="S or HxW, multiples of the patch size")
    p.add_argument("--out", default="runs/resolution", help="output directory")
    p.add_argument("--split", default="val", choices=["val", "test"])
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--limit-batches", type=float, default=None, help="Lightning limit_*_batches (int if >= 1)")
    p.add_argument("--prior-layer", type=int, default=0, help="layer whose log-prior is rendered (-1: none)")
    p.add_argument("--data-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="override a stored datamodule argument (e.g. val_path=/data/val-{000..063}.tar)")
    p.add_argument("--patch-coords", nargs="+", default=None, choices=["scaled", "index"],
                   help="patch coordinates of GOAT/RoPE runs (default: each checkpoint's own); several: one run each")
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--precision", default=None)
    a = p.parse_args(argv)
    lim = a.limit_batches
    if lim is not None and lim >= 1:
        lim = int(lim)
    return evaluate_resolutions(a.ckpt, a.resolutions, a.out, a.split, a.batch_size,
                                lim, None if a.prior_layer < 0 else a.prior_layer, _parse_kv(a.data_arg),
                                a.accelerator, a.precision, a.patch_coords)


if __name__ == "__main__":
    main()
