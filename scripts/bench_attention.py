"""GPU benchmark: GOAT attention layer vs a plain qkv+SDPA+proj layer (and the public reference).

Run on a CUDA device from the project root::

    python scripts/bench_attention.py --out out/

Measures, in ONE process so every ratio is against an anchor measured in the same run:

1. Layer fwd+bwd time and peak memory at B8 T2048 d_model 768 H12 causal, bf16 autocast
   with fp32 parameters (as ``precision: bf16-mixed`` trains):
   plain layer (anchor), plain + torch.compile, mixlab goat (R=4), goat + torch.compile, rope, alibi, nope,
   and goat-attention 0.1.1's ``GoatAttention`` when installed; plain and goat under CUDA graphs
   (``torch.cuda.make_graphed_callables``: the host's launch overhead removed, i.e. the
   GPU-bound regime); then ``--rounds`` interleaved plain / goat measurements whose per-round
   ratios judge the goal (the host drifts).
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

from mixlab.eval.common import OneLineParser


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


class Autocast(nn.Module):
    """Run ``inner`` under bf16 autocast with fp32 parameters (as bf16-mixed training does);
    ``cache=False`` for CUDA-graph capture."""

    def __init__(self, inner, cache: bool = True) -> None:
        super().__init__()
        self.inner, self.cache = inner, cache

    def forward(self, x):
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=self.cache):
            return self.inner(x)


def time_fwd_bwd(fn, x, iters: int = 30, warmup: int = 10, repeats: int = 5) -> tuple[float, float, float]:
    """``(synced ms, pipelined ms, peak MB)`` of one fwd+bwd with fresh parameter gradients.

    *synced*: median over iterations that each end with ``cuda.synchronize`` (host launch
    latency fully exposed, as in a step that reads the loss every time). *pipelined*: median
    over ``repeats`` of ``iters`` back-to-back iterations (the host runs ahead, as in a
    training loop that does not synchronise): close to the GPU time when the GPU is busy.
    Parameter gradients are set to None before every iteration (as ``zero_grad`` does).
    Peak MB is above the allocation before the call.
    """
    g = torch.randn_like(x)
    params = [p for p in getattr(fn, "parameters", lambda: [])()]

    def once():
        x.grad = None
        for p in params:
            p.grad = None
        fn(x).backward(g)

    for _ in range(warmup):
        once()
    torch.cuda.synchronize()
    synced = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        once()
        torch.cuda.synchronize()
        synced.append((time.perf_counter() - t0) * 1e3)
    piped = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            once()
        torch.cuda.synchronize()
        piped.append((time.perf_counter() - t0) * 1e3 / iters)
    x.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    once()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return statistics.median(synced), statistics.median(piped), peak


def layer_bench(args) -> list[tuple[str, float, float]]:
    from mixlab.registry import build_mixer

    B, T, D, H = 8, 2048, 768, 12
    dev = "cuda"
    x = torch.randn(B, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    rows = []
    plain = Autocast(PlainAttention(D, H)).to(dev)
    rows.append(("plain qkv+SDPA+proj (anchor)", *time_fwd_bwd(plain, x)))
    if not args.no_compile:  # compiled rows compare with the compiled plain layer (host overhead removed)
        rows.append(("plain, torch.compile", *time_fwd_bwd(torch.compile(plain), x)))
    del plain
    for name, pa in [("goat", dict(n_modes=4)), ("goat", dict(n_modes=4, lane_impl="torch")),
                     ("rope", None), ("rope", dict(rotary_impl="triton")), ("alibi", None), ("nope", None),
                     ("goat", dict(n_modes=4))]:
        m = Autocast(build_mixer(name, d_model=D, n_heads=H, causal=True, position_args=pa)).to(dev)
        label = (f"mixlab {name}" + (" R=4" if name == "goat" else "")
                 + (" (torch lanes)" if pa and "lane_impl" in pa else "")
                 + (" (in-place Triton rotation)" if pa and "rotary_impl" in pa else ""))
        if any(r[0] == label for r in rows):
            label += " (again, end of run)"
        rows.append((label, *time_fwd_bwd(m, x)))
        if (pa and ("lane_impl" in pa or "rotary_impl" in pa)) or label.endswith("end of run)"):
            continue
        if name == "goat":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                m(x).sum().backward()  # raises if the fast path is not flash-eligible
            x.grad = None
            if args.no_compile:
                continue
            try:
                mc = torch.compile(m)
                rows.append(("mixlab goat R=4, torch.compile", *time_fwd_bwd(mc, x)))
            except Exception as e:  # noqa: BLE001 - optional row
                rows.append((f"goat torch.compile failed ({type(e).__name__})", float("nan"), float("nan"),
                             float("nan")))
    plain = Autocast(PlainAttention(D, H)).to(dev)
    rows.append(("plain (again, end of run: drift check)", *time_fwd_bwd(plain, x)))
    # CUDA graphs (torch.cuda.make_graphed_callables): host launch overhead removed from both layers,
    # i.e. the GPU-bound regime of large models and batches; ratios against the graphed plain layer
    graphed = {}
    for name, build in [("plain", lambda: PlainAttention(D, H)),
                        ("goat", lambda: build_mixer("goat", d_model=D, n_heads=H, causal=True,
                                                     position_args=dict(n_modes=4)))]:
        try:
            g_fn = torch.cuda.make_graphed_callables(Autocast(build(), cache=False).to(dev), (x,))
            graphed[name] = time_fwd_bwd(g_fn, x)
            rows.append((f"{name}, CUDA graph (make_graphed_callables)", *graphed[name]))
        except Exception as e:  # noqa: BLE001 - optional rows
            rows.append((f"{name} CUDA graph failed ({type(e).__name__}: {e})"[:120], float("nan"), float("nan"),
                         float("nan")))
    if len(graphed) == 2:
        args.graphed = (graphed["goat"][0] / graphed["plain"][0], graphed["goat"][1] / graphed["plain"][1])
    # interleaved rounds: the host's speed drifts during a run, so alternate plain and goat and
    # report per-round ratios (median, min, max) - the figure to judge the goal by
    goat = Autocast(build_mixer("goat", d_model=D, n_heads=H, causal=True, position_args=dict(n_modes=4))).to(dev)
    ratios = {"synced": [], "pipelined": []}
    for _ in range(args.rounds):
        p, g = time_fwd_bwd(plain, x), time_fwd_bwd(goat, x)
        ratios["synced"].append(g[0] / p[0])
        ratios["pipelined"].append(g[1] / p[1])
    args.interleaved = {k: (statistics.median(v), min(v), max(v)) for k, v in ratios.items()}
    del plain, goat
    try:
        from goat import GoatAttention

        class Ref(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.m = GoatAttention(D, H, pos_rank=4, batch_first=True, bias=False)

            def forward(self, z):
                return self.m(z, z, z, is_causal=True, need_weights=False)[0]

        rows.append(("goat-attention 0.1.1 GoatAttention", *time_fwd_bwd(Autocast(Ref()).to(dev), x)))
    except Exception as e:  # noqa: BLE001 - optional comparison
        rows.append((f"goat-attention 0.1.1 unavailable ({type(e).__name__}: {e})"[:120], float("nan"), float("nan"),
                     float("nan")))
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
        for _ in range(5):  # 5 repeats of 10 back-to-back steps (no host sync inside)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                step()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) / 10)
        tps = B * T / statistics.median(times)
        peak = torch.cuda.max_memory_allocated() / 2**30
        n_params = sum(p.numel() for p in model.parameters()) / 1e6
        rows.append((f"genome LM {mixer} ({n_params:.0f}M params)", tps, peak))
        model = opt = None  # release them (the step closure holds these names)
        torch.cuda.empty_cache()
    return rows


def profile_goat() -> None:
    """Per fwd+bwd of the GOAT and the plain layer: host time (30 iterations launched back to
    back, before the final sync), GPU kernel time (torch.profiler), and the top CUDA kernels."""
    from torch.profiler import ProfilerActivity, profile

    from mixlab.registry import build_mixer

    x = torch.randn(8, 2048, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    for name in ["goat", "plain"]:
        m = Autocast(build_mixer("goat", d_model=768, n_heads=12, causal=True, position_args={"n_modes": 4})
                     if name == "goat" else PlainAttention(768, 12)).to("cuda")

        def once():
            x.grad = None
            for p in m.parameters():
                p.grad = None
            m(x).backward(g)

        for _ in range(5):
            once()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(30):
            once()
        host_us = (time.perf_counter() - t0) / 30 * 1e6
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                once()
            torch.cuda.synchronize()
        ka = prof.key_averages()
        gpu_us = sum(e.self_device_time_total for e in ka) / 5
        print(f"===== {name}: host {host_us:.0f} us, GPU kernels {gpu_us:.0f} us per fwd+bwd")
        print(ka.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=50))
        with profile(activities=[ProfilerActivity.CPU]) as prof:  # where the host time goes
            for _ in range(5):
                once()
            torch.cuda.synchronize()
        print(f"----- {name}: top host (CPU) ops, 5 iterations")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=50))


def main() -> None:
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--skip-lm", action="store_true")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile row")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved plain/goat rounds for the ratio")
    ap.add_argument("--profile", action="store_true",
                    help="print host time, GPU kernel time and top kernels of the GOAT and plain layers, then exit")
    args = ap.parse_args()
    ap.check_output("--out", args.out, folder=True)
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention.py needs a CUDA device")
    if args.profile:
        profile_goat()
        return
    lines = [f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", "",
             "### Attention layer fwd+bwd, B8 T2048 d_model 768 H12 causal, bf16 autocast, fp32 params", "",
             "| layer | synced ms | x plain | pipelined ms | x plain | peak MB | x plain |",
             "|---|---|---|---|---|---|---|"]
    rows = layer_bench(args)
    t0, k0, m0 = rows[0][1], rows[0][2], rows[0][3]
    for name, ms, kms, mb in rows:
        lines.append(f"| {name} | {ms:.3f} | {ms / t0:.3f} | {kms:.3f} | {kms / k0:.3f} | {mb:.0f} | {mb / m0:.3f} |")
    lines += ["", f"GOAT / plain over {args.rounds} interleaved rounds (median [min, max]): " + ", ".join(
        f"{k} {m:.3f} [{lo:.3f}, {hi:.3f}]" for k, (m, lo, hi) in args.interleaved.items())]
    if getattr(args, "graphed", None):
        lines.append(f"GOAT / plain with CUDA graphs (no host overhead): synced {args.graphed[0]:.3f}, "
                     f"pipelined {args.graphed[1]:.3f}")
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
