"""Passkey and NIAH evaluation on a depth x length grid (GOAT Fig. 3).

``python -m mixlab passkey --ckpt X.ckpt --lengths 256 512 1024 --depths 0.1 0.5 0.9``
``python -m mixlab niah --ckpt X.ckpt --haystack essay --text my_prose.txt``

For each length and needle depth, ``--samples`` sequences (seeded by ``--seed`` >= 0) are scored
with teacher forcing (:func:`mixlab.datamodules.retrieval.span_metrics`): span token accuracy
(the reported metric: the fraction of answer characters predicted right), strict accuracy (the
fraction of samples with the whole answer right) and span log-probability (nats per sample). The
model runs chunk by chunk through its caches (``--chunk``, default the training length), so no
``[T, T]`` attention matrix is built; the caches still grow with the length (an attention layer
keeps every key and value), and attention's cost grows with the square of the length. Before
anything is evaluated the memory of each length is estimated
(:func:`mixlab.eval.length.forward_bytes`): a length that needs more than is free on ``--device``
is refused, naming the number, and a long grid is announced with its operation count. Outputs in
``--out``: ``<task>_<haystack>.md`` / ``.csv`` (every cell, all three metrics; lengths in tokens,
depths and accuracies as fractions in [0, 1], log-probabilities in nats),
``<task>_<haystack>_heatmap.png`` (span token accuracy, depth x length) and TensorBoard scalars
under ``tb/<task>_<haystack>`` (a repeated evaluation replaces the earlier event files there).

The checkpoint must be a decoder LM trained on the character-level retrieval data
(``RetrievalDataModule``: ``configs/synthetic/passkey.yaml`` / ``niah.yaml``), whose 75-id
vocabulary the prompts are written in; any other run is refused before anything is written. Bad
option values (a negative ``--seed``, a length or depth given twice, ``--text`` with a haystack other
than ``essay``, an empty or missing ``--text`` file, a ``--device`` this machine lacks, an ``--out``
that is a file or under one) are one-line errors before anything is loaded or written, and a command
that fails leaves ``--out`` as it was (:func:`mixlab.eval.common.undo_on_failure`).
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
    check_device,
    chunked_logits,
    import_class,
    load_run,
    output_problem,
    pyplot,
    refuse_below,
    undo_on_failure,
)
from mixlab.eval.length import check_forward_memory, forward_flops, note_long_run

__all__ = ["evaluate_cell", "plot_heatmap", "main", "passkey_main", "niah_main"]

_RETRIEVAL_HINT = ("{task} needs a decoder LM trained on the character-level retrieval data "
                   "(mixlab.datamodules.retrieval.RetrievalDataModule, e.g. python -m mixlab fit --config "
                   "configs/synthetic/{task}.yaml)")


_PER_TOKEN = 96
"""Bytes per token and sample besides the model's: the haystack, sequence, inputs, targets and span of
:func:`~mixlab.datamodules.retrieval.make_example` and their stacked batch (host), the batch on the device."""


def _check_args(args) -> None:
    """ValueError naming the first option with a bad value (checked before anything is loaded)."""
    refuse_below(("--samples", args.samples, 1), ("--batch-size", args.batch_size, 1), ("--chunk", args.chunk, 0),
                 ("--seed", args.seed, 0))
    bad = [n for n in args.lengths or [] if n < 1]
    if bad:
        raise ValueError(f"--lengths must be >= 1 token each; got {bad[0]}")
    bad = [d for d in args.depths if not (0.0 <= d <= 1.0)]  # NaN fails too
    if bad:
        raise ValueError(f"--depths must be fractions in [0, 1] (of the haystack before the needle); got {bad[0]:g}")
    for option, values in (("--lengths", args.lengths or []), ("--depths", args.depths)):
        twice = next((v for i, v in enumerate(values) if v in values[:i]), None)
        if twice is not None:
            raise ValueError(f"{option} lists {twice:g} twice; give each once (one row or column per value)")
    if args.text is not None and args.haystack is not None and args.haystack != "essay":
        raise ValueError(f"--text is the prose of --haystack essay; with --haystack {args.haystack} it would be "
                         "ignored: drop --text or use --haystack essay")
    if args.text is not None and not str(args.text).strip():
        raise ValueError("--text is empty; give a text file (prose for --haystack essay)")
    check_device(args.device)
    problem = output_problem("--out", args.out, folder=True)
    if problem:
        raise ValueError(problem)


def _essay(args, hp: dict, haystack: str) -> np.ndarray | None:
    """The essay haystack's character ids (None for the other haystacks): ``--text``, else the checkpoint's
    ``essay_path``, else the shipped tinyshakespeare.

    Raises:
        ValueError: ``--text`` given while the haystack (the checkpoint's, no ``--haystack``) is not ``essay``;
            a text that is empty, only white space, or holds no character of the 75-character retrieval alphabet
            (names ``--text`` or the checkpoint's ``essay_path``).
        FileNotFoundError: the ``--text`` file or the checkpoint's ``essay_path`` is not there.
    """
    if haystack != "essay":
        if args.text is not None:
            raise ValueError(f"--text is the prose of --haystack essay; this checkpoint's haystack is {haystack!r} "
                             "(no --haystack given), so it would be ignored: drop --text or add --haystack essay")
        return None
    if args.text is not None:
        path, where, fix = Path(args.text), f"--text {args.text}", "give a text file (prose for --haystack essay)"
    elif hp.get("essay_path") is not None:
        path, where = Path(hp["essay_path"]), f"the checkpoint's essay_path {hp['essay_path']}"
        fix = "pass --text with the prose for --haystack essay"
    else:
        return load_essay(None)
    if not path.is_file():
        raise FileNotFoundError(f"{where}: {'a folder' if path.is_dir() else 'not found'}; {fix}")
    raw = path.read_bytes()
    essay = load_essay(str(path))
    if not raw.strip() or len(essay) == 0:
        why = ("the file is empty" if not raw else "the file holds only white space" if not raw.strip() else
               "it holds no character of the retrieval alphabet (letters, digits, punctuation)")
        raise ValueError(f"{where}: {why}; --haystack essay needs prose")
    return essay


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
    """CLI entry; returns ``{(length, depth): metrics}``.

    Raises:
        ValueError: a bad option value (:func:`_check_args`: below its least value, a length or depth given twice,
            ``--text`` with another haystack or empty, a ``--device`` this machine lacks, an ``--out`` that cannot be
            a folder), before the checkpoint is read; a checkpoint that is no retrieval LM; an essay text that is
            empty or holds no character of the alphabet; a length whose estimated memory is more than is free on
            ``--device`` (:func:`~mixlab.eval.length.check_forward_memory`), past the model's absolute positions or
            too short for the needle and question - all before anything is written.
        FileNotFoundError: the ``--text`` file (or the checkpoint's ``essay_path``) is not there.
    """
    p = OneLineParser(prog=f"python -m mixlab {task}", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--lengths", nargs="+", type=int, default=None,
                   help="context lengths in tokens (default: 1, 2, 4, 8 x the training length)")
    p.add_argument("--depths", nargs="+", type=float, default=[round(0.1 * i, 1) for i in range(1, 10)])
    p.add_argument("--samples", type=int, default=16, help="sequences per cell")
    p.add_argument("--haystack", choices=["noise", "filler", "essay"], default=None,
                   help="default: the checkpoint's training haystack")
    p.add_argument("--text", default=None, help="prose for --haystack essay (default: the checkpoint's essay text, "
                   "else the shipped tinyshakespeare); refused with another haystack")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--chunk", type=int, default=None,
                   help="tokens per cached forward (default: training length; 0: none)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the samples (>= 0)")
    p.add_argument("--out", default=None, help="output folder (default: <ckpt dir>/../retrieval)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    _check_args(args)
    from mixlab.heads.lm import CausalLM

    run = load_run(args.ckpt, args.device, head=CausalLM, hint=_RETRIEVAL_HINT.format(task=task))
    _check_run(run, args.ckpt, task)
    model, hp = run.model, run.data_args
    train_len = int(hp.get("context_length", 256))
    haystack = args.haystack if args.haystack is not None else hp.get("haystack", "noise")
    lengths = args.lengths if args.lengths is not None else [train_len * m for m in (1, 2, 4, 8)]
    essay = _essay(args, hp, haystack)
    chunk = train_len if args.chunk is None else args.chunk
    batch = min(args.batch_size, args.samples)
    abs_pos = getattr(model, "abs_pos", None)
    for length in lengths:  # memory, positions, too short for the needle and question: before anything is written
        check_forward_memory(model, batch, length, chunk, args.device, f"--lengths {length}", _PER_TOKEN)
        if abs_pos is not None and length > abs_pos.num_embeddings:
            raise ValueError(f"--lengths {length}: --ckpt {args.ckpt} has learned absolute positions up to "
                             f"abs_pos_len={abs_pos.num_embeddings} tokens only")
        try:
            make_example(np.random.default_rng(0), task, length, 0.5, haystack, essay)
        except ValueError as err:
            raise ValueError(f"--lengths {length}: {err}") from None
    note_long_run(task, len(args.depths) * args.samples * sum(forward_flops(model, n) for n in lengths), args.device)
    out = Path(args.out) if args.out is not None else Path(args.ckpt).resolve().parent.parent / "retrieval"
    problem = output_problem("--out", out, folder=True)  # the default one (a given --out was checked first)
    if problem:
        raise ValueError(problem)
    with undo_on_failure() as note:
        results, md = _evaluate(model, task, args, lengths, haystack, essay, chunk, train_len, out, note)
    stem = f"{task}_{haystack}"
    print("\n".join(md))
    print(f"wrote {out}/{stem}.md, .csv, {stem}_heatmap.png, tb/")
    return results


def _evaluate(model, task, args, lengths, haystack, essay, chunk, train_len, out: Path, note):
    """:func:`main`'s grid and outputs: ``(results, markdown)``; ``note(folder)`` before each folder is first
    written into (:func:`~mixlab.eval.common.undo_on_failure`); the TensorBoard folder with ``replace=True``: a
    repeated evaluation's scalars replace the earlier ones."""
    note(out).mkdir(parents=True, exist_ok=True)
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(note(out / "tb" / f"{task}_{haystack}", replace=True)))
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
        w.writerow(["length (tokens)", "depth (fraction)", "span_acc (fraction)", "strict_acc (fraction)",
                    "span_logprob (nats per sample)"])
        for (length, depth), m in results.items():
            w.writerow([length, depth, f"{m['span_acc']:.4f}", f"{m['strict_acc']:.4f}", f"{m['span_logprob']:.4f}"])
    md = [f"Span token accuracy (fraction of answer characters right, 0-1; {task}, {haystack} haystack, "
          f"{args.samples} samples per cell; training length {train_len} tokens)", "",
          "| depth (fraction) | " + " | ".join(f"{n} tokens" for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    md += [f"| {d:g} | " + " | ".join(f"{grid[i, j]:.3f}" for j in range(len(lengths))) + " |"
           for i, d in enumerate(args.depths)]
    md += ["| mean | " + " | ".join(f"{grid[:, j].mean():.3f}" for j in range(len(lengths))) + " |"]
    md += ["", "| length (tokens) | strict accuracy (fraction) | span log-prob (nats per sample) |", "|---|---|---|"]
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
