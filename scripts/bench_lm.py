"""Whole-model LM training speed: mixlab's CausalLM per mixer against a textbook plain GPT, in ONE process.

Run on a CUDA device from the project root::

    python scripts/bench_lm.py --out bench_lm.md                 # the issue's table (about 20 minutes on an H200)
    python scripts/bench_lm.py --models goat kda --modes eager   # a subset (the plain anchor always runs)
    python scripts/bench_lm.py --quick                           # tiny shape on CPU, eager: checks the script

Models: ``plain`` (the anchor, written below in ~60 lines: token embedding, pre-norm blocks of RMSNorm,
fused qkv, causal SDPA, SwiGLU, tied output layer, full-logits cross entropy) and
:class:`mixlab.heads.CausalLM` with mixers ``goat``, ``rope``, ``nope``, ``kda``, ``fg2gdn``, ``mesa``,
the hybrid ``--hybrid`` (default ``kda*3,goat``), ``rope_triton`` (RoPE with ``rotary_impl: triton``) and, on
request, ``goat_fla_loss`` / ``rope_fla_loss`` (``loss_kernel: fla``: fla's Triton cross entropy in the loss),
``goat_torch_loss`` / ``rope_torch_loss`` (``loss_kernel: torch``: the float32 torch kernel in the chunked loss),
``goat_full_loss`` / ``rope_full_loss`` / ``nope_full_loss`` (``loss_chunk_tokens: 0``: whole logits, as the
anchor), ``goat_where`` / ``goat_where_full_loss`` (GOAT with ``lane_impl: where``) and ``goat_scatter`` /
``goat_scatter_full_loss`` (``lane_impl: scatter``),
all at the same shape (default GPT-2 small: 12 layers x 768, 12 heads, vocabulary 50304, T 2048, batch 8)
with bf16 autocast over float32 parameters
(as ``precision: bf16-mixed``) and fused AdamW. mixlab's loss is its training loss
(:meth:`CausalLM.mean_loss`: output layer and cross entropy fused in chunks of ``loss_chunk_tokens``
tokens, gradients computed in forward, automatic at this vocabulary; ``loss_kernel: auto``, the default: fla's
kernels on CUDA); the anchor's is the plain full-logits one.

Each model runs eagerly and under ``torch.compile`` (``--modes``; ``compile-cudagraphs`` is
``torch.compile(mode="reduce-overhead")``: the compiled forward and backward replayed as CUDA graphs,
which removes the host's launch cost that the compiled mixlab models pay beyond the plain one;
``compile-blocks`` is mixlab's own route, ``backbone.compile: true``: each block compiled, the embedding and
the fused loss eager, against the plain anchor compiled whole, the strongest anchor; ``compile-max-autotune`` is
``torch.compile(mode="max-autotune-no-cudagraphs")`` for every model and the anchor alike: Inductor benchmarks its
Triton GEMM templates against cuBLAS and can fuse pointwise epilogues into them, e.g. ``goat_where``'s lane
``torch.where`` into the qkv GEMM; its compilation takes minutes per model). Every
(model, mode) is built, warmed up and its peak memory measured first (``torch.cuda.max_memory_allocated``
during one training step after the warm-up, above what was allocated before the model was built: its
parameters, gradients, optimizer state and activations, as if alone, without the compiler's warm-up
temporaries); then ``--rounds`` interleaved rounds time ``--steps`` back-to-back training steps of each in turn, so
every ratio to the plain anchor (same mode, same round) sees the same state of the host and GPU.

Reported per (model, mode): parameters N (tied embedding counted once), tokens/s (median over the
rounds), the ratio to the plain anchor's tokens/s (median and [min, max] over the rounds), MFU =
6 N tokens/s / peak FLOP/s (``--peak-tflops``, default 989: H200 bf16 dense; the attention
score FLOPs are not counted, as in the 6N rule) and the peak memory (GiB; "-" on CPU). The table
goes to stdout and, with ``--out``, to a Markdown file rewritten after every round (a run cut short
keeps the rounds it finished). Progress lines go to stderr.

``--host-time`` (CUDA) adds a second table: each (model, mode)'s host milliseconds per step (the wall time to
enqueue one step while ``torch.cuda._sleep`` holds the GPU) next to its device milliseconds (CUDA events around
that step, which then runs without waiting for the host), unprofiled. A model whose host time reaches its device
time is host-bound (fewer launches or CUDA graphs help); below it, only device time moves tokens/s. A step of more
kernels than CUDA's launch queue holds (about a thousand) fills it behind the hold: its host time is then marked,
not measured.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mixlab.eval.common import OneLineParser

MIXERS = ["goat", "rope", "nope", "kda", "fg2gdn", "mesa", "hybrid", "rope_triton"]
#: also measurable (not by default): ``<mixer>_fla_loss``, the model with ``loss_kernel="fla"`` (fla's Triton
#: cross-entropy kernels inside the chunked training loss; CUDA), and ``<mixer>_full_loss``, the model with
#: ``loss_chunk_tokens=0`` (whole logits, as the anchor: what Inductor can fuse when compiled)
FLA_LOSS = ["goat_fla_loss", "rope_fla_loss"]
FULL_LOSS = ["goat_full_loss", "rope_full_loss", "nope_full_loss", "goat_where_full_loss", "goat_scatter_full_loss"]
#: also measurable: ``goat_where`` (GOAT with ``lane_impl: where``: the lanes put into the qkv projection's output
#: by one ``torch.where``, which ``--modes compile-max-autotune`` can fuse into the GEMM's epilogue) and
#: ``goat_scatter`` (``lane_impl: scatter``: the same by ``slice_scatter``, its backward reading only the lane
#: columns of ``d qkv``)
WHERE = ["goat_where", "goat_scatter"]
TORCH_LOSS = ["goat_torch_loss", "rope_torch_loss"]
MODES = ["eager", "compile", "compile-cudagraphs", "compile-blocks", "compile-max-autotune"]
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[bench_lm {time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- the plain GPT anchor
class PlainBlock(nn.Module):
    """Pre-norm block: ``x + proj(SDPA(qkv(norm(x))))``, ``x + SwiGLU(norm(x))``."""

    def __init__(self, d: int, h: int, hidden: int) -> None:
        super().__init__()
        self.h = h
        self.norm1, self.norm2 = nn.RMSNorm(d, eps=1e-6), nn.RMSNorm(d, eps=1e-6)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.gate_up, self.down = nn.Linear(d, 2 * hidden, bias=False), nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)  # (B, H, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class PlainGPT(nn.Module):
    """Textbook decoder LM: tied embedding, ``n_layers`` :class:`PlainBlock`, final RMSNorm, full logits."""

    def __init__(self, vocab: int, d: int, n_layers: int, h: int) -> None:
        super().__init__()
        hidden = 8 * math.ceil(2 * 4 * d / 3 / 8)  # SwiGLU at 2/3 of 4d per branch, as mixlab's backbone
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(PlainBlock(d, h, hidden) for _ in range(n_layers))
        self.norm = nn.RMSNorm(d, eps=1e-6)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, inputs, targets):
        x = self.embed(inputs)
        for blk in self.blocks:
            x = blk(x)
        logits = F.linear(self.norm(x), self.embed.weight).float()  # [B, T, V]
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class MixlabLoss(nn.Module):
    """mixlab's CausalLM with its training loss (mean NLL over scored tokens) as ``forward(inputs, targets)``."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, inputs, targets):
        return self.lm.mean_loss(inputs, targets)[0]


