"""ImageNet datamodules on fixtures written here: ImageFolder tree -> WebDataset shards -> read back."""

from __future__ import annotations

import io
import logging
import os
import random
import tarfile
import warnings

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from helpers.training import fit_two_epochs
from PIL import Image

from mixlab.datamodules.digits import load_uci_digits
from mixlab.datamodules.imagenet import (
    SKIPPED,
    ImageNetDataModule,
    cuda_work_queues,
    decode_sample,
    eval_transform,
    expand_shards,
    write_imagefolder_shards,
)

N_CLASSES, PER_CLASS = 3, 4
_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


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


def test_written_shards_have_no_pax_headers(shards):
    """Members carry a whole-second mtime and no pax extended header (webdataset's default float mtime puts one
    before every member, which doubles the tar parsing of every reader)."""
    _, paths = shards
    with tarfile.open(paths[0]) as tf:
        members = tf.getmembers()
    assert len(members) == 6 and all(m.pax_headers == {} and isinstance(m.mtime, int) for m in members)
    with open(paths[0], "rb") as f:
        assert b"PaxHeader" not in f.read()


def test_seeded_rngs_without_restore_draws_the_same_and_leaves_the_seeded_streams():
    """``restore=False`` (DataLoader workers) draws exactly what ``restore=True`` draws; afterwards the RNGs
    continue the seeded streams instead of returning to the caller's states."""
    from mixlab.datamodules.imagenet import seeded_rngs

    def draw():
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    before = draw()
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    with seeded_rngs(7):
        a = draw()
    assert draw() == before  # restored
    with seeded_rngs(7, restore=False):
        b = draw()
    after = draw()
    assert a == b and after != before
    random.seed(7), np.random.seed(7), torch.manual_seed(7)  # the seeded streams' second draws
    draw()
    assert draw() == after


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


@pytest.mark.parametrize("name, value, allowed", [
    ("batch_size", 0, ">= 1"), ("eval_batch_size", 0, ">= 1 (or null)"), ("num_workers", -1, ">= 0"),
    ("shuffle_buffer", -5, ">= 0"), ("train_samples", 0, ">= 1 (or null)"),
    ("image_size", 0, "an int or [height, width], each >= 1 pixel"),
    ("image_size", [224, 0], "an int or [height, width], each >= 1 pixel"),
    # a list of another length: blamed on auto_augment before (user test)
    ("image_size", [224, 224, 3], "an int or [height, width], each >= 1 pixel"),
    ("image_size", [224], "an int or [height, width], each >= 1 pixel"),
    ("eval_size", -3, "an int or [height, width], each >= 1 pixel (or null)"), ("re_prob", 2.0, "in [0, 1]"),
    ("hflip", -0.1, "in [0, 1]"), ("crop_pct", 0.0, "in (0, 1]"), ("color_jitter", -0.3, ">= 0 (or null)"),
    ("scale", (1.0, 0.1), "(min, max) with 0 < min <= max <= 1"), ("num_classes", 0, ">= 1"),
    ("cpu_decode_fraction", 1.5, "in [0, 1]"),
    ("worker_nice", -1, "in [0, 19] (raising a worker's priority needs root)"),
    ("worker_nice", 20, "in [0, 19] (raising a worker's priority needs root)"),
    ("decode_thread", None, "true or false"), ("cuda_graphs", 1, "true or false"),
    # null where the argument has no "not set" meaning (a TypeError deep in fit before; user test)
    ("cpu_decode_fraction", None, "in [0, 1]"), ("batch_size", None, ">= 1"), ("prefetch_batches", None, ">= 0"),
])
def test_out_of_range_arguments_are_refused_at_construction(name, value, allowed):
    """Each size, count and probability is checked when the datamodule is built, with the argument's name, its
    range and the value in the message (before: a ZeroDivisionError or a DataLoader worker's traceback later)."""
    with pytest.raises(ValueError) as err:
        ImageNetDataModule(train_path="x.tar", **{name: value})
    assert str(err.value) == f"ImageNetDataModule: {name} must be {allowed}; got {value!r}"


def test_missing_shards_and_too_few_shards_are_clear_errors(shards, tmp_path):
    out, _ = shards
    with pytest.raises(FileNotFoundError, match=r"val_path: 2 of 6 shards .*train-\{0000\.\.0005\}"):
        expand_shards(str(out / "train-{0000..0005}.tar"), "val_path")
    dm = ImageNetDataModule(format="wds", val_path=str(out / "train-{0000..0001}.tar"), num_classes=N_CLASSES,
                            num_workers=4)
    with pytest.raises(ValueError, match="2 shards but world_size x num_workers = 1 x 4"):
        dm.val_dataloader()
    with pytest.raises(FileNotFoundError, match="ImageFolder root"):
        ImageNetDataModule(format="folder", val_path=str(tmp_path / "nope")).val_dataloader()
    # a fit checks its shards in setup, before Lightning's sanity validation (a user test: the error came
    # after it); a validate/test reads them at its own loader
    fit = ImageNetDataModule(format="wds", train_path=str(out / "train-{0000..0005}.tar"),
                             val_path=str(out / "train-{0000..0001}.tar"), num_classes=N_CLASSES, num_workers=1)
    with pytest.raises(FileNotFoundError, match=r"train_path: 2 of 6 shards"):
        fit.setup("fit")
    fit = ImageNetDataModule(format="wds", train_path=str(out / "train-{0000..0001}.tar"),
                             val_path=str(out / "train-{0000..0001}.tar"), num_classes=N_CLASSES, num_workers=4)
    with pytest.raises(ValueError, match=r"^train_path .*2 shards but world_size x num_workers = 1 x 4"):
        fit.setup("fit")
    fit.setup("validate")  # nothing read yet


