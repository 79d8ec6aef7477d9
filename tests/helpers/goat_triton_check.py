"""Run under TRITON_INTERPRET=1: compare the Triton lane kernels with the torch GoatLanes.

GoatLanesTriton (separate lane tensors) against GoatLanes, and the in-place path inside a
whole attention layer (``lane_impl="triton"``: lanes written into the packed qkv) against
the same layer with torch lanes + concatenation: outputs, input gradient and every parameter
gradient (the fast path's backward builds the projection gradient from dq, dk, dv itself).

Prints one JSON line {case: max_abs_error}. Used by tests/test_goat_triton.py.
On a GPU (``GOAT_CHECK_DEVICE=cuda``, no interpreter) it checks the compiled kernels, plus a
ViT-S-sized layer (batch chunks of several images).
"""

import json
import os

import torch

from mixlab.ops.goat import GoatLanes
from mixlab.ops.goat_triton import GoatLanesTriton, kernel_meta, pack_features, pack_params

DEV = torch.device(os.environ.get("GOAT_CHECK_DEVICE", "cpu"))


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
    feats = tuple(f.to(DEV) for f in feats)
    params = [None if p is None else p.to(DEV) for p in params]
    phi = phi.to(DEV)
    zq = lambda *s: torch.zeros(Bq, Tq, *s, device=DEV)
    outs = []
    for fn in (GoatLanes, GoatLanesTriton):
        ps = [None if p is None else p.clone().requires_grad_() for p in params]
        if fn is GoatLanes:
            ql, kl = fn.apply(*feats, *ps, 2.5, torch.float32)
        else:  # packed features (the q side reads only cos/sin/presence) and one flat parameter vector
            feat_q = pack_features(*feats[:3], zq(F) if mlp else None, zq(), zq(), zq(), zq())
            feat_k = pack_features(*feats[3:6], phi if mlp else None, *feats[7:])
            meta = kernel_meta(H, R, F if mlp else 0, D if mlp else 0, 2.5, slope=slope, bos=bos, default=default)
            ql, kl = fn.apply(feat_q, feat_k, pack_params(*ps), meta, Bq, Bk, torch.float32)
        gq = torch.randn(ql.shape, generator=torch.Generator().manual_seed(1)).to(DEV)
        gk = torch.randn(kl.shape, generator=torch.Generator().manual_seed(2)).to(DEV)
        (ql * gq).sum().add((kl * gk).sum()).backward()
        outs.append((ql.detach(), kl.detach(), [None if p is None else p.grad for p in ps]))
    (q0, k0, g0), (q1, k1, g1) = outs
    err = max((q0 - q1).abs().max().item(), (k0 - k1).abs().max().item())
    for a, b in zip(g0, g1):
        if a is not None and a.numel():
            err = max(err, ((a - b).abs().max() / (a.abs().max() + 1e-6)).item())
    return err


def _graph_names(fn, seen=None):
    """Names of every autograd node reachable from ``fn``."""
    seen = set() if seen is None else seen
    if fn is None or fn in seen:
        return set()
    seen.add(fn)
    names = {type(fn).__name__}
    for nxt, _ in fn.next_functions:
        names |= _graph_names(nxt, seen)
    return names


