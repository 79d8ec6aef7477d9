"""Attention mixers: the SDPA fast path against explicit formulas computed here in float64."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mixlab.coords import Coords
from mixlab.mixers.attention import Attention
from mixlab.ops.goat import alibi_slopes
from mixlab.registry import build_mixer

D, H = 48, 3  # head_dim 16


def _randomise(m: Attention, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.pos.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))


def _phi(c: torch.Tensor, present: torch.Tensor, n_freqs: int, scale: float) -> torch.Tensor:
    """phi_abs written out independently: per axis [sin(c v), cos(c v), c/scale, 1] * present."""
    v = torch.tensor([10000.0 ** (-m / (n_freqs - 1)) for m in range(n_freqs)], dtype=torch.float64)
    feats = []
    for a in range(c.shape[-1]):
        ca, pa = c[:, a : a + 1].double(), present[:, a : a + 1].double()
        f = torch.cat([torch.sin(ca * v), torch.cos(ca * v), ca / scale, torch.ones_like(ca)], dim=-1) * pa
        feats.append(f)
    return torch.cat(feats, dim=-1)


@torch.no_grad()
def goat_explicit(m: Attention, x: torch.Tensor, pos: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """z_ij = q_c.k_c/sqrt(d_c) + sum_r [alpha cos(w d) + beta sin(w d)] + u(j), by loops (batch 1)."""
    p = m.pos
    T = x.shape[1]
    dc, dh = m.d_c, m.head_dim
    qc, kc, v = (z[0].transpose(0, 1) for z in m._split(x))  # [T, H, d]
    w = p.freqs()
    axis = p.mode_axis.tolist()
    phi = _phi(pos, present, p.key_mlp_freqs, p.abs_scale)  # [T, F]
    z = torch.empty(H, T, T, dtype=torch.float64)
    for h in range(H):
        if p.key_mlp_hidden:
            g = F.silu(phi @ p.mlp_w1[h] + p.mlp_b1[h]) @ p.mlp_w2[h]
        else:
            g = torch.zeros(T, dtype=torch.float64)
        for i in range(T):
            for j in range(T):
                content = float((qc[i, h] @ kc[j, h]).detach()) / math.sqrt(dc)
                rel = 0.0
                for r, a in enumerate(axis):
                    if present[i, a] and present[j, a]:
                        d = float(pos[i, a] - pos[j, a])
                        wd = float(w[r]) * d
                        rel += float(p.alpha[h, r]) * math.cos(wd) + float(p.beta[h, r]) * math.sin(wd)
                u = float(g[j])
                if p.key_linear and present[j, 0]:
                    u += float(p.slope[h]) * float(pos[j, 0])
                if p.use_bos and present[j, 0] and pos[j, 0] == 0:
                    u += float(p.bos[h])
                if p.use_default and not present[j].any():
                    u += float(p.default[h])
                z[h, i, j] = content + rel + u
    if m.causal:
        z = z.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = torch.softmax(z, -1) @ v.transpose(0, 1)  # [H, T, dh]
    return m.proj(o.transpose(0, 1).reshape(1, T, H * dh))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("T", [1, 7, 37], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("cfg", [
    dict(n_modes=2),
    dict(n_modes=3, learned_freqs=True, freq_base=1000.0),
    dict(n_modes=1, key_mlp_hidden=0, init="alibi"),
], ids=["R2", "R3-learned", "R1-nomlp"])
@pytest.mark.parametrize("lane_impl", ["auto", "where", "scatter"])
def test_goat_sdpa_equals_explicit_formula(causal, T, cfg, lane_impl):
    torch.manual_seed(T)
    m = Attention(D, H, causal=causal, position="goat", position_args=dict(cfg, lane_impl=lane_impl)).double()
    _randomise(m, seed=T)
    x = torch.randn(1, T, D, dtype=torch.float64)
    offset = 5 if T > 1 else 0  # exercise j = 0 and j > 0 starts
    coords = Coords.seq(T, offset=0)
    pos = coords.pos[0]
    want = goat_explicit(m, x, pos, torch.ones_like(pos, dtype=torch.bool))
    torch.testing.assert_close(m(x, coords), want, rtol=1e-10, atol=1e-10)
    # a shifted window (positions offset..offset+T-1): the prior is not translation-invariant (u(j))
    c2 = Coords.seq(T, offset=offset)
    want2 = goat_explicit(m, x, c2.pos[0], torch.ones_like(c2.pos[0], dtype=torch.bool))
    torch.testing.assert_close(m(x, c2), want2, rtol=1e-10, atol=1e-10)
    m.impl = "reference"
    torch.testing.assert_close(m(x, c2), want2, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("lane_impl", ["auto", "where", "scatter"])
def test_goat_mixed_1d_2d_coordinates_equal_explicit_formula(lane_impl):
    """Text tokens (sequence axis only), image patches (y, x only), a token with no axes."""
    torch.manual_seed(1)
    m = Attention(D, H, causal=False, position="goat",
                  position_args=dict(n_modes=3, axes=3, key_linear=True, bos_bias=True, default_bias=True,
                                     lane_impl=lane_impl)).double()
    _randomise(m, seed=3)
    text = Coords(torch.tensor([[[0, 0, 0], [1, 0, 0], [2, 0, 0]]]), torch.tensor([[[1, 0, 0]] * 3], dtype=torch.bool))
    patches = Coords(torch.tensor([[[0, y, x] for y in range(2) for x in range(3)]]),
                     torch.tensor([[[0, 1, 1]] * 6], dtype=torch.bool))
    cls = Coords.empty(1, 3)
    coords = Coords.cat([cls, text, patches])
    x = torch.randn(1, coords.length, D, dtype=torch.float64)
    want = goat_explicit(m, x, coords.pos[0], coords.full_mask()[0])
    torch.testing.assert_close(m(x, coords), want, rtol=1e-10, atol=1e-10)


def _outputs_and_grads(ms, x, coords, g):
    """Each model's output on ``(x, coords)`` and its gradients (input first, then the parameters) for the
    upstream gradient ``g``."""
    outs, grads = [], []
    for m in ms:
        xi = x.clone().requires_grad_(True)
        y = m(xi, coords)
        outs.append(y)
        grads.append(torch.autograd.grad(y, [xi, *m.parameters()], g))
    return outs, grads


@pytest.mark.parametrize("T", [1, 7, 37], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("per_batch", [False, True], ids=["shared", "per-batch"])
@pytest.mark.parametrize("impl", ["where", "scatter"])
def test_goat_where_packing_gradients_equal_the_concatenated_lanes(T, per_batch, impl):
    """``lane_impl="where"`` (one ``torch.where`` into the projection's output) and ``"scatter"`` (two
    ``slice_scatter``) against the torch lanes concatenated after the content dims (``"torch"``): the same outputs
    and the same gradients for the input, the projection (whose lane-dim outputs get none) and every prior
    parameter, float64, batch 3; coordinates shared by the batch or one set per sequence (2-D patches with a [CLS]
    token)."""
    torch.manual_seed(T)
    pa = dict(n_modes=4, axes=2, default_bias=True, key_mlp_hidden=8, init="random")
    ms = [Attention(D, H, causal=False, position="goat", position_args=dict(pa, lane_impl=i)).double()
          for i in ("torch", impl)]
    ms[1].load_state_dict(ms[0].state_dict())
    b = 3
    grid = [[y, x] for y in range(T) for x in range(2)][:T]
    pos = torch.tensor([grid] * (b if per_batch else 1))
    if per_batch:
        pos = pos + torch.arange(b).view(b, 1, 1)  # each sequence its own offsets
    coords = Coords.cat([Coords.empty(pos.shape[0], 2), Coords(pos, torch.ones_like(pos, dtype=torch.bool))])
    x = torch.randn(b, coords.length, D, dtype=torch.float64)
    g = torch.randn(b, coords.length, D, dtype=torch.float64)
    outs, grads = _outputs_and_grads(ms, x, coords, g)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)
    for (name, _), g0, g1 in zip(ms[0].named_parameters(), grads[0][1:], grads[1][1:]):
        torch.testing.assert_close(g1, g0, rtol=1e-10, atol=1e-12, msg=name)
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-10, atol=1e-12)
    assert grads[1][1].abs().sum() > 0


@pytest.mark.parametrize("impl", ["where", "scatter"])
def test_goat_where_packing_on_a_long_correlated_sequence(impl):
    """Realistic inputs for the pointwise packings: 515 tokens (odd, across several key-linear blocks of 128) from
    position 1000 on, tokens that drift slowly (a normalised random walk: neighbouring keys nearly parallel), prior
    parameters at random non-zero values, batch 2 with one set of coordinates, causal; the outputs and every
    gradient equal those of the concatenated torch lanes in float64."""
    torch.manual_seed(5)
    pa = dict(n_modes=3, key_mlp_hidden=8, bos_bias=True, init="random")
    ms = [Attention(D, H, causal=True, position="goat", position_args=dict(pa, lane_impl=i)).double()
          for i in ("torch", impl)]
    _randomise(ms[0], seed=5)
    ms[1].load_state_dict(ms[0].state_dict())
    walk = torch.randn(2, 515, D, dtype=torch.float64).cumsum(1)
    x = walk / walk.norm(dim=-1, keepdim=True) * D ** 0.5
    coords = Coords.seq(515, offset=1000)
    g = torch.randn_like(x)
    outs, grads = _outputs_and_grads(ms, x, coords, g)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-11, atol=1e-11)
    for g0, g1 in zip(grads[0], grads[1]):
        torch.testing.assert_close(g1, g0, rtol=1e-9, atol=1e-11)


def test_goat_forced_triton_lanes_fall_back_to_torch_on_the_cpu(monkeypatch):
    """A model trained with ``lane_impl: triton`` (the kernels forced) still runs on a CPU: one warning, then the
    torch lanes (the same values as ``torch``)."""
    import warnings

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch.manual_seed(0)
    ref = Attention(D, H, causal=True, position="goat", position_args=dict(n_modes=2, lane_impl="torch")).double()
    tri = Attention(D, H, causal=True, position="goat", position_args=dict(n_modes=2, lane_impl="triton")).double()
    tri.load_state_dict(ref.state_dict())
    x = torch.randn(2, 9, D, dtype=torch.float64)
    with pytest.warns(UserWarning, match="lane_impl 'triton' needs CUDA tensors; got cpu"):
        y = tri(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tri(x)  # warned once
    torch.testing.assert_close(y, ref(x), rtol=0, atol=0)


def test_alibi_lane_equals_dense_alibi_bias():
    torch.manual_seed(0)
    T = 29
    m = Attention(D, H, causal=True, position="alibi").double()
    x = torch.randn(2, T, D, dtype=torch.float64)
    dc = m.d_c
    q, k, v = m._split(x)  # [B, H, T, d]
    i = torch.arange(T)
    bias = -alibi_slopes(H)[:, None, None] * (i[:, None] - i[None, :]).double()  # [H, T, T]
    bias = bias.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    z = q @ k.transpose(-1, -2) / math.sqrt(dc) + bias
    want = m.proj((torch.softmax(z, -1) @ v).transpose(1, 2).reshape(2, T, -1))
    torch.testing.assert_close(m(x), want, rtol=1e-10, atol=1e-10)
    assert len(list(m.pos.parameters())) == 0  # fixed slopes: buffers, nothing unused under DDP


def test_recency_prior_is_monotone_in_bf16_up_to_32k():
    """Pure recency prior (lambda > 0, nothing else): lanes in bf16, fp32 accumulation as in the kernel."""
    T = 32768
    p = build_mixer("goat", d_model=64, n_heads=1, causal=True,
                    position_args=dict(n_modes=1, key_mlp_hidden=0, bos_bias=False)).pos
    with torch.no_grad():
        p.slope.fill_(0.0137)
    c = Coords.seq(T)
    ql, kl = p.lanes(c.slice(T - 1, T), c, torch.bfloat16)
    logits = (ql.float() * kl.float()).sum(-1)[0, 0] / p.lane_scale  # [T]; SDPA scale 1/sqrt(d_c)
    diffs = logits.diff()
    assert bool((diffs > 0).all()), f"staircase: {(diffs <= 0).sum()} non-increasing steps"
    # the slope itself is rounded to bf16 once (same for every key): relative error < 2^-7
    assert abs(float(logits[-1] - logits[0]) / (T - 1) / 0.0137 - 1) < 2**-7
    # the single-lane layout (u = lambda * j stored in bf16) is a staircase: the test can fail
    naive = (0.0137 * torch.arange(T, dtype=torch.float32)).bfloat16().float()
    assert (naive.diff() <= 0).sum() > T // 2


def test_key_positions_past_the_exact_bf16_range_are_refused_not_silently_wrong():
    """j_hi = j // 128 is exact in bf16 only below 256: keys at j >= 32768 get a one-line error in
    bf16 (and in the alibi lanes), fp32 lanes serve them, and 32768 keys (j <= 32767) still pass."""
    for name in ("goat", "alibi"):
        p = build_mixer(name, d_model=64, n_heads=1, causal=True,
                        position_args=dict(n_modes=1, key_mlp_hidden=0) if name == "goat" else None).pos
        long = Coords.seq(32769)
        with pytest.raises(ValueError, match=r"key positions reach 32768\.\.32895 .* exact in bfloat16 only for "
                                             r"positions < 32768 .* --trainer.precision 32"):
            p.lanes(long.slice(0, 1), long, torch.bfloat16)
        ql, kl = p.lanes(long.slice(32768, 32769), long, torch.float32)
        assert float(kl[0, 0, -1, -2]) == 256.0  # j_hi of the last key, exact
        p.lanes(Coords.seq(32768), Coords.seq(32768), torch.bfloat16)  # at the limit: fine
    rope = build_mixer("rope", d_model=64, n_heads=1, causal=True)  # no key-linear lane: no limit
    rope(torch.randn(1, 40, 64).bfloat16().float(), Coords.seq(40, offset=40000))


@pytest.mark.parametrize("name", ["goat", "rope", "alibi", "nope"])
def test_cached_decoding_equals_parallel_forward(name):
    torch.manual_seed(0)
    m = build_mixer(name, d_model=D, n_heads=H, causal=True).double()
    _randomise(m, seed=1)
    x = torch.randn(2, 11, D, dtype=torch.float64)
    full = m(x)
    cache: dict = {}
    parts = ([m(x[:, :4], cache=cache)] + [m(x[:, t : t + 1], cache=cache) for t in range(4, 9)]
             + [m(x[:, 9:], cache=cache)])
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-10, atol=1e-10)


def test_rope_2d_axial_depends_only_on_coordinate_differences():
    torch.manual_seed(0)
    m = Attention(D, H, causal=False, position="rope", position_args=dict(axes=2)).double()
    x = torch.randn(1, 12, D, dtype=torch.float64)
    g = Coords.grid(3, 4)
    shifted = Coords(g.pos + torch.tensor([7, -3]))
    torch.testing.assert_close(m(x, g), m(x, shifted), rtol=1e-10, atol=1e-10)
    swapped = Coords(g.pos.flip(-1))  # y and x exchanged: different output (axes are distinct)
    assert (m(x, g) - m(x, swapped)).abs().max() > 1e-3
    m.impl = "reference"
    torch.testing.assert_close(m(x, g), m(x, shifted), rtol=1e-10, atol=1e-10)


def test_goat_fast_path_runs_one_sdpa_call_without_mask(monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append((attn_mask, q.shape, k.shape))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    m = build_mixer("goat", d_model=64, n_heads=4, causal=True, position_args=dict(n_modes=4))
    m(torch.randn(2, 10, 64))
    assert len(calls) == 1 and calls[0][0] is None and calls[0][1][-1] == 16  # lanes inside d_h


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="head_dim=8 is too small.*n_modes=4"):
        build_mixer("goat", d_model=16, n_heads=2, causal=True, position_args=dict(n_modes=4))
    with pytest.raises(ValueError, match="unknown mixer 'gaot'"):
        build_mixer("gaot", d_model=16, n_heads=2, causal=True)
    with pytest.raises(ValueError, match="alibi.*causal"):
        build_mixer("alibi", d_model=16, n_heads=2, causal=False)
    with pytest.raises(ValueError, match="n_modes=3 does not split evenly over axes=2"):
        build_mixer("goat", d_model=64, n_heads=2, causal=False, position_args=dict(n_modes=3, axes=2))


@pytest.mark.parametrize("mixed", [False, True], ids=["1d", "mixed-axes"])
def test_goat_lane_gradients_equal_autograd_through_explicit_prior(mixed):
    """GoatLanes' analytic backward vs autograd through prior_terms (float64, learned freqs)."""
    torch.manual_seed(2)
    axes = 3 if mixed else 1
    args = dict(n_modes=3, axes=axes, learned_freqs=True, key_linear=True, bos_bias=True, default_bias=mixed)
    m = Attention(D, H, causal=True, position="goat", position_args=args).double()
    _randomise(m, seed=5)
    with torch.no_grad():
        m.pos.log_freqs.copy_(torch.linspace(0.0, -3.0, 3, dtype=torch.float64))
    if mixed:
        text = Coords(torch.tensor([[[0, 0, 0], [1, 0, 0]]]), torch.tensor([[[1, 0, 0]] * 2], dtype=torch.bool))
        grid = Coords(torch.tensor([[[0, y, x] for y in range(2) for x in range(2)]]),
                      torch.tensor([[[0, 1, 1]] * 4], dtype=torch.bool))
        c = Coords.cat([Coords.empty(1, 3), text, grid])
    else:
        c = Coords.seq(300, offset=3)  # j spans several key-linear blocks (c = 128)
    W = torch.randn(1, H, c.length, c.length, dtype=torch.float64)
    params = [p for p in m.pos.parameters()]
    ql, kl = m.pos.lanes(c, c, torch.float64)
    lane = (W * (ql @ kl.transpose(-1, -2)) / m.pos.lane_scale).sum()
    g_lane = torch.autograd.grad(lane, params)
    ref = (W * m.pos.prior_terms(c, c)["total"]).sum()
    g_ref = torch.autograd.grad(ref, params)
    torch.testing.assert_close(lane, ref, rtol=1e-10, atol=1e-8)
    for (name, _), a, b in zip(m.pos.named_parameters(), g_lane, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-8, msg=lambda s: f"{name}: {s}")