def test_shards_split_by_rank_and_worker_exactly_once_and_too_few_is_a_clear_error(shards, monkeypatch):
    """2 simulated ranks (RANK/WORLD_SIZE, read by webdataset's split_by_node) x 2 workers over 4
    shards: every image exactly once; 3 shards for 4 readers: an error naming pattern and numbers."""
    out, _ = shards
    pattern = str(out / "train-{0000..0003}.tar")
    ref = ImageNetDataModule(format="wds", val_path=pattern, num_classes=N_CLASSES, eval_size=16, num_workers=0)
    x_ref, y_ref = _read_all(ref)
    monkeypatch.setenv("WORLD_SIZE", "2")
    parts = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        dm = ImageNetDataModule(format="wds", val_path=pattern, num_classes=N_CLASSES, eval_size=16, num_workers=2)
        parts.append(_read_all(dm))
    x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    assert len(x) == len(x_ref) == N_CLASSES * PER_CLASS
    match = [next(j for j in range(len(x_ref)) if torch.equal(x[i], x_ref[j])) for i in range(len(x))]
    assert sorted(match) == list(range(len(x_ref))) and torch.equal(y, y_ref[match])  # a bijection
    assert 0 < len(parts[0][1]) < len(x)  # both ranks read something
    short = str(out / "train-{0000..0002}.tar")
    dm = ImageNetDataModule(format="wds", train_path=short, num_classes=N_CLASSES, num_workers=2)
    with pytest.raises(ValueError) as err:
        dm.train_dataloader()
    msg = str(err.value)
    assert short in msg and "3 shards but world_size x num_workers = 2 x 2 = 4 readers" in msg

def test_label_out_of_range_names_sample_and_shard(shards):
    out, paths = shards
    dm = ImageNetDataModule(format="wds", val_path=str(out / "train-{0000..0003}.tar"), num_classes=2,
                            eval_size=16, batch_size=2, num_workers=0)
    with pytest.raises(ValueError, match=r"label 2 is out of range \[0, 2\)"):
        list(dm.val_dataloader())


def test_corrupt_jpeg_is_skipped_with_counted_warning(folder, tmp_path, monkeypatch):
    monkeypatch.setattr("mixlab.datamodules.imagenet._RUN_COUNT", None)  # no datamodule's run count installed
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


@pytest.mark.skipif(not hasattr(os, "nice"), reason="os.nice: POSIX only")
@pytest.mark.parametrize("context", [None, "spawn"])
def test_worker_nice_lowers_the_workers_priority_not_the_training_process(shards, monkeypatch, context):
    """``worker_nice=7``: every DataLoader worker runs at the training process's nice value + 7 (what each worker
    saw while decoding, read back as its samples' labels), under fork and spawn; the training process keeps its own.
    The other worker start-up work (the corrupt-image slots) still runs: the loader reads every image."""
    out, _ = shards
    base = os.nice(0)
    monkeypatch.setattr("mixlab.datamodules.imagenet.decode_sample", _decode_reporting_nice)
    dm = ImageNetDataModule(format="wds", val_path=str(out / "train-{0000..0003}.tar"), num_classes=N_CLASSES,
                            eval_size=16, batch_size=2, num_workers=2, worker_nice=7)
    loader = dm.val_dataloader()
    if context:
        loader.multiprocessing_context = context
    seen = torch.cat([y for _, y in loader])
    assert seen.tolist() == [min(base + 7, 19)] * (N_CLASSES * PER_CLASS) and os.nice(0) == base
    summary = ImageNetDataModule(train_path="x.tar", decode="gpu", num_workers=2, worker_nice=7).pipeline_summary()
    assert ("DataLoader workers at nice +7 (worker_nice)" if base + 7 <= 19 else
            f"at nice +{19 - base} (worker_nice 7, capped: this process runs at nice {base}") in summary


@pytest.mark.skipif(not hasattr(os, "nice"), reason="os.nice: POSIX only")
def test_worker_nice_summary_says_when_linux_caps_it(monkeypatch):
    """A training process already at nice 15 leaves its workers 4 steps (Linux's lowest priority is 19): the
    summary gives the workers' real offset and why, not the requested one."""
    monkeypatch.setattr(os, "nice", lambda inc: 15 + inc)
    summary = ImageNetDataModule(train_path="x.tar", decode="gpu", num_workers=2, worker_nice=10).pipeline_summary()
    assert "DataLoader workers at nice +4 (worker_nice 10, capped: this process runs at nice 15 and 19 is the " \
           "lowest priority)" in summary


