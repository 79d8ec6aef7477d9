"""DNA data for decoder language models: FASTA / FASTA.gz -> base tokens.

Token ids: A=0, C=1, G=2, T=3, N=4 (``vocab_size = 5``). Every sample is a
``torch.LongTensor [context_length + 1]`` of consecutive bases; the LM head shifts it.

Splits are made by *region*: each record is cut into consecutive regions of
``region_size`` bases and each region goes to train/val/test from a hash of
(record id, region index, seed). A crop never crosses a region boundary, so the splits
never share a base. Training crops start at every ``train_stride``-th position where a
full window fits; val/test use fixed, non-overlapping windows tiled over their regions.
"""
import gzip
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from itertools import chain
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from Bio.SeqIO.FastaIO import SimpleFastaParser
from torch.utils.data import DataLoader, Dataset

from mixlab.datamodules.files import expand_pattern, is_pattern
from mixlab.distributed import ResumableDataModule, SplitLoaders, check_num_workers, check_seed

log = logging.getLogger("mixlab.genome")

ALPHABET = "ACGTN"
N_ID = 4
IUPAC_CODES = "RYKMSWBDHV"
SPLITS = ("train", "val", "test")
DEFAULT_FILES = ("human_chr22_hg38_slice.fa", "human_chr17_hg19_part.fa", "human_chrM_rCRS.fa")
_BAD, _LOWER, _AMBIG = 255, 254, 253  # lookup-table markers for rejected bytes
_CACHE_VERSION = 1


@lru_cache(maxsize=None)
def _lookup_table(lowercase: str, iupac: str) -> np.ndarray:
    lut = np.full(256, _BAD, np.uint8)
    for i, base in enumerate(ALPHABET):
        lut[ord(base)] = i
    for code in IUPAC_CODES:
        lut[ord(code)] = N_ID if iupac == "n" else _AMBIG
    for upper in ALPHABET + IUPAC_CODES:
        lower, folded = ord(upper.lower()), lut[ord(upper)]
        if lowercase == "error":
            lut[lower] = _LOWER
        elif lowercase == "n" and folded != _AMBIG:
            lut[lower] = N_ID
        else:
            lut[lower] = folded
    lut.flags.writeable = False
    return lut


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def encode_sequence(seq: str | bytes, lowercase: str = "fold", iupac: str = "n",
                    where: str = "sequence") -> np.ndarray:
    """Encode DNA letters to a ``uint8`` array ``[len(seq)]`` of ids (A C G T N -> 0..4).

    Vectorised (one numpy table lookup over the bytes). ``lowercase``: "fold" (upper-case
    it), "n" (soft-masked -> N) or "error"; ``iupac``: "n" (R Y K M S W B D H V -> N) or
    "error". Raises ValueError naming ``where``, the character and its 1-based position for
    non-DNA characters (digits, '*', '-', ...) and for ``"error"`` mode violations.
    """
    _check_choice("lowercase", lowercase, ("fold", "n", "error"))
    _check_choice("iupac", iupac, ("n", "error"))
    try:
        raw = seq.encode("latin-1") if isinstance(seq, str) else bytes(seq)
    except UnicodeEncodeError as err:
        raise ValueError(f"{where}: invalid character {seq[err.start]!r} at position "
                         f"{err.start + 1}") from None
    codes = _lookup_table(lowercase, iupac)[np.frombuffer(raw, np.uint8)]
    if codes.size and codes.max() >= _AMBIG:
        pos = int(np.argmax(codes >= _AMBIG))
        char, kind = chr(raw[pos]), int(codes[pos])
        if kind == _LOWER:
            why = "a soft-masked lowercase base, but lowercase='error' (use 'fold' or 'n')"
        elif kind == _AMBIG:
            why = "an IUPAC ambiguity code, but iupac='error' (use 'n')"
        else:
            why = f"not a DNA letter (expected {ALPHABET} or IUPAC {IUPAC_CODES}, any case)"
        raise ValueError(f"{where}: character {char!r} at position {pos + 1} is {why}")
    return codes


