"""Input-pipeline benchmark: does ``ImageNetDataModule`` keep a GPU busy with ViT-S/16? (issue 21)

Run from the project root on the training machine (one GPU, all its CPU cores)::

    python scripts/bench_input.py --workers 15 --out bench_input.md
    python scripts/bench_input.py --shards '/data/imagenet/wds/imagenet1k-train-{0000..1023}.tar' \\
        --val-shards '/data/imagenet/wds/imagenet1k-validation-{0000..0063}.tar' --workers 15 --out bench_input.md
    python scripts/bench_input.py --quick --out /tmp/bench_input.md      # CPU smoke run, well under a minute

Without ``--shards`` it first writes synthetic ImageNet-like shards (``--images`` photo-like JPEGs of
``--image-wh`` pixels, about 77 kB each at 500x375, ``--classes`` labels; ``write_synthetic_shards``, the
``scripts/make_wds_shards.py`` writer) into ``--workdir``. For every ``--decode`` mode it measures, after
``--warmup`` batches, over ``--batches`` batches of ``--batch-size``:

* ``loader``: images/s out of the DataLoader (``--workers`` processes). ``cpu``: decoded and augmented
  tensors (timm DeiT recipe). ``gpu``: JPEG bytes + sampled augmentation parameters only;
* ``loader + device stage``: the same followed by the datamodule's ``on_after_batch_transfer`` on the
  device (``decode: gpu``: batched ``decode_jpeg``, crop/resize, RandAugment, erasing);
* ``device stage alone``: that stage on one batch held in memory (its device time per batch competes with
  the model's), with the torch ops it dispatches per batch (``device-stage ops per batch``, counted by
  ``torch.profiler``: a proxy of its kernel launches and host work that does not need a GPU);
* ``end to end``: loader + device stage + a ViT-S/16 training step (timm Mixup/CutMix, fwd + bwd + AdamW,
  bf16 autocast on CUDA): what training would see;

for the training and (``--val-shards`` or the synthetic set) the evaluation pipeline, and the model alone
(random tensors, same step). On CPU the device stage runs on the CPU. Also reported: the fraction of
images whose JPEG could be decoded at reduced size (PIL ``Image.draft``, a 2x or more DCT scaling) without
going under the resolution the crop needs (train: both crop sides >= 2 x 224; eval: short side >= 2 x 256).
Writes a Markdown table with date, device and command to ``--out`` and prints it. ``--profile N`` adds where the
device stage's time goes (phases, top kernels); ``--profile-end-to-end N`` profiles N prefetched training steps
and reports each CUDA stream's busy time and how much of the stage's work ran concurrently with the model's
(is the stage's device time hidden, or added to the step?). ``--decoders torchvision nvimgcodec`` adds the JPEG
decode alone of one training batch with each accelerator decoder (``jpeg_decoder``), with its difference to PIL's
images, and ``--decode-under-load`` the same decode while the model trains in another thread (what a fit's decode
costs, and what it costs the model's step); ``--jpeg-decoder`` picks the decoder of the loader rows.

``--cli-steps N`` adds the issue's measure: ``python -m mixlab fit --config configs/vit/goat_imagenet.yaml``
(``--cli-config``) for ``N`` steps on the same shards (every ``--decode`` mode and ``--cpu-decode-fraction``), next
to the same command on random tensors (``--config configs/data/random_images.yaml``: the model's own speed under
the same Lightning loop), each the median ``perf/images_per_s`` of the logged windows from step ``min(40, N/2)``,
in subprocesses, ``--cli-repeats`` times in alternating order (the first run of a machine is often the faster).
A fit on the shards takes about 100 s on the H200 hosts (10 s of it training), so ``--no-loader`` (skip the loader
and device-stage rows) keeps ``--cli-steps`` runs within a 10-minute device call. Each fit's wall time is split
into startup, logged steps and what follows the last logged step (the loaders' shutdown); ``--cli-stacks S`` also
samples the fit's stacks every ``S`` seconds and reports the main thread's frame at each sample. ``--cli-gil-hold MS
[MS ...]`` adds random-tensor fits in which a thread of the training process holds the GIL ``MS`` ms of every 50 ms:
what a device stage's Python running next to the training step can cost it. ``--cli-gil-profile START SECONDS``
samples each fit with py-spy (``pip install py-spy``) and reports which threads and frames hold the GIL.

Every row, and every CLI fit as it ends, is also printed to stderr, and ``--out`` holds what was measured so far
while the run goes on (a run cut short keeps it).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import io
import itertools
import json
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple

import torch
import torch.nn.functional as F

from mixlab.cli import CUDA_QUEUES
from mixlab.eval.common import OneLineParser


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sync_stream(device: torch.device) -> None:
    """Wait for the calling thread's current stream only (CUDA; other threads' work goes on)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def to_device(dm, batch, device: torch.device):
    """A loader batch -> (images, labels) on ``device``, as Lightning would (transfer, then the hook)."""
    batch = dm.transfer_batch_to_device(batch, device, 0)
    return dm.on_after_batch_transfer(batch, 0)


def time_loader(dm, split: str, device: torch.device, warmup: int, batches: int, stage: bool,
                step=None, prefetch: int = 0) -> tuple[float, int]:
    """(images/s, images timed) of ``split``'s loader, optionally followed by the device stage and ``step``;
    ``prefetch > 0`` (``decode: gpu``) runs the stage that many batches ahead in the datamodule's
    :class:`~mixlab.datamodules.imagenet_gpu.DevicePrefetcher`, as training does."""
    loader = dm.train_dataloader() if split == "train" else dm.val_dataloader()
    it = iter(prefetched(dm, loader, split == "train", device, prefetch) if prefetch else loader)
    n = 0
    t0 = None
    for k in range(warmup + batches):
        if k == warmup:
            sync(device)
            t0, n = time.perf_counter(), 0
        try:
            b = next(it)
        except StopIteration:
            break
        if stage:
            x, y = to_device(dm, b, device)
            if step is not None:
                step(x, y)
            n += len(y)
        else:
            n += len(b) if not isinstance(b, (tuple, list)) else len(b[1])
    sync(device)
    dt = time.perf_counter() - (t0 if t0 is not None else time.perf_counter())
    del it
    return (n / dt if dt > 0 and n else float("nan")), n


def prefetched(dm, loader, train: bool, device: torch.device, prefetch: int):
    """``loader`` with the device stage run ``prefetch`` batches ahead, as training runs it
    (:class:`~mixlab.datamodules.imagenet_gpu.DevicePrefetcher`)."""
    from mixlab.datamodules.imagenet_gpu import DevicePrefetcher

    return DevicePrefetcher(loader, dm.gpu_pipeline(train), device, prefetch,
                            priority_consumer=train and dm.priority_training)


def held_batch(dm, split: str, device: torch.device):
    """One loader batch of ``split``, after two warm-up calls of the device stage on it (synchronised)."""
    loader = dm.train_dataloader() if split == "train" else dm.val_dataloader()
    b = next(iter(loader))
    for _ in range(2):
        to_device(dm, b, device)
    sync(device)
    return b


