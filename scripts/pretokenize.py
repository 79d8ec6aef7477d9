"""Pre-tokenise a large text corpus into memmap shards for ``TextDataModule(tokens_dir=...)``.

    python scripts/pretokenize.py --input /data/fineweb/*.parquet --out data/fineweb_gpt2 \
        [--tokenizer gpt2] [--tokenizer-file ranks.tiktoken] [--text-field text] [--shard-tokens 100000000] \
        [--val-fraction 0.0005]

Reads .txt / .jsonl(.gz) / .parquet (pyarrow) / WebDataset .tar documents (FineWeb, C4,
SlimPajama dumps; ``--input`` entries are files, folders, globs or brace patterns), tokenises them
with the offline GPT-2 BPE, another tiktoken ranks file, or bytes, appends EOS to each document
and writes ``train_00000.bin, ...`` and ``val_00000.bin, ...`` (raw little-endian ids in the
smallest dtype that holds the tokenizer's vocabulary: uint16 for GPT-2, uint32 above 65,536 ids;
``shard_tokens`` tokens each at most) plus ``meta.json`` (tokenizer, vocab_size, eos_id, dtype,
token counts per shard). Each document goes to val with probability ``val_fraction`` (seeded;
the first one always), so splits share no document; a corpus of ONE document (tinyshakespeare)
is split like the in-memory loader: the last ``val_fraction`` of its token stream is val. A split
left empty is an error (exit status 2, no ``meta.json``), never a success. A tqdm bar counts
documents and tokens.

A run that fails (bad input, an unreadable document, an empty split, Ctrl-C) leaves ``--out`` as it
was: the shards are written into a temporary folder inside it and moved in only once all are written,
so an existing folder keeps its earlier files untouched, and an ``--out`` folder the run created is
removed again (with the parent folders it created).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
from tqdm import tqdm

from mixlab.datamodules.text import expand_paths, get_tokenizer, iter_documents, split_stream, token_dtype
from mixlab.eval.common import OneLineParser, undo_on_failure


class ShardWriter:
    """Appends token arrays to ``<split>_NNNNN.bin`` files of at most ``shard_tokens`` tokens, stored as
    little-endian ``dtype``."""

    def __init__(self, out: Path, split: str, shard_tokens: int, dtype: np.dtype = np.dtype(np.uint16)) -> None:
        self.out, self.split, self.cap, self.dtype = out, split, shard_tokens, np.dtype(dtype).newbyteorder("<")
        self.shards: list[dict] = []
        self.buf: list[np.ndarray] = []
        self.n = 0

    def add(self, ids: np.ndarray) -> None:
        while len(ids):
            take = min(len(ids), self.cap - self.n)
            self.buf.append(ids[:take])
            self.n += take
            ids = ids[take:]
            if self.n == self.cap:
                self.flush()

    def flush(self) -> None:
        if not self.n:
            return
        name = f"{self.split}_{len(self.shards):05d}.bin"
        np.concatenate(self.buf).astype(self.dtype).tofile(self.out / name)
        self.shards.append({"file": name, "tokens": int(self.n)})
        self.buf, self.n = [], 0


def fail(message: str) -> None:
    """One line ``pretokenize.py: error: <message>`` on stderr, exit status 2."""
    print(f"pretokenize.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> dict:
    """Tokenise ``--input`` into shards and ``meta.json`` in ``--out`` (see the module docstring); returns
    the ``meta.json`` contents.

    Errors end the run with one line ``pretokenize.py: error: <message>`` naming the option or file and
    exit status 2 (``SystemExit(2)``): a ``--val-fraction`` outside (0, 1), a ``--shard-tokens`` below 1,
    an unreadable ``--tokenizer-file``, an ``--input`` entry that matches no file (these before anything
    is written), a document that cannot be read, a split left empty. On any failure ``--out`` is left as
    it was (a folder the run created is removed; an existing one keeps exactly its earlier files).
    """
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="files, directories, globs or brace patterns")
    p.add_argument("--out", required=True, help="output folder (created)")
    p.add_argument("--tokenizer", choices=["gpt2", "byte"], default="gpt2")
    p.add_argument("--tokenizer-file", default=None,
                   help="tiktoken ranks file for --tokenizer gpt2 (default: the shipped GPT-2 one)")
    p.add_argument("--text-field", default="text")
    p.add_argument("--shard-tokens", type=int, default=100_000_000)
    p.add_argument("--val-fraction", type=float, default=0.0005)
    p.add_argument("--batch-docs", type=int, default=256, help="documents per tokenizer batch")
    p.add_argument("--max-docs", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 0 < args.val_fraction < 1:
        fail(f"--val-fraction must be in (0, 1), got {args.val_fraction}: the text datamodule reads a train "
             f"and a val split")
    if args.shard_tokens < 1:
        fail(f"--shard-tokens must be >= 1, got {args.shard_tokens}")
    try:
        tok = get_tokenizer(args.tokenizer, args.tokenizer_file)
        dtype = token_dtype(tok.vocab_size)
    except (OSError, ValueError) as err:
        fail(f"--tokenizer-file {args.tokenizer_file}: {err}")
    try:
        expand_paths(args.input, "--input")  # an entry matching no file: before anything is written
    except (OSError, ValueError) as err:
        fail(str(err))
    out = Path(args.out)
    with undo_on_failure() as note:  # a failure removes an --out it created (and its new parents)
        note(out).mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=".pretokenize-", dir=out))  # inside --out: same file system
        try:
            meta = _tokenize(args, tok, dtype, stage)
            for f in sorted(stage.iterdir()):  # all shards written: move them in, meta.json last
                if f.name != "meta.json":
                    os.replace(f, out / f.name)
            os.replace(stage / "meta.json", out / "meta.json")
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    print(f"wrote {meta['documents']:,} documents, {meta['tokens']:,} tokens to {out} (train "
          f"{sum(s['tokens'] for s in meta['shards']['train']):,}, val "
          f"{sum(s['tokens'] for s in meta['shards']['val']):,} tokens, {dtype.name})")
    return meta


def _tokenize(args: argparse.Namespace, tok, dtype: np.dtype, out: Path) -> dict:
    """Write the shards and ``meta.json`` of ``args.input`` into ``out``; returns the meta dict (:func:`fail`
    on an unreadable document or an empty split)."""
    writers = {s: ShardWriter(out, s, args.shard_tokens, dtype) for s in ("train", "val")}
    rng = random.Random(args.seed)
    n_docs, n_tok, first = 0, 0, True
    bar = tqdm(desc="documents", unit="doc")

    def flush_batch(batch: list[str], last: bool = False) -> None:
        nonlocal n_tok, first
        encoded = tok.encode_batch(batch)
        for ids in encoded:
            arr = np.empty(len(ids) + 1, dtype=dtype)
            arr[:-1], arr[-1] = ids, tok.eos_id
            n_tok += len(arr)
            if first and last and len(encoded) == 1:  # the whole corpus is one document: split its stream
                train, val = split_stream(arr, args.val_fraction)
                writers["train"].add(train)
                writers["val"].add(val)
                break
            split = "val" if rng.random() < args.val_fraction or first else "train"
            first = False
            writers[split].add(arr)
        bar.update(len(batch))
        bar.set_postfix(tokens=f"{n_tok:,}")

    batch: list[str] = []
    try:
        for doc in iter_documents(args.input, args.text_field, what="--input"):
            batch.append(doc)
            n_docs += 1
            if len(batch) == args.batch_docs:
                flush_batch(batch)
                batch = []
            if args.max_docs and n_docs >= args.max_docs:
                break
    except (OSError, ValueError) as err:  # a missing input, a record without the text field: named by the reader
        bar.close()
        fail(str(err))
    if batch:
        flush_batch(batch, last=True)
    bar.close()
    for w in writers.values():
        w.flush()
    empty = [s for s, w in writers.items() if not w.shards]
    if empty:
        fail(f"--input {' '.join(args.input)}: {n_docs:,} document(s), {n_tok:,} tokens leave the "
             f"{' and '.join(empty)} split empty at --val-fraction {args.val_fraction}; add documents or "
             f"change --val-fraction (nothing written)")
    meta = {"tokenizer": tok.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "dtype": dtype.name,
            "documents": n_docs, "tokens": n_tok, "shards": {s: w.shards for s, w in writers.items()}}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


if __name__ == "__main__":
    main(sys.argv[1:])
