"""Run under TRITON_INTERPRET=1: the Triton adaptive-CG kernel of Mesa against the torch paths.

Inputs are float32 with correlated keys (a shared direction plus noise, as trained keys are),
forget gates near 1, odd lengths, T = 1 and lengths not divisible by the chunk size. Every case
compares the Triton CG (``cg_impl="triton"``) with the torch chunk CG (same algorithm: outputs,
iteration counts and, for the backward, every gradient) and with the float64 exact solve. Forward
cases run as inference (one float16 product per CG step) unless their name starts with ``train``.

Prints one JSON line ``{case: {metric: value}}``. Used by tests/test_mesa_triton.py.
On a GPU (``MESA_CHECK_DEVICE=cuda``, no interpreter) it checks the compiled kernel.
"""

import json
import os

import torch
import torch.nn.functional as F

from mixlab.ops.mesa import mesa_chunk, mesa_exact
from mixlab.registry import build_mixer

DEV = torch.device(os.environ.get("MESA_CHECK_DEVICE", "cpu"))


def inputs(b, t, h, k, v, seed, corr=0.8, gmin=-0.05, state=False, signs=False, lamb0=0.25):
    gen = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=gen)
    base = rn(b, 1, h, k)
    keys = F.normalize(corr * base + (1 - corr) * rn(b, t, h, k), dim=-1)
    q = F.normalize(corr * base + (1 - corr) * rn(b, t, h, k), dim=-1)
    out = dict(q=q, k=keys, v=rn(b, t, h, v), g=torch.rand(b, t, h, generator=gen) * gmin,
               beta=torch.rand(b, t, h, generator=gen), lamb=torch.rand(h, k, generator=gen) + lamb0)
    if state:
        a = rn(b, h, k, k) * 0.3
        out["initial_state"] = (a @ a.transpose(-1, -2), rn(b, h, k, v))
    if signs:
        out["gate_sign"] = torch.where(torch.rand(b, t, h, generator=gen) < 0.3, -1.0, 1.0)
    return {n: (tuple(z.to(DEV) for z in x) if isinstance(x, tuple) else x.to(DEV)) for n, x in out.items()}


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def forward_case(chunk, cg_iters, cg_eps, train=False, **kw):
    """``train``: q requires grad, so the Triton forward keeps float32-accurate products (fp16x3);
    otherwise it is an inference forward (one float16 product per CG step)."""
    x = inputs(**kw)
    sign = x.pop("gate_sign", None)
    h0 = x.pop("initial_state", None)
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "lamb")]
    q_t = args[0].clone().requires_grad_(train)
    o_t, s_t, it_t = mesa_chunk(q_t, *args[1:], cg_iters, cg_eps, chunk, h0, True, sign, cg_impl="triton")
    o_t, s_t = o_t.detach(), tuple(z.detach() for z in s_t)
    o_c, s_c, it_c = mesa_chunk(*args, cg_iters, cg_eps, chunk, h0, True, sign, cg_impl="torch")
    o_e, _ = mesa_exact(*[a.double() for a in args], None if h0 is None else tuple(z.double() for z in h0),
                        gate_sign=sign)
    return {"o_vs_torch": rel(o_t, o_c), "o_vs_exact": rel(o_t, o_e),
            "iters_diff": int((it_t - it_c).abs().max()), "mean_iters": float(it_t.float().mean()),
            "state_vs_torch": rel(s_t[0], s_c[0])}


def packed_case(dtype, chunk, **kw):
    """q, k, v as strided views of one packed ``[B, T, H, 2K + V']`` projection (as a layer hands them over), in
    ``dtype``: the fused forward reads them in place; the torch path gets the same (rounded) values."""
    x = inputs(**kw)
    q, k, v = x["q"], x["k"], x["v"]
    packed = torch.cat([q, k, v, torch.zeros_like(v[..., :3])], -1).to(dtype)
    dk, dv = q.shape[-1], v.shape[-1]
    qs, ks, vs = packed[..., :dk], packed[..., dk:2 * dk], packed[..., 2 * dk:2 * dk + dv]
    rest = [x[n] for n in ("g", "beta", "lamb")]
    o_t, _, it_t = mesa_chunk(qs, ks, vs, *rest, 30, 1e-4, chunk, cg_impl="triton")
    o_c, _, it_c = mesa_chunk(qs.contiguous(), ks.contiguous(), vs.contiguous(), *rest, 30, 1e-4, chunk,
                              cg_impl="torch")
    o_e, _ = mesa_exact(*[z.double() for z in (qs, ks, vs)], *[z.double() for z in rest])
    return {"o_vs_torch": rel(o_t, o_c), "o_vs_exact": rel(o_t, o_e), "iters_diff": int((it_t - it_c).abs().max()),
            "dtype_ok": float(o_t.dtype == dtype)}


