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
