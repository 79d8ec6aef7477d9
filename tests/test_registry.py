"""Registry-driven checks that every registered mixer gets for free (no per-mixer test code):

* forward is finite and every parameter receives a gradient (DDP with find_unused_parameters=False);
* token-by-token decoding through the cache equals the parallel forward (causal mixers);
* a state_dict round trip reproduces the output.
"""

from __future__ import annotations

import pytest
import torch

from mixlab.backbone import Backbone, BackboneConfig
from mixlab.registry import build_mixer, list_mixers

D, H = 64, 2


def _mixer(name: str, causal: bool = True):
    torch.manual_seed(0)
    return build_mixer(name, d_model=D, n_heads=H, causal=causal, layer_idx=0, n_layers=2).double()


@pytest.mark.parametrize("name", list_mixers())
def test_every_parameter_gets_a_gradient(name):
    cfg = BackboneConfig(d_model=D, n_layers=2, n_heads=H, mixer=name)
    torch.manual_seed(0)
    bb = Backbone(cfg)
    x = torch.randn(2, 13, D)
    y = bb(x)
    assert torch.isfinite(y).all()
    (y * torch.randn_like(y)).sum().backward()
    missing = [n for n, p in bb.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"{name}: parameters without gradient (breaks DDP find_unused_parameters=False): {missing}"


@pytest.mark.parametrize("name", list_mixers())
def test_cached_decoding_equals_parallel_forward(name):
    m = _mixer(name)
    m.eval()
    x = torch.randn(2, 9, D, dtype=torch.float64)
    with torch.no_grad():
        full = m(x)
        cache: dict = {}
        steps = [m(x[:, :3], cache=cache)] + [m(x[:, t : t + 1], cache=cache) for t in range(3, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("name", list_mixers())
def test_state_dict_round_trip(name):
    a, b = _mixer(name), None
    torch.manual_seed(123)
    b = build_mixer(name, d_model=D, n_heads=H, causal=True, layer_idx=0, n_layers=2).double()
    b.load_state_dict(a.state_dict())
    x = torch.randn(1, 7, D, dtype=torch.float64)
    a.eval(), b.eval()
    with torch.no_grad():
        torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)
