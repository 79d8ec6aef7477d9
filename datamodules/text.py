"""Text data for decoder language models: documents -> GPT-2 BPE or byte tokens -> packed blocks.

Sources (``path``: a file, a directory (read recursively, sorted), a glob, a brace pattern, or a list of
them; :mod:`mixlab.datamodules.files`):

* ``.txt`` / ``.txt.gz`` / ``.md``: the whole file is one document;
* ``.jsonl`` / ``.jsonl.gz``: one JSON object per line, text in ``text_field``;
* ``.parquet``: column ``text_field`` (needs ``pyarrow``; a clear error otherwise);
* ``.tar`` / ``.tar.gz`` / ``.tgz``: WebDataset shards; each sample's ``.txt``/``.text``
  member, or ``.json`` member's ``text_field``;
* ``tokens_dir``: memmap shards written by ``scripts/pretokenize.py`` (uint16 for GPT-2; the dtype
  is in their ``meta.json``).

Tokenizers: ``"gpt2"`` (GPT-2 BPE through tiktoken, loading the shipped
``mixlab/data/gpt2.tiktoken`` ranks file - never a download; ``<|endoftext|>`` = 50256 is
the EOS; another tiktoken ranks file as ``tokenizer_file``, of any size: EOS after its last
rank, ``vocab_size`` from it, ids stored in the smallest dtype that holds them) and
``"byte"`` (UTF-8 bytes 0..255, EOS = 256, ``vocab_size`` 257,
``token_unit = "byte"`` so the LM head also logs bits per byte).

Packing: every document is followed by EOS and the token streams are concatenated. A
sample is ``LongTensor [context_length + 1]`` (the LM head shifts it). Train windows start
every ``train_stride`` tokens; val/test windows do not overlap. Train/val split: with one
document (tinyshakespeare) the last ``val_fraction`` of the stream is validation; with
several documents each document goes to val with probability ``val_fraction`` (seeded),
so splits never share a document. The test split is the validation split.
"""

from __future__ import annotations

import codecs
import gzip
import json
import os
import random
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Iterator, Literal, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from mixlab.datamodules.files import expand_pattern
from mixlab.distributed import ResumableDataModule, check_at_least, check_num_workers, check_seed

__all__ = [
    "GPT2Tokenizer", "ByteTokenizer", "get_tokenizer", "iter_documents", "expand_paths",
    "pack_documents", "split_stream", "token_dtype", "TokenWindows", "TextDataModule", "read_token_shards",
]

GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
GPT2_EOS = 50256


def shipped_file(name: str) -> Path:
    """Path of a file shipped in ``mixlab/data`` (``tinyshakespeare.txt``, ``gpt2.tiktoken``)."""
    return Path(str(resources.files("mixlab.data") / name))


class GPT2Tokenizer:
    """Byte-level BPE through tiktoken with GPT-2's pre-tokenisation, offline: the shipped GPT-2 ranks
    (``vocab_size`` 50257, EOS ``<|endoftext|>`` = 50256) or any tiktoken ranks file.

    The EOS id is the one after the file's largest rank and ``vocab_size`` is EOS + 1, so a larger
    vocabulary (e.g. a ranks file of 100,256 tokens: EOS 100256, ``vocab_size`` 100257) is read as it
    is; its ids are stored in the smallest dtype that holds them (:func:`token_dtype`).

    Args:
        ranks_file: tiktoken ranks file; default the shipped ``mixlab/data/gpt2.tiktoken``.

    Raises:
        FileNotFoundError: the ranks file does not exist.
        ValueError: it is a directory, or not a tiktoken ranks file (``tokenizer_file must be a tiktoken ranks
            file (lines of '<base64 token> <rank>'); got <path>: line b'...' is not ...``), holds no rank, or lacks
            one of the 256 single-byte tokens (tiktoken would panic on a text holding that byte).
    """

    name = "gpt2"
    token_unit = "token"

    def __init__(self, ranks_file: str | os.PathLike | None = None) -> None:
        import tiktoken

        path = Path(ranks_file) if ranks_file else shipped_file("gpt2.tiktoken")
        _check_ranks_path(path)
        ranks = _read_ranks(path)
        self.eos_id = max(ranks.values(), default=-1) + 1  # GPT-2's ranks: 50256
        self.enc = tiktoken.Encoding(name="gpt2_offline", pat_str=GPT2_PAT, mergeable_ranks=ranks,
                                     special_tokens={"<|endoftext|>": self.eos_id})
        self.vocab_size = self.enc.n_vocab

    def encode(self, text: str) -> list[int]:
        """Text -> ids; the literal string ``<|endoftext|>`` is encoded as ordinary text."""
        return self.enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(texts, num_threads=2)

    def decode(self, ids: Sequence[int]) -> str:
        return self.enc.decode(list(ids))