def test_gpu_pipeline_summary_names_cudas_work_queues(monkeypatch):
    """On a CUDA device the training pipeline's summary says how many hardware work queues CUDA gives the process
    (``CUDA_DEVICE_MAX_CONNECTIONS``; 8 when unset, CUDA's default), and how to get 32 when it has fewer (a script
    that uses the datamodule without ``python -m mixlab``)."""
    dm = ImageNetDataModule(train_path="x.tar", decode="gpu")
    monkeypatch.setattr(dm, "_root_device", lambda: torch.device("cuda", 0))
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    assert "; 32 hardware work queues per GPU (CUDA_DEVICE_MAX_CONNECTIONS)" in dm.pipeline_summary()
    assert "fewer than" not in dm.pipeline_summary()
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    assert ("; 8 hardware work queues per GPU (CUDA_DEVICE_MAX_CONNECTIONS): fewer than the streams of decode gpu, "
            "so the decode can wait behind the training step; export CUDA_DEVICE_MAX_CONNECTIONS=32 before CUDA starts "
            "(python -m mixlab sets it)" in dm.pipeline_summary())
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "16")
    assert cuda_work_queues() == ("16", cuda_work_queues()[1]) and cuda_work_queues()[1].startswith("fewer than")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "abc")
    assert cuda_work_queues()[1].startswith("fewer than")
    monkeypatch.setattr(dm, "_root_device", lambda: torch.device("cpu"))
    assert "hardware work queues" not in dm.pipeline_summary()


def _decode_reporting_nice(sample, num_classes, transform=None):
    """``decode_sample`` whose label is the decoding process's nice value (module level: spawn pickles it)."""
    x, _ = decode_sample(sample, num_classes, transform)
    return x, os.nice(0)


@pytest.mark.parametrize("context", [None, "spawn"])
def test_corrupt_images_are_counted_over_all_loader_processes(folder, tmp_path, monkeypatch, context, caplog):
    """Two corrupt images in shards read by different DataLoader workers: the datamodule's count (and the
    warnings') is the run's, 2, each worker counting in its own slot; before, each worker said "1 so far"."""
    import webdataset as wds

    monkeypatch.setattr("mixlab.datamodules.imagenet._RUN_COUNT", None)
    good = (folder / "class_1" / "img1.jpg").read_bytes()
    for k in range(4):  # worker 0 reads shards 0 and 2, worker 1 shards 1 and 3
        with wds.TarWriter(str(tmp_path / f"c-{k:04d}.tar")) as tar:
            for i in range(3):
                bad = (k, i) in ((0, 1), (3, 2))
                tar.write({"__key__": f"s{k}_{i}", "jpg": good[:300] if bad else good, "cls": b"1"})
    dm = ImageNetDataModule(format="wds", val_path=str(tmp_path / "c-{0000..0003}.tar"), num_classes=3,
                            eval_size=16, batch_size=2, num_workers=2)
    loader = dm.val_dataloader()
    if context:
        loader.multiprocessing_context = context
    n = sum(len(y) for _, y in loader)
    assert n == 10 and dm.corrupt_skipped == 2
    counts = dm.corrupt.counts.tolist()
    assert counts[0] == 0 and sorted(counts)[-2:] == [1, 1], counts  # two val-worker slots, one each
    with caplog.at_level(logging.WARNING, logger="mixlab.imagenet"):
        dm.teardown("validate")  # the run's total at its end, after the warnings that named each
    assert [r.getMessage() for r in caplog.records] == [
        "ImageNetDataModule: 2 corrupt image(s) skipped so far (after validate), each named in a warning above"]


def test_eval_transform_resizes_by_256_over_224_then_center_crops():
    # a 300x400 (h x w) image with a marker: resize short side to floor(64*256/224)=73 then crop 64
    img = Image.new("RGB", (400, 300), (0, 0, 0))
    tf = eval_transform(64)
    x = tf(img)
    assert x.shape == (3, 64, 64)
    resize = [t for t in tf.transforms if type(t).__name__ == "Resize"][0]
    assert resize.size == 73
    assert eval_transform([64, 96])(img).shape == (3, 64, 96)


# ---------------------------------------------------------------- exact resume of the WebDataset stream
def _fit_trainer(epoch: int, batches: int):
    """What the datamodule reads from a Trainer: the fit loop's epoch and batches processed in it."""
    from types import SimpleNamespace as NS
    return NS(strategy=None, fit_loop=NS(epoch_progress=NS(current=NS(processed=epoch)),
                                         epoch_loop=NS(batch_progress=NS(current=NS(processed=batches)))))