def layer_case(B, T, H, d_h, n_modes, axes, causal, per_sample, default, seed, bias=False, programs=512,
               mlp=(8, 2), scale=None):
    from mixlab.ops import goat_triton

    goat_triton._PROGRAMS = programs  # few programs: batch chunks of several images, the last one partial
    from mixlab.coords import Coords
    from mixlab.mixers.attention import Attention

    torch.manual_seed(seed)
    args = dict(d_model=H * d_h, n_heads=H, causal=causal, position="goat", bias=bias)
    pa = dict(n_modes=n_modes, axes=axes, init="random", default_bias=default, key_mlp_hidden=mlp[0],
              key_mlp_freqs=mlp[1])
    ref = Attention(**args, position_args=dict(pa, lane_impl="torch"))
    fast = Attention(**args, position_args=dict(pa, lane_impl="triton"))
    ref.reset_parameters()
    fast.load_state_dict(ref.state_dict())
    ref, fast = ref.to(DEV), fast.to(DEV)
    x = torch.randn(B, T, H * d_h).to(DEV)
    if axes == 1:
        c = Coords.seq(T, device=DEV)
    else:
        pos = torch.randint(0, 9, (B if per_sample else 1, T, axes))
        mask = torch.rand(B if per_sample else 1, T, axes) > 0.2
        c = Coords(pos.to(DEV), mask.to(DEV), key=None, scale=scale)  # scale: ViT patch_coords="scaled"
    gy = torch.randn(B, T, H * d_h).to(DEV)
    outs = []
    for m in (ref, fast, fast):  # fast twice: the second call launches the cached compiled kernels (GPU)
        m.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        y = m(xx, c)
        if m is fast:  # lanes written into the projection's own output: no CopySlices clone of d qkv, and
            names = _graph_names(y.grad_fn)  # d qkv built by GoatQKV's backward, not by unbind/permute/view
            assert "GoatQKVBackward" in names and not names & {"CopySlices", "UnbindBackward0"}, sorted(names)
        (y * gy).sum().backward()
        outs.append((y.detach(), xx.grad, {n: q.grad for n, q in m.named_parameters()}))
    (y0, gx0, g0) = outs[0]
    err = 0.0
    for y1, gx1, g1 in outs[1:]:  # SDPA's backward is not bitwise deterministic on GPUs: compare each to ref
        err = max(err, (y0 - y1).abs().max().item(), (gx0 - gx1).abs().max().item())
        for n in g0:
            a, b = g0[n], g1[n]
            err = max(err, ((a - b).abs().max() / (a.abs().max() + 1e-6)).item())
    lanes = fast.qkv.weight.grad.view(3, H, d_h, -1)[:2, :, d_h - (2 * n_modes + 2):]
    assert lanes.abs().max().item() == 0.0, "lane rows of qkv must get exactly zero gradient"
    return err


def split_case(B, T, H, d_h, seed):
    """QKVSplit (lane-free schemes) against view/permute/unbind: values and d qkv, for gradients
    in SDPA's usual layout and in a transposed ([B, T, H, d_h] memory) layout."""
    from mixlab.ops.goat_triton import QKVSplit

    g = torch.Generator().manual_seed(seed)
    base = torch.randn(B * T, 3 * H * d_h, generator=g).to(DEV)
    grads = [torch.randn(B, T, H, d_h, generator=g).to(DEV).transpose(1, 2),
             torch.randn(B, H, T, d_h, generator=g).to(DEV),
             torch.randn(B, T, H, d_h, generator=g).to(DEV).transpose(1, 2)]
    outs = []
    for split in (lambda z: z.view(B, T, 3, H, d_h).permute(2, 0, 3, 1, 4).unbind(0),
                  lambda z: QKVSplit.apply(z, B, H, d_h)):
        src = base.clone().requires_grad_()
        q, k, v = split(src * 1.0)
        sum((x * gx).sum() for x, gx in zip((q, k, v), grads)).backward()
        outs.append((torch.stack([q, k, v]).detach(), src.grad))
    return max((outs[0][0] - outs[1][0]).abs().max().item(), (outs[0][1] - outs[1][1]).abs().max().item())


def _compare_layers(ref, fast, x, gy, c, backward_node=None):
    """Max difference of output, input gradient and (relative) parameter gradients between the layer
    ``ref`` and ``fast = (module, callable)``; ``backward_node`` must appear in the fast path's graph."""
    outs = []
    for m, fn in ((ref, ref), fast):
        m.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        y = fn(xx, c)
        if backward_node and m is fast[0]:
            assert backward_node in _graph_names(y.grad_fn)
        (y * gy).sum().backward()
        outs.append((y.detach(), xx.grad, {n: q.grad for n, q in m.named_parameters()}))
    (y0, gx0, g0), (y1, gx1, g1) = outs
    err = max((y0 - y1).abs().max().item(), (gx0 - gx1).abs().max().item())
    for n in g0:
        err = max(err, ((g0[n] - g1[n]).abs().max() / (g0[n].abs().max() + 1e-6)).item())
    return err