def test_goat_lanes_gradcheck():
    from mixlab.ops.goat import GoatLanes

    torch.manual_seed(0)
    B, T, R, H, Fd, Hd = 1, 5, 2, 2, 3, 4
    d = dict(dtype=torch.float64)
    ang = torch.randn(B, T, R, **d)
    cos, sin = ang.cos().requires_grad_(), ang.sin().requires_grad_()
    pres = torch.ones(B, T, R, **d)
    phi = torch.randn(B, T, Fd, **d)
    j = torch.arange(T, **d).view(1, T)
    params = [torch.randn(H, R, **d), torch.randn(H, R, **d), torch.randn(H, **d), torch.randn(H, **d),
              torch.randn(H, **d), torch.randn(H, Fd, Hd, **d), torch.randn(H, Hd, **d), torch.randn(H, Hd, **d)]
    params = [p.requires_grad_() for p in params]
    fn = lambda cs, sn, *ps: GoatLanes.apply(cs, sn, pres, cs, sn, pres, phi, j // 2, j % 2, (j == 0).double(),
                                             torch.zeros_like(j), *ps, 1.7, torch.float64)
    assert torch.autograd.gradcheck(fn, (cos, sin, *params))


def test_goat_prior_loads_checkpoints_from_before_the_flat_prior():
    """State dicts with one key per term (``pos.alpha``, ``pos.mlp_w1``, ..., ALiBi's ``pos.slope``)
    load into the flat ``prior`` vector term by term."""
    from mixlab.mixers.attention import Attention

    torch.manual_seed(0)
    new = Attention(32, 2, causal=True, position="goat", position_args=dict(n_modes=2, init="random"))
    old_style = {k: v for k, v in new.state_dict().items() if not k.endswith("pos.prior")}
    for name in new.pos.learned_terms:
        old_style[f"pos.{name}"] = getattr(new.pos, name).detach().clone()
    fresh = Attention(32, 2, causal=True, position="goat", position_args=dict(n_modes=2))
    fresh.load_state_dict(old_style)
    assert torch.equal(fresh.pos.prior, new.pos.prior)
    assert torch.equal(fresh.pos.mlp_w1, new.pos.mlp_w1)
    alibi = Attention(32, 2, causal=True, position="alibi")
    sd = {k: v for k, v in alibi.state_dict().items() if not k.endswith("fixed_slope")}
    sd["pos.slope"] = torch.tensor([0.5, 0.25])
    alibi.load_state_dict(sd)
    assert torch.equal(alibi.pos.slope, torch.tensor([0.5, 0.25]))