def time_stage(dm, split: str, device: torch.device, reps: int) -> tuple[float, float, dict[str, int]]:
    """(images/s, ms per batch, ops) of the device stage alone on one held batch (``decode: gpu``); ops: the
    torch ops the stage dispatches on that batch (:func:`~mixlab.datamodules.imagenet_gpu.stage_op_counts`)."""
    from mixlab.datamodules.imagenet_gpu import stage_op_counts

    b = held_batch(dm, split, device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x, y = to_device(dm, b, device)
        sync(device)
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    ops = stage_op_counts(lambda batch: to_device(dm, batch, device), b)
    sync(device)
    return len(y) / t, 1000 * t, ops


def time_decoders(dm, device: torch.device, decoders: list[str], reps: int, compare: int = 32
                  ) -> list[tuple[str, float, float, str]]:
    """The JPEG decode alone (:func:`~mixlab.datamodules.imagenet_gpu.decode_jpegs`, one batched call) of one held
    training batch with each of ``decoders``: ``(decoder, images/s, ms per batch until the device is done, note)``;
    the note gives the host time until the call returns and the largest and mean difference, in levels, to PIL
    (the ``decode: cpu`` path's decoder) on the batch's first ``compare`` images. On a CPU device every decoder is
    torchvision's libjpeg-turbo (said in the note)."""
    import io

    import numpy as np
    from PIL import Image

    from mixlab.datamodules.imagenet_gpu import decode_jpegs

    b = held_batch(dm, "train", device)
    data, off, keys = b.data, b.offsets, b.keys[b.num_decoded:]
    ends = off.tolist()
    ref = [np.asarray(Image.open(io.BytesIO(data[ends[i]:ends[i + 1]].numpy().tobytes())).convert("RGB"))
           for i in range(min(compare, len(ends) - 1))]
    out = []
    for name in decoders:
        for _ in range(2):
            decode_jpegs(data, off, device, keys, name)
        sync(device)
        host, total = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            imgs = decode_jpegs(data, off, device, keys, name)
            host.append(time.perf_counter() - t0)
            sync(device)
            total.append(time.perf_counter() - t0)
        d = [np.abs(im.permute(1, 2, 0).cpu().numpy().astype(np.int32) - r) for im, r in zip(imgs, ref)]
        note = (f"host {1000 * statistics.median(host):.1f} ms until the call returns; vs PIL: max "
                f"{max(int(x.max()) for x in d)}, mean {float(np.mean([x.mean() for x in d])):.3g} levels "
                f"({len(d)} images)" + ("" if device.type == "cuda" else "; CPU device: torchvision's libjpeg-turbo"))
        t = statistics.median(total)
        out.append((name, len(imgs) / t, 1000 * t, note))
    return out


def time_decoders_under_load(dm, device: torch.device, decoders: list[str], reps: int, step, batch: int,
                             image_size: int, num_classes: int, step_ms_alone: float
                             ) -> list[tuple[str, float, float, str]]:
    """The JPEG decode of :func:`time_decoders` while the model trains in another thread, as in a fit: ``step`` on
    random tensors in a loop, on a CUDA stream of priority -1 (the datamodule's ``priority_training``), the host
    running ahead of the device as in a fit (no wait for a step's end; the steps are counted by CUDA events as the
    device finishes them). Returns, per decoder, ``(decoder, images/s, median ms per batch, note)``; the note
    gives the mean, the slow decodes (over twice the median: next to a training load the median stays near the
    decode alone, runs of 70-129 ms decodes make the mean; BENCHMARKS.md, forty-fifth session) and in how many of
    them and of the others the caching allocator called the device's allocator (:func:`allocator_calls`:
    ``cudaMalloc``/``cudaFree``, which synchronise), and the model's step time meanwhile against
    ``step_ms_alone`` (the model row), i.e. how much each slows the other. On a CPU device both share the host's
    cores."""
    import threading

    from mixlab.datamodules.imagenet_gpu import decode_jpegs

    b = held_batch(dm, "train", device)
    data, off, keys = b.data, b.offsets, b.keys[b.num_decoded:]
    x, y = random_batch(batch, image_size, num_classes, device)
    out = []
    for name in decoders:
        decode_jpegs(data, off, device, keys, name)
        stop, ends, failed = threading.Event(), [], []
        cuda = device.type == "cuda"
        stream = torch.cuda.Stream(device, priority=-1) if cuda else None

        def train() -> None:
            try:
                with torch.cuda.stream(stream):  # None: no-op
                    while not stop.is_set():
                        step(x, y)
                        end = torch.cuda.Event() if cuda else None
                        if end is not None:
                            end.record()
                        ends.append(end)
            except BaseException as exc:  # re-raised below
                failed.append(exc)

        def done() -> int:  # the steps the device has finished
            return sum(1 for e in list(ends) if e is None or e.query())

        thread = threading.Thread(target=train, daemon=True)
        thread.start()
        while done() < 2 and thread.is_alive():  # past the first steps
            time.sleep(0.01)
        times, allocs, t0, s0 = [], [], time.perf_counter(), done()
        while thread.is_alive() and (len(times) < reps or done() - s0 < 10):  # at least 10 steps alongside
            a, t = allocator_calls(device), time.perf_counter()
            decode_jpegs(data, off, device, keys, name)
            sync_stream(device)
            times.append(1000 * (time.perf_counter() - t))
            allocs.append(allocator_calls(device) - a)
        elapsed, n_steps = time.perf_counter() - t0, done() - s0
        stop.set()
        thread.join()
        if failed:
            raise failed[0]
        sync(device)
        step_ms, ms = 1000 * elapsed / n_steps, statistics.median(times)
        note = (f"mean {statistics.mean(times):.1f} ms; {slow_decodes(times, allocs)}; model step meanwhile "
                f"{step_ms:.1f} ms against {step_ms_alone:.1f} alone ({step_ms_alone / step_ms:.2f}x its speed; "
                f"{n_steps} steps)")
        out.append((name, len(keys) / (ms / 1000), ms, note))
    return out


def allocator_calls(device: torch.device) -> int:
    """How many times so far torch's CUDA caching allocator called the device's allocator (``cudaMalloc`` and
    ``cudaFree``: ``memory_stats``' ``num_device_alloc`` + ``num_device_free``; ``cudaFree`` synchronises the
    device), over the whole process; 0 on other devices."""
    if device.type != "cuda":
        return 0
    stats = torch.cuda.memory_stats(device)
    return int(stats.get("num_device_alloc", 0)) + int(stats.get("num_device_free", 0))


def slow_decodes(times: list[float], allocs: list[int]) -> str:
    """The slow decodes of :func:`time_decoders_under_load` in words: how many of ``times`` (ms) took over twice
    their median, the slowest, and in how many of those and of the others the allocator was called (``allocs``:
    :func:`allocator_calls` during each decode)."""
    med = statistics.median(times)
    slow = [k for k, v in enumerate(times) if v > 2 * med]
    fast = [k for k in range(len(times)) if k not in slow]
    with_alloc = lambda ks: sum(1 for k in ks if allocs[k])  # noqa: E731
    if not slow:
        return f"no decode over twice the median (cudaMalloc/cudaFree during {with_alloc(fast)} of {len(fast)})"
    return (f"{len(slow)} of {len(times)} decodes over twice the median (max {max(times):.1f} ms; cudaMalloc/cudaFree "
            f"during {with_alloc(slow)} of them and {with_alloc(fast)} of the other {len(fast)})")


def profile_stage(dm, split: str, device: torch.device, reps: int, top: int = 30) -> list[str]:
    """Markdown lines: where the device stage's time goes on one held batch over ``reps`` calls
    (``torch.profiler``, CPU and CUDA): host and device milliseconds per batch of each phase
    (``stage/decode``, ``stage/crop_resize``, ``stage/augment``) and the ``top`` kernels by device time."""
    from torch.profiler import ProfilerActivity, profile

    from mixlab.datamodules.imagenet_gpu import quiet_profiler_without_cuda

    quiet_profiler_without_cuda()
    b = held_batch(dm, split, device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(reps):
            to_device(dm, b, device)
        sync(device)
    wall = 1000 * (time.perf_counter() - t0) / reps
    events = prof.key_averages()
    dev_self = lambda e: getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))  # noqa: E731
    dev_total = lambda e: getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0))  # noqa: E731
    kernels = [e for e in events if dev_self(e) > 0 and not e.key.startswith(("aten::", "stage/", "cuda"))]
    busy = sum(dev_self(e) for e in kernels) / reps / 1000
    lines = [f"### Device stage profile, {split}, {reps} calls on one held batch of {len(b)}", "",
             f"Wall {wall:.1f} ms per batch (profiler on); device busy {busy:.1f} ms per batch (sum of kernel "
             "times).", "", "| phase | host ms/batch | device ms/batch |", "|---|---:|---:|"]
    for e in sorted((e for e in events if e.key.startswith("stage/")), key=lambda e: e.key):
        lines.append(f"| {e.key} | {e.cpu_time_total / reps / 1000:.2f} | {dev_total(e) / reps / 1000:.2f} |")
    if not kernels:
        return lines + ["", f"(no accelerator kernels: the stage ran on {device.type})"]
    lines += ["", "| kernel | calls/batch | device ms/batch | share |", "|---|---:|---:|---:|"]
    for e in sorted(kernels, key=dev_self, reverse=True)[:top]:
        name = e.key if len(e.key) <= 90 else e.key[:87] + "..."
        lines.append(f"| `{name.replace('|', '/')}` | {e.count / reps:.1f} | {dev_self(e) / reps / 1000:.3f} | "
                     f"{dev_self(e) / reps / 1000 / max(busy, 1e-9):.0%} |")
    return lines


def kernel_overlap(kernels: list[tuple[int, float, float]]) -> dict[int | str, float]:
    """Busy time of each CUDA stream and how much of it ran concurrently with the other streams.

    Args:
        kernels: ``(stream, start, end)`` of each kernel / memcpy (any time unit).

    Returns:
        per stream its busy time (the union of its intervals), ``"union"`` the time any stream was busy and
        ``"overlap"`` the time gained by concurrency: the streams' busy times summed minus ``"union"`` (0 when
        the streams' work never ran at the same time)."""
    def union(iv: list[tuple[float, float]]) -> float:
        total, end = 0.0, -math.inf
        for a, b in sorted(iv):
            if b > end:
                total += b - max(a, end)
                end = b
        return total

    by: dict[int, list[tuple[float, float]]] = {}
    for stream, a, b in kernels:
        by.setdefault(stream, []).append((a, b))
    out: dict[int | str, float] = {k: union(v) for k, v in sorted(by.items())}
    out["union"] = union([(a, b) for _, a, b in kernels])
    out["overlap"] = sum(v for k, v in out.items() if k != "union") - out["union"]
    return out