FASTA_SUFFIXES = (".fa", ".fasta", ".fna", ".fas", ".fa.gz", ".fasta.gz", ".fna.gz", ".fas.gz")
"""File name endings a ``fasta`` directory is read for (any case)."""


def _check_file(path: Path) -> None:
    if path.is_dir():
        raise IsADirectoryError(f"FASTA path is a directory, not a file: {path} (name the FASTA files in it)")
    if not path.is_file():
        raise FileNotFoundError(f"FASTA file not found: {path}")
    if path.stat().st_size == 0:
        raise ValueError(f"FASTA file {path} is empty")


_BOM = "\xef\xbb\xbf"  # UTF-8 byte-order mark as read in latin-1


def _not_a_header(line: str) -> str:
    """What a first line that is not a header starts with, shown as its bytes (``repr``) so a leading
    space or byte-order mark is visible, with the reason when ``>`` comes after them."""
    line = line.rstrip("\r\n")
    shown = f"its first bytes are {line[:40].encode('latin-1')!r}"
    if line.startswith(_BOM):
        return f"{shown}: a UTF-8 byte-order mark comes before it; save the file without the mark"
    if line.lstrip().startswith(">"):
        return f"{shown}: {len(line) - len(line.lstrip())} whitespace character(s) come before '>'"
    return shown


def read_fasta(path: str | os.PathLike, lowercase: str = "fold", iupac: str = "n"
               ) -> tuple[list[tuple[str, np.ndarray]], list[str]]:
    """Parse one FASTA or FASTA.gz file into ``([(record id, uint8 ids [n_bases])], skipped)``.

    Records are split by biopython's ``Bio.SeqIO.FastaIO.SimpleFastaParser``; the record id
    is the first word of the title. Gzip is detected by magic bytes or a ``.gz`` suffix.
    The file is read in text mode with newline translation, so LF, CRLF and bare-CR files
    parse alike; blank lines, trailing whitespace and spaces inside sequence lines are
    dropped (biopython). Records without bases are skipped (WARNING log naming them,
    returned in ``skipped``). Raises FileNotFoundError (missing file), IsADirectoryError (a
    directory) or ValueError naming the file: empty, not FASTA (first non-empty line is not a
    '>' header; biopython alone would skip such a preamble silently), unreadable gzip, no
    record with bases, or a bad character such as a tab or digit (see :func:`encode_sequence`).
    """
    path = Path(path)
    _check_file(path)
    with open(path, "rb") as fh:
        gz = fh.read(2) == b"\x1f\x8b" or path.suffix == ".gz"
    records: list[tuple[str, np.ndarray]] = []
    skipped: list[str] = []
    opener = gzip.open if gz else open
    try:
        with opener(path, "rt", encoding="latin-1") as fh:  # newline=None: universal newlines
            for first in fh:
                if first.strip():
                    break
            else:
                raise ValueError(f"FASTA file {path} is empty (no '>' header)")
            if not first.startswith(">"):
                raise ValueError(f"{path} is not FASTA: the first non-empty line does not start with '>' "
                                 f"({_not_a_header(first)})")
            for title, seq in SimpleFastaParser(chain([first], fh)):
                words = title.split()
                name = words[0] if words else ""
                if not seq:
                    log.warning("%s: record %r has no bases; skipped", path, name)
                    skipped.append(name)
                    continue
                records.append((name, encode_sequence(seq, lowercase, iupac,
                                                      f"{path}: record {name!r}")))
    except (OSError, EOFError) as err:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"cannot read FASTA file {path}: {err}") from err
    if not records:
        raise ValueError(f"FASTA file {path}: no record has any bases "
                         f"({len(skipped)} empty record(s): {skipped[:5]})")
    return records, skipped


def default_fasta() -> list[str]:
    """Paths of the three embedded human FASTA files (chr22 slice, chr17 part, chrM)."""
    try:
        root = Path(str(resources.files("mixlab.data")))
    except (TypeError, NotADirectoryError):  # mixlab imported as a namespace package
        import mixlab
        root = next(Path(p) / "data" for p in mixlab.__path__ if (Path(p) / "data").is_dir())
    return [str(root / name) for name in DEFAULT_FILES]