def backward_case(chunk, cg_iters, cg_eps, dtype=torch.float32, **kw):
    """Gradients of the Triton path (fused forward, adjoint Triton CG, reverse Triton scans) against the torch
    chunk path on the same inputs, the loss reading the output and both final states. ``dtype`` bf16: q, k, v
    rounded to bf16 for both (the Triton CG then takes one float16 product per step)."""
    x = inputs(**kw)
    sign = x.pop("gate_sign", None)
    h0 = x.pop("initial_state", None)
    x.update({n: x[n].to(dtype) for n in ("q", "k", "v")})
    names = ["q", "k", "v", "g", "beta", "lamb"] + (["h_kk0", "h_kv0"] if h0 is not None else [])
    base = [x[n] for n in names[:6]] + (list(h0) if h0 is not None else [])
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(x["v"].shape, generator=gen).to(DEV)
    w_kv = torch.randn(x["k"].shape[0], x["k"].shape[2], x["k"].shape[3], x["v"].shape[3], generator=gen).to(DEV)
    grads = {}
    for impl in ("triton", "torch"):
        leaves = [z.clone().requires_grad_() for z in base]
        init = tuple(leaves[6:]) if h0 is not None else None
        o, st, _ = mesa_chunk(*leaves[:6], cg_iters, cg_eps, chunk, init, True, sign, cg_impl=impl)
        ((o.float() * w).sum() + st[0].sum() * 0.1 + (st[1] * w_kv).sum() * 0.1).backward()
        grads[impl] = [z.grad for z in leaves]
    return {f"d{n}": rel(a, b) for n, a, b in zip(names, grads["triton"], grads["torch"])}


@torch.no_grad()
def mixer_case():
    torch.manual_seed(0)
    m = build_mixer("mesa", d_model=32, n_heads=2, impl="triton").to(DEV).eval()
    ref = build_mixer("mesa", d_model=32, n_heads=2, impl="chunk").to(DEV).eval()
    ref.load_state_dict(m.state_dict())
    x = torch.randn(2, 45, 32, device=DEV)
    return {"o_vs_chunk": rel(m(x), ref(x))}


def main():
    out = {
        "adaptive_T75_C32_correlated": forward_case(32, 30, 1e-4, b=2, t=75, h=2, k=24, v=20, seed=0),
        "train_adaptive_T75_C32_correlated": forward_case(32, 30, 1e-4, train=True, b=2, t=75, h=2, k=24, v=20,
                                                          seed=0),
        "adaptive_T1": forward_case(64, 30, 1e-4, b=2, t=1, h=2, k=16, v=16, seed=1),
        "fixed30_T37_C16_state": forward_case(16, 30, None, b=1, t=37, h=2, k=16, v=8, seed=2, state=True),
        "adaptive_T70_C64_K64_gates_near_one": forward_case(64, 30, 1e-4, b=1, t=70, h=1, k=64, v=64, seed=3,
                                                            gmin=-0.002),
        "negative_gates_T33_C16": forward_case(16, 60, 1e-6, b=1, t=33, h=2, k=8, v=8, seed=4, signs=True,
                                               lamb0=50.0),
        "packed_T45_C16": packed_case(torch.float32, 16, b=2, t=45, h=2, k=16, v=8, seed=8),
        "packed_bf16_T45_C16": packed_case(torch.bfloat16, 16, b=2, t=45, h=2, k=16, v=8, seed=8),
        "backward_fixed_T29_C16_state": backward_case(16, 30, None, b=1, t=29, h=2, k=16, v=16, seed=5, state=True),
        "backward_adaptive_T40_C32": backward_case(32, 30, 1e-4, b=1, t=40, h=2, k=16, v=16, seed=6),
        "backward_fixed_negative_gates_T33_C16_state": backward_case(16, 60, None, b=2, t=33, h=2, k=8, v=12,
                                                                     seed=9, signs=True, lamb0=50.0, state=True),
        "backward_bf16_adaptive_T45_C16": backward_case(16, 30, 1e-4, torch.bfloat16, b=2, t=45, h=2, k=16, v=16,
                                                        seed=10),
        "mixer_eval_adaptive": mixer_case(),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
