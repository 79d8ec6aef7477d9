"""``python -m mixlab compare <logdir> [--tasks ...] [--mixers ...] [--out DIR]``: cross-task tables and curves.

Reads the TensorBoard event files of a run root laid out as ``<logdir>/<task>/<mixer>/version_N/``
(the CLI's layout) with TensorBoard's own :class:`EventAccumulator` (no protobuf parsing here);
folders without ``version_N`` runs (e.g. ``resolution --out runs/resolution``, ``compare``'s own
output) are not runs. Writes into ``--out`` (default ``<logdir>/compare``):

* ``compare.md`` / ``compare.csv``: one row per mixer (run name), one column per task metric
  holding its final value (the last event by wall time over all versions and all event
  files under ``<task>/<mixer>/``, so evaluation outputs written inside a run directory,
  e.g. ``length-extrapolation`` and ``resolution`` results, are picked up too; ``resolution``
  records only its standard protocol there: the whole val split at square sizes).
  Column labels name the unit where the value has one (``top-1 (%)``, ``top-1@<res>px (%)``).
  The best value of each column (with two or more values) is bold in the Markdown table. Which metric each task
  reports is :data:`mixlab.eval.metrics.TASK_METRICS`; a task matching no entry reports ``test/loss``.
  MAD tasks (``mad_*``) also give the derived ``MAD score`` column (mean ``test/acc``
  over the MAD tasks a mixer has);
* ``curves_<task>.png``: ``train/loss``, ``val/loss`` and the task's metrics against the
  step, one line per mixer (matplotlib, Agg backend).

Runs lacking a metric are named in one message (stderr and the Markdown file), and so are runs that logged no
scalar at all (left out of the table). A ``<logdir>`` that is a
file, a missing one, or an ``--out`` that cannot be a folder is one ``error:`` line (exit status 2).
"""

from __future__ import annotations

import csv
import fnmatch
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from mixlab.eval.common import OneLineParser, output_problem, pyplot
from mixlab.eval.metrics import TASK_METRICS, Metric, task_metrics
from mixlab.registry import did_you_mean

__all__ = ["Metric", "TASK_METRICS", "task_metrics", "load_scalars", "collect", "compare", "main"]


CURVE_TAGS = ("train/loss", "val/loss")

Scalars = dict[str, list[tuple[float, int, float]]]  # tag -> [(wall_time, step, value)]


