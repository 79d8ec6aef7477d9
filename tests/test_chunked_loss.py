"""The chunked output layer + cross entropy (``mixlab.heads.loss``, the LM heads' ``loss_chunk_tokens``)
equals the plain full cross entropy: loss, hits and the gradients of the hidden states and the weight."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from mixlab.backbone import BackboneConfig
from mixlab.heads.lm import AUTO_CHUNK_TOKENS, CausalLM
from mixlab.heads.loss import fused_linear_cross_entropy, linear_cross_entropy
from mixlab.heads.synthetic import SyntheticLM


def _plain(h, w, t):
    logits = F.linear(h, w)
    nll = F.cross_entropy(logits, t, reduction="none", ignore_index=-100)
    return nll, (logits.argmax(-1) == t) & (t != -100)


@pytest.mark.parametrize("n,chunk", [(37, 5), (37, 36), (37, 37), (37, 100), (1, 3), (64, 7)],
                         ids=lambda v: str(v))
def test_linear_cross_entropy_equals_the_full_cross_entropy_in_float64(n, chunk):
    g = torch.Generator().manual_seed(n * 101 + chunk)
    d, v = 12, 29
    h = torch.randn(n, d, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(v, d, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.3] = -100  # masked positions, as the heads' targets carry them
    up = torch.randn(n, dtype=torch.float64, generator=g)  # a per-token upstream gradient, not just a mean
    nll, valid, hits = linear_cross_entropy(h, w, t, chunk=chunk)
    gh, gw = torch.autograd.grad((nll * up).sum(), (h, w))
    ref, ref_hits = _plain(h, w, t)
    rh, rw = torch.autograd.grad((ref * up).sum(), (h, w))
    assert nll.dtype == torch.float64 and valid.dtype == hits.dtype == torch.bool
    torch.testing.assert_close(nll, ref, rtol=1e-10, atol=1e-10)
    assert torch.equal(valid, t != -100) and torch.equal(hits, ref_hits)
    assert torch.all(nll[t == -100] == 0)
    torch.testing.assert_close(gh, rh, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gw, rw, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("n,chunk", [(37, 5), (37, 37), (37, 100), (1, 3), (64, 7)], ids=lambda v: str(v))
def test_fused_linear_cross_entropy_equals_the_mean_cross_entropy_in_float64(n, chunk):
    """Loss, per-token scores and both gradients (scaled by a non-unit upstream gradient) equal the
    plain full-logits mean cross entropy; a chunk with no scored token contributes nothing."""
    g = torch.Generator().manual_seed(n * 7 + chunk)
    d, v = 12, 29
    h = torch.randn(n, d, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(v, d, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.3] = -100
    t[:min(chunk, n - 1)] = -100  # the first chunk has no scored token (n = 1: nothing masked here)
    loss, nll, valid, hits = fused_linear_cross_entropy(h, w, t, chunk=chunk)
    gh, gw = torch.autograd.grad(2.5 * loss, (h, w))
    ref, ref_hits = _plain(h, w, t)
    ref_loss = ref.sum() / (t != -100).sum().clamp_min(1)
    rh, rw = torch.autograd.grad(2.5 * ref_loss, (h, w))
    assert loss.dtype == nll.dtype == torch.float64
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(nll, ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(valid, t != -100) and torch.equal(hits, ref_hits)
    torch.testing.assert_close(gh, rh, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw, rw, rtol=1e-10, atol=1e-12)


def _saved_shapes(fn, n=50, d=8, v=1000):
    """Shapes of the tensors autograd keeps for backward when ``fn(h [n, d], w [v, d], t [n])`` runs,
    after a backward pass through its first output (which must reach ``h`` and ``w``)."""
    h = torch.randn(n, d, requires_grad=True)
    w = torch.randn(v, d, requires_grad=True)
    t = torch.randint(0, v, (n,))
    saved: list[tuple[int, ...]] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(tuple(x.shape)) or x, lambda x: x):
        out = fn(h, w, t)[0]
    out.sum().backward()
    assert h.grad is not None and w.grad is not None
    return saved


def test_fused_linear_cross_entropy_keeps_no_logits_and_traces_in_one_graph():
    """What backward keeps is d hidden and d weight only (no [chunk, V] logits), and torch.compile's
    tracer takes the whole function without a graph break."""
    n, d, v, chunk = 50, 8, 1000, 16
    saved = _saved_shapes(lambda h, w, t: fused_linear_cross_entropy(h, w, t, chunk=chunk), n, d, v)
    assert sorted(saved) == sorted([(n, d), (v, d)]), saved
    h, w, t = torch.randn(n, d), torch.randn(v, d), torch.randint(0, v, (n,))
    explained = torch._dynamo.explain(lambda a, b, c: fused_linear_cross_entropy(a, b, c, chunk=chunk)[0])(h, w, t)
    assert explained.graph_break_count == 0, explained.break_reasons


@pytest.mark.parametrize("autocast", [False, True])
def test_fused_linear_cross_entropy_compiled_keeps_only_the_two_gradients(autocast):
    """Under AOTAutograd's min-cut partitioner (what ``torch.compile`` uses) the forward graph hands
    backward ``d hidden [n, d]`` and ``d weight [v, d]`` only. Traced through as an autograd.Function it
    kept every chunk's partial ``d weight`` and slices of ``G`` (the compiled 124M LM's peak memory was
    above the plain model's: 11.4 vs 8.35 GiB on the H200)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    n, d, v, chunk = 50, 8, 1000, 16
    forward_graphs = []

    def keep(gm, _inputs):
        forward_graphs.append(gm)
        return make_boxed_func(gm)

    fn = aot_function(lambda a, b, c: fused_linear_cross_entropy(a, b, c, chunk=chunk)[0], fw_compiler=keep,
                      bw_compiler=lambda gm, _: make_boxed_func(gm), partition_fn=min_cut_rematerialization_partition)
    h = torch.randn(n, d, requires_grad=True)
    w = torch.randn(v, d, requires_grad=True)
    t = torch.randint(0, v, (n,))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = fn(h, w, t)
    loss.backward()
    outputs = next(node for node in forward_graphs[0].graph.nodes if node.op == "output").args[0]
    assert sorted(tuple(o.meta["val"].shape) for o in outputs) == [(), (n, d), (v, d)]
    ref_h, ref_w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        fused_linear_cross_entropy(ref_h, ref_w, t, chunk=chunk)[0].backward()
    torch.testing.assert_close(h.grad, ref_h.grad, rtol=0, atol=0)
    torch.testing.assert_close(w.grad, ref_w.grad, rtol=0, atol=0)


