"""The boundary to fla's kernels (mixlab.ops.fla), checked on CPU with stand-ins that assert fla's
documented input contract (one dtype for q, k, v; contiguous; head dims >= 16; float32 gates and
states) and compute in float64: the casts and zero-padding must leave the values exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mixlab.ops.fla as fla
from mixlab.ops.delta_rule import _delta_rule_fla, delta_rule, delta_rule_recurrent
from mixlab.ops.mesa import mesa_chunk, mesa_fla

F64 = torch.float64


def _contract(*xs):
    assert len({x.dtype for x in xs}) == 1, f"mixed dtypes reached the kernel: {[x.dtype for x in xs]}"
    assert all(x.is_contiguous() for x in xs)
    assert xs[0].shape[-1] >= fla.MIN_HEAD_DIM


def _fake_chunk_kda(calls):
    def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, cu_seqlens=None):
        _contract(q, k, v)
        assert g.dtype == torch.float32 and g.shape == q.shape and beta.shape == q.shape[:3]
        assert initial_state is None or initial_state.dtype == torch.float32
        calls.append({"dtype": q.dtype, "K": q.shape[-1], "V": v.shape[-1]})
        o, s = delta_rule_recurrent(q.double(), k.double(), v.double(), g.double(), beta.double(), scale,
                                    None if initial_state is None else initial_state.double(), output_final_state,
                                    cu_seqlens)
        return o.to(v.dtype), (None if s is None else s.float())

    return chunk_kda


def _inputs(b=2, t=9, h=2, k=8, v=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=F64)  # noqa: E731
    return (r(b, t, h, k), F.normalize(r(b, t, h, k), dim=-1), r(b, t, h, v),
            -0.3 * torch.rand(b, t, h, k, generator=gen, dtype=F64),
            1.9 * torch.rand(b, t, h, generator=gen, dtype=F64),
            r(b, h, k, v))


def test_activation_dtype_follows_autocast_then_half_inputs_then_float32():
    x32, xbf = torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)
    assert fla.activation_dtype(x32, x32) == torch.float32
    assert fla.activation_dtype(x32, xbf) == torch.bfloat16  # bf16-true / mixed dtypes reaching the op
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fla.activation_dtype(x32, x32) == torch.bfloat16


def test_kda_boundary_casts_to_one_dtype_pads_small_heads_and_is_exact(monkeypatch):
    """q, k float32 next to a bfloat16 v (what bf16 autocast hands over): the kernel gets three
    bfloat16 tensors; K=8, V=8 are zero-padded to 16 and cut again: equal to the recurrence on
    the same bfloat16-rounded inputs (float64 stand-in), output and final state."""
    calls: list = []
    monkeypatch.setattr(fla, "import_op", lambda module, name: _fake_chunk_kda(calls))
    q, k, v, g, beta, s0 = _inputs()
    o, s = _delta_rule_fla(q.float(), k.float(), v.bfloat16(), g.float(), beta.float(), None, s0.float(), True, None)
    assert calls == [{"dtype": torch.bfloat16, "K": 16, "V": 16}]
    assert o.shape == v.shape and s.shape == s0.shape and o.dtype == torch.bfloat16
    rb = lambda x: x.bfloat16().double()  # noqa: E731
    want, want_s = delta_rule_recurrent(rb(q), rb(k), rb(v), g.float().double(), rb(beta), None, s0.float().double(),
                                        True)
    torch.testing.assert_close(o.double(), want, rtol=1e-2, atol=1e-2)  # output rounded to bfloat16
    torch.testing.assert_close(s.double(), want_s, rtol=1e-6, atol=1e-6)  # float32 state


def test_mesa_boundary_pads_to_tested_head_dims_with_unit_lambda_exactly(monkeypatch):
    """K=V=6 is handed to fla as 64 (its tested size), padded channels with Lambda = 1 and zero
    q/k/v/state: CG keeps them at 0, so the float64 stand-in equals the unpadded Mesa."""
    calls: list = []

    def chunk_mesa_net(q, k, v, g, beta, lamb, h_kk_init=None, h_kv_init=None, output_final_state=False,
                       max_CG_iteration=30):
        _contract(q, k, v)
        assert lamb.shape == (q.shape[2], q.shape[3]) and bool((lamb[:, 6:] == 1).all())
        calls.append(q.shape[-1])
        init = None if h_kk_init is None else (h_kk_init.double(), h_kv_init.double())
        o, st, _ = mesa_chunk(q.double(), k.double(), v.double(), g.double(), beta.double(), lamb.double(),
                              max_CG_iteration, None, 64, init, output_final_state)
        return o.to(v.dtype), st[0].float(), st[1].float()

    monkeypatch.setattr(fla, "import_op", lambda module, name: chunk_mesa_net)
    monkeypatch.setattr(fla, "unserved", lambda *a: None)
    gen = torch.Generator().manual_seed(3)
    b, t, h, d = 2, 11, 2, 6
    q = F.normalize(torch.randn(b, t, h, d, generator=gen, dtype=F64), dim=-1)
    k = F.normalize(torch.randn(b, t, h, d, generator=gen, dtype=F64), dim=-1)
    v = torch.randn(b, t, h, d, generator=gen, dtype=F64)
    g, beta = -torch.rand(b, t, h, generator=gen, dtype=F64), torch.rand(b, t, h, generator=gen, dtype=F64)
    lamb = 0.25 + torch.rand(h, d, generator=gen, dtype=F64)
    o, st = mesa_fla(q.float(), k.float(), v.float(), g, beta, lamb, 30, None, True)
    assert calls == [64] and o.shape == v.shape and st[0].shape == (b, h, d, d)
    want, want_st, _ = mesa_chunk(q.float().double(), k.float().double(), v.float().double(), g.float().double(),
                                  beta.float().double(), lamb.float().double(), 30, None, 64, None, True)
    torch.testing.assert_close(o.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(st[1].double(), want_st[1], rtol=1e-5, atol=1e-6)


def test_padded_dims_and_unserved_reasons():
    assert [fla.padded_dim(d, "kda") for d in (4, 16, 24, 128)] == [16, 16, 24, 128]
    assert [fla.padded_dim(d, "mesa") for d in (6, 32, 64, 96, 128)] == [64, 64, 64, 128, 128]
    x = torch.zeros(1, 32, 1, 16)
    assert "CUDA" in fla.unserved("kda", x, x, x)
    with pytest.raises(ValueError, match="impl='fla' cannot take these inputs: fla kernels need CUDA"):
        delta_rule(x, x, x, impl="fla")


def test_autotune_limit_keeps_the_least_shared_memory_config_first():
    class Cfg:
        def __init__(self, warps, stages, **kw):
            self.num_warps, self.num_stages, self.kwargs = warps, stages, kw

    configs = [Cfg(4, 2, BK=64), Cfg(8, 3, BK=64), Cfg(2, 1, BK=32), Cfg(4, 2, BK=128), Cfg(4, 4, BK=16)]
    kept = fla._keep(configs, 2)
    assert kept[0] is configs[2] and kept[1] is configs[3]  # safest, then closest to 4 warps / 2 stages
    assert fla._keep(configs, 1) == [configs[2]]
