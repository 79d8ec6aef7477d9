"""Evaluation commands on trained checkpoints (``python -m mixlab <command>``).

* :mod:`mixlab.eval.length` - ``length-extrapolation``: perplexity at multiples of the
  training length and the position-wise NLL curve.
* :mod:`mixlab.eval.retrieval` - ``passkey`` / ``niah``: span metrics on a depth x length grid.
* :mod:`mixlab.eval.prior` - ``copy-prior``: GOAT's learned log-prior split into terms.
"""