def test_fused_linear_cross_entropy_per_token_outputs_carry_no_gradient():
    h, w, t = torch.randn(7, 4, requires_grad=True), torch.randn(11, 4, requires_grad=True), torch.randint(0, 11, (7,))
    loss, nll, valid, hits = fused_linear_cross_entropy(h, w, t, chunk=3)
    assert loss.requires_grad and not (nll.requires_grad or valid.requires_grad or hits.requires_grad)


def test_linear_cross_entropy_recomputes_instead_of_keeping_the_logits():
    """With chunks, what autograd keeps for backward holds no [chunk, V] tensor (the logits are recomputed)."""
    v = 1000
    saved = _saved_shapes(lambda h, w, t: linear_cross_entropy(h, w, t, chunk=16), v=v)
    assert saved and not [s for s in saved if len(s) == 2 and s[-1] == v], saved


def test_linear_cross_entropy_rejects_a_bad_chunk_and_bad_shapes():
    h, w, t = torch.randn(4, 3), torch.randn(5, 3), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        linear_cross_entropy(h, w, t, chunk=0)
    with pytest.raises(ValueError, match=r"hidden \[N, D\]"):
        linear_cross_entropy(h[None], w, t, chunk=2)
    with pytest.raises(ValueError, match="fused_linear_cross_entropy: chunk must be >= 1"):
        fused_linear_cross_entropy(h, w, t, chunk=0)
    with pytest.raises(ValueError, match=r"hidden \[N, D\] and targets \[N\]"):
        fused_linear_cross_entropy(h, w, t[:3], chunk=2)


