"""A user test of data arguments: each bad value is one line naming the option and the value, never a hang or a
traceback, and nothing is written or removed (no run folder, the user's files and the cache entries kept).

Each refusal is checked once through ``python -m mixlab fit`` in-process (the line the user sees: ``error:
--data.init_args.<key>: <message>``) and the rest by building the datamodule directly (the message itself).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from mixlab import cli
from mixlab.datamodules import mad as M
from mixlab.datamodules import regbench as R
from mixlab.datamodules.copy_mixture import CopyMixtureDataModule
from mixlab.datamodules.digits import DigitsDataModule, load_uci_digits
from mixlab.datamodules.genome import GenomeDataModule, read_fasta
from mixlab.datamodules.parity import ParityDataModule
from mixlab.datamodules.spatial_vqa import SpatialVQADataModule
from mixlab.datamodules.text import TextDataModule
from mixlab.distributed import MAX_NUM_WORKERS

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
SHORT = ["--trainer.max_steps=1", "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
         "--trainer.enable_model_summary=false"]
WORKERS = (f"num_workers must be <= 64 (DataLoader worker processes, each with its own copy of the dataset; this "
           f"machine has {os.cpu_count()} CPU cores); got 1000")


def _error_line(capsys, monkeypatch, tmp_path: Path, config: str, *argv: str) -> str:
    """``python -m mixlab fit --config configs/<config> *argv`` in-process: its one ``error:`` line, after checking
    exit status 2, no traceback and no run folder left under ``--run_root``."""
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    runs = tmp_path / "runs"
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli.main(["fit", "--config", str(CONFIGS / config), *SHORT, "--run_root", str(runs), *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert sorted(p.name for p in runs.rglob("*")) == []  # nothing written
    return lines[0]


# ---------------------------------------------------------------------- through the CLI
@pytest.mark.parametrize(("config", "key", "value", "message"), [
    # hangs: automata generated up front, strings walked symbol by symbol, a process per worker
    ("synthetic/regbench.yaml", "n_train_automata", "1000000000",
     "n_train_automata must be <= 100000 (distinct automata are generated up front in memory, ~0.3 ms each; the "
     "paper's largest training set is 40000); got 1000000000"),
    ("synthetic/regbench.yaml", "max_string_len", "1000000000",
     "max_string_len must keep the default context_length max_strings * (max_string_len + 1) <= 65536 tokens (here "
     "6 * 1000000001); set context_length (longer strings are cut there) or lower it; got 1000000000"),
    ("synthetic/copy_mixture.yaml", "num_workers", "1000", WORKERS),
    # numpy's "expected non-negative integer"
    ("synthetic/mad_in_context_recall.yaml", "seed", "-1",
     "seed must be in [0, 4294967295] (numpy seeds each sample with [seed, split, index]); got -1"),
    ("vqa/goat_digits.yaml", "seed", "-1",
     "seed must be in [0, 4294967295] (numpy seeds each scene with [seed, split, index]); got -1"),
    # torch's "Overflow when unpacking long" when the first loader was built (the sample order's seed)
    ("genome/goat.yaml", "seed", "100000000000000",
     "seed must be in [0, 4294967295] (seeds the split and the sample order); got 100000000000000"),
    ("text/goat.yaml", "seed", "-1", "seed must be in [0, 4294967295] (seeds the split and the sample order); got -1"),
    ("vit/goat_digits.yaml", "seed", "4294967296",
     "seed must be in [0, 4294967295] (seeds the split and the sample order); got 4294967296"),
    # numpy's "high <= 0", an attention reshape of 0 tokens, a run scoring nothing
    ("synthetic/mad_compression.yaml", "vocab", "1",
     "vocab must be >= 2 for task compression (a content token and the compression token); got 1"),
    ("synthetic/mad_memorization.yaml", "seq_len", "1",
     "seq_len must be >= 2 for task memorization (one key-insert pair); got 1"),
    ("synthetic/copy_mixture.yaml", "length", "0", "length must be >= 1; got 0"),
    # numpy's "negative dimensions are not allowed"
    ("synthetic/mad_selective_copy.yaml", "num_tokens_to_copy", "-1",
     "num_tokens_to_copy must be >= 1 for task selective_copy; got -1"),
    # MixViT.grid() TypeError
    ("vit/goat_digits.yaml", "image_size", "[32,32,32]", "image_size must be an int or [H, W]; got [32, 32, 32]"),
    # "unknown []"
    ("vqa/goat_digits.yaml", "question_types", "[]",
     "question_types must name at least one of ['what_at', 'where', 'relation'] (null: all); got []"),
    # "FASTA file not found: ." (Path("") is ".")
    ("genome/goat.yaml", "fasta", "", "fasta must name FASTA files (null: the shipped ones); got ''"),
])
def test_bad_data_values_are_one_line_naming_option_and_value(capsys, monkeypatch, tmp_path, config, key, value,
                                                              message):
    start = time.monotonic()
    line = _error_line(capsys, monkeypatch, tmp_path, config, f"--data.init_args.{key}", value)
    assert line == f"error: --data.init_args.{key}: {message}"
    assert time.monotonic() - start < 60  # refused up front, not after the work it asks for


def test_paths_of_the_wrong_kind_are_one_line_and_kept(capsys, monkeypatch, tmp_path):
    """A file as ``cache_dir`` (FileExistsError traceback from mkdir), a directory as the FASTA or digits file ("file
    not found"), a text file as the ranks file (tiktoken's traceback): named, and left as they were."""
    afile, adir, ranks = tmp_path / "afile", tmp_path / "adir", tmp_path / "bad.tiktoken"
    afile.write_text("x")
    adir.mkdir()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "x.txt").write_text("x")
    (adir / "x.fa").write_text(">r\nACGT\n")
    ranks.write_text("not a ranks file\n")
    cases = [
        ("genome/goat.yaml", "cache_dir", afile, f"cache_dir must be a directory (created if missing); got {afile} "
                                                 f"(a file)"),
        ("genome/goat.yaml", "fasta", tmp_path / "notes", f"directory {str(tmp_path / 'notes')!r} holds no "
                                                          f"file ending in .fa, .fasta, .fna, .fas, .fa.gz, "
                                                          f".fasta.gz, .fna.gz, .fas.gz"),
        ("genome/goat.yaml", "fasta", tmp_path / "*.fna", f"{str(tmp_path / '*.fna')!r} matches no file"),
        ("vit/goat_digits.yaml", "path", adir, f"path must name a CSV file, not a directory; got {adir} (a "
                                               f"directory)"),
        ("text/gpt2_goat.yaml", "tokenizer_file", ranks,
         f"tokenizer_file must be a tiktoken ranks file (lines of '<base64 token> <rank>'); got {ranks}: line "
         f"b'not a ranks file' is not '<base64 token> <rank>'"),
    ]
    for config, key, path, message in cases:
        line = _error_line(capsys, monkeypatch, tmp_path, config, f"--data.init_args.{key}", str(path))
        assert line == f"error: --data.init_args.{key}: {message}"
    assert afile.read_text() == "x" and ranks.read_text() == "not a ranks file\n"
    assert sorted(p.name for p in adir.iterdir()) == ["x.fa"]


