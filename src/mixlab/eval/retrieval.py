"""Passkey and NIAH evaluation on a depth x length grid (GOAT Fig. 3).

``python -m mixlab passkey --ckpt X.ckpt --lengths 256 512 1024 --depths 0.1 0.5 0.9``
``python -m mixlab niah --ckpt X.ckpt --haystack essay --text my_prose.txt``

For each length and needle depth, ``--samples`` sequences (seeded) are scored with
teacher forcing (:func:`mixlab.datamodules.retrieval.span_metrics`): span token accuracy
(the reported metric), strict accuracy (whole answer right) and span log-probability
(nats). The model runs chunk by chunk through its caches (``--chunk``, default the
training length), so long contexts stay memory-safe. Outputs in ``--out``:
``<task>_<haystack>.md`` / ``.csv`` (every cell, all three metrics),
``<task>_<haystack>_heatmap.png`` (span token accuracy, depth x length) and TensorBoard
scalars under ``tb/``.

The checkpoint must be a decoder LM trained on the character-level retrieval data
(``RetrievalDataModule``: ``configs/synthetic/passkey.yaml`` / ``niah.yaml``), whose 75-id
vocabulary the prompts are written in; any other run is refused before anything is written. Bad
option values are one-line errors, and a command that fails leaves ``--out`` as it was
(:func:`mixlab.eval.common.undo_on_failure`).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np
import torch

from mixlab.datamodules.retrieval import CHARS, RetrievalDataModule, load_essay, make_example, span_metrics
from mixlab.eval.common import (
    OneLineParser,
    chunked_logits,
    import_class,
    load_run,
    pyplot,
    refuse_below,
    undo_on_failure,
)

__all__ = ["evaluate_cell", "plot_heatmap", "main", "passkey_main", "niah_main"]

_RETRIEVAL_HINT = ("{task} needs a decoder LM trained on the character-level retrieval data "
                   "(mixlab.datamodules.retrieval.RetrievalDataModule, e.g. python -m mixlab fit --config "
                   "configs/synthetic/{task}.yaml)")


def _check_args(args) -> None:
    """ValueError naming the first option with a bad value."""
    refuse_below(("--samples", args.samples, 1), ("--batch-size", args.batch_size, 1), ("--chunk", args.chunk, 0))
    bad = [n for n in args.lengths or [] if n < 1]
    if bad:
        raise ValueError(f"--lengths must be >= 1 token each; got {bad[0]}")
    bad = [d for d in args.depths if not (0.0 <= d <= 1.0)]  # NaN fails too
    if bad:
        raise ValueError(f"--depths must be fractions in [0, 1] (of the haystack before the needle); got {bad[0]:g}")


def _check_run(run, ckpt: str, task: str) -> None:
    """ValueError unless ``run`` is a decoder LM trained on :class:`RetrievalDataModule` data."""
    hint = _RETRIEVAL_HINT.format(task=task)
    data = import_class(run.data) if run.data else None
    if data is None or not (isinstance(data, type) and issubclass(data, RetrievalDataModule)):
        what = f"a {data.__name__} run" if data is not None else "a run with no recorded datamodule"
        raise ValueError(f"--ckpt {ckpt}: {what}; {hint}")
    if getattr(run.model, "decoder", "lm") != "lm" or getattr(run.model, "vocab_size", len(CHARS)) != len(CHARS):
        raise ValueError(f"--ckpt {ckpt}: a {run.head} with decoder={getattr(run.model, 'decoder', 'lm')!r} and "
                         f"vocab_size={run.model.vocab_size}; {hint} (decoder 'lm', vocab_size {len(CHARS)})")


@torch.no_grad()
def evaluate_cell(model, task: str, length: int, depth: float, samples: int, haystack: str = "noise",
                  essay: np.ndarray | None = None, batch_size: int = 8, chunk: int | None = None,
                  seed: int = 0, device: str | torch.device = "cpu") -> dict[str, float]:
    """Span metrics of ``samples`` sequences at one (length, depth) cell.

    Returns ``{"span_acc", "strict_acc", "span_logprob"}`` (fractions; nats per sample).
    """
    sums: dict[str, list[float]] = {}
    for b0 in range(0, samples, batch_size):
        exs = [make_example(np.random.default_rng([seed, length, int(round(depth * 1000)), i]), task, length, depth,
                            haystack, essay) for i in range(b0, min(samples, b0 + batch_size))]
        inp = torch.as_tensor(np.stack([e["inputs"] for e in exs]), device=device)
        tgt = torch.as_tensor(np.stack([e["eval_targets"] for e in exs]), device=device)
        span = torch.as_tensor(np.stack([e["span"] for e in exs]), device=device)
        lo = int(span.any(0).nonzero().min())  # the span is at the end: keep only those logits
        kept = []
        for s, logits in chunked_logits(model, inp, chunk):
            c = logits.shape[1]
            if s + c > lo:
                kept.append(logits[:, max(0, lo - s):])
        logits = torch.cat(kept, dim=1)
        for k, (s, n) in span_metrics(logits, tgt[:, lo:], span[:, lo:]).items():
            acc = sums.setdefault(k, [0.0, 0.0])
            acc[0] += float(s)
            acc[1] += float(n)
    return {k: s / max(n, 1.0) for k, (s, n) in sums.items()}


def plot_heatmap(grid: np.ndarray, depths: list[float], lengths: list[int], path: Path, title: str):
    """Save a depth x length heatmap of ``grid [len(depths), len(lengths)]`` in [0, 1]."""
    fig, ax = pyplot().subplots(figsize=(1.0 + 0.9 * len(lengths), 1.0 + 0.45 * len(depths)))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="upper")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=7,
                    color="white" if grid[i, j] < 0.5 else "black")
    fig.colorbar(im, ax=ax, label="span token accuracy")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return fig


def main(argv: list[str] | None = None, task: str = "passkey") -> dict:
    """CLI entry; returns ``{(length, depth): metrics}``."""
    p = OneLineParser(prog=f"python -m mixlab {task}", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--lengths", nargs="+", type=int, default=None,
                   help="context lengths in tokens (default: 1, 2, 4, 8 x the training length)")
    p.add_argument("--depths", nargs="+", type=float, default=[round(0.1 * i, 1) for i in range(1, 10)])
    p.add_argument("--samples", type=int, default=16, help="sequences per cell")
    p.add_argument("--haystack", choices=["noise", "filler", "essay"], default=None,
                   help="default: the checkpoint's training haystack")
    p.add_argument("--text", default=None, help="prose for --haystack essay (default: shipped tinyshakespeare)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--chunk", type=int, default=None,
                   help="tokens per cached forward (default: training length; 0: none)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="output folder (default: <ckpt dir>/../retrieval)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    _check_args(args)
    from mixlab.heads.lm import CausalLM

    run = load_run(args.ckpt, args.device, head=CausalLM, hint=_RETRIEVAL_HINT.format(task=task))
    _check_run(run, args.ckpt, task)
    model, hp = run.model, run.data_args
    train_len = int(hp.get("context_length", 256))
    haystack = args.haystack or hp.get("haystack", "noise")
    lengths = args.lengths or [train_len * m for m in (1, 2, 4, 8)]
    essay = load_essay(args.text or hp.get("essay_path")) if haystack == "essay" else None
    for length in lengths:  # too short for the needle and question: before anything is written
        try:
            make_example(np.random.default_rng(0), task, length, 0.5, haystack, essay)
        except ValueError as err:
            raise ValueError(f"--lengths {length}: {err}") from None
    chunk = train_len if args.chunk is None else args.chunk
    out = Path(args.out) if args.out else Path(args.ckpt).resolve().parent.parent / "retrieval"
    with undo_on_failure() as note:
        results, md = _evaluate(model, task, args, lengths, haystack, essay, chunk, train_len, out, note)
    stem = f"{task}_{haystack}"
    print("\n".join(md))
    print(f"wrote {out}/{stem}.md, .csv, {stem}_heatmap.png, tb/")
    return results


def _evaluate(model, task, args, lengths, haystack, essay, chunk, train_len, out: Path, note):
    """:func:`main`'s grid and outputs: ``(results, markdown)``; ``note(folder)`` before each folder is first
    written into (:func:`~mixlab.eval.common.undo_on_failure`)."""
    note(out).mkdir(parents=True, exist_ok=True)
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(note(out / "tb" / f"{task}_{haystack}")))
    try:
        return _grid(model, task, args, lengths, haystack, essay, chunk, train_len, out, writer)
    finally:
        writer.close()


def _grid(model, task, args, lengths, haystack, essay, chunk, train_len, out: Path, writer):
    results: dict[tuple[int, float], dict[str, float]] = {}
    grid = np.zeros((len(args.depths), len(lengths)))
    for j, length in enumerate(lengths):
        for i, depth in enumerate(args.depths):
            m = evaluate_cell(model, task, length, depth, args.samples, haystack, essay, args.batch_size, chunk,
                              args.seed, args.device)
            results[(length, depth)] = m
            grid[i, j] = m["span_acc"]
            for k, v in m.items():
                writer.add_scalar(f"{task}/{k}/depth_{depth:g}", v, length)
        writer.add_scalar(f"{task}/span_acc_mean", float(grid[:, j].mean()), length)
        print(f"{task} length {length}: span_acc by depth " + " ".join(f"{v:.2f}" for v in grid[:, j]))
    stem = f"{task}_{haystack}"
    with open(out / f"{stem}.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["length", "depth", "span_acc", "strict_acc", "span_logprob"])
        for (length, depth), m in results.items():
            w.writerow([length, depth, f"{m['span_acc']:.4f}", f"{m['strict_acc']:.4f}", f"{m['span_logprob']:.4f}"])
    md = [f"Span token accuracy ({task}, {haystack} haystack, {args.samples} samples per cell; "
          f"training length {train_len})", "", "| depth | " + " | ".join(str(n) for n in lengths) + " |",
          "|---|" + "---|" * len(lengths)]
    md += [f"| {d:g} | " + " | ".join(f"{grid[i, j]:.3f}" for j in range(len(lengths))) + " |"
           for i, d in enumerate(args.depths)]
    md += ["| mean | " + " | ".join(f"{grid[:, j].mean():.3f}" for j in range(len(lengths))) + " |"]
    md += ["", "| length | strict acc | span log-prob (nats) |", "|---|---|---|"]
    md += [f"| {n} | {np.mean([results[(n, d)]['strict_acc'] for d in args.depths]):.3f} | "
           f"{np.mean([results[(n, d)]['span_logprob'] for d in args.depths]):.3f} |" for n in lengths]
    (out / f"{stem}.md").write_text("\n".join(md) + "\n")
    fig = plot_heatmap(grid, args.depths, lengths, out / f"{stem}_heatmap.png",
                       f"{task} ({haystack}): {getattr(model, 'run_name', '')}")
    writer.add_figure(f"{task}/heatmap", fig)
    return results, md


def passkey_main(argv: list[str] | None = None) -> dict:
    """``python -m mixlab passkey``."""
    return main(argv, "passkey")


def niah_main(argv: list[str] | None = None) -> dict:
    """``python -m mixlab niah``."""
    return main(argv, "niah")
