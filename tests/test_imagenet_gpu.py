"""``decode: gpu`` (mixlab.datamodules.imagenet_gpu) run on the CPU device against the CPU (timm/PIL) path.

Images are the photo-like synthetic JPEGs of ``write_synthetic_shards`` (96 x 72, 3 classes); levels are
0..255 (the uint8 scale), so "mean |d| < 1" is less than one grey level.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.interpreter import interpreter_cannot_loop, run_interpreter_check
from PIL import Image

from mixlab.datamodules.imagenet import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    SKIPPED,
    ImageNetDataModule,
    decode_sample,
    eval_transform,
    seeded_rngs,
    synthetic_jpeg,
    train_transform,
    write_synthetic_shards,
)
from mixlab.datamodules.imagenet_gpu import (
    _GEOMETRIC,
    RA_OPS,
    AugmentPlanner,
    DevicePrefetcher,
    EncodedBatch,
    GpuPipeline,
    TrainParams,
    _AugmentGraphs,
    _Upload,
    aa_resample_weights,
    apply_ra_op,
    collate_encoded,
    decode_jpegs,
    encode_sample,
    resized_crops,
    stage_op_counts,
)

MEAN, STD = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)


def _levels(x: torch.Tensor) -> torch.Tensor:
    """Normalised images -> 0..255 levels."""
    return (x * STD + MEAN) * 255


@pytest.fixture(scope="module")
def samples():
    rng = np.random.default_rng(0)
    return [{"__key__": f"k{i}", "__url__": "s.tar", "jpg": synthetic_jpeg(rng, 96, 72), "cls": str(i % 3).encode()}
            for i in range(24)]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic")
    return write_synthetic_shards(out, 24, size=(96, 72), num_classes=3, maxcount=4)  # 6 shards


def _both_paths(samples, tf, seed0=1000):
    """CPU path images and the gpu path (CPU device) batch for the same per-sample seeds."""
    cpu, enc = [], []
    params = TrainParams(tf)
    for i, s in enumerate(samples):
        with seeded_rngs(seed0 + i):
            cpu.append(decode_sample(s, 3, tf)[0])
        with seeded_rngs(seed0 + i):
            enc.append(encode_sample(s, 3, params))
    batch = collate_encoded(enc)
    x, y = GpuPipeline(tf, train=True)(batch)
    return torch.stack(cpu), x, y, batch


def test_sampled_parameters_are_the_cpu_paths_draws():
    """Crop boxes (on the original size) equal timm's RandomResizedCrop draws for the same seed, and their
    distribution is the recipe's: area fraction in [0.08, 1] (mean ~0.42 on a 4:3 image: draws that do
    not fit are redrawn, which favours small crops), aspect in [3/4, 4/3]."""
    tf = train_transform(224)
    params, rrc = TrainParams(tf), tf.transforms[0]
    img = Image.open(io.BytesIO(synthetic_jpeg(np.random.default_rng(1), 500, 375)))  # header only
    crops = []
    for seed in range(400):
        with seeded_rngs(seed):
            p = params(img)
        with seeded_rngs(seed):
            ref = rrc.get_params(img, rrc.scale, rrc.ratio)
        assert p["crop"].tolist() == list(ref)
        crops.append(ref)
    c = torch.tensor(crops, dtype=torch.float64)
    area, aspect = c[:, 2] * c[:, 3] / (500 * 375), c[:, 3] / c[:, 2]
    assert area.min() >= 0.075 and area.max() <= 1.0 and 0.38 < area.mean() < 0.47
    assert aspect.min() >= 0.74 and aspect.max() <= 1.34
    assert (c[:, 0] + c[:, 2] <= 375).all() and (c[:, 1] + c[:, 3] <= 500).all()


@pytest.mark.parametrize("name", RA_OPS)
def test_each_randaugment_op_matches_timms_pil_op(name):
    """Every op against timm's own PIL function on the same image and argument: bit-exact except the
    geometric ops (grid_sample bicubic a=-0.75 vs PIL's a=-0.5: under 1.5 levels on average)."""
    from timm.data.auto_augment import NAME_TO_OP

    img = Image.open(io.BytesIO(synthetic_jpeg(np.random.default_rng(2), 70, 50))).convert("RGB")
    x = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1)[None].float()
    args = {"Rotate": 25.0, "Posterize": 2, "PosterizeIncreasing": 1, "PosterizeOriginal": 6, "Solarize": 100,
            "SolarizeIncreasing": 30, "SolarizeAdd": 90, "ShearX": 0.27, "ShearY": -0.27, "TranslateX": 11.0,
            "TranslateY": -7.0, "TranslateXRel": 0.3, "TranslateYRel": -0.4, "Color": 1.7, "Contrast": 0.4,
            "Brightness": 1.6, "Sharpness": 0.2, "ColorIncreasing": 0.3, "ContrastIncreasing": 1.8,
            "BrightnessIncreasing": 0.5, "SharpnessIncreasing": 1.9}
    fill = (124, 116, 104)
    a = args.get(name)
    ref = NAME_TO_OP[name](img, *([] if a is None else [a]), fillcolor=fill, resample=Image.BICUBIC)
    ref = torch.from_numpy(np.asarray(ref).copy()).permute(2, 0, 1).float()
    out = apply_ra_op(name, x, torch.tensor([float(a or 0)], dtype=torch.float64), 3, torch.tensor(fill).float())[0]
    d = (out - ref).abs()
    assert out.shape == ref.shape and out.min() >= 0 and out.max() <= 255 and torch.equal(out, out.round())
    if name in ("Rotate", "ShearX", "ShearY"):
        assert d.mean() < 1.5 and (d == 0).float().mean() > 0.3, (d.mean(), d.max())
    else:
        assert d.max() == 0, (d.mean(), d.max())


def test_train_batch_matches_cpu_path_per_image_and_per_channel(samples):
    """Same seeds: the same crops, flips, ops and erasing boxes; images without erasing agree to under one
    level on average (decoder and resize kernels), erased ones outside their box; per-channel mean and std
    of the batch agree to 0.02 (normalised units)."""
    tf = train_transform(64)
    x_cpu, x, y, batch = _both_paths(samples, tf)
    assert x.shape == x_cpu.shape == (24, 3, 64, 64) and x.dtype == torch.float32
    assert y.tolist() == [i % 3 for i in range(24)]
    boxes = batch.params["erase"][:, 0]
    erased = boxes[:, 2] > 0
    assert 0 < int(erased.sum()) < 24 and (batch.params["ra_op"] >= 0).any()
    for k in range(24):
        d = (_levels(x[k]) - _levels(x_cpu[k])).abs()
        if erased[k]:
            t, le, h, w = boxes[k].tolist()
            d[:, t:t + h, le:le + w] = 0
        assert d.mean() < 1.0, (k, d.mean())
    keep = ~erased
    assert torch.allclose(x[keep].mean((0, 2, 3)), x_cpu[keep].mean((0, 2, 3)), atol=0.02)
    assert torch.allclose(x[keep].std((0, 2, 3)), x_cpu[keep].std((0, 2, 3)), atol=0.02)
    assert torch.allclose(x.std((0, 2, 3)), x_cpu.std((0, 2, 3)), atol=0.05)  # erasing noise: N(0, 1) both
    again, _ = GpuPipeline(tf, train=True)(batch)
    assert torch.equal(again, x)  # deterministic given the batch (exact resume)


@pytest.mark.parametrize("size", [32, [24, 40], 80])
def test_eval_batch_matches_cpu_path(samples, size):
    """Resize by 256/224 then centre crop, at square, non-square and upsampling resolutions: equal to the
    CPU path within JPEG decoder differences (mean under 0.5 levels, no pixel off by more than 12)."""
    tf = eval_transform(size)
    ref = torch.stack([decode_sample(s, 3, tf)[0] for s in samples])
    x, y = GpuPipeline(tf, train=False)(collate_encoded([encode_sample(s, 3) for s in samples]))
    assert x.shape == ref.shape and y.tolist() == [i % 3 for i in range(24)]
    d = (_levels(x) - _levels(ref)).abs()
    assert d.mean() < 0.5 and d.max() <= 12, (d.mean(), d.max())