def build(name: str, args, compile_blocks: bool = False) -> nn.Module:
    """``plain`` or a mixlab CausalLM with mixer ``name`` (``hybrid``: ``args.hybrid``) as a loss module;
    ``compile_blocks``: ``backbone.compile: true``."""
    torch.manual_seed(0)
    if name == "plain":
        return PlainGPT(args.vocab, args.d_model, args.n_layers, args.n_heads)
    from mixlab.backbone import BackboneConfig
    from mixlab.heads.lm import CausalLM

    kernel = "fla" if name.endswith("_fla_loss") else "torch" if name.endswith("_torch_loss") else "auto"
    chunk = 0 if name.endswith("_full_loss") else args.loss_chunk_tokens
    name = name.removesuffix("_fla_loss").removesuffix("_full_loss").removesuffix("_torch_loss")
    mixer, mixer_args = (args.hybrid if name == "hybrid" else name), {}
    if name == "rope_triton":  # RoPE rotated in place in the packed qkv (position_args.rotary_impl)
        mixer, mixer_args = "rope", {"rope": {"position_args": {"rotary_impl": "triton"}}}
    if name in ("goat_where", "goat_scatter"):  # GOAT's lanes put into the projection's output by one pointwise op
        mixer, mixer_args = "goat", {"goat": {"position_args": {"lane_impl": name.removeprefix("goat_")}}}
    cfg = BackboneConfig(d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads, mixer=mixer,
                         mixer_args=mixer_args, compile=compile_blocks)
    return MixlabLoss(CausalLM(vocab_size=args.vocab, backbone=cfg, loss_chunk_tokens=chunk,
                               loss_kernel=kernel))