_RANKS_FORMAT = "a tiktoken ranks file (lines of '<base64 token> <rank>')"


def _check_ranks_path(path: str | os.PathLike) -> None:
    """Refuse a ``tokenizer_file`` that is a directory or missing.

    Raises:
        ValueError: a directory (``tokenizer_file must be a tiktoken ranks file ...; got <path> (a directory)``).
        FileNotFoundError: no such file.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"tokenizer_file must be {_RANKS_FORMAT}; got {path} (a directory)")
    if not path.is_file():
        raise FileNotFoundError(f"GPT-2 ranks file not found: {path} (tokenizer_file)")


def _read_ranks(path: Path) -> dict[bytes, int]:
    """tiktoken's ``load_tiktoken_bpe`` of ``path``, its errors as one ValueError naming ``tokenizer_file``."""
    from tiktoken.load import load_tiktoken_bpe

    try:
        ranks = load_tiktoken_bpe(str(path))
    except ValueError as err:  # tiktoken: "Error parsing line b'...' in <path>" (a traceback through the CLI)
        text = str(err).rsplit(" in ", 1)[0]
        if text.startswith("Error parsing line "):
            line = text.removeprefix("Error parsing line ")
            text = f"line {line[:60]}{'...' if len(line) > 60 else ''} is not '<base64 token> <rank>'"
        raise ValueError(f"tokenizer_file must be {_RANKS_FORMAT}; got {path}: {text[:200]}") from None
    if not ranks:
        raise ValueError(f"tokenizer_file must be {_RANKS_FORMAT}; got {path}: it holds no rank")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:  # tiktoken panics on the first text holding such a byte
        raise ValueError(f"tokenizer_file must be {_RANKS_FORMAT}; got {path}: it lacks {len(missing)} of the 256 "
                         f"single-byte tokens (e.g. {bytes(missing[:1])!r}) that byte-level BPE needs")
    return ranks


class ByteTokenizer:
    """UTF-8 bytes (ids 0..255) plus EOS = 256; ``vocab_size`` 257."""

    name = "byte"
    token_unit = "byte"
    eos_id = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def get_tokenizer(name: str, tokenizer_file: str | None = None):
    """``"gpt2"`` -> :class:`GPT2Tokenizer`, ``"byte"`` -> :class:`ByteTokenizer`.

    Raises:
        ValueError: unknown name.
    """
    if name == "gpt2":
        return GPT2Tokenizer(tokenizer_file)
    if name == "byte":
        return ByteTokenizer()
    raise ValueError(f"tokenizer must be 'gpt2' or 'byte'; got {name!r}")


# ---------------------------------------------------------------------- documents
_TEXT_SUFFIXES = (".txt", ".txt.gz", ".md")
_JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".ndjson")
_TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
_ALL_SUFFIXES = _TEXT_SUFFIXES + _JSONL_SUFFIXES + _TAR_SUFFIXES + (".parquet",)


def expand_paths(path: str | os.PathLike | Sequence[str | os.PathLike], what: str = "data.init_args.path"
                 ) -> list[Path]:
    """Files named by ``path``: files, directories (read recursively), globs, brace patterns
    (``text-{000..002}.tar``), several joined by ``::`` or in a list; each entry's files sorted
    (:func:`mixlab.datamodules.files.expand_pattern`, the rule of every mixlab input). ``what``: the option
    ``path`` came from, named in errors.

    Raises:
        FileNotFoundError: an entry matches no file (names ``what`` and the entry).
    """
    return [Path(f) for f in expand_pattern(path, what, suffixes=_ALL_SUFFIXES)]


