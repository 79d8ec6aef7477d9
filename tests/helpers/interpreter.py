"""Run a check script of ``tests/helpers`` under Triton's CPU interpreter and read its JSON result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_interpreter_check(name: str, timeout: float = 600) -> dict:
    """``python tests/helpers/<name>`` with ``TRITON_INTERPRET=1`` -> the JSON object on its last stdout line.

    Raises:
        AssertionError: the script failed (its stderr tail in the message).
    """
    script = Path(__file__).parent / name
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


_LOOP_PROBE = """
import torch, triton, triton.language as tl

@triton.jit
def _loop(o_ptr, n):
    s = 0.0
    for _ in range(n):
        s += 1.0
    tl.store(o_ptr, s)

o = torch.zeros(1)
_loop[(1,)](o, 3)
assert float(o) == 3.0
"""


def interpreter_cannot_loop() -> str | None:
    """Why this Triton's CPU interpreter cannot run a ``for`` loop bounded by a runtime argument, or None.

    Triton 3.6's interpreter turns the bound into a one-element array, and ``int()`` of it fails under numpy 2.4
    (``TypeError: only 0-dimensional arrays can be converted to Python scalars``); Triton 3.8's works. The compiled
    kernels are not affected (they are checked on the GPU).
    """
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", _LOOP_PROBE], env=env, capture_output=True, text=True, timeout=300)
    if out.returncode == 0:
        return None
    import numpy
    import triton

    last = (out.stderr.strip().splitlines() or ["?"])[-1]
    return (f"Triton {triton.__version__}'s interpreter cannot run a loop with a runtime bound under numpy "
            f"{numpy.__version__} ({last[-160:]})")
