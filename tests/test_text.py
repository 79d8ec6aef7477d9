"""Text datamodule: offline GPT-2 BPE round trip, readers, packing, splits, pre-tokenised shards."""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mixlab.datamodules.text import (
    ByteTokenizer,
    GPT2Tokenizer,
    TextDataModule,
    TokenWindows,
    iter_documents,
    pack_documents,
    shipped_file,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpt2():
    return GPT2Tokenizer()


def test_gpt2_known_ids_and_round_trip(gpt2):
    # reference GPT-2 ids (r50k): "Hello world" -> [15496, 995]; " the" -> 262
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.encode(" the") == [262]
    assert gpt2.vocab_size == 50257 and gpt2.eos_id == 50256
    for text in ["Hello world", "  leading spaces\n\nand\ttabs ", "caf\u00e9 \u65e5\u672c\u8a9e \U0001f600",
                 "ROMEO:\nBut, soft! what light through yonder window breaks?", "<|endoftext|> literal"]:
        ids = gpt2.encode(text)
        assert gpt2.decode(ids) == text
        assert 50256 not in ids  # the literal special string is ordinary text


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "caf\u00e9\n\U0001f600"
    ids = tok.encode(text)
    assert ids[:3] == [99, 97, 102] and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids + [tok.eos_id]) == text


def test_pack_and_windows_values():
    packed = pack_documents([[1, 2], [3]], eos_id=9)
    assert packed.tolist() == [1, 2, 9, 3, 9]
    ds = TokenWindows([np.arange(10), np.arange(100, 104)], length=4, stride=3)
    # first array: starts 0, 3, 6; second: start 0 only
    assert len(ds) == 4
    assert ds[1].tolist() == [3, 4, 5, 6] and ds[3].tolist() == [100, 101, 102, 103]
    assert ds[0].dtype == torch.int64


def test_readers(tmp_path):
    (tmp_path / "a.txt").write_text("plain doc")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as fh:
        fh.write(json.dumps({"text": "json one"}) + "\n\n" + json.dumps({"text": "json two", "id": 3}) + "\n")
    import webdataset as wds

    with wds.TarWriter(str(tmp_path / "c.tar")) as w:
        w.write({"__key__": "s0", "txt": "wds text"})
        w.write({"__key__": "s1", "json": json.dumps({"text": "wds json"}).encode()})
    docs = list(iter_documents(tmp_path))
    assert docs == ["plain doc", "json one", "json two", "wds text", "wds json"]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1.*text_field"):
        list(iter_documents(tmp_path / "bad.jsonl"))
    with pytest.raises(FileNotFoundError, match="matches no file"):
        list(iter_documents(tmp_path / "missing*.txt"))
    if importlib.util.find_spec("pyarrow") is None:
        (tmp_path / "d.parquet").write_bytes(b"PAR1")
        with pytest.raises(ImportError, match="pyarrow"):
            list(iter_documents(tmp_path / "d.parquet"))


def test_tinyshakespeare_split_and_batches():
    dm = TextDataModule(tokenizer="byte", context_length=32, batch_size=4)
    splits = dm.token_splits()
    n_bytes = len(shipped_file("tinyshakespeare.txt").read_bytes())
    train, val = splits["train"][0], splits["val"][0]
    assert len(train) + len(val) == n_bytes + 1  # + the document's EOS
    assert val[-1] == 256 and abs(len(val) / (n_bytes + 1) - 0.1) < 1e-3
    batch = next(iter(dm.val_dataloader()))
    assert batch.shape == (4, 33) and torch.equal(batch[0], torch.as_tensor(val[:33].astype(np.int64)))
    assert dm.vocab_size == 257 and dm.token_unit == "byte" and dm.task_name == "text"


def test_multi_document_split_shares_no_document(tmp_path):
    for i in range(30):
        (tmp_path / f"d{i:02d}.txt").write_text(f"document number {i} " * 3)
    dm = TextDataModule(path=str(tmp_path), tokenizer="byte", context_length=8, val_fraction=0.2, seed=1)
    sp = dm.token_splits()
    decode = lambda a: bytes(int(x) for x in a if x < 256).decode()  # noqa: E731
    train_text, val_text = decode(sp["train"][0]), decode(sp["val"][0])
    val_docs = {f"document number {i} " * 3 for i in range(30) if f"document number {i} " * 3 in val_text}
    assert val_docs and all(d not in train_text for d in val_docs)
    assert (sp["train"][0] == 256).sum() + (sp["val"][0] == 256).sum() == 30


