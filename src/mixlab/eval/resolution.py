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

* ``resolution.csv`` - one row per (run, resolution): run, position, patch_coords, train_res, res, height, width,
  top1 and top5 (%), loss, split, limit_batches (empty: all batches), ckpt;
* ``resolution.md`` - Markdown table of top-1 (%) with one row per run and one column per resolution, under a
  line naming the protocol (split, batches, ``--data-arg``);
* ``resolution_top1.png`` - top-1 against resolution, one line per run;
* ``prior_<run>_layer<L>.png`` - the learned 2D log-prior of layer ``L`` of each GOAT run (one panel
  per head, query at the grid centre);
* a TensorBoard event file in ``tensorboard/`` (scalars ``resolution/<run>/top1`` and ``top5`` stepped by
  the resolution of square sizes, ``resolution/<run>/top1_width<W>`` stepped by the height of non-square ones,
  the figures, the Markdown table as text).

For a checkpoint inside a run folder (``.../version_N/checkpoints/x.ckpt``) the results of the standard
protocol also go into that run's ``version_N/resolution/`` (whatever ``--out`` is) as scalars
``resolution/<run>/top1`` and ``top5`` stepped by the resolution, where ``python -m mixlab compare`` finds
them as the task's ``top-1@<res>px (%)`` columns. The standard protocol: the whole val split (``--split val``,
no ``--limit-batches``, no ``--data-arg``), square sizes, the checkpoint's own ``patch_coords``;
``--batch-size``, ``--accelerator`` and ``--precision`` are free. Anything else is written into ``--out`` only,
and one line says why it was not recorded in the run folder (e.g. ``not recorded in <run>/resolution for
compare: --split test``). A new evaluation replaces the run folder's earlier event files: the resolutions it
evaluates get the new values, the others keep their earlier values (copied into the new file), so compare and
TensorBoard show one value per resolution. One checkpoint per run folder is recorded per call (the first). An
``--out`` inside a run folder (below ``<task>/<mixer>/``, which compare reads whole) is refused when it would
hold off-protocol numbers or another run's.

