"""GPU run matrix: every registered mixer trained and tested through the real CLI, per head and precision.

    python scripts/gpu_matrix.py --out OUT                        # CUDA: the whole matrix (about 8 min on one H200)
    python scripts/gpu_matrix.py --out OUT --mixers kda mesa --heads lm --precisions bf16-mixed
    python scripts/gpu_matrix.py --out OUT --quick                # CPU: a few tiny runs (checks the script)

Each case is two commands a user would type, each in a fresh process (forked from a server that
has imported torch, Lightning and mixlab; ``python -m mixlab`` subprocesses before Python 3.11)::

    python -m mixlab fit  --config <head config> --model.init_args.backbone.mixer <mixer> ... --trainer.precision <p>
    python -m mixlab test --config <head config> ... --ckpt_path last

with a few dozen steps (``--steps``; twice that for the ViT, :data:`HEAD_STEPS`), evaluation and
test limited to two batches. Heads (base
configs): ``lm`` genome decoder LM (``configs/genome/goat.yaml``; head dims 16, 64 and 128 at 4
heads), ``synthetic`` MAD in-context recall under MAD's sizes (127-token inputs, batch 128, width
128: head dim 32), ``vit`` ViT on digits and ``vqa`` spatial VQA (bidirectional: causal-only
recurrences must be refused with one line). A case is

* ``pass``: both commands exit 0, every logged ``train/loss`` is finite, the mean of the last
  five is below the mean of the first five, and ``test`` logged its metrics;
* ``refused``: ``fit`` exits 2 with one ``error: ...`` line (the CLI's bad-input contract);
* ``fail``: anything else (a traceback, a non-finite or flat loss, a crash).

Written to ``OUT``: ``gpu_matrix.md`` (a compact mixer x (head, precision, head dim) table, then one
row per case: status, steps/s
between the 5th and last logged step, peak memory, first and last loss), ``gpu_matrix.jsonl``
and ``gpu_matrix_failures.log`` (the last lines of every failed command). Runs go to
``--run-dir`` (default a temporary folder). fla's autotuning is bounded by
``MIXLAB_FLA_AUTOTUNE`` (default 2 here; see :mod:`mixlab.ops.fla`), so steps/s are not
tuned-kernel speeds; ``scripts/bench_*.py`` measure speed.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mixlab.eval.common import OneLineParser
from mixlab.eval.compare import load_scalars
from mixlab.eval.runner import Launcher, MpsDaemon

ROOT = Path(__file__).resolve().parent.parent
HYBRID = "kda*3,mla"
BIDIRECTIONAL = ("vit", "vqa")
#: Step multipliers per head: a ViT on digits sits at chance for its first ~30 steps (MLA in fp32 on the
#: H200: 2.314 -> 2.353 over 30 steps, 2.314 -> 2.261 over 60 on CPU), so it gets twice the budget.
HEAD_STEPS = {"vit": 2}
M = "--model.init_args."
#: Extra overrides per head in ``--quick`` (a CPU check of the script): 64-token LM windows, not 256
#: (kda's chunked torch path trains at about 0.5 steps/s on 2 CPU cores at 256).
QUICK_ARGS = {"lm": ["--data.init_args.context_length", "64"]}


def head_args(head: str, mixer: str, head_dim: int | None) -> tuple[str, list[str], int | None]:
    """(base config, overrides, nominal head dim) of one case."""
    if head == "lm":
        hd = head_dim or 64
        return "configs/genome/goat.yaml", [f"{M}backbone.d_model", str(4 * hd), f"{M}backbone.n_heads", "4",
                                            "--data.init_args.batch_size", "16"], hd
    if head == "synthetic":
        return "configs/synthetic/mad_in_context_recall.yaml", [
            "--data.init_args.seq_len", "128", "--data.init_args.batch_size", "128", "--data.init_args.n_train", "4096",
            f"{M}backbone.d_model", "128", f"{M}backbone.n_heads", "4"], 32
    if head == "vit":
        return "configs/vit/goat_digits.yaml", ["--trainer.max_epochs", "-1", "--trainer.check_val_every_n_epoch",
                                                "null"], 32
    if head == "vqa":  # shipped configs for the schemes that read (sequence, y, x); 1D positions for the rest
        if mixer in ("goat", "rope", "nope"):
            return f"configs/vqa/{mixer}_digits.yaml", ["--data.init_args.n_train", "4096"], 32
        return "configs/vqa/goat_digits.yaml", ["--data.init_args.n_train", "4096", f"{M}coordinates", "sequence"], 32
    raise ValueError(f"unknown head {head!r}")


def cases(mixers: list[str], heads: list[str], precisions: list[str], dims: list[int]) -> list[dict]:
    out = []
    for head in heads:
        for mixer in mixers:
            for precision in precisions:
                for hd in (dims if head == "lm" else [None]):
                    out.append({"mixer": mixer, "head": head, "precision": precision, "head_dim": hd})
    return out


def _tail(text: str, n: int = 12) -> str:
    return "\n".join([ln for ln in text.splitlines() if ln.strip()][-n:])


def run_case(case: dict, steps: int, run_root: Path, launch, quick: bool = False) -> dict:
    config, extra, hd = head_args(case["head"], case["mixer"], case["head_dim"])
    if quick:
        extra = [*extra, *QUICK_ARGS.get(case["head"], [])]
    name = f"{case['mixer'].replace('*', 'x').replace(',', '-')}-{case['head']}-{case['precision']}-hd{hd}"
    if case["mixer"] == HYBRID and case["head"] != "lm":  # the 3:1 pattern needs a multiple of 4 layers
        extra = [*extra, f"{M}backbone.n_layers", "4"]
    common = ["--config", config, *extra, f"{M}backbone.mixer", case["mixer"], "--trainer.precision",
              case["precision"], "--run_root", str(run_root), "--run_name", name]
    steps = steps * HEAD_STEPS.get(case["head"], 1)
    fit = ["fit", *common, "--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(steps),
           "--trainer.limit_val_batches", "2", "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar",
           "false", f"{M}optim.warmup_steps", "5"]
    test = ["test", *common, "--ckpt_path", "last", "--trainer.limit_test_batches", "2",
            "--trainer.enable_progress_bar", "false"]
    row = {**case, "head_dim": hd, "name": name}
    logs = run_root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rc, text = launch(fit, logs / f"{name}.fit.log")
    row["fit_s"] = round(time.perf_counter() - t0, 1)
    errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
    if rc == 2 and len(errors) == 1 and "Traceback" not in text:
        return {**row, "status": "refused", "why": errors[0][:200]}
    if rc != 0:
        return {**row, "status": "fail", "why": f"fit exit {rc}", "log": _tail(text)}
    run_dirs = sorted(run_root.glob(f"*/{name}"))
    sc = load_scalars(run_dirs[0]) if run_dirs else {}
    loss = sorted(sc.get("train/loss", []), key=lambda e: e[1])
    values = [v for _, _, v in loss]
    if len(values) < 10 or not all(math.isfinite(v) for v in values):
        finite = all(map(math.isfinite, values))
        return {**row, "status": "fail", "why": f"train/loss: {len(values)} values, finite={finite}"}
    first, last = sum(values[:5]) / 5, sum(values[-5:]) / 5
    row.update(loss_first=round(first, 4), loss_last=round(last, 4))
    (w0, s0, _), (w1, s1, _) = loss[4], loss[-1]
    row["steps_per_s"] = round((s1 - s0) / (w1 - w0), 2) if w1 > w0 else None
    mem = sc.get("perf/peak_mem_gb", [])
    row["peak_mem_gb"] = round(max(v for _, _, v in mem), 3) if mem else None
    if not last < first:
        return {**row, "status": "fail", "why": "loss did not decrease"}
    rc, text = launch(test, logs / f"{name}.test.log")
    tags = [t for t in load_scalars(run_dirs[0]) if t.startswith("test/")]
    if rc != 0 or not tags:
        return {**row, "status": "fail", "why": f"test exit {rc}, {len(tags)} test metrics", "log": _tail(text)}
    return {**row, "status": "pass", "total_s": round(time.perf_counter() - t0, 1)}


def table(rows: list[dict]) -> str:
    lines = ["| mixer | head | precision | head dim | status | steps/s | peak mem GB | loss first -> last | note |",
             "|" + "---|" * 9]
    for r in sorted(rows, key=lambda r: (r["head"], r["mixer"], r["precision"], r["head_dim"] or 0)):
        loss = f"{r['loss_first']:.3f} -> {r['loss_last']:.3f}" if "loss_first" in r else ""
        note = r.get("why", "") if r["status"] != "pass" else ""
        lines.append(f"| {r['mixer']} | {r['head']} | {r['precision']} | {r['head_dim']} | {r['status']} | "
                     f"{r.get('steps_per_s') or ''} | {r.get('peak_mem_gb') or ''} | {loss} | "
                     f"{note.replace('|', '/')} |")
    counts = {s: sum(r["status"] == s for r in rows) for s in ("pass", "refused", "fail")}
    lines.append("")
    lines.append(f"{len(rows)} cases: {counts['pass']} pass, {counts['refused']} refused, {counts['fail']} fail")
    return "\n".join(lines) + "\n"


def pivot(rows: list[dict]) -> str:
    """Compact table: one row per mixer, one column per (head, precision[, head dim]); a cell is
    ``pass <steps/s> / <peak GB>``, ``refused`` or ``FAIL``."""
    def col(r: dict) -> str:
        return f"{r['head']} {r['precision']}" + (f" hd{r['head_dim']}" if r["head"] == "lm" else "")

    order = {h: i for i, h in enumerate(["lm", "synthetic", "vit", "vqa"])}
    def rank(c: str) -> tuple:
        head, precision, *hd = c.split()
        return order.get(head, 9), precision, int(hd[0][2:]) if hd else 0

    cols = sorted({col(r) for r in rows}, key=rank)
    cells: dict[str, dict[str, str]] = {}
    for r in rows:
        st = r["status"]
        cell = (f"pass {r.get('steps_per_s') or '?'} / {r.get('peak_mem_gb') or '?'}" if st == "pass"
                else "refused" if st == "refused" else "**FAIL**")
        cells.setdefault(r["mixer"], {})[col(r)] = cell
    lines = ["| mixer | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for mixer in sorted(cells):
        lines.append(f"| {mixer} | " + " | ".join(cells[mixer].get(c, "") for c in cols) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for gpu_matrix.md / .jsonl / _failures.log")
    ap.add_argument("--run-dir", default=None, help="where the runs go (default: a temporary folder)")
    ap.add_argument("--mixers", nargs="+", default=None, help=f"registry names or patterns (default: all + {HYBRID!r})")
    ap.add_argument("--heads", nargs="+", default=["lm", "synthetic", "vit", "vqa"])
    ap.add_argument("--precisions", nargs="+", default=["bf16-mixed", "32"])
    ap.add_argument("--head-dims", nargs="+", type=int, default=[16, 64, 128], help="LM head dims (4 heads)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--workers", type=int, default=12, help="cases run side by side (one GPU serves many small runs)")
    ap.add_argument("--mps", choices=MpsDaemon.MODES, default="auto",
                    help="CUDA MPS for the cases side by side (mixlab.eval.runner.MpsDaemon)")
    ap.add_argument("--timeout", type=int, default=420, help="seconds per command")
    ap.add_argument("--fla-autotune", default="2", help="MIXLAB_FLA_AUTOTUNE for the runs")
    ap.add_argument("--done", default=None, help="gpu_matrix.jsonl of an earlier (interrupted) run: its finished "
                    "cases are kept, not rerun")
    ap.add_argument("--quick", action="store_true",
                    help="CPU check of the script: goat + kda, lm (64 tokens) + vit, 32, 12 steps")
    args = ap.parse_args(argv)
    ap.check_output("--out", args.out, folder=True)
    import torch

    from mixlab.registry import list_mixers

    if args.quick:
        args.mixers = args.mixers or ["goat", "kda"]
        args.heads, args.precisions, args.head_dims = ["lm", "vit"], ["32"], [16]
        args.steps, args.workers = max(args.steps if args.steps != 30 else 12, 10), min(args.workers, 2)
    mixers = args.mixers or [*list_mixers(), HYBRID]
    todo = cases(mixers, args.heads, args.precisions, args.head_dims)
    done = [json.loads(line) for line in Path(args.done).read_text().splitlines()] if args.done else []
    key = lambda r: (r["mixer"], r["head"], r["precision"], r["head_dim"] if r["head"] == "lm" else None)  # noqa: E731
    finished = {key(r) for r in done}
    todo = [c for c in todo if key(c) not in finished]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_matrix.jsonl").write_text("".join(json.dumps(r) + "\n" for r in done))
    run_root = Path(args.run_dir or tempfile.mkdtemp(prefix="gpu_matrix_"))
    env = {**os.environ, "MIXLAB_FLA_AUTOTUNE": args.fla_autotune, "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"[gpu_matrix] {len(todo)} cases on {device}, {args.workers} at a time, runs in {run_root}", flush=True)
    t0 = time.perf_counter()
    rows: list[dict] = list(done)

    def one(case: dict) -> dict:
        row = run_case(case, args.steps, run_root, launch, args.quick)
        rows.append(row)
        with open(out / "gpu_matrix.jsonl", "a") as f:  # written as cases finish: survives a killed run
            f.write(json.dumps({k: v for k, v in row.items() if k != "log"}) + "\n")
        print(f"[gpu_matrix {time.perf_counter() - t0:6.0f}s {len(rows)}/{len(todo) + len(done)}] {row['name']}: "
              f"{row['status']} "
              f"{row.get('why', '')}", flush=True)
        return row

    launch = Launcher(args.workers, env, args.timeout, cwd=ROOT, mps=args.mps)
    with ThreadPoolExecutor(args.workers) as pool:
        list(pool.map(one, todo))
    (out / "gpu_matrix_failures.log").write_text("".join(f"=== {r['name']}: {r.get('why', '')}\n{r.get('log', '')}\n"
                                                         for r in rows if r["status"] == "fail"))
    md = (f"Device: {device}; torch {torch.__version__}; {args.steps} steps per fit; "
          f"wall {time.perf_counter() - t0:.0f} s with {args.workers} runs side by side.\n\n"
          "Cells: status, steps/s (between the 5th and last logged step) / peak memory in GB.\n\n"
          + pivot(rows) + "\n" + table(rows))
    (out / "gpu_matrix.md").write_text(md)
    print(md, flush=True)
    return 1 if any(r["status"] == "fail" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