def decode_text(raw: bytes, encoding: str, where: str) -> str:
    """``raw`` decoded with ``encoding``.

    Raises:
        ValueError: undecodable bytes: ``"<where>: not <encoding> text: byte 0xff at byte offset N
            ...; set data.init_args.encoding (e.g. latin-1) to read it"``.
    """
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as err:
        raise ValueError(f"{where}: not {encoding} text: byte 0x{raw[err.start]:02x} at byte offset {err.start} "
                         f"({err.reason}); set data.init_args.encoding (e.g. latin-1) to read it") from None


def _read_text(path: Path, encoding: str) -> str:
    """The whole text of a file (``.gz``: decompressed), decoded with ``encoding``.

    Raises:
        ValueError: undecodable bytes (names the file, the byte offset and ``data.init_args.encoding``);
            a damaged gzip file.
    """
    if not path.name.endswith(".gz"):
        return decode_text(path.read_bytes(), encoding, str(path))
    try:
        with gzip.open(path, "rb") as fh:
            raw = fh.read()
    except (OSError, EOFError) as err:  # gzip.BadGzipFile is an OSError; a truncated file ends in EOFError
        raise ValueError(f"{path}: not a readable gzip file ({err or type(err).__name__})") from None
    return decode_text(raw, encoding, f"{path} (decompressed)")


def _json_text(obj: dict, field: str, where: str) -> str:
    if not isinstance(obj, dict) or field not in obj:
        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(f"{where}: no text field {field!r} (data.init_args.text_field); found {keys}")
    return str(obj[field])


def _json(text: str | bytes, where: str) -> dict:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not a JSON record ({err})") from None


def iter_documents(path, text_field: str = "text", encoding: str = "utf-8", what: str = "data.init_args.path"
                   ) -> Iterator[str]:
    """Yield documents (``str``) from every file of ``path`` (see the module docstring; ``what``: the option it
    came from, as :func:`expand_paths`), text files decoded with ``encoding``.

    Raises:
        ValueError: unsupported file type; bytes that are not ``encoding`` text (names the file,
            the byte offset and ``data.init_args.encoding``); a line that is not JSON or a JSON
            record without ``text_field``; a WebDataset sample with no text member.
        ImportError: a ``.parquet`` file without ``pyarrow`` installed.
    """
    for f in expand_paths(path, what):
        name = f.name.lower()
        if name.endswith(_TEXT_SUFFIXES):
            yield _read_text(f, encoding)
        elif name.endswith(_JSONL_SUFFIXES):
            for i, line in enumerate(_read_text(f, encoding).split("\n"), 1):
                if line.strip():
                    yield _json_text(_json(line, f"{f}:{i}"), text_field, f"{f}:{i}")
        elif name.endswith(".parquet"):
            try:
                import pyarrow.parquet as pq
            except ImportError as err:
                raise ImportError(f"reading {f} needs pyarrow (pip install pyarrow)") from err
            pf = pq.ParquetFile(f)
            if text_field not in pf.schema_arrow.names:
                raise ValueError(f"{f}: no column {text_field!r} (data.init_args.text_field); "
                                 f"columns {pf.schema_arrow.names}")
            for batch in pf.iter_batches(columns=[text_field]):
                yield from (str(t) for t in batch.column(0).to_pylist() if t is not None)
        elif name.endswith(_TAR_SUFFIXES):
            yield from _iter_wds(f, text_field, encoding)
        else:
            raise ValueError(f"unsupported text file type: {f} (expected one of {', '.join(_ALL_SUFFIXES)})")


def _iter_wds(path: Path, text_field: str, encoding: str = "utf-8") -> Iterator[str]:
    """Documents of one WebDataset shard (samples grouped by key, as webdataset does)."""
    import webdataset as wds

    with open(path, "rb") as fh:
        stream = fh if not path.name.endswith(("gz", "tgz")) else gzip.open(fh)
        files = wds.tariterators.tar_file_expander([{"url": str(path), "stream": stream}])
        for sample in wds.tariterators.group_by_keys(files):
            key = sample.get("__key__", "?")
            for ext in ("txt", "text"):
                if ext in sample:
                    yield decode_text(sample[ext], encoding, f"{path}: sample {key!r} .{ext}")
                    break
            else:
                if "json" not in sample:
                    raise ValueError(f"{path}: WebDataset sample {key!r} has no .txt/.text/.json member")
                yield _json_text(_json(sample["json"], f"{path}:{key}"), text_field, f"{path}:{key}")