def _region_hash(name: str, index: int, seed: int) -> float:
    """Uniform number in [0, 1) from (record id, region index, seed); stable across runs."""
    key = f"{name}\x1f{index}\x1f{seed}".encode("utf-8", "surrogateescape")
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") / 2.0**64


@dataclass
class GenomeRecord:
    """One FASTA record: ``tokens`` is a uint8 array ``[n_bases]`` of ids 0..4."""
    name: str
    path: str
    tokens: np.ndarray


class GenomeCropDataset(Dataset):
    """Crops of ``context_length + 1`` bases inside regions, every ``stride`` bases.

    Regions are given as arrays (record index, start, length), in bases. Item ``i`` is the
    crop at the i-th valid start (regions in the order given); returns
    ``torch.LongTensor [context_length + 1]``. :meth:`locate` gives (record index, start).
    """

    def __init__(self, sequences: list[np.ndarray], rec: np.ndarray, start: np.ndarray,
                 length: np.ndarray, context_length: int, stride: int) -> None:
        self.sequences, self.window, self.stride = sequences, context_length + 1, stride
        counts = np.where(length >= self.window, (length - self.window) // stride + 1, 0)
        keep = counts > 0
        self._rec, self._start = rec[keep].astype(np.int64), start[keep].astype(np.int64)
        self._cum = np.cumsum(counts[keep].astype(np.int64))

    def __len__(self) -> int:
        return int(self._cum[-1]) if len(self._cum) else 0

    def locate(self, i: int) -> tuple[int, int]:
        """(record index, start in bases within that record) of item ``i``."""
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} crops")
        k = int(np.searchsorted(self._cum, i, side="right"))
        before = int(self._cum[k - 1]) if k else 0
        return int(self._rec[k]), int(self._start[k]) + (i - before) * self.stride

    def __getitem__(self, i: int) -> torch.Tensor:
        r, s = self.locate(int(i))
        return torch.from_numpy(np.asarray(self.sequences[r][s:s + self.window], np.int64))


class GenomeTrainDataset(GenomeCropDataset):
    """Training crops: every ``train_stride``-th start where a full window fits."""


class GenomeEvalDataset(GenomeCropDataset):
    """Val/test: fixed non-overlapping windows tiled over each region (stride = window)."""

    def __init__(self, sequences, rec, start, length, context_length: int) -> None:
        super().__init__(sequences, rec, start, length, context_length, context_length + 1)


