"""Every registered mixer with a CUDA fast path, checked against its torch reference on the device.

    python scripts/check_gpu_paths.py --out OUT            # CUDA: fast path in float32 and bfloat16
    python scripts/check_gpu_paths.py --out /tmp/c --smoke # CPU: tiny shapes, impl "auto" (checks the script)

For each mixer in :func:`mixlab.registry.list_mixers` that has a fast path (table ``PATHS``:
fla-core kernels for the delta-rule family, Hawk, GLA, Mamba2 and Mesa; FlexAttention for
SWA; SDPA (+ Triton GOAT lanes) for the attention mixers and MLA) the layer runs
``x [B, T, D] -> y`` and a backward of ``sum(y * u)`` twice:

* fast: the module in float32 or bfloat16 with the fast ``impl``;
* reference: a float64 copy of the same (already rounded) parameters and input, torch path.

Reported per mixer and dtype (Markdown table to stdout and ``OUT/check_gpu_paths.md``, JSON
beside it): max abs error of the output and its relative size (max abs error / max |ref|),
and the same for the worst parameter gradient (named). Mesa runs in training mode (30 fixed
CG iterations: fla ``chunk_mesa_net`` casts q, k to fp16 and floors CG denominators at 1e-5).

Defaults checked (the mixers' ``impl="auto"`` on CUDA): Hawk runs the torch chunked scan
(``mixlab.ops.scan.linear_scan_chunk``) against the float64 token loop - fla ``chunk_hgrn``
failed this check on fla-core 0.6.0 + Triton 3.6 (H200); re-check it with ``--fast-impl
hawk=fla``. Mamba2's ``fla`` path is fla ``chunk_gla`` with the per-head gate broadcast over the
state dim (``chunk_simple_gla``'s backward fails on Hopper + Triton 3.6, fla #640; opt-in
``--fast-impl mamba2=fla_simple``).
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

import torch

from mixlab.eval.common import OneLineParser
from mixlab.registry import build_mixer, list_mixers

# name -> (fast impl, reference impl); lane_impl for GOAT is set alongside (triton / torch)
_DELTA = ("fla", "chunk")
PATHS: dict[str, tuple[str, str]] = {  # checked in this order
    "hawk": ("auto", "loop"), "gla": ("fla", "chunk"), "mamba2": ("fla", "chunk"), "swa": ("flex", "mask"),
    "mesa": ("fla", "chunk"),
    "deltanet": _DELTA, "gdn": _DELTA, "kda": _DELTA, "fg2gdn": _DELTA, "fg2gdn_plus": _DELTA,
    "fgbgdn": _DELTA, "kda_kvbeta": _DELTA,
    "rope": ("sdpa", "reference"), "alibi": ("sdpa", "reference"), "nope": ("sdpa", "reference"),
    "goat": ("sdpa", "reference"), "mla": ("sdpa", "reference"),
}
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[check_gpu_paths {time.perf_counter() - _T0:6.1f}s] {msg}", flush=True)


def _set_impl(m: torch.nn.Module, impl: str, lane_impl: str) -> None:
    for mod in m.modules():
        if hasattr(mod, "impl") and isinstance(mod.impl, str):
            mod.impl = impl
        if hasattr(mod, "lane_impl"):
            mod.lane_impl = lane_impl


def _err(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = (a.double() - b.double()).abs().max().item()
    return d, d / max(b.double().abs().max().item(), 1e-30)


def check(name: str, dev: torch.device, dtype: torch.dtype, B: int, T: int, D: int, H: int, smoke: bool,
          fast_impl: str | None = None) -> dict:
    """Fast path (``dtype``) vs float64 reference for mixer ``name``; errors of output and worst param grad.
    ``fast_impl`` overrides the ``PATHS`` fast impl (on CUDA)."""
    fast, ref_impl = PATHS[name]
    fast = fast_impl or fast
    if dev.type != "cuda":  # CPU smoke: the dispatching default stands in for the fast path
        fast = "auto" if name not in ("rope", "alibi", "nope", "goat", "mla") else "sdpa"
    torch.manual_seed(0)
    m = build_mixer(name, d_model=D, n_heads=H, causal=True).to(dev)
    with torch.no_grad():  # non-trivial gates / biases (zero-initialised ones would hide errors)
        for n, p in m.named_parameters():
            if p.dim() == 1 and n.endswith("bias"):
                p.normal_(0, 0.5)
    m = m.to(dtype).train()
    ref = copy.deepcopy(m).double()
    _set_impl(m, fast, "triton" if dev.type == "cuda" else "torch")
    _set_impl(ref, ref_impl, "torch")
    x = torch.randn(B, T, D, device=dev).to(dtype)
    u = torch.randn(B, T, D, device=dev).to(dtype)

    def run(mod, xx):
        y = mod(xx)
        (y.double() * u.double()).sum().backward()
        g = {n: p.grad.detach().clone() for n, p in mod.named_parameters() if p.grad is not None}
        return y.detach(), g

    y, g = run(m, x)
    yr, gr = run(ref, x.double())
    missing = sorted(set(gr) - set(g))
    worst = max(((n,) + _err(g[n], gr[n]) for n in gr if n in g), key=lambda t: t[2])
    return {"fast": fast, "ref": ref_impl, "out": _err(y, yr), "grad": worst[1:], "grad_param": worst[0],
            "missing_grads": missing, "finite": bool(torch.isfinite(y).all())}


def main(argv: list[str] | None = None) -> None:
    ap = OneLineParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out/gpu_paths")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check of the script)")
    ap.add_argument("--mixers", nargs="*", default=None, help="subset of mixer names (default: all in PATHS)")
    ap.add_argument("--heads", type=int, default=4,
                    help="heads of the D=512 layer (K=V=512/heads); fla's float32 Mesa/KDA backward kernels need "
                         "K=V <= 64 (--heads 8) on an H200's shared memory")
    ap.add_argument("--fla-max-configs", type=int, default=3,
                    help="autotune each fla kernel over at most N configs (0: fla's full search; "
                         "mixlab.ops.fla.limit_autotune)")
    ap.add_argument("--fast-impl", nargs="*", default=[], metavar="MIXER=IMPL",
                    help="override a fast impl, e.g. hawk=fla (opt-in fla chunk_hgrn) or mamba2=fla_simple")
    args = ap.parse_args(argv)
    ap.check_output("--out", args.out, folder=True)
    if any("=" not in kv for kv in args.fast_impl):
        ap.error(f"--fast-impl: expected MIXER=IMPL items; got {args.fast_impl}")
    overrides = dict(kv.split("=", 1) for kv in args.fast_impl)
    bad = [k for k in overrides if k not in PATHS]
    if bad:
        ap.error(f"--fast-impl: unknown mixer(s) {bad}; known: {sorted(PATHS)}")
    dev = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if dev.type == "cuda":
        from mixlab.ops.fla import limit_autotune
        print(f"fla autotuners limited to {args.fla_max_configs} configs: {limit_autotune(args.fla_max_configs)}",
              flush=True)
    B, T, D, H = (1, 48, 64, 2) if args.smoke else (2, 1000, 512, args.heads)
    names = [n for n in PATHS if n in list_mixers() and (args.mixers is None or n in args.mixers)]
    unknown = [n for n in list_mixers() if n not in PATHS]
    dtypes = [torch.float32, torch.bfloat16] if dev.type == "cuda" else [torch.float32]
    env = f"torch {torch.__version__}, {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}"
    try:
        from importlib.metadata import version
        env += f", fla-core {version('fla-core')}"
    except Exception:  # noqa: BLE001
        pass
    log(env)
    rows, data = [], {"env": env, "shape": dict(B=B, T=T, D=D, H=H), "results": {}}
    for name in names:
        for dt in dtypes:
            log(f"{name} {str(dt)[6:]}")
            try:
                r = check(name, dev, dt, B, T, D, H, args.smoke, overrides.get(name))
            except Exception as e:  # noqa: BLE001  (report, keep going)
                print(f"[check_gpu_paths] {name} {dt}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                r = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
            data["results"][f"{name}/{str(dt)[6:]}"] = r
            if "error" in r:
                rows.append([name, str(dt)[6:], "-", "FAILED", r["error"], "", ""])
            else:
                f = lambda p: f"{p[0]:.2e} / {p[1]:.2e}"  # noqa: E731
                note = "" if not r["missing_grads"] else f"no grad on fast path: {', '.join(r['missing_grads'])}"
                rows.append([name, str(dt)[6:], f"{r['fast']} vs {r['ref']} (float64)", f(r["out"]),
                             f(r["grad"]) + f" ({r['grad_param']})", "yes" if r["finite"] else "NO", note])
            (out / "check_gpu_paths.json").write_text(json.dumps(data, indent=1, default=str))
            text = _report(env, B, T, D, H, unknown, rows)  # rewritten per row: a cut run keeps what it did
            (out / "check_gpu_paths.md").write_text(text)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print(text, flush=True)


def _report(env, B, T, D, H, unknown, rows) -> str:
    hdr = ["mixer", "dtype", "paths", "output max abs / rel", "worst param grad max abs / rel", "finite", "note"]
    table = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)] + ["| " + " | ".join(r) + " |" for r in rows]
    return (f"# Fast path vs torch reference ({env})\n\nLayer B={B} T={T} D={D} H={H}; relative = max abs error / "
            f"max |reference|. Mixers without a fast path: {', '.join(unknown) or 'none'}.\n\n"
            + "\n".join(table) + "\n")


if __name__ == "__main__":
    main()