def test_rope_rotary_impl_option():
    """``rotary_impl``: a typo is a one-line error naming the option; ``auto`` on CPU tensors keeps the torch
    rotation (equal outputs to ``torch``); the Triton path itself is checked under the interpreter
    (tests/test_goat_triton.py)."""
    with pytest.raises(ValueError, match="rotary_impl must be 'torch', 'triton' or 'auto'; got 'cuda'"):
        build_mixer("rope", d_model=32, n_heads=2, causal=True, position_args={"rotary_impl": "cuda"})
    torch.manual_seed(0)
    a = build_mixer("rope", d_model=32, n_heads=2, causal=True, position_args={"rotary_impl": "torch"}).double()
    b = build_mixer("rope", d_model=32, n_heads=2, causal=True, position_args={"rotary_impl": "auto"}).double()
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)


def test_rope_triton_rotation_on_cpu_warns_and_rotates_by_torch():
    """``rotary_impl: triton`` on CPU tensors raised Triton's "0 active drivers" (a user test), then a
    one-line error, which made a checkpoint trained with the kernel unusable on a CPU (the checkpoint's
    option overrides the command line's): now one warning per layer and the torch rotation's values."""
    import os
    import warnings

    from mixlab.mixers import build_mixer

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter runs the kernel on CPU")
    torch.manual_seed(0)
    layer = build_mixer("rope", d_model=16, n_heads=2, position_args={"rotary_impl": "triton"}).double()
    torch.manual_seed(0)
    ref = build_mixer("rope", d_model=16, n_heads=2, position_args={"rotary_impl": "torch"}).double()
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    with pytest.warns(UserWarning, match="rotary_impl 'triton' needs CUDA tensors; got cpu"):
        out = layer(x)
    torch.testing.assert_close(out, ref(x), rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(x)  # once per layer