def compiled_case(B, T, H, d_h, n_modes, axes, causal, seed):
    """The torch.compile path (``fullgraph=True``; the lanes written into the packed qkv in place by the kernel
    op ``mixlab::goat_lanes_into`` inside ``GoatLanesInto``; the parameter gradient and the zeroed lane entries
    of ``d qkv`` by ``mixlab::goat_lanes_backward``) against the eager layer with torch lanes: output, input
    gradient and parameter gradients; plus ``torch.library.opcheck`` of both ops (schema with the mutation,
    fake tensors)."""
    from mixlab.coords import Coords
    from mixlab.mixers.attention import Attention
    from mixlab.ops.goat_triton import goat_lanes_backward, goat_lanes_into, meta_key, pack_features

    backend = "inductor" if DEV.type == "cuda" else "aot_eager"
    torch.manual_seed(seed)
    args = dict(d_model=H * d_h, n_heads=H, causal=causal, position="goat")
    pa = dict(n_modes=n_modes, axes=axes, init="random", key_mlp_hidden=8, key_mlp_freqs=2)
    ref = Attention(**args, position_args=dict(pa, lane_impl="torch"))
    ref.reset_parameters()
    fast = Attention(**args, position_args=dict(pa, lane_impl="triton"))
    fast.load_state_dict(ref.state_dict())
    ref, fast = ref.to(DEV), fast.to(DEV)
    c = Coords.seq(T, device=DEV) if axes == 1 else Coords(torch.randint(0, 9, (1, T, axes)).to(DEV))
    x, gy = torch.randn(B, T, H * d_h).to(DEV), torch.randn(B, T, H * d_h).to(DEV)
    err = _compare_layers(ref, (fast, torch.compile(fast, backend=backend, fullgraph=True)), x, gy, c)
    # the ops themselves: opcheck runs their schema (incl. the declared mutation) and fake-tensor tests
    pos = fast.pos
    f = pos._features(c, torch.float32)
    feat = pack_features(f["cos"], f["sin"], f["present"], f.get("phi"), f["j_hi"], f["j_lo"], f["is_bos"],
                         f["is_none"])
    params, key = pos._flat_params().detach().clone(), meta_key(pos._kernel_meta())
    qkv = torch.randn(B * T, 3 * H * d_h, device=DEV)
    torch.library.opcheck(goat_lanes_into, (qkv, feat, params, key, B, d_h),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(goat_lanes_backward, (torch.randn_like(qkv), feat, params, key, B, d_h),
                          test_utils=("test_schema", "test_faketensor"))
    return err


def rope_case(B, T, H, d_h, axes, causal, per_sample, seed, bias=False, compiled=False):
    """RoPE's in-place path (``rotary_impl="triton"``: q, k rotated inside the packed qkv by RopeQKV) against
    the torch path (QKVSplit views + rotation): output, input gradient, every parameter gradient. With
    ``compiled``: the fast layer under ``torch.compile`` (``fullgraph=True``), where the rotation runs in place as
    the kernel op ``mixlab::rope_rotate`` inside ``RopeQKVInto`` (forward, and by ``-theta`` on ``d qkv``
    backward); plus ``torch.library.opcheck`` of the op and the op's inverse undoing its rotation."""
    from mixlab.coords import Coords
    from mixlab.mixers.attention import Attention
    from mixlab.ops.rope_triton import rope_rotate

    torch.manual_seed(seed)
    args = dict(d_model=H * d_h, n_heads=H, causal=causal, position="rope", bias=bias)
    ref = Attention(**args, position_args=dict(axes=axes, rotary_impl="torch"))
    fast = Attention(**args, position_args=dict(axes=axes, rotary_impl="triton"))
    fast.load_state_dict(ref.state_dict())
    ref, fast = ref.to(DEV), fast.to(DEV)
    if axes == 1 and not per_sample:
        c = Coords.seq(T, device=DEV)
    else:
        pos = torch.randint(0, 9, (B if per_sample else 1, T, axes))
        c = Coords(pos.to(DEV), (torch.rand(B if per_sample else 1, T, axes) > 0.2).to(DEV))
    x, gy = torch.randn(B, T, H * d_h).to(DEV), torch.randn(B, T, H * d_h).to(DEV)
    if not compiled:
        return _compare_layers(ref, (fast, fast), x, gy, c, backward_node="RopeQKVBackward")
    backend = "inductor" if DEV.type == "cuda" else "aot_eager"
    err = _compare_layers(ref, (fast, torch.compile(fast, backend=backend, fullgraph=True)), x, gy, c)
    cos, sin = (t.squeeze(1).float().contiguous() for t in fast.pos._cos_sin(c, torch.float32))
    qkv = torch.randn(B * T, 3 * H * d_h, device=DEV)
    torch.library.opcheck(rope_rotate, (qkv.clone(), cos, sin, H, d_h, axes, False),
                          test_utils=("test_schema", "test_faketensor"))
    turned = qkv.clone()
    rope_rotate(turned, cos, sin, H, d_h, axes, False)
    moved = (turned - qkv).abs().max().item()
    rope_rotate(turned, cos, sin, H, d_h, axes, True)
    assert moved > 0.1, moved  # it rotated, and the inverse rotation undoes it
    return max(err, (turned - qkv).abs().max().item())


def _watch_traced_launches():
    """Count the kernel launches inside the traced ops (``mixlab.ops.compile.traced_launch``) that pass a tensor
    the kernel writes as two arguments: ``torch.compile`` clones each written argument of a traced kernel on its
    own, so such a launch loses the writes made through one of them (on the H200 the first in-place GOAT op did:
    ``_lanes_fwd`` got ``qkv`` as ``qout`` and ``kout``)."""
    from mixlab.ops import goat_triton, rope_triton

    writes = {  # the arguments each kernel stores through, by its flags
        "_lanes_fwd": lambda kw: ("qout",) if kw["ONE_OUT"] else ("qout", "kout"),
        "_lanes_bwd_reduce": lambda kw: ("dq", "g") if kw["ZERO"] else ("g",),
        "_lanes_bwd_params": lambda kw: ("part",), "_rope_fwd": lambda kw: ("qkv",)}
    seen = {"launches": 0, "shared": 0}

    def watch(fn, grid, args, kwargs, _orig=goat_triton.traced_launch):
        named = dict(zip(fn.arg_names, args))
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        seen["launches"] += 1
        seen["shared"] += any(sum(_same(named[n], a) for a in tensors) > 1 for n in writes[fn.__name__](kwargs))
        return _orig(fn, grid, args, kwargs)

    def _same(a, b):
        # the same tensor object, or (real tensors) the same address; under torch.compile's tracing the
        # arguments are fake tensors, which have no address
        if a is b:
            return True
        fake = torch._subclasses.fake_tensor.is_fake
        return not (fake(a) or fake(b)) and a.data_ptr() == b.data_ptr()

    goat_triton.traced_launch = rope_triton.traced_launch = watch
    return seen


_LAUNCHES = _watch_traced_launches()
res = {
    "rope_causal_T37": rope_case(3, 37, 2, 16, 1, True, False, 25),
    "rope_T1": rope_case(2, 1, 2, 8, 1, True, False, 26),
    "rope_2d_per_sample_bias": rope_case(2, 20, 3, 24, 2, False, True, 27, bias=True),
    "compiled_layer_causal_T37": compiled_case(2, 37, 2, 16, 2, 1, True, 23),
    "compiled_layer_2d": compiled_case(3, 20, 2, 16, 2, 2, False, 24),
    "compiled_rope_T37": rope_case(2, 37, 2, 16, 1, True, False, 28, compiled=True),
    "compiled_rope_2d_per_sample": rope_case(3, 20, 2, 24, 2, True, True, 29, compiled=True),
    "split_plain_T37": split_case(3, 37, 2, 24, 20),
    "split_plain_T1": split_case(1, 1, 3, 16, 21),
    "layer_causal_T70": layer_case(3, 70, 2, 16, 2, 1, True, False, False, 10),
    "layer_T1": layer_case(2, 1, 2, 16, 1, 1, True, False, False, 11),
    "layer_causal_T260": layer_case(2, 260, 2, 16, 1, 1, True, False, False, 17),  # 64-token blocks
    "layer_bias": layer_case(2, 40, 2, 16, 2, 1, False, False, False, 13, bias=True),
    "layer_2d_per_sample_default": layer_case(2, 37, 3, 16, 2, 2, False, True, True, 12),
    "layer_2d_shared_batch_chunks": layer_case(5, 37, 2, 16, 2, 2, False, False, True, 14, programs=8),
    "layer_2d_scaled": layer_case(2, 37, 2, 16, 2, 2, False, False, True, 22, scale=(0.5, 0.75)),
    "layer_head_dim_24": layer_case(3, 45, 2, 24, 2, 1, True, False, True, 18, programs=4),  # padded head tile

    "self_mlp": case(1, 1, 70, 70, 3, 2, 6, 5, True, True, False, True, 0),
    "batch_q_default": case(2, 1, 33, 20, 2, 3, 4, 8, True, False, True, True, 1),
    "no_mlp_T1": case(1, 1, 1, 1, 1, 2, 3, 3, False, True, False, False, 2),
    "alibi_like_R0": case(1, 1, 65, 65, 0, 2, 3, 3, True, False, False, False, 3),
}
# every traced launch above got distinct tensors (value 0; and the compiled cases did launch through it)
res["traced_launch_shared_args"] = float(_LAUNCHES["shared"] + (_LAUNCHES["launches"] == 0))


def deterministic_case(B, T, H, n_modes, seed):
    """GoatQKV's backward twice on the same (dq, dk, dv): d qkv and the parameter gradient must be
    bitwise equal (the kernel's cross-program sums run in a fixed order). Returns the max diff."""
    from mixlab.coords import Coords
    from mixlab.mixers.attention import Attention

    torch.manual_seed(seed)
    m = Attention(H * 64, H, causal=True, position="goat", position_args=dict(n_modes=n_modes, init="random")).to(DEV)
    qkv0 = torch.randn(B * T, 3 * H * 64, device=DEV)
    grads = [torch.randn(B, H, T, 64, device=DEV) for _ in range(3)]
    outs = []
    for _ in range(2):
        src = qkv0.clone().requires_grad_()
        q, k, v = m.pos.pack(src * 1.0, Coords.seq(T, device=DEV), B)
        d_src, d_prm = torch.autograd.grad((q, k, v), (src, m.pos.prior), grads)
        outs.append((d_src, d_prm))
    return max((outs[0][0] - outs[1][0]).abs().max().item(), (outs[0][1] - outs[1][1]).abs().max().item())


if DEV.type == "cuda":  # ViT-S/16 at 224: 196 patches + [CLS] (no coordinates), 6 heads, R=16, default MLP
    res["layer_vit_s_B64"] = layer_case(64, 197, 6, 64, 16, 2, False, False, True, 15, mlp=(32, 8))
    res["layer_lm_B8_T2048"] = layer_case(8, 2048, 12, 64, 4, 1, True, False, False, 16, mlp=(32, 8))
    res["deterministic_lm_B8_T2048"] = deterministic_case(8, 2048, 12, 4, 19)  # must be exactly 0
    res["compiled_layer_lm_B8_T2048"] = compiled_case(8, 2048, 12, 64, 4, 1, True, 30)  # Inductor, 124M-sized
    res["compiled_layer_vit_s_B64"] = compiled_case(64, 196, 6, 64, 16, 2, False, 31)
    res["compiled_rope_lm_B8_T2048"] = rope_case(8, 2048, 12, 64, 1, True, False, 32, compiled=True)
print(json.dumps(res))
