"""Gated delta-rule family: chunkwise torch path and recurrence vs an independent float64 loop
written here in the paper's form (FG²-GDN arXiv 2604.19021, Eqs. 7, 10-13), gradcheck,
step-wise decoding, packed sequences, bad input, extreme gates, fused gate preparation."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from mixlab.backbone import parse_pattern
from mixlab.ops.delta_rule import delta_rule, delta_rule_chunk, delta_rule_recurrent, gated_delta_rule
from mixlab.ops.fg2_gate import fg2_gate_prep_torch
from mixlab.registry import build_mixer

DT = torch.float64
VARIANTS = ["deltanet", "gdn", "kda", "fg2gdn", "fg2gdn_plus", "fgbgdn", "kda_kvbeta"]
# (decay alpha, key-side rate, value-side rate): "v" = channel-wise, "s" = scalar per head, None = absent / tied
GATES = {
    "deltanet": (None, "s", None),
    "gdn": ("s", "s", None),
    "kda": ("v", "s", None),
    "fg2gdn": ("v", "v", None),
    "fg2gdn_plus": ("v", "v", "v"),
    "fgbgdn": ("s", "v", None),
    "kda_kvbeta": ("v", "s", "s"),
}


def paper_loop(q, k, v, alpha, beta, beta_v=None, S0=None, scale=None):
    """S_t = (I - k^ k^T) Diag(alpha_t) S_{t-1} + k^ v~^T, k^ = sqrt(beta) k, v~ = sqrt(beta_v or beta) v,
    o_t = S_t^T q_t scale; for a scalar beta without beta_v: (I - b k k^T) Diag(a) S + b k v^T.
    One (batch, head) at a time, explicit matrices. alpha: None, [B,T,H] or [B,T,H,K] (decay factors)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    o = torch.zeros(B, T, H, V, dtype=DT)
    S_out = torch.zeros(B, H, K, V, dtype=DT)
    eye = torch.eye(K, dtype=DT)
    for b in range(B):
        for h in range(H):
            S = torch.zeros(K, V, dtype=DT) if S0 is None else S0[b, h].clone()
            for t in range(T):
                a = torch.ones(K, dtype=DT) if alpha is None else alpha[b, t, h] * torch.ones(K, dtype=DT)
                kt, vt = k[b, t, h], v[b, t, h]
                if beta.dim() == 3 and beta_v is None:
                    bt = beta[b, t, h]
                    S = (eye - bt * torch.outer(kt, kt)) @ torch.diag(a) @ S + bt * torch.outer(kt, vt)
                else:
                    kh = beta[b, t, h].sqrt() * kt
                    bv = beta if beta_v is None else beta_v
                    vh = bv[b, t, h].sqrt() * vt
                    S = (eye - torch.outer(kh, kh)) @ torch.diag(a) @ S + torch.outer(kh, vh)
                o[b, t, h] = S.T @ (q[b, t, h] * scale)
            S_out[b, h] = S
    return o, S_out


def random_inputs(variant, B=2, T=13, H=2, K=4, V=None, seed=0, max_rate=1.0):
    g_ = torch.Generator().manual_seed(seed)
    V = K if V is None else V
    r = lambda *s: torch.randn(*s, generator=g_, dtype=DT)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=g_, dtype=DT)  # noqa: E731
    da, bk, bv = GATES[variant]
    q, k, v = r(B, T, H, K), F.normalize(r(B, T, H, K), dim=-1), r(B, T, H, V)
    alpha = None if da is None else (0.5 + 0.5 * u(B, T, H) if da == "s" else 0.5 + 0.5 * u(B, T, H, K))
    beta = max_rate * (u(B, T, H) if bk == "s" else u(B, T, H, K))
    beta_v = None if bv is None else max_rate * (u(B, T, H) if bv == "s" else u(B, T, H, V))
    return q, k, v, alpha, beta, beta_v, r(B, H, K, V)