def test_corrupt_images_are_skipped_and_counted_in_workers_and_at_decode(samples):
    good = samples[0]["jpg"]
    bad = [dict(samples[1], jpg=good[: len(good) // 3], __key__="trunc"),  # no end-of-image marker: PIL check
           dict(samples[2], jpg=b"not an image", __key__="junk")]
    params = TrainParams(train_transform(32))
    before = SKIPPED["corrupt"]
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert [encode_sample(s, 3, params) for s in bad] == [None, None]
    assert SKIPPED["corrupt"] - before == 2 and sum("'trunc' in s.tar" in str(w.message) for w in rec) == 1
    # a file that passes the worker's header check but no decoder reads: found at (accelerator) decode time
    enc = [encode_sample(s, 3, params) for s in samples[:4]]
    broken = bytearray(good[:200]) + bytes(range(256)) * 8 + b"\xff\xd9"
    enc[1]["jpeg"] = torch.frombuffer(broken, dtype=torch.uint8)
    batch = collate_encoded(enc)
    before = SKIPPED["corrupt"]
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        imgs = decode_jpegs(batch.data, batch.offsets, torch.device("cpu"), batch.keys)
        x, y = GpuPipeline(train_transform(32), train=True)(batch)
    assert imgs[1] is None and all(im is not None and im.shape == (3, 72, 96) for k, im in enumerate(imgs) if k != 1)
    assert SKIPPED["corrupt"] - before == 2  # once per call
    assert any("'k1' in s.tar" in str(w.message) and "accelerator" in str(w.message) for w in rec)
    assert x.shape == (3, 3, 32, 32) and y.tolist() == [batch.labels[k].item() for k in (0, 2, 3)]


def _encoded(samples, tf, seed0=1000) -> list[dict]:
    params = TrainParams(tf)
    out = []
    for i, s in enumerate(samples):
        with seeded_rngs(seed0 + i):
            out.append(encode_sample(s, 3, params))
    return out


@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
def test_worker_decoded_share_equals_the_accelerator_decode(samples, fraction):
    """``cpu_fraction``: the first share of the batch is decoded, cropped, resized and flipped in the worker
    (torchvision's uint8 resize: fixed-point weights) and equals the accelerator path's float32 resize of the
    same crop to within one level; labels and draws stay with their images; the rest equals the all-bytes batch
    exactly (the same code); the whole recipe on top agrees to under half a level on average."""
    plain = train_transform(40, auto_augment=None, re_prob=0.0, color_jitter=0.0)
    enc = _encoded(samples, plain)
    ref, y_ref = GpuPipeline(plain, train=True)(collate_encoded(enc))
    batch = collate_encoded(enc, cpu_fraction=fraction, size=(40, 40))
    p = round(fraction * 24)
    assert batch.num_decoded == p and batch.pixels.dtype == torch.uint8 and batch.pixels.shape == (p, 3, 40, 40)
    assert len(batch.offsets) == 24 - p + 1 and batch.keys == [e["key"] for e in enc]
    assert torch.equal(batch.params["crop"], torch.stack([e["crop"] for e in enc]))
    x, y = GpuPipeline(plain, train=True)(batch)
    assert torch.equal(y, y_ref)
    d = (_levels(x) - _levels(ref)).abs()
    assert d[:p].max() < 1.01 and d[:p].mean() < 0.3, (d[:p].max(), d[:p].mean())
    assert d[p:].numel() == 0 or d[p:].max() < 1e-3
    assert (batch.params["flip"][:p]).any()  # flips were applied in the worker (else the maximum would be large)
    tf = train_transform(40)  # the DeiT recipe: the same draws, augmentation on the accelerator for all images
    enc = _encoded(samples, tf)
    full, _ = GpuPipeline(tf, train=True)(collate_encoded(enc))
    x, _ = GpuPipeline(tf, train=True)(collate_encoded(enc, cpu_fraction=fraction, size=(40, 40)))
    assert (_levels(x) - _levels(full)).abs().mean() < 0.5


def test_encoded_batch_pickles_as_one_buffer_and_release_frees_it(samples):
    """A worker's batch crosses the process boundary as ONE storage (torch's shared-memory pickler: one file
    descriptor, one mapping) and comes back equal, field by field, with its worker-decoded pixels; ``release``
    empties every host tensor and frees that storage."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's shared-memory reductions)

    tf = train_transform(40)
    batch = collate_encoded(_encoded(samples, tf), cpu_fraction=0.25, size=(40, 40),
                            planner=GpuPipeline(tf, train=True).planner("cpu"))
    named = dict(batch._tensors())
    assert {"data", "offsets", "labels", "pixels", "params.crop", "params.ra_arg", "params.flip", "plan.data",
            "plan.erase_data"} <= set(named)
    got = pickle.loads(ForkingPickler.dumps(batch))
    assert got.plan.key == batch.plan.key and got.plan.layout == batch.plan.layout
    assert [layer.slots for layer in got.plan.layers] == [layer.slots for layer in batch.plan.layers]
    assert batch.plan.data is named["plan.data"]  # pickling left the worker's batch whole
    assert got.keys == batch.keys and got.train == batch.train and got.num_decoded == 6
    for name, t in got._tensors():
        ref = named[name]
        assert t.dtype == ref.dtype and torch.equal(t, ref), name
        assert t.untyped_storage().data_ptr() == got.data.untyped_storage().data_ptr(), name
    assert got.params["ra_arg"].dtype == torch.float64 and got.params["flip"].dtype == torch.bool
    x, y = GpuPipeline(tf, train=True)(got)
    x_ref, y_ref = GpuPipeline(tf, train=True)(batch)
    assert torch.equal(y, y_ref) and torch.equal(x, x_ref)
    storage = got.data.untyped_storage()
    got.release()
    assert all(t.numel() == 0 for _, t in got._tensors()) and len(got) == 0
    assert storage.nbytes() > 0 and storage.data_ptr() != got.data.untyped_storage().data_ptr()
    cuda = batch.to("meta")  # a batch holding a non-host tensor pickles unpacked
    assert "_packed" not in cuda.__getstate__() and cuda.__getstate__()["labels"].device.type == "meta"


def test_worker_made_augment_plan_is_the_stages_own_and_is_used(samples, monkeypatch):
    """The augmentation plan a worker makes (``collate_encoded(planner=...)``) holds exactly the arrays the stage
    would upload, the stage uses it instead of planning (the planner is not called again), and the images equal
    those of the same batch without a plan; a plan made for another setting (CUDA graphs' padding, on a CPU stage)
    is ignored and the stage plans itself; evaluation and an unknown device get no planner."""
    tf = train_transform(40)
    enc = _encoded(samples, tf)
    pipe = GpuPipeline(tf, train=True)
    plain = collate_encoded(enc)
    batch = collate_encoded(enc, planner=pipe.planner("cpu"))
    n = len(batch)
    assert plain.plan is None and batch.plan.key == (n, (40, 40), None, False)
    ref = AugmentPlanner(pipe.mean, pipe.std, pipe.fill, (40, 40), pipe.params.ra_families,
                         pipe.params.ra_modes)(plain.params)
    assert torch.equal(batch.plan.data, ref.data) and torch.equal(batch.plan.erase_data, ref.erase_data)
    assert batch.plan.erase_seed == int(plain.params["seed"].sum()) % 2**63
    assert batch.plan.erase_layout == ref.erase_layout
    x_ref, y_ref = pipe(plain)
    cuda_plan = collate_encoded(enc, planner=GpuPipeline(tf, train=True).planner("cuda"))
    assert cuda_plan.plan.key == (n, (40, 40), -(-n // 16), False)

    def refuse(self, p):
        raise AssertionError("the stage planned again")

    with monkeypatch.context() as m:
        m.setattr(AugmentPlanner, "__call__", refuse)
        x, y = pipe(batch)
    assert torch.equal(x, x_ref) and torch.equal(y, y_ref)
    x, y = pipe(cuda_plan)  # not its plan: planned here, the same images
    assert torch.equal(x, x_ref) and torch.equal(y, y_ref)
    assert GpuPipeline(eval_transform(40), train=False).planner("cpu") is None and pipe.planner(None) is None


def test_worker_decode_failure_goes_to_the_accelerator_decode_and_is_counted(samples):
    """An image libjpeg-turbo refuses in the worker's share moves behind the worker-decoded images (label and
    draws with it), reaches the accelerator's decode, and is skipped and counted there; a share of 0 rounds to
    no worker decoding; a share without the output size is an error."""
    tf = train_transform(32, auto_augment=None, re_prob=0.0, color_jitter=0.0)
    enc = _encoded(samples[:6], tf)
    good = samples[0]["jpg"]
    enc[1]["jpeg"] = torch.frombuffer(bytearray(good[:200]) + bytes(range(256)) * 8 + b"\xff\xd9", dtype=torch.uint8)
    batch = collate_encoded(enc, cpu_fraction=0.5, size=(32, 32))
    assert batch.num_decoded == 2 and batch.keys == [enc[k]["key"] for k in (0, 2, 1, 3, 4, 5)]
    assert batch.labels.tolist() == [enc[k]["label"] for k in (0, 2, 1, 3, 4, 5)]
    before = SKIPPED["corrupt"]
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        x, y = GpuPipeline(tf, train=True)(batch)
    assert SKIPPED["corrupt"] - before == 1 and any("'k1' in s.tar" in str(w.message) for w in rec)
    assert x.shape == (5, 3, 32, 32) and y.tolist() == [enc[k]["label"] for k in (0, 2, 3, 4, 5)]
    ref, _ = GpuPipeline(tf, train=True)(collate_encoded([enc[k] for k in (0, 2, 3, 4, 5)]))
    assert (_levels(x) - _levels(ref)).abs().max() < 1.01
    assert collate_encoded(enc, cpu_fraction=0.01, size=(32, 32)).pixels is None
    with pytest.raises(ValueError, match="output size"):
        collate_encoded(enc, cpu_fraction=0.5)


def test_datamodule_gpu_mode_loaders_and_rank_split(shards, monkeypatch):
    """``decode='gpu'`` loaders yield EncodedBatch; the datamodule hooks turn them into images; under 2
    simulated ranks x 2 workers every validation image is read exactly once; ``auto`` is ``cpu`` here."""
    assert ImageNetDataModule(train_path=shards).decode_mode() == "cpu"
    with pytest.raises(ValueError, match="decode='gpu' reads WebDataset shards"):
        ImageNetDataModule(format="folder", decode="gpu")
    dm = ImageNetDataModule(train_path=shards, val_path=shards, num_classes=3, image_size=32, batch_size=4,
                            num_workers=2, train_samples=16, decode="gpu", persistent_workers=False)
    batches = list(dm.train_dataloader())
    assert len(batches) == 4 and all(isinstance(b, EncodedBatch) and b.train for b in batches)
    x, y = dm.on_after_batch_transfer(dm.transfer_batch_to_device(batches[0], torch.device("cpu"), 0), 0)
    assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    with pytest.raises(ValueError, match="cpu_decode_fraction must be in"):
        ImageNetDataModule(train_path=shards, decode="gpu", cpu_decode_fraction=1.5)
    dm = ImageNetDataModule(train_path=shards, val_path=shards, num_classes=3, image_size=32, batch_size=4,
                            num_workers=2, train_samples=16, decode="gpu", persistent_workers=False,
                            cpu_decode_fraction=0.5)
    b = next(iter(dm.train_dataloader()))
    assert b.num_decoded == 2 and "2 of 4 images of each training batch decoded, cropped, resized and flipped in " \
        "the 2 DataLoader worker(s)" in dm.pipeline_summary()
    dm.cpu_decode_fraction = 0.1  # rounds to no image of 4: said so
    assert "cpu_decode_fraction=0.1 is no image of a batch of 4" in dm.pipeline_summary()
    with pytest.warns(UserWarning, match="cpu_decode_fraction=0.5 has no effect with decode=cpu"):
        ImageNetDataModule(train_path=shards, decode="cpu", cpu_decode_fraction=0.5)
    x, y = dm.on_after_batch_transfer(dm.transfer_batch_to_device(b, torch.device("cpu"), 0), 0)
    assert x.shape == (4, 3, 32, 32) and torch.equal(y, b.labels)
    assert all(v.num_decoded == 0 for v in dm.val_dataloader())  # evaluation: the accelerator decodes all
    keys = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        dm = ImageNetDataModule(val_path=shards, num_classes=3, eval_size=24, eval_batch_size=5, num_workers=2,
                                decode="gpu")
        for b in dm.val_dataloader():
            assert not b.train
            x, y = dm.on_after_batch_transfer(b, 0)
            assert x.shape == (len(b), 3, 24, 24)
            keys += b.keys
    assert len(keys) == len(set(keys)) == 24


# ---------------------------------------------------------------------- batched crop + resize, prefetch
def test_aa_resample_weights_equal_torch_interpolate_float64():
    """Row o of the matrix = the weights torch's antialiased bicubic gives output pixel o (read off by resizing
    the identity), down- and upsampling, odd sizes, and zero beyond each input's size."""
    import torch.nn.functional as F

    for n_in, out in [(375, 224), (97, 224), (224, 224), (5, 3), (1, 7), (500, 31)]:
        eye = torch.eye(n_in, dtype=torch.float64).view(n_in, 1, 1, n_in)
        ref = F.interpolate(eye, size=(1, out), mode="bicubic", antialias=True, align_corners=False)
        ref = ref.view(n_in, out).T  # [out, n_in]
        w = aa_resample_weights(torch.tensor([n_in]), out, n_in + 3)[0].double()
        torch.testing.assert_close(w[:, :n_in], ref, rtol=0, atol=2e-7)  # float32 weights
        assert bool((w[:, n_in:] == 0).all())


def _dense_reference_weights(in_sizes, out_size, n_max, resized=None, offsets=None):
    """The resampling matrices as :func:`aa_resample_weights` computed them before the windowed version (every
    input pixel of every row in float64), kept as the plain reference of the formula."""
    def cubic(x):  # Keys, a = -0.5
        x = x.abs()
        near, far = (1.5 * x - 2.5) * x * x + 1, (((x - 5) * x + 8) * x - 4) * -0.5
        return torch.where(x < 1, near, torch.where(x < 2, far, torch.zeros_like(x)))

    size = in_sizes.to(torch.float64).view(-1, 1, 1)
    scale = size / (out_size if resized is None else resized.to(torch.float64).view(-1, 1, 1))
    stretch = scale.clamp_min(1.0)
    o = torch.arange(out_size, dtype=torch.float64).view(1, -1, 1)
    if offsets is not None:
        o = o + offsets.to(torch.float64).view(-1, 1, 1)
    centre = scale * (o + 0.5)
    lo = (centre - 2 * stretch + 0.5).trunc().clamp_min(0)
    hi = torch.minimum((centre + 2 * stretch + 0.5).trunc(), size)
    j = torch.arange(n_max, dtype=torch.float64).view(1, 1, -1)
    w = cubic((j - centre + 0.5) / stretch) * ((j >= lo) & (j < hi))
    return (w / w.sum(-1, keepdim=True)).to(torch.float32)


def test_windowed_resample_weights_equal_the_dense_formula():
    """The windowed weights (taps from the host sizes, scattered into the dense matrix) equal the dense formula
    to float32 rounding: random sizes down- and upsampling, scale exactly 1, odd sizes, 1-pixel inputs, resized
    sizes with window offsets, flipped rows (= the reference's rows reversed), the default taps and the dense
    fallback. Rows past a resized input (no window: 0 / 0 in the reference) are zero."""
    from mixlab.datamodules.imagenet_gpu import _window_taps

    g = torch.Generator().manual_seed(3)
    cases = [(torch.tensor([375, 224, 97, 1, 5, 224]), 224, None, None),  # down, exactly 1, up, 1 pixel, odd
             (torch.randint(1, 400, (40,), generator=g), 57, None, None)]
    sizes = torch.randint(1, 300, (40,), generator=g)
    res = torch.randint(20, 400, (40,), generator=g)
    cases.append((sizes, 16, res, (torch.rand(40, generator=g) * (res - 16).clamp_min(0)).long()))
    cases.append((sizes, 30, res, None))  # rows past small resized sizes: empty windows
    for in_sizes, out, resized, offsets in cases:
        n_max = int(in_sizes.max()) + 3
        ref = _dense_reference_weights(in_sizes, out, n_max, resized, offsets)
        empty = ref.isnan().all(-1)
        assert bool(empty.any()) == (out == 30) and not ref[~empty].isnan().any()
        ref = ref.nan_to_num(0.0)
        scale = (in_sizes / (out if resized is None else resized)).max()
        flip = torch.rand(len(in_sizes), generator=g) < 0.5
        variants = {"taps": aa_resample_weights(in_sizes, out, n_max, resized, offsets, _window_taps(scale, n_max)),
                    "default": aa_resample_weights(in_sizes, out, n_max, resized, offsets),
                    "flip": aa_resample_weights(in_sizes, out, n_max, resized, offsets, _window_taps(scale, n_max),
                                                flip),
                    "default flip": aa_resample_weights(in_sizes, out, n_max, resized, offsets, flip=flip)}
        want_flip = torch.where(flip.view(-1, 1, 1), ref.flip(1), ref)
        for name, w in variants.items():
            assert w.shape == ref.shape and w.dtype == torch.float32, name
            torch.testing.assert_close(w, want_flip if "flip" in name else ref, rtol=0, atol=1.2e-7,
                                       msg=lambda m, name=name: f"{name}, out {out}: {m}")


def test_resize_groups_split_and_gemm_order():
    """The split into size groups: exactly ``k`` contiguous runs covering the sorted crops, each under the byte
    cap, padded work no more than one group's (and less on ImageNet-like crops); with a cap that no ``k`` runs
    meet, runs grow greedily to the cap. Each GEMM order is the cheaper one for its padded sizes."""
    from mixlab.datamodules.imagenet_gpu import _resize_cost, _split_groups

    rng = np.random.default_rng(0)
    area = rng.uniform(0.08, 1.0, 256) * 500 * 375  # RandomResizedCrop-like crops of 500 x 375 images
    aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3), 256))
    h = np.minimum(np.sqrt(area / aspect), 375).astype(np.int64)
    w = np.minimum(np.sqrt(area * aspect), 500).astype(np.int64)
    o = np.argsort(h * w, kind="stable")
    h, w = h[o], w[o]

    def cost(runs):
        return sum((e - s) * _resize_cost(np.array(h[s:e].max()), np.array(w[s:e].max()), 224, 224)[0]
                   for s, e in runs)

    one = cost([(0, 256)])
    for k in (1, 2, 4, 7):
        runs = _split_groups(h, w, (224, 224), k, 1 << 30)
        assert len(runs) == k and runs[0][0] == 0 and runs[-1][1] == 256
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(runs, runs[1:]))
        assert cost(runs) <= one
    assert cost(_split_groups(h, w, (224, 224), 4, 1 << 30)) < 0.8 * one  # 0.76 (timm's crop draws: 0.67)
    cap = 12 * 200 * 200 * 3  # at most 3 crops of 200 x 200 per run
    runs = _split_groups(h, w, (224, 224), 4, cap)
    assert len(runs) > 4 and runs[-1][1] == 256
    assert all(e - s == 1 or (e - s) * 12 * h[s:e].max() * w[s:e].max() <= cap for s, e in runs)
    # rows first (Wy X) Wx^T: oh wm (hm + ow); columns first Wy (X Wx^T): hm ow (wm + oh)
    assert not _resize_cost(np.array(375), np.array(500), 224, 224)[1]  # wide crop: columns (the long side) first
    assert _resize_cost(np.array(500), np.array(375), 224, 224)[1]  # tall crop: rows first
    assert _resize_cost(np.array(100), np.array(100), 224, 224)[0] == 100 * 224 * 324 + 256 * 100 * 100