# ---------------------------------------------------------------------- measuring
class Case:
    """One (model, mode): the module, its optimizer, its training step and what was measured."""

    def __init__(self, name: str, mode: str, args, dev: torch.device) -> None:
        self.name, self.mode, self.dev = name, mode, dev
        blocks = mode == "compile-blocks" and name != "plain"  # the plain anchor is compiled whole
        self.module = build(name, args, compile_blocks=blocks).to(dev)
        self.n_params = sum(p.numel() for p in self.module.parameters())  # tied weights counted once
        fused = dev.type == "cuda"
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=1e-4, weight_decay=0.1, fused=fused)
        whole = {"compile": {}, "compile-cudagraphs": {"mode": "reduce-overhead"}, "compile-blocks": {},
                 "compile-max-autotune": {"mode": "max-autotune-no-cudagraphs"}}
        self.fn = self.module if mode == "eager" or blocks else torch.compile(self.module, **whole[mode])
        g = torch.Generator().manual_seed(1)
        batch = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=g).to(dev)
        self.inputs, self.targets = batch[:, :-1], batch[:, 1:]
        self.amp = args.amp
        self.tps: list[float] = []
        self.peak_gib: float | None = None

    def step(self) -> None:
        with torch.autocast(self.dev.type, dtype=torch.bfloat16, enabled=self.amp):
            loss = self.fn(self.inputs, self.targets)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(case: Case, steps: int, tokens: int) -> float:
    """Tokens/s over ``steps`` back-to-back training steps (no host sync inside)."""
    sync(case.dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        case.step()
    sync(case.dev)
    return steps * tokens / (time.perf_counter() - t0)


def table(cases: list[Case], args) -> str:
    """The Markdown table of everything measured so far."""
    anchor = {c.mode: c for c in cases if c.name == "plain"}
    on_gpu = args.device.startswith("cuda")  # MFU against the GPU's peak; "-" on CPU
    head = ["model", "mode", "params (M)", "tokens/s", "ratio to plain: median [min, max]", "MFU %", "peak mem (GiB)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cases:
        if not c.tps:
            continue
        tps = statistics.median(c.tps)
        plain = anchor.get(c.mode)
        ratios = [a / b for a, b in zip(c.tps, plain.tps)] if plain is not None else []
        ratio = f"{statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]" if ratios else "-"
        mfu = f"{100 * 6 * c.n_params * tps / (args.peak_tflops * 1e12):.1f}" if on_gpu else "-"
        mem = "-" if c.peak_gib is None else f"{c.peak_gib:.2f}"
        label = f"hybrid `{args.hybrid}`" if c.name == "hybrid" else c.name
        lines.append(f"| {label} | {c.mode} | {c.n_params / 1e6:.2f} | {tps:,.0f} | {ratio} | {mfu} | {mem} |")
    rounds = min((len(c.tps) for c in cases), default=0)
    note = (f"\n{args.n_layers} layers x {args.d_model}, {args.n_heads} heads, vocabulary {args.vocab}, "
            f"T {args.seq_len}, batch {args.batch}, {'bf16 autocast' if args.amp else 'float32'}, "
            f"{'fused ' if on_gpu else ''}AdamW; "
            f"{rounds} interleaved rounds of {args.steps} steps "
            f"after {args.warmup} warm-up steps; MFU = 6 N tokens/s / {args.peak_tflops:g} TFLOP/s; "
            f"device {device_name(args)}; torch {torch.__version__}.\n")
    return "\n".join(lines) + "\n" + note


def device_name(args) -> str:
    return torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else args.device


def _need(names: list[str]) -> str:
    return "needs" if len(names) == 1 else "need"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=MIXERS, choices=MIXERS + FLA_LOSS + FULL_LOSS + TORCH_LOSS + WHERE,
                   help="mixlab models besides the plain anchor (always measured)")
    p.add_argument("--hybrid", default="kda*3,goat", help="mixer pattern of the 'hybrid' model")
    p.add_argument("--modes", nargs="+", default=None, choices=MODES,
                   help="default: eager compile (--quick: eager)")
    p.add_argument("--n-layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--n-heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--loss-chunk-tokens", type=int, default=None,
                   help="mixlab's loss_chunk_tokens (default: automatic; 0: full logits like the anchor)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="timed training steps per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, autotuning)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="peak dense FLOP/s of the device, in TFLOP/s")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu (--quick: cpu)")
    p.add_argument("--no-amp", dest="amp", action="store_false", help="float32 instead of bf16 autocast")
    p.add_argument("--quick", action="store_true",
                   help="tiny shape on CPU (2 x 64, vocab 512, T 64, batch 2, 2 warm-up steps, 2 rounds of 2), "
                        "eager, float32: new defaults for those options (given ones still apply)")
    p.add_argument("--out", type=Path, default=None, help="Markdown file for the table")
    p.add_argument("--host-time", action="store_true",
                   help="after the rounds, measure each (model, mode)'s host time per step (the time to enqueue one "
                        "step while the GPU is held busy) and device time per step (CUDA events around that step), "
                        "unprofiled: a step whose host time exceeds its device time is host-bound (CUDA)")
    p.add_argument("--profile", type=int, default=0, metavar="K",
                   help="after the rounds, profile 2 steps of each (model, mode) and print its K most expensive "
                        "device kernels (torch.profiler; with --out, also to <out>.profile.txt)")
    tokens = sys.argv[1:] if argv is None else argv
    if "--quick" in tokens:  # the tiny shape as defaults: an option given beside --quick still applies
        p.set_defaults(n_layers=2, d_model=64, n_heads=2, vocab=512, seq_len=64, batch=2, rounds=2, steps=2, warmup=2,
                       amp=False, device="cpu", hybrid="kda,goat", modes=["eager"])
    args = p.parse_args(argv)
    p.check_output("--out", args.out)
    for name in ("rounds", "steps", "n_layers", "d_model", "n_heads", "vocab", "seq_len", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    for name in ("warmup", "profile"):
        if getattr(args, name) < 0:
            p.error(f"--{name} must be >= 0; got {getattr(args, name)}")
    if args.loss_chunk_tokens is not None and args.loss_chunk_tokens < 0:
        p.error("--loss-chunk-tokens must be >= 0 (0: full logits) or left out (automatic); "
                f"got {args.loss_chunk_tokens}")
    if not args.peak_tflops > 0:
        p.error(f"--peak-tflops must be > 0; got {args.peak_tflops}")
    if args.device is not None and not (args.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", args.device)):
        p.error(f"--device must be cpu, cuda or cuda:N; got {args.device!r}")
    if "hybrid" in args.models:
        from mixlab.backbone import mixer_names, parse_pattern

        try:
            parse_pattern(args.hybrid, len(mixer_names(args.hybrid)))  # registered names
        except ValueError as err:
            p.error(f"--hybrid {args.hybrid!r}: {err}")
    if args.device is not None and args.device.startswith("cuda") and not torch.cuda.is_available():
        hint = "--device cpu" if args.quick else "--device cpu, or --quick"
        p.error(f"--device cuda: no CUDA device is available here (use {hint})")
    if args.d_model % args.n_heads:
        p.error(f"--d-model ({args.d_model}) must be divisible by --n-heads ({args.n_heads})")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.modes = args.modes or ["eager", "compile"]
    if args.host_time and not args.device.startswith("cuda"):
        p.error(f"--host-time needs CUDA (it holds the GPU busy while the host enqueues a step); device {args.device}")
    from mixlab.heads.lm import AUTO_CHUNK_MIN_VOCAB

    cuda_only = {"rope_triton", *FLA_LOSS}  # the in-place Triton rotation and fla's loss kernels need CUDA
    if not args.device.startswith("cuda") and cuda_only & set(args.models):
        left = [m for m in args.models if m not in cuda_only]
        if not left:
            p.error(f"{', '.join(args.models)} {_need(args.models)} CUDA; nothing besides the plain anchor is left to "
                    f"measure on {args.device}")
        print(f"bench_lm: {', '.join(m for m in args.models if m in cuda_only)} left out (needs CUDA)", file=sys.stderr)
        args.models = left
    if not args.device.startswith("cuda") and "compile-blocks" in args.modes:
        p.error(f"--modes compile-blocks needs CUDA: backbone.compile compiles blocks on CUDA only (on {args.device} "
                "the blocks would run eagerly against a compiled anchor)")
    if not args.device.startswith("cuda") and "compile-cudagraphs" in args.modes:
        p.error(f"--modes compile-cudagraphs needs CUDA: there are no CUDA graphs on {args.device} "
                "(use --modes compile)")
    if not args.device.startswith("cuda"):  # say what a CPU run costs before it starts (user test: silent minutes)
        compiled = [m for m in args.modes if m in ("compile", "compile-max-autotune")]
        if compiled:
            print(f"bench_lm: --modes {' '.join(compiled)} on the CPU: Inductor compiles each model for the CPU first "
                  "(minutes on a few cores, more for the recurrent mixers and under max-autotune); --modes eager "
                  "measures the script's path quickly", file=sys.stderr)
        if not args.quick and args.d_model * args.n_layers >= 4096:
            print(f"bench_lm: a {args.n_layers} x {args.d_model} model on the CPU (the GPU shape): expect minutes per "
                  f"step; --quick runs a tiny model", file=sys.stderr)
    chunked = args.loss_chunk_tokens if args.loss_chunk_tokens is not None else args.vocab >= AUTO_CHUNK_MIN_VOCAB
    fla = [m for m in args.models if m in FLA_LOSS]
    if not chunked and fla:  # fla's kernels run inside the chunked loss only
        p.error(f"{', '.join(fla)} {_need(fla)} the chunked loss: --loss-chunk-tokens > 0 or --vocab >= "
                f"{AUTO_CHUNK_MIN_VOCAB} (got --vocab {args.vocab}, --loss-chunk-tokens {args.loss_chunk_tokens})")
    return args


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark; returns the Markdown table (also printed, and written to ``--out``)."""
    args = parse(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        dynamo = torch._dynamo.config  # every (model, mode) is a new module: room for all their graphs
        dynamo.cache_size_limit = max(dynamo.cache_size_limit, 64)
    names = ["plain"] + [m for m in dict.fromkeys(args.models) if m != "plain"]
    tokens = args.batch * args.seq_len
    cases: list[Case] = []
    for mode in args.modes:
        for name in names:
            if dev.type == "cuda":
                sync(dev)
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            log(f"build + warm up {name} ({mode})")
            case = Case(name, mode, args, dev)
            for _ in range(args.warmup):
                case.step()
            if dev.type == "cuda":  # the peak of one steady-state step (not the compiler's warm-up temporaries)
                sync(dev)
                torch.cuda.reset_peak_memory_stats()
                case.step()
                sync(dev)
                case.peak_gib = (torch.cuda.max_memory_allocated() - base) / 2**30
            cases.append(case)
    # one more untimed step of each case, in round order: a graph built for a later case can invalidate an
    # earlier case's guards (shared code objects), and that one-time recompile belongs outside the timing
    # (H200, 2026-12-02: goat compiled at 11k tokens/s in round 1, 254k in round 2, without this pass)
    for case in cases:
        case.step()
    from torch._dynamo.utils import counters

    for r in range(args.rounds):
        for case in cases:
            graphs = counters["stats"]["unique_graphs"]
            case.tps.append(timed(case, args.steps, tokens))
            if counters["stats"]["unique_graphs"] != graphs:
                log(f"warning: {case.name} ({case.mode}) compiled a new graph inside timed round {r + 1}")
        log(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{c.name}/{c.mode} {c.tps[-1]:,.0f} tok/s" for c in cases))
        md = table(cases, args)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(md)
    if args.host_time and dev.type == "cuda":
        md += "\n" + host_device_table(cases)
        if args.out is not None:
            args.out.write_text(md)
    print(md, flush=True)
    if args.profile:
        prof = "\n".join(profile(c, args.profile) for c in cases)
        print(prof, flush=True)
        if args.out is not None:
            args.out.with_suffix(".profile.txt").write_text(prof)
    return md


def host_device_table(cases: list[Case], repeats: int = 5) -> str:
    """Host and device milliseconds per training step of each case, without a profiler (CUDA only).

    The GPU is first held by ``torch.cuda._sleep`` for longer than a step takes to enqueue; the host time is the
    wall time of enqueuing one step behind it, and the device time the CUDA-event time of that step, which then
    runs with all its work queued (never waiting for the host). Medians over ``repeats``. A host time of half the
    hold or more is marked as not measurable this way: the host waited for the device, at a sync in the step or
    because the step launches more kernels than CUDA's launch queue holds (about a thousand pending launches;
    the eager recurrent mixers' steps and the ViT-S step, which torch's sync debug mode finds free of syncs, both
    read 350-470 ms on an H200: BENCHMARKS.md, thirty-fifth session)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10**8
    sync(cases[0].dev)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    sync(cases[0].dev)
    per_ms = cycles / start.elapsed_time(end)
    lines = ["| model | mode | host ms / step | device ms / step | host / device |", "|---|---|---:|---:|---:|"]
    for case in cases:
        host, device = [], []
        for _ in range(repeats):
            sync(case.dev)
            torch.cuda._sleep(int(per_ms * 400))  # hold the GPU for 400 ms
            start.record()
            t0 = time.perf_counter()
            case.step()
            host.append(1e3 * (time.perf_counter() - t0))
            end.record()
            sync(case.dev)
            device.append(start.elapsed_time(end))
        h, d = statistics.median(host), statistics.median(device)
        mark = " (host waited for the device: a sync in the step, or a full launch queue)" if h >= 200 else ""
        lines.append(f"| {case.name} | {case.mode} | {h:.1f}{mark} | {d:.1f} | {h / d:.2f} |")
    log("host and device time per step measured")
    return "\n".join(lines) + "\n"


def profile(case: Case, top: int) -> str:
    """The ``top`` kernels by total device time over 2 training steps of ``case`` (a text table), on CUDA
    also the ``top`` ops by host time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if case.dev.type == "cuda" else [])
    sync(case.dev)
    with torch_profile(activities=acts) as prof:
        for _ in range(2):
            case.step()
        sync(case.dev)
    key = "self_cuda_time_total" if case.dev.type == "cuda" else "self_cpu_time_total"
    text = f"## {case.name} ({case.mode}), 2 steps\n" + prof.key_averages().table(sort_by=key, row_limit=top)
    if case.dev.type == "cuda":  # host time too: a compiled model whose host time exceeds its device time is host-bound
        text += "\n### by host (self CPU) time\n" + prof.key_averages().table(sort_by="self_cpu_time_total",
                                                                              row_limit=top)
    return text


if __name__ == "__main__":
    main()