@pytest.mark.parametrize("T", [1, 7, 16, 37], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("variant", VARIANTS)
def test_chunk_and_recurrence_equal_paper_loop(variant, T):
    q, k, v, alpha, beta, beta_v, S0 = random_inputs(variant, T=T, seed=T)
    want, want_S = paper_loop(q, k, v, alpha, beta, beta_v, S0)
    g = None if alpha is None else alpha.log()
    for impl, kw in [("chunk", dict(chunk_size=16)), ("chunk", dict(chunk_size=8)), ("recurrent", {})]:
        o, S = gated_delta_rule(q, k, v, g, beta, beta_v, initial_state=S0, output_final_state=True, impl=impl, **kw)
        torch.testing.assert_close(o, want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(S, want_S, rtol=1e-10, atol=1e-10)


def test_negative_eigenvalue_rates_equal_paper_loop():
    for variant in ["gdn", "fg2gdn", "fg2gdn_plus"]:
        q, k, v, alpha, beta, beta_v, S0 = random_inputs(variant, T=21, seed=3, max_rate=2.0)
        want, _ = paper_loop(q, k, v, alpha, beta, beta_v, S0)
        o, _ = gated_delta_rule(q, k, v, alpha.log(), beta, beta_v, initial_state=S0, chunk_size=8)
        torch.testing.assert_close(o, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("variant", VARIANTS)
def test_packed_varlen_equals_separate_sequences(variant):
    lens = [5, 1, 17, 0, 9]
    q, k, v, alpha, beta, beta_v, _ = random_inputs(variant, B=1, T=sum(lens), seed=11)
    S0 = torch.randn(len(lens), 2, 4, 4, dtype=DT)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)))
    g = None if alpha is None else alpha.log()
    o, S = gated_delta_rule(q, k, v, g, beta, beta_v, initial_state=S0, output_final_state=True, cu_seqlens=cu,
                            chunk_size=8)
    o_rec, S_rec = gated_delta_rule(q, k, v, g, beta, beta_v, initial_state=S0, output_final_state=True, cu_seqlens=cu,
                                    impl="recurrent")
    torch.testing.assert_close(o, o_rec, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(S, S_rec, rtol=1e-10, atol=1e-10)
    for n, (s0, s1) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        sl = lambda x: None if x is None else x[:, s0:s1]  # noqa: E731
        want, want_S = paper_loop(sl(q), sl(k), sl(v), sl(alpha), sl(beta), sl(beta_v), S0[n : n + 1])
        torch.testing.assert_close(o[:, s0:s1], want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(S[n : n + 1], want_S, rtol=1e-10, atol=1e-10)


def test_fg2_with_equal_channel_rates_is_kda_and_plus_with_tied_rates_is_fg2():
    q, k, v, alpha, beta, _, S0 = random_inputs("kda", T=23, seed=7)
    g = alpha.log()
    kda, _ = gated_delta_rule(q, k, v, g, beta, initial_state=S0, chunk_size=8)
    fg2, _ = gated_delta_rule(q, k, v, g, beta.unsqueeze(-1).expand(-1, -1, -1, 4), initial_state=S0, chunk_size=8)
    torch.testing.assert_close(fg2, kda, rtol=1e-10, atol=1e-10)
    _, _, _, _, bvec, _, _ = random_inputs("fg2gdn", T=23, seed=8)
    fg2, _ = gated_delta_rule(q, k, v, g, bvec, initial_state=S0, chunk_size=8)
    plus, _ = gated_delta_rule(q, k, v, g, bvec, bvec.clone(), initial_state=S0, chunk_size=8)
    torch.testing.assert_close(plus, fg2, rtol=1e-12, atol=1e-12)


def test_fg2_plus_layer_with_tied_projections_equals_fg2_layer():
    torch.manual_seed(0)
    a = build_mixer("fg2gdn", d_model=16, n_heads=2, causal=True, chunk_size=8).double()
    b = build_mixer("fg2gdn_plus", d_model=16, n_heads=2, causal=True, chunk_size=8).double()
    b.load_state_dict(a.state_dict(), strict=False)
    b.bv_proj.load_state_dict(a.b_proj.state_dict())
    x = torch.randn(2, 11, 16, dtype=DT)
    torch.testing.assert_close(b(x), a(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", ["scalar-decay", "fg2plus-negeig"])
def test_gradcheck_chunk_path(case):
    torch.manual_seed(1)
    B, T, H, K, V = 1, 11, 1, 3, 3
    q = torch.randn(B, T, H, K, dtype=DT, requires_grad=True)
    kr = torch.randn(B, T, H, K, dtype=DT, requires_grad=True)
    v = torch.randn(B, T, H, V, dtype=DT, requires_grad=True)
    gs = (K,) if case != "scalar-decay" else ()
    g = (-torch.rand(B, T, H, *gs, dtype=DT)).requires_grad_()
    S0 = torch.randn(B, H, K, V, dtype=DT, requires_grad=True)
    rate = 2.0 if case == "fg2plus-negeig" else 1.0
    bs = (K,) if case.startswith("fg2") else ()
    beta = (rate * torch.rand(B, T, H, *bs, dtype=DT) + 0.05).requires_grad_()
    beta_v = (rate * torch.rand(B, T, H, V, dtype=DT) + 0.05).requires_grad_() if case == "fg2plus-negeig" else None
    inputs = [q, kr, v, g, beta, S0] + ([beta_v] if beta_v is not None else [])

    def f(q, kr, v, g, beta, S0, beta_v=None):
        o, S = gated_delta_rule(q, F.normalize(kr, dim=-1), v, g, beta, beta_v, initial_state=S0,
                                output_final_state=True, chunk_size=8, impl="chunk")
        return o, S

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6, fast_mode=True)


@pytest.mark.parametrize("variant", VARIANTS + ["fg2gdn_negeig"])
def test_layer_stepwise_decoding_and_recurrent_impl_equal_parallel_forward(variant):
    torch.manual_seed(0)
    name, extra = (variant, {}) if variant != "fg2gdn_negeig" else ("fg2gdn", dict(allow_neg_eigval=True))
    m = build_mixer(name, d_model=24, n_heads=2, causal=True, chunk_size=8, **extra).double()
    x = torch.randn(2, 19, 24, dtype=DT)
    full = m(x)
    assert full.abs().mean() > 1e-3
    m.impl = "recurrent"
    torch.testing.assert_close(m(x), full, rtol=1e-10, atol=1e-10)
    m.impl = "auto"  # chunks for the prefix, the recurrence for single tokens
    cache: dict = {}
    parts = ([m(x[:, :6], cache=cache)] + [m(x[:, t : t + 1], cache=cache) for t in range(6, 15)]
             + [m(x[:, 15:], cache=cache)])
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-10, atol=1e-10)
    assert cache["state"].dtype == DT and cache["state"].shape == (2, 2, 12, 12)


def test_layer_packed_sequences_equal_separate_forwards():
    torch.manual_seed(0)
    m = build_mixer("fg2gdn_plus", d_model=16, n_heads=2, causal=True, chunk_size=8).double()
    xs = [torch.randn(1, n, 16, dtype=DT) for n in (7, 2, 12)]
    cu = torch.tensor([0, 7, 9, 21])
    packed = m(torch.cat(xs, 1), cu_seqlens=cu)
    torch.testing.assert_close(packed, torch.cat([m(x) for x in xs], 1), rtol=1e-10, atol=1e-10)


def test_layer_gates_parameterisation_and_no_weight_decay_markers():
    m = build_mixer("kda", d_model=32, n_heads=2, causal=True)
    assert m.A_log._no_weight_decay and m.dt_bias._no_weight_decay
    A = m.A_log.exp()
    assert bool(((A >= 1 - 1e-5) & (A <= 16)).all())
    dt = F.softplus(m.dt_bias)
    assert bool(((dt > 0.99e-3) & (dt < 0.101)).all())
    g, bk, bv = m.gates(torch.randn(1, 5, 32))
    assert g.shape == (1, 5, 2, 16) and bool((g <= 0).all()) and bk.shape == (1, 5, 2) and bv is None
    m = build_mixer("fg2gdn_plus", d_model=32, n_heads=2, causal=True, value_dim=8)
    g, bk, bv = m.gates(torch.randn(1, 5, 32))
    assert bk.shape == (1, 5, 2, 16) and bv.shape == (1, 5, 2, 8)


@pytest.mark.parametrize("impl", ["chunk", "recurrent"])
def test_no_nan_at_4096_tokens_with_extreme_gates(impl):
    torch.manual_seed(0)
    B, T, H, K = 1, 4096 if impl == "chunk" else 512, 1, 8  # the token loop is slow: 512 tokens
    q = torch.randn(B, T, H, K)
    k = F.normalize(torch.randn(B, T, H, K), dim=-1).requires_grad_()
    v = (100 * torch.randn(B, T, H, K)).requires_grad_()
    # per-channel decays from "erase everything" (log alpha = -1e4) to "never forget" (0)
    g = torch.where(torch.rand(B, T, H, K) < 0.5, torch.full((B, T, H, K), -1e4), torch.zeros(B, T, H, K))
    g = g.requires_grad_()
    beta = (2.0 * torch.rand(B, T, H, K)).clamp_max(1.999).requires_grad_()  # negative eigenvalues
    o, S = gated_delta_rule(q, k, v, g, beta, output_final_state=True, impl=impl)
    assert bool(torch.isfinite(o).all()) and bool(torch.isfinite(S).all())
    assert o.abs().max() < 1e5  # bounded: every transition has spectral norm <= 1
    (o.square().mean() + S.square().mean()).backward()
    for t in (k, v, g, beta):
        assert bool(torch.isfinite(t.grad).all())


def test_bad_input_errors_are_named():
    with pytest.raises(ValueError, match="FG²-GDN.*d_k == d_v.*head_dim=8, value_dim=4"):
        build_mixer("fg2gdn", d_model=16, n_heads=2, causal=True, value_dim=4)
    build_mixer("fg2gdn_plus", d_model=16, n_heads=2, causal=True, value_dim=4)  # separate rates: allowed
    q = torch.randn(1, 10, 1, 4)
    with pytest.raises(ValueError, match="chunk_size=48 is not supported"):
        delta_rule_chunk(q, q, q, chunk_size=48)
    with pytest.raises(ValueError, match="chunk_size=48 is not supported"):
        build_mixer("fg2gdn", d_model=16, n_heads=2, causal=True, chunk_size=48)
    with pytest.raises(ValueError, match="initial_state is torch.float16.*float32"):
        delta_rule(q, q, q, initial_state=torch.zeros(1, 1, 4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="cached recurrent state is torch.bfloat16"):
        build_mixer("gdn", d_model=8, n_heads=1, causal=True)(
            torch.randn(1, 3, 8), cache={"state": torch.zeros(1, 1, 8, 8, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="unknown mixer 'fg2gnd'"):
        parse_pattern("fg2gdn*3,fg2gnd", 4)
    with pytest.raises(ValueError, match="causal=False is not supported"):
        build_mixer("kda", d_model=8, n_heads=1, causal=False)
    with pytest.raises(ValueError, match="needs d_k == d_v"):
        gated_delta_rule(q, q, torch.randn(1, 10, 1, 3), None, torch.rand(1, 10, 1, 4))
    with pytest.raises(ValueError, match="cu_seqlens needs packed inputs with B=1"):
        delta_rule_recurrent(torch.randn(2, 4, 1, 4), torch.randn(2, 4, 1, 4), torch.randn(2, 4, 1, 4),
                             cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="cu_seqlens.*cannot be combined with a decoding cache"):
        build_mixer("gdn", d_model=8, n_heads=1, causal=True)(torch.randn(1, 3, 8), cache={},
                                                              cu_seqlens=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="impl='fla' cannot take these inputs: fla kernels need CUDA"):
        delta_rule(q, q, q, impl="fla")


_GATE_SCRIPT = r"""
import torch
from mixlab.ops.fg2_gate import fg2_gate_prep, fg2_gate_prep_torch
torch.manual_seed(0)
for sep, K, V, rate in [(False, 8, 8, 1.0), (True, 8, 6, 2.0), (False, 12, 12, 2.0)]:
    k = torch.randn(2, 5, 3, K, requires_grad=True); v = torch.randn(2, 5, 3, V, requires_grad=True)
    bk = (4 * torch.randn(2, 5, 3, K)).requires_grad_()
    bv = (4 * torch.randn(2, 5, 3, V)).requires_grad_() if sep else None
    ins = [k, v, bk] + ([bv] if sep else [])
    got = fg2_gate_prep(k, v, bk, bv, max_rate=rate, impl="triton")
    want = fg2_gate_prep_torch(k, v, bk, bv, max_rate=rate)
    up = (torch.randn_like(got[0]), torch.randn_like(got[1]))
    g1 = torch.autograd.grad(got, ins, up)
    g2 = torch.autograd.grad(want, ins, up)
    for a, b in list(zip(got, want)) + list(zip(g1, g2)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
print("OK")
"""


def test_fused_gate_prep_triton_kernel_equals_torch_forward_and_backward():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _GATE_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


def test_gate_prep_reference_equals_formula():
    torch.manual_seed(0)
    k, v = torch.randn(2, 3, 2, 4, dtype=DT), torch.randn(2, 3, 2, 5, dtype=DT)
    bk, bv = torch.randn(2, 3, 2, 4, dtype=DT), torch.randn(2, 3, 2, 5, dtype=DT)
    kt, vt = fg2_gate_prep_torch(k, v, bk, bv, max_rate=2.0, eps=0.0)
    torch.testing.assert_close(kt, (2 * torch.sigmoid(bk)).sqrt() * k / k.norm(dim=-1, keepdim=True))
    torch.testing.assert_close(vt, (2 * torch.sigmoid(bv)).sqrt() * v)


@pytest.mark.parametrize("name", ["deltanet", "gdn", "kda", "fg2gdn", "fg2gdn_plus", "hybrid_fg2gdn_mla"])
def test_shipped_genome_configs_build_and_run(name):
    """configs/genome/<name>.yaml: the backbone builds from the YAML and runs forward + backward."""
    from pathlib import Path

    import yaml

    from mixlab.backbone import Backbone, BackboneConfig

    path = Path(__file__).resolve().parents[1] / "configs" / "genome" / f"{name}.yaml"
    cfg = yaml.safe_load(path.read_text())["model"]["init_args"]["backbone"]
    torch.manual_seed(0)
    bb = Backbone(BackboneConfig(**cfg))
    y = bb(torch.randn(2, 40, cfg["d_model"]))
    y.square().mean().backward()
    assert bool(torch.isfinite(y).all()) and y.std() > 0.1


def test_short_conv_is_shared_loads_the_former_delta_weight_and_packs_sequences():
    """The delta-rule mixers use :class:`mixlab.mixers.layers.ShortConv` (one short convolution in
    mixlab); their former ``[C, W]`` weight still loads, and the formula is the one they had."""
    from mixlab.mixers.layers import ShortConv

    torch.manual_seed(0)
    conv = ShortConv(6, 4, bias=False).double()
    w = conv.weight.detach()[:, 0].clone()  # [C, W], as the delta mixers stored it
    x = torch.randn(2, 9, 6, dtype=torch.float64)
    xp = torch.cat([x.new_zeros(2, 3, 6), x], 1)
    want = F.silu(sum(xp[:, 3 - s: 3 - s + 9] * w[:, 3 - s] for s in range(4)))  # silu(sum_s w[W-1-s] x_{t-s})
    torch.testing.assert_close(conv(x), want, rtol=1e-12, atol=1e-12)
    fresh = ShortConv(6, 4, bias=False).double()
    fresh.load_state_dict({"weight": w})
    assert fresh.weight.shape == (6, 1, 4) and torch.equal(fresh.weight[:, 0], w)
    cu = torch.tensor([0, 4, 9])
    torch.testing.assert_close(conv(x[:1], cu_seqlens=cu), torch.cat([conv(x[:1, :4]), conv(x[:1, 4:])], 1),
                               rtol=0, atol=0)
    m = build_mixer("kda", d_model=16, n_heads=2, causal=True)
    assert all(type(c) is ShortConv and c.bias is None for c in (m.q_conv, m.k_conv, m.v_conv))


# ------------------------------------------------------------- correlated keys (issue 15)
def _correlated_inputs(decay, T=4096, B=1, H=2, K=32, noise=0.3, seed=0):
    """Keys sharing one direction (``k = normalize(u + noise * n)``: mean pairwise cosine ~0.9
    at noise 0.3, as in trained models), rates beta in [0, 2), float64."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=DT)  # noqa: E731
    u = F.normalize(r(K), dim=0)
    k = F.normalize(u + noise * r(B, T, H, K), dim=-1)
    beta = 2.0 * torch.rand(B, T, H, generator=gen, dtype=DT)
    g = {"none": None, "scalar": -0.1 * torch.rand(B, T, H, generator=gen, dtype=DT),
         "vector": -0.1 * torch.rand(B, T, H, K, generator=gen, dtype=DT)}[decay]
    return r(B, T, H, K), k, r(B, T, H, K), g, beta


_REFERENCE: dict = {}


def _recurrence_with_grads(decay):
    """Float64 token-by-token recurrence: output, final state and the gradients of a fixed
    random projection of both (cached per decay kind: the 4096-step loop is the slow part)."""
    if decay not in _REFERENCE:
        leaves = [x if x is None else x.clone().requires_grad_() for x in _correlated_inputs(decay)]
        o, S = delta_rule_recurrent(*leaves, output_final_state=True)
        gen = torch.Generator().manual_seed(1)
        wo, ws = torch.randn(o.shape, generator=gen, dtype=DT), torch.randn(S.shape, generator=gen, dtype=DT)
        ((o * wo).sum() + (S * ws).sum()).backward()
        _REFERENCE[decay] = (o.detach(), S.detach(), [None if x is None else x.grad for x in leaves], wo, ws)
    return _REFERENCE[decay]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("chunk_size", [16, 64], ids=lambda c: f"C{c}")
@pytest.mark.parametrize("decay", ["none", "scalar", "vector"])
def test_chunk_path_matches_float64_recurrence_for_correlated_keys(decay, chunk_size, dtype):
    """The UT-transform inverse must stay accurate when keys in a chunk share a direction and
    beta reaches 2 (the old repeated-squaring inverse was 1e-2 off at C=64 in float32 here):
    T=4096, output, final state and every gradient within 1e-5 (float32) / 1e-10 (float64)
    of the float64 recurrence, relative to the largest reference entry."""
    ref_o, ref_S, ref_grads, wo, ws = _recurrence_with_grads(decay)
    leaves = [x if x is None else x.to(dtype).requires_grad_() for x in _correlated_inputs(decay)]
    o, S = delta_rule_chunk(*leaves, output_final_state=True, chunk_size=chunk_size)
    ((o * wo.to(dtype)).sum() + (S * ws.to(dtype)).sum()).backward()
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    rel = lambda a, b: ((a.double() - b).abs().max() / b.abs().max()).item()  # noqa: E731
    assert rel(o, ref_o) < tol and rel(S, ref_S) < tol
    for name, x, want in zip("q k v g beta".split(), leaves, ref_grads):
        if x is not None:
            assert rel(x.grad, want) < tol, name


def test_unit_lower_inverse_equals_triangular_solve():
    """The block inverse against LAPACK's triangular solve (float64), strongly correlated rows."""
    from mixlab.ops.delta_rule import _unit_lower_inverse

    gen = torch.Generator().manual_seed(0)
    for C in (1, 2, 8, 64):
        k = F.normalize(1.0 + 0.1 * torch.randn(3, C, 16, generator=gen, dtype=DT), dim=-1)
        L = (1.9 * k @ k.transpose(-1, -2)).tril(-1)
        want = torch.linalg.solve_triangular(torch.eye(C, dtype=DT) + L, torch.eye(C, dtype=DT).expand(3, C, C),
                                             upper=False, unitriangular=True)
        torch.testing.assert_close(_unit_lower_inverse(L), want, rtol=1e-12, atol=1e-12)