def _random_crops(n: int, seed: int, lo: int = 20, hi: int = 160, shape: str = "any", device: str = "cpu"):
    """``n`` random uint8 images with a random crop box each (the first 1 x 1; ``shape`` 'tall' / 'wide': boxes
    at least 3x taller / wider than wide / tall) and random flips."""
    g = torch.Generator().manual_seed(seed)
    imgs, boxes = [], []
    for k in range(n):
        h, w = (int(v) for v in torch.randint(lo, hi, (2,), generator=g))
        if shape != "any":
            h, w = (3 * max(h, w), min(h, w)) if shape == "tall" else (min(h, w), 3 * max(h, w))
        imgs.append(torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g).to(device))
        bh, bw = (1, 1) if k == 0 and shape == "any" else (int(torch.randint(1, h + 1, (), generator=g)),
                                                          int(torch.randint(1, w + 1, (), generator=g)))
        if shape == "tall":
            bh, bw = max(bh, 3 * bw, 3), bw
        elif shape == "wide":
            bh, bw = bh, max(bw, 3 * bh, 3)
        bh, bw = min(bh, h), min(bw, w)
        boxes.append([int(torch.randint(0, h - bh + 1, (), generator=g)),
                      int(torch.randint(0, w - bw + 1, (), generator=g)), bh, bw])
    return imgs, torch.tensor(boxes), torch.rand(n, generator=g) < 0.5


def _diff_to_torchvision(out, imgs, boxes, flip, size):
    """|out - torchvision's resized_crop (bicubic, antialiased; rounded, clamped, flipped)| per pixel."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.functional import resized_crop

    diffs = []
    for b, (im, (t, le, h, w)) in enumerate(zip(imgs, boxes.tolist())):
        ref = resized_crop(im.float(), t, le, h, w, list(size), interpolation=InterpolationMode.BICUBIC,
                           antialias=True).round().clamp(0, 255)
        diffs.append((out[b] - (ref.flip(-1) if flip[b] else ref)).abs())
    return torch.stack(diffs)


def test_resized_crops_equal_torchvision_per_image():
    """The batched crop + resize + flip equals torchvision's resized_crop image by image (uint8 result, both
    resampling directions, crops of 1 pixel, many size groups under a small memory cap)."""
    imgs, boxes, flip = _random_crops(14, 0)
    out = resized_crops(imgs, boxes, (40, 56), flip, max_bytes=3 * 100 * 100 * 4 * 2)
    assert out.shape == (14, 3, 40, 56) and out.dtype == torch.float32
    d = _diff_to_torchvision(out, imgs, boxes, flip, (40, 56))
    assert d.max() <= 1 and (d > 0).float().mean() < 1e-3  # float32 sums: a rare tie rounds the other way
    assert resized_crops([], torch.zeros(0, 4, dtype=torch.int64), (8, 8)).shape == (0, 3, 8, 8)


@pytest.mark.parametrize("groups", [1, 3, 4, 20])
@pytest.mark.parametrize("size", [(40, 56), (56, 40)])
def test_resized_crops_equal_torchvision_for_any_number_of_groups(groups, size):
    """One size group, a few, or more groups than images (then one image each), square and non-square outputs
    (both GEMM orders): every image equals torchvision's."""
    imgs, boxes, flip = _random_crops(14, 1)
    d = _diff_to_torchvision(resized_crops(imgs, boxes, size, flip, groups=groups), imgs, boxes, flip, size)
    assert d.max() <= 1 and (d > 0).float().mean() < 1e-3