def profile_end_to_end(dm, device: torch.device, step, prefetch: int, warmup: int, steps: int) -> list[str]:
    """Markdown lines: does the device stage's work run concurrently with the model's? ``steps`` training
    steps, the stage ``prefetch`` batches ahead (as training runs it), under ``torch.profiler``; from the
    trace, each CUDA stream's busy milliseconds per step and the part that overlapped (:func:`kernel_overlap`).
    The model runs on the default stream, the stage on the prefetcher's and the decoder's streams."""
    import json

    from torch.profiler import ProfilerActivity, profile

    head = [f"### End-to-end profile, train, {steps} steps (stage {prefetch} ahead)", ""]
    if device.type != "cuda":
        return head + [f"(no CUDA streams: the run is on {device.type})"]
    it = iter(prefetched(dm, dm.train_dataloader(), True, device, max(prefetch, 1)))
    for _ in range(warmup):
        step(*next(it))
    sync(device)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(*next(it))
        sync(device)
    wall = 1000 * (time.perf_counter() - t0) / steps
    del it
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        trace = json.loads(Path(tmp, "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    kernels = [(int(e.get("args", {}).get("stream", -1)), float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
               for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    ov = kernel_overlap(kernels)
    busy, overlap = ov["union"] / 1000 / steps, ov["overlap"] / 1000 / steps
    lines = head + [f"Wall {wall:.1f} ms per step (profiler on); device busy (any stream) {busy:.1f} ms per step; "
                    f"**overlapped {overlap:.2f} ms per step**.", "",
                    "| CUDA stream | busy ms/step |", "|---:|---:|"]
    lines += [f"| {k} | {v / 1000 / steps:.2f} |" for k, v in ov.items() if k not in ("union", "overlap")]
    return lines


def of_model(ips: float, model_ips: float) -> str:
    """Note of an end-to-end row: its rate as a share of the model alone, flagged when above it (impossible for
    a steady state: the model row was slowed, e.g. by a busy host, or the timed batches were prepared during
    the warm-up; rerun on an idle host with more ``--batches``)."""
    note = f"{ips / model_ips:.0%} of the model alone"
    if ips > 1.05 * model_ips:
        note += " (above the model alone: not a steady state; rerun on an idle host with more --batches)"
    return note


ROOT = Path(__file__).resolve().parents[1]
RANDOM_IMAGES = ROOT / "configs" / "data" / "random_images.yaml"
_T0 = time.perf_counter()


def log(msg: str) -> None:
    """A progress line on stderr (the whole table goes to stdout at the end)."""
    print(f"[bench_input {time.perf_counter() - _T0:6.0f}s] {msg}", file=sys.stderr, flush=True)


def _write_part(job: tuple) -> str:
    out_dir, n, wh, classes, shard_size, seed = job
    from mixlab.datamodules.imagenet import write_synthetic_shards

    return write_synthetic_shards(out_dir, n, wh, classes, shard_size, seed=seed, prefix=f"synthetic{seed}")


def writer_procs(n_images: int) -> int:
    """Processes that write ``n_images`` synthetic images: one per 512 images, at most 4 and the CPU count."""
    return min(4, os.cpu_count() or 1, -(-n_images // 512))


def part_sizes(n_images: int, procs: int) -> list[int]:
    """Images per writing process (the non-empty parts of :func:`write_shards_parallel`)."""
    return [n for n in (n_images // procs + (k < n_images % procs) for k in range(procs)) if n]


def synthetic_shard_count(n_images: int, shard_size: int) -> int:
    """Shards :func:`write_shards_parallel` writes for ``n_images`` (each part's last shard may be short)."""
    return sum(-(-n // shard_size) for n in part_sizes(n_images, writer_procs(n_images)))


def write_shards_parallel(out_dir: str | Path, n_images: int, wh: tuple[int, int], classes: int, shard_size: int,
                          procs: int) -> str:
    """``write_synthetic_shards`` split over ``procs`` processes (part ``k`` in ``out_dir/part{k}``, seed ``k``):
    the shard patterns joined by ``::`` (what ``ImageNetDataModule`` reads as one list). 4 processes write 4096
    500x375 images in ~25 s on the H200 hosts, one in ~90 s."""
    jobs = [(str(Path(out_dir) / f"part{k}"), n, wh, classes, shard_size, k)
            for k, n in enumerate(part_sizes(n_images, procs))]
    if len(jobs) == 1:
        return _write_part(jobs[0])
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(len(jobs)) as pool:
        return "::".join(pool.map(_write_part, jobs))


class CliFit(NamedTuple):
    """One ``--cli-steps`` fit: ``perf/images_per_s`` (median, min, max over its logged windows) and where its wall
    time went (:func:`fit_timeline`)."""

    median: float
    lo: float
    hi: float
    timeline: str = ""


# `python -c` wrapper of `python -m mixlab` for --cli-stacks: a daemon thread writes every thread's stack every
# N seconds (sys._current_frames under the GIL; faulthandler's watchdog dump crashed fits now and then)
_STACK_MAIN = """import runpy, sys, threading, time, traceback
out, every, t0 = open(sys.argv[1], "w"), float(sys.argv[2]), time.time()
def sample():
    while True:
        time.sleep(every)
        names = {t.ident: t.name for t in threading.enumerate()}
        out.write(f"sample {time.time() - t0:.1f} s\\n")
        for ident, frame in sys._current_frames().items():
            if ident != threading.get_ident():
                out.write(f"thread {names.get(ident, ident)}\\n" + "".join(traceback.format_stack(frame)))
        out.flush()
threading.Thread(target=sample, daemon=True, name="bench_input-stacks").start()
sys.argv = ["mixlab", *sys.argv[3:]]
runpy.run_module("mixlab", run_name="__main__", alter_sys=True)
"""


# `python -c` wrapper of `python -m mixlab` for --cli-gil-hold: a daemon thread of the training process runs pure
# Python (holding the GIL, as a device stage's planning does) for argv[1] ms of every 50 ms, from 5 s after start,
# under the 0.5 ms switch interval of configs/vit/goat_imagenet.yaml's switch_interval_ms
_GIL_MAIN = """import runpy, sys, threading, time
hold = float(sys.argv[1]) / 1000
def hold_gil():
    time.sleep(5.0)
    sys.setswitchinterval(0.0005)
    while True:
        t = time.perf_counter()
        while time.perf_counter() - t < hold:
            pass
        time.sleep(max(0.0, 0.05 - (time.perf_counter() - t)))
threading.Thread(target=hold_gil, daemon=True, name="bench_input-gil").start()
sys.argv = ["mixlab", *sys.argv[2:]]
runpy.run_module("mixlab", run_name="__main__", alter_sys=True)
"""


def fit_timeline(started: float, ended: float, scalars: dict) -> str:
    """Where a fit's wall time went, from the wall times of its logged scalars (TensorBoard events): ``started`` and
    ``ended`` are the process's ``time.time()`` at launch and exit. Startup (interpreter, imports, data setup, the
    first steps' one-time work) ends where the first logged step's time, less that many steps at the logged steps'
    pace, begins; after the last logged step come the remaining steps and the process's exit (loader shutdown)."""
    events = sorted((w, s) for tag, ev in scalars.items() if tag.startswith(("perf/", "train/")) for w, s, _ in ev)
    if len(events) < 2 or events[-1][1] <= events[0][1]:
        return f"wall {ended - started:.1f} s (too few logged steps for a split)"
    (w0, s0), (w1, s1) = events[0], events[-1]
    pace = (w1 - w0) / (s1 - s0)  # s per step between the first and the last logged step
    startup = max(0.0, w0 - started - s0 * pace)
    return (f"wall {ended - started:.1f} s: startup ~{startup:.1f} s, steps {s0}..{s1} {w1 - w0:.2f} s "
            f"({1000 * pace:.0f} ms/step by the logs' clock), after step {s1} {ended - w1:.1f} s")


def _short_frame(line: str) -> str:
    """``File "/a/b/c.py", line 7, in f`` -> ``b/c.py:7 f``."""
    m = re.match(r'File "(.*)", line (\d+), in (.*)', line.strip())
    if not m:
        return line.strip()
    return f"{'/'.join(Path(m[1]).parts[-2:])}:{m[2]} {m[3]}"


def input_summary(scalars: dict, from_step: int) -> str:
    """Host ms per step of the fit's input path from step ``from_step`` on (medians of the logged windows):
    ``perf/data_wait_ms`` (the training loop between steps) and, with the device stage prefetched,
    ``perf/input/*_ms`` (``DevicePrefetcher.timings``: the loop waiting for the stage, the stage thread waiting for
    the workers, running the stage, the decode (part of the stage unless ``decode_thread``), the stage thread
    waiting for the decode thread, and waiting for queue room); then, on Linux, ``perf/host/*_ms`` (the training
    thread's time on a CPU, waiting for one and blocked, and the process's other threads' CPU and run-queue time:
    ``mixlab.callbacks.ThroughputMemory``). Empty when none was logged."""
    names = [("perf/data_wait_ms", "between steps")] + [
        (f"perf/input/{k}_ms", w) for k, w in (("consumer_wait", "waiting for the stage"),
                                               ("loader_wait", "stage thread waiting for workers"),
                                               ("stage", "stage"), ("stage_cpu", "of it on a CPU"),
                                               ("decode", "decode"),
                                               ("decode_wait", "stage thread waiting for the decode thread"),
                                               ("queue_full", "stage thread waiting for queue room"))]
    host = [(f"perf/host/{k}_ms", w) for k, w in (("train_cpu", "training thread on a CPU"),
                                                  ("train_runqueue", "waiting for a CPU"),
                                                  ("train_blocked", "blocked"),
                                                  ("other_cpu", "the process's other threads on a CPU"),
                                                  ("other_runqueue", "waiting for a CPU"))]
    out = []
    for head, group in (("input ms/step: ", names), ("host ms/step: ", host)):
        parts = []
        for tag, words in group:
            values = [v for _, step, v in scalars.get(tag, []) if step >= from_step]
            if values:
                parts.append(f"{words} {statistics.median(values):.1f}")
        if parts:
            out.append(head + ", ".join(parts))
    return "; ".join(out)


def stack_summary(text: str) -> list[str]:
    """The main thread's innermost frame at each sample of a ``--cli-stacks`` file (and, when that frame is not
    mixlab's, the innermost mixlab or Lightning frame below it), as ``"T0-T1 s: frame"`` lines, equal consecutive
    entries merged: where a fit spent its time. The file's lines at column 0 are ``sample T s`` and ``thread NAME``;
    the indented ones are ``traceback.format_stack``'s, innermost frame last."""
    samples: list[list] = []  # [time, frames of the main thread]
    thread = None
    for line in text.splitlines():
        if line.startswith("sample "):
            samples.append([line.removeprefix("sample ").removesuffix(" s"), []])
            thread = None
        elif line.startswith("thread "):
            thread = line.removeprefix("thread ")
        elif thread == "MainThread" and samples and line.startswith("  File "):
            samples[-1][1].append(line.strip())
    entries = []
    for when, frames in samples:
        if not frames:
            entries.append((when, "?"))
            continue
        ours = [f for f in frames if "mixlab" in f or "/datamodules/" in f or "lightning" in f]
        entry = _short_frame(frames[-1])
        if ours and ours[-1] != frames[-1]:
            entry += f" < {_short_frame(ours[-1])}"
        entries.append((when, entry))
    out: list[str] = []
    for entry, run in itertools.groupby(entries, key=lambda e: e[1]):
        times = [when for when, _ in run]
        out.append(f"{times[0]} s: {entry}" if len(times) == 1 else f"{times[0]}-{times[-1]} s: {entry}")
    return out


# `python -c` check of `python -m mixlab fit` arguments: the model, datamodule and trainer built from them
# (their own checks run: ranges, mixer options), the subcommand not run (nothing trained or saved); on success
# one line `MIXLAB_CHECK {json}` names the classes built and the datamodule's num_workers
_CHECK_MAIN = """import json, sys
from mixlab.cli import MixlabCLI, one_line_errors
from mixlab.registry import load_plugins
try:
    load_plugins()  # as python -m mixlab does ($MIXLAB_IMPORT, entry points)
except ImportError as err:
    sys.exit(f"error: {err}")
class Check(MixlabCLI):
    def _run_subcommand(self, subcommand):
        print("MIXLAB_CHECK " + json.dumps({"model": type(self.model).__name__, "data": type(self.datamodule).__name__,
                                            "num_workers": getattr(self.datamodule, "num_workers", None)}))
with one_line_errors(sys.argv[1:]):
    Check(args=sys.argv[1:])
"""


def gil_summary(text: str, rate: float, seconds: float, top: int = 3) -> str:
    """One line from a ``py-spy record --gil --threads -f raw`` file (``text``; sampled ``rate`` times a second for
    ``seconds``): each thread's share of the wall time holding the GIL, most first, with its ``top`` innermost frames
    by samples (``file:line function``, percent of the wall time). py-spy writes only the samples in which a thread
    holds the GIL, one ``thread (ID): NAME;frame;...;frame COUNT`` line per distinct stack."""
    threads: collections.Counter = collections.Counter()
    leaves: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        thread, *frames = stack.split(";")
        name = thread.split(": ", 1)[-1]
        threads[name] += int(count)
        if frames:  # "function (path/file.py:line)" -> "file.py:line function"
            m = re.fullmatch(r"(.*) \((?:.*/)?([^/]+:\d+)\)", frames[-1])
            leaf = f"{m.group(2)} {m.group(1)}" if m else frames[-1]
            leaves[name][leaf] += int(count)
    total = rate * seconds
    if not threads or total <= 0:
        return "GIL: no samples"
    parts = []
    for name, n in threads.most_common():
        tops = leaves[name].most_common(top)
        where = ", ".join(f"{leaf} {100 * m / total:.1f}%" for leaf, m in tops)
        parts.append(f"{name} {100 * n / total:.1f}%" + (f" ({where})" if where else ""))
    return f"GIL held, % of {seconds:g} s: " + "; ".join(parts)


def cli_args_check(args: list[str], config: str, env: dict[str, str] | None = None) -> tuple[str, dict[str, Any]]:
    """``(error, built)`` of ``python -m mixlab fit --config CONFIG ARGS`` with the classes built and the subcommand
    not run (its run root a temporary folder; ``env``: variables set for its process as for the fit's), before any
    fit runs: ``error`` is the last line of the error output when the CLI refuses ``args`` (an unknown option, a
    value of the wrong type, a value the datamodule or model refuses), else ``""``; ``built`` names the model and
    datamodule classes and the datamodule's ``num_workers`` (``{}`` on an error)."""
    with tempfile.TemporaryDirectory(prefix="bench_input_check_") as tmp:
        done = subprocess.run([sys.executable, "-c", _CHECK_MAIN, "fit", "--config", config, *args, "--run_root", tmp],
                              capture_output=True, text=True, env={**os.environ, **(env or {})})
    if done.returncode == 0:
        found = [ln for ln in done.stdout.splitlines() if ln.startswith("MIXLAB_CHECK ")]
        return "", json.loads(found[-1].split(" ", 1)[1]) if found else {}
    lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip() and not ln.startswith("(MIXLAB_TRACEBACK")]
    return (lines[-1] if lines else f"exit status {done.returncode}"), {}


_ENV_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def split_env(words: Iterable[str]) -> tuple[dict[str, str], list[str]]:
    """A ``--cli-variants`` string's words as a shell reads them: the leading ``NAME=value`` words are environment
    variables of the fit's process (e.g. ``CUDA_DEVICE_MAX_CONNECTIONS=8``), the rest its CLI arguments."""
    words = list(words)
    k = 0
    while k < len(words) and _ENV_WORD.match(words[k]):
        k += 1
    return dict(w.split("=", 1) for w in words[:k]), words[k:]


def cli_images_per_s(args: list[str], run_root: Path, from_step: int, stacks: tuple[Path, float] | None = None,
                     gil_hold_ms: float = 0.0, gil_profile: tuple[Path, float, float] | None = None,
                     env: dict[str, str] | None = None) -> CliFit:
    """``perf/images_per_s`` (median, min, max) from step ``from_step`` on of one ``python -m mixlab fit ARGS`` run
    logging under ``run_root`` (a subprocess: its own workers, CUDA context and compile caches), with its wall-time
    split (:func:`fit_timeline`). ``stacks = (file, seconds)``: the run's threads' stacks are written to ``file``
    every ``seconds`` (:data:`_STACK_MAIN`; :func:`stack_summary` reads them). ``gil_hold_ms > 0``: a thread of the
    run holds the GIL that many ms of every 50 ms (:data:`_GIL_MAIN`; not with ``stacks``). ``gil_profile = (file,
    start, seconds)``: py-spy samples which of the run's threads hold the GIL for ``seconds`` from ``start`` seconds
    after its launch (:data:`GIL_PROFILE_RATE` a second, raw output in ``file``; :func:`gil_summary` is added to the
    result's line). ``env``: environment variables set for the run's process (on top of this one's).

    Raises:
        RuntimeError: the run failed (its command and the end of its stderr) or logged no ``perf/images_per_s``.
    """
    from mixlab.eval.compare import load_scalars

    if gil_hold_ms > 0:
        cmd = [sys.executable, "-c", _GIL_MAIN, f"{gil_hold_ms:g}", "fit", *args, "--run_root", str(run_root)]
    elif stacks is None:
        cmd = [sys.executable, "-m", "mixlab", "fit", *args, "--run_root", str(run_root)]
    else:
        cmd = [sys.executable, "-c", _STACK_MAIN, str(stacks[0]), str(stacks[1]), "fit", *args, "--run_root",
               str(run_root)]
    started, gil = time.time(), ""
    environ = {**os.environ, **(env or {})}
    if gil_profile is None:
        done = subprocess.run(cmd, capture_output=True, text=True, env=environ)
        returncode, stderr = done.returncode, done.stderr
    else:
        with tempfile.TemporaryFile("w+") as err, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err,
                                                                   text=True, env=environ) as proc:
            gil = gil_profile_run(proc, *gil_profile)
            returncode = proc.wait()
            err.seek(0)
            stderr = err.read()
    ended = time.time()
    if returncode != 0:
        raise RuntimeError(f"{shlex.join([*(f'{k}={v}' for k, v in (env or {}).items()), *cmd])} exited with "
                           f"{returncode}:\n{stderr[-3000:]}")
    scalars = load_scalars(run_root)
    values = [v for _, step, v in scalars.get("perf/images_per_s", []) if step >= from_step]
    if not values:
        raise RuntimeError(f"{shlex.join(cmd)} logged no perf/images_per_s from step {from_step} on")
    return CliFit(statistics.median(values), min(values), max(values),
                  "; ".join(filter(None, [fit_timeline(started, ended, scalars), input_summary(scalars, from_step),
                                          gil])))


GIL_PROFILE_RATE = 200  # py-spy samples a second (--cli-gil-profile)


def gil_profile_run(proc: subprocess.Popen, out: Path, start: float, seconds: float) -> str:
    """``py-spy record --gil --threads --nonblocking`` of the running ``proc`` for ``seconds`` from ``start`` seconds
    after now, raw output in ``out``; returns :func:`gil_summary`'s line, or why there is none (the run ended first,
    py-spy failed)."""
    try:
        proc.wait(timeout=start)
        return "GIL: the fit ended before the profile's start"
    except subprocess.TimeoutExpired:
        pass
    cmd = ["py-spy", "record", "--pid", str(proc.pid), "--gil", "--threads", "--nonblocking", "-r",
           str(GIL_PROFILE_RATE), "-d", f"{seconds:g}", "-f", "raw", "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if not out.is_file():
        return f"GIL: py-spy wrote nothing (exit {done.returncode}: {done.stderr.strip()[-300:]})"
    return gil_summary(out.read_text(), GIL_PROFILE_RATE, seconds)


def build_model(name: str, image_size: int, num_classes: int, device: torch.device):
    import timm

    if name == "tiny":
        from timm.models.vision_transformer import VisionTransformer

        model = VisionTransformer(img_size=image_size, patch_size=16, embed_dim=32, depth=1, num_heads=2,
                                  num_classes=num_classes)
    elif name.startswith("mixlab-"):  # mixlab's ViT-S/16 with a position preset: mixlab-goat2d, mixlab-ape, ...
        from mixlab.heads.vit import MixViT, vit_backbone

        preset = name.removeprefix("mixlab-")
        model = MixViT(num_classes=num_classes, img_size=image_size, backbone=vit_backbone(preset),
                       ape=preset == "ape")
    else:
        model = timm.create_model(name, num_classes=num_classes, drop_path_rate=0.1, img_size=image_size)
    return model.to(device).train()


def make_step(model, device: torch.device, num_classes: int):
    """A training step as ImageClassifier's: timm Mixup/CutMix (DeiT), soft-target CE, AdamW; bf16 on CUDA."""
    from dataclasses import asdict

    from timm.data import Mixup

    from mixlab.heads.vit import MixupConfig

    mix = Mixup(**asdict(MixupConfig()), label_smoothing=0.1, num_classes=num_classes)  # the head's DeiT defaults
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05)

    def step(x, y):
        if x.shape[0] % 2:
            x, y = x[:-1], y[:-1]
        xm, ym = mix(x, y)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(xm)
        loss = torch.sum(-ym * F.log_softmax(logits.float(), dim=-1), dim=-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def random_batch(batch: int, image_size: int, num_classes: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random training inputs: float32 images ``[batch, 3, image_size, image_size]`` (standard normal) and int64
    labels ``[batch]`` in ``[0, num_classes)``, on ``device``."""
    return (torch.randn(batch, 3, image_size, image_size, device=device),
            torch.randint(0, num_classes, (batch,), device=device))


def time_model(step, batch: int, image_size: int, num_classes: int, device: torch.device, warmup: int,
               iters: int) -> float:
    x, y = random_batch(batch, image_size, num_classes, device)
    for _ in range(warmup):
        step(x, y)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        step(x, y)
    sync(device)
    return batch * iters / (time.perf_counter() - t0)


def launch_ms(step, batch: int, image_size: int, num_classes: int, device: torch.device, reps: int = 3) -> float:
    """Median host milliseconds until ``step`` returns when the device has nothing queued (a sync before each):
    the host's launch time of one step (forward, autograd's backward thread, optimizer), none of it spent
    waiting for the device unless the step synchronises. Next to the step's wall time on random tensors it says
    whether the step is host-bound: a host that needs most of the step to launch it has no slack for the input
    pipeline's threads (the GIL, CPU caches) before the device waits."""
    x, y = random_batch(batch, image_size, num_classes, device)
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - t0)
    sync(device)
    return 1000 * statistics.median(times)


def make_eval_step(model, device: torch.device):
    """The model's evaluation forward (no grad, bf16 autocast on CUDA) as a ``step(x, y)`` for :func:`time_model`."""
    def step(x, y):
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            model(x)
    return step


def draft_fractions(pattern: str, image_size: int, crop_pct: float, limit: int) -> tuple[float, float, int]:
    """Fractions of images (first ``limit`` of the shards; JPEG headers only) where PIL's ``draft`` could
    decode at 1/2 size or less: (train: a timm RandomResizedCrop draw has both sides >= 2 x image_size;
    eval: short side >= 2 x floor(image_size / crop_pct)), and the number of images looked at."""
    import random

    import webdataset as wds
    from PIL import Image
    from timm.data.transforms import RandomResizedCropAndInterpolation

    from mixlab.datamodules.imagenet import expand_shards

    rng = random.Random(0)
    rrc = RandomResizedCropAndInterpolation(image_size)
    resize = math.floor(image_size / crop_pct)
    train = evals = n = 0
    for sample in wds.tarfile_samples([{"url": u} for u in expand_shards(pattern)]):
        data = next((sample[k] for k in ("jpg", "jpeg") if k in sample), None)
        if data is None:
            continue
        img = Image.open(io.BytesIO(data))
        state = random.getstate()
        random.seed(rng.random())
        _, _, h, w = rrc.get_params(img, rrc.scale, rrc.ratio)
        random.setstate(state)
        train += h >= 2 * image_size and w >= 2 * image_size
        evals += min(img.size) >= 2 * resize
        n += 1
        if n >= limit:
            break
    return train / max(n, 1), evals / max(n, 1), n


def decode_runs(modes: list[str], fractions: list[float]) -> list[tuple[str, float, str]]:
    """``(decode mode, worker share, table label)`` of every pipeline measured: each mode, ``gpu`` once per share."""
    return [(m, f, f"gpu, {f:.0%} in workers" if f else m) for m in modes for f in (fractions if m == "gpu" else [0.0])]


def cli_rows(a, train_pattern: str, val_pattern: str, model_ips: float,
             progress: Callable[[str], None] = log) -> list[tuple[str, ...]]:
    """Table rows of ``--cli-steps``: the CLI on random tensors (the anchor), then on the shards for every decode
    mode and worker share, ``--cli-repeats`` rounds in alternating order; each row the median over its runs.
    ``progress`` gets a line for each fit as it ends. The ratio to the model row is given only when that row is
    mixlab's ViT (``--model mixlab-<preset>``; the preset should be the one of ``--cli-config``): the CLI trains
    the config's model, and a timm or tiny model row would make the ratio meaningless."""
    n, b, size = a.cli_steps, a.batch_size, a.image_size
    same_model = a.model.startswith("mixlab-")
    if not same_model:
        progress(f"the model row is {a.model}, the CLI fits train {Path(a.cli_config).name}'s model: no ratio between "
                 "them (--model mixlab-goat2d is the default config's)")

    def vs_model(ips: float) -> str:
        return f"{ips / model_ips:.3f}x the model row" if same_model else "the model row is another model"

    common = ["--model.init_args.img_size", str(size), "--data.init_args.image_size", str(size),
              "--data.init_args.batch_size", str(b), "--trainer.max_steps", str(n), "--trainer.limit_val_batches", "0",
              "--trainer.log_every_n_steps", str(min(10, max(1, n // 10))), "--trainer.enable_progress_bar", "false",
              *shlex.split(a.cli_args)]
    kinds = [("random", 0.0, "-", "")] + [(m, f, label + (f", {variant}" if variant else ""), variant)
                                          for m, f, label in decode_runs(a.decode, a.cpu_decode_fraction)
                                          for variant in a.cli_variants]
    kinds += [("random-gil", 0.0, f"random tensors, a thread holding the GIL {ms:g} ms of every 50 ms", f"{ms:g}")
              for ms in a.cli_gil_hold]
    runs: dict[tuple[str, float, str, str], list[tuple[float, ...]]] = {k: [] for k in kinds}
    stacks_dir = stacks_folder(a) if a.cli_stacks else None
    with tempfile.TemporaryDirectory(prefix="bench_input_cli_") as tmp:
        for r in range(a.cli_repeats):
            for k, (mode, frac, label, variant) in enumerate(kinds if r % 2 == 0 else kinds[::-1]):
                if mode.startswith("random"):
                    args = ["--config", a.cli_config, "--config", str(RANDOM_IMAGES), *common]
                    env = {}
                else:
                    env, extra = split_env(shlex.split(variant))
                    args = ["--config", a.cli_config, *common, "--data.init_args.train_path", train_pattern,
                            "--data.init_args.val_path", val_pattern, "--data.init_args.num_workers", str(a.workers),
                            "--data.init_args.train_samples", str(2 * n * b), "--data.init_args.decode", mode,
                            "--data.init_args.cpu_decode_fraction", str(frac), *extra]
                what = "random tensors" if mode == "random" else label
                gil = float(variant) if mode == "random-gil" else 0.0
                stacks = profile = None
                fit_file = f"{re.sub(r'[^A-Za-z0-9]+', '_', what).strip('_')}-run{r + 1}.txt"
                if stacks_dir is not None:
                    stacks_dir.mkdir(parents=True, exist_ok=True)
                    stacks = (stacks_dir / fit_file, a.cli_stacks)
                if a.cli_gil_profile:
                    gil_dir = stacks_folder(a, ".gil")
                    gil_dir.mkdir(parents=True, exist_ok=True)
                    profile = (gil_dir / fit_file, *a.cli_gil_profile)
                got = cli_images_per_s(args, Path(tmp) / f"r{r}k{k}", min(40, n // 2), stacks=stacks,
                                       gil_hold_ms=gil, gil_profile=profile, env=env)
                runs[mode, frac, label, variant].append(got)
                timeline = getattr(got, "timeline", "")
                progress(f"CLI fit on {what}, run {r + 1}/{a.cli_repeats}: "
                         f"{got[0]:,.0f} images/s ({vs_model(got[0])})" + (f"; {timeline}" if timeline else ""))
                if stacks is not None and stacks[0].is_file():
                    progress(f"  main thread, sampled every {a.cli_stacks:g} s ({stacks[0]}): "
                             + "; ".join(stack_summary(stacks[0].read_text())))
    anchor = statistics.median(g[0] for g in runs[kinds[0]])
    out = []
    for (mode, frac, label, _), got in runs.items():
        ips = statistics.median(g[0] for g in got)
        each = ", ".join(f"{g[0]:,.0f} [{g[1]:,.0f}, {g[2]:,.0f}]" for g in got)
        if mode == "random":
            out.append(("train", "-", "-", f"through the CLI, random tensors ({n} steps)", f"{ips:,.0f}", "",
                        f"{vs_model(ips)}; runs (median [min, max] of each fit's logged windows): {each}"))
            continue
        if mode == "random-gil":
            out.append(("train", "-", "-", f"through the CLI, {label} ({n} steps)", f"{ips:,.0f}", "",
                        f"{ips / anchor:.3f}x the CLI on random tensors; runs: {each}"))
            continue
        out.append(("train", label, str(a.workers), f"through the CLI, shards ({n} steps)", f"{ips:,.0f}", "",
                    f"**{vs_model(ips)}**, {ips / anchor:.3f}x the CLI on random tensors; "
                    f"runs (median [min, max] of each fit's logged windows): {each}"))
    return out


def stacks_folder(a, suffix: str = ".stacks") -> Path:
    """Where ``--cli-stacks`` writes each fit's stack dumps (``--cli-gil-profile``: its py-spy files, ``suffix``
    ``.gil``): next to ``--out`` (``X.md`` -> ``X.stacks/``), else ``bench_input.stacks/`` in the working
    directory."""
    return Path(a.out or "bench_input.md").with_suffix(suffix)


def device_name(device: torch.device) -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, {cores} CPU cores"
    return f"CPU only ({platform.processor() or platform.machine()}), {cores} CPU cores"


def check_cli_fits(p: OneLineParser, a: argparse.Namespace, variants: list[tuple[str, ...]], shards: int) -> None:
    """Refuse, through ``p.error``, a ``--cli-config`` that is not an image classifier on ImageNet shards and a
    ``--cli-args``/``--cli-variants`` string the CLI refuses or that asks for more DataLoader workers than the
    ``shards`` of the fewest-shard pattern (each worker reads whole shards)."""
    config = a.cli_config
    for variant in variants:
        env, words = split_env(variant)
        for k, w in enumerate(words):  # NAME=value where an option belongs: a misplaced or misspelt variable
            if re.match(r"\w+=", w) and (k == 0 or not words[k - 1].startswith("-") or "=" in words[k - 1]):
                p.error(f"--cli-variants {shlex.join(variant)!r}: {w!r} is not an option; environment variables go "
                        "first, as NAME=value with NAME of letters, digits and _ not starting with a digit")
        queues = env.get(CUDA_QUEUES[0])
        if queues is not None and not (queues.isdigit() and 1 <= int(queues) <= 32):
            p.error(f"--cli-variants {shlex.join(variant)!r}: {CUDA_QUEUES[0]} must be an int in [1, 32]; "
                    f"got {queues!r}")
        args = [*shlex.split(a.cli_args), "--data.init_args.num_workers", str(a.workers), *words]
        bad, built = cli_args_check(args, config, env)
        if bad and "num_workers" in bad and "unknown option" in bad:
            bad, built = cli_args_check([*shlex.split(a.cli_args), *words], config, env)
        if bad:
            bad = re.sub(r"\s*\(?python -m mixlab fit --help lists the options\)?", "", bad)  # p.error says it
            p.error(f"--cli-args/--cli-variants {shlex.join(variant)!r}: `python -m mixlab fit` refuses them: {bad}")
        if (built.get("model"), built.get("data")) != ("ImageClassifier", "ImageNetDataModule"):
            p.error(f"--cli-config {config!r} trains {built.get('model')} on {built.get('data')}; the --cli-steps "
                    "fits need an ImageClassifier on ImageNetDataModule (a ViT config, e.g. "
                    "configs/vit/goat_imagenet.yaml)")
        workers = built.get("num_workers") or 0
        if workers > shards:
            p.error(f"--cli-variants {shlex.join(variant)!r}: num_workers {workers} for {shards} shards; every "
                    "DataLoader worker needs at least one shard")


def main(argv: list[str] | None = None) -> str:
    os.environ.setdefault(*CUDA_QUEUES)  # this process's device stage as in a fit (python -m mixlab sets it)
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", default=None, help="training shard pattern (default: write synthetic shards)")
    p.add_argument("--val-shards", default=None, help="evaluation shard pattern (default: --shards)")
    p.add_argument("--workdir", default=None, help="where synthetic shards go (default: a temporary folder)")
    p.add_argument("--images", type=int, default=4096, help="synthetic images")
    p.add_argument("--image-wh", default="500x375", help="synthetic image width x height (pixels)")
    p.add_argument("--classes", type=int, default=10, help="synthetic classes (real shards: 1000)")
    p.add_argument("--shard-size", type=int, default=128, help="synthetic images per shard")
    p.add_argument("--decode", nargs="+", default=["cpu", "gpu"], choices=["cpu", "gpu"])
    p.add_argument("--workers", type=int, default=15, help="DataLoader workers")
    p.add_argument("--cpu-decode-fraction", type=float, nargs="+", default=[0.0], metavar="F",
                   help="decode gpu: share of each training batch decoded in the workers (one set of gpu rows per F)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--warmup", type=int, default=5, help="batches before timing")
    p.add_argument("--batches", type=int, default=30, help="timed batches")
    p.add_argument("--model", default="vit_small_patch16_224",
                   help="timm model name, mixlab-<preset> (mixlab's ViT-S/16: mixlab-goat2d, mixlab-ape, "
                        "mixlab-rope2d, mixlab-nope) or 'tiny'")
    p.add_argument("--prefetch", type=int, default=2,
                   help="decode gpu: also time the device stage run this many batches ahead in a background "
                        "thread (the datamodule's prefetch_batches; 0: only the synchronous stage)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="decode gpu: also profile the device stage over N calls (phases, top kernels)")
    p.add_argument("--profile-end-to-end", type=int, default=0, metavar="N",
                   help="decode gpu: also profile N prefetched training steps and report, per CUDA stream, the busy "
                        "time and how much of the stage's work overlapped the model's")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="decode gpu: launch the training augmentation's ops eagerly (datamodule cuda_graphs: false)")
    p.add_argument("--augment-impl", default="torch", choices=["torch", "triton"],
                   help="decode gpu: the loader rows' crop + resize and training augmentation: Triton kernels, or "
                        "TF32 GEMMs and the family-batched torch ops in CUDA graphs (datamodule augment_impl)")
    p.add_argument("--jpeg-decoder", default="torchvision", choices=["torchvision", "nvimgcodec"],
                   help="decode gpu: the loader rows' JPEG decoder on CUDA (datamodule jpeg_decoder; nvimgcodec: the "
                        "GPU's hardware JPEG decoder, needs nvidia-nvimgcodec-cu13); the --cli-steps fits take it "
                        "from --cli-args/--cli-variants")
    p.add_argument("--decoders", nargs="+", default=[], choices=["torchvision", "nvimgcodec"],
                   help="decode gpu: also time the JPEG decode alone of one training batch with each decoder, and its "
                        "difference to PIL's images (the decode cpu path's decoder)")
    p.add_argument("--decode-under-load", action="store_true",
                   help="with --decoders: also time each decoder's batch decode while the model trains in another "
                        "thread (priority -1 stream, running ahead of the device as in a fit), and the model's step "
                        "time meanwhile")
    p.add_argument("--no-end-to-end", action="store_true", help="skip loader + model runs")
    p.add_argument("--no-eval", action="store_true", help="skip the evaluation pipeline")
    p.add_argument("--no-loader", action="store_true",
                   help="skip the loader and device-stage rows (and end to end): the model row and the --cli-steps "
                        "rows only")
    p.add_argument("--no-train", action="store_true", help="skip the training pipeline (and the training model row)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--cli-steps", type=int, default=0, metavar="N",
                   help="also train N steps through `python -m mixlab fit` on the shards and on random tensors")
    p.add_argument("--cli-config", default=str(ROOT / "configs" / "vit" / "goat_imagenet.yaml"),
                   help="the ViT config of the --cli-steps runs")
    p.add_argument("--cli-repeats", type=int, default=1, help="--cli-steps runs of each kind, in alternating order")
    p.add_argument("--cli-args", default="", help="more CLI arguments for every --cli-steps run (one string)")
    p.add_argument("--cli-variants", nargs="+", default=[""], metavar="ARGS",
                   help="--cli-steps fits on the shards once per string of extra CLI arguments, e.g. '' "
                        "'--data.init_args.worker_nice 10' '--data.init_args.decode_thread true' ('': as "
                        "configured); leading NAME=value words set the fit's environment, as in a shell: "
                        "'CUDA_DEVICE_MAX_CONNECTIONS=8'")
    p.add_argument("--cli-stacks", type=float, default=0, metavar="SECONDS",
                   help="write every --cli-steps fit's thread stacks every SECONDS next to --out "
                        "(X.md -> X.stacks/; without --out: ./bench_input.stacks/), and report the main thread's "
                        "frame at each dump: where a fit's "
                        "startup and shutdown time goes")
    p.add_argument("--cli-gil-hold", type=float, nargs="+", default=[], metavar="MS",
                   help="also --cli-steps fits on random tensors with a thread of the training process holding the "
                        "GIL MS ms of every 50 ms (pure Python, 0.5 ms switch interval), once per MS: how much a "
                        "device stage's Python in the training process can cost the step")
    p.add_argument("--cli-gil-profile", type=float, nargs=2, default=None, metavar=("START", "SECONDS"),
                   help="sample every --cli-steps fit with py-spy (on PATH: pip install py-spy) for SECONDS from START "
                        "seconds after its launch, keeping only the samples in which a thread holds the GIL: each "
                        "thread's share of the wall time and its top frames (raw files next to --out: X.md -> "
                        "X.gil/). Which Python in the training process holds the GIL that the step waits for")
    p.add_argument("--quick", action="store_true",
                   help="CPU smoke run: 48 small images, 2 workers, batch 8, tiny model, 32 px")
    p.add_argument("--out", default=None, help="write the Markdown table here")
    a = p.parse_args(argv)
    p.check_output("--out", a.out)
    given = sys.argv[1:] if argv is None else argv
    quick_sets = ("--images", "--image-wh", "--classes", "--shard-size", "--workers", "--batch-size", "--image-size",
                  "--warmup", "--batches", "--model")
    clash = [o for o in quick_sets if any(g == o or g.startswith(o + "=") for g in given)]
    if a.quick and clash:
        p.error(f"--quick sets {', '.join(clash)} itself; drop {'them' if len(clash) > 1 else 'it'} or drop --quick")
    for name, least in (("images", 1), ("classes", 1), ("shard_size", 1), ("workers", 0), ("batch_size", 2),
                        ("image_size", 1), ("warmup", 0), ("batches", 1), ("prefetch", 0)):
        if getattr(a, name) < least:
            p.error(f"--{name.replace('_', '-')} must be >= {least}; got {getattr(a, name)}")
    if not re.fullmatch(r"\d+x\d+", a.image_wh.lower()) or min(int(v) for v in a.image_wh.lower().split("x")) < 1:
        p.error(f"--image-wh must be WIDTHxHEIGHT in pixels, e.g. 500x375; got {a.image_wh!r}")
    if a.device is not None and a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {a.device}: no CUDA device is available here")
    if a.model not in ("tiny",) and not a.model.startswith("mixlab-"):
        import timm

        if not timm.is_model(a.model):
            p.error(f"--model {a.model!r} is not a timm model name (nor 'tiny' or mixlab-<preset>)")
    if a.no_train and a.no_eval:  # before any shard is written
        p.error("--no-train and --no-eval leave nothing to measure")
    if any(not 0 <= f <= 1 for f in a.cpu_decode_fraction):
        p.error(f"--cpu-decode-fraction values must be in [0, 1]; got {a.cpu_decode_fraction}")
    if a.cli_steps < 0 or a.cli_repeats < 1:
        p.error(f"--cli-steps must be >= 0 and --cli-repeats >= 1; got {a.cli_steps}, {a.cli_repeats}")
    split_args: list[tuple[str, ...]] = []
    for option, strings in (("--cli-args", [a.cli_args]), ("--cli-variants", a.cli_variants)):
        for text in strings:
            try:
                split_args.append(tuple(shlex.split(text)))
            except ValueError as err:
                p.error(f"{option} {text!r}: {err}")
    variants = split_args[1:]
    if len(set(variants)) < len(variants):
        p.error(f"--cli-variants has the same arguments twice: {a.cli_variants}")
    if a.cli_stacks < 0 or (a.cli_stacks and not a.cli_steps):
        p.error(f"--cli-stacks must be > 0 seconds (0: off) and needs --cli-steps; got {a.cli_stacks:g}, --cli-steps "
                f"{a.cli_steps}")
    if any(not 0 < ms < 50 for ms in a.cli_gil_hold) or (a.cli_gil_hold and not a.cli_steps):
        p.error(f"--cli-gil-hold values must be in (0, 50) ms and need --cli-steps; got {a.cli_gil_hold}")
    if a.cli_gil_hold and a.cli_stacks:
        p.error("--cli-gil-hold and --cli-stacks: give one of them (each wraps the fit's process its own way)")
    if a.cli_gil_profile is not None:
        start, seconds = a.cli_gil_profile
        if start < 0 or seconds <= 0 or not a.cli_steps:
            p.error(f"--cli-gil-profile START SECONDS: START >= 0 and SECONDS > 0 seconds, with --cli-steps; got "
                    f"{start:g} {seconds:g}, --cli-steps {a.cli_steps}")
        if shutil.which("py-spy") is None:
            p.error("--cli-gil-profile needs py-spy on PATH (pip install py-spy)")
        if a.cli_stacks or a.cli_gil_hold:
            p.error("--cli-gil-profile with --cli-stacks or --cli-gil-hold: give one of them (each changes the fit's "
                    "process)")
        p.check_output("--cli-gil-profile (its folder next to --out)", stacks_folder(a, ".gil"), folder=True)
    if a.cli_stacks:  # the stack dumps' folder next to --out (X.md -> X.stacks/), written after the fits
        p.check_output("--cli-stacks (its folder next to --out)", stacks_folder(a), folder=True)
    if not a.cli_steps and (a.cli_variants != [""] or a.cli_args):
        p.error("--cli-variants and --cli-args shape the --cli-steps fits: give --cli-steps N too")
    if a.cli_steps and not Path(a.cli_config).is_file():
        p.error(f"--cli-config {a.cli_config!r}: no such file")
    if a.profile < 0:
        p.error(f"--profile must be >= 0 calls; got {a.profile}")
    if a.no_loader and (a.profile or a.profile_end_to_end):
        p.error("--no-loader skips the device stage that --profile / --profile-end-to-end look at; drop one of them")
    if a.decode_under_load and (not a.decoders or a.no_train):
        p.error("--decode-under-load times the decoders of --decoders next to the training model: give --decoders "
                "and drop --no-train")
    if a.profile_end_to_end < 0:
        p.error(f"--profile-end-to-end must be >= 0 steps; got {a.profile_end_to_end}")
    if a.quick:
        a.images, a.image_wh, a.classes, a.shard_size, a.workers = 48, "64x48", 4, 6, 2
        a.batch_size, a.image_size, a.warmup, a.batches, a.model = 8, 32, 1, 3, "tiny"
        a.device = a.device or "cpu"
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    from mixlab.datamodules.files import expand_pattern
    from mixlab.datamodules.imagenet import ImageNetDataModule

    counts = {}  # shards of each pattern: every DataLoader worker needs one (the datamodule's rule)
    for option, pattern in (("--shards", a.shards), ("--val-shards", a.val_shards)):
        if pattern is not None:
            try:
                counts[option] = len(expand_pattern(pattern, option, kind="shards"))
            except (FileNotFoundError, ValueError) as err:
                p.error(str(err))
    if a.shards is None:
        counts["--images / --shard-size"] = synthetic_shard_count(a.images, a.shard_size)
    if a.no_eval and not a.cli_steps:  # the evaluation shards are read by the eval rows and the CLI fits only
        counts.pop("--val-shards", None)
    for option, count in counts.items():
        if count < max(1, a.workers):
            p.error(f"{option}: {count} shards for --workers {a.workers}; every DataLoader worker needs at least one "
                    f"shard: lower --workers" + (" or --shard-size" if a.shards is None and option != "--val-shards"
                                                 else ""))

    if a.cli_steps:  # a config or arguments the fits refuse fail here, not after minutes of earlier fits
        check_cli_fits(p, a, variants, min(counts.values()))

    tmp = None
    train_pattern, what = a.shards, "real shards"
    if train_pattern is None:
        wdir = a.workdir or (tmp := tempfile.TemporaryDirectory(prefix="bench_input_")).name
        w, h = (int(v) for v in a.image_wh.lower().split("x"))
        t0 = time.perf_counter()
        train_pattern = write_shards_parallel(wdir, a.images, (w, h), a.classes, a.shard_size,
                                              writer_procs(a.images))
        files = sorted(Path(wdir).rglob("folder/**/*.jpg"))
        kb = sum(f.stat().st_size for f in files) / len(files) / 1000
        what = f"synthetic: {a.images} JPEGs {w}x{h}, {kb:.0f} kB mean, {a.classes} classes " \
               f"(written in {time.perf_counter() - t0:.0f} s" + (f"; shards {train_pattern})" if a.workdir else ")")
    val_pattern = a.val_shards or train_pattern

    num_classes = a.classes if a.shards is None else 1000

    def dm_for(mode: str, fraction: float = 0.0) -> ImageNetDataModule:
        return ImageNetDataModule(format="wds", train_path=train_pattern, val_path=val_pattern, num_classes=num_classes,
                                  image_size=a.image_size, batch_size=a.batch_size, num_workers=a.workers,
                                  train_samples=10**9, shuffle_buffer=min(5000, 4 * a.batch_size),
                                  persistent_workers=False, decode=mode, cuda_graphs=not a.no_cuda_graphs,
                                  cpu_decode_fraction=fraction, jpeg_decoder=a.jpeg_decoder,
                                  augment_impl=a.augment_impl)

    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[str, ...]] = []
    cmd = "python " + " ".join(shlex.quote(v) for v in [sys.argv[0] if argv is None else "scripts/bench_input.py",
                                                         *(sys.argv[1:] if argv is None else argv)])
    graphs_mode = ("launched op by op (--no-cuda-graphs)" if a.no_cuda_graphs else
                   f"in CUDA graphs ({a.augment_impl})" if device.type == "cuda" else
                   "launched op by op (CUDA graphs need a CUDA device)")

    def render() -> list[str]:
        """The report's header and table of the rows measured so far."""
        return [f"## Input pipeline vs model ({datetime.date.today().isoformat()})", "",
                f"- device: {device_name(device)}; torch {torch.__version__}"
                + (f"; {CUDA_QUEUES[0]}={os.environ[CUDA_QUEUES[0]]} (as `python -m mixlab` sets it unless exported"
                   + ("; a --cli-variants string can set another)" if a.cli_steps else ")")
                   if device.type == "cuda" else ""),
                f"- data: {what if a.shards is None else train_pattern}"
                + (f"; evaluation: {a.val_shards}" if a.val_shards else ""),
                f"- batch {a.batch_size}, {a.image_size} px, warm-up {a.warmup} batches, {a.batches} timed"
                + (f"; training augmentation (decode gpu) {graphs_mode}, JPEGs decoded by {a.jpeg_decoder}"
                   if "gpu" in a.decode else
                   "; training augmentation by timm's transforms in the loader workers (decode cpu)"),
                f"- command: `{cmd}`", "",
                "| pipeline | decode | workers | measured | img/s | ms/batch | note |",
                "|---|---|---|---|---:|---:|---|"] + ["| " + " | ".join(r) + " |" for r in rows]

    fits: list[str] = []  # CLI fits ended so far (their rows come when all have run)

    def bullet(line: str) -> str:  # a fit, or (indented) what was sampled of it
        return f"  - {line.strip()}" if line.startswith("  ") else f"- {line}"

    def progress(line: str) -> None:
        """``line`` to stderr, and ``--out`` rewritten with everything so far (a run cut short keeps it)."""
        log(line)
        if a.out:
            Path(a.out).write_text("\n".join(render() + [""] + [bullet(f) for f in fits]
                                             + ["", "(partial: the run has not finished)", ""]))

    def fit_ended(line: str) -> None:
        fits.append(line)
        progress(line)

    def row(pipeline, decode, stage, ips, ms="", note=""):
        rows.append((pipeline, decode, str(a.workers) if stage != "device stage alone" and decode != "-" else "-",
                     stage, f"{ips:,.0f}", ms, note))
        progress(" | ".join(rows[-1]))

    model = build_model(a.model, a.image_size, num_classes, device)
    step = make_step(model, device, num_classes)
    if not a.no_train:
        model_ips = time_model(step, a.batch_size, a.image_size, num_classes, device, max(2, a.warmup),
                               max(3, a.batches // 2))
        step_ms = 1000 * a.batch_size / model_ips
        note = "fp32"
        if device.type == "cuda":
            host = launch_ms(step, a.batch_size, a.image_size, num_classes, device)
            note = (f"bf16 autocast; the host launches one step in {host:.1f} ms with the device idle "
                    f"({host / step_ms:.2f} of the step)")
        row("model", "-", f"{a.model} fwd+bwd+AdamW (random tensors)", model_ips, f"{step_ms:.1f}", note)
    if not a.no_eval:
        model.eval()
        eval_ips = time_model(make_eval_step(model, device), a.batch_size, a.image_size, num_classes, device, 2,
                              max(3, a.batches // 2))
        model.train()
        row("model", "-", f"{a.model} evaluation forward (random tensors)", eval_ips,
            f"{1000 * a.batch_size / eval_ips:.1f}", "bf16 autocast, no grad" if device.type == "cuda" else "fp32")
    splits = [] if a.no_loader else ([] if a.no_train else ["train"]) + ([] if a.no_eval else ["val"])
    stage_ops: list[str] = []
    profiles: list[str] = []
    for split in splits:
        fractions = a.cpu_decode_fraction if split == "train" else [0.0]
        for decode, fraction, mode in decode_runs(a.decode, fractions):  # mode: the table's label
            dm = dm_for(decode, fraction)
            if decode == "cpu":
                ips, n = time_loader(dm, split, device, a.warmup, a.batches, stage=False)
                label = "loader (decoded, augmented)" if split == "train" else "loader (decoded, resized, cropped)"
                row(split, mode, label, ips, note=f"{n} images")
            else:
                ips, n = time_loader(dm, split, device, a.warmup, a.batches, stage=False)
                row(split, mode, "loader (bytes + parameters" + (", the share decoded)" if fraction else ")"), ips,
                    note=f"{n} images")
                ips, n = time_loader(dm, split, device, a.warmup, a.batches, stage=True)
                row(split, mode, "loader + device stage", ips, note=f"{n} images")
                if a.prefetch:
                    ips, n = time_loader(dm, split, device, a.warmup, a.batches, stage=True, prefetch=a.prefetch)
                    row(split, mode, f"loader + device stage, prefetched ({a.prefetch} ahead)", ips,
                        note=f"{n} images")
                ips, ms, ops = time_stage(dm, split, device, max(3, a.batches // 3))
                row(split, mode, "device stage alone", ips, f"{ms:.1f}",
                    f"on {device.type}; {ops['ops']:,} ops ({ops['compute']:,} compute)")
                stage_ops.append(f"{split} ({mode}) {ops['ops']:,} ({ops['compute']:,} compute, "
                                 f"{ops['decode']} decoder calls, "
                                 f"{ops['syncs']} syncing)")
                if split == "train" and not fraction:
                    for name, ips, ms, note in time_decoders(dm, device, a.decoders, max(3, a.batches // 3)):
                        row(split, f"{mode}, {name}", "JPEG decode alone (one batched call)", ips, f"{ms:.1f}", note)
                    if a.decode_under_load:
                        for name, ips, ms, note in time_decoders_under_load(
                                dm, device, a.decoders, max(3, a.batches // 3), step, a.batch_size, a.image_size,
                                num_classes, 1000 * a.batch_size / model_ips):
                            row(split, f"{mode}, {name}", "JPEG decode next to training steps (another thread)", ips,
                                f"{ms:.1f}", note)
                if a.profile:
                    profiles += [""] + profile_stage(dm, split, device, a.profile)
            if split == "train" and not a.no_end_to_end:
                ips, n = time_loader(dm, split, device, a.warmup, a.batches, stage=True, step=step)
                row(split, mode, "end to end (loader + model step)" if decode == "cpu" else
                    "end to end (loader + device stage + model step)", ips,
                    f"{1000 * a.batch_size / ips:.1f}", of_model(ips, model_ips))
                if decode == "gpu" and a.prefetch:
                    ips, n = time_loader(dm, split, device, a.warmup, a.batches, stage=True, step=step,
                                         prefetch=a.prefetch)
                    row(split, mode, f"end to end, device stage prefetched ({a.prefetch} ahead)", ips,
                        f"{1000 * a.batch_size / ips:.1f}", of_model(ips, model_ips))
                if decode == "gpu" and a.profile_end_to_end:
                    profiles += [""] + profile_end_to_end(dm, device, step, a.prefetch, a.warmup,
                                                          a.profile_end_to_end)
    if a.cli_steps and not a.no_train:
        rows += cli_rows(a, train_pattern, val_pattern, model_ips, progress=fit_ended)
    lines = render()
    if fits:
        lines += ["", "CLI fits, in the order they ran (wall time split from the logged steps' times):"] \
            + [bullet(f) for f in fits]
    if stage_ops:
        lines += ["", f"device-stage ops per batch of {a.batch_size}: {'; '.join(stage_ops)} (torch ops dispatched "
                  "from Python, `torch.profiler` CPU events; compute: not views, each launches kernels on a GPU)."]
    lines += profiles
    if splits:
        f_train, f_eval, n_draft = draft_fractions(train_pattern, a.image_size, 224 / 256, 2000)
        applies = {"train": f"{f_train:.1%} of training crops", "val": f"{f_eval:.1%} of evaluation images"}
        lines += ["", f"PIL `draft` (reduced-size JPEG decoding) could apply to "
                  f"{' and '.join(applies[s] for s in splits)} ({n_draft} images looked at)."]
    text = "\n".join(lines + [""])
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    if tmp is not None:
        tmp.cleanup()
    return text


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: exit normally, so temporary shards go
    try:
        main()
    except KeyboardInterrupt:
        print("bench_input: interrupted (--out keeps what was measured)", file=sys.stderr)
        sys.exit(130)
    except RuntimeError as err:  # a CLI fit failed: its command and error output, no traceback of ours
        print(f"bench_input: {err}\n(--out keeps what was measured before)", file=sys.stderr)
        sys.exit(1)