def test_pretokenize_shards_match_in_memory(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import pretokenize
    finally:
        sys.path.pop(0)
    with open(tmp_path / "corpus.jsonl", "w") as fh:
        for i in range(20):
            fh.write(json.dumps({"text": f"Doc {i}: to be or not to be."}) + "\n")
    meta = pretokenize.main(["--input", str(tmp_path / "corpus.jsonl"), "--out", str(tmp_path / "tok"),
                             "--shard-tokens", "50", "--val-fraction", "0.1"])
    assert meta["tokenizer"] == "gpt2" and meta["documents"] == 20
    assert len(meta["shards"]["train"]) > 1  # several 50-token shards
    dm = TextDataModule(tokens_dir=str(tmp_path / "tok"), tokenizer="gpt2", context_length=8)
    sp = dm.token_splits()
    all_tokens = np.concatenate(sp["train"] + sp["val"])
    tok = GPT2Tokenizer()
    expected = sum(len(tok.encode(f"Doc {i}: to be or not to be.")) + 1 for i in range(20))
    assert len(all_tokens) == meta["tokens"] == expected
    assert (all_tokens == 50256).sum() == 20
    assert tok.decode([t for t in sp["val"][0] if t != 50256]).startswith("Doc 0:")
    assert next(iter(dm.train_dataloader())).shape == (16, 9) or len(dm.windows("train", 9)) < 16


def test_one_shard_pattern_rule_for_text_and_image_inputs(tmp_path):
    """Text WebDataset shards named by a brace pattern used to "match no file" while the image datamodule
    took braces and refused globs: both read braces, globs, folders and ``::`` lists through one function."""
    import webdataset as wds

    from mixlab.datamodules.files import expand_pattern
    from mixlab.datamodules.imagenet import expand_shards
    from mixlab.datamodules.text import expand_paths

    for i in range(3):
        with wds.TarWriter(str(tmp_path / f"text-{i:03d}.tar")) as w:
            w.write({"__key__": f"s{i}", "txt": f"shard {i}"})
    names = [str(tmp_path / f"text-{i:03d}.tar") for i in range(3)]
    for pattern in ("text-{000..002}.tar", "text-*.tar", "text-00[0-2].tar", "text-{000..001}.tar::text-002.tar"):
        full = "::".join(str(tmp_path / p) for p in pattern.split("::"))
        assert [str(p) for p in expand_paths(full)] == names, pattern
        assert expand_shards(full, "train_path") == names, pattern
    assert list(iter_documents(str(tmp_path / "text-{000..002}.tar"))) == ["shard 0", "shard 1", "shard 2"]
    assert expand_shards(str(tmp_path), "train_path") == names  # a folder of shards
    assert expand_shards("pipe:curl -s http://x/a-{0..1}.tar", "train_path") == ["pipe:curl -s http://x/a-0.tar",
                                                                               "pipe:curl -s http://x/a-1.tar"]
    with pytest.raises(FileNotFoundError, match=r"^data.init_args.path: 2 of 5 files from pattern .*text-\{000\.\.004\}"
                                                r"\.tar' do not exist, e.g. \[.*text-003.tar', .*text-004.tar'\]$"):
        expand_paths(str(tmp_path / "text-{000..004}.tar"))
    with pytest.raises(FileNotFoundError, match=r"^train_path: '.*nope-\*.tar' matches no shard$"):
        expand_shards(str(tmp_path / "nope-*.tar"), "train_path")
    assert expand_pattern([str(tmp_path / "text-002.tar"), str(tmp_path / "text-000.tar")]) == [names[2], names[0]]


def _pretokenize():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import pretokenize
    finally:
        sys.path.pop(0)
    return pretokenize


def test_pretokenize_splits_a_one_document_corpus_like_the_in_memory_loader(tmp_path, capsys):
    """The shipped tinyshakespeare is one document: all of it used to go to val_00000.bin, no train shard,
    and the script reported success; now its last val_fraction is val, as TextDataModule splits it."""
    meta = _pretokenize().main(["--input", str(shipped_file("tinyshakespeare.txt")), "--out", str(tmp_path / "tok"),
                                "--tokenizer", "byte", "--val-fraction", "0.1"])
    n = len(shipped_file("tinyshakespeare.txt").read_bytes()) + 1
    assert meta["documents"] == 1 and meta["tokens"] == n and meta["dtype"] == "uint16"
    assert [s["tokens"] for s in meta["shards"]["train"]] == [round(n * 0.9)]
    assert [s["tokens"] for s in meta["shards"]["val"]] == [n - round(n * 0.9)]
    from_shards = TextDataModule(tokens_dir=str(tmp_path / "tok"), tokenizer="byte").token_splits()
    in_memory = TextDataModule(tokenizer="byte", val_fraction=0.1).token_splits()
    for split in ("train", "val"):
        assert np.array_equal(np.concatenate(from_shards[split]), in_memory[split][0]), split


def test_pretokenize_never_reports_success_with_an_empty_split(tmp_path, capsys):
    for i in range(2):
        (tmp_path / f"d{i}.txt").write_text(f"document {i}")
    with pytest.raises(SystemExit) as info:  # the first document goes to val, the second (p = 0.99) too
        _pretokenize().main(["--input", str(tmp_path / "d*.txt"), "--out", str(tmp_path / "tok"), "--tokenizer",
                             "byte", "--val-fraction", "0.99"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()  # after the progress bar's lines
    assert err[-1] == (f"pretokenize.py: error: --input {tmp_path / 'd*.txt'}: 2 document(s), 22 tokens leave the "
                       f"train split empty at --val-fraction 0.99; add documents or change --val-fraction "
                       f"(nothing written)")
    assert not (tmp_path / "tok").exists()  # the folder the failed run created is gone
    with pytest.raises(SystemExit):
        _pretokenize().main(["--input", str(tmp_path / "d0.txt"), "--out", str(tmp_path / "tok"),
                             "--val-fraction", "0"])
    assert capsys.readouterr().err.strip().startswith("pretokenize.py: error: --val-fraction must be in (0, 1), "
                                                      "got 0.0")
    with pytest.raises(SystemExit):  # the reader's message names the script's option, not the datamodule's
        _pretokenize().main(["--input", str(tmp_path / "none*.txt"), "--out", str(tmp_path / "tok")])
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("pretokenize.py: error: --input: ") and "matches no file" in err[-1]


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under ``root``, by relative path."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def test_a_failed_pretokenize_leaves_the_out_folder_as_it_was(tmp_path, capsys):
    """A user test: a failed run left an empty (or partial) --out folder behind. Now it removes a folder it
    created (and the parents it made for it), and an existing folder keeps exactly its earlier files, also
    one the run would have overwritten."""
    (tmp_path / "in").mkdir()
    with open(tmp_path / "in" / "corpus.jsonl", "w") as fh:  # record 30 has no text field
        for i in range(40):
            fh.write(json.dumps({"text": f"document {i} " * 3} if i != 29 else {"body": "x"}) + "\n")
    bad = ["--input", str(tmp_path / "in" / "corpus.jsonl"), "--tokenizer", "byte", "--shard-tokens", "16",
           "--batch-docs", "4", "--val-fraction", "0.2"]  # shards written before record 30 is read
    want = f"pretokenize.py: error: {tmp_path / 'in' / 'corpus.jsonl'}:30: no text field 'text' " \
           f"(data.init_args.text_field); found ['body']"
    none = f"pretokenize.py: error: --input: '{tmp_path / 'none*.txt'}' matches no file"
    before = _tree(tmp_path)
    # a new folder: the input matches no file (checked before anything is made), a record cannot be read
    for argv, says in ((["--input", str(tmp_path / "none*.txt")], none), (bad, want)):
        with pytest.raises(SystemExit) as info:
            _pretokenize().main([*argv, "--out", str(tmp_path / "new" / "deep" / "tok")])
        assert info.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1] == says
        assert _tree(tmp_path) == before
    # an existing folder: its files stay as they were (a shard name the run writes included), nothing is added
    old = tmp_path / "old"
    (old / "sub").mkdir(parents=True)
    (old / "train_00000.bin").write_bytes(b"earlier shard")
    (old / "notes.txt").write_text("keep me")
    before = _tree(tmp_path)
    with pytest.raises(SystemExit) as info:
        _pretokenize().main([*bad, "--out", str(old)])
    assert info.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1] == want
    assert _tree(tmp_path) == before
    assert sorted(_tree(old)) == ["notes.txt", "sub", "train_00000.bin"]
    # the readable part of the input: the run succeeds into the existing folder, whose other files stay
    meta = _pretokenize().main([*bad, "--max-docs", "29", "--out", str(old)])  # stops before record 30
    assert meta["documents"] == 29
    files = sorted(_tree(old))
    assert [f for f in files if not f.endswith(".bin")] == ["meta.json", "notes.txt", "sub"]
    assert sorted(f for f in files if f.endswith(".bin")) == sorted(
        s["file"] for split in ("train", "val") for s in meta["shards"][split])


def test_pretokenize_refuses_shard_tokens_below_one(tmp_path, capsys):
    """``--shard-tokens 0`` looped forever in ShardWriter.add; now one line before anything is written."""
    (tmp_path / "d.txt").write_text("a document")
    with pytest.raises(SystemExit) as info:
        _pretokenize().main(["--input", str(tmp_path / "d.txt"), "--out", str(tmp_path / "tok"), "--tokenizer",
                             "byte", "--shard-tokens", "0"])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip() == "pretokenize.py: error: --shard-tokens must be >= 1, got 0"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.txt"]


@pytest.fixture(scope="module")
def big_ranks(tmp_path_factory):
    """A tiktoken ranks file of 65,796 tokens: every byte, every byte pair, and " the", "the", "and", "ing"
    ranked above 65,535 (so their ids do not fit uint16)."""
    import base64

    tokens = [bytes([i]) for i in range(256)] + [bytes([a, b]) for a in range(256) for b in range(256)]
    tokens += [b"the", b" the", b"and", b"ing"]
    path = tmp_path_factory.mktemp("ranks") / "big.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))
    return path


def test_a_tokenizer_above_65536_ids_sets_the_vocab_and_stores_uint32(big_ranks, tmp_path):
    """A tiktoken ranks file of more than 65,536 ids: numpy's OverflowError in the text datamodule and in
    pretokenize.py, and a vocab_size fixed at 50257. Now the vocabulary comes from the tokenizer (EOS after
    the last rank) and ids are stored as uint32 (meta.json says so)."""
    tok = GPT2Tokenizer(big_ranks)
    assert tok.eos_id == 65796 and tok.vocab_size == 65797
    text = "the king and the singing"
    ids = tok.encode(text)
    assert max(ids) > 65535 and tok.decode(ids) == text
    (tmp_path / "doc.txt").write_text(text * 40)
    dm = TextDataModule(path=str(tmp_path / "doc.txt"), tokenizer_file=str(big_ranks), context_length=8)
    assert dm.vocab_size == 65797
    sp = dm.token_splits()
    stream = np.concatenate([sp["train"][0], sp["val"][0]])
    assert stream.dtype == np.uint32 and stream.tolist() == tok.encode(text * 40) + [65796]
    meta = _pretokenize().main(["--input", str(tmp_path / "doc.txt"), "--out", str(tmp_path / "tok"),
                                "--tokenizer-file", str(big_ranks), "--val-fraction", "0.1"])
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 65797 and meta["eos_id"] == 65796
    shards = TextDataModule(tokens_dir=str(tmp_path / "tok"), tokenizer_file=str(big_ranks))
    assert shards.vocab_size == 65797
    got = shards.token_splits()
    assert np.array_equal(np.concatenate(got["train"] + got["val"]), stream)


def test_token_dtype_is_the_smallest_that_holds_the_vocabulary_and_refuses_the_rest():
    from mixlab.datamodules.text import token_dtype

    assert [token_dtype(v).name for v in (256, 257, 50257, 65536, 65537, 2**32)] == \
        ["uint8", "uint16", "uint16", "uint16", "uint32", "uint32"]
    with pytest.raises(ValueError, match="vocabulary of 4,294,967,297 ids cannot be stored as token ids: the "
                                         "largest token dtype, uint32, holds 4,294,967,296"):
        token_dtype(2**32 + 1)
    with pytest.raises(ValueError, match=r"^token id 70000 does not fit uint16 token arrays \(at most 65535\); "
                                         r"store them as uint32$"):
        pack_documents([[1, 70000]], eos_id=2, dtype=np.uint16)
    assert pack_documents([[1, 70000]], eos_id=2).dtype == np.uint32


@pytest.mark.parametrize(("option", "value", "says"), [
    ("context_length", -1, "data.init_args.context_length must be >= 1; got -1"),
    ("batch_size", 0, "data.init_args.batch_size must be >= 1; got 0"),
    ("max_val_windows", -1, "data.init_args.max_val_windows must be >= 1 (or null); got -1"),
    ("train_stride", 0, "data.init_args.train_stride must be >= 1 (or null); got 0"),
    ("num_workers", -2, "data.init_args.num_workers must be >= 0; got -2"),
])
def test_sizes_out_of_range_name_the_option(option, value, says):
    """A size out of range is refused when the datamodule is built, naming the option (a user test got
    ``__len__() should return >= 0`` for ``max_val_windows: -1`` and a torch traceback for ``batch_size: 0``)."""
    with pytest.raises(ValueError) as info:
        TextDataModule(**{option: value})
    assert str(info.value) == says


def test_tokenizer_file_with_the_byte_tokenizer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="tokenizer 'byte' does not read one: drop tokenizer_file"):
        TextDataModule(tokenizer="byte", tokenizer_file=str(tmp_path / "ranks.tiktoken"))
