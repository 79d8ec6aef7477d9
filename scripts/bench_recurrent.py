"""Gated delta-rule mixers on the GPU: correctness of the CUDA path, fwd+bwd cost, prefill throughput.

One command runs everything and writes Markdown tables (stdout and ``OUT/bench_recurrent.md``),
``OUT/bench_recurrent.json`` and ``OUT/prefill.png``::

    python scripts/bench_recurrent.py --out bench_out/recurrent

1. CUDA vs reference, per variant (deltanet, gdn, kda, fg2gdn, fg2gdn_plus, fgbgdn, kda_kvbeta):
   the mixer layer in float32 on CUDA (fla ``chunk_kda`` + Triton gate prep) against a
   float64 copy on the torch chunkwise path; max abs / max relative (to max |ref|) error of
   the output, the final state, and all parameter gradients; also packed ``cu_seqlens``.
2. fwd+bwd time at B4 T4096 H16 K=V=128 bf16, all in this run, as ratios to KDA:
   op level (gate prep + kernel: raw ``chunk_kda``, KDA, FG²-GDN with fused / eager /
   compiled gate prep, FG²-GDN+, GDN via KDA with a broadcast gate) and layer level
   (full mixers with projections, D = 2048). Goals: FG²-GDN <= 1.03x KDA, FG²-GDN+ <= 1.06x.
3. Prefill (forward, no grad) throughput vs length 2K..32K at 32768 tokens per call
   (paper Fig. 3 setting): GDN, KDA, FG²-GDN, FG²-GDN+ layers and causal flash attention
   (RoPE attention layer, SDPA restricted to the flash backend).

``--smoke`` runs tiny shapes (works on CPU with the torch paths, to check the script).
Progress goes to stdout (flushed) per section, variant and shape; the report files are
rewritten after every section, so a run cut by a time limit keeps what it finished. The
first call of each fla kernel at a new shape/dtype runs Triton autotuning (tens of seconds
per section on an H200); ``--skip compile`` drops the torch.compile row.

    python scripts/bench_recurrent.py --out OUT --warmup 2 --iters 8 --skip compile
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mixlab.eval.common import OneLineParser
from mixlab.ops.delta_rule import delta_rule
from mixlab.ops.fg2_gate import fg2_gate_prep, fg2_gate_prep_torch
from mixlab.registry import build_mixer

VARIANTS = ["deltanet", "gdn", "kda", "fg2gdn", "fg2gdn_plus", "fgbgdn", "kda_kvbeta"]
_T0 = time.perf_counter()
WARMUP, ITERS = 3, 10  # set from --warmup / --iters


def log(msg: str) -> None:
    """Progress line on stdout, flushed (seconds since start)."""
    print(f"[bench_recurrent {time.perf_counter() - _T0:7.1f}s] {msg}", flush=True)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timeit(fn, dev, warmup=3, iters=10):
    """Median milliseconds of ``fn()`` (CUDA events on GPU, wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    sync(dev)
    times = []
    for _ in range(iters):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def md_table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


# ---------------------------------------------------------------------------------- 1. correctness
def check_variant(name, dev, B, T, D, H, fast_impl):
    torch.manual_seed(0)
    m = build_mixer(name, d_model=D, n_heads=H, causal=True).to(dev)
    with torch.no_grad():  # non-trivial gates: random low-rank / bias weights
        for p in m.parameters():
            if p.dim() == 1 and p is not getattr(m, "A_log", None) and p is not getattr(m, "dt_bias", None):
                p.normal_(0, 0.5)
    ref = copy.deepcopy(m).double()
    m.impl, ref.impl = fast_impl, "chunk"
    x = torch.randn(B, T, D, device=dev)
    up = torch.randn(B, T, D, device=dev)
    res = {}

    def run(mod, xx, **kw):
        cache = None if kw else {}  # packed sequences (cu_seqlens) take no decoding cache
        y = mod(xx, cache=cache, **kw)
        (y * up[: y.shape[0], : y.shape[1]].to(y.dtype)).sum().backward()
        grads = {n: p.grad.detach().clone() for n, p in mod.named_parameters() if p.grad is not None}
        mod.zero_grad(set_to_none=True)
        return y.detach(), None if cache is None else cache["state"].detach(), grads

    y, s, g = run(m, x)
    yr, sr, gr = run(ref, x.double())

    def err(a, b):
        a, b = a.double(), b.double()
        d = (a - b).abs().max().item()
        return d, d / max(b.abs().max().item(), 1e-30)

    res["out"] = err(y, yr)
    res["state"] = err(s, sr)
    worst = max(((n,) + err(g[n], gr[n]) for n in gr), key=lambda t: t[2])
    res["grad"] = worst[1:]
    res["grad_param"] = worst[0]
    # packed sequences (B = 1, three segments)
    cu = torch.tensor([0, T // 3, T // 3 + 7, T], device=dev)
    xp = x[:1]
    yp, _, _ = run(m, xp, cu_seqlens=cu)
    ypr, _, _ = run(ref, xp.double(), cu_seqlens=cu)
    res["varlen_out"] = err(yp, ypr)
    return res


def section_correctness(dev, smoke, report, heads=8):
    B, T, D, H = (2, 40, 32, 2) if smoke else (2, 1000, 512, heads)
    fast = "fla" if dev.type == "cuda" else "recurrent"
    rows, data = [], {}
    for name in VARIANTS:
        log(f"correctness: {name} (B={B} T={T} D={D} H={H}, {fast} vs chunk float64)")
        r = check_variant(name, dev, B, T, D, H, fast)
        data[name] = r
        f = lambda p: f"{p[0]:.2e} / {p[1]:.2e}"  # noqa: E731
        rows.append([name, f(r["out"]), f(r["state"]), f(r["grad"]) + f" ({r['grad_param']})", f(r["varlen_out"])])
    report.append(f"## 1. CUDA path ({fast}, float32) vs torch chunk reference (float64)\n\n"
                  f"Layer B={B} T={T} D={D} H={H} (K=V={D // H}); max abs / max relative error.\n")
    report.append(md_table(["variant", "output", "final state", "worst param grad", "varlen output"], rows))
    log("correctness: mla (sdpa vs reference float64)")
    data["mla"] = check_mla(dev, B, T, D, H)
    report.append(f"\nMLA (impl sdpa, float32) vs its reference path (float64), same shape: output "
                  f"{data['mla']['out'][0]:.2e} / {data['mla']['out'][1]:.2e}, worst param grad "
                  f"{data['mla']['grad'][0]:.2e} / {data['mla']['grad'][1]:.2e} ({data['mla']['grad_param']}).")
    return data


def check_mla(dev, B, T, D, H):
    """MLA layer: ``impl="sdpa"`` in float32 vs ``impl="reference"`` in float64 (output, parameter grads)."""
    torch.manual_seed(0)
    m = build_mixer("mla", d_model=D, n_heads=H, causal=True).to(dev)
    ref = copy.deepcopy(m).double()
    m.impl, ref.impl = "sdpa", "reference"
    x = torch.randn(B, T, D, device=dev)
    up = torch.randn(B, T, D, device=dev)

    def run(mod, xx):
        y = mod(xx)
        (y * up.to(y.dtype)).sum().backward()
        grads = {n: p.grad.detach().clone() for n, p in mod.named_parameters() if p.grad is not None}
        mod.zero_grad(set_to_none=True)
        return y.detach(), grads

    (y, g), (yr, gr) = run(m, x), run(ref, x.double())

    def err(a, b):
        d = (a.double() - b).abs().max().item()
        return d, d / max(b.abs().max().item(), 1e-30)

    worst = max(((n,) + err(g[n], gr[n]) for n in gr), key=lambda t: t[2])
    return {"out": err(y, yr), "grad": worst[1:], "grad_param": worst[0]}


# ---------------------------------------------------------------------------------- 2. fwd+bwd
def section_fwd_bwd(dev, smoke, report, skip=()):
    B, T, H, K = (1, 128, 2, 16) if smoke else (4, 4096, 16, 128)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    impl = "fla" if dev.type == "cuda" else "chunk"
    torch.manual_seed(0)
    mk = lambda *s: torch.randn(*s, device=dev, dtype=dt).requires_grad_()  # noqa: E731
    q, k, v = mk(B, T, H, K), mk(B, T, H, K), mk(B, T, H, K)
    g = (-torch.rand(B, T, H, K, device=dev) * 0.1).requires_grad_()
    gs = (-torch.rand(B, T, H, device=dev) * 0.1).requires_grad_()
    bl, blk, blv = mk(B, T, H), mk(B, T, H, K), mk(B, T, H, K)
    compiled_prep = torch.compile(fg2_gate_prep_torch) if dev.type == "cuda" else fg2_gate_prep_torch

    def backward(o):
        o.float().square().mean().backward()

    def raw_kda():
        if dev.type == "cuda":
            from fla.ops.kda import chunk_kda
            o, _ = chunk_kda(q, k, v, g, torch.sigmoid(bl), use_qk_l2norm_in_kernel=True)
        else:
            o, _ = delta_rule(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, g, torch.sigmoid(bl), impl=impl)
        backward(o)

    def kda():
        o, _ = delta_rule(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, g, torch.sigmoid(bl).to(dt), impl=impl)
        backward(o)

    def gdn():
        o, _ = delta_rule(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, gs, torch.sigmoid(bl).to(dt), impl=impl)
        backward(o)

    def fg2(prep, sep=False):
        def f():
            kt, vt = prep(k, v, blk, blv if sep else None)
            o, _ = delta_rule(F.normalize(q, dim=-1), kt, vt, g, None, impl=impl)
            backward(o)
        return f

    fused = lambda *a: fg2_gate_prep(*a, impl="triton" if dev.type == "cuda" else "torch")  # noqa: E731
    cases = [("raw chunk_kda (l2norm in kernel)", raw_kda), ("KDA", kda), ("GDN (chunk_kda, broadcast gate)", gdn),
             ("FG²-GDN, fused gate prep", fg2(fused)), ("FG²-GDN, eager gate prep", fg2(fg2_gate_prep_torch)),
             ("FG²-GDN+, fused gate prep", fg2(fused, True)),
             ("FG²-GDN+, eager gate prep", fg2(fg2_gate_prep_torch, True))]
    if "compile" not in skip:
        cases.append(("FG²-GDN, compiled gate prep", fg2(compiled_prep)))
    times = {}
    for name, fn in cases:
        log(f"fwd+bwd op: {name} (B={B} T={T} H={H} K={K})")
        try:
            times[name] = timeit(fn, dev, warmup=2 if smoke else WARMUP, iters=3 if smoke else ITERS)
            log(f"  {times[name]:.3f} ms")
        except Exception as e:  # report, keep going
            times[name] = float("nan")
            print(f"[fwd+bwd] {name}: {type(e).__name__}: {e}", file=sys.stderr)
    anchor, raw = times["KDA"], times["raw chunk_kda (l2norm in kernel)"]
    rows = [[n, f"{t:.3f}", f"{t / anchor:.3f}", f"{t / raw:.3f}"] for n, t in times.items()]
    report.append(f"\n## 2. fwd+bwd, op level (gate prep + kernel), B={B} T={T} H={H} K=V={K} {str(dt)[6:]}\n\n"
                  "Anchor: KDA (normalize q, k in torch + chunk_kda) in this run. Goals: FG²-GDN <= 1.03x, "
                  "FG²-GDN+ <= 1.06x.\n")
    report.append(md_table(["case", "ms", "x KDA", "x raw chunk_kda"], rows))

    # layer level: full mixers with projections, D = H * K
    D = H * K
    x = torch.randn(B, T, D, device=dev, dtype=dt)
    ltimes = {}
    for name in ["kda", "fg2gdn", "fg2gdn_plus", "gdn"]:
        log(f"fwd+bwd layer: {name} (D={D})")
        torch.manual_seed(0)
        m = build_mixer(name, d_model=D, n_heads=H, causal=True, impl=impl).to(dev, dt)

        def step(m=m):
            m(x).float().square().mean().backward()
        try:
            ltimes[name] = timeit(step, dev, warmup=2 if smoke else WARMUP, iters=3 if smoke else ITERS)
            log(f"  {ltimes[name]:.3f} ms")
        except Exception as e:
            ltimes[name] = float("nan")
            print(f"[layer] {name}: {type(e).__name__}: {e}", file=sys.stderr)
        del m
    rows = [[n, f"{t:.3f}", f"{t / ltimes['kda']:.3f}", f"{t / raw:.3f}"] for n, t in ltimes.items()]
    report.append(f"\n### fwd+bwd, full mixer layers (projections, conv, gates, gated norm), D={D}\n")
    report.append(md_table(["layer", "ms", "x KDA layer", "x raw chunk_kda"], rows))
    return {"op_ms": times, "layer_ms": ltimes}


# ---------------------------------------------------------------------------------- 3. prefill
def section_prefill(dev, smoke, report, out):
    H, K = (2, 16) if smoke else (16, 128)
    D = H * K
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    total = 2048 if smoke else 32768
    lengths = [256, 512, 1024] if smoke else [2048, 4096, 8192, 16384, 32768]
    impl = "fla" if dev.type == "cuda" else "chunk"
    layers = {n: build_mixer(n, d_model=D, n_heads=H, causal=True, impl=impl).to(dev, dt).eval()
              for n in ["gdn", "kda", "fg2gdn", "fg2gdn_plus"]}
    layers["flash attention"] = build_mixer("rope", d_model=D, n_heads=H, causal=True).to(dev, dt).eval()
    tput: dict[str, dict[int, float]] = {n: {} for n in layers}
    for T in lengths:
        B = max(1, total // T)
        x = torch.randn(B, T, D, device=dev, dtype=dt)
        for n, m in layers.items():
            log(f"prefill: {n} T={T} B={B}")

            def fwd(m=m, n=n):
                with torch.no_grad():
                    if n == "flash attention" and dev.type == "cuda":
                        from torch.nn.attention import SDPBackend, sdpa_kernel
                        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                            m(x)
                    else:
                        m(x)
            try:
                ms = timeit(fwd, dev, warmup=1 if smoke else WARMUP, iters=2 if smoke else ITERS)
                tput[n][T] = B * T / ms * 1e3
                log(f"  {ms:.3f} ms, {tput[n][T] / 1e6:.3f} M tokens/s")
            except Exception as e:
                tput[n][T] = float("nan")
                print(f"[prefill] {n} T={T}: {type(e).__name__}: {e}", file=sys.stderr)
        x = None  # release it (the fwd closure holds the name)
    header = ["layer"] + [f"{T // 1024}K" if T >= 1024 else str(T) for T in lengths]
    rows = [[n] + [f"{tput[n][T] / 1e6:.2f}" for T in lengths] for n in layers]
    report.append(f"\n## 3. Prefill throughput (M tokens/s, forward only, {total} tokens per call, "
                  f"H={H} K=V={K} D={D} {str(dt)[6:]})\n")
    report.append(md_table(header, rows))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        for n in layers:
            ax.plot(lengths, [tput[n][T] / 1e6 for T in lengths], marker="o", label=n)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel("prefill throughput (M tokens/s)")
        ax.set_title(f"Prefill, {total} tokens per call, {str(dt)[6:]}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "prefill.png", dpi=150)
        report.append(f"\n![prefill throughput]({(out / 'prefill.png').name})\n")
    except Exception as e:  # pragma: no cover
        print(f"[prefill] plot failed: {e}", file=sys.stderr)
    return {n: {str(T): v for T, v in d.items()} for n, d in tput.items()}


def main(argv: list[str] | None = None) -> None:
    ap = OneLineParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out/recurrent", help="output directory (tables, JSON, PNG)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (checks the script; runs on CPU)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["correctness", "fwd_bwd", "prefill", "compile"],
                    help="sections to leave out; 'compile' drops the torch.compile gate-prep row")
    ap.add_argument("--heads", type=int, default=8,
                    help="correctness: heads of the D=512 layer (K=V=512/heads). fla's float32 backward kernels "
                         "need more shared memory than an H200 has at K=V=128; K=V=64 fits")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per case (after autotuning)")
    ap.add_argument("--iters", type=int, default=10, help="timed calls per case (median reported)")
    ap.add_argument("--fla-max-configs", type=int, default=3,
                    help="autotune each fla kernel over at most N configs (0: fla's full search; "
                         "mixlab.ops.fla.limit_autotune)")
    args = ap.parse_args(argv)
    ap.check_output("--out", args.out, folder=True)
    global WARMUP, ITERS
    WARMUP, ITERS = args.warmup, args.iters
    dev = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if dev.type == "cuda":
        from mixlab.ops.fla import limit_autotune
        print(f"fla autotuners limited to {args.fla_max_configs} configs: {limit_autotune(args.fla_max_configs)}",
              flush=True)
    env = f"torch {torch.__version__}, device {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}"
    try:
        import triton
        env += f", triton {triton.__version__}"
    except Exception:
        pass
    try:
        from importlib.metadata import version
        env += f", fla-core {version('fla-core')}"
    except Exception:
        pass
    report = [f"# bench_recurrent ({env})\n"]
    data = {"env": env}
    log(env)

    def save():
        (out / "bench_recurrent.md").write_text("\n".join(report) + "\n")
        (out / "bench_recurrent.json").write_text(json.dumps(data, indent=1, default=str))

    for name, fn in (("correctness", lambda: section_correctness(dev, args.smoke, report, args.heads)),
                     ("fwd_bwd", lambda: section_fwd_bwd(dev, args.smoke, report, args.skip)),
                     ("prefill_tokens_per_s", lambda: section_prefill(dev, args.smoke, report, out))):
        if name.split("_tokens")[0] in args.skip:
            continue
        log(f"section {name}")
        data[name] = fn()
        save()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print("\n".join(report) + "\n", flush=True)


if __name__ == "__main__":
    main()