def test_resized_crops_gemm_operands_are_16_byte_aligned(monkeypatch):
    """Every operand of the crop/resize GEMMs has a leading dimension and a start of a multiple of 4 float32
    values (16 bytes), whatever the crop sizes: cuBLAS then takes its aligned TF32 kernels (the H200 profile showed
    ``align1`` kernels when the weights' rows were ``n_max + taps`` and the crops ``wm`` values long). The result
    still equals torchvision's."""
    seen = []
    orig = torch.bmm

    def bmm(a, b, out=None):
        for t in (a, b) + (() if out is None else (out,)):
            ld = t.stride(-2) if t.stride(-1) == 1 else t.stride(-1) if t.stride(-2) == 1 else None
            seen.append((ld, t.storage_offset(), t.stride(0)))
        return orig(a, b) if out is None else orig(a, b, out=out)

    monkeypatch.setattr(torch, "bmm", bmm)
    for seed, shape in ((11, "tall"), (12, "wide"), (13, "any")):
        imgs, boxes, flip = _random_crops(9, seed, shape=shape)
        boxes[:, 2:] = boxes[:, 2:].clamp_min(2)  # odd and even widths, never a multiple of 4 by design
        boxes[:, 2] = torch.minimum(boxes[:, 2], torch.tensor([im.shape[1] for im in imgs]))
        boxes[:, 3] = torch.minimum(boxes[:, 3], torch.tensor([im.shape[2] for im in imgs]))
        boxes[:, 0] = torch.minimum(boxes[:, 0], torch.tensor([im.shape[1] for im in imgs]) - boxes[:, 2])
        boxes[:, 1] = torch.minimum(boxes[:, 1], torch.tensor([im.shape[2] for im in imgs]) - boxes[:, 3])
        out = resized_crops(imgs, boxes, (40, 36), flip)
        d = _diff_to_torchvision(out, imgs, boxes, flip, (40, 36))
        assert d.max() <= 1 and (d > 0).float().mean() < 1e-3, shape
    assert seen and all(ld is not None and ld % 4 == 0 and off % 4 == 0 and bs % 4 == 0 for ld, off, bs in seen), seen
    w = aa_resample_weights(torch.tensor([13, 7]), 9, 13)
    assert w.stride(1) % 4 == 0 and w.shape == (2, 9, 13)


def test_resized_crops_op_count_does_not_depend_on_crop_sizes():
    """Tall crops (rows-first GEMMs) and wide crops (columns first), a batch whose largest crop is in the
    last group or not: the same torch ops (the per-group views are strided views, not size-dependent slices),
    and each equals torchvision."""
    from mixlab.datamodules.imagenet_gpu import RESIZE_GROUPS, _resize_cost

    counts = {}
    for shape, seed in (("tall", 2), ("wide", 3), ("any", 5), ("any", 7)):
        imgs, boxes, flip = _random_crops(12, seed, shape=shape)
        hm, wm = (int(v) for v in boxes[:, 2:].max(0).values)
        if shape != "any":
            assert bool(_resize_cost(np.array(hm), np.array(wm), 40, 40)[1]) == (shape == "tall")
        counts[shape, seed] = stage_op_counts(lambda _: resized_crops(imgs, boxes, (40, 40), flip), None)
        d = _diff_to_torchvision(resized_crops(imgs, boxes, (40, 40), flip), imgs, boxes, flip, (40, 40))
        assert d.max() <= 1 and (d > 0).float().mean() < 1e-3, shape
    assert len({(c["ops"], c["compute"]) for c in counts.values()}) == 1, counts
    assert RESIZE_GROUPS == 2  # the stage op counts quoted in the op-count test below assume it


def test_tf32_scope_restores_the_callers_precision_settings():
    """``_tf32_matmul`` (the crop/resize GEMMs' TF32 scope on CUDA) turns TF32 on inside and afterwards leaves
    every legacy and new-API precision setting as the caller had it, from each of the ways a caller sets them
    (in a subprocess: the settings are process-wide)."""
    import subprocess
    import sys

    code = r"""
import torch
from mixlab.datamodules.imagenet_gpu import _tf32_matmul
m, get = torch.backends.cuda.matmul, torch._C._get_fp32_precision_getter
def state():
    out = []
    for f in (lambda: m.allow_tf32, torch.get_float32_matmul_precision,
              *[lambda b=b, o=o: get(b, o) for b, o in [("generic", "all"), ("cuda", "matmul"), ("cuda", "all"),
                ("cudnn", "conv"), ("cudnn", "all"), ("mkldnn", "matmul"), ("mkldnn", "all")]]):
        try:
            out.append(f())
        except RuntimeError:
            out.append("mixed")
    return out
def reset():
    torch.set_float32_matmul_precision("highest")
    for b, o in [("cuda", "matmul"), ("mkldnn", "matmul"), ("generic", "all")]:
        torch._C._set_fp32_precision_setter(b, o, "none")
pristine = state()
inits = {"default": lambda: None, "high": lambda: torch.set_float32_matmul_precision("high"),
         "medium": lambda: torch.set_float32_matmul_precision("medium"),
         "legacy off": lambda: setattr(m, "allow_tf32", False), "legacy on": lambda: setattr(m, "allow_tf32", True),
         "new ieee": lambda: setattr(m, "fp32_precision", "ieee"),
         "new tf32": lambda: setattr(m, "fp32_precision", "tf32"),
         "generic tf32": lambda: setattr(torch.backends, "fp32_precision", "tf32"),
         "cudnn tf32": lambda: setattr(torch.backends.cudnn.conv, "fp32_precision", "tf32")}
for name, init in inits.items():
    reset()
    assert state() == pristine, (name, state())
    init()
    before = state()
    with _tf32_matmul(True):
        inside = state()
    assert state() == before, (name, before, state())
    assert inside[0] is True or before[0] == "mixed", (name, inside)
    with _tf32_matmul(False):
        assert state() == before
print("ok", len(inits))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok 9" in done.stdout, done.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_resized_crops_on_cuda_with_and_without_tf32():
    """On CUDA: float32 GEMMs equal torchvision's resized_crop (on the same device) as on the CPU; TF32 GEMMs
    (the default) differ by one level at most, on a few percent of pixels at most; the caller's TF32 setting
    is unchanged afterwards."""
    imgs, boxes, flip = _random_crops(64, 6, lo=100, hi=500, device="cuda")
    before = torch.backends.cuda.matmul.allow_tf32
    for tf32 in (False, True):
        out = resized_crops(imgs, boxes, (224, 224), flip.cuda(), tf32=tf32)
        d = _diff_to_torchvision(out, imgs, boxes, flip, (224, 224))
        frac = float((d > 0).float().mean())
        print(f"tf32={tf32}: max {float(d.max())}, pixels differing {frac:.2e}")
        assert d.max() <= 1 and frac < (0.05 if tf32 else 1e-3), (tf32, float(d.max()), frac)
    assert torch.backends.cuda.matmul.allow_tf32 == before


def _encoded_batches(samples, tf, n: int) -> list:
    """``n`` training batches of 6 encoded samples each (bytes + parameters drawn under fixed seeds)."""
    params = TrainParams(tf)
    batches = []
    for k in range(n):
        enc = []
        for i, s in enumerate(samples[6 * k: 6 * k + 6]):
            with seeded_rngs(100 * k + i):
                enc.append(encode_sample(s, 3, params))
        batches.append(collate_encoded(enc))
    return batches


def test_device_prefetcher_yields_the_stage_outputs_in_order_and_reraises(samples):
    """The prefetcher hands out exactly what the stage gives batch by batch; the first batch runs in the
    consumer's thread, the others in the background thread; an error in either reaches the consumer; leaving
    the loop early ends the thread; an empty loader yields nothing."""
    tf = train_transform(32)
    batches = _encoded_batches(samples, tf, 4)
    pipe = GpuPipeline(tf, train=True)
    direct = [pipe(b) for b in batches]
    got = list(DevicePrefetcher(batches, pipe, "cpu", depth=2))
    assert len(got) == 4 and len(DevicePrefetcher(batches, pipe, "cpu")) == 4
    for (x, y), (xr, yr) in zip(got, direct):
        assert torch.equal(x, xr) and torch.equal(y, yr)
    for (x, y), (xr, yr) in zip(DevicePrefetcher(batches, pipe, "cpu", priority_consumer=True), direct, strict=True):
        assert torch.equal(x, xr) and torch.equal(y, yr)  # no streams on a CPU device: the same batches

    def bad_stage(b):
        raise ValueError("broken shard")

    with pytest.raises(ValueError, match="broken shard"):
        list(DevicePrefetcher(batches, bad_stage, "cpu"))
    import threading

    threads = []

    def stage_in(b):
        threads.append(threading.current_thread().name)
        if len(threads) == 3:
            raise ValueError("broken third batch")
        return pipe(b)

    with pytest.raises(ValueError, match="broken third batch"):  # an error in the background thread, too
        list(DevicePrefetcher(batches, stage_in, "cpu"))
    # the first batch (one-time work: CUDA graph captures) in the consumer's thread, the rest in the background
    assert threads[0] == threading.current_thread().name and set(threads[1:]) == {"mixlab-device-prefetch"}
    assert list(DevicePrefetcher([], pipe, "cpu")) == []

    it = iter(DevicePrefetcher(batches, pipe, "cpu", depth=1))
    next(it)
    it.close()
    assert not any(t.name == "mixlab-device-prefetch" for t in threading.enumerate())
    with pytest.raises(ValueError, match="depth must be >= 1"):
        DevicePrefetcher(batches, pipe, "cpu", depth=0)


def _transported(batch: EncodedBatch) -> EncodedBatch:
    """``batch`` as the training process receives it from a DataLoader worker (torch's shared-memory pickler)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's shared-memory reductions)

    return pickle.loads(ForkingPickler.dumps(batch))


