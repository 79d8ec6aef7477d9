"""Which shapes and dtypes fla-core's kernels serve, through mixlab's boundary (``mixlab.ops.fla``).

    python scripts/probe_fla.py --out OUT                 # CUDA: every op x dtype x head dim x (B, T)
    python scripts/probe_fla.py --out OUT --ops mesa --dtypes bfloat16 --dims 32 --shapes 128x127

For each op (``kda``: :func:`mixlab.ops.delta_rule.delta_rule` with channel-wise decay and
beta in [0, 2); ``gla``: :func:`mixlab.ops.gla.gla`; ``mesa``: :func:`mixlab.ops.mesa.mesa_net`,
30 fixed CG iterations), input dtype (float32, bfloat16, float16, and ``mixed``: q, k float32
next to a bfloat16 v, as autocast hands them over), head dim K = V and batch x length, the
fast path (``impl="fla"``) runs forward and backward on inputs with correlated keys, and the
float64 torch path on the same (rounded) inputs is the reference. Reported per case: ``ok``
with the output's and the worst gradient's error relative to the largest reference entry, or
the error's type and first line. Each (op, dtype) runs in its own process, so an illegal
memory access ends one process only and is reported at the case that caused it (``crash``).
Writes ``OUT/probe_fla.md`` (one table) and ``OUT/probe_fla.jsonl``. ``--raw`` bypasses
:func:`mixlab.ops.fla.unserved` (the routing rules this probe measured), to re-check a kernel's
own limits on a new fla or Triton version.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from mixlab.eval.common import OneLineParser

DTYPES = ("float32", "bfloat16", "float16", "mixed")
OPS = ("kda", "gla", "mesa")


def _inputs(op: str, b: int, t: int, k_dim: int, seed: int = 0):
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    h = 2
    u = F.normalize(r(k_dim), dim=0)
    k = F.normalize(u + 0.5 * r(b, t, h, k_dim), dim=-1)
    q = F.normalize(r(b, t, h, k_dim), dim=-1) if op == "mesa" else r(b, t, h, k_dim)
    v = r(b, t, h, k_dim)
    if op == "kda":
        g = -0.2 * torch.rand(b, t, h, k_dim, generator=gen, dtype=torch.float64)
        beta = 2.0 * torch.rand(b, t, h, generator=gen, dtype=torch.float64)
        return [q, k, v, g, beta]
    if op == "gla":
        return [q, k, v, -0.2 * torch.rand(b, t, h, k_dim, generator=gen, dtype=torch.float64)]
    g = -0.2 * torch.rand(b, t, h, generator=gen, dtype=torch.float64)
    beta = torch.rand(b, t, h, generator=gen, dtype=torch.float64)
    lamb = 0.25 + torch.rand(h, k_dim, generator=gen, dtype=torch.float64)
    return [q, k, v, g, beta, lamb]


def _run(op: str, xs, impl: str):
    from mixlab.ops.delta_rule import delta_rule
    from mixlab.ops.gla import gla
    from mixlab.ops.mesa import mesa_net

    if op == "kda":
        return delta_rule(*xs, output_final_state=True, impl=impl)
    if op == "gla":
        return gla(*xs, impl=impl)
    o, st, _ = mesa_net(*xs, cg_iters=30, output_final_state=True, impl="fla" if impl == "fla" else "chunk")
    return o, st[1]


def _cast(op: str, xs, dtype: str, device):
    import torch

    act = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "mixed": torch.bfloat16}[dtype]
    out = []
    for i, x in enumerate(xs):
        gate = i >= 3  # g, beta, lamb stay float32 (as the mixers compute them)
        want = torch.float32 if gate or (dtype == "mixed" and i < 2) else act
        out.append(x.to(device=device, dtype=want))
    return out


def worker(op: str, dtype: str, dims: list[int], shapes: list[tuple[int, int]]) -> None:
    """One process: every (K, B, T) case of one op and dtype; one JSON line per case."""
    import torch

    if os.environ.get("PROBE_RAW") == "1":  # the kernels themselves, past mixlab's routing rules
        import mixlab.ops.fla as fla

        fla.unserved = lambda *a: None
    device = torch.device("cuda")
    for k_dim in dims:
        for b, t in shapes:
            case = {"op": op, "dtype": dtype, "K": k_dim, "B": b, "T": t}
            print("START " + json.dumps(case), flush=True)
            try:
                xs = _cast(op, _inputs(op, b, t, k_dim), dtype, device)
                leaves = [x.clone().requires_grad_() for x in xs]
                o, s = _run(op, leaves, "fla")
                gen = torch.Generator(device="cpu").manual_seed(1)
                wo = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(device)
                ws = torch.randn(s.shape, generator=gen, dtype=torch.float64).to(device)
                ((o.double() * wo).sum() + (s.double() * ws).sum()).backward()
                torch.cuda.synchronize()
                ref_leaves = [x.detach().double().requires_grad_() for x in xs]
                ro, rs = _run(op, ref_leaves, "chunk")
                ((ro * wo).sum() + (rs * ws).sum()).backward()
                rel = lambda a, r: float((a.double() - r).abs().max() / r.abs().max().clamp_min(1e-30))  # noqa: E731
                grads = [rel(a.grad, r.grad) for a, r in zip(leaves, ref_leaves) if r.grad is not None]
                outs = [o, s] + [x.grad for x in leaves if x.grad is not None]
                finite = all(bool(torch.isfinite(z).all()) for z in outs)
                case.update(status="ok" if finite else "nonfinite", out=rel(o, ro), state=rel(s, rs), grad=max(grads))
            except Exception as e:  # noqa: BLE001 - the table reports every failure kind
                first = (str(e).strip().splitlines() or [""])[0][:160]
                case.update(status="error", error=f"{type(e).__name__}: {first}")
                if "illegal memory access" in str(e) or "CUDA error" in str(e):
                    print("RESULT " + json.dumps(case), flush=True)
                    return
            print("RESULT " + json.dumps(case), flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    ap.add_argument("--dims", nargs="+", type=int, default=[8, 16, 32, 64, 128, 256])
    ap.add_argument("--shapes", nargs="+", default=["2x1", "2x63", "2x127", "2x200", "128x127", "4x2048"],
                    help="BxT cases")
    ap.add_argument("--raw", action="store_true", help="skip mixlab.ops.fla.unserved (probe the kernels' own limits)")
    ap.add_argument("--worker", nargs=2, metavar=("OP", "DTYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    ap.check_output("--out", args.out, folder=True)
    shapes = [tuple(int(z) for z in s.split("x")) for s in args.shapes]
    if args.worker:
        worker(*args.worker, args.dims, shapes)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    procs = {}
    for op in args.ops:
        for dtype in args.dtypes:
            cmd = [sys.executable, __file__, "--out", str(out), "--worker", op, dtype, "--dims", *map(str, args.dims),
                   "--shapes", *args.shapes]
            procs[(op, dtype)] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                                  env={**os.environ, "CUDA_LAUNCH_BLOCKING": "1",
                                                       "PROBE_RAW": "1" if args.raw else "0"})
    rows = []
    for (op, dtype), p in procs.items():
        text, _ = p.communicate()
        started = None
        for line in text.splitlines():
            if line.startswith("START "):
                started = json.loads(line[6:])
            elif line.startswith("RESULT "):
                rows.append(json.loads(line[7:]))
                started = None
        if started is not None:  # the process died inside this case
            tail = [ln for ln in text.splitlines() if ln.strip()][-3:]
            rows.append({**started, "status": "crash", "error": " | ".join(tail)[:200]})
        print(f"[probe_fla {time.perf_counter() - t0:6.1f}s] {op} {dtype}: exit {p.returncode}", flush=True)
    with open(out / "probe_fla.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    lines = ["| op | dtype | K | B x T | status | out err | state err | grad err | error |", "|" + "---|" * 9]
    for r in rows:
        fmt = lambda x: f"{x:.1e}" if isinstance(x, float) else ""  # noqa: E731
        lines.append(f"| {r['op']} | {r['dtype']} | {r['K']} | {r['B']}x{r['T']} | {r['status']} | {fmt(r.get('out'))} "
                     f"| {fmt(r.get('state'))} | {fmt(r.get('grad'))} | {r.get('error', '')} |")
    (out / "probe_fla.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