def _model(cls, chunk, **kw):
    torch.manual_seed(0)
    cfg = BackboneConfig(d_model=32, n_layers=2, n_heads=2, mixer="goat")
    return cls(vocab_size=23, backbone=cfg, loss_chunk_tokens=chunk, **kw).double()


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("cls", [CausalLM, SyntheticLM])
def test_heads_training_loss_and_gradients_do_not_depend_on_loss_chunk_tokens(cls, tie):
    torch.manual_seed(1)
    batch = torch.randint(0, 23, (3, 14))  # 3 x 13 = 39 scored tokens: chunks of 5 do not divide it
    if cls is SyntheticLM:
        tgt = batch[:, 1:].clone()
        tgt[:, :4] = -100
        batch = {"inputs": batch[:, :-1], "targets": tgt, "span": torch.rand(3, 13) < 0.5}
    results = []
    for chunk in (0, 5):
        model = _model(cls, chunk, tie_embeddings=tie, **({"span_weight": 2.0} if cls is SyntheticLM else {}))
        model.log = lambda *a, **k: None  # no trainer attached
        loss = model.training_step(batch, 0)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        with torch.no_grad():
            scores = model._nll(batch)  # the evaluation sums' inputs: (nll, valid, hits)
        results.append((loss.detach(), grads, scores))
    (l0, g0, s0), (l1, g1, s1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-10, atol=1e-10)
    assert g0.keys() == g1.keys() and ("embed.weight" if tie else "lm_head.weight") in g0
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-10, atol=1e-10, msg=name)
    torch.testing.assert_close(s1[0], s0[0], rtol=1e-10, atol=1e-10)
    assert torch.equal(s1[1], s0[1]) and torch.equal(s1[2], s0[2])


