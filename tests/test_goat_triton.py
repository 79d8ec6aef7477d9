"""The Triton lane kernels (GPU fast path) equal the torch GoatLanes, run on CPU by Triton's interpreter."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_triton_lanes_equal_torch_lanes_under_interpreter():
    script = Path(__file__).parent / "helpers" / "goat_triton_check.py"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    errors = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(errors) == {"layer_causal_T260", "self_mlp", "batch_q_default", "no_mlp_T1", "alibi_like_R0",
                           "layer_causal_T70", "layer_T1", "layer_bias", "layer_2d_per_sample_default",
                           "layer_2d_shared_batch_chunks", "layer_2d_scaled", "layer_head_dim_24",
                           "split_plain_T37", "split_plain_T1", "compiled_layer_causal_T37", "compiled_layer_2d",
                           "rope_causal_T37", "rope_T1", "rope_2d_per_sample_bias"}
    for name, err in errors.items():
        assert err < 1e-4, (name, err)
