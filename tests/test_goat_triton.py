"""The Triton lane kernels (GPU fast path) equal the torch GoatLanes, run on CPU by Triton's interpreter."""

import pytest
from helpers.interpreter import run_interpreter_check

pytest.importorskip("triton")


def test_triton_lanes_equal_torch_lanes_under_interpreter():
    errors = run_interpreter_check("goat_triton_check.py")
    assert set(errors) == {"layer_causal_T260", "self_mlp", "batch_q_default", "no_mlp_T1", "alibi_like_R0",
                           "layer_causal_T70", "layer_T1", "layer_bias", "layer_2d_per_sample_default",
                           "layer_2d_shared_batch_chunks", "layer_2d_scaled", "layer_head_dim_24",
                           "split_plain_T37", "split_plain_T1", "compiled_layer_causal_T37", "compiled_layer_2d",
                           "rope_causal_T37", "rope_T1", "rope_2d_per_sample_bias", "compiled_rope_T37",
                           "compiled_rope_2d_per_sample", "traced_launch_shared_args"}
    for name, err in errors.items():
        assert err < 1e-4, (name, err)
