"""MesaNet benchmarks on one CUDA GPU (ratios against anchors measured in the same run).

    python scripts/bench_mesa.py --out out/bench_mesa            # H200: everything (~5-8 min)
    python scripts/bench_mesa.py --out out/bench_mesa --quick    # small shapes, smoke test
    python scripts/bench_mesa.py --out /tmp/b --quick --device cpu   # CPU smoke test (no fla rows)

Sections (``--sections``, comma-separated; Markdown tables printed and written to ``<out>/bench_mesa.md``;
decode plot to ``<out>/decode_tokens_per_s.png``):

0. ``breakdown``: the adaptive Triton prefill's pieces (chunk statistics in torch and with the Triton
   chunk-state scan, the CG kernel per launch configuration of ``MIXLAB_MESA_CG``, the read-out)
   against fla's whole fixed-30 call.
1. Training op: ``mixlab.ops.mesa.mesa_net`` at 30 CG, fwd+bwd, B4 T4096 H16 K=V=128 bf16,
   against the raw fla-core ``chunk_mesa_net`` call (anchor; goal ratio <= 1.05). The torch
   chunkwise path and the Triton CG path (fixed 30 and adaptive; goal: adaptive no slower than
   fixed 30) are listed beside it.
2. Inference (no grad), two gate regimes: fla at 30 fixed CG (anchor), torch chunk and the
   Triton CG kernel (``impl="triton"``, CUDA only) at 30 fixed and adaptive eps = 1e-4 (cap 30):
   mean/max CG iterations, prefill time and
   speed-up (goal >= 2x), output relative error vs the exact solve (float64
   ``torch.linalg.solve`` on batch 0, first heads; goal <= 1e-3) on the solver's float32
   output (same rounded inputs cast to float32), beside the error of the timed bf16 output
   and the bf16 rounding floor (exact solve rounded to bf16, ~1.6e-3, hides solver error).
   fla's own error vs the exact solve documents its fp16 q/k and 1e-5 CG-denominator floor.
3. Decode tokens/s vs generated length, batch 8, a 4-layer d_model 1536 / 12-head backbone
   per mixer with caches: attention (``rope``, KV cache), Mesa (adaptive 1e-4 and fixed 30),
   GDN and KDA when those mixers are registered. For each length L (128 .. 2048) the caches
   are filled by one parallel forward over the first L - n tokens (the mixers' cache API),
   then ``--decode-steps`` n = 32 single-token steps (4 untimed, the rest timed) end at L:
   tokens/s = batch x timed steps / time. Every step feeds the previous output back.

    python scripts/bench_mesa.py --out out/bench_mesa --sections decode   # decode only (~1 min)
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
import traceback

import torch
import torch.nn.functional as F

from mixlab.backbone import Backbone, BackboneConfig
from mixlab.eval.common import OneLineParser
from mixlab.ops.mesa import mesa_exact, mesa_net
from mixlab.registry import list_mixers


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device, warmup: int = 2, reps: int = 5) -> float:
    """Median wall time of ``fn()`` in ms (synchronised)."""
    for _ in range(warmup):
        fn()
    sync(dev)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(dev)
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def make_inputs(b, t, h, d, dev, dtype, regime: str, seed: int = 0, requires_grad: bool = False):
    g0 = torch.Generator(device="cpu").manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g0).to(dev)
    q = F.normalize(rn(b, t, h, d), dim=-1).to(dtype)
    k = F.normalize(rn(b, t, h, d), dim=-1).to(dtype)
    v = rn(b, t, h, d).to(dtype)
    shift = 0.0 if regime == "standard" else 4.0  # "long memory": forget gates ~ sigmoid(4) = 0.98
    g = F.logsigmoid(rn(b, t, h) + shift).float()
    beta = torch.sigmoid(rn(b, t, h)).float()
    lamb = (F.softplus(torch.rand(h, d, generator=g0)) + 0.25).float().to(dev)
    ins = [q, k, v, g, beta, lamb]
    if requires_grad:
        ins = [z.detach().requires_grad_(True) for z in ins]
    return ins


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def md_table(header: list[str], rows: list[list]) -> str:
    def fmt(x):
        if isinstance(x, float):
            return f"{x:.3g}" if (abs(x) < 1e-2 or abs(x) >= 1e4) and x != 0 else f"{x:.3f}"
        return str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- 0. prefill pieces
CG_CONFIGS = ["bc=32,warps=8,hold=1,prec=fp16x3", "bc=32,warps=8,hold=1,prec=fp16", "bc=64,warps=8,hold=1,prec=fp16",
              "bc=32,warps=4,hold=1,prec=fp16", "bc=16,warps=4,hold=1,prec=fp16", "bc=64,warps=8,hold=1,prec=fp16x3",
              "bc=16,warps=4,hold=0,prec=tf32x3", "bc=16,warps=4,hold=0,prec=ieee"]
STATES_CONFIGS = ["bk=64,bx=64,warps=4,stages=3", "bk=64,bx=64,warps=4,stages=1", "bk=32,bx=64,warps=4,stages=3"]


@torch.no_grad()
def bench_breakdown(dev, shape, reps) -> str:
    """Where the adaptive Triton prefill's time goes: chunk statistics (torch), the CG kernel per
    launch configuration (``MIXLAB_MESA_CG``), the read-out; fla's whole fixed-30 call as anchor."""
    from mixlab.ops import mesa as mo
    from mixlab.ops.mesa_triton import launch_config, mesa_cg_triton

    b, t, h, d = shape
    q, k, v, g, beta, lamb = make_inputs(b, t, h, d, dev, torch.float32, "standard")
    rows = []
    try:
        anchor = timed(lambda: mesa_net(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta, lamb, cg_iters=30,
                                        impl="fla"), dev, reps=reps)
        rows.append(["fla chunk_mesa_net, 30 fixed, bf16 (anchor)", "", anchor, 1.0])
    except Exception as e:  # noqa: BLE001
        anchor = float("nan")
        rows.append([f"fla failed: {type(e).__name__}: {str(e)[:80]}", "", anchor, anchor])
    ch = mo._Chunks(k, v, g, beta, None, 64)
    t_prep = timed(lambda: mo._Chunks(k, v, g, beta, None, 64), dev, reps=reps)
    rows.append(["chunk statistics (`_Chunks`, torch)", "", t_prep, t_prep / anchor])
    try:
        ch_t = mo._Chunks(k, v, g, beta, None, 64, states="triton")
        t_prep_t = timed(lambda: mo._Chunks(k, v, g, beta, None, 64, states="triton"), dev, reps=reps)
        rows.append(["chunk statistics, Triton chunk-state scan (`states='triton'`)",
                     f"H vs torch {rel_err(ch_t.H, ch.H):.1e}, G {rel_err(ch_t.G, ch.G):.1e}", t_prep_t,
                     t_prep_t / anchor])
        del ch_t
        saved_s = os.environ.get("MIXLAB_MESA_STATES")
        for scfg in STATES_CONFIGS:
            os.environ["MIXLAB_MESA_STATES"] = scfg
            try:
                ts = timed(lambda: mo._Chunks(k, v, g, beta, None, 64, states="triton"), dev, reps=reps)
                rows.append([f"chunk statistics, Triton scan {scfg}", "", ts, ts / anchor])
            except Exception as e:  # noqa: BLE001
                rows.append([f"Triton scan {scfg} failed: {type(e).__name__}: {str(e)[:80]}", "", float("nan"),
                             float("nan")])
        if saved_s is None:
            os.environ.pop("MIXLAB_MESA_STATES", None)
        else:
            os.environ["MIXLAB_MESA_STATES"] = saved_s
    except Exception as e:  # noqa: BLE001
        rows.append([f"Triton chunk-state scan failed: {type(e).__name__}: {str(e)[:80]}", "", float("nan"),
                     float("nan")])
    lam = mo._lamb_per_chunk(lamb, ch)
    rhs = ch.chunk_view(q)
    x_ref, it_ref = mo._chunk_cg(ch, lam, rhs, 30, 1e-4)
    saved = os.environ.get("MIXLAB_MESA_CG")
    for cfg in CG_CONFIGS:
        os.environ["MIXLAB_MESA_CG"] = cfg
        try:
            x, it = mesa_cg_triton(ch.H, ch.k, ch.D, ch.dq, lam, rhs, 30, 1e-4)
            tc = timed(lambda: mesa_cg_triton(ch.H, ch.k, ch.D, ch.dq, lam, rhs, 30, 1e-4), dev, reps=reps)
            t30 = timed(lambda: mesa_cg_triton(ch.H, ch.k, ch.D, ch.dq, lam, rhs, 30, None), dev, reps=reps)
            note = (f"mean iters {float(it.float().mean()):.2f}; x vs torch CG {rel_err(x, x_ref):.1e}; "
                    f"fixed 30: {t30:.3f} ms")
            rows.append([f"Triton CG adaptive 1e-4, {cfg}", note, tc, tc / anchor])
        except Exception as e:  # noqa: BLE001
            rows.append([f"Triton CG {cfg} failed: {type(e).__name__}: {str(e)[:80]}", "", float("nan"), float("nan")])
    if saved is None:
        os.environ.pop("MIXLAB_MESA_CG", None)
    else:
        os.environ["MIXLAB_MESA_CG"] = saved
    t_read = timed(lambda: mo._readout_kv(x_ref, ch.G, ch.k, ch.v, ch.D, ch.dq), dev, reps=reps)
    rows.append(["read-out (`_readout_kv`, torch)", "", t_read, t_read / anchor])
    for name, impl in (("impl=triton (default config " + str(launch_config(64, d)) + ")", "triton"),
                       ("impl=chunk (torch CG)", "chunk")):
        try:
            t_all = timed(lambda: mesa_net(q, k, v, g, beta, lamb, cg_iters=30, cg_eps=1e-4, impl=impl), dev,
                          reps=reps)
            rows.append([f"whole prefill, adaptive 1e-4, {name}", "", t_all, t_all / anchor])
        except Exception as e:  # noqa: BLE001
            rows.append([f"whole prefill {name} failed: {type(e).__name__}: {str(e)[:80]}", "", float("nan"),
                         float("nan")])
    title = f"### 0. Prefill pieces, B{b} T{t} H{h} K=V={d}, float32 inputs, chunk 64\n\n"
    return title + md_table(["piece", "note", "ms (median)", "x fla 30"], rows)


