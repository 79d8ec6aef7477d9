"""Pre-tokenise a large text corpus into uint16 memmap shards for ``TextDataModule(tokens_dir=...)``.

    python scripts/pretokenize.py --input /data/fineweb/*.parquet --out data/fineweb_gpt2 \
        [--tokenizer gpt2] [--text-field text] [--shard-tokens 100000000] [--val-fraction 0.0005]

Reads .txt / .jsonl(.gz) / .parquet (pyarrow) / WebDataset .tar documents (FineWeb, C4,
SlimPajama dumps), tokenises them with the offline GPT-2 BPE (or bytes), appends EOS to
each document and writes ``train_00000.bin, ...`` and ``val_00000.bin, ...`` (raw
little-endian uint16, ``shard_tokens`` tokens each at most) plus ``meta.json``
(tokenizer, vocab_size, eos_id, dtype, token counts per shard). Each document goes to val
with probability ``val_fraction`` (seeded), so splits share no document. A tqdm bar
counts documents and tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from mixlab.datamodules.text import get_tokenizer, iter_documents


class ShardWriter:
    """Appends token arrays to ``<split>_NNNNN.bin`` files of at most ``shard_tokens`` tokens."""

    def __init__(self, out: Path, split: str, shard_tokens: int) -> None:
        self.out, self.split, self.cap = out, split, shard_tokens
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
        np.concatenate(self.buf).astype("<u2").tofile(self.out / name)
        self.shards.append({"file": name, "tokens": int(self.n)})
        self.buf, self.n = [], 0


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="files, directories or globs")
    p.add_argument("--out", required=True, help="output folder (created)")
    p.add_argument("--tokenizer", choices=["gpt2", "byte"], default="gpt2")
    p.add_argument("--tokenizer-file", default=None, help="GPT-2 ranks file (default: the shipped one)")
    p.add_argument("--text-field", default="text")
    p.add_argument("--shard-tokens", type=int, default=100_000_000)
    p.add_argument("--val-fraction", type=float, default=0.0005)
    p.add_argument("--batch-docs", type=int, default=256, help="documents per tokenizer batch")
    p.add_argument("--max-docs", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    tok = get_tokenizer(args.tokenizer, args.tokenizer_file)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    writers = {s: ShardWriter(out, s, args.shard_tokens) for s in ("train", "val")}
    rng = random.Random(args.seed)
    n_docs, n_tok, first = 0, 0, True
    bar = tqdm(desc="documents", unit="doc")

    def flush_batch(batch: list[str]) -> None:
        nonlocal n_tok, first
        for ids in tok.encode_batch(batch):
            split = "val" if rng.random() < args.val_fraction or (first and args.val_fraction > 0) else "train"
            first = False
            arr = np.empty(len(ids) + 1, dtype=np.uint16)
            arr[:-1], arr[-1] = ids, tok.eos_id
            writers[split].add(arr)
            n_tok += len(arr)
        bar.update(len(batch))
        bar.set_postfix(tokens=f"{n_tok:,}")

    batch: list[str] = []
    for doc in iter_documents(args.input, args.text_field):
        batch.append(doc)
        n_docs += 1
        if len(batch) == args.batch_docs:
            flush_batch(batch)
            batch = []
        if args.max_docs and n_docs >= args.max_docs:
            break
    if batch:
        flush_batch(batch)
    bar.close()
    for w in writers.values():
        w.flush()
    meta = {"tokenizer": tok.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "dtype": "uint16",
            "documents": n_docs, "tokens": n_tok, "shards": {s: w.shards for s, w in writers.items()}}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    print(f"wrote {n_docs:,} documents, {n_tok:,} tokens to {out}")
    return meta


if __name__ == "__main__":
    main(sys.argv[1:])
