"""Run under TRITON_INTERPRET=1: compare GoatLanesTriton with GoatLanes (values and gradients).

Prints one JSON line {case: max_abs_error}. Used by tests/test_goat_triton.py.
"""

import json

import torch

from mixlab.ops.goat import GoatLanes
from mixlab.ops.goat_triton import GoatLanesTriton


def case(Bq, Bk, Tq, Tk, R, H, F, D, slope, bos, default, mlp, seed):
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g)
    ang_q, ang_k = rn(Bq, Tq, R) * 3, rn(Bk, Tk, R) * 3
    pres_q = (torch.rand(Bq, Tq, R, generator=g) > 0.2).float()
    pres_k = (torch.rand(Bk, Tk, R, generator=g) > 0.2).float()
    phi = rn(Bk, Tk, F)
    j = torch.randint(0, 1000, (Bk, Tk), generator=g)
    feats = (ang_q.cos(), ang_q.sin(), pres_q, ang_k.cos(), ang_k.sin(), pres_k, phi,
             (j // 128).float(), (j % 128).float(), (j == 0).float(), (torch.rand(Bk, Tk, generator=g) > 0.8).float())
    params = [rn(H, R), rn(H, R), rn(H) if slope else None, rn(H) if bos else None, rn(H) if default else None,
              rn(H, F, D) if mlp else None, rn(H, D) if mlp else None, rn(H, D) if mlp else None]
    outs = []
    for fn in (GoatLanes, GoatLanesTriton):
        ps = [None if p is None else p.clone().requires_grad_() for p in params]
        ql, kl = fn.apply(*feats, *ps, 2.5, torch.float32)
        gq, gk = torch.randn(ql.shape, generator=torch.Generator().manual_seed(1)), torch.randn(kl.shape, generator=torch.Generator().manual_seed(2))
        (ql * gq).sum().add((kl * gk).sum()).backward()
        outs.append((ql.detach(), kl.detach(), [None if p is None else p.grad for p in ps]))
    (q0, k0, g0), (q1, k1, g1) = outs
    err = max((q0 - q1).abs().max().item(), (k0 - k1).abs().max().item())
    for a, b in zip(g0, g1):
        if a is not None and a.numel():
            err = max(err, ((a - b).abs().max() / (a.abs().max() + 1e-6)).item())
    return err


res = {
    "self_mlp": case(1, 1, 70, 70, 3, 2, 6, 5, True, True, False, True, 0),
    "batch_q_default": case(2, 1, 33, 20, 2, 3, 4, 8, True, False, True, True, 1),
    "no_mlp_T1": case(1, 1, 1, 1, 1, 2, 3, 3, False, True, False, False, 2),
    "alibi_like_R0": case(1, 1, 65, 65, 0, 2, 3, 3, True, False, False, False, 3),
}
print(json.dumps(res))