def test_a_truncated_shard_stops_with_one_line_naming_it(shards, tmp_path):
    """A shard cut off mid-file (a copy that did not finish) stops the loader with a ValueError naming the shard,
    which the CLI prints as one ``error: data: ...`` line (a 44-frame worker traceback before: user test)."""
    import shutil

    out, _ = shards
    for k in range(4):
        shutil.copy(out / f"train-{k:04d}.tar", tmp_path / f"train-{k:04d}.tar")
    bad = tmp_path / "train-0002.tar"
    bad.write_bytes(bad.read_bytes()[:600])  # inside the first member's data
    dm = ImageNetDataModule(format="wds", train_path=str(tmp_path / "train-{0000..0003}.tar"), num_classes=N_CLASSES,
                            image_size=16, batch_size=2, num_workers=0, train_samples=24, decode="cpu")
    dm.trainer = _fit_trainer(0, 0)
    with pytest.raises(ValueError, match=r"^shard .*train-0002\.tar is not a readable tar file \(.*\): truncated or "
                                         r"corrupt; write it again, or leave it out of the pattern$"):
        list(dm.train_dataloader())


def test_gpu_decode_train_batches_come_from_the_workers_planned_and_packed(shards):
    """``decode: gpu`` with a known device and DataLoader workers: each training batch arrives from its worker as one
    buffer (``transported``) with its augmentation plan for that device made there (the CPU stage's: no CUDA graphs'
    padding), and the stage's images from it equal those it makes planning itself."""
    from types import SimpleNamespace as NS

    from mixlab.datamodules.imagenet_gpu import DevicePrefetcher, EncodedBatch

    out, _ = shards
    dm = ImageNetDataModule(format="wds", train_path=str(out / "train-{0000..0003}.tar"), num_classes=N_CLASSES,
                            image_size=16, batch_size=2, num_workers=2, train_samples=8, decode="gpu")
    trainer = _fit_trainer(0, 0)
    trainer.strategy = NS(root_device=torch.device("cpu"))
    dm.trainer = trainer
    loader = dm.train_dataloader()
    assert isinstance(loader, DevicePrefetcher)
    batch = next(iter(loader.loader))
    assert isinstance(batch, EncodedBatch) and batch.transported and batch.plan.key == (2, (16, 16), None, False)
    stage = dm.gpu_pipeline(True)
    x, y = stage(batch)
    own = EncodedBatch(batch.data, batch.offsets, batch.labels, batch.keys, batch.params, batch.train)
    x_ref, y_ref = stage(own)
    assert torch.equal(x, x_ref) and torch.equal(y, y_ref)


@pytest.mark.parametrize("workers,world", [(0, 1), (2, 1), (2, 2)])
def test_wds_stream_resumes_with_the_next_batch_bitwise(shards, monkeypatch, workers, world):
    """Uninterrupted: epoch 0, then epoch 1 on the same (persistent) workers; at batch k=3 of epoch 1
    the state goes through a checkpoint into a fresh datamodule, whose first 3 batches must equal
    batches 3..5 bitwise (random DeiT augmentation included). world=2: rank 1 of 2 (RANK/WORLD_SIZE)."""
    out, _ = shards
    if world == 2:
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "1")

    def make():
        return ImageNetDataModule(format="wds", train_path=str(out / "train-{0000..0003}.tar"), num_classes=N_CLASSES,
                                  image_size=16, batch_size=2, num_workers=workers, train_samples=24,
                                  shuffle_buffer=4, persistent_workers=True)

    k, n_next = 3, 3
    dm = make()
    dm.trainer = _fit_trainer(0, 0)
    loader = dm.train_dataloader()
    it = iter(loader)  # (draws the DataLoader's base seed from torch's RNG)
    rng_before = torch.get_rng_state()
    epoch0 = list(it)
    assert len(epoch0) == len(loader) == 24 // world // 2
    if workers == 0:  # per-sample seeding restores the caller's RNG (dropout etc. unaffected)
        assert torch.equal(torch.get_rng_state(), rng_before)
    dm.trainer = _fit_trainer(1, 0)  # Lightning's next epoch: EpochSyncLoader passes it to the workers
    full = [b for _, b in zip(range(k + n_next), loader)]
    assert loader.dataset.epoch == 1 and not torch.equal(full[0][0], epoch0[0][0])
    dm.trainer = _fit_trainer(1, k)  # checkpoint after k batches of epoch 1
    state = dm.state_dict()
    assert state == {"train_stream": {"epoch": 1, "seed": dm.order_seed(0), "consumed_batches": k, "world": world,
                                      "num_workers": workers, "batch_size": 2, "shards": 4}}
    buf = io.BytesIO()
    torch.save({"ImageNetDataModule": state}, buf)  # as in a Lightning checkpoint
    buf.seek(0)
    fresh = make()
    fresh.load_state_dict(torch.load(buf, weights_only=True)["ImageNetDataModule"])
    fresh.trainer = _fit_trainer(1, k)  # Lightning restored the loop progress
    rest = [b for _, b in zip(range(n_next), fresh.train_dataloader())]
    for j in range(n_next):
        assert torch.equal(rest[j][0], full[k + j][0]) and torch.equal(rest[j][1], full[k + j][1]), j
    assert not torch.equal(rest[0][0], full[0][0])