def _read_cache(npy: Path, meta: Path) -> tuple[tuple[np.ndarray, dict] | None, str]:
    """``((memory-mapped uint8 tokens [n_bases], info), "")`` of a genome cache entry, or ``(None, what is
    wrong)`` when it does not read back whole: a .json that is not the entry's record, a .npy that is not a
    1-D uint8 array (a foreign or overwritten file), or one holding another number of bases than the record
    (a copy cut short)."""
    try:
        info = json.loads(meta.read_text())
        names = [(str(name), int(n)) for name, n in info["names"]]
        skipped = list(info["skipped"])
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
        return None, f"{meta.name} is not a cache record: {type(err).__name__}: {err}"
    try:
        data = np.load(npy, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as err:  # numpy: "mmap length is greater than file size", bad header
        return None, f"{npy.name} does not read as an array: {str(err).split('. ')[0]}"
    total = sum(n for _, n in names)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.shape != (total,):
        got = f"{data.dtype} {list(data.shape)}" if isinstance(data, np.ndarray) else type(data).__name__
        if hasattr(data, "close"):  # an .npz archive holds its file open
            data.close()
        return None, f"{npy.name} holds {got}, its record {total} uint8 bases"
    return (data, {**info, "names": names, "skipped": skipped}), ""


class GenomeDataModule(SplitLoaders, ResumableDataModule):
    """FASTA genome(s) -> batches ``LongTensor [batch, context_length + 1]`` of base ids.

    Args (lengths in bases): ``fasta`` paths (FASTA or .gz, one or many records each; a directory, a glob
    or a brace pattern names the FASTA files it matches, :data:`FASTA_SUFFIXES` in a directory, as
    :func:`mixlab.datamodules.files.expand_pattern` reads every mixlab input; None -> the embedded human
    chr22 slice, chr17 part and chrM); ``context_length`` tokens
    per input; ``lowercase`` "fold" | "n" | "error"; ``iupac`` "n" | "error";
    ``region_size``, ``val_fraction``, ``test_fraction``, ``seed`` define the split (each
    split with a fraction > 0 gets a region that fits a window when >= 3 regions do);
    regions with more than ``max_n_fraction`` N are dropped; ``train_stride`` spaces
    training crop starts (raise it for whole genomes: the sampler permutes all starts);
    ``cache_dir`` stores encoded files as .npy (keyed by path, mtime, size, settings; created if
    missing): a cache entry that does not read back whole (a truncated or overwritten .npy, a
    damaged .json) is rebuilt from its FASTA file with a WARNING naming it; ``num_workers`` at most
    :data:`~mixlab.distributed.MAX_NUM_WORKERS` (64).

    Under DDP/FSDP rank r of W reads items r::W of one seeded order (no duplicates; see
    :class:`mixlab.distributed.ResumableSampler`); the train order's position is saved in
    checkpoints (:meth:`state_dict`), so a run resumed mid-epoch sees the next unseen batch.

    Raises ValueError naming the argument for invalid arguments (also ``fasta`` naming an empty
    path, ``cache_dir`` naming an existing file), FileNotFoundError naming ``fasta`` and the pattern for
    a directory, glob or brace pattern that matches no FASTA file; at :meth:`setup`,
    FileNotFoundError / ValueError naming the file for bad input (see :func:`read_fasta`),
    ValueError naming ``cache_dir`` when the cache cannot be written there, and ValueError
    naming ``context_length``, the split and its largest region when a split has no window.
    """

    split_arguments: tuple[str, ...] = ("seed", "region_size", "val_fraction", "test_fraction")
    """The region hash: ``region_size``, the fractions and ``seed``."""

    task_name = "genome"
    token_unit = "base"
    vocab_size = 5
    alphabet = ALPHABET

    def __init__(self, fasta: list[str] | str | None = None, context_length: int = 1024,
                 batch_size: int = 8, eval_batch_size: int | None = None, num_workers: int = 0,
                 lowercase: Literal["fold", "n", "error"] = "fold",
                 iupac: Literal["n", "error"] = "n", region_size: int = 8192,
                 val_fraction: float = 0.05, test_fraction: float = 0.05, seed: int = 0,
                 max_n_fraction: float = 0.5, train_stride: int = 1,
                 cache_dir: str | None = None) -> None:
        super().__init__()
        checks = [("context_length", context_length >= 1, ">= 1"),
                  ("batch_size", batch_size >= 1, ">= 1"),
                  ("eval_batch_size", eval_batch_size is None or eval_batch_size >= 1, ">= 1"),
                  ("num_workers", num_workers >= 0, ">= 0"),
                  ("region_size", region_size >= 2, ">= 2"),
                  ("val_fraction", 0 <= val_fraction < 1, "in [0, 1)"),
                  ("test_fraction", 0 <= test_fraction < 1, "in [0, 1)"),
                  ("max_n_fraction", 0 <= max_n_fraction <= 1, "in [0, 1]"),
                  ("train_stride", train_stride >= 1, ">= 1")]
        for arg, ok, rule in checks:
            if not ok:
                raise ValueError(f"{arg} must be {rule}, got {locals()[arg]!r}")
        if val_fraction + test_fraction >= 1:
            raise ValueError(f"val_fraction + test_fraction must be < 1, got "
                             f"{val_fraction} + {test_fraction}")
        _check_choice("lowercase", lowercase, ("fold", "n", "error"))
        _check_choice("iupac", iupac, ("n", "error"))
        check_num_workers(num_workers)
        check_seed(seed)
        files = default_fasta() if fasta is None else [fasta] if isinstance(fasta, str) else fasta
        if not files:
            raise ValueError(f"fasta must name at least one file (null: the shipped ones); got {fasta!r}")
        for f in files:
            if not str(f).strip():  # Path("") is ".", which read as "FASTA file not found: ."
                raise ValueError(f"fasta must name FASTA files (null: the shipped ones); got {str(f)!r}")
            text = str(f).strip()
            if text.startswith("[") and text.endswith("]") and not Path(text).expanduser().exists():
                raise ValueError(f"fasta: {text!r} is a list read as one path (YAML reads an unquoted '{{' in a "
                                 f"list as a mapping); quote its entries, e.g. \"['chr{{1..3}}.fa', 'extra.fa']\"")
        if fasta is not None:  # globs, braces, directories: the rule of every mixlab input
            files = [g for f in files for g in (expand_pattern(str(f), "fasta", suffixes=FASTA_SUFFIXES)
                                                if is_pattern(f) else [str(f)])]
            real = [os.path.realpath(os.path.expanduser(f)) for f in files]  # a/../a/x.fa is a/x.fa
            twice = sorted({f for i, f in enumerate(files) if real[i] in real[:i]})
            if twice:  # a directory and a file in it: each file read once
                log.warning("fasta names %d file(s) more than once (read once each): %s", len(twice), twice[:3])
                files = [f for i, f in enumerate(files) if real[i] not in real[:i]]
        if cache_dir and Path(cache_dir).expanduser().exists() and not Path(cache_dir).expanduser().is_dir():
            raise ValueError(f"cache_dir must be a directory (created if missing); got {cache_dir} (a file)")
        self.save_hyperparameters()
        self.fasta = [str(Path(f).expanduser()) for f in files]
        self.context_length, self.region_size, self.seed = context_length, region_size, seed
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size or batch_size
        self.num_workers, self.lowercase, self.iupac = num_workers, lowercase, iupac
        self.val_fraction, self.test_fraction = val_fraction, test_fraction
        self.max_n_fraction, self.train_stride = max_n_fraction, train_stride
        self.cache_dir = cache_dir
        self.records: list[GenomeRecord] = []
        self.regions: dict[str, np.ndarray] = {}  # rec, start, length, split (-1 = dropped)
        self.datasets: dict[str, GenomeCropDataset] = {}

    # -- reading ---------------------------------------------------------------------------
    def _load_file(self, path: Path) -> tuple[list[tuple[str, np.ndarray]], list[str]]:
        """read_fasta, or with ``cache_dir`` a memory-mapped .npy of the encoded file.

        A cache entry that does not read back whole (:func:`_read_cache`) is rebuilt from ``path`` with a
        WARNING naming it (only this entry's own ``genome-<key>`` files are replaced, each by an atomic rename of
        a complete new file).

        Raises:
            ValueError: the cache cannot be written in ``cache_dir`` (names it and the reason); else as
                :func:`read_fasta`.
        """
        if not self.cache_dir:
            return read_fasta(path, self.lowercase, self.iupac)
        _check_file(path)
        st = path.stat()
        key = json.dumps([str(path.resolve()), st.st_mtime_ns, st.st_size, self.lowercase,
                          self.iupac, _CACHE_VERSION])
        digest = hashlib.sha256(key.encode()).hexdigest()[:20]
        stem = Path(self.cache_dir).expanduser() / f"genome-{digest}"
        npy, meta = stem.with_suffix(".npy"), stem.with_suffix(".json")
        cached = None
        if npy.exists() and meta.exists():
            cached, damage = _read_cache(npy, meta)
            if cached is None:
                log.warning("%s: cached encoding %s is damaged (%s); rebuilding it from %s", path, npy, damage,
                            path)
        if cached is not None:
            data, info = cached
            log.info("%s: using cached encoding %s", path, npy)
            for name in info["skipped"]:
                log.warning("%s: record %r has no bases; skipped (cached)", path, name)
        else:
            records, skipped = read_fasta(path, self.lowercase, self.iupac)
            info = {"source": str(path), "skipped": skipped,
                    "names": [(name, len(tokens)) for name, tokens in records]}
            tmp = stem.with_suffix(".tmp.npy")  # written in place: no second copy in memory
            try:
                npy.parent.mkdir(parents=True, exist_ok=True)
                total = sum(n for _, n in info["names"])
                out = np.lib.format.open_memmap(tmp, "w+", np.uint8, (total,))
                pos = 0
                for _, tokens in records:
                    out[pos:pos + len(tokens)] = tokens
                    pos += len(tokens)
                out.flush()
                del out, records
                os.replace(tmp, npy)
                stem.with_suffix(".tmp.json").write_text(json.dumps(info))
                os.replace(stem.with_suffix(".tmp.json"), meta)
            except OSError as err:  # a parent that is a file, no permission, a full disk
                raise ValueError(f"cache_dir {self.cache_dir}: cannot write the genome cache there "
                                 f"({err.strerror or err}: {err.filename or npy}); choose another cache_dir "
                                 f"or none") from None
            data = np.load(npy, mmap_mode="r")
        ends = np.cumsum([n for _, n in info["names"]])
        return ([(name, data[e - n:e]) for (name, n), e in zip(info["names"], ends)],
                info["skipped"])

    # -- splitting -------------------------------------------------------------------------
    def _make_regions(self) -> int:
        """Cut records into regions, drop N-rich ones, assign splits. Returns #dropped."""
        rec, start, length, n_count, u = [], [], [], [], []
        for r, record in enumerate(self.records):
            starts = np.arange(0, len(record.tokens), self.region_size, dtype=np.int64)
            rec.append(np.full(len(starts), r, np.int64))
            start.append(starts)
            length.append(np.minimum(starts + self.region_size, len(record.tokens)) - starts)
            n_count.append(np.add.reduceat(record.tokens == N_ID, starts, dtype=np.int64))
            u.append([_region_hash(record.name, j, self.seed) for j in range(len(starts))])
        rec, start, length, n_count = map(np.concatenate, (rec, start, length, n_count))
        u = np.concatenate([np.asarray(x, np.float64) for x in u])
        split = np.zeros(len(u), np.int64)  # 0 train, 1 val, 2 test, -1 dropped
        split[u < self.val_fraction + self.test_fraction] = 2
        split[u < self.val_fraction] = 1
        dropped = n_count > self.max_n_fraction * length
        split[dropped] = -1
        # Guarantee every split one region that can hold a window (when >= 3 regions can):
        # move the lowest-hash usable region of the split with the most usable regions.
        usable = (split >= 0) & (length >= self.context_length + 1)
        if usable.sum() >= 3:
            for code, frac in enumerate((1.0, self.val_fraction, self.test_fraction)):
                if frac > 0 and not (usable & (split == code)).any():
                    donor = int(np.argmax(np.bincount(split[usable], minlength=3)))
                    pool = np.flatnonzero(usable & (split == donor))
                    split[pool[np.argmin(u[pool])]] = code
        self.regions = {"rec": rec, "start": start, "length": length, "split": split}
        return int(dropped.sum())

    def _region_size_for(self, count: int, records: np.ndarray) -> int | None:
        """The largest region_size below the current one (and >= context_length + 1) that cuts ``records`` (bases
        per record) into at least ``count`` regions that fit a window, N content aside; None if even
        context_length + 1 does not."""
        need = self.context_length + 1
        records = records[records >= need]
        for size in range(min(self.region_size - 1, int(records.max(initial=0))), need - 1, -1):
            if int((records // size).sum() + (records % size >= need).sum()) >= count:
                return size
        return None

    def _check_windows(self) -> None:
        length, split, need = self.regions["length"], self.regions["split"], self.context_length + 1
        kept = length[split >= 0]
        largest = int(kept.max()) if kept.size else 0
        head = f"context_length={self.context_length} needs {need} bases per sample"
        hint = "lower context_length or raise region_size (a crop never crosses a region boundary)"
        if largest < need:
            n_dropped = int((split < 0).sum())
            why = (f"; {n_dropped} of {split.size} region(s) were dropped for holding more than "
                   f"max_n_fraction={self.max_n_fraction} N bases" if n_dropped else "")
            raise ValueError(f"{head}, but the largest region of any split holds {largest} "
                             f"bases (region_size={self.region_size}){why}; "
                             f"{'raise max_n_fraction, or ' if n_dropped else ''}{hint}")
        for code, (name, frac) in enumerate(zip(SPLITS, (1.0, self.val_fraction,
                                                         self.test_fraction))):
            if frac > 0 and len(self.datasets[name]) == 0:
                mine = length[split == code]
                got = (f"its {mine.size} region(s) hold at most {int(mine.max())} bases"
                       if mine.size else "it got no region")
                usable = int((kept >= need).sum())
                if usable < 3:  # too few regions: smaller ones make more (raising region_size makes fewer)
                    records = np.bincount(self.regions["rec"], weights=length).astype(np.int64)  # bases a record
                    size, longest = self._region_size_for(3, records), int(records.max())
                    fix = (f"lower region_size (e.g. {size}: at least {need}) or add data" if size else
                           f"lower context_length and region_size together (the longest record holds {longest} "
                           f"bases: e.g. context_length {max(1, longest // 6)} with region_size "
                           f"{max(2, longest // 3)}), or add data")
                    raise ValueError(f"region_size={self.region_size} gives {usable} region(s) that fit a window of "
                                     f"{need} bases (a context of {self.context_length}); 3 are needed for a "
                                     f"guaranteed split, and the {name} split got none: {fix}")
                raise ValueError(f"{head}, but the {name} split has no window: {got} (largest "
                                 f"region overall: {largest} bases; {usable} region(s) fit a "
                                 f"window, 3 are needed for a guaranteed split); {hint}")

    # -- Lightning hooks -------------------------------------------------------------------
    def prepare_data(self) -> None:
        """Nothing to download; files are parsed in :meth:`setup`."""

    def setup(self, stage: str | None = None) -> None:
        """Parse the FASTA files once (cached on the instance) and build all three datasets."""
        if self.datasets:
            return
        self.records, skipped = [], 0
        for f in self.fasta:
            records, empty = self._load_file(Path(f))
            self.records += [GenomeRecord(name, f, tokens) for name, tokens in records]
            skipped += len(empty)
        dropped = self._make_regions()
        seqs = [r.tokens for r in self.records]
        rg = self.regions
        for code, name in enumerate(SPLITS):
            m = rg["split"] == code
            args = (seqs, rg["rec"][m], rg["start"][m], rg["length"][m], self.context_length)
            self.datasets[name] = (GenomeTrainDataset(*args, self.train_stride) if code == 0
                                   else GenomeEvalDataset(*args))
        try:
            self._check_windows()
        except ValueError:
            self.datasets = {}
            raise
        bases = [int(rg["length"][rg["split"] == c].sum()) for c in range(3)]
        log.info("genome: %d records from %d file(s), %d bases; train %d bases (%d crops), "
                 "val %d bases (%d windows), test %d bases (%d windows); %d of %d regions "
                 "dropped for N > %g; %d records skipped (no bases)", len(self.records),
                 len(self.fasta), sum(len(s) for s in seqs), bases[0], len(self.train_dataset),
                 bases[1], len(self.val_dataset), bases[2], len(self.test_dataset), dropped,
                 len(rg["split"]), self.max_n_fraction, skipped)
        if len(self.train_dataset) > 2**28:
            log.warning("genome: %d training crops; the shuffling sampler permutes all of them "
                        "(8 bytes each) - raise train_stride", len(self.train_dataset))

    train_dataset = property(lambda self: self.datasets["train"], doc="GenomeTrainDataset")
    val_dataset = property(lambda self: self.datasets["val"], doc="GenomeEvalDataset")
    test_dataset = property(lambda self: self.datasets["test"], doc="GenomeEvalDataset")

    def split_loader(self, split: str) -> DataLoader:
        """Loader with a :class:`~mixlab.distributed.ResumableSampler`: rank r of W gets items
        r::W of one seeded order (training: permuted per epoch, tail of n % W dropped;
        evaluation: in order, every window exactly once - padded to even ranks only where the
        forward is collective, see :class:`~mixlab.distributed.ResumableDataModule`).

        ``"train"``: shuffled crops, ``LongTensor [batch_size, context_length + 1]``, drop_last=True;
        ``"val"``/``"test"``: fixed windows in order, ``LongTensor [eval_batch_size, context_length + 1]``.
        """
        self.setup()
        train = split == "train"
        return self.resumable_loader(self.datasets[split], self.batch_size if train
                                     else self.eval_batch_size, train, seed=self.seed,
                                     num_workers=self.num_workers)