def test_device_prefetcher_frees_each_batch_after_its_stage_on_an_accelerator(samples):
    """On an accelerator (here the ``meta`` device: no streams) the prefetcher releases the host memory of every
    batch that came from a worker once the stage has returned, the first one (consumer's thread) and the rest
    (background thread), after the stage has read it; the caller's own batches (not transported), and any batch on
    the CPU, are left as they are (they may be iterated again)."""
    own = _encoded_batches(samples, train_transform(32), 4)
    batches = [_transported(b) for b in own]
    expected = [(int(b.data.sum()), b.params["crop"].clone()) for b in batches]

    def stage(b):
        assert b.labels.device.type == "meta" and b.data.numel() > 0
        return int(b.data.sum()), b.params["crop"].clone()

    got = list(DevicePrefetcher(batches, stage, "meta", depth=2))
    assert [g[0] for g in got] == [e[0] for e in expected]
    assert all(torch.equal(g[1], e[1]) for g, e in zip(got, expected))
    assert all(b.data.numel() == 0 and b.params["crop"].numel() == 0 and len(b) == 0 for b in batches)
    assert [(int(b.data.sum()), len(b)) for b in own] == [(e[0], 6) for e in expected]
    assert list(DevicePrefetcher(own, stage, "meta", depth=2))[0][0] == expected[0][0]
    kept = [_transported(b) for b in _encoded_batches(samples, train_transform(32), 2)]
    list(DevicePrefetcher(kept, lambda b: (b.data.sum(), b.labels), "cpu"))
    assert all(b.data.numel() > 0 and len(b) == 6 for b in kept)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_REMOVE) is Linux's")
def test_release_gives_a_transported_batchs_pages_back_unless_they_are_held(samples):
    """``release`` frees a worker batch's shared-memory pages before emptying it (another view of the buffer then
    reads zeros: the pages are gone); with ``pages_held`` (nvImageCodec may still read the bytes) the pages stay
    and a view taken before reads the bytes unchanged; private memory is never touched."""
    from mixlab.datamodules.imagenet_gpu import _give_back_pages

    for held in (False, True):
        batch = _transported(_encoded_batches(samples, train_transform(32), 1)[0])
        assert batch.transported and batch.data.is_shared() and batch.data.numel() > 3 * 4096
        view = torch.empty(0, dtype=torch.uint8).set_(batch.data.untyped_storage())  # the whole buffer
        before = view.clone()
        batch.pages_held = held
        batch.release()
        assert len(batch) == 0 and batch.data.numel() == 0
        if held:
            assert torch.equal(view, before)
        else:
            assert view[8192:-8192].count_nonzero() == 0 and before[8192:-8192].count_nonzero() > 0
    private = torch.arange(3 * 4096, dtype=torch.int32)
    assert not _give_back_pages(private.untyped_storage()) and torch.equal(private, torch.arange(3 * 4096))


def test_device_prefetcher_with_a_decode_thread_yields_the_same_batches_and_reraises(samples):
    """``decode_thread``: the JPEGs decoded one batch ahead in a second thread (``GpuPipeline.decode``) and the
    rest of the stage (``finish``) in the stage thread give exactly the one-thread batches, in order, in every pass;
    the stage thread waited for the decode thread (``decode_wait``); an error in either thread reaches the
    consumer; leaving early ends both threads; a stage without ``decode``/``finish`` is refused."""
    import threading

    tf = train_transform(32)
    batches = _encoded_batches(samples, tf, 4)
    pipe = GpuPipeline(tf, train=True)
    direct = [pipe(b) for b in batches]
    pre = DevicePrefetcher(batches, pipe, "cpu", depth=1, decode_thread=True)
    for _ in range(2):
        got = list(pre)
        assert len(got) == 4
        for (x, y), (xr, yr) in zip(got, direct, strict=True):
            assert torch.equal(x, xr) and torch.equal(y, yr)
    assert pre.timings()["batches"] == 8 and pre.timings()["decode_wait"] > 0

    class BrokenDecode(GpuPipeline):
        def decode(self, batch):
            if int(batch.labels.sum()) == int(batches[2].labels.sum()):
                raise ValueError("unreadable third batch")
            return super().decode(batch)

    with pytest.raises(ValueError, match="unreadable third batch"):
        list(DevicePrefetcher(batches, BrokenDecode(tf, train=True), "cpu", decode_thread=True))
    it = iter(DevicePrefetcher(batches, pipe, "cpu", depth=1, decode_thread=True))
    next(it)
    next(it)
    it.close()
    alive = {t.name for t in threading.enumerate()}
    assert not alive & {"mixlab-device-prefetch", "mixlab-device-decode"}, alive
    with pytest.raises(ValueError, match="decode_thread needs a stage with decode"):
        DevicePrefetcher(batches, lambda b: b, "cpu", decode_thread=True)


def test_device_prefetcher_timings_say_where_the_input_time_went(samples):
    """``timings()``: the loader's waits (a loader that sleeps 30 ms before each batch after the first, which the
    consumer itself fetches), the stage's time (the pipeline sleeping 20 ms in each stage call, its decode time
    from ``GpuPipeline.decode_seconds``), the consumer waiting for the thread, and the batches handed out, summed
    over two passes. Lower bounds only: sleeps last at least as long as asked."""
    import time

    tf = train_transform(32)
    batches = _encoded_batches(samples, tf, 3)
    pipe = GpuPipeline(tf, train=True)

    class SlowLoader:
        def __len__(self):
            return len(batches)

        def __iter__(self):
            for k, b in enumerate(batches):
                if k:
                    time.sleep(0.03)
                yield b

    def stage(b):
        time.sleep(0.02)
        return pipe(b)

    stage.decode_seconds = 0.0
    pre = DevicePrefetcher(SlowLoader(), stage, "cpu", depth=1)
    assert pre.timings() == {"consumer_wait": 0.0, "loader_wait": 0.0, "stage": 0.0, "stage_cpu": 0.0,
                             "queue_full": 0.0, "decode": 0.0, "batches": 0.0}  # decode_wait only with decode_thread
    for _ in range(2):
        assert len(list(pre)) == 3
    t = pre.timings()
    assert t["batches"] == 6 and t["loader_wait"] >= 4 * 0.03 and t["stage"] >= 6 * 0.02
    assert 0 < t["stage_cpu"] <= t["stage"] - 6 * 0.02 + 0.05  # the sleeps are waiting, not CPU time
    assert t["consumer_wait"] >= 4 * 0.03  # the consumer waits for every batch the thread fetches and stages
    assert t["queue_full"] >= 0 and t["decode"] == 0.0  # the stage function has no decode time of its own
    before = pipe.decode_seconds
    list(DevicePrefetcher(batches, pipe, "cpu").__iter__())
    assert pipe.decode_seconds > before  # GpuPipeline counts its decode_jpegs time


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_prefetcher_runs_the_consumer_on_a_high_priority_stream_on_cuda(samples):
    """``priority_consumer``: while the pass runs, the consumer's current stream has priority -1 (above the
    stage's stream), the batches equal the stage run directly, and afterwards the caller's stream is current
    again; without it the consumer stays on the caller's stream. The batches come as from workers (shared memory),
    so each is released, its pages given back, as soon as its stage returns: the images are still right."""
    dev = torch.device("cuda")
    tf = train_transform(32)
    batches = _encoded_batches(samples, tf, 3)
    pipe = GpuPipeline(tf, train=True)
    direct = [pipe(b.to(dev)) for b in batches]
    caller = torch.cuda.current_stream(dev)
    for priority, expected in ((True, -1), (False, caller.priority)):
        seen = []
        sent = [_transported(b) for b in batches]
        for (x, y), (xr, yr) in zip(DevicePrefetcher(sent, pipe, dev, priority_consumer=priority), direct,
                                    strict=True):
            seen.append(torch.cuda.current_stream(dev).priority)
            assert torch.equal(x, xr) and torch.equal(y, yr)
        assert seen == [expected] * 3
        assert torch.cuda.current_stream(dev) == caller
        assert all(len(b) == 0 for b in sent)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_prefetcher_decode_thread_on_cuda_gives_the_same_batches(samples):
    """On CUDA, with the decode in its own thread and stream (``decode_thread``) and the consumer on the
    high-priority stream, as training runs it: the batches equal the stage run directly, over two passes (the
    stage stream waits for each decode event; the images' memory is not reused early)."""
    dev = torch.device("cuda")
    tf = train_transform(32)
    batches = _encoded_batches(samples, tf, 4)
    pipe = GpuPipeline(tf, train=True)
    direct = [pipe(b.to(dev)) for b in batches]
    pre = DevicePrefetcher(batches, pipe, dev, depth=1, priority_consumer=True, decode_thread=True)
    for _ in range(2):
        for (x, y), (xr, yr) in zip(pre, direct, strict=True):
            assert torch.equal(x, xr) and torch.equal(y, yr)
    assert pre.timings()["batches"] == 8 and pre.timings()["decode"] > 0


@pytest.mark.parametrize("size", [24, 40])
def test_batched_eval_equals_per_image_resize_and_center_crop(size):
    """The eval stage (Resize short side + CenterCrop through resized_crops) equals timm's transforms run
    image by image on the decoded tensors (also for a thin image the resize enlarges); another
    interpolation takes the per-image path and matches exactly."""
    g = torch.Generator().manual_seed(size)
    pipe = GpuPipeline(eval_transform(size), train=False)
    hws = [(int(h), int(w)) for h, w in torch.randint(30, 130, (9, 2), generator=g)] + [(12, 200)]
    imgs = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in hws]
    ref = torch.stack([pipe.crop(pipe.resize(im.float()).round().clamp(0, 255)) for im in imgs])
    d = (pipe._eval(imgs) - ref).abs()
    assert d.max() <= 1 and (d > 0).float().mean() < 1e-3
    bilinear = GpuPipeline(eval_transform(size, interpolation="bilinear"), train=False)
    ref = torch.stack([bilinear.crop(bilinear.resize(im)) for im in imgs]).float()
    torch.testing.assert_close(bilinear._eval(imgs), ref, rtol=0, atol=0)