def test_wds_epochs_read_shards_in_different_seeded_orders_each_shard_once(shards):
    out, _ = shards
    dm = ImageNetDataModule(format="wds", train_path=str(out / "train-{0000..0003}.tar"), num_classes=N_CLASSES,
                            image_size=16, batch_size=2, num_workers=2, train_samples=12)
    stream, again = dm.wds_dataset("train"), dm.wds_dataset("train")
    orders = {}
    for epoch, pass_ in [(0, 0), (0, 1), (1, 0), (2, 0)]:
        per_worker = [stream.consumer_shards(epoch, pass_, w, 2) for w in range(2)]
        assert sorted(per_worker[0] + per_worker[1]) == sorted(stream.urls)  # every shard once per pass
        assert per_worker == [again.consumer_shards(epoch, pass_, w, 2) for w in range(2)]  # seeded
        orders[epoch, pass_] = per_worker
    assert len({str(o) for o in orders.values()}) == len(orders)  # a new order every epoch and pass
    # end to end, one pass (train_samples=None): every sample once, in another order next epoch
    one = ImageNetDataModule(format="wds", train_path=str(out / "train-{0000..0003}.tar"), num_classes=N_CLASSES,
                             image_size=16, batch_size=12, num_workers=0, train_samples=None, shuffle_buffer=4)
    loader = one.train_dataloader()
    (_, y0), = list(loader)
    loader.dataset.set_epoch(1)
    (_, y1), = list(loader)
    assert sorted(y0.tolist()) == sorted(y1.tolist()) == [c for c in range(N_CLASSES) for _ in range(PER_CLASS)]
    assert y0.tolist() != y1.tolist()


class _BatchRecorder(pl.LightningModule):
    """Linear classifier that records ``(epoch, images, labels)`` of every training batch; with
    ``expect_total_steps`` it reads ``trainer.estimated_stepping_batches`` in
    ``configure_optimizers`` (as mixlab's heads do) and checks it."""

    def __init__(self, expect_total_steps: int | None = None):
        super().__init__()
        self.lin, self.seen, self.expect = torch.nn.Linear(3 * 8 * 8, N_CLASSES), [], expect_total_steps

    def training_step(self, batch, i):
        self.seen.append((self.current_epoch, batch[0].clone(), batch[1].clone()))
        return torch.nn.functional.cross_entropy(self.lin(batch[0].flatten(1)), batch[1])

    def configure_optimizers(self):
        if self.expect is not None:
            assert self.trainer.estimated_stepping_batches == self.expect
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_wds_resume_under_lightning_mid_epoch_and_at_the_last_batch(shards, tmp_path):
    """Real Trainer, 2 epochs x 4 steps, checkpoints every 3 steps: resuming from step 3 (mid epoch 0)
    and from step 4 (the last batch of epoch 0: Lightning builds the resumed iterator before it moves
    on to epoch 1) trains on exactly the uninterrupted run's remaining batches."""

    def fit(ckpt=None, every=None):
        pl.seed_everything(3)
        dm = ImageNetDataModule(format="wds", train_path=str(out / "train-{0000..0003}.tar"), val_path=None,
                                num_classes=N_CLASSES, image_size=8, batch_size=2, num_workers=0, train_samples=8,
                                shuffle_buffer=4)
        return fit_two_epochs(_BatchRecorder(), dm, tmp_path, ckpt, every).seen

    out, _ = shards
    full = fit(every=1)
    assert [e for e, _, _ in full] == [0] * 4 + [1] * 4 and not torch.equal(full[0][1], full[4][1])
    for step in (3, 4):
        rest = fit(str(tmp_path / f"step={step}.ckpt"))
        assert len(rest) == 8 - step
        for (e, x, y), (e_ref, x_ref, y_ref) in zip(rest, full[step:]):
            assert e == e_ref and torch.equal(x, x_ref) and torch.equal(y, y_ref)


@pytest.mark.parametrize("workers,reload,decode,fraction",
                         [(0, 0, "cpu", 0), (2, 0, "cpu", 0), (0, 1, "cpu", 0), (2, 0, "gpu", 0), (2, 0, "gpu", 0.5)])
