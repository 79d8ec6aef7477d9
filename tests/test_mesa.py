"""MesaNet: CG vs the exact solve, chunked vs per-token, adjoint backward vs autograd through
``torch.linalg.solve``, bad input, long sequences with forget gates near 1, the mixer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mixlab.mixers.mesa import Mesa
from mixlab.ops.mesa import (
    conjugate_gradient,
    mesa_chunk,
    mesa_exact,
    mesa_fla,
    mesa_net,
    mesa_recurrent,
    mesa_states,
)
from mixlab.registry import build_mixer

F64 = torch.float64


def _inputs(b=2, t=13, h=2, k=6, v=5, dtype=F64, gmin=-1.0, seed=0, state=False):
    gen = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)
    ru = lambda *s: torch.rand(*s, generator=gen, dtype=dtype)
    q = F.normalize(rn(b, t, h, k), dim=-1)
    kk = F.normalize(rn(b, t, h, k), dim=-1)
    out = [q, kk, rn(b, t, h, v), ru(b, t, h) * gmin, ru(b, t, h), ru(h, k) + 0.25]
    if state:
        a = rn(b, h, k, k) * 0.3
        out.append((a @ a.transpose(-1, -2), rn(b, h, k, v)))
    return out


# ---------------------------------------------------------------------------- forward values
@pytest.mark.parametrize("t", [1, 7, 37], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("state", [False, True], ids=["h0", "init"])
def test_cg30_matches_exact_solve_float64(t, state):
    *args, h0 = _inputs(t=t, state=True)
    h0 = h0 if state else None
    o_ex, s_ex = mesa_exact(*args, initial_state=h0, output_final_state=True)
    o_ch, s_ch, it_ch = mesa_chunk(*args, cg_iters=30, chunk_size=16, initial_state=h0, output_final_state=True)
    o_rec, s_rec, it_rec = mesa_recurrent(*args, cg_iters=30, initial_state=h0, output_final_state=True)
    assert (o_ch - o_ex).abs().max() < 1e-5 and (o_rec - o_ex).abs().max() < 1e-5
    for a, b in zip(s_ch, s_ex):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # chunked equals per-token (same CG, same start) to float64 round-off
    torch.testing.assert_close(o_ch, o_rec, rtol=1e-10, atol=1e-10)
    # K=6 systems: exact arithmetic CG converges in <= 6 steps; later steps see r == 0 or keep going
    assert it_ch.shape == (2, t, 2) and int(it_ch.max()) <= 30


def test_chunk_size_and_padding_do_not_change_values():
    args = _inputs(t=29)
    ref, _, _ = mesa_chunk(*args, cg_iters=30, chunk_size=29)
    for c in (1, 4, 8, 64):
        o, _, _ = mesa_chunk(*args, cg_iters=30, chunk_size=c)
        torch.testing.assert_close(o, ref, rtol=1e-10, atol=1e-10)


def test_conjugate_gradient_adaptive_meets_eps_and_counts():
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(50, 12, 12, generator=gen, dtype=F64)
    spd = a @ a.transpose(-1, -2) + torch.diag_embed(torch.linspace(0.25, 3.0, 12, dtype=F64)).expand(50, -1, -1)
    rhs = torch.randn(50, 12, generator=gen, dtype=F64)
    rhs[3] = 0.0  # zero right-hand side: converged before the first step
    mv = lambda p: (spd @ p.unsqueeze(-1)).squeeze(-1)
    for eps in (1e-2, 1e-6):
        x, it = conjugate_gradient(mv, rhs, max_iter=100, eps=eps)
        res = (rhs - mv(x)).norm(dim=-1)
        assert bool((res <= eps * rhs.norm(dim=-1) + 1e-300).all())
        assert int(it[3]) == 0 and int(it.max()) < 100 and int(it.min(0).values) >= 0
    x_fixed, it_fixed = conjugate_gradient(mv, rhs, max_iter=3)
    assert bool((it_fixed[torch.arange(50) != 3] == 3).all())
    # a cap below what eps needs stops at the cap
    _, it_cap = conjugate_gradient(mv, rhs, max_iter=2, eps=1e-12)
    assert int(it_cap.max()) == 2
    mv0 = lambda p: (spd[:1] @ p.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(x_fixed[0], conjugate_gradient(mv0, rhs[:1], max_iter=3)[0][0])


@pytest.mark.parametrize("eps", [1e-2, 1e-4])
def test_adaptive_chunked_equals_per_token_and_meets_eps(eps):
    q, k, v, g, beta, lamb = _inputs(t=23, k=8, v=8, gmin=-0.05)
    o_ch, _, it_ch = mesa_chunk(q, k, v, g, beta, lamb, cg_iters=30, cg_eps=eps, chunk_size=8)
    o_rec, _, it_rec = mesa_recurrent(q, k, v, g, beta, lamb, cg_iters=30, cg_eps=eps)
    torch.testing.assert_close(o_ch, o_rec, rtol=1e-9, atol=1e-9)
    assert torch.equal(it_ch, it_rec)
    assert 0 < float(it_ch.float().mean()) < 30
    # the stopping criterion holds for every token: rebuild x from o is not possible, so re-solve
    hs, _ = mesa_states(k, v, g, beta)
    mat = hs + torch.diag_embed(lamb)
    x, it = conjugate_gradient(lambda p: (mat @ p.unsqueeze(-1)).squeeze(-1), q, 30, eps)
    assert torch.equal(it, it_ch)
    assert bool(((q - (mat @ x.unsqueeze(-1)).squeeze(-1)).norm(dim=-1) <= eps * q.norm(dim=-1)).all())
    o_ex, _ = mesa_exact(q, k, v, g, beta, lamb)
    assert (o_ch - o_ex).norm() / o_ex.norm() < 10 * eps


# ---------------------------------------------------------------------------- backward
def test_adjoint_backward_gradcheck():
    *args, h0 = _inputs(b=1, t=5, h=1, k=3, v=2, state=True)
    leaves = [z.clone().requires_grad_() for z in (*args, *h0)]

    def fn(q, k, v, g, beta, lamb, hk, hv):
        o, (a, b), _ = mesa_chunk(q, k, v, g, beta, lamb, cg_iters=6, chunk_size=2, initial_state=(hk, hv),
                                  output_final_state=True)
        return o, a, b

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("t,chunk", [(1, 64), (11, 4), (16, 8)])
def test_adjoint_backward_equals_autograd_through_linalg_solve(t, chunk):
    *args, h0 = _inputs(b=2, t=t, h=2, k=5, v=4, state=True, seed=3)
    lc = [z.clone().requires_grad_() for z in (*args, *h0)]
    le = [z.clone().requires_grad_() for z in (*args, *h0)]
    o_c, s_c, _ = mesa_chunk(*lc[:6], cg_iters=30, chunk_size=chunk, initial_state=tuple(lc[6:]),
                             output_final_state=True)
    o_e, s_e = mesa_exact(*le[:6], initial_state=tuple(le[6:]), output_final_state=True)
    gen = torch.Generator().manual_seed(9)
    w = [torch.randn(z.shape, generator=gen, dtype=F64) for z in (o_c, *s_c)]
    loss_c = sum((wi * z).sum() for wi, z in zip(w, (o_c, *s_c)))
    loss_e = sum((wi * z).sum() for wi, z in zip(w, (o_e, *s_e)))
    gc = torch.autograd.grad(loss_c, lc)
    ge = torch.autograd.grad(loss_e, le)
    for name, a, b in zip(["q", "k", "v", "g", "beta", "lamb", "h_kk0", "h_kv0"], gc, ge):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-8, msg=lambda m, n=name: f"d{n}: {m}")


def test_adjoint_backward_adaptive_cg_close_to_exact():
    args = _inputs(b=1, t=20, h=2, k=6, v=6, gmin=-0.1, seed=4)
    la = [z.clone().requires_grad_() for z in args]
    le = [z.clone().requires_grad_() for z in args]
    w = torch.randn(1, 20, 2, 6, generator=torch.Generator().manual_seed(2), dtype=F64)
    (mesa_chunk(*la, cg_iters=30, cg_eps=1e-8, chunk_size=8)[0] * w).sum().backward()
    (mesa_exact(*le)[0] * w).sum().backward()
    for a, b in zip(la, le):
        assert float((a.grad - b.grad).norm() / b.grad.norm()) < 1e-6


# ---------------------------------------------------------------------------- long sequences
def test_no_nan_forget_gates_near_one_T4096():
    q, k, v, g, beta, lamb = _inputs(b=1, t=4096, h=1, k=8, v=8, dtype=torch.float32, gmin=-1e-4, seed=5)
    lamb = torch.full_like(lamb, 0.25)  # smallest regulariser: condition numbers ~ 1e4
    leaves = [z.clone().requires_grad_() for z in (q, k, v, g, beta, lamb)]
    o, _, it = mesa_chunk(*leaves, cg_iters=30, chunk_size=64)
    o.square().mean().backward()
    assert bool(torch.isfinite(o).all())
    assert all(bool(torch.isfinite(z.grad).all()) for z in leaves)
    o_ex, _ = mesa_exact(q.double(), k.double(), v.double(), g.double(), beta.double(), lamb.double())
    assert float((o.detach().double() - o_ex).norm() / o_ex.norm()) < 1e-3
    o_ad, _, it_ad = mesa_chunk(q, k, v, g, beta, lamb, cg_iters=30, cg_eps=1e-4, chunk_size=64)
    assert bool(torch.isfinite(o_ad).all()) and 0 < float(it_ad.float().mean()) < 30
    assert float((o_ad.double() - o_ex).norm() / o_ex.norm()) < 1e-3


def test_float32_states_and_gradients_track_float64_over_long_mixed_decay_sequences():
    """Strong decay for 2000 tokens (log decay summed to ~ -2000), then gates near one: the chunk-to-chunk decay
    matrix takes differences of large cumulative logs; float32 must stay as close to float64 as per-token math."""
    q, k, v, g, beta, lamb, h0 = _inputs(b=1, t=3000, h=2, k=8, v=8, gmin=-2.0, seed=11, state=True)
    g[:, 2000:] *= 1e-3
    w = torch.randn(v.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    out = {}
    for dt in (torch.float32, F64):
        leaves = [z.to(dt).requires_grad_() for z in (q, k, v, g, beta, lamb, *h0)]
        o, st, _ = mesa_chunk(*leaves[:6], cg_iters=30, chunk_size=16, initial_state=tuple(leaves[6:]),
                              output_final_state=True)
        ((o * w.to(dt)).sum() + st[0].sum() + st[1].sum()).backward()
        out[dt] = [o.detach(), *(z.detach() for z in st)] + [z.grad for z in leaves]
    names = ["o", "H_final", "G_final", "dq", "dk", "dv", "dg", "dbeta", "dlamb", "dh_kk0", "dh_kv0"]
    for name, a, b in zip(names, out[torch.float32], out[F64]):
        err = float((a.double() - b).norm() / b.norm())
        assert err < 2e-5, (name, err)


# ---------------------------------------------------------------------------- bad input
def test_bad_solver_arguments_raise():
    args = _inputs(t=3)
    with pytest.raises(ValueError, match="cg_iters"):
        mesa_chunk(*args, cg_iters=0)
    with pytest.raises(ValueError, match="cg_eps"):
        mesa_chunk(*args, cg_eps=0.0)
    with pytest.raises(ValueError, match="cg_eps"):
        mesa_recurrent(*args, cg_eps=-1e-4)
    with pytest.raises(ValueError, match="lamb"):
        mesa_chunk(*args[:5], torch.ones(3, 6, dtype=F64))
    with pytest.raises(ValueError, match="impl"):
        mesa_net(*args, impl="triton")
    big = _inputs(t=2, h=1, k=130, v=130, dtype=torch.float32)
    with pytest.raises(ValueError, match="head dims up to 128; got 130"):
        mesa_fla(*big)
    with pytest.raises(ValueError, match="fixed CG count"):
        mesa_net(*big, cg_eps=1e-4, impl="fla")
    # found by a user test: these reached NaN outputs or torch errors that named nothing
    with pytest.raises(ValueError, match=r"lamb \(the regulariser diagonal Lambda\) must be > 0; got min -0.5"):
        mesa_chunk(*args[:5], torch.full((2, 6), -0.5, dtype=F64))
    with pytest.raises(ValueError, match="lamb .* must be > 0; got min 0.0"):
        mesa_net(*args[:5], torch.zeros(2, 6, dtype=F64), impl="chunk")
    with pytest.raises(ValueError, match="chunk_size must be an integer >= 1; got 2.5"):
        mesa_chunk(*args, chunk_size=2.5)
    with pytest.raises(ValueError, match=r"T = 0"):
        mesa_chunk(*_inputs(t=0))
    *args_s, h0 = _inputs(t=3, state=True)
    with pytest.raises(ValueError, match="initial_state must be a pair .* got tuple of length 1"):
        mesa_chunk(*args_s, initial_state=(h0[0],))
    with pytest.raises(ValueError, match="cg_impl='torch' \\(mesa_chunk\\)"):
        mesa_chunk(*args, cg_impl="triton")


@pytest.mark.parametrize("kw,match", [
    (dict(lambda_floor=0.0), "lambda_floor"),
    (dict(lambda_floor=-0.1), "lambda_floor"),
    (dict(eval_cg_eps=0.0), "cg_eps"),
    (dict(cg_iters=0), "cg_iters"),
    (dict(cg_iters=10**9), r"cg_iters must be finite and >= 1 and <= 1000; got 1000000000"),  # ran as a hang
    (dict(causal=False), "causal"),
])
def test_mixer_bad_config_raises(kw, match):
    with pytest.raises(ValueError, match=match):
        build_mixer("mesa", **{**dict(d_model=16, n_heads=2, causal=True, layer_idx=0, n_layers=1), **kw})
    if "cg_iters" in kw:  # the class itself, built directly, refuses it too
        with pytest.raises(ValueError, match=r"cg_iters \(CG iteration count / cap\) must be an integer in \[1, 1000"):
            Mesa(d_model=16, n_heads=2, **kw)


# ---------------------------------------------------------------------------- mixer
@pytest.mark.parametrize("training", [True, False], ids=["train-fixed", "eval-adaptive"])
@torch.no_grad()
def test_mixer_decoding_equals_parallel_and_reports_iterations(training):
    torch.manual_seed(0)
    m = build_mixer("mesa", d_model=24, n_heads=2, causal=True, layer_idx=0, n_layers=1, chunk_size=4).double()
    m.train(training)
    x = torch.randn(2, 10, 24, dtype=F64)
    y = m(x)
    iters = m.extra_metrics()
    cache: dict = {}
    steps = torch.cat([m(x[:, i : i + 1], None, cache) for i in range(10)], dim=1)
    torch.testing.assert_close(steps, y, rtol=1e-10, atol=1e-10)
    cache = {}
    two = torch.cat([m(x[:, :6], None, cache), m(x[:, 6:], None, cache)], dim=1)
    torch.testing.assert_close(two, y, rtol=1e-10, atol=1e-10)
    assert set(iters) == {"cg_iters/h0", "cg_iters/h1", "cg_iters/mean"}
    if training:
        assert 28.0 < float(iters["cg_iters/mean"]) <= 30.0  # a residual of exactly 0 stops early
    else:
        assert 0 < float(iters["cg_iters/mean"]) < 30.0
    # the chunked mixer output equals the exact solve built from the mixer's own pieces
    m.eval()
    m.eval_cg_eps = None
    m.impl = "exact"
    y_ex = m(x)
    m.impl = "chunk"
    torch.testing.assert_close(m(x), y_ex, rtol=1e-6, atol=1e-8)


def test_mixer_gradients_flow_to_all_parameters():
    torch.manual_seed(1)
    m = build_mixer("mesa", d_model=16, n_heads=2, causal=True, layer_idx=0, n_layers=1, chunk_size=4, cg_iters=10)
    x = torch.randn(2, 9, 16)
    m(x).square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()) and float(p.grad.abs().sum()) > 0, name
    lamb = m.lamb()
    torch.testing.assert_close(lamb, torch.full_like(lamb, 1.0))  # initialised at lambda_init


@torch.no_grad()
def test_mixer_metrics_callback_logs_cg_iterations_per_layer_and_head():
    from mixlab.backbone import BackboneConfig
    from mixlab.callbacks import MixerMetrics
    from mixlab.heads.lm import CausalLM

    torch.manual_seed(0)
    cfg = BackboneConfig(d_model=16, n_layers=2, n_heads=2, mixer="hawk,mesa",
                         mixer_args={"mesa": {"chunk_size": 4, "cg_iters": 7}})
    model = CausalLM(5, cfg).eval()
    model(torch.randint(0, 5, (2, 9)))
    logged = {}
    model.log = lambda name, value, **kw: logged.__setitem__(name, (float(value), kw))  # type: ignore[method-assign]
    MixerMetrics()._log(model, "val")
    tag = "val/mixer/layer1/cg_iters/"
    assert set(logged) == {tag + "h0", tag + "h1", tag + "mean"}
    mean, kw = logged["val/mixer/layer1/cg_iters/mean"]
    assert 0 < mean <= 7 and kw["on_epoch"] and not kw["on_step"]
    assert mean == pytest.approx((logged[tag + "h0"][0] + logged[tag + "h1"][0]) / 2)


# ---------------------------------------------------------------------------- negative forget gates
def _signed_inputs(t=23, seed=4):
    q, k, v, g, beta, lamb = _inputs(t=t, seed=seed, gmin=-0.5)
    gen = torch.Generator().manual_seed(seed + 1)
    sign = torch.where(torch.rand(g.shape, generator=gen) < 0.4, -1.0, 1.0).to(F64)
    return q, k, v, g, beta, lamb * 0 + 3.0, sign  # Lambda = 3 I dominates the indefinite H_t


def test_negative_gates_chunk_and_recurrent_match_the_signed_recurrence():
    """gamma_t = sign_t exp(g_t): chunked CG (chunk sizes 4 and 64) and the per-token loop equal
    the exact solve on statistics built token by token with the signed gate, written out here."""
    q, k, v, g, beta, lamb, sign = _signed_inputs()
    b, t, h, dk = q.shape
    H = torch.zeros(b, h, dk, dk, dtype=F64)
    G = torch.zeros(b, h, dk, v.shape[-1], dtype=F64)
    want = torch.zeros(b, t, h, v.shape[-1], dtype=F64)
    for i in range(t):
        gam = (sign[:, i] * g[:, i].exp())[..., None, None]
        H = gam * H + beta[:, i, :, None, None] * k[:, i, :, :, None] * k[:, i, :, None, :]
        G = gam * G + beta[:, i, :, None, None] * k[:, i, :, :, None] * v[:, i, :, None, :]
        x = torch.linalg.solve(H + torch.diag_embed(lamb), q[:, i].unsqueeze(-1)).squeeze(-1)
        want[:, i] = (x.unsqueeze(-2) @ G).squeeze(-2)
    for c in (4, 64):
        o, st, _ = mesa_chunk(q, k, v, g, beta, lamb, 60, None, c, None, True, gate_sign=sign)
        torch.testing.assert_close(o, want, rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(st[0], H, rtol=1e-12, atol=1e-12)
    o, _, _ = mesa_recurrent(q, k, v, g, beta, lamb, 60, gate_sign=sign)
    torch.testing.assert_close(o, want, rtol=1e-9, atol=1e-10)
    o, _ = mesa_exact(q, k, v, g, beta, lamb, gate_sign=sign)
    torch.testing.assert_close(o, want, rtol=1e-10, atol=1e-12)


def test_negative_gates_adjoint_backward_equals_autograd_through_exact_solve():
    q, k, v, g, beta, lamb, sign = _signed_inputs(t=9)
    leaves = [z.clone().requires_grad_() for z in (q, k, v, g, beta, lamb)]
    ref = [z.clone().requires_grad_() for z in (q, k, v, g, beta, lamb)]
    w = torch.randn(v.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
    (mesa_chunk(*leaves, 80, None, 4, gate_sign=sign)[0] * w).sum().backward()
    (mesa_exact(*ref, gate_sign=sign)[0] * w).sum().backward()
    for name, a, r in zip("q k v g beta lamb".split(), leaves, ref):
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-7, atol=1e-9, msg=name)


@torch.no_grad()
def test_mixer_negative_gates_decode_like_parallel_and_flip_signs():
    torch.manual_seed(0)
    m = build_mixer("mesa", d_model=16, n_heads=2, negative_gates=True, lambda_init=50.0, lambda_floor=49.0,
                    chunk_size=4, eval_cg_eps=None, cg_iters=40).double().eval()
    x = torch.randn(2, 9, 16, dtype=F64)
    y = m(x)
    cache: dict = {}
    steps = torch.cat([m(x[:, i:i + 1], None, cache) for i in range(9)], 1)
    torch.testing.assert_close(steps, y, rtol=1e-8, atol=1e-10)
    a = m.a_proj(x)
    assert bool((a < 0).any()) and bool((a > 0).any())  # both gate signs occur at init
