"""ImageNet datamodules on fixtures written here: ImageFolder tree -> WebDataset shards -> read back."""

from __future__ import annotations

import tarfile
import warnings

import pytest
import torch
from PIL import Image

from mixlab.datamodules.digits import load_uci_digits
from mixlab.datamodules.imagenet import (
    SKIPPED, ImageNetDataModule, decode_sample, eval_transform, expand_shards, write_imagefolder_shards)

N_CLASSES, PER_CLASS = 3, 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """ImageFolder tree of real digits (classes 0, 1, 2; 4 images each, 40x48 RGB, JPEG and PNG)."""
    root = tmp_path_factory.mktemp("imagefolder")
    images, labels = load_uci_digits()
    for c in range(N_CLASSES):
        (root / f"class_{c}").mkdir()
        idx = (labels == c).nonzero().flatten()[:PER_CLASS]
        for k, i in enumerate(idx.tolist()):
            img = Image.fromarray(images[i].numpy()).convert("RGB").resize((48, 40))
            ext = "png" if k == 0 else "jpg"  # one PNG per class exercises re-encoding
            img.save(root / f"class_{c}" / f"img{k}.{ext}")
    return root


@pytest.fixture(scope="module")
def shards(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    paths = write_imagefolder_shards(folder, str(out / "train-%04d.tar"), maxcount=3, shuffle_seed=0)
    return out, paths


def _read_tar(path):
    with tarfile.open(path) as tf:
        return {m.name: tf.extractfile(m).read() for m in tf.getmembers()}


def test_written_shards_follow_timm_convention(shards, folder):
    out, paths = shards
    assert len(paths) == 4  # 12 samples, 3 per shard
    assert (out / "classes.txt").read_text().split() == ["class_0", "class_1", "class_2"]
    labels = {}
    for p in paths:
        for name, data in _read_tar(p).items():
            key, ext = name.split(".", 1)
            assert ext in ("jpg", "cls")
            if ext == "cls":
                labels[key] = int(data.decode("ascii"))
            else:
                assert data[:2] == b"\xff\xd8"  # JPEG, PNGs re-encoded
    assert len(labels) == N_CLASSES * PER_CLASS
    for key, y in labels.items():
        assert key.startswith(f"class_{y}_")


def _read_all(dm, split="val"):
    """All (images, labels) of a split through a DataLoader with ``dm.num_workers`` workers."""
    xs, ys = [], []
    for x, y in torch.utils.data.DataLoader(dm.wds_dataset(split), batch_size=2, num_workers=dm.num_workers):
        xs.append(x)
        ys.append(y)
    return torch.cat(xs), torch.cat(ys)


def test_shards_read_back_with_right_labels_over_two_workers_without_duplicates(shards, folder):
    out, _ = shards
    dm = ImageNetDataModule(format="wds", val_path=str(out / "train-{0000..0003}.tar"), num_classes=N_CLASSES,
                            eval_size=[24, 32], batch_size=2, num_workers=2)
    x, y = _read_all(dm)
    assert x.shape == (N_CLASSES * PER_CLASS, 3, 24, 32)  # non-square eval resolution
    # every image exactly once: compare with the ImageFolder reading of the same files
    ref = ImageNetDataModule(format="folder", val_path=str(folder), num_classes=N_CLASSES, eval_size=[24, 32],
                             batch_size=4, num_workers=0)
    xr, yr = zip(*[ref.folder_dataset("val")[i] for i in range(N_CLASSES * PER_CLASS)])
    xr, yr = torch.stack(xr), torch.tensor(yr)
    assert sorted(y.tolist()) == sorted(yr.tolist()) == [c for c in range(N_CLASSES) for _ in range(PER_CLASS)]
    # match images one to one (shards hold the same JPEG bytes; PNGs were re-encoded, so allow JPEG error)
    d = (x.flatten(1)[:, None] - xr.flatten(1)[None]).abs().mean(-1)  # [N, N]
    match = d.argmin(1)
    assert sorted(match.tolist()) == list(range(len(yr)))  # a bijection: no duplicate, none missing
    assert torch.equal(y, yr[match])


def test_training_pipeline_has_fixed_epoch_and_even_batches(shards):
    out, _ = shards
    dm = ImageNetDataModule(format="wds", train_path=str(out / "train-{0000..0003}.tar"), num_classes=N_CLASSES,
                            image_size=32, batch_size=2, num_workers=2, train_samples=10, shuffle_buffer=4,
                            persistent_workers=False)
    loader = dm.train_dataloader()
    batches = list(loader)
    assert len(batches) == len(loader) == 4  # ceil(10 / 2 workers) = 5 -> 2 full batches per worker
    for x, y in batches:
        assert x.shape == (2, 3, 32, 32) and ((y >= 0) & (y < N_CLASSES)).all()


def test_missing_shards_and_too_few_shards_are_clear_errors(shards, tmp_path):
    out, _ = shards
    with pytest.raises(FileNotFoundError, match=r"val_path: 2 of 6 shards .*train-\{0000\.\.0005\}"):
        expand_shards(str(out / "train-{0000..0005}.tar"), "val_path")
    dm = ImageNetDataModule(format="wds", val_path=str(out / "train-{0000..0001}.tar"), num_classes=N_CLASSES, num_workers=4)
    with pytest.raises(ValueError, match="2 shards but world_size x num_workers = 1 x 4"):
        dm.val_dataloader()
    with pytest.raises(FileNotFoundError, match="ImageFolder root"):
        ImageNetDataModule(format="folder", val_path=str(tmp_path / "nope")).val_dataloader()


def test_label_out_of_range_names_sample_and_shard(shards):
    out, paths = shards
    dm = ImageNetDataModule(format="wds", val_path=str(out / "train-{0000..0003}.tar"), num_classes=2,
                            eval_size=16, batch_size=2, num_workers=0)
    with pytest.raises(ValueError, match=r"label 2 is out of range \[0, 2\)"):
        list(dm.val_dataloader())


def test_corrupt_jpeg_is_skipped_with_counted_warning(folder, tmp_path):
    good = (folder / "class_1" / "img1.jpg").read_bytes()
    samples = [{"__key__": "a", "__url__": "s.tar", "jpg": good, "cls": b"1"},
               {"__key__": "bad", "__url__": "s.tar", "jpg": good[: len(good) // 3], "cls": b"0"},
               {"__key__": "junk", "__url__": "s.tar", "jpg": b"not an image", "cls": b"2"}]
    before = SKIPPED["corrupt"]
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = [decode_sample(s, 3, eval_transform(16)) for s in samples]
    assert out[1] is None and out[2] is None and out[0][1] == 1
    assert SKIPPED["corrupt"] - before == 2
    msgs = [str(w.message) for w in rec if "corrupt" in str(w.message)]
    assert len(msgs) == 2 and "'bad' in s.tar" in msgs[0] and f"{before + 2} corrupt image(s)" in msgs[1]


def test_eval_transform_resizes_by_256_over_224_then_center_crops():
    # a 300x400 (h x w) image with a marker: resize short side to floor(64*256/224)=73 then crop 64
    img = Image.new("RGB", (400, 300), (0, 0, 0))
    tf = eval_transform(64)
    x = tf(img)
    assert x.shape == (3, 64, 64)
    resize = [t for t in tf.transforms if type(t).__name__ == "Resize"][0]
    assert resize.size == 73
    assert eval_transform([64, 96])(img).shape == (3, 64, 96)
