"""Decoding throughput of ``generate``: the dict-cache loop (anchor) against static caches, eager and as a
replayed CUDA graph (issue 17, item 5; :mod:`mixlab.eval.decode`).

For each dtype (float32, bfloat16) and mixer (goat, rope, nope, kda, mesa) one randomly initialised
:class:`~mixlab.heads.CausalLM` (batch 8, 4 layers, d_model 1536, head dim 128, GPT-2 vocabulary) decodes
a random 128-token prompt greedily for 256 new tokens by each path, in the same process::

    python scripts/bench_decode.py --out bench_out/decode          # on the GPU
    python scripts/bench_decode.py --compile --mixers rope kda     # adds the torch.compile'd step (+ CUDA graph)
    python scripts/bench_decode.py --quick --out /tmp/decode       # CPU, tiny model, < 30 s

Reported per row: decode tokens/s of each path (``batch * (new - 1)`` tokens over the time of ``new``
tokens minus the time of 1 token, i.e. prefill excluded; median of ``--repeats`` runs after one untimed
warm-up run per path), the ratio of each static path to the dict loop, and the fraction of generated
ids equal to the dict loop's (greedy; a random model's near-tied logits can flip an argmax between
kernels, after which the sequences differ: bfloat16 rows show it most). The Markdown table goes to
stdout and ``OUT/bench_decode.md`` (``--out`` a directory, or a path ending in ``.md``); progress to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import time
from pathlib import Path

import torch

from mixlab.backbone import BackboneConfig
from mixlab.eval.common import OneLineParser
from mixlab.eval.generate import generate
from mixlab.heads.lm import CausalLM

MIXERS = ["goat", "rope", "nope", "kda", "mesa"]
PATHS = {"dict": {"static": False}, "eager": {"static": True, "cuda_graph": False},
         "graph": {"static": True, "cuda_graph": True},
         "compiled": {"static": True, "cuda_graph": None, "compile_step": True}}  # --compile; graph on CUDA
TITLES = {"dict": "dict loop", "eager": "static eager", "graph": "CUDA graph", "compiled": "compiled step"}
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[bench_decode {time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def build(mixer: str, args: argparse.Namespace, dtype: torch.dtype, device: torch.device) -> CausalLM:
    torch.manual_seed(0)
    cfg = BackboneConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.d_model // args.head_dim,
                         mixer=mixer)
    return CausalLM(vocab_size=args.vocab, backbone=cfg).to(device=device, dtype=dtype).eval()


FAILED_CAPTURES: list[str] = []  # notes of generate calls whose CUDA graph capture fell back to eager steps


def timed(model: CausalLM, prompt: torch.Tensor, new: int, kw: dict) -> tuple[float, torch.Tensor]:
    """Seconds for one ``generate`` call (device synchronised) and its ids; a capture-failure note that
    ``generate`` writes to stderr is kept in :data:`FAILED_CAPTURES` (and still shown)."""
    if prompt.is_cuda:
        torch.cuda.synchronize()
    err = io.StringIO()
    t = time.perf_counter()
    with contextlib.redirect_stderr(err):
        ids = generate(model, prompt, new, temperature=0, **kw)
    if prompt.is_cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    if err.getvalue():
        sys.stderr.write(err.getvalue())
        FAILED_CAPTURES.extend(line for line in err.getvalue().splitlines() if "capture failed" in line)
    return dt, ids


def measure(model: CausalLM, prompt: torch.Tensor, new: int, kw: dict, repeats: int) -> tuple[float, torch.Tensor]:
    """Decode tokens/s (prefill excluded: time of ``new`` tokens minus time of 1) and the ids of ``new`` tokens."""
    _, ids = timed(model, prompt, new, kw)  # warm-up: Triton compilation, cuBLAS handles, graph pools
    timed(model, prompt, 1, kw)
    rates = []
    for _ in range(repeats):
        t_one = timed(model, prompt, 1, kw)[0]
        t_all, ids = timed(model, prompt, new, kw)
        rates.append(prompt.shape[0] * (new - 1) / max(t_all - t_one, 1e-9))
    return statistics.median(rates), ids


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def main(argv: list[str] | None = None) -> str:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="tiny model on CPU (checks the script, < 30 s on idle cores); replaces the shape, --prompt, "
                        "--new, --repeats and --device")
    p.add_argument("--mixers", nargs="+", default=MIXERS)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float64"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=1536)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", action="store_true",
                   help="also the static step through torch.compile (captured as a CUDA graph on CUDA)")
    p.add_argument("--out", default=None, help="directory for bench_decode.md (or a path ending in .md)")
    args = p.parse_args(argv)
    p.check_output("--out", args.out, folder=not str(args.out or "").endswith(".md"))
    from mixlab.backbone import mixer_names, parse_pattern

    for mixer in args.mixers:
        try:
            parse_pattern(mixer, len(mixer_names(mixer)))  # registered names
        except ValueError as err:
            p.error(f"--mixers {mixer!r}: {err}")
    if args.quick:
        args.batch, args.layers, args.d_model, args.head_dim, args.vocab = 2, 2, 64, 32, 97
        args.prompt, args.new, args.repeats, args.device = 9, 12, 1, "cpu"
    device = torch.device(args.device)
    paths = [k for k in PATHS if (k != "graph" or device.type == "cuda") and (k != "compiled" or args.compile)]
    fast = paths[1:]
    head = ("| dtype | mixer | " + " | ".join(f"{TITLES[k]} tok/s" for k in paths) + " | "
            + " | ".join(f"{k} / dict" for k in fast) + " | ids = dict (" + " / ".join(fast) + ") |")
    lines, notes = [head, "|" + "---|" * (4 + 2 * len(fast))], []  # dtype, mixer, rates, ratios, ids
    for dname in args.dtypes:
        dtype = getattr(torch, dname)
        for mixer in args.mixers:
            model = build(mixer, args, dtype, device)
            g = torch.Generator().manual_seed(1)
            prompt = torch.randint(0, args.vocab, (args.batch, args.prompt), generator=g).to(device)
            rate, ids = {}, {}
            for path in paths:
                log(f"{dname} {mixer} {path}")
                failed = len(FAILED_CAPTURES)
                rate[path], ids[path] = measure(model, prompt, args.new, PATHS[path], args.repeats)
                if len(FAILED_CAPTURES) > failed:
                    notes.append(f"{dname} {mixer}: the CUDA graph capture failed, the {path} column is eager "
                                 f"({FAILED_CAPTURES[-1]})")
            same = " / ".join(f"{float((ids[k] == ids['dict']).double().mean()):.3f}" for k in fast)
            lines.append(f"| {dname} | {mixer} | " + " | ".join(_fmt(rate[k]) for k in paths) + " | "
                         + " | ".join(f"{rate[k] / rate['dict']:.2f}x" for k in fast) + f" | {same} |")
            log(lines[-1])
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    lines += ["", f"Greedy decoding, batch {args.batch}, {args.layers} layers, d_model {args.d_model}, head dim "
              f"{args.head_dim}, vocabulary {args.vocab}, prompt {args.prompt}, {args.new} new tokens; decode tokens/s "
              f"(prefill excluded), median of {args.repeats}; ids = dict: fraction of generated ids equal to the dict "
              f"loop's; the graph paths' time includes their capture (once per generate call), the compiled step's "
              f"compilation happens in the untimed warm-up call; device {device} "
              f"({name}), torch {torch.__version__}.", *notes]
    md = "\n".join(lines) + "\n"
    print(md, end="", flush=True)
    if args.out:
        out = Path(args.out)
        out = out if out.suffix == ".md" else out / "bench_decode.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(md)
    return md


if __name__ == "__main__":
    main()
