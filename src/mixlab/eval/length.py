"""Length extrapolation of a decoder LM: perplexity at multiples of the training length.

``python -m mixlab length-extrapolation --ckpt A.ckpt [B.ckpt ...] --lengths 1 2 4 8``

For each checkpoint and each multiple ``m`` the validation stream of the checkpoint's
datamodule (or ``--data-path``) is cut into non-overlapping windows of ``m * L_train + 1``
tokens (at most ``--max-windows``). The model is run with teacher forcing, chunk by
chunk through its caches (``--chunk`` tokens at a time, exact for attention), so no
``[T, T]`` attention matrix is built; the caches still grow with the length (an attention
layer keeps every key and value). Before anything is evaluated the memory of each length is
estimated (:func:`forward_bytes`) and a length that needs more than is free on ``--device`` is
refused, naming the number; a long evaluation (attention's cost grows with the square of the
length) is announced with its operation count. Outputs in ``--out``:

* ``length_extrapolation.md`` / ``.csv``: perplexity (``exp`` of the mean next-token NLL in
  nats/token; lower is better) per model and length (the CSV's length columns are named by the
  length in tokens and hold perplexities);
* ``position_nll.png``: mean NLL at every position of the longest windows (moving average
  over ``--smooth`` positions, at most half the positions), log-x, training length marked
  (MesaNet Fig. 3 style);
* ``position_nll.csv``: the raw per-position curves (nats/token);
* TensorBoard scalars ``length/ppl`` and ``length/loss`` (step = length in tokens) and
  ``position_nll/len_<L>`` (step = position) and the figure in ``tb/``.

Where the scalars go. The standard protocol - the checkpoint's own data: no ``--data-path``, no
``--tokenizer``, the default ``--split val`` - writes them into the checkpoint's run folder
(``version_N/length_extrapolation/tb``, where ``mixlab compare`` reads them as the task's
``PPL@<len>`` columns), replacing the scalars of an earlier evaluation there; checkpoints outside
a run folder write ``tb/<label>`` under ``--out``. Any other call measures other data, so it writes
only into ``--out`` and says so in one line; its default ``--out`` is outside the run folder that
``compare`` reads (``<runs>/length_extrapolation/<task>_<run>_<version>_<what differs>`` for a
checkpoint in ``<runs>/<task>/<run>/version_N/``), and an ``--out`` inside that folder is refused.
A repeated evaluation into the same ``tb/`` folders replaces the scalars of the lengths it measures again and keeps
the other lengths' (its event file carries them over; the earlier files are removed).

A command that fails leaves these folders as they were: arguments are checked before anything is
written (option values, ``--out``, ``--device``, ``--data-path``; per checkpoint its kind, the
tokenizer's vocabulary, the lengths' memory and windows), and an error later (a second checkpoint
that is not a text LM, an error during the evaluation) removes the event files and outputs it wrote
and the folders it created (:func:`mixlab.eval.common.undo_on_failure`).
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from mixlab.eval.common import (
    OneLineParser,
    Run,
    check_device,
    chunked_logits,
    import_class,
    load_run,
    output_problem,
    pyplot,
    undo_on_failure,
)

__all__ = ["position_nll", "length_table", "plot_position_nll", "forward_bytes", "forward_flops",
           "check_forward_memory", "note_long_run", "main"]

_PER_TOKEN = 48
"""Bytes per token and window besides the model's: the collated int64 batch on the host and on the device and the
float64 position sums (:func:`position_nll`)."""


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


# ---------------------------------------------------------------------------------------------- memory and time
def _cache_bytes(mixer, batch: int, length: int, dtype: torch.dtype, d_model: int) -> int:
    """Bytes of one layer's cache after ``length`` tokens of ``batch`` sequences: the mixer's
    :meth:`~mixlab.mixers.base.Mixer.static_cache_bytes` (keys and values of SDPA attention, the fixed states of
    the recurrent mixers); for an attention layer without one (``impl="reference"``, ``swa``, ``mla``) keys and
    values of width ``d_model`` (``swa``: of its window only)."""
    n = int(mixer.static_cache_bytes(batch, length, dtype))
    if n:
        return n
    from mixlab.mixers.base import AttentionMixer

    if isinstance(mixer, AttentionMixer) or "attention" in type(mixer).__name__.lower():
        keep = min(length, int(getattr(mixer, "window", None) or length))
        return 2 * batch * keep * d_model * torch.empty(0, dtype=dtype).element_size()
    return 0


def forward_bytes(model, batch: int, length: int, chunk: int | None, per_token: int = 0) -> int:
    """Estimated peak bytes of a teacher-forced forward of ``batch`` sequences of ``length`` tokens through
    :func:`~mixlab.eval.common.chunked_logits` with ``chunk`` (``None``/0 or ``>= length``: one plain forward).

    Counts every layer's cache after ``length`` tokens (:func:`_cache_bytes`, twice: growing it by
    concatenation copies it, and freed blocks stay with the allocator), the cached key coordinates, the
    ``[chunk, length]`` causal mask of a cached chunk (bool and float), the ``[B, H, chunk, length]``
    probabilities of ``impl="reference"`` attention, one chunk's float32 logits with their cross-entropy and its
    activations, and ``per_token`` bytes per token and sequence (the caller's own inputs and targets). An estimate:
    for the shipped passkey config (goat, d_model 64) on a CPU, with retrieval's ``per_token``, it came within 10%
    of the peak resident memory measured at 16,384 tokens, batch 1 and 2 (it does not model a CUDA kernel's
    workspace).
    """
    p = next(model.parameters())
    dtype = p.dtype
    cfg = model.backbone.cfg
    d, blocks = int(cfg.d_model), model.backbone.blocks
    vocab = int(getattr(model, "vocab_size", 0) or 0)
    c = length if not chunk or chunk >= length else chunk
    need = 0
    for blk in blocks:
        need += 2 * _cache_bytes(blk.mixer, batch, length, dtype, d) + 32 * length
        if getattr(blk.mixer, "impl", None) == "reference":
            need += 3 * 4 * batch * int(getattr(blk.mixer, "n_heads", 1)) * c * length
    if c < length:
        need += 5 * c * length
    need += int(batch * c * (3 * 4 * vocab + (8 + 3 * float(getattr(cfg, "mlp_ratio", 4.0))) * d * p.element_size()))
    return int(need + batch * length * per_token)


def forward_flops(model, length: int) -> float:
    """Approximate floating-point operations of one teacher-forced forward of ``length`` tokens: ``2 x`` the
    parameters per token, plus ``2 * d_model * length * keys`` for every layer whose cache grows with the length
    (attention: ``keys = length``, ``swa`` its window; causal QK and PV)."""
    dtype = next(model.parameters()).dtype
    d = int(model.backbone.cfg.d_model)
    flops = 2.0 * sum(p.numel() for p in model.parameters()) * length
    for blk in model.backbone.blocks:
        m = blk.mixer
        if _cache_bytes(m, 1, 2, dtype, d) > _cache_bytes(m, 1, 1, dtype, d):
            flops += 2.0 * d * length * min(length, int(getattr(m, "window", None) or length))
    return flops


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"


def check_forward_memory(model, batch: int, length: int, chunk: int | None, device: str | torch.device,
                         what: str, per_token: int = 0) -> int:
    """Refuse an evaluation whose :func:`forward_bytes` is more than the memory free on ``device``
    (:func:`mixlab.eval.common.free_bytes`: CUDA's free bytes, the host's ``MemAvailable``), before anything is
    allocated; returns the estimate (bytes).

    Raises:
        ValueError: ``"<what>: the evaluation needs about N GiB ..., more than the M GiB free on <device>; lower
            --lengths [or --batch-size ...]"``, one line (``what`` names the option and value, e.g.
            ``"--lengths 8 (1024 tokens)"``).
    """
    from mixlab.eval.common import free_bytes

    need = forward_bytes(model, batch, length, chunk, per_token)
    free = free_bytes(device)
    if need <= free:
        return need
    ways = ["lower --lengths"]
    one = forward_bytes(model, 1, length, chunk, per_token)
    if batch > 1 and one <= free:
        ways.append(f"--batch-size (1 sequence at a time: about {_gib(one)})")
    raise ValueError(f"{what}: the evaluation needs about {_gib(need)} ({batch} sequence(s) of {length} tokens: "
                     f"caches, activations and logits of the chunked forward), more than the {_gib(free)} free on "
                     f"{device}; {' or '.join(ways)}")


def _duration(seconds: float) -> str:
    for unit, size in (("days", 86400), ("hours", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def note_long_run(command: str, flops: float, device: str | torch.device) -> bool:
    """Say on stderr (one line) that an evaluation of ``flops`` floating-point operations takes long: above 1e12 on
    a CPU, 1e15 on a GPU, with the time at a nominal pace (1e10 operations/s on a CPU, 1e13 on a GPU: a guide, not
    a measurement). Returns whether it said so."""
    pace = 1e13 if torch.device(device).type == "cuda" else 1e10
    if flops <= 100 * pace:
        return False
    print(f"note: {command}: about {flops:.2g} floating-point operations in all (attention's share grows with the "
          f"square of the length): expect a long run (some {_duration(flops / pace)} at {pace:.0e} operations/s)",
          file=sys.stderr)
    return True


# ------------------------------------------------------------------------------------------------ outputs
def length_table(results: dict[str, dict[int, float]], train_length: dict[str, int]) -> tuple[str, list[list[str]]]:
    """Markdown table and CSV rows of perplexities ``results[label][length]`` (length in tokens).

    The Markdown table has a caption and the columns ``model``, ``train length (tokens)``, ``PPL@<length>``; the
    CSV rows ``model``, ``train_len (tokens)`` and one column per length named by the length in tokens (what
    :mod:`mixlab.eval.reproduce` reads), holding perplexities (3 decimals; empty where not measured).
    """
    lengths = sorted({length for r in results.values() for length in r})
    head = ["model", "train_len (tokens)"] + [str(length) for length in lengths]
    rows = [head]
    for label, r in results.items():
        rows.append([label, str(train_length[label])]
                    + [f"{r[length]:.3f}" if length in r else "" for length in lengths])
    md_head = ["model", "train length (tokens)"] + [f"PPL@{length}" for length in lengths]
    md = ["Perplexity (exp of the mean next-token NLL in nats/token; lower is better) at each evaluation length "
          "(PPL@<tokens>)", "", "| " + " | ".join(md_head) + " |", "|" + "---|" * len(md_head)]
    md += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    return "\n".join(md) + "\n", rows


def smoothing_width(smooth: int, positions: int) -> int:
    """The moving-average width :func:`plot_position_nll` uses for a curve of ``positions`` points: ``smooth``,
    at most half the positions (rounded up), so that the smoothed curve keeps at least half of them."""
    return max(1, min(smooth, (positions + 1) // 2))


def plot_position_nll(curves: dict[str, np.ndarray], train_length: dict[str, int], path: Path, smooth: int = 16):
    """Save the position-wise NLL figure (one curve per model, moving average over
    :func:`smoothing_width` positions); returns the matplotlib figure."""
    fig, ax = pyplot().subplots(figsize=(6.4, 4.0))
    for label, curve in curves.items():
        k = smoothing_width(smooth, len(curve))
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


# ------------------------------------------------------------------------------------------------ data
def _datamodule(run: Run, args):
    """The checkpoint's datamodule with ``--data-path`` / ``--tokenizer`` applied and its documents read, and its
    ``context_length`` (0 when it records none).

    Raises:
        ValueError: not a text datamodule; ``--data-path`` that holds no readable text; a ``--tokenizer`` whose
            ids do not fit the model's vocabulary (each naming the option).
    """
    cls = import_class(run.data or "mixlab.datamodules.text.TextDataModule")
    if not hasattr(cls, "windows"):  # checked on the class: --data-path/--tokenizer are text options
        raise ValueError(f"--ckpt {run.path}: a {cls.__name__} run; length extrapolation evaluates decoder LMs "
                         "trained on text (TextDataModule or a datamodule with a windows(split, length) method)")
    over, given = {}, []
    if args.data_path is not None:
        over["path"], over["tokens_dir"] = args.data_path, None
        given.append(f"--data-path {args.data_path}")
    if args.tokenizer is not None:
        over["tokenizer"] = args.tokenizer
        given.append(f"--tokenizer {args.tokenizer}")
    try:
        dm = run.datamodule(default="mixlab.datamodules.text.TextDataModule", **over)
        if args.data_path is not None and hasattr(dm, "token_splits"):
            dm.token_splits()  # read now: an unreadable or empty file is named before any length
    except (ValueError, OSError) as err:
        if not given:
            raise
        why = str(err)
        if why.startswith(f"{args.data_path}:"):  # "<file>: file is empty"
            why = why[len(str(args.data_path)) + 1:].strip()
        raise ValueError(f"{', '.join(given)}: {why}") from None
    vocab, model_vocab = getattr(dm, "vocab_size", None), getattr(run.model, "vocab_size", None)
    if args.tokenizer is not None and vocab is not None and model_vocab is not None and vocab > model_vocab:
        raise ValueError(f"--tokenizer {args.tokenizer}: its {vocab} token ids do not fit the {model_vocab}-token "
                         f"vocabulary of --ckpt {run.path} (trained with tokenizer "
                         f"{run.data_args.get('tokenizer', 'gpt2')!r})")
    return dm, int(run.data_args.get("context_length", 0))


def _windows(dm, args, m: float, length: int) -> Dataset:
    """The ``--max-windows`` windows of ``length + 1`` tokens for multiple ``m``; ValueError naming
    ``--lengths`` when the split is too short for one."""
    try:
        return dm.windows(args.split, length + 1, max_windows=args.max_windows)
    except ValueError as err:
        why = re.sub(r"\s*\(lower data\.init_args\.context_length or add data\)", "", str(err))
        more = ("give --data-path a longer text" if args.data_path is not None
                else "evaluate a longer text with --data-path")
        raise ValueError(f"--lengths {m:g} ({length} tokens): {why} (lower --lengths, or {more})") from None


def _token_lengths(multiples: list[float], l_train: int, ckpt: str, model) -> list[tuple[float, int]]:
    """``[(multiple, tokens)]`` of ``--lengths`` at training length ``l_train``.

    Raises:
        ValueError: a multiple of 0 tokens; two multiples of the same token count; a length past the model's
            learned absolute positions (``abs_pos_len``).
    """
    out: list[tuple[float, int]] = []
    for m in multiples:
        length = int(round(m * l_train))
        if length < 1:
            raise ValueError(f"--lengths {m:g}: {length} tokens at the training length {l_train} of --ckpt {ckpt}; "
                             "give multiples of at least one token")
        same = next((a for a, n in out if n == length), None)
        if same is not None:
            raise ValueError(f"--lengths {same:g} and {m:g} are both {length} tokens at the training length "
                             f"{l_train} of --ckpt {ckpt}; give each length once")
        out.append((m, length))
    abs_pos = getattr(model, "abs_pos", None)
    longest = max(out, key=lambda x: x[1])
    if abs_pos is not None and longest[1] > abs_pos.num_embeddings:
        raise ValueError(f"--lengths {longest[0]:g} ({longest[1]} tokens): --ckpt {ckpt} has learned absolute "
                         f"positions up to abs_pos_len={abs_pos.num_embeddings} tokens only")
    return out


# ------------------------------------------------------------------------------------------------ folders
def _compare_tree(ckpt: str | Path) -> Path | None:
    """The folder ``mixlab compare`` reads as the checkpoint's run (``<task>/<run>``: every event file below it,
    :func:`mixlab.eval.compare.load_scalars`): the parent of the nearest ``version_*`` folder above the checkpoint;
    None when there is none."""
    ck = Path(ckpt).resolve()
    return next((d.parent for d in ck.parents if d.name.startswith("version_")), None)


def _differs(args) -> list[str]:
    """The options that make this call other than the standard protocol (the checkpoint's own data: no
    ``--data-path``, no ``--tokenizer``, ``--split val``), as given; empty for the standard protocol."""
    out = [f"--data-path {args.data_path}"] if args.data_path is not None else []
    if args.tokenizer is not None:
        out.append(f"--tokenizer {args.tokenizer}")
    if args.split != "val":
        out.append(f"--split {args.split}")
    return out


def _default_out(ckpt: str, args) -> Path:
    """``--out`` when not given. Standard protocol: ``<ckpt dir>/../length_extrapolation``. Otherwise a folder
    outside the run that ``mixlab compare`` reads, named by what differs: for a checkpoint in
    ``<runs>/<task>/<run>/version_N/``, ``<runs>/length_extrapolation/<task>_<run>_version_N_<what>`` (not a run
    for ``compare``: it holds no ``version_*`` folder); else ``<ckpt dir>/../length_extrapolation_<what>``."""
    ck = Path(ckpt).resolve()
    if not _differs(args):
        return ck.parent.parent / "length_extrapolation"
    parts = []
    if args.data_path is not None:
        parts.append("data-" + (re.sub(r"[^A-Za-z0-9.+-]+", "-", Path(str(args.data_path)).name).strip("-")[:40]
                                or "path"))
    if args.tokenizer is not None:
        parts.append(f"tokenizer-{args.tokenizer}")
    if args.split != "val":
        parts.append(f"split-{args.split}")
    what = "_".join(parts)
    tree = _compare_tree(ck)
    if tree is None:
        return ck.parent.parent / f"length_extrapolation_{what}"
    version = next(d for d in ck.parents if d.name.startswith("version_"))
    return tree.parent.parent / "length_extrapolation" / f"{tree.parent.name}_{tree.name}_{version.name}_{what}"


# ------------------------------------------------------------------------------------------------ command
def main(argv: list[str] | None = None) -> dict:
    """CLI entry (``python -m mixlab length-extrapolation``); returns ``{label: {length: ppl}}``.

    Bad option values are argparse errors (one line, exit status 2) before anything is read or written: a
    ``--lengths`` multiple that is not positive and finite or is given twice, ``--chunk`` < 0, ``--max-windows``,
    ``--batch-size``, ``--smooth`` < 1, ``--train-length`` < 2 (0 included), ``--labels`` empty or not one per
    ``--ckpt``, a ``--device`` this machine lacks, a ``--data-path`` that matches no file, an ``--out`` that is a
    file, under a file or not writable, or (off the standard protocol) inside the run folder ``compare`` reads.
    Raises ValueError / OSError for a checkpoint that cannot be read or is not a decoder LM on text, a
    ``--data-path`` without text, a ``--tokenizer`` whose ids the model lacks, a missing training length, a
    ``--lengths`` multiple of no token, two multiples of the same token count, one whose estimated memory is more
    than is free on ``--device`` (:func:`check_forward_memory`) or whose windows the split is too short for (each
    checked before that checkpoint's TensorBoard writer is created); any error leaves ``--out`` and the runs'
    ``length_extrapolation`` folders as they were (:func:`~mixlab.eval.common.undo_on_failure`).
    """
    p = OneLineParser(prog="python -m mixlab length-extrapolation", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", nargs="+", required=True, help="checkpoint(s) to compare")
    p.add_argument("--labels", nargs="*", default=None,
                   help="row labels, one non-empty label per --ckpt (default: each checkpoint's run folder name, "
                        "else its model's default run name)")
    p.add_argument("--lengths", nargs="+", type=float, default=[1, 2, 4, 8], help="multiples of the training length")
    p.add_argument("--train-length", type=int, default=None, help="override the training length (tokens, >= 2)")
    p.add_argument("--max-windows", type=int, default=16, help="windows per length")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--chunk", type=int, default=None,
                   help="tokens per cached forward (default: training length; 0: none)")
    p.add_argument("--data-path", default=None,
                   help="evaluate on these documents instead of the checkpoint's (not recorded for mixlab compare)")
    p.add_argument("--tokenizer", choices=["gpt2", "byte"], default=None,
                   help="override the checkpoint datamodule's tokenizer (not recorded for mixlab compare)")
    p.add_argument("--split", choices=["val", "test", "train"], default="val",
                   help="text split to cut the windows from (TextDataModule: test is the same data as val; "
                        "other than val: not recorded for mixlab compare)")
    p.add_argument("--smooth", type=int, default=16,
                   help="moving-average width of the NLL curve (positions, >= 1; at most half the curve)")
    p.add_argument("--out", default=None,
                   help="output folder (default: <ckpt dir>/../length_extrapolation; with --data-path, --tokenizer or "
                        "--split: a folder outside the run, see above)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    _check_options(p, args)
    differs = _differs(args)
    out = Path(args.out) if args.out is not None else _default_out(args.ckpt[0], args)
    problem = output_problem("--out", args.out if args.out is not None else out, folder=True)  # "" is refused
    if problem:
        p.error(problem)
    if differs:
        inside = next((t for t in map(_compare_tree, args.ckpt)
                       if t is not None and out.resolve().is_relative_to(t)), None)
        if inside is not None:
            p.error(f"--out {out} is inside the run folder {inside}, where mixlab compare reads every event file as "
                    f"the run's own: a perplexity measured with {', '.join(differs)} would sit next to those on its "
                    "training data; give an --out outside it")
    with undo_on_failure() as note:
        results, md = _evaluate(args, out, note, standard=not differs)
    print(md)
    if differs:
        print(f"not recorded for mixlab compare: measured with {', '.join(differs)}, not on the checkpoint's own "
              f"validation data; the results are only in {out}")
    print(f"wrote {out}/length_extrapolation.md, .csv, position_nll.png, tb/")
    return results


def _check_options(p: OneLineParser, args) -> None:
    """:func:`main`'s up-front checks of option values (``p.error``: one line, exit status 2)."""
    bad_length = next((m for m in args.lengths if not m > 0), None)  # NaN fails too
    for name, bad, value, need in (
            ("--chunk", args.chunk is not None and args.chunk < 0, args.chunk, ">= 0 (0: no chunking)"),
            ("--lengths", bad_length is not None, args.lengths, "positive"),
            ("--lengths", any(math.isinf(m) for m in args.lengths), args.lengths, "finite"),
            ("--max-windows", args.max_windows < 1, args.max_windows, "positive"),
            ("--batch-size", args.batch_size < 1, args.batch_size, "positive"),
            ("--train-length", args.train_length is not None and args.train_length < 2, args.train_length,
             "positive (>= 2 tokens)"),
            ("--smooth", args.smooth < 1, args.smooth, ">= 1 (positions of the moving average)")):
        if bad:
            p.error(f"{name} must be {need}; got {value}")
    twice = next((m for i, m in enumerate(args.lengths) if m in args.lengths[:i]), None)
    if twice is not None:
        p.error(f"--lengths lists {twice:g} twice; give each multiple once")
    if args.labels is not None:
        if len(args.labels) != len(args.ckpt):
            p.error(f"--labels has {len(args.labels)} entries for {len(args.ckpt)} --ckpt")
        empty = next((i for i, label in enumerate(args.labels) if not label.strip()), None)
        if empty is not None:
            p.error(f"--labels: label {empty + 1} ({args.labels[empty]!r}) is empty; give each --ckpt a name")
    try:
        check_device(args.device)
    except ValueError as err:
        p.error(str(err))
    if args.data_path is not None:
        from mixlab.datamodules.text import expand_paths

        try:
            expand_paths(args.data_path, "--data-path")
        except (ValueError, OSError) as err:
            p.error(str(err))


def _earlier_lengths(tb: Path, lengths: set[int]) -> dict[str, list[tuple[int, float]]]:
    """The scalars an earlier call wrote into ``tb`` for lengths (tokens) other than ``lengths``: ``{tag: [(step,
    value), ...]}`` of ``length/ppl`` and ``length/loss`` (step = length) and ``position_nll/len_<length>``. The
    new call's event file carries them over, so that its earlier files (removed on success) take only the lengths
    measured again with them (a user test: ``--lengths 1.5`` after ``--lengths 1 2 4`` left PPL@192 alone)."""
    if not tb.is_dir() or not any(tb.glob("events.out.tfevents.*")):
        return {}
    from mixlab.eval.compare import load_scalars

    kept: dict[str, list[tuple[int, float]]] = {}
    for tag, points in load_scalars(tb).items():
        per_length = re.fullmatch(r"position_nll/len_(\d+)", tag)
        if per_length:
            if int(per_length.group(1)) not in lengths:
                kept[tag] = [(step, value) for _, step, value in points]
        elif tag in ("length/ppl", "length/loss"):
            last = {step: value for _, step, value in points}  # the newest value of each length
            kept[tag] = [(step, value) for step, value in sorted(last.items()) if step not in lengths]
    return {tag: points for tag, points in kept.items() if points}


def _evaluate(args, out: Path, note, standard: bool = True) -> tuple[dict[str, dict[int, float]], str]:
    """:func:`main`'s evaluation and outputs: ``(results, markdown table)``; ``note(folder)`` is called before
    each folder is first written into (:func:`~mixlab.eval.common.undo_on_failure`); TensorBoard folders with
    ``replace=True``, once per call (a folder two checkpoints write into keeps both). ``standard``: the run's own
    data, whose scalars go into the checkpoint's run folder."""
    from torch.utils.tensorboard import SummaryWriter

    noted: set[Path] = set()

    def note_tb(folder: Path) -> Path:
        folder = Path(folder).absolute()
        if folder not in noted:
            noted.add(folder)
            note(folder, replace=True)
        return folder

    results: dict[str, dict[int, float]] = {}
    curves: dict[str, np.ndarray] = {}
    train_len: dict[str, int] = {}
    for i, ckpt in enumerate(args.ckpt):
        run = load_run(ckpt, args.device)
        model = run.model
        dm, l_train = _datamodule(run, args)
        l_train = args.train_length if args.train_length is not None else l_train
        if l_train <= 0:
            raise ValueError(f"{ckpt}: no context_length in the checkpoint's datamodule; pass --train-length")
        lengths = _token_lengths(args.lengths, l_train, ckpt, model)
        chunk = l_train if args.chunk is None else args.chunk
        batch = min(args.batch_size, args.max_windows)
        for m, length in lengths:  # memory, then a too short split: before the writer
            check_forward_memory(model, batch, length, chunk, args.device, f"--lengths {m:g} ({length} tokens)",
                                 _PER_TOKEN)
        windows = [_windows(dm, args, m, length) for m, length in lengths]
        run_folder = _compare_tree(ckpt)  # <task>/<run>: the run's --run_name
        label = args.labels[i] if args.labels is not None else (
            run_folder.name if run_folder is not None else getattr(model, "run_name", Path(ckpt).stem))
        if label in results:
            label = f"{label}-{i}"
        note_long_run(f"length-extrapolation {label}",
                      sum(len(ds) * forward_flops(model, length) for (_, length), ds in zip(lengths, windows)),
                      args.device)
        train_len[label], results[label] = l_train, {}
        ck = Path(ckpt).resolve()
        # the standard protocol's scalars go into the checkpoint's own run folder (where `mixlab compare` looks),
        # whatever --out is; any other data only into --out
        in_run = standard and ck.parent.name == "checkpoints"
        tb_dir = ck.parent.parent / "length_extrapolation" / "tb" if in_run else out / "tb" / label
        problem = output_problem(f"--ckpt {ckpt} (its run folder)" if in_run else "--out", tb_dir, folder=True)
        if problem:
            raise ValueError(problem)
        kept = _earlier_lengths(tb_dir, {length for _, length in lengths})
        writer = SummaryWriter(str(note_tb(tb_dir)))
        try:
            for tag, points in kept.items():  # lengths an earlier call measured and this one does not
                for step, value in points:
                    writer.add_scalar(tag, value, step)
            for (m, length), ds in zip(lengths, windows):
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
        w.writerow(["model", "position (tokens)", "nll (nats/token)"])
        for label, c in curves.items():
            w.writerows([label, t + 1, f"{v:.6f}"] for t, v in enumerate(c))
    shortest = min(len(c) for c in curves.values())
    if smoothing_width(args.smooth, shortest) < args.smooth:
        print(f"note: --smooth {args.smooth} is more than half the {shortest} positions of the longest windows; the "
              f"NLL curve is averaged over {smoothing_width(args.smooth, shortest)} positions", file=sys.stderr)
    fig = plot_position_nll(curves, train_len, out / "position_nll.png", args.smooth)
    writer = SummaryWriter(str(note_tb(out / "tb")))
    try:
        writer.add_figure("position_nll", fig)
    finally:
        writer.close()
    return results, md
