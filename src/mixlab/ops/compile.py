"""``torch.compile`` helpers: ``cuda_compiled(fn)`` runs ``fn`` through ``torch.compile`` on CUDA tensors,
eagerly elsewhere; :func:`kernel_op` registers a function that launches Triton kernels as an operator the
compiler can trace (:func:`traced_launch` launches them inside it).

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

__all__ = ["cuda_compiled", "kernel_op", "traced_launch"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


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


def traced_launch(fn, grid: tuple, args: tuple, kwargs: dict) -> None:
    """``fn[grid](*args, **kwargs)`` inside the body of a :func:`kernel_op` operator: through
    ``torch.library.wrap_triton``, which ``torch.compile`` records as a Triton kernel call that Inductor launches
    from its own wrapper (no Python per call). Under ``TRITON_INTERPRET=1`` a plain call."""
    (fn if _INTERPRET else torch.library.wrap_triton(fn))[grid](*args, **kwargs)


def kernel_op(name: str, fake: Callable, mutates: tuple[str, ...] = ()):
    """Decorator: register ``fn`` as the operator ``name`` (``"mixlab::..."``) for ``torch.compile``: a
    ``torch.library.triton_op``, whose body Inductor traces, so the compiled graph launches the Triton kernels
    itself (an opaque ``custom_op`` costs ~0.1 ms of host time per call, BENCHMARKS.md); ``mutates`` names the
    arguments it writes in place (Inductor writes into that buffer when nothing else reads it afterwards).
    Under Triton's CPU interpreter (``TRITON_INTERPRET=1``, the tests), whose kernels cannot be traced, a
    ``custom_op`` with the explicit ``fake`` (output shapes; ``None`` for an op that returns nothing) runs the
    same body instead."""
    def register(fn):
        if _INTERPRET:
            op = torch.library.custom_op(name, fn, mutates_args=mutates)
            op.register_fake(fake)
            return op
        return torch.library.triton_op(name, fn, mutates_args=mutates)
    return register
