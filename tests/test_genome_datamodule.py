"""GenomeDataModule: FASTA parsing, token values, region splits and every bad-input error."""
import gzip
import logging
import os
import random
import re

import numpy as np
import pytest
import torch

from mixlab.datamodules import genome
from mixlab.datamodules.genome import GenomeDataModule, encode_sequence

IDS = {"A": 0, "C": 1, "G": 2, "T": 3, "N": 4}
IUPAC = "RYKMSWBDHV"


def expected_ids(seq: str, lowercase: str = "fold") -> list[int]:
    """Independent reference: a dict lookup per character."""
    out = []
    for ch in seq:
        if ch.islower() and lowercase == "n":
            out.append(4)
        else:
            up = ch.upper()
            out.append(4 if up in IUPAC else IDS[up])
    return out


def fasta_text(records: dict[str, str], width: int = 7) -> str:
    lines = []
    for header, seq in records.items():
        lines.append(f">{header}")
        lines += [seq[i:i + width] for i in range(0, len(seq), width)]
    return "\n".join(lines) + "\n"


def write(path, text: str | bytes, gz: bool = False):
    data = text.encode() if isinstance(text, str) else text
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def random_dna(n: int, rng: random.Random, alphabet: str = "ACGT") -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def make(paths, **kw) -> GenomeDataModule:
    kw = {"context_length": 15, "region_size": 64, "val_fraction": 0.2, "test_fraction": 0.2,
          "max_n_fraction": 1.0, **kw}
    dm = GenomeDataModule(fasta=[str(p) for p in paths], **kw)
    dm.setup("fit")
    return dm


RNG = random.Random(1234)
RECORDS = {
    "chr1 first record": (random_dna(150, RNG) + "acgtnacgt" + "N" * 20 + "RYKMSWBDHV"
                          + random_dna(90, RNG)),
    "chrX": "nnnn" + random_dna(300, RNG, "ACGTacgt") + "rykmswbdhv" + "NNNNNnnnnn",
    "scaffold_3": random_dna(200, RNG, "ACGTN"),
}


# -- round trip --------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["plain", "gz", "gz_no_suffix", "crlf", "cr"])
def test_round_trip(tmp_path, variant):
    text = fasta_text(RECORDS)
    if variant == "crlf":
        text = text.replace("\n", "\r\n")
    elif variant == "cr":
        text = text.replace("\n", "\r")
    name = {"gz": "g.fa.gz", "gz_no_suffix": "g.fasta"}.get(variant, "g.fa")
    path = write(tmp_path / name, text, gz=variant.startswith("gz"))
    dm = make([path])
    assert [r.name for r in dm.records] == ["chr1", "chrX", "scaffold_3"]
    for rec, seq in zip(dm.records, RECORDS.values()):
        assert rec.tokens.dtype == np.uint8
        assert rec.tokens.tolist() == expected_ids(seq)
        assert rec.path == str(path)


def test_several_files_and_string_argument(tmp_path):
    a = write(tmp_path / "a.fa", fasta_text({"a": "ACGT" * 40}))
    b = write(tmp_path / "b.fa.gz", fasta_text({"b": "TTGCA" * 40}), gz=True)
    assert [r.name for r in make([a, b]).records] == ["a", "b"]
    dm = GenomeDataModule(fasta=str(a), context_length=15, region_size=16)
    dm.setup()
    assert dm.records[0].tokens.tolist() == [0, 1, 2, 3] * 40


@pytest.mark.parametrize("lowercase", ["fold", "n"])
def test_lowercase_modes(tmp_path, lowercase):
    path = write(tmp_path / "l.fa", fasta_text(RECORDS))
    dm = make([path], lowercase=lowercase)
    for rec, seq in zip(dm.records, RECORDS.values()):
        assert rec.tokens.tolist() == expected_ids(seq, lowercase)


def test_lowercase_error_names_file_and_record(tmp_path):
    path = write(tmp_path / "soft.fa", ">up\nACGTACGT\n>masked\nACGTacgt\n")
    with pytest.raises(ValueError, match=r"soft\.fa.*'masked'.*'a'.*position 5.*lowercase"):
        make([path], lowercase="error")
    # upper-case-only data passes in error mode
    ok = write(tmp_path / "up.fa", ">up\n" + "ACGTN" * 40 + "\n")
    assert make([ok], lowercase="error").records[0].tokens.tolist() == [0, 1, 2, 3, 4] * 40