def test_a_value_from_a_config_file_names_the_file_and_key(capsys, monkeypatch, tmp_path):
    config = tmp_path / "regbench.yaml"
    config.write_text((CONFIGS / "synthetic/regbench.yaml").read_text().replace(
        "n_train_automata: 500", "n_train_automata: 1000000000"))
    monkeypatch.setattr(sys, "argv", ["mixlab"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli.main(["fit", "--config", str(config), *SHORT, "--run_root", str(tmp_path / "runs")])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert lines == [f"error: {config}: data.init_args.n_train_automata: n_train_automata must be <= 100000 "
                     f"(distinct automata are generated up front in memory, ~0.3 ms each; the paper's largest "
                     f"training set is 40000); got 1000000000"]
    assert not (tmp_path / "runs").exists()


def test_compression_longer_than_the_decoder_is_one_line_before_training(capsys, monkeypatch, tmp_path):
    """``seq_len 64`` with the config's ``max_len 32`` was a cross-entropy shape error in the first step; the head's
    ``setup`` (where it already checks the vocabulary against the datamodule) refuses it, naming ``max_len``."""
    line = _error_line(capsys, monkeypatch, tmp_path, "synthetic/mad_compression.yaml",
                       "--data.init_args.seq_len", "64")
    assert line == (f"error: {CONFIGS / 'synthetic/mad_compression.yaml'}: model.init_args.max_len: max_len must be "
                    ">= the datamodule's seq_len 64 (the compression decoder reconstructs every position; raise "
                    "max_len or lower data.init_args.seq_len); got 32")


# ---------------------------------------------------------------------- the datamodules directly
def _refused(build, message: str, error: type[Exception] = ValueError) -> None:
    with pytest.raises(error) as info:
        build()
    assert str(info.value) == message


@pytest.mark.parametrize("cls", [CopyMixtureDataModule, M.MADDataModule, R.RegBenchDataModule, ParityDataModule])
def test_every_synthetic_task_refuses_a_negative_seed_and_too_many_workers(cls):
    _refused(lambda: cls(seed=-1), "seed must be in [0, 4294967295] (numpy seeds each sample with [seed, split, "
                                   "index]); got -1")
    _refused(lambda: cls(seed=2**32), "seed must be in [0, 4294967295] (numpy seeds each sample with [seed, split, "
                                      "index]); got 4294967296")
    _refused(lambda: cls(num_workers=1000), WORKERS)
    assert MAX_NUM_WORKERS == 64
    cls(seed=2**32 - 1, num_workers=64)  # the limits themselves are taken


def test_num_workers_cap_holds_for_every_datamodule_and_its_loaders():
    for build in (lambda: GenomeDataModule(num_workers=1000), lambda: TextDataModule(num_workers=1000),
                  lambda: DigitsDataModule(num_workers=1000), lambda: SpatialVQADataModule(num_workers=1000)):
        _refused(build, WORKERS)
    dm = CopyMixtureDataModule(n_train=8, batch_size=4)
    dm.num_workers = 1000  # set after construction: the shared loader refuses it too
    _refused(dm.train_dataloader, WORKERS)


@pytest.mark.parametrize(("task", "vocab", "seq_len", "message"), [
    ("in_context_recall", 2, None, "vocab must be >= 4 for task in_context_recall (2 keys and 2 values); got 2"),
    ("in_context_recall", None, 3, "seq_len must be >= 4 for task in_context_recall (2 key-value slots); got 3"),
    ("noisy_recall", 6, None,
     "vocab must be >= 7 for task noisy_recall (half of it noise tokens, then 2 keys and 2 values); got 6"),
    # 3 key tokens give 6 distinct 3-token test keys, fewer than the 8 pairs: the test split's key draw never ended
    ("fuzzy_recall", 8, None, "vocab must be >= 9 for task fuzzy_recall (4 key tokens for 8 distinct 3-token test "
                              "keys, a value token and the pad); got 8"),
    ("selective_copy", 2, None,
     "vocab must be >= 3 for task selective_copy (a content token, the blank and the copy marker); got 2"),
    ("selective_copy", None, 32, "seq_len must be >= 33 for task selective_copy (2 * num_tokens_to_copy + 1 with "
                                 "num_tokens_to_copy=16); got 32"),
    ("compression", None, 1, "seq_len must be >= 2 for task compression (a content token and the compression "
                             "token); got 1"),
    ("memorization", 2, None, "vocab must be >= 3 for task memorization (a key, a value and the insert token); got 2"),
])
def test_mad_vocabularies_and_lengths_below_the_task_least_are_named(task, vocab, seq_len, message):
    _refused(lambda: M.MADDataModule(task, vocab=vocab, seq_len=seq_len), message)


@pytest.mark.parametrize("task", M.TASKS)
def test_mad_task_least_sizes_generate_every_split(task):
    least = M.task_minimums(task)
    dm = M.MADDataModule(task, vocab=least["vocab"][0], seq_len=least["seq_len"][0], n_train=8, n_val=8, n_test=8)
    for split in ("train", "val", "test"):
        for i in range(50):
            sample = dm.dataset(split)[i % 8] if i < 8 else dm.sample(np.random.default_rng([1, 2, i]), split)
            assert (sample["targets"] != M.IGNORE).any()  # something to train on


def test_fuzzy_recall_with_too_few_keys_is_refused_instead_of_looping():
    with pytest.raises(ValueError, match=r"^fuzzy_recall: vocab_size=8 gives 3 key tokens, 6 distinct test keys, "
                                         r"fewer than n_pairs=8$"):
        M.fuzzy_recall(np.random.default_rng(0), vocab_size=8, seq_len=64, test=True)


def test_copy_mixture_refuses_an_empty_vocabulary():
    _refused(lambda: CopyMixtureDataModule(vocab=0), "vocab must be >= 1; got 0")
    _refused(lambda: CopyMixtureDataModule(p_first=float("nan")),
             "copy-mixture needs p_first, p_prev >= 0 and p_first + p_prev <= 1; got nan, 0.3")


def test_regbench_limits_and_long_strings_cut_at_the_context():
    _refused(lambda: R.RegBenchDataModule(n_test_automata=100_001),
             "n_test_automata must be <= 100000 (distinct automata are generated up front in memory, ~0.3 ms each; "
             "the paper's largest training set is 40000); got 100001")
    _refused(lambda: R.RegBenchDataModule(context_length=65_537),
             "context_length must be <= 65536 tokens (samples are built token by token, ~10 us each); got 65537")
    _refused(lambda: R.RegBenchDataModule(max_strings=100_000),
             "max_strings must keep the default context_length max_strings * (max_string_len + 1) <= 65536 tokens "
             "(here 100000 * 50); set context_length (longer strings are cut there) or lower it; got 100000")
    # with a context length set, huge strings are cut where the context ends: the same sample, in no time
    start = time.monotonic()
    dm = R.RegBenchDataModule(n_train_automata=5, n_val_automata=1, n_test_automata=1, max_string_len=10**9,
                              max_strings=10**9, context_length=64)
    assert dm.dataset("train")[0]["inputs"].shape == (64,)
    assert time.monotonic() - start < 10
    autos = [R.random_dfa(np.random.default_rng(i)) for i in range(5)]
    for i in range(200):
        trans, ctx = autos[i % 5], (1, 7, 40, 300)[i % 4]
        whole = R.sample_strings(np.random.default_rng(i), trans, 3, 8, 1, 30)
        cut = R.sample_strings(np.random.default_rng(i), trans, 3, 8, 1, 30, max_tokens=ctx + 1)
        a, b = R.regbench_example(trans, whole, ctx), R.regbench_example(trans, cut, ctx)
        assert all(np.array_equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------- genome, digits and text files
@pytest.fixture(scope="module")
def fasta(tmp_path_factory) -> Path:
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("fasta") / "g.fa"
    path.write_text("".join(f">r{i}\n" + "".join(rng.choice(list("ACGT"), 3000)) + "\n" for i in range(4)))
    return path


def _genome(fasta: Path, cache: Path) -> list[np.ndarray]:
    dm = GenomeDataModule([str(fasta)], context_length=64, region_size=512, cache_dir=str(cache))
    dm.setup()
    return [np.array(r.tokens) for r in dm.records]


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "json"])
def test_a_damaged_genome_cache_entry_is_rebuilt_with_a_warning(tmp_path, fasta, caplog, damage):
    cache = tmp_path / "cache"
    expected = _genome(fasta, cache)
    npy = next(cache.glob("genome-*.npy"))
    meta, good = npy.with_suffix(".json"), npy.read_bytes()
    other = cache / "notes.txt"  # a file of the user's beside the entries: never touched
    other.write_text("keep")
    if damage == "truncated":  # a copy cut short: numpy's "mmap length is greater than file size"
        npy.write_bytes(good[:len(good) // 2])
    elif damage == "garbage":
        npy.write_bytes(b"\x00" * 100)
    elif damage == "empty":
        npy.write_bytes(b"")
    else:
        meta.write_text("{")
    with caplog.at_level(logging.WARNING, logger="mixlab.genome"):
        got = _genome(fasta, cache)
    assert all(np.array_equal(x, y) for x, y in zip(expected, got))
    assert npy.read_bytes() == good and other.read_text() == "keep"
    assert sorted(p.name for p in cache.iterdir()) == sorted([npy.name, meta.name, "notes.txt"])
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and warned[0].startswith(f"{fasta}: cached encoding {npy} is damaged (")
    assert warned[0].endswith(f"); rebuilding it from {fasta}")


def test_a_genome_cache_that_cannot_be_written_is_named(tmp_path, fasta):
    afile = tmp_path / "afile"
    afile.write_text("x")
    dm = GenomeDataModule([str(fasta)], context_length=64, region_size=512, cache_dir=str(afile / "sub"))
    _refused(dm.setup, f"cache_dir {afile / 'sub'}: cannot write the genome cache there (Not a directory: "
                       f"{afile / 'sub'}); choose another cache_dir or none")
    assert afile.read_text() == "x"


def test_directories_and_empty_paths_are_named_as_such(tmp_path):
    _refused(lambda: read_fasta(tmp_path), f"FASTA path is a directory, not a file: {tmp_path} (name the FASTA "
                                           f"files in it)", IsADirectoryError)
    _refused(lambda: load_uci_digits(tmp_path), f"UCI digits path is a directory, not a CSV file: {tmp_path}",
             IsADirectoryError)
    _refused(lambda: GenomeDataModule(fasta=["", "x.fa"]), "fasta must name FASTA files (null: the shipped ones); "
                                                           "got ''")
    _refused(lambda: GenomeDataModule(fasta=[]), "fasta must name at least one file (null: the shipped ones); got []")
    _refused(lambda: DigitsDataModule(path=""), "path must name a CSV file (null: the shipped digits); got ''")
    _refused(lambda: DigitsDataModule(eval_size=[16]), "eval_size must be an int or [H, W]; got [16]")
    _refused(lambda: TextDataModule(tokenizer_file=str(tmp_path)),
             f"tokenizer_file must be a tiktoken ranks file (lines of '<base64 token> <rank>'); got {tmp_path} (a "
             f"directory)")


def test_ranks_files_that_tiktoken_cannot_use_are_named(tmp_path):
    empty, partial = tmp_path / "empty.tiktoken", tmp_path / "ab.tiktoken"
    empty.write_text("")
    partial.write_text("YQ== 0\nYg== 1\n")  # "a" and "b" only: tiktoken panicked on the first other byte
    head = "tokenizer_file must be a tiktoken ranks file (lines of '<base64 token> <rank>'); got"
    _refused(lambda: TextDataModule(tokenizer_file=str(empty)).vocab_size, f"{head} {empty}: it holds no rank")
    _refused(lambda: TextDataModule(tokenizer_file=str(partial)).vocab_size,
             f"{head} {partial}: it lacks 254 of the 256 single-byte tokens (e.g. b'\\x00') that byte-level BPE "
             f"needs")
    assert partial.read_text() == "YQ== 0\nYg== 1\n"


def test_imagenet_worker_count_is_capped_like_the_other_datamodules():
    """The WebDataset loaders are built without ``resumable_loader``: the cap is checked in the constructor."""
    from mixlab.datamodules.imagenet import ImageNetDataModule
    from mixlab.distributed import MAX_NUM_WORKERS

    with pytest.raises(ValueError, match=rf"^num_workers must be <= {MAX_NUM_WORKERS} \(DataLoader worker processes.*"
                                         r"; got 1000$"):
        ImageNetDataModule(format="wds", train_path="/nowhere/{0..3}.tar", num_workers=1000)
    assert ImageNetDataModule(format="wds", train_path="/nowhere/{0..3}.tar", num_workers=MAX_NUM_WORKERS).num_workers \
        == MAX_NUM_WORKERS


def test_fasta_patterns_name_the_files_they_match(tmp_path, caplog):
    """``fasta`` reads patterns as every mixlab input does: a directory (its FASTA files, recursively), a glob and a
    brace pattern name the same sorted files, and the data they give is the data of the files named one by one."""
    rng = np.random.default_rng(1)
    (tmp_path / "g" / "sub").mkdir(parents=True)
    names = ["g/a.fa", "g/sub/b.fasta", "g/c.fna"]
    for name in names:
        (tmp_path / name).write_text(">r\n" + "".join(rng.choice(list("ACGT"), 2000)) + "\n")
    (tmp_path / "g" / "README.txt").write_text("not a genome")
    one_by_one = sorted(str(tmp_path / n) for n in names)
    assert GenomeDataModule(fasta=str(tmp_path / "g")).fasta == one_by_one
    assert GenomeDataModule(fasta=str(tmp_path / "g" / "**" / "*.f*a")).fasta == one_by_one
    assert GenomeDataModule(fasta=str(tmp_path / "g" / "{a.fa,c.fna,sub/b.fasta}")).fasta == \
        [str(tmp_path / n) for n in ("g/a.fa", "g/c.fna", "g/sub/b.fasta")]
    assert GenomeDataModule(fasta=[str(tmp_path / "g/a.fa"), str(tmp_path / "g/c.*")]).fasta == one_by_one[:2]
    assert GenomeDataModule(fasta=f"{tmp_path / 'g/c.fna'}::{tmp_path / 'g/a.fa'}").fasta == one_by_one[1::-1]
    with caplog.at_level(logging.WARNING, logger="mixlab.genome"):  # a directory and a file in it: read once
        assert GenomeDataModule(fasta=[str(tmp_path / "g"), str(tmp_path / "g/a.fa")]).fasta == one_by_one
    assert caplog.messages == [f"fasta names 1 file(s) more than once (read once each): {[one_by_one[0]]}"]
    assert GenomeDataModule(fasta=[str(tmp_path / "g/a.fa"), str(tmp_path / "g/sub/../a.fa")]).fasta == \
        [str(tmp_path / "g/a.fa")]  # the same file by another path
    listed = f"[{tmp_path}/g/{{a,c}}.f*a, {tmp_path}/g/sub/b.fasta]"  # an unquoted brace in a command-line list
    _refused(lambda: GenomeDataModule(fasta=listed), f"fasta: {listed!r} is a list read as one path (YAML reads an "
                                                     f"unquoted '{{' in a list as a mapping); quote its entries, e.g. "
                                                     f"\"['chr{{1..3}}.fa', 'extra.fa']\"")

    def tokens(fasta):
        dm = GenomeDataModule(fasta, context_length=64, region_size=512, val_fraction=0.2, test_fraction=0.2)
        dm.setup("fit")
        return [dm.train_dataset[i] for i in range(0, len(dm.train_dataset), 97)]
    got, expected = tokens(str(tmp_path / "g")), tokens(one_by_one)
    assert len(got) == len(expected) > 3 and all(torch.equal(a, b) for a, b in zip(got, expected))


def test_too_few_regions_name_region_size_and_a_value_that_works(tmp_path):
    """A user test: one 5,000-base file with the default region_size 8192 was told to "lower context_length or
    raise region_size", neither of which helps (one region is one region). Now the line says to lower region_size,
    with a value that gives three regions, and that value trains."""
    rng = np.random.default_rng(2)
    small = tmp_path / "small.fa"
    small.write_text(">s\n" + "".join(rng.choice(list("ACGT"), 5000)) + "\n")
    dm = GenomeDataModule(str(small), context_length=256)
    _refused(lambda: dm.setup("fit"), "region_size=8192 gives 1 region(s) that fit a window of 257 bases (a context "
                                      "of 256); 3 are needed for a guaranteed split, and the val split got none: lower "
                                      "region_size (e.g. 2371: at least 257) or add data")
    dm = GenomeDataModule(str(small), context_length=256, region_size=2371)
    dm.setup("fit")
    assert all(len(dm.datasets[name]) > 0 for name in ("train", "val", "test"))
    tiny = tmp_path / "tiny.fa"
    tiny.write_text(">t\n" + "".join(rng.choice(list("ACGT"), 600)) + "\n")
    _refused(lambda: GenomeDataModule(str(tiny), context_length=256).setup("fit"),
             "region_size=8192 gives 1 region(s) that fit a window of 257 bases (a context of 256); 3 are needed for a "
             "guaranteed split, and the val split got none: lower context_length and region_size together (the "
             "longest record holds 600 bases: e.g. context_length 100 with region_size 200), or add data")
    dm = GenomeDataModule(str(tiny), context_length=100, region_size=200, batch_size=2)
    dm.setup("fit")  # the values the line suggests
    assert all(len(dm.datasets[name]) > 0 for name in ("train", "val", "test"))