def test_wds_resume_under_lightning_in_later_epochs(shards, tmp_path, workers, reload, decode, fraction):
    """Real Trainer, 3 epochs x 4 steps; the module asks for ``trainer.estimated_stepping_batches`` in
    ``configure_optimizers`` (as mixlab's heads do), so Lightning builds and iterates the train loader
    before it restores the loops (the trainer's epoch still reads 0 then). Resuming mid epoch 1 (step 6),
    at the last batch of epoch 1 (step 8) and mid epoch 2 (step 10) trains on exactly the uninterrupted
    run's remaining batches, in the same epochs; also when Lightning rebuilds the loader every epoch
    (``reload_dataloaders_every_n_epochs=1``: again after restoring its loops). ``decode='gpu'`` (run on the
    CPU device: JPEG bytes from the workers, decoded and augmented in ``on_after_batch_transfer``) too, also with
    half of each batch decoded in the workers (``cpu_decode_fraction=0.5``)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(ckpt=None):
        pl.seed_everything(5)
        dm = ImageNetDataModule(format="wds", train_path=str(out / "train-{0000..0003}.tar"), val_path=None,
                                num_classes=N_CLASSES, image_size=8, batch_size=2, num_workers=workers,
                                train_samples=8, shuffle_buffer=4, decode=decode, cpu_decode_fraction=fraction)
        model = _BatchRecorder(expect_total_steps=12)
        cbs = [] if ckpt else [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1,
                                               filename="{step}")]
        trainer = pl.Trainer(max_epochs=3, accelerator="cpu", logger=False, callbacks=cbs,
                             enable_checkpointing=not ckpt, limit_val_batches=0, enable_progress_bar=False,
                             enable_model_summary=False, reload_dataloaders_every_n_epochs=reload)
        trainer.fit(model, dm, ckpt_path=ckpt)
        return model.seen

    out, _ = shards
    full = fit()
    assert [e for e, _, _ in full] == [0] * 4 + [1] * 4 + [2] * 4
    assert not torch.equal(full[4][1], full[0][1]) and not torch.equal(full[8][1], full[4][1])
    for step in (6, 8, 10):
        state = torch.load(tmp_path / f"step={step}.ckpt", weights_only=False)["ImageNetDataModule"]["train_stream"]
        assert (state["epoch"], state["consumed_batches"]) == ((step - 1) // 4, (step - 1) % 4 + 1)
        rest = fit(str(tmp_path / f"step={step}.ckpt"))
        assert len(rest) == 12 - step
        for j, ((e, x, y), (e_ref, x_ref, y_ref)) in enumerate(zip(rest, full[step:])):
            assert e == e_ref and torch.equal(x, x_ref) and torch.equal(y, y_ref), (step, j)


@pytest.mark.parametrize("decode", ["gpu", "cpu"])
def test_fit_end_stops_the_persistent_training_workers(shards, decode):
    """When ``fit`` returns, the training DataLoader's persistent workers are gone, also behind the device stage
    (``decode: gpu``: Lightning iterates the :class:`DevicePrefetcher`, not the DataLoader, and so did not stop
    them). Before, they lived until the process exited, where torch 2.11 waits 5 s per worker: 75 s after the
    last step of a 15-worker GPU fit."""
    import multiprocessing

    out, _ = shards
    before = set(multiprocessing.active_children())
    dm = ImageNetDataModule(format="wds", train_path=str(out / "train-{0000..0003}.tar"), val_path=None,
                            num_classes=N_CLASSES, image_size=8, batch_size=2, num_workers=2, train_samples=8,
                            shuffle_buffer=4, decode=decode)
    seen = []

    class Workers(pl.Callback):  # the training loader's workers, while they run
        def on_train_batch_end(self, trainer, *args):
            seen.extend(set(multiprocessing.active_children()) - before)

    pl.Trainer(max_steps=3, accelerator="cpu", logger=False, limit_val_batches=0, enable_progress_bar=False,
               enable_model_summary=False, enable_checkpointing=False, callbacks=[Workers()]).fit(_BatchRecorder(), dm)
    assert len(set(seen)) == 2 and (decode == "cpu" or dm._train_prefetcher is not None)
    assert not any(w.is_alive() for w in seen) and set(multiprocessing.active_children()) <= before


def test_switch_interval_holds_while_the_device_stage_runs_and_is_restored(shards):
    """``switch_interval_ms``: Python's thread switch interval is the given one while the training device stage
    runs (``decode: gpu``, prefetched) and the previous one again when ``fit`` returns; with ``decode: cpu`` it is
    never touched. A value out of range is refused naming it."""
    import sys

    out, _ = shards
    before = sys.getswitchinterval()
    for decode, during in (("gpu", 0.0005), ("cpu", before)):
        dm = ImageNetDataModule(format="wds", train_path=str(out / "train-{0000..0003}.tar"), val_path=None,
                                num_classes=N_CLASSES, image_size=8, batch_size=2, num_workers=1, train_samples=8,
                                shuffle_buffer=4, decode=decode, switch_interval_ms=0.5)  # 0 workers: no prefetch
        seen = []

        class Interval(pl.Callback):
            def on_train_batch_end(self, trainer, *args):
                seen.append(sys.getswitchinterval())

        pl.Trainer(max_steps=2, accelerator="cpu", logger=False, limit_val_batches=0, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False, callbacks=[Interval()]).fit(
            _BatchRecorder(), dm)
        assert seen == pytest.approx([during] * 2) and sys.getswitchinterval() == pytest.approx(before), decode
    with pytest.raises(ValueError, match=r"switch_interval_ms must be in \(0, 1000\] milliseconds \(or null\); got 0"):
        ImageNetDataModule(switch_interval_ms=0)


@pytest.mark.parametrize("workers,stop", [(0, 3), (0, 4), (2, 6)])
def test_wds_run_stopped_at_max_steps_and_extended_continues_its_epoch(shards, tmp_path, workers, stop):
    """A mixlab head (``Head``) run over WebDataset shards, 4 steps per epoch, stopped at ``max_steps``
    (3, 6: inside an epoch; 4: at its end) and extended to 10 from the ``last.ckpt`` written at the end
    of training: the batches and their epochs equal the uninterrupted run's (the stopped epoch used to
    count as done, so the rest of it was skipped)."""
    from mixlab.callbacks import LastCheckpoint
    from mixlab.heads.common import Head

    class Rec(_BatchRecorder, Head):  # the recorder's steps, Head's checkpoints
        pass

    def fit(ckdir, max_steps, ckpt=None):
        pl.seed_everything(5)
        dm = ImageNetDataModule(format="wds", train_path=str(out / "train-{0000..0003}.tar"), val_path=None,
                                num_classes=N_CLASSES, image_size=8, batch_size=2, num_workers=workers,
                                train_samples=8, shuffle_buffer=4)
        model = Rec()
        pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, callbacks=[LastCheckpoint(dirpath=ckdir)],
                   limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False).fit(model, dm,
                                                                                                  ckpt_path=ckpt)
        return model.seen

    out, _ = shards
    full = fit(tmp_path / "full", 10)
    assert [e for e, _, _ in full] == [0] * 4 + [1] * 4 + [2] * 2
    fit(tmp_path / "run", stop)
    rest = fit(tmp_path / "run", 10, str(tmp_path / "run" / "last.ckpt"))
    assert len(rest) == 10 - stop
    for j, ((e, x, y), (e_ref, x_ref, y_ref)) in enumerate(zip(rest, full[stop:])):
        assert e == e_ref and torch.equal(x, x_ref) and torch.equal(y, y_ref), (stop, j)


def test_shard_writer_skips_an_unreadable_image_with_a_warning_naming_it(tmp_path):
    """A file that is neither a JPEG nor a readable image (a truncated PNG, a stray text file named .png) is
    skipped with a warning naming it; the others are written and classes.txt exists (before: PIL's traceback
    stopped the writer, leaving partial shards and no classes.txt)."""
    import webdataset as wds

    from mixlab.datamodules.imagenet import write_imagefolder_shards

    for c in ("a", "b"):
        (tmp_path / "tree" / c).mkdir(parents=True)
        Image.new("RGB", (8, 6), (10, 200, 30)).save(tmp_path / "tree" / c / "ok.png")
    bad = tmp_path / "tree" / "b" / "bad.png"
    bad.write_bytes(b"not an image at all")
    with pytest.warns(UserWarning, match=r"skipped '.*bad\.png', not a readable image .*1 skipped so far"):
        shards = write_imagefolder_shards(tmp_path / "tree", str(tmp_path / "out" / "s-%04d.tar"), maxcount=10)
    keys = sorted(x["__key__"] for x in wds.WebDataset(shards, shardshuffle=False))
    assert keys == ["a_ok", "b_ok"]
    assert (tmp_path / "out" / "classes.txt").read_text() == "a\nb\n"


def test_randaugment_posterize_of_zero_bits_is_a_black_image_not_an_error():
    """timm's PosterizeIncreasing keeps 0 bits at level 10, which the DeiT recipe's magnitude noise reaches (about
    0.3% of images); Pillow 13 refuses 0 bits, which ended a CPU-path fit of the ImageNet config within a few
    hundred images (found through the CLI). The training transform's Posterize ops now give a black image there,
    as the accelerator path does, and Pillow's result for 1-7 bits."""
    import copy

    from PIL import ImageOps
    from timm.data.auto_augment import RandAugment

    from mixlab.datamodules.imagenet import train_transform
    from mixlab.datamodules.imagenet_gpu import apply_ra_op

    t = train_transform(32)
    ra = next(s for s in t.transforms if isinstance(s, RandAugment))
    op = copy.copy(next(o for o in ra.ops if o.name == "PosterizeIncreasing"))
    op.prob, op.magnitude_std = 1.0, 0.0
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 30, 3), dtype=np.uint8))
    op.magnitude = 10.0  # 4 - int(10 / 10 * 4) = 0 bits
    black = np.asarray(op(img))
    assert black.shape == (40, 30, 3) and black.max() == 0
    x = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1)[None].float()
    assert apply_ra_op("PosterizeIncreasing", x, torch.zeros(1, dtype=torch.float64)).max() == 0  # accelerator path
    op.magnitude = 5.0  # 2 bits
    assert np.array_equal(np.asarray(op(img)), np.asarray(ImageOps.posterize(img, 2)))
    # the whole recipe at level 10 (every image posterized to 0 bits whenever the op is drawn) runs through
    t10 = train_transform(32, auto_augment="rand-m10-mstd0-inc1")
    random.seed(0)
    for _ in range(60):
        out = t10(img)
        assert out.shape == (3, 32, 32) and torch.isfinite(out).all()