def test_iupac_modes(tmp_path):
    path = write(tmp_path / "amb.fa", ">r1\n" + "ACGT" * 40 + "\n>r2\n" + "ACGTRYkm" * 20 + "\n")
    assert make([path]).records[1].tokens.tolist() == [0, 1, 2, 3, 4, 4, 4, 4] * 20
    with pytest.raises(ValueError, match=r"amb\.fa.*'r2'.*'R'.*iupac"):
        make([path], iupac="error")
    assert encode_sequence("acgtRYKMSWBDHVrykmswbdhvNn").tolist() == [0, 1, 2, 3] + [4] * 22


def test_encode_sequence_is_vectorised_lookup():
    seq = "ACGTNacgtn" * 1000
    assert encode_sequence(seq).tolist() == expected_ids(seq)
    assert encode_sequence(seq.encode(), lowercase="n").tolist() == expected_ids(seq, "n")
    with pytest.raises(ValueError, match="lowercase must be one of"):
        encode_sequence("A", lowercase="upper")


# -- splits ------------------------------------------------------------------------------
def split_windows(dm):
    """(split, record index, start, end) of every window of every split."""
    out = []
    for split in ("train", "val", "test"):
        ds = dm.datasets[split]
        for i in range(len(ds)):
            r, s = ds.locate(i)
            out.append((split, r, s, s + dm.context_length + 1))
    return out


@pytest.fixture
def multi_record_file(tmp_path):
    rng = random.Random(7)
    recs = {f"contig{i}": random_dna(n, rng) for i, n in enumerate([2000, 700, 3100, 90, 1500])}
    return write(tmp_path / "multi.fa", fasta_text(recs, width=60)), recs


def test_splits_do_not_overlap_and_stay_in_regions(multi_record_file):
    path, recs = multi_record_file
    dm = make([path], context_length=31, region_size=128, train_stride=5)
    label = [np.full(len(s), -1) for s in recs.values()]
    codes = {"train": 0, "val": 1, "test": 2}
    counts = {k: 0 for k in codes}
    for split, r, s, e in split_windows(dm):
        assert s // 128 == (e - 1) // 128, "a window crosses a region boundary"
        assert e <= len(label[r])
        seen = set(label[r][s:e].tolist()) - {-1}
        assert seen <= {codes[split]}, f"{split} window {r}:{s}-{e} overlaps {seen}"
        label[r][s:e] = codes[split]
        counts[split] += 1
    assert all(counts.values())
    # val/test windows are fixed tiles: non-overlapping, aligned to their region start
    for split in ("val", "test"):
        starts = [(r, s) for sp, r, s, _ in split_windows(dm) if sp == split]
        assert all((s % 128) % 32 == 0 for _, s in starts)
        assert len(set(starts)) == len(starts)


def test_split_is_deterministic_and_seeded(multi_record_file):
    path, _ = multi_record_file
    a, b = make([path], seed=3, region_size=100), make([path], seed=3, region_size=100)
    c = make([path], seed=4, region_size=100)
    assert np.array_equal(a.regions["split"], b.regions["split"])
    assert split_windows(a) == split_windows(b)
    assert not np.array_equal(a.regions["split"], c.regions["split"])


def test_split_fractions_and_guarantee(tmp_path):
    rng = random.Random(0)
    path = write(tmp_path / "big.fa", fasta_text({"big": random_dna(40 * 500, rng)}, 80))
    dm = make([path], region_size=40, val_fraction=0.1, test_fraction=0.2)
    frac = np.bincount(dm.regions["split"], minlength=3) / 500
    assert abs(frac[1] - 0.1) < 0.05 and abs(frac[2] - 0.2) < 0.06
    # three regions and tiny fractions: still one val and one test region
    small = write(tmp_path / "small.fa", fasta_text({"s": random_dna(3 * 64, rng)}))
    dm = make([small], val_fraction=0.001, test_fraction=0.001)
    assert sorted(dm.regions["split"].tolist()) == [0, 1, 2]


