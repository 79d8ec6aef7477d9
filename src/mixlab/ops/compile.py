"""``cuda_compiled(fn)``: run ``fn`` through ``torch.compile`` on CUDA tensors, eagerly elsewhere.

Position-lane construction is a handful of tiny, batch-independent ops per layer; eagerly
each is a kernel launch, which dominates a short attention layer on a fast GPU. Compiled,
they fuse into a few kernels. CPU (tests, CI) stays eager: identical math, no compiler
needed. Set ``MIXLAB_COMPILE=0`` to disable compilation everywhere (``force``: also on CPU). Called
while ``torch.compile`` traces (a compiled block, a compiled model), ``fn`` is traced inline.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)

__all__ = ["cuda_compiled"]


def cuda_compiled(fn: F) -> F:
    compiled = None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal compiled
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        mode = os.environ.get("MIXLAB_COMPILE", "1")
        if first is None or mode == "0" or (first.device.type != "cuda" and mode != "force"):
            return fn(*args, **kwargs)
        if torch.compiler.is_compiling():  # inside a compiled block: traced into its graph (a nested
            return fn(*args, **kwargs)     # torch.compile would break that graph, H200 2026-12-02)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=False)
        return compiled(*args, **kwargs)

    wrapper.eager = fn  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]
