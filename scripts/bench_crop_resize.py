"""Crop + resize of the ImageNet device stage alone: ``resized_crops`` with the batched TF32 GEMMs (``impl="gemm"``,
``augment_impl: torch``) against the two Triton kernels (``impl="triton"``, ``augment_impl: triton``) (issue 21).

Run on a CUDA machine from the project root::

    python scripts/bench_crop_resize.py --out crop_resize.md

Per case: ``--batch`` uint8 images of ``--image-wh`` pixels (random levels: the resampling cost does not depend on
the content), training crops drawn as timm's ``RandomResizedCrop`` (scale 0.08-1, ratio 3/4-4/3, flips) resized to
224, and the evaluation's Resize (short side 256 / 224 x the size) + CenterCrop at 224 and 512. Each impl runs
``--warmup`` times, then ``--iters`` times: the device time its kernels and copies take (``torch.profiler``, summed:
what a model running next to the stage loses), its ratio against the GEMMs measured in the same run, the median time
between CUDA events around the call (launch gaps included: bound by the host where it launches slower than the GPU
runs) and the host time until the call returns, and how the two impls differ (largest level difference, share of
pixels that differ). Writes a Markdown table with date, device and command to
``--out`` and prints it.
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import sys
import time
from pathlib import Path

import torch

from mixlab.datamodules.imagenet_gpu import resized_crops


def rrc_boxes(hw: list[tuple[int, int]], seed: int = 0) -> torch.Tensor:
    """int64 ``[n, 4]`` crop boxes (top, left, height, width) drawn by torchvision's
    ``RandomResizedCrop.get_params`` (scale 0.08-1, ratio 3/4-4/3: timm's defaults) for each image size."""
    from torchvision.transforms import RandomResizedCrop

    torch.manual_seed(seed)
    return torch.tensor([RandomResizedCrop.get_params(torch.empty(1, h, w), [0.08, 1.0], [3 / 4, 4 / 3])
                         for h, w in hw])


def timed(fn, warmup: int, iters: int) -> tuple[float, float, torch.Tensor]:
    for _ in range(warmup):
        out = fn()
    torch.cuda.synchronize()
    dev_ms, host_ms = [], []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        a.record()
        out = fn()
        b.record()
        host_ms.append(1e3 * (time.perf_counter() - t))
        torch.cuda.synchronize()
        dev_ms.append(a.elapsed_time(b))
    return sorted(dev_ms)[iters // 2], sorted(host_ms)[iters // 2], out


def kernel_ms(fn, iters: int) -> float:
    """Device milliseconds per call summed over the kernels and copies ``fn`` launches (``torch.profiler``): the
    GPU time the call takes from a model running next to it, launch gaps excluded."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    dev = lambda e: getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))  # noqa: E731
    return sum(dev(e) for e in prof.key_averages() if not e.key.startswith(("aten::", "cuda"))) / iters / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--image-wh", default="500x375", help="image width x height (pixels)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", help="Markdown file to write")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_crop_resize.py: needs a CUDA device (the Triton kernels and the TF32 GEMMs are CUDA paths)")
    w, h = (int(v) for v in args.image_wh.lower().split("x"))
    g = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    imgs = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g).to(dev) for _ in range(args.batch)]
    hw = [(h, w)] * args.batch
    cases = {"train 224 (RandomResizedCrop, flips)": dict(boxes=rrc_boxes(hw), size=(224, 224),
                                                          flip=torch.rand(args.batch, generator=g) < 0.5)}
    for crop in (224, 512):
        short = int(math.floor(crop / 0.875))
        rs = torch.tensor([[short * hh // min(hh, ww), short * ww // min(hh, ww)] for hh, ww in hw])
        cases[f"eval {crop} (Resize {short} + CenterCrop)"] = dict(
            boxes=torch.tensor([[0, 0, hh, ww] for hh, ww in hw]), size=(crop, crop), flip=None, resized=rs,
            offsets=torch.round((rs - crop) / 2.0).to(torch.int64))
    rows = []
    for name, c in cases.items():
        kw = {k: v for k, v in c.items() if k not in ("boxes", "size", "flip")}
        fns = {impl: (lambda impl=impl: resized_crops(imgs, c["boxes"], c["size"], c["flip"], impl=impl, **kw))
               for impl in ("gemm", "triton")}
        res = {impl: timed(fn, args.warmup, args.iters) for impl, fn in fns.items()}
        kern = {impl: kernel_ms(fn, 5) for impl, fn in fns.items()}
        d = (res["triton"][2] - res["gemm"][2]).abs()
        for impl, (dm, hm, _) in res.items():
            diff = f"{float(d.max()):.0f}, {float((d > 0).float().mean()):.1e}" if impl == "triton" else "-"
            rows.append(f"| {name} | {impl} | {kern[impl]:.3f} | {kern['gemm'] / kern[impl]:.2f}x | {dm:.3f} | "
                        f"{hm:.3f} | {diff} |")
            print(rows[-1], file=sys.stderr, flush=True)
    head = (f"`{' '.join(['python', 'scripts/bench_crop_resize.py'] + sys.argv[1:])}` — "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {torch.cuda.get_device_name()}, "
            f"torch {torch.__version__}, {platform.node()}; {args.batch} images of {w}x{h}, median of {args.iters}\n\n"
            "| case | impl | kernel ms / batch | kernel time vs gemm | events ms / batch | host ms / batch | triton vs "
            "gemm: max levels, share of pixels |\n|---|---|---:|---:|---:|---:|---|\n")
    text = head + "\n".join(rows) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
