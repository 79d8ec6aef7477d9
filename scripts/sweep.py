"""Run task configs over several mixers and write a comparison table.

    python scripts/sweep.py --configs configs/synthetic/mad_*.yaml configs/synthetic/regbench.yaml \
        --mixers goat rope --out sweep.md [--set trainer.max_steps=200 ...] [--grid]

Every (config, mixer) pair is trained with ``python -m mixlab fit``'s CLI in this process
(``--model.init_args.backbone.mixer <mixer>``; the config's ``mixer_args`` for other
names are ignored), then tested on its final weights. ``--set key=value`` adds CLI
overrides to every run (e.g. ``trainer.max_steps=50``, ``data.init_args.n_train=500``).
``--grid`` runs MAD configs over the MAD difficulty grid (default + single-factor
changes, :func:`mixlab.datamodules.mad.mad_grid`; the model's ``vocab_size``/``max_len``
follow the data). MAD configs add the MAD score (mean over tasks of the task score =
mean over the settings run), both micro (``test/acc``) and macro (``test/acc_macro``).

Outputs: ``--out`` (Markdown) and the same name with ``.csv``; runs log to
``<run_root>/<task>/<mixer>`` (TensorBoard).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import yaml

from mixlab.eval.common import OneLineParser

METRICS = {  # task_name prefix -> test metrics reported
    "mad_": ["test/acc", "test/acc_macro"],
    "regbench": ["test/regbench_acc", "test/tvd"],
    "parity": ["test/acc"],
    "copy_mixture": ["test/excess_nll"],
    "passkey": ["test/span_acc", "test/strict_acc"],
    "niah": ["test/span_acc", "test/strict_acc"],
    "text": ["test/ppl"],
}


def metric_names(task: str) -> list[str]:
    for prefix, names in METRICS.items():
        if task.startswith(prefix):
            return names
    return ["test/loss"]


def run_one(config: str, mixer: str, overrides: list[str], run_root: str) -> tuple[str, dict[str, float]]:
    """Fit + test one config with ``mixer``; returns ``(task_name, test metrics)``."""
    from mixlab.cli import MixlabCLI

    args = ["--config", config, "--model.init_args.backbone.mixer", mixer, "--run_root", run_root,
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
    args += [f"--{o}" for o in overrides]
    cli = MixlabCLI(args=args, run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    res = cli.trainer.test(cli.model, datamodule=cli.datamodule, verbose=False)[0]
    return cli.datamodule.task_name, {k: float(v) for k, v in res.items()}


def _grid_overrides(config: str) -> dict[str, list[str]]:
    """``{setting: overrides}`` for a MAD config (just ``{"default": []}`` otherwise)."""
    cfg = yaml.safe_load(Path(config).read_text())
    data = cfg.get("data", {})
    if not str(data.get("class_path", "")).endswith("MADDataModule"):
        return {"default": []}
    from mixlab.datamodules.mad import DEFAULTS, mad_grid

    task = data.get("init_args", {}).get("task", "in_context_recall")
    model_vocab = cfg.get("model", {}).get("init_args", {}).get("vocab_size", DEFAULTS[task]["vocab_size"])
    out = {}
    for name, change in mad_grid(task).items():
        ov = [f"data.init_args.{k}={v}" for k, v in change.items()]
        if "vocab" in change:
            ov.append(f"model.init_args.vocab_size={max(change['vocab'], model_vocab)}")
        if task == "compression" and "seq_len" in change:
            ov.append(f"model.init_args.max_len={change['seq_len']}")
        out[name] = ov
    return out


def main(argv: list[str] | None = None) -> dict:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", required=True, help="task configs (YAML)")
    p.add_argument("--mixers", nargs="+", required=True, help="registered mixer names or patterns")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="CLI overrides for every run")
    p.add_argument("--grid", action="store_true", help="MAD difficulty grid for MAD configs")
    p.add_argument("--out", default="sweep.md")
    p.add_argument("--run-root", default="runs/sweep")
    args = p.parse_args(argv)
    p.check_output("--out", args.out)
    for c in args.configs:
        if not Path(c).is_file():
            p.error(f"config not found: {c}")
    sys.argv = sys.argv[:1]  # LightningCLI gets its arguments from run_one, not from this command line
    # results[mixer][column] = value; mad[mixer][kind][task][setting] = accuracy
    results: dict[str, dict[str, float]] = {m: {} for m in args.mixers}
    mad: dict[str, dict[str, dict[str, dict[str, float]]]] = {m: {"micro": {}, "macro": {}} for m in args.mixers}
    columns: list[str] = []
    for config in args.configs:
        settings = _grid_overrides(config) if args.grid else {"default": []}
        for mixer in args.mixers:
            for setting, ov in settings.items():
                task, res = run_one(config, mixer, args.set + ov, args.run_root)
                for name in metric_names(task):
                    col = f"{task}:{name.split('/', 1)[1]}" + ("" if setting == "default" else f" [{setting}]")
                    if col not in columns:
                        columns.append(col)
                    results[mixer][col] = res.get(name, float("nan"))
                if task.startswith("mad_"):
                    mad[mixer]["micro"].setdefault(task, {})[setting] = res.get("test/acc", float("nan"))
                    mad[mixer]["macro"].setdefault(task, {})[setting] = res.get("test/acc_macro", float("nan"))
                print(f"[sweep] {task} {mixer} {setting}: " + ", ".join(f"{k}={v:.4f}" for k, v in res.items()),
                      flush=True)
                _write(args, results, mad, columns, final=False)  # partial table after every run
    return _write(args, results, mad, columns, final=True)


def _write(args, results, mad, columns, final: bool) -> dict:
    """Add the MAD scores and write the Markdown / CSV tables (also after every run)."""
    from mixlab.datamodules.mad import mad_score

    results = {m: dict(r) for m, r in results.items()}
    columns = list(columns)
    for mixer in args.mixers:
        for kind in ("micro", "macro"):
            if mad[mixer][kind]:
                score, _ = mad_score(mad[mixer][kind])
                col = f"MAD score ({kind}, {len(mad[mixer][kind])} tasks)"
                if col not in columns:
                    columns.append(col)
                results[mixer][col] = score
    header = ["mixer"] + columns
    rows = [[m] + [f"{results[m].get(c, float('nan')):.4f}" for c in columns] for m in args.mixers]
    md = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]
    out = Path(args.out)
    out.write_text("\n".join(md) + "\n")
    with open(out.with_suffix(".csv"), "w", newline="") as fh:
        csv.writer(fh).writerows([header] + rows)
    if final:
        print("\n".join(md))
        print(f"wrote {out} and {out.with_suffix('.csv')}")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