def test_n_rich_regions_dropped_and_logged(tmp_path, caplog):
    seq = "ACGT" * 64 + "N" * 40 + "ACGTACGTACGTACGTACGTACGT" + "ACGT" * 48
    path = write(tmp_path / "n.fa", fasta_text({"r": seq}))
    with caplog.at_level(logging.INFO, logger="mixlab.genome"):
        dm = make([path], max_n_fraction=0.5)
    assert dm.regions["split"].tolist()[4] == -1  # region 4 (bases 256..319) is 62% N
    assert (dm.regions["split"] >= 0).sum() == len(dm.regions["split"]) - 1
    assert re.search(r"1 of 8 regions dropped for N", caplog.text)


def test_train_items_equal_documented_slices(multi_record_file):
    path, recs = multi_record_file
    seqs = list(recs.values())
    dm = make([path], context_length=31, region_size=128, train_stride=3)
    # the i-th valid start, computed independently from the region table
    expected_starts = []
    rg = dm.regions
    for r, a, n, sp in zip(rg["rec"], rg["start"], rg["length"], rg["split"]):
        if sp == 0:
            expected_starts += [(int(r), int(s)) for s in range(a, a + n - 32 + 1, 3)]
    ds = dm.train_dataset
    assert len(ds) == len(expected_starts)
    for i in [0, 1, 2, len(ds) // 2, len(ds) - 1]:
        r, s = expected_starts[i]
        item = ds[i]
        assert item.dtype == torch.long and item.shape == (32,)
        assert item.tolist() == expected_ids(seqs[r][s:s + 32])
    batch = next(iter(dm.train_dataloader()))
    assert batch.shape == (dm.batch_size, 32) and batch.dtype == torch.long


def test_cache_dir_reuses_encoding(tmp_path, monkeypatch, multi_record_file, caplog):
    path, recs = multi_record_file
    path.write_text(fasta_text(recs) + ">empty_one\n")
    cache = tmp_path / "cache"
    first = make([path], cache_dir=str(cache))
    assert len(list(cache.glob("genome-*.npy"))) == 1

    def boom(*a, **k):
        raise AssertionError("should have used the cache")

    monkeypatch.setattr(genome, "read_fasta", boom)
    with caplog.at_level(logging.INFO, logger="mixlab.genome"):
        second = make([path], cache_dir=str(cache))
    assert "'empty_one' has no bases" in caplog.text and "1 records skipped" in caplog.text
    for x, y in zip(first.records, second.records):
        assert x.name == y.name and np.array_equal(x.tokens, y.tokens)
    assert split_windows(first) == split_windows(second)
    os.utime(path, ns=(1, 1))  # a changed mtime invalidates the cache entry
    with pytest.raises(AssertionError, match="cache"):
        make([path], cache_dir=str(cache))


# -- bad input ---------------------------------------------------------------------------
@pytest.mark.parametrize("name, content, pattern", [
    ("empty.fa", b"", r"empty\.fa is empty"),
    ("blank.fa", b"\n  \n\n", r"blank\.fa is empty"),
    ("noheader.fa", b"ACGTACGT\nACGT\n", r"noheader\.fa is not FASTA"),
    ("garbage.bin", bytes(range(256)) * 4, r"garbage\.bin is not FASTA"),
    ("preamble.fa", b"made by a tool\n>r\nACGT\n", r"preamble\.fa is not FASTA"),
    # the offending character is shown (the message used to quote the stripped line: ">r", which looks fine)
    ("space.fa", b" >r\nACGT\n", r"space\.fa is not FASTA: the first non-empty line does not start with '>' "
                                  r"\(its first bytes are b' >r': 1 whitespace character\(s\) come before '>'\)$"),
    ("bom.fa", b"\xef\xbb\xbf>r\nACGT\n", r"bom\.fa is not FASTA: .*\(its first bytes are b'\\xef\\xbb\\xbf>r': a "
                                          r"UTF-8 byte-order mark comes before it; save the file without the mark\)$"),
    ("fake.fa.gz", b">r\nACGT\n", r"cannot read FASTA file .*fake\.fa\.gz"),
    ("allempty.fa", b">a\n>b\n\n", r"allempty\.fa: no record has any bases"),
    ("digits.fa", b">ok\nACGT\n>bad\nACG7T\n", r"digits\.fa: record 'bad'.*'7' at position 4"),
    ("star.fa", b">p\nACGT*\n", r"star\.fa: record 'p'.*'\*'"),
])
def test_bad_files_raise_naming_the_file(tmp_path, name, content, pattern):
    path = write(tmp_path / name, content)
    with pytest.raises(ValueError, match=pattern):
        make([path])


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"not found: .*nope\.fa"):
        make([tmp_path / "nope.fa"])


