"""Length extrapolation of a decoder LM: perplexity at multiples of the training length.

``python -m mixlab length-extrapolation --ckpt A.ckpt [B.ckpt ...] --lengths 1 2 4 8``

For each checkpoint and each multiple ``m`` the validation stream of the checkpoint's
datamodule (or ``--data-path``) is cut into non-overlapping windows of ``m * L_train + 1``
tokens (at most ``--max-windows``). The model is run with teacher forcing, chunk by
chunk through its caches (``--chunk`` tokens at a time, exact for attention), so memory
stays bounded at long lengths. Outputs in ``--out``:

* ``length_extrapolation.md`` / ``.csv``: perplexity (``exp`` of the mean NLL, nats/token)
  per model and length;
* ``position_nll.png``: mean NLL at every position of the longest windows (moving average
  over ``--smooth`` positions), log-x, training length marked (MesaNet Fig. 3 style);
* ``position_nll.csv``: the raw per-position curves;
* TensorBoard scalars ``length/ppl`` and ``length/loss`` (step = length in tokens) and
  ``position_nll/len_<L>`` (step = position) in the checkpoint's run folder
  (``version_N/length_extrapolation/tb``, where ``mixlab compare`` finds them; ``tb/<label>``
  under ``--out`` for checkpoints outside a run folder), and the figure in ``tb/``.

A command that fails leaves these folders as they were: arguments are checked before anything is
written, and an error later (a checkpoint that is not a text LM, a length its data is too short for,
an error during the evaluation) removes the event files and outputs it wrote and the folders it
created (:func:`mixlab.eval.common.undo_on_failure`).
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from mixlab.eval.common import OneLineParser, Run, chunked_logits, import_class, load_run, pyplot, undo_on_failure

__all__ = ["position_nll", "length_table", "plot_position_nll", "main"]


@torch.no_grad()
def position_nll(model, windows: Dataset, batch_size: int = 4, chunk: int | None = None,
                 device: str | torch.device = "cpu") -> tuple[np.ndarray, int]:
    """Summed next-token NLL per position over all windows.

    Args:
        model: a :class:`~mixlab.heads.CausalLM` (``forward(tokens, coords, caches)``).
        windows: dataset of ``LongTensor [L + 1]`` token windows.
        batch_size: windows per forward.
        chunk: tokens per cached forward (``None``/0: one plain forward).

    Returns:
        ``(nll_sum [L] float64 in nats, number of windows)``; mean NLL at position ``t``
        (predicting token ``t + 1`` from tokens ``0..t``) is ``nll_sum[t] / n``.
    """
    total, n = None, 0
    for batch in DataLoader(windows, batch_size=batch_size, shuffle=False):
        batch = batch.to(device)
        inp, tgt = batch[:, :-1], batch[:, 1:]
        out = torch.zeros(inp.shape[1], dtype=torch.float64, device=device)
        for s, logits in chunked_logits(model, inp, chunk):
            c = logits.shape[1]
            nll = F.cross_entropy(logits.float().flatten(0, 1), tgt[:, s:s + c].flatten(), reduction="none")
            out[s:s + c] += nll.view(-1, c).double().sum(0)
        total = out if total is None else total + out
        n += batch.shape[0]
    if total is None:
        raise ValueError("position_nll: the window dataset is empty")
    return total.cpu().numpy(), n


def length_table(results: dict[str, dict[int, float]], train_length: dict[str, int]) -> tuple[str, list[list[str]]]:
    """Markdown table and CSV rows of perplexities ``results[label][length]``."""
    lengths = sorted({length for r in results.values() for length in r})
    head = ["model", "train_len"] + [str(length) for length in lengths]
    rows = [head]
    for label, r in results.items():
        rows.append([label, str(train_length[label])]
                    + [f"{r[length]:.3f}" if length in r else "" for length in lengths])
    md = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    md += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    return "\n".join(md) + "\n", rows


def plot_position_nll(curves: dict[str, np.ndarray], train_length: dict[str, int], path: Path, smooth: int = 16):
    """Save the position-wise NLL figure (one curve per model); returns the matplotlib figure."""
    fig, ax = pyplot().subplots(figsize=(6.4, 4.0))
    for label, curve in curves.items():
        k = max(1, min(smooth, len(curve)))
        sm = np.convolve(curve, np.ones(k) / k, mode="valid")
        ax.plot(np.arange(len(sm)) + 1 + (k - 1) / 2, sm, label=label, lw=1.2)
    for length in sorted(set(train_length.values())):
        ax.axvline(length, color="gray", ls="--", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("token position")
    ax.set_ylabel("NLL (nats/token)")
    ax.set_title("Position-wise NLL (dashed: training length)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return fig


def _datamodule(run: Run, args):
    cls = import_class(run.data or "mixlab.datamodules.text.TextDataModule")
    if not hasattr(cls, "windows"):  # checked on the class: --data-path/--tokenizer are text options
        raise ValueError(f"--ckpt {run.path}: a {cls.__name__} run; length extrapolation evaluates decoder LMs "
                         "trained on text (TextDataModule or a datamodule with a windows(split, length) method)")
    over = {}
    if args.data_path is not None:
        over["path"], over["tokens_dir"] = args.data_path, None
    if args.tokenizer is not None:
        over["tokenizer"] = args.tokenizer
    return run.datamodule(default="mixlab.datamodules.text.TextDataModule", **over), \
        int(run.data_args.get("context_length", 0))


def _windows(dm, args, m: float, length: int) -> Dataset:
    """The ``--max-windows`` windows of ``length + 1`` tokens for multiple ``m``; ValueError naming
    ``--lengths`` when the split is too short for one."""
    try:
        return dm.windows(args.split, length + 1, max_windows=args.max_windows)
    except ValueError as err:
        raise ValueError(f"--lengths {m:g} ({length} tokens): {err}") from None


def main(argv: list[str] | None = None) -> dict:
    """CLI entry (``python -m mixlab length-extrapolation``); returns ``{label: {length: ppl}}``.

    Bad option values are argparse errors (exit status 2) before anything is read or written. Raises
    ValueError / OSError for a checkpoint that cannot be read or is not a decoder LM on text, a missing
    training length, or a ``--lengths`` multiple whose windows the split is too short for (each checked
    before that checkpoint's TensorBoard writer is created); any error leaves ``--out`` and the runs'
    ``length_extrapolation`` folders as they were (:func:`~mixlab.eval.common.undo_on_failure`).
    """
    p = OneLineParser(prog="python -m mixlab length-extrapolation", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", nargs="+", required=True, help="checkpoint(s) to compare")
    p.add_argument("--labels", nargs="*", default=None, help="row labels (default: the model run names)")
    p.add_argument("--lengths", nargs="+", type=float, default=[1, 2, 4, 8], help="multiples of the training length")
    p.add_argument("--train-length", type=int, default=None, help="override the training length (tokens)")
    p.add_argument("--max-windows", type=int, default=16, help="windows per length")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--chunk", type=int, default=None,
                   help="tokens per cached forward (default: training length; 0: none)")
    p.add_argument("--data-path", default=None, help="evaluate on these documents instead of the checkpoint's")
    p.add_argument("--tokenizer", default=None, help="override the checkpoint datamodule's tokenizer")
    p.add_argument("--split", choices=["val", "test", "train"], default="val",
                   help="text split to cut the windows from (TextDataModule: test is the same data as val)")
    p.add_argument("--smooth", type=int, default=16, help="moving-average width of the NLL curve")
    p.add_argument("--out", default=None, help="output folder (default: <ckpt dir>/../length_extrapolation)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    for name, bad in (("--chunk", args.chunk is not None and args.chunk < 0),
                      ("--lengths", any(m <= 0 for m in args.lengths)), ("--max-windows", args.max_windows < 1),
                      ("--batch-size", args.batch_size < 1), ("--train-length", (args.train_length or 2) < 2)):
        if bad:
            value = {"--chunk": args.chunk, "--lengths": args.lengths, "--max-windows": args.max_windows,
                     "--batch-size": args.batch_size, "--train-length": args.train_length}[name]
            p.error(f"{name} must be {'>= 0 (0: no chunking)' if name == '--chunk' else 'positive'}"
                    f"{' (>= 2 tokens)' if name == '--train-length' else ''}; got {value}")
    if args.labels and len(args.labels) != len(args.ckpt):
        p.error(f"--labels has {len(args.labels)} entries for {len(args.ckpt)} --ckpt")
    out = Path(args.out) if args.out else Path(args.ckpt[0]).resolve().parent.parent / "length_extrapolation"
    with undo_on_failure() as note:
        results, md = _evaluate(args, out, note)
    print(md)
    print(f"wrote {out}/length_extrapolation.md, .csv, position_nll.png, tb/")
    return results


def _evaluate(args, out: Path, note) -> tuple[dict[str, dict[int, float]], str]:
    """:func:`main`'s evaluation and outputs: ``(results, markdown table)``; ``note(folder)`` is called before
    each folder is first written into (:func:`~mixlab.eval.common.undo_on_failure`)."""
    from torch.utils.tensorboard import SummaryWriter

    results: dict[str, dict[int, float]] = {}
    curves: dict[str, np.ndarray] = {}
    train_len: dict[str, int] = {}
    for i, ckpt in enumerate(args.ckpt):
        run = load_run(ckpt, args.device)
        model = run.model
        dm, l_train = _datamodule(run, args)
        l_train = args.train_length or l_train
        if l_train <= 0:
            raise ValueError(f"{ckpt}: no context_length in the checkpoint's datamodule; pass --train-length")
        lengths = [(m, int(round(m * l_train))) for m in args.lengths]
        windows = [_windows(dm, args, m, length) for m, length in lengths]  # a too short split: before the writer
        label = args.labels[i] if args.labels else getattr(model, "run_name", Path(ckpt).stem)
        if label in results:
            label = f"{label}-{i}"
        train_len[label], results[label] = l_train, {}
        ck = Path(ckpt).resolve()
        # scalars go into the checkpoint's own run folder (where `mixlab compare` looks), whatever --out is
        in_run = ck.parent.name == "checkpoints"
        tb_dir = ck.parent.parent / "length_extrapolation" / "tb" if in_run else out / "tb" / label
        writer = SummaryWriter(str(note(tb_dir)))
        try:
            for (m, length), ds in zip(lengths, windows):
                chunk = l_train if args.chunk is None else args.chunk
                nll, n = position_nll(model, ds, args.batch_size, chunk, args.device)
                loss = float(nll.sum() / (n * length))
                results[label][length] = math.exp(min(loss, 80.0))
                curves[label] = nll / n
                writer.add_scalar("length/ppl", results[label][length], length)
                writer.add_scalar("length/loss", loss, length)
                for t in range(length):
                    writer.add_scalar(f"position_nll/len_{length}", float(nll[t] / n), t + 1)
                print(f"{label}: length {length} ({m:g}x, {n} windows): loss {loss:.4f} "
                      f"ppl {results[label][length]:.3f}")
        finally:
            writer.close()
    md, rows = length_table(results, train_len)
    note(out).mkdir(parents=True, exist_ok=True)
    (out / "length_extrapolation.md").write_text(md)
    with open(out / "length_extrapolation.csv", "w", newline="") as fh:
        csv.writer(fh).writerows(rows)
    with open(out / "position_nll.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["model", "position", "nll"])
        for label, c in curves.items():
            w.writerows([label, t + 1, f"{v:.6f}"] for t, v in enumerate(c))
    fig = plot_position_nll(curves, train_len, out / "position_nll.png", args.smooth)
    writer = SummaryWriter(str(note(out / "tb")))
    try:
        writer.add_figure("position_nll", fig)
    finally:
        writer.close()
    return results, md