def test_loss_chunk_tokens_defaults_on_for_large_vocabularies_only():
    cfg = BackboneConfig(d_model=8, n_layers=1, n_heads=1, mixer="nope")
    assert CausalLM(vocab_size=5, backbone=cfg).loss_chunk_tokens == 0
    assert CausalLM(vocab_size=50304, backbone=cfg).loss_chunk_tokens == AUTO_CHUNK_TOKENS
    assert CausalLM(vocab_size=50304, backbone=cfg, loss_chunk_tokens=0).loss_chunk_tokens == 0
    with pytest.raises(ValueError, match="loss_chunk_tokens must be >= 0"):
        CausalLM(vocab_size=5, backbone=cfg, loss_chunk_tokens=-1)
    with pytest.raises(ValueError, match=r"abs_pos_len must be >= 0 \(0: no learned absolute positions\); got -5"):
        CausalLM(vocab_size=5, backbone=cfg, abs_pos_len=-5)  # accepted silently before (user test)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_linear_cross_entropy_under_autocast_matches_float64(dtype):
    """Under autocast the logits matmul runs in the autocast dtype, as F.linear's would; the loss and both
    gradients are in float32 and no further from the float64 cross entropy than the plain path's under
    the same autocast (float16: within 1e-3 relative norm). Under float16
    (``16-mixed``) the gradient ``(softmax - onehot) / n``, formed in forward before any loss scale
    multiplies it, has entries ~1/(V n) that float16 flushes or rounds away: its products run in float32
    (in float16, d W was 3e-3 off)."""
    torch.manual_seed(0)
    n, d, v = 8192, 16, 512
    h = torch.randn(n, d, requires_grad=True)
    w = (0.1 * torch.randn(v, d)).requires_grad_()
    t = torch.randint(0, v, (n,))
    with torch.autocast("cpu", dtype=dtype):
        loss = fused_linear_cross_entropy(h, w, t, chunk=3000)[0]
        plain = F.cross_entropy(F.linear(h, w).float(), t)
    gh, gw = torch.autograd.grad(loss, (h, w))
    ph, pw = torch.autograd.grad(plain, (h, w))
    hd, wd = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = F.cross_entropy(F.linear(hd, wd), t)
    rh, rw = torch.autograd.grad(ref, (hd, wd))

    def err(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    assert loss.dtype == gh.dtype == gw.dtype == torch.float32
    assert abs(loss.item() - ref.item()) < 1e-3 * ref.item()
    # no further from float64 than the plain path under the same autocast (bf16 itself: ~3e-3 for d W)
    assert err(gw, rw) < max(1e-3, 1.5 * err(pw, rw)) and err(gh, rh) < max(1e-3, 1.5 * err(ph, rh))
    if dtype == torch.float16:
        assert err(gw, rw) < 1e-3 and err(gh, rh) < 1e-3


def test_fused_linear_cross_entropy_on_correlated_states_and_peaked_logits_in_float32():
    """Inputs shaped like a trained LM's, not i.i.d.: hidden states on a low-rank subspace (correlated
    tokens), an output matrix whose logits reach +-60 (near one-hot softmax: the in-place exp must not
    overflow), targets mostly the model's own argmax, 3,001 tokens in chunks of 512. Float32 loss and
    gradients against the float64 full cross entropy."""
    g = torch.Generator().manual_seed(11)
    n, d, v, rank = 3001, 48, 700, 4
    basis = torch.randn(rank, d, dtype=torch.float64, generator=g)
    h64 = torch.randn(n, rank, dtype=torch.float64, generator=g) @ basis + 0.05 * torch.randn(n, d, dtype=torch.float64,
                                                                                               generator=g)
    w64 = 3.0 * torch.randn(v, d, dtype=torch.float64, generator=g)
    logits = h64 @ w64.t()
    t = torch.where(torch.rand(n, generator=g) < 0.8, logits.argmax(-1), torch.randint(0, v, (n,), generator=g))
    t[::97] = -100
    assert logits.abs().max() > 60  # peaked, as intended
    h, w = h64.float().requires_grad_(), w64.float().requires_grad_()
    loss = fused_linear_cross_entropy(h, w, t, chunk=512)[0]
    gh, gw = torch.autograd.grad(loss, (h, w))
    hd, wd = h64.clone().requires_grad_(), w64.clone().requires_grad_()
    ref = F.cross_entropy(F.linear(hd, wd), t, ignore_index=-100)
    rh, rw = torch.autograd.grad(ref, (hd, wd))
    assert torch.isfinite(loss) and abs(loss.item() - ref.item()) < 1e-4 * max(ref.item(), 1.0)
    torch.testing.assert_close(gh.double(), rh, rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(gw.double(), rw, rtol=1e-3, atol=1e-6)


_FLA_SCRIPT = r"""
import json, torch, torch.nn.functional as F
from mixlab.backbone import BackboneConfig
from mixlab.heads.lm import CausalLM
from mixlab.heads.loss import fused_linear_cross_entropy

g = torch.Generator().manual_seed(5)
n, d, v, rank = 301, 48, 700, 4  # correlated states, logits up to +-60, mostly the argmax as target, ignored rows
basis = torch.randn(rank, d, dtype=torch.float64, generator=g)
h64 = torch.randn(n, rank, dtype=torch.float64, generator=g) @ basis + 0.05 * torch.randn(n, d, dtype=torch.float64,
                                                                                           generator=g)
w64 = 3.0 * torch.randn(v, d, dtype=torch.float64, generator=g)
t = torch.where(torch.rand(n, generator=g) < 0.8, (h64 @ w64.t()).argmax(-1), torch.randint(0, v, (n,), generator=g))
t[::13] = -100
hd, wd = h64.clone().requires_grad_(), w64.clone().requires_grad_()
ref = F.cross_entropy(F.linear(hd, wd), t, ignore_index=-100)
rh, rw = torch.autograd.grad(ref, (hd, wd))
rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()
res = {"peak": (h64 @ w64.t()).abs().max().item()}
for name, dt in (("fp32", None), ("bf16", torch.bfloat16)):
    out = {}
    for kernel in ("torch", "fla"):
        h, w = h64.float().requires_grad_(), w64.float().requires_grad_()
        with torch.autocast("cpu", dtype=dt or torch.bfloat16, enabled=dt is not None):
            loss, nll, valid, hits = fused_linear_cross_entropy(h, w, t, chunk=64, kernel=kernel)
        out[kernel] = (loss, nll, hits, *torch.autograd.grad(loss, (h, w)))
    (lt, nt, ht, ght, gwt), (lf, nf, hf, ghf, gwf) = out["torch"], out["fla"]
    res[name] = {"loss_ref": abs(lf.item() - ref.item()) / ref.item(), "loss_torch": abs(lf.item() - lt.item()),
                 "nll": (nf - nt).abs().max().item(), "hits_equal": bool(torch.equal(hf, ht)),
                 "gh_torch": rel(ghf, ght), "gw_torch": rel(gwf, gwt), "gh_ref": rel(ghf, rh), "gw_ref": rel(gwf, rw),
                 "gh_ref_torch": rel(ght, rh), "gw_ref_torch": rel(gwt, rw), "dtype": str(lf.dtype)}
# the LM head: a training step's loss and every parameter's gradient, loss_kernel fla vs torch (bf16 autocast)
grads = {}
for kernel in ("torch", "fla"):
    torch.manual_seed(0)
    m = CausalLM(vocab_size=300, backbone=BackboneConfig(d_model=32, n_layers=2, n_heads=2, mixer="goat"),
                 loss_chunk_tokens=16, loss_kernel=kernel)
    x = torch.randint(0, 300, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = m.mean_loss(x[:, :-1], x[:, 1:])[0]
    loss.backward()
    grads[kernel] = (loss.item(), {k: p.grad.clone() for k, p in m.named_parameters()})
res["lm_loss"] = abs(grads["fla"][0] - grads["torch"][0])
res["lm_grad"] = max(rel(grads["fla"][1][k], grads["torch"][1][k]) for k in grads["torch"][1])
print(json.dumps(res))
"""


def test_fla_loss_kernel_equals_the_torch_kernel_and_float64_under_the_interpreter():
    """``kernel="fla"`` (fla's Triton cross-entropy kernels, run on CPU by Triton's interpreter) against the torch
    kernel and the float64 cross entropy, on correlated hidden states with logits up to +-60, ignored targets and
    301 tokens in chunks of 64: float32 loss within 1e-5 of float64 and gradients within 1e-4; under bf16 autocast
    the same loss as the torch kernel to float32 rounding, the same hits, gradients within one bf16 rounding of
    ``G`` of the torch kernel's and no further from float64. A CausalLM training step with ``loss_kernel: fla``
    gives the torch kernel's loss and parameter gradients."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", _FLA_SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                         cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["peak"] > 60
    f32, b16 = r["fp32"], r["bf16"]
    assert f32["dtype"] == b16["dtype"] == "torch.float32"
    assert f32["loss_ref"] < 1e-5 and f32["loss_torch"] < 1e-5 and f32["nll"] < 1e-4 and f32["hits_equal"]
    assert max(f32["gh_ref"], f32["gw_ref"], f32["gh_torch"], f32["gw_torch"]) < 1e-4
    assert b16["loss_torch"] < 1e-5 and b16["nll"] < 1e-4 and b16["hits_equal"]
    assert b16["gh_torch"] < 1e-2 and b16["gw_torch"] < 1e-2
    assert b16["gh_ref"] < 1.5 * b16["gh_ref_torch"] + 1e-3 and b16["gw_ref"] < 1.5 * b16["gw_ref_torch"] + 1e-3
    assert r["lm_loss"] < 1e-5 and r["lm_grad"] < 2e-2


def test_loss_kernel_bad_names_and_fla_off_cuda_are_one_line_errors():
    h, w, t = torch.randn(4, 3), torch.randn(5, 3), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="kernel must be one of torch, fla, auto; got 'triton'"):
        fused_linear_cross_entropy(h, w, t, chunk=2, kernel="triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="kernel 'fla' needs CUDA tensors"):
            fused_linear_cross_entropy(h, w, t, chunk=2, kernel="fla")
    with pytest.raises(ValueError, match="needs CUDA tensors"):  # float64 matmuls never take fla's kernels
        fused_linear_cross_entropy(h.double(), w.double(), t, chunk=2, kernel="fla")
    # auto on CPU is the torch kernel: the same numbers
    a, b = (fused_linear_cross_entropy(h, w, t, chunk=2, kernel=k)[0] for k in ("auto", "torch"))
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="loss_kernel must be one of torch, fla, auto; got 'liger'"):
        CausalLM(vocab_size=5, backbone=BackboneConfig(d_model=16, n_layers=1, n_heads=2), loss_kernel="liger")
    # a fit on CPU with loss_kernel fla stops at on_fit_start (before the sanity check), naming the option
    m = CausalLM(vocab_size=5, backbone=BackboneConfig(d_model=32, n_layers=1, n_heads=2), loss_chunk_tokens=4,
                 loss_kernel="fla")
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="loss_kernel 'fla' .* needs a CUDA device; this run trains on cpu"):
            m.on_fit_start()
    # float16 precision: refused too (checked after the device; the interpreter stands in for CUDA here)
    import types

    m._trainer = types.SimpleNamespace(precision="16-mixed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        with pytest.raises(ValueError, match="loss_kernel 'fla' supports bf16 and float32 matmuls; precision 16-mixed"):
            m.on_fit_start()
        m._trainer = types.SimpleNamespace(precision="bf16-mixed")
        m.on_fit_start()  # accepted
    m._trainer = None
    # fla without chunking would be silently the torch path: refused at construction (vocabulary 5: no auto chunks)
    with pytest.raises(ValueError, match="loss_kernel 'fla' runs inside the chunked training loss, but "
                                         "loss_chunk_tokens is 0 .* this one has 5"):
        CausalLM(vocab_size=5, backbone=BackboneConfig(d_model=32, n_layers=1, n_heads=2), loss_kernel="fla")