def test_empty_record_skipped_with_warning(tmp_path, caplog):
    path = write(tmp_path / "gap.fa", ">empty1\n>full\n" + "ACGT" * 50 + "\n>empty2\n")
    with caplog.at_level(logging.INFO, logger="mixlab.genome"):
        dm = make([path])
    assert [r.name for r in dm.records] == ["full"]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("'empty1'" in m and "gap.fa" in m for m in warned)
    assert any("'empty2'" in m for m in warned)
    assert "2 records skipped" in caplog.text


def test_context_length_too_long(tmp_path):
    path = write(tmp_path / "short.fa", fasta_text({"r": "ACGT" * 100}))
    with pytest.raises(ValueError, match=r"context_length=64 needs 65 bases.*largest region of "
                                         r"any split holds 64 bases.*raise region_size"):
        make([path], context_length=64, region_size=64)
    # every region dropped for its N content: the message says so (a user test found "holds 0 bases")
    path = write(tmp_path / "all_n.fa", fasta_text({"r": "N" * 500}))
    with pytest.raises(ValueError, match=r"holds 0 bases \(region_size=64\); 8 of 8 region\(s\) were dropped for "
                                         r"holding more than max_n_fraction=.* N bases; "
                                         r"raise max_n_fraction, or lower"):
        make([path], context_length=32, region_size=64, max_n_fraction=0.5)
    # 160 bases = regions of 64, 64, 32: a window fits, but only two regions can hold one; 59 makes 59, 59, 42
    path = write(tmp_path / "tail.fa", fasta_text({"r": "ACGT" * 40}))
    with pytest.raises(ValueError, match=r"region_size=64 gives 2 region\(s\) that fit a window of 41 bases \(a "
                                         r"context of 40\); 3 are needed for a guaranteed split, and the (val|test) "
                                         r"split got none: lower region_size \(e.g. 59: at least 41\) or add data"):
        make([path], context_length=40, val_fraction=0.3, test_fraction=0.3)
    dm = make([path], context_length=40, region_size=59, val_fraction=0.3, test_fraction=0.3)
    assert all(len(dm.datasets[name]) > 0 for name in ("train", "val", "test"))


@pytest.mark.parametrize("kwargs, arg", [
    ({"context_length": 0}, "context_length"),
    ({"region_size": 1}, "region_size"),
    ({"val_fraction": 1.0}, "val_fraction"),
    ({"test_fraction": -0.1}, "test_fraction"),
    ({"val_fraction": 0.5, "test_fraction": 0.5}, "val_fraction \\+ test_fraction"),
    ({"batch_size": 0}, "batch_size"),
    ({"train_stride": 0}, "train_stride"),
    ({"max_n_fraction": 1.5}, "max_n_fraction"),
    ({"lowercase": "upper"}, "lowercase"),
    ({"iupac": "x"}, "iupac"),
    ({"fasta": []}, "fasta"),
])
def test_invalid_arguments(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        GenomeDataModule(**kwargs)


# -- embedded real data ------------------------------------------------------------------
def test_embedded_default_human_dna():
    paths = genome.default_fasta()
    n_expected = 0
    for p in paths:
        with open(p) as fh:
            n_expected += sum(len(line.strip()) for line in fh if not line.startswith(">"))
    assert n_expected == 200001 + 40000 + 16569
    dm = GenomeDataModule(context_length=256)
    dm.setup("fit")
    assert dm.vocab_size == 5 and dm.alphabet == "ACGTN" and dm.task_name == "genome"
    assert sum(len(r.tokens) for r in dm.records) == n_expected
    assert [r.name for r in dm.records] == ["chr22:16600000-16800000", "chr17", "MT_human"]
    with open(paths[2]) as fh:  # chrM starts GATCACAGGT
        first = fh.read().split("\n", 1)[1][:10]
    assert dm.records[2].tokens[:10].tolist() == expected_ids(first)
    assert all(len(dm.datasets[s]) > 0 for s in ("train", "val", "test"))
    batch = next(iter(dm.val_dataloader()))
    assert batch.shape[1] == 257 and int(batch.max()) <= 4