_TOKEN_DTYPES = (np.uint8, np.uint16, np.uint32)


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype holding ids ``0 .. vocab_size - 1`` (uint8, uint16 or uint32), as
    token arrays and ``scripts/pretokenize.py`` shards store them (``meta.json`` records it).

    Raises:
        ValueError: a vocabulary larger than uint32 holds, or not positive.
    """
    for dtype in _TOKEN_DTYPES:
        if 0 < vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise ValueError(f"a tokenizer vocabulary of {vocab_size:,} ids cannot be stored as token ids: the largest "
                     f"token dtype, uint32, holds {np.iinfo(np.uint32).max + 1:,}")


def pack_documents(docs: Sequence[Sequence[int]], eos_id: int, dtype=None) -> np.ndarray:
    """Concatenate token lists, each followed by ``eos_id`` -> 1-D array of ``dtype`` (default: the
    smallest of :func:`token_dtype` holding every id).

    Raises:
        ValueError: an id that ``dtype`` cannot hold (instead of numpy's OverflowError).
    """
    top = max([eos_id] + [max(d) for d in docs if len(d)])
    dtype = token_dtype(int(top) + 1) if dtype is None else np.dtype(dtype)
    if top > np.iinfo(dtype).max:
        raise ValueError(f"token id {top} does not fit {dtype.name} token arrays (at most {np.iinfo(dtype).max}); "
                         f"store them as {token_dtype(int(top) + 1).name}")
    total = sum(len(d) + 1 for d in docs)
    out = np.empty(total, dtype=dtype)
    i = 0
    for d in docs:
        out[i:i + len(d)] = d
        out[i + len(d)] = eos_id
        i += len(d) + 1
    return out


def split_stream(stream: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)`` of a one-document corpus: the last ``val_fraction`` of its token stream is
    validation (the in-memory loader and ``scripts/pretokenize.py`` split it the same way)."""
    cut = int(round(len(stream) * (1 - val_fraction)))
    return stream[:cut], stream[cut:]


def read_token_shards(tokens_dir: str | os.PathLike, split: str) -> tuple[dict, list[np.ndarray]]:
    """``(meta, [memmap ...])`` of ``<split>_*.bin`` shards from ``scripts/pretokenize.py``, little-endian of
    ``meta["dtype"]`` (uint16 when absent: shards written before it was recorded).

    Raises:
        FileNotFoundError: no ``meta.json`` or no shard of ``split``.
    """
    d = Path(tokens_dir)
    if not (d / "meta.json").is_file():
        raise FileNotFoundError(f"{d}/meta.json not found (data.init_args.tokens_dir); "
                                "run scripts/pretokenize.py first")
    meta = json.loads((d / "meta.json").read_text())
    files = sorted(d.glob(f"{split}_*.bin"))
    if not files:
        raise FileNotFoundError(f"no {split}_*.bin shard in {d} (data.init_args.tokens_dir)")
    dtype = np.dtype(meta.get("dtype", "uint16")).newbyteorder("<")
    return meta, [np.memmap(f, dtype=dtype, mode="r") for f in files]


class TokenWindows(Dataset):
    """Windows of ``length`` tokens over several 1-D token arrays (never crossing arrays).

    Item ``i`` is ``LongTensor [length]``. Starts are ``0, stride, 2*stride, ...``.
    """

    def __init__(self, arrays: Sequence[np.ndarray], length: int, stride: int, max_windows: int | None = None) -> None:
        if length < 2 or stride < 1:
            raise ValueError(f"TokenWindows: need length >= 2 and stride >= 1; got {length}, {stride}")
        self.arrays, self.length, self.stride = list(arrays), length, stride
        counts = [max(0, (len(a) - length) // stride + 1) for a in self.arrays]
        self.cum = np.cumsum([0] + counts)
        self.n = int(self.cum[-1]) if max_windows is None else min(int(self.cum[-1]), max_windows)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.n:
            raise IndexError(i)
        a = int(np.searchsorted(self.cum, i, side="right") - 1)
        s = (i - int(self.cum[a])) * self.stride
        return torch.from_numpy(np.asarray(self.arrays[a][s:s + self.length], dtype=np.int64))


class TextDataModule(ResumableDataModule):
    """Packed text for :class:`mixlab.heads.CausalLM` (``task_name = "text"``).

    Args:
        path: documents (file / directory / glob / list); ``None`` = the shipped
            tinyshakespeare (``mixlab/data/tinyshakespeare.txt``).
        tokenizer: ``"gpt2"`` (BPE, offline) or ``"byte"``.
        tokenizer_file: tiktoken ranks file (default: the shipped GPT-2 one); sets ``vocab_size``.
        text_field: JSON / parquet field holding the text.
        tokens_dir: read pre-tokenised ``train_*.bin`` / ``val_*.bin`` shards instead of
            ``path`` (see ``scripts/pretokenize.py``; the tokenizer must match).
        context_length: tokens per training sample (windows hold ``context_length + 1``).
        batch_size: samples per batch.
        train_stride: step between training windows (default ``context_length``).
        val_fraction: fraction of the stream (one document) or of documents (several); 0: no val split (fit
            with ``--trainer.limit_val_batches 0``).
        max_val_windows: cap on validation/test windows.
        num_workers: DataLoader workers.
        seed: split seed (and, with ``seed_everything``, the seed of the window order).
        encoding: text encoding of ``.txt``/``.jsonl``/WebDataset text (default ``utf-8``;
            e.g. ``latin-1``, ``cp1252``, ``utf-16``).

    Under DDP/FSDP rank r of W reads windows r::W of one seeded order (no duplicates; see
    :class:`mixlab.distributed.ResumableDataModule`); the train position is saved in
    checkpoints, so a run resumed mid-epoch continues with the next unseen batch.

    Raises:
        ValueError: bad tokenizer name or encoding; a size out of its range (``context_length``, ``batch_size``,
            ``train_stride``, ``max_val_windows`` >= 1, ``num_workers`` in ``[0, 64]``:
            :func:`~mixlab.distributed.check_num_workers`); ``tokenizer_file`` with the byte tokenizer, or a
            directory (FileNotFoundError: missing); when the tokenizer is first read (``vocab_size``, ``setup``):
            a ``tokenizer_file`` that is not a tiktoken ranks file; at ``setup``: a file that is not
            ``encoding`` text (names the file, the byte offset and ``data.init_args.encoding``),
            data holding no text (``"<file>: file is empty"``), a split too short for one window
            (names the split, its token count and the window length).
    """

    split_aliases = {"test": "val"}
    """The test split is the val split (:meth:`test_dataloader`)."""

    split_arguments: tuple[str, ...] = ("seed", "val_fraction")
    """``val_fraction`` and, with several documents, the seed that assigns documents to val."""

    task_name = "text"

    def __init__(
        self,
        path: str | list[str] | None = None,
        tokenizer: Literal["gpt2", "byte"] = "gpt2",
        tokenizer_file: str | None = None,
        text_field: str = "text",
        tokens_dir: str | None = None,
        context_length: int = 256,
        batch_size: int = 16,
        train_stride: int | None = None,
        val_fraction: float = 0.1,
        max_val_windows: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
        encoding: str = "utf-8",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if not 0.0 <= val_fraction < 1.0:  # 0: no val split (fit with --trainer.limit_val_batches 0)
            raise ValueError(f"val_fraction must be in [0, 1); got {val_fraction}")
        check_at_least(("train_stride", "max_val_windows"), context_length=(context_length, 1),
                       batch_size=(batch_size, 1), train_stride=(train_stride, 1),
                       max_val_windows=(max_val_windows, 1), num_workers=(num_workers, 0))
        if tokenizer_file is not None and tokenizer != "gpt2":
            raise ValueError(f"data.init_args.tokenizer_file ({tokenizer_file}) is a BPE ranks file for tokenizer "
                             f"'gpt2'; tokenizer {tokenizer!r} does not read one: drop tokenizer_file")
        if tokenizer_file is not None:  # its contents are read with the tokenizer (vocab_size, setup)
            _check_ranks_path(tokenizer_file)
        check_num_workers(num_workers)
        check_seed(seed)
        try:
            codecs.lookup(encoding)
        except LookupError:
            raise ValueError(f"data.init_args.encoding: unknown text encoding {encoding!r}") from None
        self.encoding = encoding
        self.path, self.tokenizer_name, self.tokenizer_file = path, tokenizer, tokenizer_file
        self.text_field, self.tokens_dir = text_field, tokens_dir
        self.context_length, self.batch_size = context_length, batch_size
        self.train_stride = train_stride or context_length
        self.val_fraction, self.max_val_windows = val_fraction, max_val_windows
        self.num_workers, self.seed = num_workers, seed
        self._splits: dict[str, list[np.ndarray]] | None = None
        if tokenizer not in ("gpt2", "byte"):
            raise ValueError(f"data.init_args.tokenizer must be 'gpt2' or 'byte'; got {tokenizer!r}")

    @cached_property
    def tokenizer(self):
        return get_tokenizer(self.tokenizer_name, self.tokenizer_file)

    @property
    def vocab_size(self) -> int:
        """Token ids ``0 .. vocab_size - 1``: from ``tokens_dir``'s ``meta.json``, else the tokenizer's
        (byte: 257; the shipped GPT-2 ranks: 50257; another ``tokenizer_file``: its ranks + EOS)."""
        if self.tokens_dir:
            meta = Path(self.tokens_dir) / "meta.json"
            if meta.is_file() and "vocab_size" in (m := json.loads(meta.read_text())):
                return int(m["vocab_size"])
        return int(self.tokenizer.vocab_size)

    @property
    def token_unit(self) -> str:
        return "byte" if self.tokenizer_name == "byte" else "token"

    # ------------------------------------------------------------------ data
    def token_splits(self) -> dict[str, list[np.ndarray]]:
        """``{"train": [arrays], "val": [arrays]}`` of token ids (computed once)."""
        if self._splits is not None:
            return self._splits
        if self.tokens_dir:
            meta, train = read_token_shards(self.tokens_dir, "train")
            _, val = read_token_shards(self.tokens_dir, "val")
            if meta.get("tokenizer", self.tokenizer_name) != self.tokenizer_name:
                raise ValueError(f"{self.tokens_dir}/meta.json tokenizer {meta.get('tokenizer')!r} != "
                                 f"data.init_args.tokenizer {self.tokenizer_name!r}")
            self._splits = {"train": train, "val": val}
            return self._splits
        path = self.path if self.path is not None else shipped_file("tinyshakespeare.txt")
        docs = list(iter_documents(path, self.text_field, self.encoding))
        if not any(docs):
            files = expand_paths(path)
            raise ValueError(f"{files[0]}: file is empty" if len(files) == 1 else
                             f"data.init_args.path {path!r}: its {len(files)} files hold no text")
        tok = self.tokenizer
        ids = tok.encode_batch(docs)
        dtype = token_dtype(tok.vocab_size)
        if len(ids) == 1:
            train, val = split_stream(pack_documents(ids, tok.eos_id, dtype), self.val_fraction)
            self._splits = {"train": [train], "val": [val]}
        else:
            rng = random.Random(self.seed)
            is_val = [rng.random() < self.val_fraction for _ in ids]
            if not any(is_val) and self.val_fraction > 0:
                is_val[-1] = True
            self._splits = {
                "train": [pack_documents([d for d, v in zip(ids, is_val) if not v], tok.eos_id, dtype)],
                "val": [pack_documents([d for d, v in zip(ids, is_val) if v], tok.eos_id, dtype)],
            }
        return self._splits

    def windows(self, split: str, length: int, stride: int | None = None,
                max_windows: int | None = None) -> TokenWindows:
        """Dataset of ``LongTensor [length]`` windows of ``split`` ("train" / "val" / "test").

        Raises:
            ValueError: the split has tokens, but fewer than ``length`` (an empty val split, ``val_fraction``
                0, gives an empty dataset: fit and validate name it, see :func:`mixlab.cli.no_batches`).
        """
        arrays = self.token_splits()["train" if split == "train" else "val"]
        ds = TokenWindows(arrays, length, stride or length - 1, max_windows)
        n = sum(len(a) for a in arrays)
        if len(ds) == 0 and (n or split == "train"):
            raise ValueError(f"text {split} split has {n} tokens; too short for one window of {length} tokens "
                             f"(lower data.init_args.context_length or add data)")
        return ds

    def setup(self, stage: str | None = None) -> None:
        self.token_splits()

    def _loader(self, ds: Dataset, shuffle: bool) -> DataLoader:
        """Rank-split loader (training: shuffled per epoch, full batches, resumable)."""
        return self.resumable_loader(ds, self.batch_size, shuffle, seed=self.seed,
                                     num_workers=self.num_workers)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.windows("train", self.context_length + 1, self.train_stride), True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.windows("val", self.context_length + 1, None, self.max_val_windows), False)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()
