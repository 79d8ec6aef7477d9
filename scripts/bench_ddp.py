"""GPU benchmark (issue 9): genome LM on 2 GPUs with DDP and FSDP vs 1 GPU at twice the batch.

Run on a machine with 2 CUDA GPUs from the project root::

    python scripts/bench_ddp.py --steps 300 --out out/

Three ``python -m mixlab fit`` runs of the same experiment (default
``configs/genome/goat.yaml``, bf16-mixed, no validation), same seed and data order:

* anchor: 1 GPU, per-device batch ``2 B``;
* DDP: 2 GPUs, ``--config configs/trainer/ddp.yaml``, per-device batch ``B``;
* FSDP: 2 GPUs, ``--config configs/trainer/fsdp.yaml``, per-device batch ``B``.

The genome datamodule's ResumableSampler gives rank ``r`` the samples ``r::2`` of the
1-GPU batch order, so all three runs see the same global batches and their loss curves
should agree up to bf16 rounding. Per step each rank records its loss and a CUDA-synced
wall time (callback :class:`StepRecorder` in this file).

Reported (Markdown table to stdout and ``<out>/bench_ddp.md``, raw per-step CSVs beside it):
tokens/s over steps ``>= --warmup``; scaling efficiency = tokens/s on 2 GPUs / (2 x tokens/s
of 1 GPU at the same per-GPU batch B) - the issue's definition - and also against 2 x the
anchor (1 GPU at 2B); loss agreement vs the anchor: max and mean |loss - anchor loss| per
step, and the mean loss of the last 10% of steps. ``<out>/bench_ddp_loss.png`` plots the loss
curves (and the difference to the anchor). ``--cpu`` is a smoke test (gloo, no FSDP).
``--parallel-single`` runs the two 1-GPU runs at the same time, one per GPU (saves device
time; they share the host CPUs, so their tokens/s may be slightly low).
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch

from mixlab.eval.common import OneLineParser

ROOT = Path(__file__).resolve().parents[1]


class StepRecorder(pl.Callback):
    """Appends ``step,rank,loss,time,tokens`` per training step to ``<path>.rank<r>.csv``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fh = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        if self._fh is None:
            self._fh = open(f"{self.path}.rank{trainer.global_rank}.csv", "w")
        loss = float(outputs["loss"].detach())
        tokens = batch.shape[0] * (batch.shape[1] - 1)
        self._fh.write(f"{trainer.global_step},{trainer.global_rank},{loss!r},{time.perf_counter()!r},{tokens}\n")
        self._fh.flush()


