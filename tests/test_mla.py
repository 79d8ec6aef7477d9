"""MLA (decoupled RoPE) against an explicit float64 formula written here; cached decoding;
the 3:1 delta-rule / MLA hybrid backbone."""

from __future__ import annotations

import math

import pytest
import torch

from mixlab.backbone import Backbone, BackboneConfig
from mixlab.coords import Coords
from mixlab.registry import build_mixer

DT = torch.float64


def rms(x, w, eps):
    return x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps) * w


def rope_explicit(x, pos, base):
    """GPT-NeoX half rotation: pair (i, i + d/2) rotated by pos * base^(-2i/d). x [T, d]."""
    d = x.shape[-1]
    out = x.clone()
    for t in range(x.shape[0]):
        for i in range(d // 2):
            ang = float(pos[t]) * base ** (-2 * i / d)
            a, b = x[t, i], x[t, i + d // 2]
            out[t, i] = a * math.cos(ang) - b * math.sin(ang)
            out[t, i + d // 2] = b * math.cos(ang) + a * math.sin(ang)
    return out


@torch.no_grad()
def mla_explicit(m, x, pos):
    """DeepSeek-V2 Eqs. 9-19 for batch row 0, head by head."""
    H, dn, dr, dv, dc = m.n_heads, m.nope_dim, m.rope_dim, m.v_dim, m.kv_rank
    x = x[0]
    T = x.shape[0]
    if m.q_rank:
        cq = rms(x @ m.q_a.weight.T, m.q_norm.weight, m.q_norm.eps)
        qall = cq @ m.q_b.weight.T
    else:
        qall = x @ m.q_proj.weight.T
    a = x @ m.kv_a.weight.T
    ckv = rms(a[:, :dc], m.kv_norm.weight, m.kv_norm.eps)
    kr = rope_explicit(a[:, dc:], pos, m.rope.base)
    kvall = ckv @ m.kv_b.weight.T
    outs = []
    for h in range(H):
        qh = qall[:, h * (dn + dr) : (h + 1) * (dn + dr)]
        qn, qr = qh[:, :dn], rope_explicit(qh[:, dn:], pos, m.rope.base)
        kvh = kvall[:, h * (dn + dv) : (h + 1) * (dn + dv)]
        kn, v = kvh[:, :dn], kvh[:, dn:]
        z = (qn @ kn.T + qr @ kr.T) / math.sqrt(dn + dr)
        if m.causal:
            z = z.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        outs.append(torch.softmax(z, -1) @ v)
    return (torch.cat(outs, -1) @ m.o_proj.weight.T).unsqueeze(0)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("cfg", [dict(), dict(q_rank=12, kv_rank=10, rope_dim=4, v_dim=6)],
                         ids=["default", "lowrank-q"])
def test_mla_equals_explicit_formula(cfg, causal):
    torch.manual_seed(0)
    m = build_mixer("mla", d_model=32, n_heads=2, causal=causal, **cfg).double()
    with torch.no_grad():
        for n in (m.kv_norm, getattr(m, "q_norm", None)):
            if n is not None:
                n.weight.uniform_(0.5, 1.5)
    x = torch.randn(1, 9, 32, dtype=DT)
    c = Coords.seq(9, offset=3)
    want = mla_explicit(m, x, c.pos[0, :, 0])
    torch.testing.assert_close(m(x, c), want, rtol=1e-10, atol=1e-10)
    m.impl = "reference"
    torch.testing.assert_close(m(x, c), want, rtol=1e-10, atol=1e-10)


def test_mla_cached_decoding_equals_parallel_and_caches_only_the_latent():
    torch.manual_seed(0)
    m = build_mixer("mla", d_model=32, n_heads=4, causal=True, kv_rank=12).double()
    x = torch.randn(2, 11, 32, dtype=DT)
    full = m(x)
    cache: dict = {}
    parts = ([m(x[:, :4], cache=cache)] + [m(x[:, t : t + 1], cache=cache) for t in range(4, 9)]
             + [m(x[:, 9:], cache=cache)])
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-10, atol=1e-10)
    assert cache["c_kv"].shape == (2, 11, 12) and cache["k_r"].shape == (2, 1, 11, m.rope_dim)


def test_mla_bad_arguments():
    with pytest.raises(ValueError, match="rope_dim=3"):
        build_mixer("mla", d_model=32, n_heads=2, causal=True, rope_dim=3)
    with pytest.raises(ValueError, match="mixer 'mla': impl must be 'sdpa' or 'reference'; got 'flash'"):
        build_mixer("mla", d_model=32, n_heads=2, causal=True, impl="flash")


def test_hybrid_3_to_1_backbone_decoding_equals_parallel():
    torch.manual_seed(0)
    cfg = BackboneConfig(d_model=32, n_layers=4, n_heads=2, mixer="fg2gdn*3,mla",
                         mixer_args={"fg2gdn": {"chunk_size": 8}})
    bb = Backbone(cfg).double()
    assert bb.pattern == ["fg2gdn", "fg2gdn", "fg2gdn", "mla"]
    x = torch.randn(2, 13, 32, dtype=DT)
    full = bb(x)
    caches = [{} for _ in range(4)]
    parts = [bb(x[:, :5], caches=caches)] + [bb(x[:, t : t + 1], caches=caches) for t in range(5, 13)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-9, atol=1e-9)
    # the gate parameters survive the backbone's generic init with their own init
    A = bb.blocks[0].mixer.A_log.exp()
    assert bool(((A >= 1 - 1e-5) & (A <= 16)).all())
    # any pattern: a mixed one
    Backbone(BackboneConfig(d_model=32, n_layers=4, n_heads=2, mixer="gdn,kda,fg2gdn_plus,mla"))(x.float())