# ---------------------------------------------------------------------------- 1. training op
def bench_train(dev, shape, reps) -> str:
    b, t, h, d = shape
    rows = []
    ins = make_inputs(b, t, h, d, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32, "standard",
                      requires_grad=True)
    do = torch.randn(b, t, h, d, device=dev, dtype=ins[2].dtype)

    def step(fn):
        def run():
            for z in ins:
                z.grad = None
            o = fn()
            o.backward(do)
        return run

    anchor = None
    if dev.type == "cuda":
        from fla.ops.mesa_net import chunk_mesa_net

        anchor = timed(step(lambda: chunk_mesa_net(*ins, max_CG_iteration=30)[0]), dev, reps=reps)
        rows.append(["fla chunk_mesa_net (raw, anchor)", anchor, 1.0])
        ours = timed(step(lambda: mesa_net(*ins, cg_iters=30, impl="auto")[0]), dev, reps=reps)
        rows.append(["mixlab mesa_net impl=auto (-> fla)", ours, ours / anchor])
    try:
        tc = timed(step(lambda: mesa_net(*ins, cg_iters=30, impl="chunk")[0]), dev, warmup=1, reps=max(1, reps // 3))
        rows.append(["mixlab mesa_net impl=chunk (torch)", tc, tc / anchor if anchor else float("nan")])
    except Exception as e:  # noqa: BLE001  (e.g. out of memory at full size)
        rows.append([f"mixlab impl=chunk failed: {type(e).__name__}: {str(e)[:80]}", float("nan"), float("nan")])
    if dev.type == "cuda":
        for name, eps in (("30 fixed", None), ("adaptive eps=1e-4", 1e-4)):
            try:
                tt = timed(step(lambda e=eps: mesa_net(*ins, cg_iters=30, cg_eps=e, impl="triton")[0]), dev, reps=reps)
                rows.append([f"mixlab mesa_net impl=triton (Triton CG, {name})", tt, tt / anchor])
            except Exception as e:  # noqa: BLE001
                rows.append([f"mixlab impl=triton {name} failed: {type(e).__name__}: {str(e)[:80]}", float("nan"),
                             float("nan")])
    title = f"### 1. Mesa fwd+bwd, 30 CG, B{b} T{t} H{h} K=V={d} ({ins[0].dtype})\n\n"
    return (title + md_table(["implementation", "ms (median)", "ratio vs fla"], rows)
            + "\n\nGoal: mixlab impl=auto <= 1.05x fla.")


# ---------------------------------------------------------------------------- 2. inference
@torch.no_grad()
def bench_inference(dev, shape, reps, err_heads: int) -> str:
    """Prefill timing at the benchmark dtype (bf16 on CUDA); errors on batch 0 / ``err_heads`` heads
    against the float64 exact solve, measured twice: on the solver's float32 output (the same
    solver re-run on float32 copies of the same rounded inputs; mesa computes in float32 either
    way and only casts its output to v's dtype) and on the timed run's output in its dtype, whose
    rounding alone costs ~1.6e-3 in bf16 (the floor row: exact solve rounded to that dtype)."""
    b, t, h, d = shape
    out = []
    for regime in ("standard", "long memory"):
        ins = make_inputs(b, t, h, d, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32, regime, seed=1)
        odt = ins[2].dtype
        # exact reference on batch 0 and the first heads, float64, from the same (rounded) inputs
        sub = lambda z, hd=err_heads: z[:1, :, :hd] if z.dim() >= 3 else z[:hd]
        exact_in = [sub(z).double() for z in ins]
        f32_in = [sub(z).float() for z in ins]  # the same values in float32: solver error without output rounding
        o_ex, _ = mesa_exact(*exact_in)
        o_ex32, _ = mesa_exact(*f32_in)
        rows = []
        anchor = None
        nan = float("nan")
        if dev.type == "cuda":
            from fla.ops.mesa_net import chunk_mesa_net

            run = lambda: chunk_mesa_net(*ins, max_CG_iteration=30)[0]
            anchor = timed(run, dev, reps=reps)
            try:  # fla on float32 inputs (it still casts q, k to fp16 internally)
                e32 = rel_err(chunk_mesa_net(*f32_in, max_CG_iteration=30)[0], o_ex)
            except Exception as e:  # noqa: BLE001
                print(f"fla chunk_mesa_net on float32 inputs failed: {type(e).__name__}: {e}", flush=True)
                e32 = nan
            rows.append(["fla 30 fixed (anchor)", 30.0, 30, anchor, 1.0, nan, e32, rel_err(sub(run()), o_ex)])
        res = {}
        solvers = [("torch chunk 30 fixed", None, "chunk"), ("torch chunk adaptive eps=1e-4", 1e-4, "chunk")]
        if dev.type == "cuda":
            solvers += [("Triton CG 30 fixed", None, "triton"), ("Triton CG adaptive eps=1e-4", 1e-4, "triton")]
        for name, eps, impl in solvers:
            try:
                o, _, it = mesa_net(*ins, cg_iters=30, cg_eps=eps, impl=impl)
            except Exception as e:  # noqa: BLE001  (a kernel that does not build on this device)
                rows.append([f"{name} failed: {type(e).__name__}: {str(e)[:80]}"] + [nan] * 7)
                continue
            ms = timed(lambda: mesa_net(*ins, cg_iters=30, cg_eps=eps, impl=impl), dev, warmup=1, reps=reps)
            res[name] = ms
            o32 = mesa_net(*f32_in, cg_iters=30, cg_eps=eps, impl=impl)[0]
            rows.append([name, float(it.float().mean()), int(it.max()), ms,
                         anchor / ms if anchor else nan, res["torch chunk 30 fixed"] / ms,
                         rel_err(o32, o_ex), rel_err(sub(o), o_ex)])
        rows.append(["exact solve in fp32 (reference check)", nan, "-", nan, nan, nan, rel_err(o_ex32, o_ex), nan])
        rows.append([f"exact solve rounded to {str(odt)[6:]} (output-rounding floor)", nan, "-", nan, nan, nan, nan,
                     rel_err(o_ex.to(odt), o_ex)])
        hdr = ["solver", "mean CG iters", "max", "prefill ms", "speed-up vs fla-30", "speed-up vs torch-30",
               f"rel err, fp32 output (b0, {err_heads} heads)", f"rel err, {str(odt)[6:]} output (timed run)"]
        gate_note = "g = logsigmoid(N(0,1))" if regime == "standard" else "g = logsigmoid(N(4,1)), gates ~0.98"
        out.append(f"#### gates: {regime} ({gate_note})\n\n" + md_table(hdr, rows))
    title = f"### 2. Inference prefill, B{b} T{t} H{h} K=V={d}, adaptive CG vs 30 fixed\n\n"
    goals = ("\n\nGoals: adaptive speed-up >= 2x, rel err <= 1e-3 (judged on the fp32-output column: the solver's "
             "own error; the output-dtype column cannot go below the rounding floor row). Errors: relative "
             "Frobenius norm vs the float64 exact solve (torch.linalg.solve) from the same rounded inputs. "
             "fla casts q, k to fp16 and floors CG denominators at 1e-5.")
    return title + "\n\n".join(out) + goals


# ---------------------------------------------------------------------------- 3. decode
@torch.no_grad()
def bench_decode(dev, lengths: list[int], batch: int, d_model: int, n_layers: int, n_heads: int, out_dir: str,
                 steps: int = 32, warm: int = 4) -> str:
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    known = set(list_mixers())
    variants = [("attention (rope, KV cache)", "rope", {}),
                ("mesa adaptive eps=1e-4", "mesa", {"mesa": {"eval_cg_eps": 1e-4, "cg_iters": 30}}),
                ("mesa 30 fixed", "mesa", {"mesa": {"eval_cg_eps": None, "cg_iters": 30}})]
    for name in ("gdn", "kda"):
        if name in known:
            variants.append((name, name, {}))
    curves: dict[str, list[float]] = {}
    # the attention mixers decode without cuDNN SDPA (mixlab.mixers.attention.sdpa)
    for label, mixer, margs in variants:
        try:
            torch.manual_seed(0)
            cfg = BackboneConfig(d_model=d_model, n_layers=n_layers, n_heads=n_heads, mixer=mixer, mixer_args=margs)
            net = Backbone(cfg).to(dev, dtype).eval()
            tps = []
            for length in lengths:
                caches = [{} for _ in range(n_layers)]
                prompt = torch.randn(batch, length - steps, d_model, device=dev, dtype=dtype)
                x = net(prompt, None, caches)[:, -1:] * 0.5  # prefill: parallel forward filling the caches
                for i in range(steps):
                    if i == warm:
                        sync(dev)
                        t0 = time.perf_counter()
                    x = net(x, None, caches)[:, -1:] * 0.5  # feed a token-like vector back
                sync(dev)
                tps.append(batch * (steps - warm) / (time.perf_counter() - t0))
                print(f"[decode] {label} L={length}: {tps[-1]:.0f} tokens/s", flush=True)
                del caches, prompt
            curves[label] = tps
            del net
        except Exception as e:  # noqa: BLE001
            curves[label] = [float("nan")] * len(lengths)
            print(f"decode {label} failed: {type(e).__name__}: {e}")
            traceback.print_exc()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    anchor = curves[variants[0][0]]
    rows = []
    for label, tps in curves.items():
        rows.append([label] + [f"{v:.0f} ({v / a:.2f}x)" if math.isfinite(v) and a > 0 else "n/a"
                               for v, a in zip(tps, anchor)])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for label, tps in curves.items():
            ax.plot(lengths, tps, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("generated length (tokens)")
        ax.set_ylabel(f"decode tokens/s (batch {batch})")
        ax.set_title(f"{n_layers} layers, d_model {d_model}, {n_heads} heads, {dtype}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "decode_tokens_per_s.png"), dpi=120)
        plt.close(fig)
    except Exception as e:  # noqa: BLE001
        print(f"plot failed: {e}")
    title = (f"### 3. Decode tokens/s vs generated length (batch {batch}, {n_layers} layers, d_model {d_model}, "
             f"{n_heads} heads, {str(dtype)[6:]}; caches prefilled to L - {steps}, then {steps - warm} timed "
             f"single-token steps ending at L; SDPA without cuDNN while decoding; "
             f"ratio vs attention)\n\n")
    return title + md_table(["mixer"] + [str(n) for n in lengths], rows) + "\n\nPlot: decode_tokens_per_s.png"


def main() -> None:
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/bench_mesa")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small shapes (smoke test)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--sections", default="breakdown,train,inference,decode")
    ap.add_argument("--decode-steps", type=int, default=32, help="decoding steps per length (4 of them untimed)")
    ap.add_argument("--fla-max-configs", type=int, default=3,
                    help="autotune each fla kernel over at most N configs (0: fla's full search; "
                         "mixlab.ops.fla.limit_autotune)")
    args = ap.parse_args()
    ap.check_output("--out", args.out, folder=True)
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device(args.device)
    if dev.type == "cuda":
        from mixlab.ops.fla import limit_autotune
        print(f"fla autotuners limited to {args.fla_max_configs} configs: {limit_autotune(args.fla_max_configs)}",
              flush=True)
    if args.quick:
        shape, err_heads, lengths, dm, nl, nh, reps = (1, 256, 2, 32), 2, [16, 32, 64], 128, 2, 4, 2
    else:
        shape, err_heads, lengths, dm, nl, nh, reps = (4, 4096, 16, 128), 2, [128, 256, 512, 1024, 2048], \
            1536, 4, 12, args.reps
    parts = [f"## MesaNet benchmarks ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}, "
             f"torch {torch.__version__})"]
    sections = args.sections.split(",")
    for name, fn in (("breakdown", lambda: bench_breakdown(dev, shape, reps)),
                     ("train", lambda: bench_train(dev, shape, reps)),
                     ("inference", lambda: bench_inference(dev, shape, reps, err_heads)),
                     ("decode", lambda: bench_decode(dev, lengths, 8, dm, nl, nh, args.out,
                                                     steps=min(args.decode_steps, min(lengths) - 1)))):
        if name not in sections:
            continue
        if name == "breakdown" and dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            parts.append("### 0. Prefill pieces: skipped (the Triton kernels need CUDA, or TRITON_INTERPRET=1 on CPU)")
            print(parts[-1] + "\n", flush=True)
            continue
        try:
            text = fn()
        except Exception as e:  # noqa: BLE001  (keep the other sections)
            traceback.print_exc()
            text = f"### {name}: FAILED {type(e).__name__}: {e}"
        print(text + "\n", flush=True)
        parts.append(text)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "bench_mesa.md"), "w") as f:
        f.write("\n\n".join(parts) + "\n")
    print(f"wrote {os.path.join(args.out, 'bench_mesa.md')}")


if __name__ == "__main__":
    main()