@pytest.mark.parametrize("device,workers", [("cpu", 0), ("cpu", 2), pytest.param("cuda", 0, marks=_CUDA),
                                            pytest.param("cuda", 2, marks=_CUDA)])
def test_vit_resume_on_the_gpu_stage_has_the_uninterrupted_losses(tmp_path, device, workers):
    """``decode: gpu`` (the device stage; prefetched in a thread with workers, in the step without; on CUDA with
    its CUDA graphs and bf16-mixed), ViT with Mixup / CutMix and stochastic depth: 10 steps against 5 + 5 resumed
    from ``last.ckpt`` give the same losses. Written after an H100 run with ``num_workers: 0`` differed from its
    first step (the samples' seeded draws then ran in the prefetch thread); the CUDA cases have not run yet."""
    from mixlab.backbone import BackboneConfig
    from mixlab.callbacks import LastCheckpoint
    from mixlab.datamodules.imagenet import write_synthetic_shards
    from mixlab.heads.vit import ImageClassifier
    from mixlab.optim import OptimConfig

    pattern = write_synthetic_shards(tmp_path / "data", 128, size=(160, 120), maxcount=16)
    losses: list[float] = []

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    def fit(folder, max_steps, ckpt=None):
        pl.seed_everything(0)
        model = ImageClassifier(num_classes=10, img_size=64, patch_size=16, label_smoothing=0.1,
                                mixup=dict(mixup_alpha=0.8, cutmix_alpha=1.0, prob=1.0, switch_prob=0.5, mode="batch"),
                                backbone=BackboneConfig(d_model=32, n_layers=2, n_heads=2, mixer="goat", causal=False,
                                                        drop_path=0.5),
                                optim=OptimConfig(lr=3e-3, warmup_steps=2, total_steps=10))
        dm = ImageNetDataModule(format="wds", train_path=pattern, val_path=pattern, num_classes=10, image_size=64,
                                batch_size=8, num_workers=workers, train_samples=128, decode="gpu")
        start = len(losses)
        acc = dict(accelerator="gpu", devices=1, precision="bf16-mixed") if device == "cuda" else dict(
            accelerator="cpu")
        pl.Trainer(max_steps=max_steps, **acc, logger=False, enable_progress_bar=False, enable_model_summary=False,
                   num_sanity_val_steps=0, limit_val_batches=0,
                   callbacks=[LastCheckpoint(dirpath=folder), Losses()]).fit(model, dm, ckpt_path=ckpt)
        return losses[start:]

    full = fit(tmp_path / "full", 10)
    first = fit(tmp_path / "run", 5)
    rest = fit(tmp_path / "run", 10, str(tmp_path / "run" / "last.ckpt"))
    assert len(full) == 10 and first + rest == full