# ---------------------------------------------------------------------- batched RandAugment, op count
_ARGS = {"Rotate": 25.0, "PosterizeIncreasing": 1, "SolarizeIncreasing": 30, "SolarizeAdd": 90, "ShearX": 0.27,
         "ShearY": -0.27, "TranslateXRel": 0.3, "TranslateYRel": -0.4, "ColorIncreasing": 0.3,
         "ContrastIncreasing": 1.8, "BrightnessIncreasing": 0.5, "SharpnessIncreasing": 1.9}


def _with_ops(batch: EncodedBatch, ops: list[list[str | None]]) -> EncodedBatch:
    """``batch`` with RandAugment draws replaced: image b applies ``ops[b]`` (timm names, None: no op) with
    the arguments of ``_ARGS``, on odd images negated (geometric ops) or mirrored about 1 (enhance factors) as
    timm's random negation does, bicubic."""
    def arg(o, k):
        a = float(_ARGS.get(o, 0))
        if k % 2 and o.startswith(("Rotate", "Shear", "Translate")):
            return -a
        return 2 - a if k % 2 and o.startswith(("Color", "Contrast", "Brightness", "Sharpness")) else a

    b = len(batch)
    op = torch.tensor([[-1 if o is None else RA_OPS.index(o) for o in row] for row in ops], dtype=torch.int64)
    arg = torch.tensor([[arg(o, k) if o else 0.0 for o in row] for k, row in enumerate(ops)], dtype=torch.float64)
    params = dict(batch.params, ra_op=op, ra_arg=arg, ra_interp=torch.full((b, op.shape[1]), 3, dtype=torch.int64))
    return EncodedBatch(batch.data, batch.offsets, batch.labels, batch.keys, params, batch.train)


def _recipe_batch(samples, tf):
    params = TrainParams(tf)
    enc = []
    for i, s in enumerate(samples):
        with seeded_rngs(500 + i):
            enc.append(encode_sample(s, 3, params))
    return collate_encoded(enc), [op.name for op in tf.transforms[2].ops]


def test_randaugment_layers_batched_equal_per_image_ops(samples):
    """A batch whose images draw different ops (every op of the recipe, in both layers, with image-specific
    arguments) gives, image by image, exactly what the ops applied to that image alone give."""
    tf = train_transform(40)
    batch, names = _recipe_batch(samples, tf)
    ops = [[names[k % len(names)], names[(3 * k + 1) % len(names)]] for k in range(len(batch))]
    ops[5][1] = None
    pipe = GpuPipeline(tf, train=True)
    batch = _with_ops(batch, ops)
    x = pipe._train(decode_jpegs(batch.data, batch.offsets, torch.device("cpu"), batch.keys), batch.params, "cpu")
    fill = torch.tensor(pipe.fill)
    ref = []
    for k in range(len(batch)):
        im = x[k:k + 1]
        for layer in range(2):
            o = batch.params["ra_op"][k, layer]
            if o >= 0:
                im = apply_ra_op(RA_OPS[o], im, batch.params["ra_arg"][k, layer:layer + 1], 3, fill)
        ref.append(im)
    ref = torch.cat(ref)
    up = _Upload()
    layers = pipe.layers(up, batch.params, (40, 40))
    s_fill = up.add(fill.double().numpy())
    segs = up.to(torch.device("cpu"))
    for layer in layers:
        layer(x, segs, segs[s_fill].float().view(1, 3, 1, 1))
    assert torch.equal(x, ref)


