"""The evaluation wing: commands on trained runs (``python -m mixlab <command>``) and what they share.

* :mod:`mixlab.eval.common` - :func:`~mixlab.eval.common.load_run` (a run from its checkpoint:
  head, datamodule and its arguments), :func:`~mixlab.eval.common.pyplot`, the chunked forward.
* :mod:`mixlab.eval.metrics` - the headline metric of every task (:data:`~mixlab.eval.metrics.TASK_METRICS`).
* :mod:`mixlab.eval.compare` - ``compare``: cross-task tables and curves from TensorBoard runs.
* :mod:`mixlab.eval.figures` - ``figure <name>``: the papers' analysis figures (``copy-prior`` is
  an alias of ``figure goat-prior``).
* :mod:`mixlab.eval.length` - ``length-extrapolation``: perplexity at multiples of the
  training length and the position-wise NLL curve.
* :mod:`mixlab.eval.retrieval` - ``passkey`` / ``niah``: span metrics on a depth x length grid.
* :mod:`mixlab.eval.resolution` - ``resolution``: image classifiers at other resolutions.
"""
