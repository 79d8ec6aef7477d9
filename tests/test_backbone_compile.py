"""``BackboneConfig.compile``: blocks through torch.compile on CUDA only, same values, same state keys."""

import torch

import mixlab.backbone as bb
from mixlab.backbone import Backbone, BackboneConfig
from mixlab.coords import Coords


def _model(compile: bool) -> Backbone:
    torch.manual_seed(0)
    return Backbone(BackboneConfig(d_model=32, n_layers=2, n_heads=2, mixer="goat,kda", compile=compile)).double()


def test_compile_option_keeps_cpu_eager_and_the_state_keys(monkeypatch):
    calls = []
    monkeypatch.setattr(bb.torch, "compile", lambda m, **kw: calls.append(m) or m)
    eager, comp = _model(False), _model(True)
    assert list(comp.state_dict()) == list(eager.state_dict())
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    torch.testing.assert_close(comp(x), eager(x), rtol=0, atol=0)
    assert calls == []  # a CPU forward never compiles


def test_compiled_blocks_give_the_eager_values():
    """The compiled callables (aot_eager backend: traced by Dynamo and AOTAutograd, no C++ build) equal
    the eager blocks, forward and backward, GOAT's lanes included."""
    comp = _model(True)
    orig = torch.compile
    bb.torch.compile = lambda m, **kw: orig(m, backend="aot_eager", **kw)
    try:
        blocks = comp._compiled_blocks()
    finally:
        bb.torch.compile = orig
    assert comp._compiled_blocks() is blocks and len(blocks) == 2  # built once
    assert blocks[0] is not comp.blocks[0] and blocks[1] is comp.blocks[1]  # kda is not compile_safe: eager
    x = torch.randn(2, 9, 32, dtype=torch.float64, requires_grad=True)
    c = Coords.seq(9)
    ref = x
    out = x
    for blk, fast in zip(comp.blocks, blocks):
        ref, out = blk(ref, c), fast(out, c)
    torch.testing.assert_close(out, ref)
    (g_ref,) = torch.autograd.grad(ref.square().sum(), x)
    (g_out,) = torch.autograd.grad(out.square().sum(), x)
    torch.testing.assert_close(g_out, g_ref)