def run(name: str, out: Path, args, devices: int, batch: int, fragment: str | None, gpu: str | None = None
        ) -> dict | None:
    """One training run in a subprocess; returns per-step {loss (rank mean), time, tokens}."""
    if args.reuse and all((out / f"{name}.rank{r}.csv").is_file() for r in range(devices)):
        print(f"[bench_ddp] {name}: reusing {out / name}.rank*.csv", flush=True)
        return _read(out, name, devices)
    frag = out / f"{name}_extra.yaml"
    frag.write_text(
        "trainer:\n"
        f"  max_steps: {args.steps}\n"
        "  limit_val_batches: 0\n"
        "  num_sanity_val_steps: 0\n"
        "  enable_progress_bar: false\n"
        f"  devices: {devices}\n"
        f"  accelerator: {'cpu' if args.cpu else 'gpu'}\n"
        "  callbacks:\n"
        "  - class_path: bench_ddp.StepRecorder\n"
        f"    init_args: {{path: {out / name}}}\n")
    cmd = [sys.executable, "-m", "mixlab", "fit", "--config", str(ROOT / args.config)]
    if fragment:
        cmd += ["--config", str(ROOT / "configs" / "trainer" / fragment)]
        if args.cpu:
            cmd += ["--trainer.strategy.init_args.process_group_backend", "gloo"]
    cmd += ["--config", str(frag), "--data.init_args.batch_size", str(batch),
            "--run_root", str(out / "runs"), "--run_name", name, *args.extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "scripts"), os.environ.get("PYTHONPATH", "")])}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    print(f"[bench_ddp] {name}: {' '.join(cmd)}", flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"[bench_ddp] {name} FAILED (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return None
    print(f"[bench_ddp] {name}: done in {time.time() - t0:.0f} s", flush=True)
    return _read(out, name, devices)


def _read(out: Path, name: str, devices: int) -> dict:
    """Per-step {loss (rank mean), time, tokens} from the runs' CSVs."""
    ranks = []
    for r in range(devices):
        rows = list(csv.reader(open(f"{out / name}.rank{r}.csv")))
        ranks.append({int(s): (float(loss), float(t), int(n)) for s, _, loss, t, n in rows})
    steps = sorted(ranks[0])
    return {"steps": steps,
            "loss": {s: sum(rk[s][0] for rk in ranks) / devices for s in steps},
            "time": {s: ranks[0][s][1] for s in steps},
            "tokens": ranks[0][steps[0]][2] * devices}


def tokens_per_s(res: dict, warmup: int) -> float:
    steps = [s for s in res["steps"] if s >= warmup]
    if len(steps) < 2:
        return float("nan")
    return res["tokens"] * (len(steps) - 1) / (res["time"][steps[-1]] - res["time"][steps[0]])


def main(argv: list[str] | None = None) -> None:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/genome/goat.yaml", help="experiment config (relative to the repo)")
    p.add_argument("--batch", type=int, default=16, help="per-GPU batch B of the 2-GPU runs (anchor: 2B)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30, help="steps excluded from tokens/s")
    p.add_argument("--out", default="out", help="folder for bench_ddp.md, CSVs and runs")
    p.add_argument("--no-single-b", action="store_true", help="skip the 1-GPU run at batch B")
    p.add_argument("--cpu", action="store_true", help="CPU smoke test of this script (gloo DDP, no FSDP)")
    p.add_argument("--parallel-single", action="store_true",
                   help="run the two 1-GPU runs concurrently on GPUs 0 and 1 (saves time; shared host CPUs)")
    p.add_argument("--reuse", action="store_true",
                   help="reuse the per-step CSVs of runs already in --out (e.g. to rerun only a failed one)")
    p.add_argument("extra", nargs="*",
                   help="extra CLI overrides after --, e.g. -- --data.init_args.context_length 1024")
    args = p.parse_args(argv)
    p.check_output("--out", args.out, folder=True)
    if not args.cpu and torch.cuda.device_count() < 2:
        sys.exit(f"bench_ddp needs 2 CUDA GPUs, found {torch.cuda.device_count()}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.parallel_single and not args.no_single_b:
        from concurrent.futures import ThreadPoolExecutor

        gpus = (None, None) if args.cpu else ("0", "1")
        with ThreadPoolExecutor(2) as pool:
            fa = pool.submit(run, "single_2b", out, args, 1, 2 * args.batch, None, gpus[0])
            fb = pool.submit(run, "single_b", out, args, 1, args.batch, None, gpus[1])
            results = {"1 GPU, batch 2B (anchor)": fa.result(), "1 GPU, batch B": fb.result()}
    else:
        results = {"1 GPU, batch 2B (anchor)": run("single_2b", out, args, 1, 2 * args.batch, None)}
        if not args.no_single_b:
            results["1 GPU, batch B"] = run("single_b", out, args, 1, args.batch, None)
    results["2 GPUs DDP, batch B/GPU"] = run("ddp", out, args, 2, args.batch, "ddp.yaml")
    if not args.cpu:
        results["2 GPUs FSDP, batch B/GPU"] = run("fsdp", out, args, 2, args.batch, "fsdp.yaml")

    anchor = results["1 GPU, batch 2B (anchor)"]
    single_b = results.get("1 GPU, batch B")
    a_tps = tokens_per_s(anchor, args.warmup) if anchor else float("nan")
    b_tps = tokens_per_s(single_b, args.warmup) if single_b else float("nan")
    lines = [f"Genome LM `{args.config}`, B = {args.batch}, {args.steps} steps, tokens/s over steps "
             f">= {args.warmup}; GPUs: {torch.cuda.get_device_name(0) if not args.cpu else 'CPU'}", "",
             "| run | tokens/s | x anchor | efficiency vs 2 x (1 GPU, B) | efficiency vs 2 x anchor | "
             "max abs dloss | mean abs dloss | final loss (last 10%) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, res in results.items():
        if res is None:
            lines.append(f"| {name} | FAILED | | | | | | |")
            continue
        tps = tokens_per_s(res, args.warmup)
        two_gpu = "GPUs" in name
        eff_b = f"{tps / (2 * b_tps):.3f}" if two_gpu and single_b else ""
        eff_a = f"{tps / (2 * a_tps):.3f}" if two_gpu and anchor else ""
        common = [s for s in res["steps"] if anchor and s in anchor["loss"]]
        d = [abs(res["loss"][s] - anchor["loss"][s]) for s in common]
        tail = res["steps"][-max(1, len(res["steps"]) // 10):]
        final = sum(res["loss"][s] for s in tail) / len(tail)
        dl = f"{max(d):.4f} | {sum(d) / len(d):.4f}" if d and name != "1 GPU, batch B" else "- | -"
        lines.append(f"| {name} | {tps:,.0f} | {tps / a_tps:.3f} | {eff_b} | {eff_a} | {dl} | {final:.4f} |")
    lines += ["", "Loss deltas are per step against the anchor (same global batches; bf16 rounding "
              "makes them nonzero). The 1-GPU batch-B run has different batches (no delta)."]
    if args.parallel_single and not args.no_single_b:
        lines.append("The two 1-GPU runs ran concurrently (one per GPU, shared host CPUs).")
    text = "\n".join(lines)
    print(text)
    (out / "bench_ddp.md").write_text(text + "\n")
    plot_losses(results, out / "bench_ddp_loss.png", args)


def plot_losses(results: dict, path: Path, args) -> None:
    """Loss per step of every run (top) and its difference to the anchor (bottom)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"[bench_ddp] no plot: {e}")
        return
    anchor = results.get("1 GPU, batch 2B (anchor)")
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    for name, res in results.items():
        if res is None:
            continue
        ax.plot(res["steps"], [res["loss"][s] for s in res["steps"]], label=name, lw=1,
                ls="--" if "GPUs" in name else "-")
        if anchor and res is not anchor and name != "1 GPU, batch B":
            common = [s for s in res["steps"] if s in anchor["loss"]]
            ax2.plot(common, [res["loss"][s] - anchor["loss"][s] for s in common], label=name, lw=1)
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(f"{args.config}, B={args.batch}/GPU (anchor 2B on 1 GPU)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax2.set_xlabel("step")
    ax2.set_ylabel("loss - anchor loss")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