Checked before anything is evaluated (one-line ``ValueError`` naming the option, ``error: ...`` with exit status
2 from the CLI): the checkpoints, each resolution (a multiple of the patch size, and one batch of it must fit
in the memory free on the device: images and two ``[B, T, D]`` activations, ``T`` the tokens per image), the
``--out`` folder, ``--batch-size >= 1``, ``--limit-batches`` (a fraction in (0, 1) or a whole count >= 1), the
``--data-arg`` keys (those the datamodule takes), ``--accelerator`` (known and present), ``--precision`` (a
value Lightning takes), ``--prior-layer`` (a layer of each GOAT run, or -1). Ctrl-C during an evaluation (which
Lightning's trainer turns into ``sys.exit(1)``) is raised again as KeyboardInterrupt: ``python -m mixlab
resolution`` then puts ``--out`` and the run folders back as they were and exits 130.
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

__all__ = ["parse_resolution", "evaluate_resolutions", "check_trainer_options", "check_fits", "render_log_prior",
           "main"]


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


_ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps", "tpu")


def check_trainer_options(accelerator: str, precision: str | None) -> None:
    """Refuse an ``--accelerator`` Lightning does not know or this machine lacks, and a ``--precision`` that is
    not one of Lightning's values (``32-true``, ``bf16-mixed``, ``16``, ...; None: the default), or ``16-mixed``
    on the CPU (Lightning would run bf16-mixed).

    Raises:
        ValueError: one line naming the option, the value and the values it takes.
    """
    from typing import get_args

    from lightning.fabric.connector import _PRECISION_INPUT_STR, _PRECISION_INPUT_STR_ALIAS
    from lightning.pytorch.accelerators import AcceleratorRegistry

    known = list(dict.fromkeys([*_ACCELERATORS, *sorted(AcceleratorRegistry.available_accelerators())]))
    if accelerator not in known:
        raise ValueError(f"--accelerator {accelerator!r} is not an accelerator Lightning knows; use one of "
                         f"{', '.join(known)}")
    if accelerator == "gpu":
        if not any(AcceleratorRegistry[a]["accelerator"].is_available() for a in ("cuda", "mps")
                   if a in AcceleratorRegistry):
            raise ValueError("--accelerator gpu: this machine has no GPU (neither CUDA nor MPS is available); use "
                             "--accelerator cpu (or auto)")
    elif accelerator != "auto" and not AcceleratorRegistry[accelerator]["accelerator"].is_available():
        raise ValueError(f"--accelerator {accelerator}: not available on this machine; use --accelerator cpu "
                         f"(or auto)")
    values = [*get_args(_PRECISION_INPUT_STR), *get_args(_PRECISION_INPUT_STR_ALIAS)]
    if precision is not None and str(precision) not in values:
        raise ValueError(f"--precision {precision!r} is not a Lightning precision; use one of {', '.join(values)}")
    import warnings

    import lightning.pytorch as pl

    info = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    level = info.level
    info.setLevel(logging.WARNING)  # the evaluation's own first Trainer says "GPU available ..." once
    try:  # a combination Lightning refuses (or a precision whose package is missing), before any evaluation
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = pl.Trainer(accelerator=accelerator, devices=1, precision=precision, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    except Exception as err:
        why = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"--accelerator {accelerator} --precision {precision}: Lightning refuses them ({why})") \
            from None
    finally:
        info.setLevel(level)
    from mixlab.cli import float16_on_cpu

    float16 = float16_on_cpu(precision, type(trainer.accelerator).__name__ == "CPUAccelerator")
    if float16:
        raise ValueError(f"--precision {float16}")


def _eval_device(accelerator: str) -> torch.device:
    """The device whose free memory one batch must fit in: CUDA for ``gpu``/``cuda`` (``auto``: when present), else
    the host (``cpu``; ``mps`` shares the host's memory)."""
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def check_fits(model, hw: tuple[int, int], batch: int, device: torch.device, precision: str) -> int:
    """Bytes that one batch of ``batch`` images of ``hw = (H, W)`` pixels needs at least: the float32 images
    ``[B, C, H, W]`` and two ``[B, T, D]`` activations (the residual stream and one layer's output, 2 bytes an
    element under 16-bit precision, else 4 or 8), ``T`` the tokens per image (patches + prefix); a lower bound
    (attention and the datamodule's own buffers come on top), checked against the memory free on ``device``
    (:func:`mixlab.eval.common.free_bytes`) before anything is evaluated.

    Raises:
        ValueError: more than is free; the message names ``--resolutions``, the tokens and the sizes.
    """
    from mixlab.eval.common import free_bytes

    vit = model.model
    gh, gw = vit.grid(*hw)
    tokens = gh * gw + vit.num_prefix_tokens
    act = 2 if "16" in str(precision) else 8 if "64" in str(precision) else 4
    chans = vit.patch_embed.proj.in_channels
    need = batch * (chans * hw[0] * hw[1] * 4 + 2 * tokens * vit.embed_dim * act)
    free = free_bytes(device)
    if need > free:
        prefix = f" + {vit.num_prefix_tokens} [CLS]" if vit.num_prefix_tokens else ""
        raise ValueError(f"--resolutions {_res_label(hw)}: {tokens:,} tokens per image ({gh}x{gw} patches of "
                         f"{vit.patch_size} px{prefix}); one batch of {batch} needs at least {need / 2**30:,.1f} GiB "
                         f"(images and two [B, T, {vit.embed_dim}] activations), more than the {free / 2**30:,.1f} "
                         f"GiB free on {device.type}; give smaller resolutions or a smaller --batch-size")
    return need


PEAK_FLOPS = {"cuda": 1e15, "cpu": 1e13}
"""Generous FLOP/s of a device (an H200's dense bf16 peak is about 1e15), for :func:`slow_warning`'s lower bound."""


def slow_warning(model, hw: tuple[int, int], batch: int, device: torch.device,
                 limit_batches: int | float | None) -> str | None:
    """A warning line when one batch of ``batch`` images of ``hw`` pixels cannot take less than a minute: the
    attention's two ``T x T`` products alone, ``4 T^2 D L`` FLOP per image (``T`` tokens, width ``D``, ``L``
    layers), at the device's :data:`PEAK_FLOPS`. Memory does not stop such a run (flash attention's memory is linear
    in ``T``: the 24 px digits model at 8192 px, 4.2M tokens an image, fits an H200 and runs for hours); else None.
    """
    vit = model.model
    gh, gw = vit.grid(*hw)
    tokens = gh * gw + vit.num_prefix_tokens
    per_image = 4 * tokens**2 * vit.embed_dim * len(vit.backbone.blocks)
    peak = PEAK_FLOPS.get(device.type, PEAK_FLOPS["cpu"])
    seconds = per_image * batch / peak
    if seconds < 60:
        return None
    took = f"{seconds / 3600:,.1f} hours" if seconds >= 3600 else f"{seconds / 60:,.0f} minutes"
    which = ("every batch of the split" if limit_batches is None or limit_batches == 1.0 and
             isinstance(limit_batches, float) else f"{limit_batches:g} of the split's batches" if limit_batches < 1
             else f"{int(limit_batches)} batch(es)")
    return (f"warning: --resolutions {_res_label(hw)}: {tokens:,} tokens per image; attention alone is "
            f"{per_image:.1e} FLOP per image, at least {took} per batch of {batch} at {device.type}'s peak "
            f"({peak:.0e} FLOP/s), for {which} (--limit-batches and "
            f"--batch-size bound it)")


def _check_data_args(run, data_args: dict[str, Any]) -> None:
    """Refuse ``--data-arg`` keys the run's datamodule does not take (and ``eval_size``, set by ``--resolutions``)."""
    import inspect

    from mixlab.eval.common import import_class
    from mixlab.registry import did_you_mean

    if not data_args:
        return
    if "eval_size" in data_args:
        raise ValueError("--data-arg eval_size: the evaluation size is set by --resolutions")
    if run.data is None:
        return  # run.datamodule names --ckpt in its own error
    cls = import_class(run.data)
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    takes = [n for n, p in params.items() if n != "self" and p.kind is not inspect.Parameter.VAR_POSITIONAL]
    unknown = [k for k in data_args if k not in takes]
    if unknown:
        raise ValueError(f"--data-arg {unknown[0]}: {cls.__name__} takes no argument {unknown[0]!r} (it takes "
                         f"{', '.join(takes)}){did_you_mean(unknown[:1], takes)}")


def _check_limit(limit_batches: int | float | None) -> None:
    """``None``, a fraction in (0, 1) or a whole count >= 1 (an ``int``, or ``1.0`` = all batches as in Lightning)."""
    if limit_batches is None:
        return
    if not limit_batches > 0 or not math.isfinite(limit_batches) or (
            limit_batches > 1 and limit_batches != int(limit_batches)):
        raise ValueError(f"--limit-batches must be a fraction of the batches in (0, 1) or a whole count >= 1; "
                         f"got {limit_batches:g}")


def _protocol(split: str, limit_batches: int | float | None, data_args: dict[str, Any] | None) -> list[str]:
    """Why a call's results are not the standard protocol's (the whole val split, the stored data); [] when they are."""
    why = [] if split == "val" else [f"--split {split}"]
    if limit_batches is not None and not (isinstance(limit_batches, float) and limit_batches == 1.0):
        why.append(f"--limit-batches {limit_batches}")
    why += [f"--data-arg {k}" for k in data_args or {}]
    return why


def _off_protocol(call: list[str], hw: tuple[int, int], pc: str, own_pc: str) -> list[str]:
    """``call`` plus why one (resolution, convention) is off the standard protocol: non-square, another convention."""
    why = list(call)
    if hw[0] != hw[1]:
        why.append(f"{_res_label(hw)} (non-square)")
    if pc != own_pc:
        why.append(f"--patch-coords {pc} (the checkpoint's own: {own_pc})")
    return why


def _run_folder(path: str | Path) -> Path | None:
    """``version_N`` of a checkpoint in a run folder (``.../version_N/checkpoints/x.ckpt``), else None."""
    ck = Path(path).resolve()
    return ck.parent.parent if ck.parent.name == "checkpoints" else None


def _check_out_place(out: Path, runs: list, reasons: dict[str, list[str]]) -> None:
    """Refuse an ``--out`` below a run's ``<task>/<mixer>/`` (compare reads every event file there) when it would hold
    off-protocol numbers (``reasons``: ``{ckpt: [why]}``) or another run's."""
    here = out.absolute().resolve()
    version = next((d for d in [here, *here.parents] if re.fullmatch(r"version_\d+", d.name)), None)
    if version is None:
        return
    off = sorted({w for why in reasons.values() for w in why})
    if off:
        raise ValueError(f"--out {out} is inside the run folder {version}, where compare would read these numbers "
                         f"({', '.join(off)}) as that run's top-1@<res>px; give a folder outside the runs "
                         f"(e.g. runs/resolution)")
    other = next((p for p, _ in runs if (_run_folder(p) or Path("/")).parent != version.parent), None)
    if other is not None:
        raise ValueError(f"--out {out} is inside the run folder {version}, where compare would read the results of "
                         f"--ckpt {other} (another run) as that run's; give a folder outside the runs "
                         f"(e.g. runs/resolution)")


def evaluate_resolutions(ckpts: list[str], resolutions: list[tuple[int, int]], out: str | Path,
                         split: str = "val", batch_size: int | None = None, limit_batches: int | float | None = None,
                         prior_layer: int | None = 0, data_args: dict[str, Any] | None = None,
                         accelerator: str = "auto", precision: str | None = None,
                         patch_coords: list[str] | None = None) -> list[dict]:
    """Evaluate each checkpoint at each resolution; write CSV, Markdown, PNG and TensorBoard logs.

    Args:
        ckpts: ImageClassifier checkpoint paths.
        resolutions: ``(H, W)`` pairs in pixels (multiples of the patch size; others raise ValueError).
        out: output directory (created).
        split: ``val`` or ``test`` dataloader of the stored datamodule.
        batch_size: override the datamodule's batch size (>= 1; None: the stored one).
        limit_batches: Lightning ``limit_val_batches`` / ``limit_test_batches``: a fraction in (0, 1) or a
            whole count >= 1 of batches (None: all).
        prior_layer: render this layer's log-prior for GOAT runs (None: skip).
        data_args: extra datamodule arguments (e.g. ``{"val_path": ...}`` when data moved).
        accelerator / precision: Lightning Trainer settings (precision default: bf16-mixed on CUDA).
        patch_coords: conventions to evaluate GOAT/RoPE runs with (``scaled``, ``index``); None: each
            checkpoint's own. With several, run names get ``-<convention>``.

    Returns:
        the CSV rows (dicts; ``top1``/``top5`` in %).

    Raises:
        ValueError: a checkpoint that is not an ImageClassifier run, a resolution that is not a multiple of
            a checkpoint's patch size (``--resolutions HxW for <ckpt>: ...``) or whose one batch cannot fit in
            the device's free memory (:func:`check_fits`), a bad ``split``, ``patch_coords``, ``batch_size``,
            ``limit_batches``, ``prior_layer`` (past a GOAT run's layers), ``data_args`` key, ``accelerator`` or
            ``precision``, an ``out`` that is (or is under) a file or is a run folder that would mislead compare;
            all checked before anything is written or evaluated (one line naming the option). A later failure,
            Ctrl-C included (KeyboardInterrupt), leaves ``out`` and the runs' ``resolution`` folders as they were
            (:func:`mixlab.eval.common.undo_on_failure`).
    """
    from mixlab.eval.common import output_problem, refuse_below
    from mixlab.heads.vit import ImageClassifier, check_patch_coords

    if split not in ("val", "test"):
        raise ValueError(f"--split must be 'val' or 'test'; got {split!r}")
    for pc in patch_coords or []:
        check_patch_coords(pc)
    refuse_below(("--batch-size", batch_size, 1), ("--prior-layer", prior_layer, 0))
    _check_limit(limit_batches)
    problem = output_problem("--out", out, folder=True)
    if problem:
        raise ValueError(problem)
    check_trainer_options(accelerator, precision)
    out = Path(out)
    if precision is None:
        precision = "bf16-mixed" if torch.cuda.is_available() and accelerator != "cpu" else "32-true"
    device = _eval_device(accelerator)
    call = _protocol(split, limit_batches, data_args)
    # every checkpoint loaded and every resolution checked before anything is written
    runs, reasons = [], {}
    for path in ckpts:
        run = load_run(path, "cpu", head=ImageClassifier,
                       hint="the resolution evaluation needs an ImageClassifier run (e.g. configs/vit/*.yaml)")
        vit = run.model.model
        batch = int(batch_size or run.data_args.get("batch_size") or 1)
        for hw in resolutions:
            try:
                vit.grid(*hw)
            except ValueError as err:
                raise ValueError(f"--resolutions {_res_label(hw)} for {path}: {err}") from None
            check_fits(run.model, hw, batch, device, precision)
            slow = slow_warning(run.model, hw, batch, device, limit_batches)
            if slow:
                print(slow, flush=True)
        n_layers = len(vit.backbone.blocks)
        if prior_layer is not None and run.model.position == "goat2d" and prior_layer >= n_layers:
            raise ValueError(f"--prior-layer {prior_layer}: --ckpt {path} has {n_layers} layers (0..{n_layers - 1}); "
                             f"-1 renders none")
        _check_data_args(run, data_args)
        from mixlab.cli import split_deciders

        moved = [f"{k}={data_args[k]!r} (the run's: {run.data_args.get(k)!r})" for k in split_deciders(run.data)
                 if k in (data_args or {}) and data_args[k] != run.data_args.get(k)]
        if moved:
            print(f"warning: --data-arg {', '.join(moved)} for {path}: the data is split otherwise than in the "
                  f"checkpoint's run; the evaluated {split} split could hold images it was trained on")
        try:  # the datamodule as the evaluation builds it (not set up): a value it refuses, here
            run.datamodule(eval_size=list(resolutions[0]), **(data_args or {}),
                           **({} if batch_size is None else {"batch_size": batch_size}))
        except (TypeError, ValueError) as err:
            if not data_args:
                raise
            raise ValueError(f"--data-arg {', '.join(f'{k}={v!r}' for k, v in data_args.items())}: "
                             f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
        own = vit.patch_coords
        conventions = [own] if not vit.reads_patch_coords else list(dict.fromkeys(patch_coords or [own]))
        reasons[str(path)] = sorted({w for pc in conventions for hw in resolutions
                                     for w in _off_protocol(call, hw, pc, own)}) if _run_folder(path) else []
        runs.append((path, run))
    _check_out_place(out, runs, reasons)
    with undo_on_failure() as note:
        note(out)
        out.mkdir(parents=True, exist_ok=True)
        return _evaluate(runs, resolutions, out, split, batch_size, limit_batches, prior_layer, data_args,
                         accelerator, precision, patch_coords, note)


def _run_trainer(fn, *args: Any, **kwargs: Any) -> Any:
    """``trainer.validate`` / ``trainer.test`` (``fn``) whose Ctrl-C stays a KeyboardInterrupt.

    Lightning's trainer catches KeyboardInterrupt, ignores SIGINT from then on and calls ``sys.exit(1)``; an
    interrupted trainer (``trainer.interrupted``) raises KeyboardInterrupt again instead, with the SIGINT handler
    it had before, so that :func:`mixlab.cli._run_command` undoes the outputs, says so and exits 130."""
    import signal
    import threading

    trainer = fn.__self__
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if main_thread else None
    try:
        return fn(*args, **kwargs)
    except SystemExit:
        if not trainer.interrupted:
            raise
        if main_thread and previous is not None:
            signal.signal(signal.SIGINT, previous)
        raise KeyboardInterrupt from None


class _RunRecord:
    """The standard-protocol scalars of one run folder, ``version_N/resolution/`` (what compare reads).

    Created on the first value (so an off-protocol call leaves the folder untouched): reads the values that the
    folder's earlier event files hold (the ``resolution/*/top1`` / ``top5`` tags compare reads: the first in sorted
    order, the latest value per step), then writes a new event file, noted with ``replace=True`` so that the
    earlier files go once the command succeeds; :meth:`close` copies the earlier values of the resolutions this
    call did not evaluate into it (with their wall times)."""

    def __init__(self, folder: Path, name: str, note) -> None:
        self.folder, self.name, self.note = folder, name, note
        self.writer = None
        self.steps: list[int] = []
        self.earlier: dict[str, dict[int, tuple[float, float]]] = {}

    def add(self, row: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter

        if self.writer is None:
            self.earlier = _earlier_values(self.folder)
            self.writer = SummaryWriter(str(self.note(self.folder, replace=True)))
        for key in ("top1", "top5"):
            self.writer.add_scalar(f"resolution/{self.name}/{key}", row[key], global_step=row["height"])
        self.steps.append(row["height"])

    def close(self) -> list[int]:
        """Copy the earlier values of the other resolutions, close; returns those resolutions (px)."""
        if self.writer is None:
            return []
        kept = sorted({s for values in self.earlier.values() for s in values} - set(self.steps))
        for key, values in self.earlier.items():
            for step in kept:
                if step in values:
                    wall, value = values[step]
                    self.writer.add_scalar(f"resolution/{self.name}/{key}", value, global_step=step, walltime=wall)
        self.writer.close()
        return kept


def _earlier_values(folder: Path) -> dict[str, dict[int, tuple[float, float]]]:
    """``{"top1"|"top5": {resolution: (wall_time, value)}}`` of the event files below ``folder`` (none: empty), read
    as compare reads them (:func:`mixlab.eval.compare.load_scalars`: the first matching tag, the latest per step)."""
    from mixlab.eval.compare import _find_tag, load_scalars

    if not folder.is_dir():
        return {}
    scalars = load_scalars(folder)
    found: dict[str, dict[int, tuple[float, float]]] = {}
    for key in ("top1", "top5"):
        tag = _find_tag(scalars, f"resolution/*/{key}")
        if tag is not None:
            found[key] = {step: (wall, value) for wall, step, value in scalars[tag]}  # sorted: the latest wins
    return found


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
    call = _protocol(split, limit_batches, data_args)
    recorded: dict[Path, str] = {}  # run folder -> the --ckpt recorded there by this call
    records: list[_RunRecord] = []
    limit = "" if limit_batches is None else str(limit_batches)
    try:
        for path, run in runs:
            model = run.model
            base = model.run_name
            names_seen[base] = names_seen.get(base, 0) + 1
            if names_seen[base] > 1:
                base = f"{base}-{names_seen[base]}"
            own_pc = model.model.patch_coords
            train_res = _res_label(model.model.img_size)
            conventions = list(dict.fromkeys(patch_coords or [own_pc]))
            if not model.model.reads_patch_coords:
                conventions = [own_pc]
            # the run's own folder too (where `mixlab compare` looks), whatever --out is: the standard protocol only
            version = _run_folder(path)
            record, skipped = None, []
            if version is not None and version in recorded:
                skipped = [f"--ckpt {recorded[version]} of the same run is recorded there by this call"]
            elif version is not None:
                record = _RunRecord(version / "resolution", model.run_name, note)
                records.append(record)
                recorded[version] = str(path)
            for pc, hw in ((pc, hw) for pc in conventions for hw in resolutions):
                model.model.patch_coords = pc
                name = f"{base}-{pc}" if len(conventions) > 1 else base
                over = {"eval_size": list(hw), **(data_args or {})}
                if batch_size is not None:
                    over["batch_size"] = batch_size
                dm = run.datamodule(**over)
                kw = {f"limit_{split}_batches": limit_batches} if limit_batches is not None else {}
                trainer = pl.Trainer(accelerator=accelerator, devices=1, precision=precision, logger=False,
                                     enable_checkpointing=False, enable_progress_bar=False,
                                     enable_model_summary=False, **kw)
                fn = trainer.validate if split == "val" else trainer.test
                metrics = _run_trainer(fn, model, datamodule=dm, verbose=False)[0]
                lightning_info.setLevel(max(lightning_info.level, logging.WARNING))
                row = {"run": name, "position": model.position, "patch_coords": pc, "train_res": train_res,
                       "res": _res_label(hw), "height": hw[0], "width": hw[1],
                       "top1": float(metrics[f"{split}/top1"]), "top5": float(metrics[f"{split}/top5"]),
                       "loss": float(metrics[f"{split}/loss"]), "split": split, "limit_batches": limit,
                       "ckpt": str(path)}
                rows.append(row)
                if hw[0] == hw[1]:
                    writer.add_scalar(f"resolution/{name}/top1", row["top1"], global_step=hw[0])
                    writer.add_scalar(f"resolution/{name}/top5", row["top5"], global_step=hw[0])
                else:  # its own tag: at step = height it would stand for the square size of that height
                    writer.add_scalar(f"resolution/{name}/top1_width{hw[1]}", row["top1"], global_step=hw[0])
                why = _off_protocol(call, hw, pc, own_pc)
                if record is not None and not why:
                    record.add(row)
                elif record is not None:
                    skipped += [w for w in why if w not in skipped]
                print(f"{name:>16s} @ {row['res']:>9s}: top-1 {row['top1']:6.2f} %  top-5 {row['top5']:6.2f} %  "
                      f"loss {row['loss']:.4f}")
            model.model.patch_coords = own_pc
            if prior_layer is not None and model.position == "goat2d":
                try:
                    fig = render_log_prior(model.model, prior_layer, out / f"prior_{base}_layer{prior_layer}.png",
                                           title=f"{base}: layer {prior_layer} learned 2D log-prior (query: red x)")
                    writer.add_figure(f"prior/{base}/layer{prior_layer}", fig)
                except ValueError as exc:  # a non-GOAT layer in a hybrid pattern
                    print(f"{base}: no prior image ({exc})")
            if version is not None:
                kept = record.close() if record is not None else []
                if record is not None and record.steps:
                    print(f"{base}: top-1 at {', '.join(map(str, record.steps))} px recorded in {version}/resolution "
                          f"for compare" + (f" (kept from before: {', '.join(map(str, kept))} px)" if kept else ""))
                if skipped:
                    print(f"{base}: not recorded in {version}/resolution for compare: {', '.join(skipped)}")
        _write_tables(rows, out, writer, call)
    finally:  # on failure too: an open writer's thread would flush into the folders the undo removes
        lightning_info.setLevel(info_level)
        writer.close()
        for record in records:
            if record.writer is not None:
                record.writer.close()
    return rows


def _write_tables(rows: list[dict], out: Path, writer, call: list[str] | None = None) -> None:
    """``resolution.csv``, ``resolution.md`` (top-1 in %, under a line naming the protocol: split, batches and the
    off-protocol options ``call``) and ``resolution_top1.png`` in ``out``; the table and figure also to ``writer``."""
    plt = pyplot()
    fields = ["run", "position", "patch_coords", "train_res", "res", "height", "width", "top1", "top5", "loss",
              "split", "limit_batches", "ckpt"]
    with open(out / "resolution.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{r[k]:.4f}" if isinstance(r[k], float) else r.get(k, "")) for k in fields})
    runs = list(dict.fromkeys(r["run"] for r in rows))
    res = list(dict.fromkeys(r["res"] for r in rows))
    table = {(r["run"], r["res"]): r for r in rows}
    split = rows[0]["split"] if rows and "split" in rows[0] else "val"
    limit = rows[0].get("limit_batches", "") if rows else ""
    batches = ("all batches" if limit in ("", "1.0") else
               "the first batch" if limit == "1" else f"the first {limit} batches" if float(limit) >= 1 else
               f"a fraction {limit} of the batches")
    extra = [c for c in call or [] if c.startswith("--data-arg")]
    lines = [f"top-1 (%) without fine-tuning: {split} split, {batches}" + (f", {', '.join(extra)}" if extra else "")
             + "; columns: evaluation resolution in px (HxW: height x width)", "",
             "| run | train res (px) | " + " | ".join(f"top-1 @ {x} px (%)" for x in res) + " |",
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
    ax.set_title(f"Resolution transfer (no fine-tuning, {split} split)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "resolution_top1.png", dpi=120)
    writer.add_figure("resolution/top1", fig)


def main(argv: list[str] | None = None) -> list[dict]:
    """``python -m mixlab resolution --ckpt ... --resolutions 224 288 384`` (see module docstring).

    Raises:
        ValueError: bad input (:func:`evaluate_resolutions`; a ``--limit-batches`` or ``--prior-layer`` out of
            range), before anything is evaluated; the CLI prints it as one ``error:`` line (exit status 2).
    """
    p = OneLineParser(prog="python -m mixlab resolution", description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ckpt", nargs="+", required=True, help="ImageClassifier checkpoints (one per run)")
    p.add_argument("--resolutions", nargs="+", required=True, type=_resolution_arg,
                   help="S or HxW in pixels, multiples of the patch size")
    p.add_argument("--out", default="runs/resolution", help="output folder")
    p.add_argument("--split", default="val", choices=["val", "test"],
                   help="dataloader evaluated (only val results are recorded in the run folders for compare)")
    p.add_argument("--batch-size", type=int, default=None, help="images per batch, >= 1 (None: the stored one)")
    p.add_argument("--limit-batches", type=float, default=None,
                   help="evaluate part of the split: a fraction of its batches in (0, 1), or a whole count >= 1 "
                        "(1 = one batch); None: all. Limited results are not recorded in the run folders")
    p.add_argument("--prior-layer", type=int, default=0, help="layer whose log-prior is rendered (-1: none)")
    p.add_argument("--data-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="override a stored datamodule argument (e.g. val_path=/data/val-{000..063}.tar)")
    p.add_argument("--patch-coords", nargs="+", default=None, choices=["scaled", "index"],
                   help="patch coordinates of GOAT/RoPE runs (default: each checkpoint's own); several: one run each")
    p.add_argument("--accelerator", default="auto", help="Lightning accelerator: auto, cpu, gpu, cuda, mps, tpu")
    p.add_argument("--precision", default=None,
                   help="Lightning precision, e.g. 32-true, bf16-mixed, 16-mixed (None: bf16-mixed on CUDA, "
                        "else 32-true)")
    a = p.parse_args(argv)
    from mixlab.eval.common import refuse_below

    refuse_below(("--prior-layer", a.prior_layer, -1))
    lim = a.limit_batches
    _check_limit(lim)
    if lim is not None and lim >= 1:
        lim = int(lim)  # a count: Lightning reads 1.0 as all batches, 1 as one
    return evaluate_resolutions(a.ckpt, a.resolutions, a.out, a.split, a.batch_size,
                                lim, None if a.prior_layer < 0 else a.prior_layer, _parse_kv(a.data_arg),
                                a.accelerator, a.precision, a.patch_coords)

if __name__ == "__main__":
    main()
