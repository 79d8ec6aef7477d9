"""GPU benchmark: ViT-S/16 with the 2D GOAT prior vs learned APE vs timm's ``vit_small_patch16_224``.

Run on a CUDA device from the project root::

    python scripts/bench_vit.py --out out/

One process, so every ratio is against the anchor (timm ``vit_small_patch16_224``, drop-path 0.1,
``dynamic_img_size=True``) measured in the same run:

1. training images/s (fwd + bwd + AdamW step, bf16 autocast, batch 256 at 224) and peak
   ``max_memory_allocated`` for: timm (anchor), mixlab GOAT-2D (R=16), mixlab APE, mixlab 2D RoPE,
   mixlab NoPE; with ``--compile`` also ``torch.compile`` of each.
2. eval images/s at 512 (inference_mode, bf16, batch 64; APE/timm resample their embeddings).
3. whether the GOAT fast path runs under the FLASH SDPA backend alone (no dense bias fallback).

Goal (issue 5): GOAT-2D training images/s >= 0.97x timm. Prints Markdown tables and writes
``bench_vit.md`` into ``--out``.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mixlab.eval.common import OneLineParser


def build(name: str):
    import timm

    import mixlab.heads.vit  # noqa: F401  (registers the vit_small_patch16_* models)

    if name == "timm":
        return timm.create_model("vit_small_patch16_224", num_classes=1000, drop_path_rate=0.1, dynamic_img_size=True)
    return timm.create_model(f"vit_small_patch16_{name}", num_classes=1000, drop_path_rate=0.1)


def bench_train(model, batch: int, res: int, iters: int, warmup: int) -> tuple[float, float]:
    """(images/s, peak GB) of fwd+bwd+AdamW at ``res`` in bf16 autocast."""
    dev = torch.device("cuda")
    model = model.to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05)
    x = torch.randn(batch, 3, res, res, device=dev)
    y = torch.randint(0, 1000, (batch,), device=dev)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(dev) / 1e9
    opt = None  # release it (the step closure holds the name)
    return batch / statistics.median(times), peak


@torch.inference_mode()
def bench_eval(model, batch: int, res: int, iters: int, warmup: int) -> float:
    dev = torch.device("cuda")
    model = model.to(dev).eval()
    x = torch.randn(batch, 3, res, res, device=dev)
    for _ in range(warmup):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(x)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(x)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return batch / statistics.median(times)


def flash_only_ok() -> str:
    """Run the GOAT-2D model forward with only the FLASH SDPA backend allowed."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = build("goat").cuda().eval()
    x = torch.randn(8, 3, 224, 224, device="cuda")
    try:
        with (torch.inference_mode(), sdpa_kernel([SDPBackend.FLASH_ATTENTION]),
              torch.autocast("cuda", dtype=torch.bfloat16)):
            model(x)
        return "yes"
    except RuntimeError as exc:
        return f"NO ({str(exc).splitlines()[0][:80]})"


def main(argv: list[str] | None = None) -> None:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out", help="directory for bench_vit.md")
    p.add_argument("--batch", type=int, default=256, help="training batch at 224")
    p.add_argument("--eval-batch", type=int, default=64, help="eval batch at --eval-res")
    p.add_argument("--eval-res", type=int, default=512)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--models", nargs="+", default=["timm", "goat", "ape", "rope2d", "nope"])
    p.add_argument("--compile", action="store_true", help="also measure torch.compile'd models")
    a = p.parse_args(argv)
    p.check_output("--out", a.out, folder=True)
    if not torch.cuda.is_available():
        sys.exit("bench_vit.py needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    variants = [(m, False) for m in a.models] + ([(m, True) for m in a.models] if a.compile else [])
    rows = []
    for name, comp in variants:
        torch.manual_seed(0)
        model = build(name)
        params = sum(p.numel() for p in model.parameters()) / 1e6
        run = torch.compile(model) if comp else model
        ips, peak = bench_train(run, a.batch, 224, a.iters, a.warmup)
        eval_ips = bench_eval(run, a.eval_batch, a.eval_res, a.iters, a.warmup)
        label = ("timm vit_small_patch16_224" if name == "timm" else f"mixlab {name}") + (" + compile" if comp else "")
        rows.append(dict(label=label, name=name, compiled=comp, params=params, ips=ips, peak=peak, eval_ips=eval_ips))
        print(f"{label}: {ips:.0f} img/s train, {peak:.2f} GB, {eval_ips:.0f} img/s eval@{a.eval_res}", flush=True)
        model = run = None  # release them (the step closure holds these names)
        torch.cuda.empty_cache()
    anchor = {c: next((r for r in rows if r["name"] == "timm" and r["compiled"] == c), None) for c in (False, True)}
    dev = torch.cuda.get_device_name()
    lines = [f"### ViT-S/16 throughput ({dev}, torch {torch.__version__}, bf16 autocast, AdamW)", "",
             f"Training: batch {a.batch} at 224, fwd+bwd+step, median of {a.iters}. Eval: batch {a.eval_batch} at "
             f"{a.eval_res}, inference. Ratios against timm vit_small_patch16_224 in the same run "
             "(compiled rows against compiled timm).", "",
             "| model | params (M) | train img/s | x timm | peak mem (GB) | x timm | "
             f"eval img/s @{a.eval_res} | x timm |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        an = anchor[r["compiled"]] or anchor[False]
        lines.append(f"| {r['label']} | {r['params']:.2f} | {r['ips']:.0f} | {r['ips'] / an['ips']:.3f} | "
                     f"{r['peak']:.2f} | "
                     f"{r['peak'] / an['peak']:.3f} | {r['eval_ips']:.0f} | {r['eval_ips'] / an['eval_ips']:.3f} |")
    goat = next((r for r in rows if r["name"] == "goat" and not r["compiled"]), None)
    lines.append("")
    if goat and anchor[False]:
        ratio = goat["ips"] / anchor[False]["ips"]
        lines.append(f"Goal GOAT-2D training >= 0.97x timm: {ratio:.3f}x -> {'met' if ratio >= 0.97 else 'NOT met'}.")
    lines.append(f"GOAT-2D forward under the FLASH backend only: {flash_only_ok()}.")
    md = "\n".join(lines) + "\n"
    print()
    print(md)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_vit.md").write_text(md)


if __name__ == "__main__":
    main()