def test_padded_families_equal_exact_ones(samples):
    """With a quantum (the CUDA-graph layout), every family runs on its image count rounded up, the extra
    entries scratch images after the batch with identity parameters: the real images come out exactly as
    with each family on exactly its images; the scratch images stay integer levels (valid LUT indices)."""
    tf = train_transform(40)
    batch, names = _recipe_batch(samples, tf)
    n = len(batch)
    batch = _with_ops(batch, [[names[k % len(names)], names[(5 * k + 2) % len(names)]] for k in range(n)])
    pipe = GpuPipeline(tf, train=True)
    x = pipe._train(decode_jpegs(batch.data, batch.offsets, torch.device("cpu"), batch.keys), batch.params, "cpu")
    fill = torch.tensor(pipe.fill).view(1, 3, 1, 1)
    outs = {}
    for q in (None, 1, 5, 32):
        up = _Upload()
        layers = pipe.layers(up, batch.params, (40, 40), q)
        segs = up.to(torch.device("cpu"))
        xq = torch.cat([x, torch.zeros(q or 0, *x.shape[1:])])
        for layer in layers:
            if q:
                assert all(m % q == 0 and m < len(segs[layer.slots[f][0]]) + q for f, m in layer.sizes.items())
                assert all(len(segs[slot[0]]) == -(-n // q) * q for slot in layer.slots.values())
            layer(xq, segs, fill)
        outs[q] = xq
        assert torch.equal(xq, xq.round().clamp(0, 255))
    for q in (1, 5, 32):
        assert torch.equal(outs[q][:n], outs[None]), q


class _EagerGraphs(_AugmentGraphs):
    """:class:`_AugmentGraphs` on the CPU: a "graph" runs its captured body again on every replay (what a CUDA
    graph does on the device), reading the same static buffers."""

    def __init__(self, n, hw):
        self.n, self.hw, self.device = n, tuple(hw), torch.device("cpu")
        self.quantum = -(-n // 16)
        self.x = torch.zeros(n + self.quantum, 3, *hw)
        self.plan = self.layout = self.done = None
        self.graphs, self.captures = {}, 0

    def begin(self):
        pass

    def end(self):
        pass

    @contextlib.contextmanager
    def _capturing(self):
        yield torch.zeros_like(self.x)

    def _capture(self, body, scratch):
        body(scratch)
        self.captures += 1
        return type("G", (), {"replay": staticmethod(lambda: body(self.x))})()


def test_augment_graph_replays_equal_the_eager_stage(samples):
    """The graph path's Python side on the CPU (:class:`_EagerGraphs`): static image and plan buffers with a
    fixed layout, every (layer, family, padded count) captured at the first batch (24 images: quantum
    ceil(24 / 16) = 2, so 12 counts x 4 families x 2 layers), replayed for later batches with other draws.
    Every batch equals the eager stage's output exactly, and later batches capture nothing."""
    tf = train_transform(32)
    batch, names = _recipe_batch(samples, tf)
    n = len(batch)
    pipe = GpuPipeline(tf, train=True)
    graphs = _EagerGraphs(n, pipe.size)
    pipe._graphs_for = lambda k, dev: graphs if k == n else None
    draws = [[[names[(k + s) % len(names)], names[(3 * k + s) % len(names)]] for k in range(n)] for s in range(3)]
    draws.append(draws[0])  # the first batch's draws again: nothing new to capture
    captured = []
    for ops in draws:
        b = _with_ops(batch, ops)
        x, y = pipe(b)
        want, y_want = GpuPipeline(tf, train=True)(b)
        assert torch.equal(x, want) and torch.equal(y, y_want)
        assert x.data_ptr() != graphs.x.data_ptr()  # a new tensor: the next batch reuses the buffer
        captured.append(graphs.captures)
    assert captured == [2 * 4 * 12] * len(draws), captured
    assert len(graphs.graphs) == captured[-1]
    plan = graphs.plan
    pipe(_with_ops(batch, draws[1]))
    assert graphs.plan is plan  # same layout: the same static buffer


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_augment_cuda_graphs_equal_eager_on_cuda(samples, impl):
    """On CUDA: the training stage with its augmentation in CUDA graphs gives the eager stage's images, batch
    after batch (new draws, reused graphs); a batch of another size runs eagerly. ``torch`` (the family graphs):
    exactly. ``triton`` (the fused kernels, one graph): images without a geometric op exactly; a geometric op's
    output can be one level off where its sampled value lies within rounding of a half level (``grid_sample``'s
    CUDA kernel contracts multiply-adds), which a second layer can widen (Contrast, Equalize): rare values."""
    tf = train_transform(48)
    batch, names = _recipe_batch(samples, tf)
    n = len(batch)
    dev = torch.device("cuda")
    graphed = GpuPipeline(tf, train=True, augment_impl=impl)
    eager = GpuPipeline(tf, train=True, cuda_graphs=False, augment_impl=impl)  # the same crop + resize kernels
    for s in range(4):
        ops = [[names[(k + s) % len(names)], names[(3 * k + s) % len(names)]] for k in range(n)]
        b = _with_ops(batch, ops).to(dev)
        x, _ = graphed(b)
        want, _ = eager(b)
        if impl == "torch":
            assert torch.equal(x, want), s
        else:
            geometric = torch.tensor([any(o in _GEOMETRIC for o in pair) for pair in ops], device=dev)
            assert torch.equal(x[~geometric], want[~geometric]), s
            assert float((x != want).float().mean()) < 1e-3, s
    assert graphed._graphs is not None and graphed._graphs.graphs
    assert (type(graphed._graphs).__name__ == "_FusedGraphs") == (impl == "triton")
    small = collate_encoded([encode_sample(s, 3, graphed.params) for s in samples[:5]]).to(dev)
    assert graphed._graphs_for(5, dev) is None
    assert torch.equal(graphed(small)[0], eager(small)[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_worker_decoded_share_on_cuda(samples):
    """On CUDA, with the worker-decoded share pinned (the DataLoader's pin-memory thread) and the augmentation in
    CUDA graphs: the same images as the stage on the CPU device to within the decoders' and TF32's differences,
    and the graphed stage equals the eager one exactly (no random erasing: its noise generator is per device)."""
    tf = train_transform(48, re_prob=0.0)
    batch = collate_encoded(_encoded(samples, tf), cpu_fraction=0.5, size=(48, 48)).pin_memory()
    assert batch.pixels.is_pinned()
    ref, _ = GpuPipeline(tf, train=True)(batch)
    dev = torch.device("cuda")
    x, y = GpuPipeline(tf, train=True)(batch.to(dev))
    eager, _ = GpuPipeline(tf, train=True, cuda_graphs=False)(batch.to(dev))
    assert torch.equal(x, eager) and torch.equal(y.cpu(), batch.labels)
    d = (_levels(x.cpu()) - _levels(ref)).abs()
    assert d.mean() < 1.0, d.mean()


def test_device_stage_op_count_does_not_depend_on_the_ops_drawn(samples):
    """CPU proxy of the stage's kernel launches (issue 21): the torch ops one batch dispatches (torch.profiler)
    are the same whether every image draws different RandAugment ops, all draw the same op or none draws
    one, and for 8 or 24 images (one decoder call per image on the CPU aside); none of them would make the
    host wait for an accelerator. No timing.

    For reference (torch 2.14, CPU): this batch's stage dispatched 510 ops (358 compute) with the crop/resize in one
    size group and dense float64 resampling weights; 519 (362) with RESIZE_GROUPS = 2 size groups (13 ops, 5 compute
    each: the gather, its float copy, the two GEMMs), the windowed weights of all groups in one call (one scatter
    into the dense matrices) and the flip folded into the weights. The number of groups is min(RESIZE_GROUPS, B),
    so 8 and 24 images dispatch the same ops. The evaluation stage: 126 (75) -> 141 (82)."""
    tf = train_transform(32)
    batch, names = _recipe_batch(samples, tf)
    pipe = GpuPipeline(tf, train=True)
    n = len(batch)
    variants = {"different": [[names[k % len(names)], names[(k + 7) % len(names)]] for k in range(n)],
                "same": [["Rotate", "Rotate"]] * n, "none": [[None, None]] * n}
    counts = {k: stage_op_counts(pipe, _with_ops(batch, ops)) for k, ops in variants.items()}
    assert len({(c["ops"], c["compute"]) for c in counts.values()}) == 1, counts
    assert counts["none"]["decode"] == n and counts["none"]["compute"] < counts["none"]["ops"]
    assert all(c["syncs"] == 0 for c in counts.values()), counts  # no item / nonzero / unique ... in the stage
    assert stage_op_counts(lambda b: (torch.ones(3).nonzero(), float(torch.ones(1))), None)["syncs"] == 3
    enc = []
    for i, s in enumerate(samples[:8]):
        with seeded_rngs(248 + i):  # no image draws an erasing box here: the erasing ops run on none
            enc.append(encode_sample(s, 3, pipe.params))
    assert not (collate_encoded(enc).params["erase"][..., 2] > 0).any()
    small = stage_op_counts(pipe, _with_ops(collate_encoded(enc), variants["different"][:8]))
    assert (small["ops"], small["compute"]) == (counts["none"]["ops"], counts["none"]["compute"]), (small, counts)


@pytest.mark.parametrize("recipe", [dict(auto_augment=None), dict(interpolation="bilinear")],
                         ids=["colour-jitter", "bilinear"])
def test_other_recipes_match_cpu_path(samples, recipe):
    """Colour jitter instead of RandAugment (brightness / contrast / saturation in a per-image random order, as
    batched layers) and a bilinear recipe (per-image crop, RandAugment's geometric ops bilinear): images agree
    with the CPU path to under one level on average outside the erasing boxes (colour jitter: under 0.25 over the
    batch, measured 0.17; the jitter steps applied in the reverse order give 0.49)."""
    tf = train_transform(48, **recipe)
    x_cpu, x, _, batch = _both_paths(samples, tf, seed0=3000)
    jitter = recipe.get("auto_augment", "") is None
    assert ("cj_order" in batch.params) == jitter and ("ra_op" in batch.params) != jitter
    boxes = batch.params["erase"][:, 0]
    means = []
    for k in range(len(samples)):
        d = (_levels(x[k]) - _levels(x_cpu[k])).abs()
        t, le, h, w = boxes[k].tolist()
        d[:, t:t + h, le:le + w] = 0
        means.append(float(d.mean()))
    assert max(means) < (0.5 if jitter else 1.0) and sum(means) / len(means) < (0.25 if jitter else 0.4), means
    if jitter:
        assert (batch.params["cj_factor"][:, :3] != 1).all()



def test_gpu_mode_loader_runs_under_the_spawn_start_method(shards):
    """``decode: gpu`` workers started with ``spawn`` (forkserver is Python 3.14's default on Linux) get the
    pickled dataset and augmentation sampler (timm's RandAugment ops record through a class, not a closure)
    and give the fork-started loader's batches: same keys, labels and parameters."""
    kw = dict(train_path=shards, num_classes=3, image_size=32, batch_size=4, num_workers=2, train_samples=16,
              decode="gpu", persistent_workers=False)
    dm = ImageNetDataModule(**kw)
    want = list(dm.train_dataloader())
    dm = ImageNetDataModule(**kw)
    loader = dm.train_dataloader()
    loader.multiprocessing_context = "spawn"
    got = list(loader)
    assert [b.keys for b in got] == [b.keys for b in want] and len(got) == 4
    for b, b0 in zip(got, want):
        assert torch.equal(b.labels, b0.labels) and b.params.keys() == b0.params.keys()
        assert all(torch.equal(b.params[k], b0.params[k]) for k in b.params)


def test_pipeline_summary_says_where_images_are_decoded_and_augmented():
    """The line logged when the train loader is built names the decode mode, the device stage's place and
    whether the RandAugment layers replay CUDA graphs (on a CPU device ``cuda_graphs`` is said to do nothing)."""
    dm = ImageNetDataModule(train_path="x.tar", decode="cpu", num_workers=3)
    assert dm.pipeline_summary() == "decode cpu: JPEG decoding and augmentation in 3 DataLoader worker(s)"
    text = ImageNetDataModule(train_path="x.tar", decode="gpu").pipeline_summary()
    assert "on cpu" in text and "2 batch(es) ahead" in text and "cuda_graphs has no effect on a CPU device" in text
    assert "high-priority" not in text and "priority_training has no effect on a CPU device" in text
    dm = ImageNetDataModule(train_path="x.tar", decode="gpu", cuda_graphs=False, prefetch_batches=0)
    text = dm.pipeline_summary()
    assert "in on_after_batch_transfer" in text and text.endswith("launched op by op")


def test_no_prefetch_thread_for_training_with_num_workers_0(monkeypatch):
    """With ``num_workers: 0`` the training samples' parameter draws reseed the process's global generators
    (``seeded_rngs``); from the prefetch thread they would interleave with the training step's Mixup / dropout
    draws (two runs of one seed differed from their first step, on an H100 and on the CPU), so the training loader
    is not prefetched then (the stage runs in the training step) and the summary says why; evaluation stays
    prefetched."""
    from mixlab.datamodules.imagenet_gpu import DevicePrefetcher

    loader = [1, 2]
    for workers, prefetched in ((0, False), (1, True)):
        dm = ImageNetDataModule(train_path="x.tar", decode="gpu", num_workers=workers, prefetch_batches=2)
        monkeypatch.setattr(dm, "_root_device", lambda: torch.device("cpu"))
        assert isinstance(dm.prefetched(loader, True), DevicePrefetcher) == prefetched, workers
        assert isinstance(dm.prefetched(loader, False), DevicePrefetcher)
        text = dm.pipeline_summary()
        assert ("num_workers 0: the samples' augmentation draws reseed" in text) == (not prefetched), text
        assert ("2 batch(es) ahead" in text) == prefetched, text


def test_fused_triton_layer_equals_the_family_reference_under_interpreter():
    """The fused augmentation layer (two Triton kernels over the batch, :mod:`mixlab.datamodules.imagenet_triton`)
    under Triton's CPU interpreter equals the family-batched torch reference exactly: every RandAugment op (each
    drawn at least once, timm-like arguments, nearest / bilinear / bicubic for the geometric ones), flat images and
    channels, saturated corners, odd sizes down to 3 x 5, and two layers in a row (the ping-pong buffers)."""
    pytest.importorskip("triton")
    res = run_interpreter_check("imagenet_triton_check.py")
    assert len(res) == 4
    for case, r in res.items():
        if case == "two_layers":
            assert r["non_geometric_differ"] == 0 and r["geometric_share_differ"] == 0.0, r
            continue
        assert {"lut", "equalize", "blend", "affine"} <= set(r), (case, r)
        for fam, f in r.items():
            if fam != "pixels":
                assert f["differ"] == 0 and f["integer"] and f["range_ok"], (case, fam, f)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_triton_layer_on_cuda_equals_the_family_reference():
    """The compiled Triton kernels on CUDA against the torch reference on CUDA: point ops, Equalize and the blends
    exactly; the geometric ops to one level where ``grid_sample``'s own rounding differs (rare)."""
    pytest.importorskip("triton")
    import subprocess
    import sys

    script = Path(__file__).parent / "helpers" / "imagenet_triton_check.py"
    out = subprocess.run([sys.executable, str(script), "--device", "cuda"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for case, r in res.items():
        if case == "two_layers":
            assert r["non_geometric_differ"] == 0 and r["geometric_share_differ"] < 1e-3, r
            continue
        for fam, f in r.items():
            if fam == "pixels":
                continue
            assert f["integer"] and f["range_ok"], (case, fam, f)
            if fam == "affine":
                assert f["max"] <= 1.0 and f["differ"] <= 1e-3 * r["pixels"], (case, f)
            else:
                assert f["differ"] == 0, (case, fam, f)


def _check_triton_resize(res: dict, share: float) -> None:
    assert set(res) == {"train_any_12x20", "train_tall_20x12", "train_wide_9x9", "photo", "runs", "one_image",
                        "eval"}, res
    for name, r in res.items():
        assert r["integer"] and r["range_ok"], (name, r)
        # float32 sums in another order than torchvision's / the GEMMs': a rare tie rounds the other way
        assert r["tv_max"] <= 1 and r["tv_share"] < share and r["gemm_max"] <= 1 and r["gemm_share"] < share, (name, r)


def test_triton_crop_resize_equals_torchvision_under_the_interpreter():
    """``resized_crops(impl="triton")`` under Triton's CPU interpreter: random crops (any, tall, wide; flips; crops of
    1 pixel), photo-like decoded JPEGs, one image with a one-row output, and the evaluation's Resize + CenterCrop
    windows equal torchvision's ``resized_crop`` and the float32 GEMM path image by image (to one level on a rare
    tie)."""
    pytest.importorskip("triton")
    if reason := interpreter_cannot_loop():
        pytest.skip(reason)
    _check_triton_resize(run_interpreter_check("imagenet_resize_check.py"), 1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_crop_resize_on_cuda_equals_torchvision():
    """The compiled crop + resize kernels on CUDA at ImageNet sizes (64 crops of 100-500 px images to 224, 32
    evaluation images resized to 256 and cropped to 224) against torchvision and the float32 GEMMs."""
    pytest.importorskip("triton")
    import subprocess
    import sys

    script = Path(__file__).parent / "helpers" / "imagenet_resize_check.py"
    out = subprocess.run([sys.executable, str(script), "--device", "cuda"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    _check_triton_resize(json.loads(out.stdout.strip().splitlines()[-1]), 1e-3)


def test_resized_crops_refuses_an_unknown_impl_and_a_strided_out_for_triton():
    imgs, boxes, flip = _random_crops(2, 0)
    with pytest.raises(ValueError, match="resized_crops: impl must be 'gemm' or 'triton'; got 'cuda'"):
        resized_crops(imgs, boxes, (8, 8), flip, impl="cuda")
    out = torch.empty(2, 3, 8, 16)[..., ::2]
    with pytest.raises(ValueError, match="out must be float32 .*contiguous"):
        resized_crops(imgs, boxes, (8, 8), flip, impl="triton", out=out)


def test_augment_impl_is_checked_passed_on_and_summarised():
    """``augment_impl`` outside the choices is refused by the datamodule and the pipeline, naming the argument;
    the datamodule passes it to its pipelines (default ``torch``)."""
    with pytest.raises(ValueError, match="augment_impl must be 'triton' or 'torch'; got 'cuda'"):
        ImageNetDataModule(train_path="x.tar", augment_impl="cuda")
    with pytest.raises(ValueError, match="GpuPipeline: augment_impl must be one of"):
        GpuPipeline(train_transform(32), train=True, augment_impl="kornia")
    assert ImageNetDataModule(train_path="x.tar", decode="gpu").gpu_pipeline(True).augment_impl == "torch"
    dm = ImageNetDataModule(train_path="x.tar", decode="gpu", augment_impl="triton")
    assert dm.gpu_pipeline(True).augment_impl == "triton"
    assert "(augment_impl triton has no effect on a CPU device)" in dm.pipeline_summary()
    assert "augment_impl" not in ImageNetDataModule(train_path="x.tar", decode="gpu").pipeline_summary()


def test_jpeg_decoder_choice_is_checked(monkeypatch):
    """``jpeg_decoder`` outside the choices is refused by the datamodule, the pipeline and ``decode_jpegs``, each
    naming the argument (``auto`` is gone: it picked nvimgcodec when installed, which trained slower); the summary
    names the decoder (and that a CPU device decodes with torchvision)."""
    for bad in ("dali", "auto"):
        with pytest.raises(ValueError, match=f"jpeg_decoder must be 'torchvision' or 'nvimgcodec'; got '{bad}'"):
            ImageNetDataModule(train_path="x.tar", jpeg_decoder=bad)
    with pytest.raises(ValueError, match="GpuPipeline: jpeg_decoder must be one of"):
        GpuPipeline(train_transform(32), train=True, jpeg_decoder="nvjpeg")
    with pytest.raises(ValueError, match="decode_jpegs: decoder must be one of"):
        decode_jpegs(torch.zeros(4, dtype=torch.uint8), torch.tensor([0, 4]), torch.device("cpu"), ["k"], "pil")
    dm = ImageNetDataModule(train_path="x.tar", decode="gpu", jpeg_decoder="nvimgcodec")
    assert dm.gpu_pipeline(True).jpeg_decoder == "nvimgcodec"
    text = ImageNetDataModule(train_path="x.tar", decode="gpu", jpeg_decoder="nvimgcodec").pipeline_summary()
    assert "jpeg_decoder nvimgcodec has no effect on a CPU device: torchvision" in text
    dm = ImageNetDataModule(train_path="x.tar", decode="gpu", jpeg_decoder="nvimgcodec")
    monkeypatch.setattr(dm, "_root_device", lambda: torch.device("cuda", 0))
    with pytest.raises(ImportError, match=r"jpeg_decoder 'nvimgcodec' needs NVIDIA nvImageCodec: pip install"):
        dm.gpu_pipeline(True)


def test_nvimgcodec_images_it_cannot_decode_go_to_torchvision_then_pil(samples, monkeypatch):
    """nvImageCodec returns None for an image it cannot decode: that image (only) is decoded by torchvision alone
    (then PIL), and one no decoder reads is skipped and counted; the others are nvImageCodec's, in batch order."""
    from mixlab.datamodules import imagenet_gpu

    jpegs = [s["jpg"] for s in samples[:5]]
    jpegs[3] = jpegs[3][:100]  # truncated: no decoder reads it
    data = torch.from_numpy(np.frombuffer(b"".join(jpegs), np.uint8).copy())
    off = torch.zeros(6, dtype=torch.int64)
    off[1:] = torch.tensor([len(j) for j in jpegs]).cumsum(0)
    ref = [Image.open(io.BytesIO(j)).convert("RGB") for j in jpegs[:3] + jpegs[4:]]
    seen = []

    class Fake:  # stands in for the CUDA-only decoder: marks its images, fails images 1 and 3
        def decode(self, d, o, stream):
            from torchvision.io import decode_jpeg

            seen.append(stream)
            return [None if i in (1, 3) else decode_jpeg(d[o[i]:o[i + 1]]) for i in range(len(o) - 1)]

    monkeypatch.setattr(imagenet_gpu._NvImageCodec, "get", classmethod(lambda cls, device: Fake()))
    before = SKIPPED["corrupt"]
    with pytest.warns(RuntimeWarning, match="k3"):
        imgs = imagenet_gpu._decode_nvimgcodec(data, off, torch.device("cpu"), [f"k{i}" for i in range(5)], "s")
    assert seen == ["s"] and imgs[3] is None and SKIPPED["corrupt"] == before + 1
    for im, r in zip(imgs[:3] + imgs[4:], ref):
        assert (im.permute(1, 2, 0).int() - torch.from_numpy(np.array(r)).int()).abs().float().mean() < 1.5
    # a decoder that leaves failed images out of its list (older releases): which ones is unknown, so torchvision
    # decodes the whole batch
    class Short:
        def decode(self, cs, params, cuda_stream):
            return [object()] * (len(cs) - 1)

    codec = object.__new__(imagenet_gpu._NvImageCodec)
    codec.decoder, codec.params, codec.lock = Short(), None, contextlib.nullcontext()
    assert codec.decode(data, off, type("S", (), {"cuda_stream": 0})()) == [None] * len(jpegs)
    # planar buffers (P_RGB, nvImageCodec >= 0.9) are the images as they are; interleaved ones become [3, H, W] views
    hwc = np.arange(2 * 3 * 5 * 3, dtype=np.uint8).reshape(2, 3, 5, 3)

    class Layout:
        def __init__(self, planar):
            self.planar = planar

        def decode(self, cs, params, cuda_stream):
            return [np.ascontiguousarray(im.transpose(2, 0, 1)) if self.planar else im for im in hwc]

    two = off[:3]
    for planar in (True, False):
        codec.decoder, codec.planar, codec.device = Layout(planar), planar, torch.device("cpu")
        for im, ref in zip(codec.decode(data, two, type("S", (), {"cuda_stream": 0})()), hwc, strict=True):
            assert torch.equal(im, torch.from_numpy(ref).permute(2, 0, 1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nvimgcodec_decode_on_cuda_equals_pil_and_the_stage_keeps_its_images(samples):
    """On CUDA (with nvImageCodec installed): its images equal PIL's (the CPU path's decoder) to within one level
    (an H100, 32 ImageNet-sized JPEGs: max 1, mean 1e-4 levels; torchvision's nvJPEG: max 30, mean 3.3), small and
    ImageNet-sized JPEGs; prefetched with a decode thread over two passes the stage gives the same batches as run
    directly (its images are held until the crop has read them) and labels as the torchvision stage."""
    pytest.importorskip("nvidia.nvimgcodec")
    dev = torch.device("cuda")
    rng = np.random.default_rng(1)
    jpegs = [s["jpg"] for s in samples] + [synthetic_jpeg(rng, 500, 375) for _ in range(8)]
    data = torch.from_numpy(np.frombuffer(b"".join(jpegs), np.uint8).copy())
    off = torch.zeros(len(jpegs) + 1, dtype=torch.int64)
    off[1:] = torch.tensor([len(j) for j in jpegs]).cumsum(0)
    nv = decode_jpegs(data, off, dev, [f"k{i}" for i in range(len(jpegs))], "nvimgcodec")
    for im, j in zip(nv, jpegs, strict=True):
        ref = torch.from_numpy(np.array(Image.open(io.BytesIO(j)).convert("RGB"))).permute(2, 0, 1)
        d = (im.cpu().int() - ref.int()).abs()
        assert im.device.type == "cuda" and d.max() <= 2 and d.float().mean() < 0.05
    tf = train_transform(32)
    batches = _encoded_batches(samples, tf, 4)
    pipe = GpuPipeline(tf, train=True, jpeg_decoder="nvimgcodec")
    direct = [pipe(b.to(dev)) for b in batches]
    for (x, y), b in zip(direct, batches):
        assert torch.equal(y, GpuPipeline(tf, train=True)(b.to(dev))[1]) and x.isfinite().all()
    pre = DevicePrefetcher(batches, pipe, dev, depth=1, priority_consumer=True, decode_thread=True)
    for _ in range(2):
        for (x, y), (xr, yr) in zip(pre, direct, strict=True):
            assert torch.equal(x, xr) and torch.equal(y, yr)