def test_test_split_without_test_path_says_it_tests_on_val(folder, caplog):
    """Without ``test_path`` the test loader reads ``val_path`` (documented); the log says so once (a user test:
    ``test`` silently scored the val images)."""
    dm = ImageNetDataModule(format="folder", val_path=str(folder), num_classes=N_CLASSES, image_size=32,
                            batch_size=4, num_workers=0)
    with caplog.at_level(logging.INFO, logger="mixlab.imagenet"):
        dm.test_dataloader()
        dm.test_dataloader()
    said = [r.getMessage() for r in caplog.records if "test_path is not set" in r.getMessage()]
    assert said == [f"imagenet: test_path is not set: testing on val_path {folder}"]
    caplog.clear()
    own = ImageNetDataModule(format="folder", val_path=str(folder), test_path=str(folder), num_classes=N_CLASSES,
                             image_size=32, batch_size=4, num_workers=0)
    with caplog.at_level(logging.INFO, logger="mixlab.imagenet"):
        own.test_dataloader()
    assert "test_path is not set" not in caplog.text


def test_decode_gpu_on_cuda_warns_when_cuda_has_fewer_than_32_work_queues(shards, monkeypatch):
    """A script that builds the datamodule itself (no ``python -m mixlab``, which sets 32) and trains with the GPU
    stage on CUDA gets one warning saying how to get 32 queues; with 32 there is none."""
    out, _ = shards
    dm = ImageNetDataModule(format="wds", train_path=str(out / "train-{0000..0003}.tar"), num_classes=N_CLASSES,
                            image_size=32, batch_size=2, num_workers=1, decode="gpu", train_samples=8)
    monkeypatch.setattr(dm, "_root_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(dm, "prefetched", lambda loader, train: loader)  # no CUDA here
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    with pytest.warns(UserWarning, match=r"ImageNetDataModule: 8 CUDA hardware work queues per GPU are fewer than the "
                                         r"streams of decode gpu, .* export CUDA_DEVICE_MAX_CONNECTIONS=32"):
        dm.train_dataloader()
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dm.train_dataloader()
