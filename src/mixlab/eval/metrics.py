"""Headline metrics per task: which logged scalars the run tables report, and in which direction.

A leaf module (no mixlab imports, no command): read by the ``compare`` command and by the
training-time TensorBoard HParams callback (:mod:`mixlab.tb`). Adding a task: add its entry to
:data:`TASK_METRICS` (see README "Adding a task").
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

__all__ = ["Metric", "TASK_METRICS", "DEFAULT_METRICS", "task_metrics"]


@dataclass(frozen=True)
class Metric:
    """One table column of a task.

    Attributes:
        tag: scalar tag; may be an ``fnmatch`` pattern (``resolution/*/top1``): the first
            matching tag in sorted order is used.
        label: column label, with the unit where the value has one (``top-1 (%)``); ``{step}`` is replaced
            by the step for ``by_step`` metrics.
        higher_is_better: direction (bold = best).
        by_step: one column per logged step (the step is a length or a resolution, e.g.
            ``length/ppl`` at step = context length), instead of the final value.
    """

    tag: str
    label: str
    higher_is_better: bool
    by_step: bool = False


TASK_METRICS: dict[str, list[Metric]] = {
    "genome": [Metric("test/bits_per_base", "bits/base", False)],
    "text": [Metric("test/ppl", "PPL", False), Metric("length/ppl", "PPL@{step}", False, by_step=True)],
    "imagenet": [Metric("test/top1", "top-1 (%)", True),
                 Metric("resolution/*/top1", "top-1@{step}px (%)", True, by_step=True)],
    "digits": [Metric("test/top1", "top-1 (%)", True),
               Metric("resolution/*/top1", "top-1@{step}px (%)", True, by_step=True)],
    "vqa_*": [Metric("test/acc_heldout", "held-out acc", True), Metric("test/acc_seen", "seen acc", True)],
    "mad_*": [Metric("test/acc", "acc", True)],
    "regbench": [Metric("test/regbench_acc", "acc", True)],
    "parity": [Metric("test/acc", "acc", True)],
    "copy_mixture": [Metric("test/excess_nll", "excess NLL", False)],
    "passkey": [Metric("test/span_acc", "span acc", True)],
    "niah": [Metric("test/span_acc", "span acc", True)],
}
"""Task name (a datamodule's ``task_name``, ``fnmatch`` pattern) -> its table metrics. Extend by adding an entry."""

DEFAULT_METRICS = [Metric("test/loss", "loss", False)]


def task_metrics(task: str) -> list[Metric]:
    """Metrics of ``task``: exact key of :data:`TASK_METRICS`, else the first matching pattern, else ``test/loss``."""
    if task in TASK_METRICS:
        return TASK_METRICS[task]
    for pattern, metrics in TASK_METRICS.items():
        if fnmatch.fnmatchcase(task, pattern):
            return metrics
    return DEFAULT_METRICS
