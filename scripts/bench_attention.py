"""GPU benchmark: GOAT attention layer vs a plain qkv+SDPA+proj layer (and the public reference).

Run on a CUDA device from the project root::

    python scripts/bench_attention.py --out out/

Measures, in ONE process so every ratio is against an anchor measured in the same run:

1. Layer fwd+bwd time and peak memory at B8 T2048 d_model 768 H12 bf16 causal:
   plain layer (anchor), mixlab goat (R=4), goat + torch.compile, rope, alibi, nope,
   and goat-attention 0.1.1's ``GoatAttention`` when installed.
   Also checks that the GOAT fast path runs under the FLASH backend only.
2. Genome-LM training tokens/s and peak memory, GOAT vs RoPE, 125M-class config
   (12 layers, d 768, 12 heads, context 1024, batch 16, vocab 5, AdamW, bf16 autocast).

Prints Markdown tables (and writes ``bench_attention.md`` into ``--out``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


class PlainAttention(nn.Module):
    """Anchor: fused qkv Linear -> causal SDPA (flash) -> out Linear."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.h = h
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


def kernel_ms(fn, x, g, iters: int = 10) -> float:
    """Sum of GPU kernel time per fwd+bwd (torch.profiler), in ms: what the layer costs the GPU,
    independent of host-side launch overhead (which dominates small layers on a fast GPU)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            x.grad = None
            fn(x).backward(g)
        torch.cuda.synchronize()
    total = 0.0
    for e in prof.key_averages():
        total += getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
    return total / 1e3 / iters


def time_fwd_bwd(fn, x, iters: int = 30, warmup: int = 10) -> tuple[float, float, float]:
    """Median wall ms of fwd+bwd, GPU kernel ms, and peak MB above the pre-call allocation."""
    g = torch.randn_like(x)
    for _ in range(warmup):
        x.grad = None
        fn(x).backward(g)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        x.grad = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(x).backward(g)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    x.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(x).backward(g)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return statistics.median(times), kernel_ms(fn, x, g), peak


def layer_bench(args) -> list[tuple[str, float, float]]:
    from mixlab.registry import build_mixer

    B, T, D, H = 8, 2048, 768, 12
    dev = "cuda"
    x = torch.randn(B, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    rows = []
    plain = PlainAttention(D, H).to(dev, torch.bfloat16)
    rows.append(("plain qkv+SDPA+proj (anchor)", *time_fwd_bwd(plain, x)))
    del plain
    for name, pa in [("goat", dict(n_modes=4)), ("goat", dict(n_modes=4, lane_impl="torch")),
                     ("rope", None), ("alibi", None), ("nope", None)]:
        m = build_mixer(name, d_model=D, n_heads=H, causal=True, position_args=pa).to(dev, torch.bfloat16)
        label = f"mixlab {name}" + (" R=4" if name == "goat" else "") + (" (torch lanes)" if pa and "lane_impl" in pa else "")
        rows.append((label, *time_fwd_bwd(m, x)))
        if pa and "lane_impl" in pa:
            continue
        if name == "goat":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                m(x).sum().backward()  # raises if the fast path is not flash-eligible
            x.grad = None
            mc = torch.compile(m)
            rows.append(("mixlab goat R=4, torch.compile", *time_fwd_bwd(mc, x)))
    try:
        from goat import GoatAttention

        ref = GoatAttention(D, H, pos_rank=4, batch_first=True, bias=False).to(dev, torch.bfloat16)
        rows.append(("goat-attention 0.1.1 GoatAttention",
                     *time_fwd_bwd(lambda z: ref(z, z, z, is_causal=True, need_weights=False)[0], x)))
    except Exception as e:  # noqa: BLE001 - optional comparison
        rows.append((f"goat-attention 0.1.1 unavailable ({type(e).__name__}: {e})"[:120], float("nan"), float("nan"), float("nan")))
    return rows


def lm_bench(args) -> list[tuple[str, float, float]]:
    from mixlab.backbone import BackboneConfig
    from mixlab.heads.lm import CausalLM

    B, T = 16, 1024
    rows = []
    for mixer, pa in [("rope", None), ("goat", {"n_modes": 2})]:
        torch.manual_seed(0)
        cfg = BackboneConfig(d_model=768, n_layers=12, n_heads=12, mixer=mixer,
                             mixer_args={mixer: {"position_args": pa}} if pa else {})
        model = CausalLM(vocab_size=5, backbone=cfg).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        batch = torch.randint(0, 5, (B, T + 1), device="cuda")

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        tps = B * T / statistics.median(times)
        peak = torch.cuda.max_memory_allocated() / 2**30
        n_params = sum(p.numel() for p in model.parameters()) / 1e6
        rows.append((f"genome LM {mixer} ({n_params:.0f}M params)", tps, peak))
        del model, opt
        torch.cuda.empty_cache()
    return rows


def profile_goat() -> None:
    """torch.profiler table of one GOAT layer fwd+bwd (after warm-up)."""
    from torch.profiler import ProfilerActivity, profile

    from mixlab.registry import build_mixer

    x = torch.randn(8, 2048, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for name in ["goat", "plain"]:
        m = (build_mixer("goat", d_model=768, n_heads=12, causal=True, position_args={"n_modes": 4})
             if name == "goat" else PlainAttention(768, 12)).to("cuda", torch.bfloat16)
        for _ in range(5):
            m(x).sum().backward()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                m(x).sum().backward()
            torch.cuda.synchronize()
        print(f"===== {name}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=50))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--skip-lm", action="store_true")
    ap.add_argument("--profile", action="store_true", help="print the top CUDA kernels of the GOAT layer and exit")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention.py needs a CUDA device")
    if args.profile:
        profile_goat()
        return
    lines = [f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", "",
             "### Attention layer fwd+bwd, B8 T2048 d_model 768 H12 bf16 causal", "",
             "| layer | wall ms | x plain | GPU kernel ms | x plain | peak MB | x plain |",
             "|---|---|---|---|---|---|---|"]
    rows = layer_bench(args)
    t0, k0, m0 = rows[0][1], rows[0][2], rows[0][3]
    for name, ms, kms, mb in rows:
        lines.append(f"| {name} | {ms:.3f} | {ms / t0:.3f} | {kms:.3f} | {kms / k0:.3f} | {mb:.0f} | {mb / m0:.3f} |")
    print("\n".join(lines), flush=True)
    if not args.skip_lm:
        lm = lm_bench(args)
        lines += ["", "### Genome LM training step, 12x768 H12, B16 T1024, bf16 autocast, AdamW", "",
                  "| model | tokens/s | x rope | peak GiB | x rope |", "|---|---|---|---|---|"]
        for name, tps, gb in lm:
            lines.append(f"| {name} | {tps:,.0f} | {tps / lm[0][1]:.3f} | {gb:.2f} | {gb / lm[0][2]:.3f} |")
        print("\n".join(lines[-(len(lm) + 4):]), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_attention.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