def load_scalars(run_dir: str | Path) -> Scalars:
    """All scalars of every event file below ``run_dir`` (all versions, nested eval outputs).

    Returns ``{tag: [(wall_time, step, value), ...]}`` sorted by ``(wall_time, step)``.
    """
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    out: Scalars = {}
    dirs = sorted({p.parent for p in Path(run_dir).rglob("events.out.tfevents.*")})
    for d in dirs:
        acc = EventAccumulator(str(d), size_guidance={SCALARS: 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            out.setdefault(tag, []).extend((e.wall_time, e.step, float(e.value)) for e in acc.Scalars(tag))
    for events in out.values():
        events.sort(key=lambda e: (e[0], e[1]))
    return out


def _find_tag(scalars: Scalars, pattern: str) -> str | None:
    if pattern in scalars:
        return pattern
    hits = sorted(t for t in scalars if fnmatch.fnmatchcase(t, pattern))
    return hits[0] if hits else None


def metric_values(scalars: Scalars, metric: Metric) -> dict[str, float]:
    """``{column label: value}`` of one metric in one run (empty when the tag is missing)."""
    tag = _find_tag(scalars, metric.tag)
    if tag is None:
        return {}
    events = scalars[tag]
    if not metric.by_step:
        return {metric.label: events[-1][2]}
    last: dict[int, float] = {}
    for _, step, value in events:  # sorted by wall time: the latest value per step wins
        last[step] = value
    return {metric.label.format(step=s): last[s] for s in sorted(last)}


def _match(name: str, patterns: list[str] | None) -> bool:
    return not patterns or any(fnmatch.fnmatchcase(name, p) for p in patterns)


@dataclass
class Comparison:
    """Result of :func:`collect`.

    Attributes:
        columns: ``[(task, label, higher_is_better)]`` in table order.
        table: ``{mixer: {(task, label): value}}``.
        missing: ``["<task>/<mixer>: <tag>", ...]`` runs that lack a metric.
        scalars: ``{task: {mixer: Scalars}}`` (for the curves).
        empty: ``["<task>/<mixer>", ...]`` runs (``version_*`` folders) that logged no scalar, left out of the table:
            fewer steps than ``trainer.log_every_n_steps`` and no validation, ``trainer.logger: false``, or a crash
            before the first log.
    """

    columns: list[tuple[str, str, bool]]
    table: dict[str, dict[tuple[str, str], float]]
    missing: list[str]
    scalars: dict[str, dict[str, Scalars]]
    empty: list[str] = field(default_factory=list)


def collect(logdir: str | Path, tasks: list[str] | None = None, mixers: list[str] | None = None) -> Comparison:
    """Read ``<logdir>/<task>/<mixer>/`` runs into a :class:`Comparison`.

    ``tasks``/``mixers`` are name filters (``fnmatch`` patterns allowed).

    Raises:
        FileNotFoundError: ``logdir`` does not exist or holds no run with event files
            (the message names the directory and the filters).
        NotADirectoryError: ``logdir`` is a file (compare needs the run root folder).
    """
    root = Path(logdir)
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(f"compare: {root} is a file; compare needs the run root folder, "
                                 f"<logdir>/<task>/<mixer>/version_N (e.g. runs/)")
    if not root.is_dir():
        raise FileNotFoundError(f"compare: log directory {root} does not exist (<logdir>)")
    columns: list[tuple[str, str, bool]] = []
    table: dict[str, dict[tuple[str, str], float]] = {}
    missing: list[str] = []
    all_scalars: dict[str, dict[str, Scalars]] = {}
    empty: list[str] = []
    for task_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        task = task_dir.name
        if not _match(task, tasks):
            continue
        runs = {}
        for run_dir in sorted(p for p in task_dir.iterdir() if p.is_dir()):
            if not _match(run_dir.name, mixers) or next(run_dir.glob("version_*"), None) is None:
                continue
            has_events = next(run_dir.glob("version_*/**/events.out.tfevents.*"), None) is not None
            scalars = load_scalars(run_dir) if has_events else {}
            if scalars:
                runs[run_dir.name] = scalars
            else:  # nothing to compare, but said (compare.md and stderr), not dropped silently
                empty.append(f"{task}/{run_dir.name}")
        if not runs:
            continue
        all_scalars[task] = runs
        task_cols: dict[str, bool] = {}
        for mixer, scalars in runs.items():
            row = table.setdefault(mixer, {})
            for metric in task_metrics(task):
                values = metric_values(scalars, metric)
                if not values:
                    missing.append(f"{task}/{mixer}: {metric.tag}")
                for label, value in values.items():
                    row[(task, label)] = value
                    task_cols.setdefault(label, metric.higher_is_better)
        columns += [(task, label, task_cols[label]) for label in sorted(task_cols, key=lambda lab: _rank(task, lab))]
    if not all_scalars:
        there = sorted(p.name for p in root.iterdir() if p.is_dir() and next(p.glob("*/version_*"), None))
        runs_there = sorted({r.name for t in root.iterdir() if t.is_dir() for r in t.iterdir() if r.is_dir()})
        hints = "".join(did_you_mean([w for w in given or [] if not any(_match(n, [w]) for n in names)], names)
                        for given, names in ((tasks, there), (mixers, runs_there)))  # filters matching nothing
        raise FileNotFoundError(f"compare: no runs with TensorBoard event files under {root}/<task>/<mixer>/ "
                                f"(tasks={tasks or 'all'}, mixers={mixers or 'all'})"
                                + (f"; {_EMPTY}: {', '.join(empty)}" if empty else "")
                                + (hints or (f"; tasks there: {', '.join(there)}" if there else "")))
    mad = [(t, lab) for t, lab, _ in columns if t.startswith("mad_") and lab == "acc"]
    if mad:
        # a score over fewer tasks than the suite has would read as the MAD score: label the count
        label = "score" if len(mad) >= 6 else f"score ({len(mad)}/6 tasks)"
        for row in table.values():
            accs = [row[c] for c in mad if c in row]
            if len(accs) == len(mad):
                row[("MAD", label)] = sum(accs) / len(accs)
        columns.append(("MAD", label, True))
    return Comparison(columns, table, missing, all_scalars, empty)


_EMPTY = ("runs that logged no scalar (fewer steps than trainer.log_every_n_steps and no validation, or "
          "trainer.logger: false)")


def _rank(task: str, label: str) -> tuple[int, int]:
    """Column order: metric order of :data:`TASK_METRICS`, then increasing step."""
    for i, m in enumerate(task_metrics(task)):
        if label == m.label:
            return (i, 0)
        if m.by_step:
            hit = re.fullmatch(re.escape(m.label).replace(re.escape("{step}"), r"(-?\d+)"), label)
            if hit:
                return (i, int(hit.group(1)))
    return (len(task_metrics(task)), 0)


def _best(values: list[float], higher: bool) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return (max(finite) if higher else min(finite)) if finite else None


def to_markdown(cmp: Comparison) -> str:
    """Markdown table (``task: label`` headers, best per column in bold, ``-`` = missing)."""
    header = ["mixer"] + [f"{t}: {lab}" for t, lab, _ in cmp.columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    best = {(t, lab): _best([r.get((t, lab)) for r in cmp.table.values()], hi) for t, lab, hi in cmp.columns}
    count = {(t, lab): sum((t, lab) in r for r in cmp.table.values()) for t, lab, _ in cmp.columns}
    for mixer in sorted(cmp.table):
        row = cmp.table[mixer]
        cells = [mixer]
        for t, lab, _ in cmp.columns:
            v = row.get((t, lab))
            cell = "-" if v is None else f"{v:.4g}"
            cells.append(f"**{cell}**" if v is not None and v == best[(t, lab)] and count[(t, lab)] > 1 else cell)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_csv(cmp: Comparison, path: Path) -> None:
    """CSV: ``mixer`` then one ``task:label`` column per metric (empty = missing)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["mixer"] + [f"{t}:{lab}" for t, lab, _ in cmp.columns])
        for mixer in sorted(cmp.table):
            w.writerow([mixer] + [("" if (v := cmp.table[mixer].get((t, lab))) is None else repr(v))
                                  for t, lab, _ in cmp.columns])


def plot_curves(cmp: Comparison, out: Path) -> list[Path]:
    """``curves_<task>.png`` per task: one panel per curve tag, one line per mixer."""
    plt = pyplot()
    paths = []
    for task, runs in cmp.scalars.items():
        tags = [t for t in CURVE_TAGS if any(t in s for s in runs.values())]
        for m in task_metrics(task):
            for s in runs.values():
                tag = _find_tag(s, m.tag)
                if tag and tag not in tags and len(s[tag]) > 1:
                    tags.append(tag)
        if not tags:
            continue
        fig, axes = plt.subplots(1, len(tags), figsize=(4.5 * len(tags), 3.4), squeeze=False)
        # one colour and line style per run in every panel (a panel without some runs shifted the colours of the
        # others, and the only legend, the first panel's, then named other runs' lines: a user test)
        palette = plt.get_cmap("tab10" if len(runs) <= 10 else "tab20")
        style = {m: (palette(i % palette.N), ("-", "--", ":", "-.")[i // palette.N % 4])
                 for i, m in enumerate(sorted(runs))}
        for ax, tag in zip(axes[0], tags):
            for mixer, s in sorted(runs.items()):
                t = tag if tag in s else _find_tag(s, tag)
                if t is None:
                    continue
                last: dict[int, float] = {}
                for _, step, value in s[t]:
                    last[step] = value
                steps = sorted(last)
                ax.plot(steps, [last[k] for k in steps], marker="." if len(steps) < 30 else None, label=mixer,
                        color=style[mixer][0], linestyle=style[mixer][1])
            ax.set_title(f"{task}: {tag}")
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        from matplotlib.lines import Line2D

        axes[0][0].legend(handles=[Line2D([], [], color=c, linestyle=ls, label=m) for m, (c, ls) in style.items()],
                          fontsize=8)  # every run, whichever panel holds its lines
        fig.tight_layout()
        path = out / f"curves_{task}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def compare(logdir: str | Path, tasks: list[str] | None = None, mixers: list[str] | None = None,
            out: str | Path | None = None, plots: bool = True) -> Comparison:
    """Collect, write ``compare.md``/``compare.csv`` (and the curve PNGs) into ``out``; print the table.

    Raises:
        FileNotFoundError / NotADirectoryError: see :func:`collect`.
        ValueError: ``out`` is (or is under) a file, checked before anything is read (names ``--out``).
    """
    problem = output_problem("--out", out, folder=True)
    if problem:
        raise ValueError(problem)
    cmp = collect(logdir, tasks, mixers)
    out = Path(out) if out is not None else Path(logdir) / "compare"
    out.mkdir(parents=True, exist_ok=True)
    md = to_markdown(cmp)
    text = md
    for msg in (["runs lacking a metric: " + "; ".join(cmp.missing)] if cmp.missing else []) + \
            ([f"{_EMPTY}, left out: " + ", ".join(cmp.empty)] if cmp.empty else []):
        print(msg, file=sys.stderr)
        text += "\n" + msg + "\n"
    (out / "compare.md").write_text(text)
    write_csv(cmp, out / "compare.csv")
    pngs = plot_curves(cmp, out) if plots else []
    print(md)
    print(f"wrote {out}/compare.md, compare.csv" + (f", {len(pngs)} curve PNGs" if pngs else ""))
    return cmp


def main(argv: list[str] | None = None) -> Comparison:
    """CLI entry (``python -m mixlab compare``)."""
    p = OneLineParser(prog="python -m mixlab compare", description=__doc__.split("\n\n")[0])
    p.add_argument("logdir", help="run root: <logdir>/<task>/<mixer>/version_N")
    p.add_argument("--tasks", nargs="+", default=None, help="task names or patterns (default: all)")
    p.add_argument("--mixers", nargs="+", default=None, help="run names or patterns (default: all)")
    p.add_argument("--out", default=None, help="output folder (default: <logdir>/compare)")
    p.add_argument("--no-plots", action="store_true", help="skip the curve PNGs")
    a = p.parse_args(argv)
    return compare(a.logdir, a.tasks, a.mixers, a.out, plots=not a.no_plots)
