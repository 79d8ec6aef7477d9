"""GPU benchmark: GOAT's lane kernels alone, swept over launch configurations.

Run on a CUDA device from the project root::

    python scripts/bench_goat_lanes.py --out out/

Times the in-place lane forward and the backward of ``GoatQKV`` (the pass that builds
``d qkv`` from ``dq, dk, dv`` and sums the lane gradients, then the parameter-gradient
kernel), next to the copies autograd makes for a plain layer's ``view -> permute ->
unbind`` (``stack`` + ``contiguous``, the part of a plain backward that GOAT's first
backward kernel replaces), at the two shapes the issue benchmarks use:

* LM layer: B8 T2048 d_model 768 H12, R=4, causal, key MLP 32 (``bench_attention.py``);
* ViT-S/16 layer: B256 T197 (196 patches + [CLS]) H6, R=16 on 2 axes, default bias.

for every combination of warps per program, token block and target program count (how many
batch chunks share the features). ``--stores`` adds the
forward's stores alone (same grid and masks, constant values) against a contiguous write
of the same number of bytes: the cost of scattering lanes into the qkv rows. Median microseconds over
CUDA-event-timed loops of 50 calls; writes a Markdown table (``bench_goat_lanes.md``) and
prints the fastest configuration per shape, to set the defaults in
``mixlab/ops/goat_triton.py`` (``_NUM_WARPS``, ``_BLOCK_T``, ``_PROGRAMS``).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from pathlib import Path
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from mixlab.eval.common import OneLineParser

SHAPES = {
    "lm B8 T2048 H12 R4": dict(B=8, T=2048, H=12, causal=True, axes=1,
                               position_args=dict(n_modes=4)),
    "vit B256 T197 H6 R16": dict(B=256, T=197, H=6, causal=False, axes=2,
                                 position_args=dict(n_modes=16, axes=2, default_bias=True)),
}


def _coords(spec, dev):
    from mixlab.coords import Coords

    if spec["axes"] == 1:
        return Coords.seq(spec["T"], device=dev)
    side = int((spec["T"] - 1) ** 0.5)
    return Coords.cat([Coords.empty(1, 2, device=dev), Coords.grid(side, side, device=dev)])  # [CLS] + patches


@triton.jit
def _store_only(out, N, T, BB, ROW: tl.constexpr, HD: tl.constexpr, QOFF: tl.constexpr, KOFF: tl.constexpr,
                L: tl.constexpr, LP: tl.constexpr, BLOCK_T: tl.constexpr):
    """The lane forward's stores alone (same grid, pattern and masks; constant values)."""
    h = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    b0 = tl.program_id(2) * BB
    l = tl.arange(0, LP)
    tile = tl.zeros([BLOCK_T, LP], dtype=tl.float32) + 1.0
    for i in range(0, BB):
        ob = b0 + i
        m = ((t < T) & (ob < N))[:, None] & (l < L)[None, :]
        base = out + (ob * T + t).to(tl.int64) * ROW + h * HD
        tl.store((base + QOFF)[:, None] + l[None, :], tile, mask=m)
        tl.store((base + KOFF)[:, None] + l[None, :], tile, mask=m)


def time_us(fn, reps: int = 50, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(out)


def main() -> None:
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--warps", type=int, nargs="*", default=[4, 8])
    ap.add_argument("--block-t", type=int, nargs="*", default=[32, 64])
    ap.add_argument("--programs", type=int, nargs="*", default=[128, 512, 2048])
    ap.add_argument("--stores", action="store_true",
                    help="also time the forward's stores alone against a contiguous write of the same bytes")
    args = ap.parse_args()
    ap.check_output("--out", args.out, folder=True)
    if not torch.cuda.is_available():
        raise SystemExit("bench_goat_lanes.py needs a CUDA device")
    from mixlab.mixers.attention import Attention
    from mixlab.ops import goat as G
    from mixlab.ops import goat_triton as GT

    dev = torch.device("cuda")
    lines = [f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", "",
             "| shape | warps | block | programs | grid x batch chunk | fwd us | bwd us | fwd+bwd us |",
             "|---|---|---|---|---|---|---|---|"]
    best: dict[str, tuple[float, str]] = {}
    for name, spec in SHAPES.items():
        torch.manual_seed(0)
        B, T, H = spec["B"], spec["T"], spec["H"]
        m = Attention(H * 64, H, causal=spec["causal"], position="goat", position_args=spec["position_args"],
                      bias=True).to(dev)
        pos = m.pos
        c = _coords(spec, dev)
        feat = G.packed_features(pos._features(c, torch.float32))
        params = pos._flat_params().detach()
        meta = pos._kernel_meta()
        qkv = torch.randn(B * T, 3 * H * 64, device=dev, dtype=torch.bfloat16)
        dq, dk, dv = (torch.randn(B, H, T, 64, device=dev, dtype=torch.bfloat16) for _ in range(3))
        plain = time_us(lambda: torch.stack([dq, dk, dv]).permute(1, 3, 0, 2, 4).reshape(B * T, -1))
        lines.append(f"| {name} | plain backward's stack + contiguous of d qkv (anchor) | | | | | {plain:.1f} | |")
        print(lines[-1], flush=True)
        L = meta["L"]
        layout = dict(ROW=3 * H * 64, HD=64, QOFF=64 - L, KOFF=H * 64 + 64 - L)
        if args.stores:  # where the forward's time goes: its stores alone vs writing the same bytes contiguously
            GT._NUM_WARPS, GT._BLOCK_T, GT._PROGRAMS = 4, None, 2048
            grid, BB, const, _ = GT._launch_args(meta, feat.shape, feat.shape, B, B)
            stores = time_us(lambda: _store_only[grid](qkv, B, T, BB, L=L, LP=const["LP"], BLOCK_T=const["BLOCK_T"],
                                                       **layout))
            flat = torch.empty(2 * B * T * H * L, device=dev, dtype=qkv.dtype)
            fill = time_us(lambda: flat.fill_(1.0))
            lines.append(f"| {name} | stores only (default launch) | | | {grid} x {BB} | {stores:.1f} | "
                         f"contiguous fill of the same bytes: {fill:.1f} | |")
            print(lines[-1], flush=True)
        for warps, block, programs in itertools.product(args.warps, args.block_t, args.programs):
            GT._NUM_WARPS, GT._BLOCK_T, GT._PROGRAMS = warps, block, programs
            grid, BB, const, kernels = GT._launch_args(meta, feat.shape, feat.shape, B, B)
            with torch.no_grad():
                fwd = time_us(lambda: GT.GoatQKV.apply(qkv, feat, params, meta, B, 64))
            ctx = SimpleNamespace(saved_tensors=(feat, params), args=(grid, BB, const, kernels, B, 64))
            bwd = time_us(lambda: GT.GoatQKV.backward(ctx, dq, dk, dv))
            lines.append(f"| {name} | {warps} | {block} | {programs} | {grid} x {BB} | {fwd:.1f} | {bwd:.1f} "
                         f"| {fwd + bwd:.1f} |")
            print(lines[-1], flush=True)
            cfg = f"warps={warps} block={block} programs={programs}"
            if name not in best or fwd + bwd < best[name][0]:
                best[name] = (fwd + bwd, cfg)
        m = qkv = dq = dk = dv = None  # release them (the timing lambdas hold these names)
    lines += [""] + [f"fastest at {n}: {cfg} ({us:.1f} us)" for n, (us, cfg) in best.items()]
    print("\n".join(lines[-len(best):]))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_goat_lanes.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
