"""Hawk (RG-LRU), GLA, Mamba2 and SWA: fast paths against loops / explicit formulas in float64,
decoding with a cache against the parallel forward, the hawk,mesa hybrid pattern."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mixlab.backbone import Backbone, BackboneConfig
from mixlab.coords import Coords
from mixlab.ops.gla import gla, gla_chunk, gla_recurrent, mamba2_ssd, mamba2_ssd_loop, simple_gla
from mixlab.ops.scan import linear_scan, linear_scan_chunk, linear_scan_loop
from mixlab.registry import build_mixer

F64 = torch.float64
LENGTHS = [1, 7, 37]


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _mixer(name, **kw):
    torch.manual_seed(0)
    m = build_mixer(name, **{**dict(d_model=24, n_heads=2, causal=True, layer_idx=0, n_layers=1), **kw})
    return m.double().eval()


@torch.no_grad()
def _assert_decoding_equals_parallel(m, t=9, split=5):
    x = torch.randn(2, t, 24, generator=_gen(1), dtype=F64)
    y = m(x)
    cache: dict = {}
    steps = torch.cat([m(x[:, i : i + 1], None, cache) for i in range(t)], dim=1)
    torch.testing.assert_close(steps, y, rtol=1e-10, atol=1e-10)
    cache = {}
    two = torch.cat([m(x[:, :split], None, cache), m(x[:, split:], None, cache)], dim=1)
    torch.testing.assert_close(two, y, rtol=1e-10, atol=1e-10)
    return x, y


# ---------------------------------------------------------------------------- scan / Hawk
@pytest.mark.parametrize("t", LENGTHS, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_linear_scan_chunk_equals_loop(t, chunk):
    g = _gen(t)
    x = torch.randn(2, t, 5, generator=g, dtype=F64)
    a = -torch.rand(2, t, 5, generator=g, dtype=F64) * 4
    h0 = torch.randn(2, 5, generator=g, dtype=F64)
    y_ref, s_ref = linear_scan_loop(x, a, h0)
    y, s = linear_scan_chunk(x, a, h0, chunk_size=chunk)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s, s_ref, rtol=1e-12, atol=1e-12)
    # the loop itself against the formula h_t = sum_i prod_{s=i+1..t} exp(g_s) x_i + prod exp(g) h0
    tt = t - 1
    want = torch.exp(a[:, : tt + 1].sum(1)) * h0 + sum(torch.exp(a[:, i + 1 : tt + 1].sum(1)) * x[:, i] for i in range(t))
    torch.testing.assert_close(y_ref[:, -1], want, rtol=1e-12, atol=1e-12)


def test_linear_scan_bad_input():
    with pytest.raises(ValueError, match="x and g"):
        linear_scan(torch.zeros(1, 3, 4), torch.zeros(1, 3, 5))
    with pytest.raises(ValueError, match="impl"):
        linear_scan(torch.zeros(1, 3, 4), torch.zeros(1, 3, 4), impl="cuda")


@pytest.mark.parametrize("t", LENGTHS, ids=lambda t: f"T{t}")
@torch.no_grad()
def test_hawk_equals_griffin_rglru_loop(t):
    m = _mixer("hawk")
    x = torch.randn(2, t, 24, generator=_gen(2), dtype=F64)
    y = m(x)
    # Griffin Sec. 2.4 written out token by token, from the mixer's own parameters
    gate = F.gelu(m.in_gate(x), approximate="tanh")
    u = m.conv(m.in_x(x))
    nh, bw = m.gate_w.shape[1], m.gate_w.shape[2]
    ub = u.view(2, t, nh, bw)
    r = torch.sigmoid(torch.einsum("bthi,hij->bthj", ub, m.gate_w[0]) + m.gate_b[0]).reshape(2, t, -1)
    i_g = torch.sigmoid(torch.einsum("bthi,hij->bthj", ub, m.gate_w[1]) + m.gate_b[1]).reshape(2, t, -1)
    a_base = torch.sigmoid(m.lam)
    h = torch.zeros(2, m.width, dtype=F64)
    hs = []
    for s in range(t):
        a = a_base ** (m.c * r[:, s])
        h = a * h + torch.sqrt(1 - a * a) * (i_g[:, s] * u[:, s])
        hs.append(h)
    want = m.out(torch.stack(hs, 1) * gate)
    torch.testing.assert_close(y, want, rtol=1e-10, atol=1e-12)
    # a^c initialised uniform in [0.9, 0.999]
    ac = a_base ** m.c
    assert float(ac.min()) >= 0.9 - 1e-9 and float(ac.max()) <= 0.999 + 1e-9


def test_hawk_decoding_equals_parallel():
    _assert_decoding_equals_parallel(_mixer("hawk"))


# ---------------------------------------------------------------------------- GLA / Mamba2
@pytest.mark.parametrize("t", LENGTHS, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("vector", [True, False], ids=["gla", "simple"])
def test_gla_chunk_equals_recurrent(t, vector):
    g = _gen(3)
    q, k = torch.randn(2, t, 2, 4, generator=g, dtype=F64), torch.randn(2, t, 2, 4, generator=g, dtype=F64)
    v = torch.randn(2, t, 2, 3, generator=g, dtype=F64)
    gate = -torch.rand((2, t, 2, 4) if vector else (2, t, 2), generator=g, dtype=F64) * 2
    s0 = torch.randn(2, 2, 4, 3, generator=g, dtype=F64)
    o_ref, s_ref = gla_recurrent(q, k, v, gate, None, s0)
    o, s = gla_chunk(q, k, v, gate, None, s0, chunk_size=4)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s, s_ref, rtol=1e-12, atol=1e-12)
    # the recurrence against the explicit sum o_t = sum_{i<=t} (q_t * prod decay) . k_i v_i + decayed s0
    tt = t - 1
    gv = gate if vector else gate.unsqueeze(-1).expand(2, t, 2, 4)
    acc = torch.einsum("bhk,bhkv->bhv", q[:, tt] * torch.exp(gv[:, : tt + 1].sum(1)), s0)
    for i in range(t):
        w = q[:, tt] * torch.exp(gv[:, i + 1 : tt + 1].sum(1)) * k[:, i]
        acc = acc + w.sum(-1, keepdim=True) * v[:, i]
    torch.testing.assert_close(o_ref[:, -1], acc / 2.0, rtol=1e-12, atol=1e-12)  # scale = 4 ** -0.5


def test_gla_bad_gate_shape():
    q = torch.zeros(1, 3, 2, 4)
    with pytest.raises(ValueError, match="per key channel"):
        gla(q, q, q, torch.zeros(1, 3, 2))
    with pytest.raises(ValueError, match="per head"):
        simple_gla(q, q, q, torch.zeros(1, 3, 2, 4))


@pytest.mark.parametrize("t", LENGTHS, ids=lambda t: f"T{t}")
def test_mamba2_simple_gla_mapping_equals_loop(t):
    g = _gen(4)
    x = torch.randn(2, t, 3, 5, generator=g, dtype=F64)
    dt = F.softplus(torch.randn(2, t, 3, generator=g, dtype=F64))
    a = -torch.rand(3, generator=g, dtype=F64) * 8
    bm, cm = torch.randn(2, t, 3, 4, generator=g, dtype=F64), torch.randn(2, t, 3, 4, generator=g, dtype=F64)
    s0 = torch.randn(2, 3, 4, 5, generator=g, dtype=F64)
    y_ref, s_ref = mamba2_ssd_loop(x, dt, a, bm, cm, s0)
    y, s = mamba2_ssd(x, dt, a, bm, cm, s0, chunk_size=4)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s, s_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name,kw", [("gla", {}), ("gla", {"conv_size": 4}), ("mamba2", {"d_state": 8})],
                         ids=["gla", "gla-conv", "mamba2"])
def test_gla_family_decoding_equals_parallel_and_chunk_equals_recurrent(name, kw):
    m = _mixer(name, **kw)
    x, y = _assert_decoding_equals_parallel(m)
    m.impl = "recurrent"
    with torch.no_grad():
        torch.testing.assert_close(m(x), y, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------- SWA
def _band_attention_explicit(m, x, window):
    """softmax over keys j with i - window < j <= i, by loops over queries (batch 0)."""
    t = x.shape[1]
    q, k, v = m.qkv_heads(x, Coords.seq(t))
    out = torch.empty_like(q)
    for i in range(t):
        lo = max(0, i - window + 1)
        z = q[:, :, i : i + 1] @ k[:, :, lo : i + 1].transpose(-1, -2) / math.sqrt(m.head_dim)
        out[:, :, i : i + 1] = torch.softmax(z, -1) @ v[:, :, lo : i + 1]
    return m.proj(out.transpose(1, 2).reshape(x.shape[0], t, -1))


@pytest.mark.parametrize("t", LENGTHS, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("window", [1, 4, 64])
@pytest.mark.parametrize("impl", ["mask", "reference"])
@torch.no_grad()
def test_swa_equals_banded_dense_attention(t, window, impl):
    m = _mixer("swa", window=window, impl=impl)
    x = torch.randn(2, t, 24, generator=_gen(5), dtype=F64)
    torch.testing.assert_close(m(x), _band_attention_explicit(m, x, window), rtol=1e-10, atol=1e-12)
    if window >= t:  # the window covers everything: plain causal attention
        q, k, v = m.qkv_heads(x, Coords.seq(t))
        full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.testing.assert_close(m(x), m.proj(full.transpose(1, 2).reshape(2, t, -1)), rtol=1e-10, atol=1e-12)


def test_swa_decoding_equals_parallel_with_bounded_cache():
    m = _mixer("swa", window=3)
    _assert_decoding_equals_parallel(m, t=11, split=6)
    cache: dict = {}
    with torch.no_grad():
        for i in range(7):
            m(torch.randn(1, 1, 24, dtype=F64), None, cache)
    assert cache["k"].shape[2] == 2 and cache["n"] == 7


@pytest.mark.parametrize("kw,match", [(dict(window=0), "window"), (dict(position="goat"), "position"),
                                      (dict(impl="flash"), "impl")])
def test_swa_bad_config(kw, match):
    with pytest.raises(ValueError, match=match):
        _mixer("swa", **kw)


# ---------------------------------------------------------------------------- hybrid
@torch.no_grad()
def test_hawk_mesa_hybrid_pattern_decodes_like_parallel():
    torch.manual_seed(0)
    cfg = BackboneConfig(d_model=24, n_layers=2, n_heads=2, mixer="hawk,mesa",
                         mixer_args={"mesa": {"chunk_size": 4, "eval_cg_eps": None}})
    net = Backbone(cfg).double().eval()
    assert net.pattern == ["hawk", "mesa"]
    x = torch.randn(1, 7, 24, generator=_gen(6), dtype=F64)
    y = net(x)
    caches = [{} for _ in range(2)]
    steps = torch.cat([net(x[:, i : i + 1], None, caches) for i in range(7)], dim=1)
    torch.testing.assert_close(steps, y, rtol=1e-9, atol=1e-10)
    assert bool(torch.isfinite(y).all()) and float(y.std()) > 0
