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
