"""Static-cache decoding (:mod:`mixlab.eval.decode`): the fixed-buffer step gives the same greedy ids as the
argmax of the parallel forward and as the dict-cache loop (float64, CPU: the eager form of the step that
CUDA replays as a graph), for attention (goat, rope, nope, alibi) and recurrent (kda, gdn, mesa, hawk, gla,
mamba2) models; every mixer's static step equals its dict-cache step; capacity and bad input are one-line
errors; Mesa's CUDA solve (Triton CG) runs under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from mixlab.backbone import BackboneConfig
from mixlab.eval import decode
from mixlab.eval.generate import generate
from mixlab.heads.lm import CausalLM
from mixlab.registry import build_mixer, list_mixers

VOCAB = 50
STATIC = ["goat", "rope", "nope", "alibi", "kda", "gdn", "mesa", "hawk", "gla", "mamba2"]
MIXER_ARGS = {"goat": {"position_args": {"init": "random"}}}  # a prior that is not zero


def _model(mixer: str, **kw) -> CausalLM:
    """A tiny float64 LM whose greedy continuations are not one repeated id (init_std 0.3)."""
    torch.manual_seed(0)
    cfg = BackboneConfig(d_model=32, n_layers=2, n_heads=2, mixer=mixer, init_std=0.3,
                         mixer_args={mixer: MIXER_ARGS.get(mixer, {})})
    return CausalLM(vocab_size=VOCAB, backbone=cfg, **kw).double().eval()


def _parallel_argmax(model: CausalLM, prompt: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``[B, n]``: the argmax of the full parallel forward (no cache) at the positions that predicted ``new``."""
    with torch.no_grad():
        logits = model(torch.cat([prompt, new], 1))
    return logits[:, prompt.shape[1] - 1:-1].argmax(-1)


@pytest.mark.parametrize("prompt_len", [1, 5, 8])
@pytest.mark.parametrize("mixer", STATIC)
def test_static_greedy_equals_the_parallel_argmax_and_the_dict_loop(mixer, prompt_len):
    model = _model(mixer)
    assert decode.supports_static(model)
    prompt = torch.randint(0, VOCAB, (3, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    new = generate(model, prompt, 19, temperature=0, cuda_graph=False, static=True)  # static or an error
    assert new.shape == (3, 19) and len(set(new.flatten().tolist())) >= 4  # a real continuation
    assert new.tolist() == _parallel_argmax(model, prompt, new).tolist()
    assert new.tolist() == generate(model, prompt, 19, temperature=0, static=False).tolist()


@pytest.mark.parametrize("mixer", ["goat", "mesa"])
def test_static_sampling_draws_the_same_ids_as_the_dict_loop(mixer):
    model = _model(mixer)
    prompt = torch.randint(0, VOCAB, (2, 3), generator=torch.Generator().manual_seed(0))
    runs = [generate(model, prompt, 12, temperature=1.3, top_k=7, generator=torch.Generator().manual_seed(5),
                     vocab_limit=40, static=s) for s in (None, False)]
    assert runs[0].tolist() == runs[1].tolist()
    assert runs[0].max() < 40 and len(set(runs[0].flatten().tolist())) >= 4


def test_static_eos_stops_where_the_dict_loop_stops():
    model = _model("rope")
    prompt = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(1))
    free = generate(model, prompt, 40, temperature=0, static=False)
    common = set(free[0].tolist()) & set(free[1].tolist())
    assert common
    eos = max(common, key=lambda i: (free == i).int().argmax(1).max().item())  # the latest stop of them
    a, b = (generate(model, prompt, 40, temperature=0, eos_id=eos, static=s) for s in (None, False))
    assert a.tolist() == b.tolist() and a.shape[1] < 40 and (a == eos).any(1).all()


@pytest.mark.parametrize("mixer", ["goat", "kda", "mesa"])
def test_decoding_up_to_the_static_capacity_then_an_error(mixer):
    """The last slot is written and attended to; one more step is a one-line error raised on the host."""
    model = _model(mixer, abs_pos_len=16)
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2))
    capacity = 9
    with torch.no_grad():
        caches = [{} for _ in model.backbone.blocks]
        first = model(prompt, None, caches)[:, -1].argmax(-1)
        dec = decode.StaticDecoder(model, decode.static_states(model, caches, capacity), 5, capacity)
        dec.token.copy_(first)
        ids = [first]
        for _ in range(capacity - 5):
            dec.step()
            ids.append(dec.token.clone())
        assert int(dec.pos) == capacity
        with pytest.raises(ValueError, match="past the static capacity of 9 positions"):
            dec.step()
    new = torch.stack(ids, 1)
    assert new.tolist() == _parallel_argmax(model, prompt, new).tolist()


def test_bad_input_is_a_one_line_error():
    model = _model("goat", abs_pos_len=12)
    prompt = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"exceeds the model's learned absolute positions \(abs_pos_len=12\)"):
        generate(model, prompt, 10, temperature=0)
    assert generate(model, prompt, 9, temperature=0).shape == (2, 9)  # 4 + 9 - 1 = 12 positions fed
    with pytest.raises(ValueError, match=r"needs .* GiB of static caches and output ids, more than the .* GiB free"
                                         r" on cpu; lower max_new_tokens") as err:
        generate(_model("nope"), prompt, 10**13, temperature=0)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="GiB of output ids"):  # the dict loop checks its output buffer too
        generate(_model("nope"), prompt, 10**13, temperature=0, static=False)
    with pytest.raises(ValueError, match=r"static=True, but CausalLM \(swa, swa\) has no static decoding step"):
        generate(_model("swa"), prompt, 4, temperature=0, static=True)
    reference = _model("goat")
    for blk in reference.backbone.blocks:
        blk.mixer.impl = "reference"  # the explicit-softmax path keeps no static cache
    with pytest.raises(ValueError, match=r"static=True, but a layer has no static cache for this configuration"):
        generate(reference, prompt, 4, temperature=0, static=True)
    assert generate(reference, prompt, 4, temperature=0).tolist() == generate(_model("goat"), prompt, 4,
                                                                               temperature=0).tolist()


def test_a_model_without_static_steps_falls_back_to_the_dict_loop():
    assert not decode.supports_static(_model("goat").train())  # training mode (dropout): the dict loop
    model = _model("swa")
    assert not decode.supports_static(model)
    prompt = torch.randint(0, VOCAB, (2, 3), generator=torch.Generator().manual_seed(3))
    new = generate(model, prompt, 10, temperature=0, cuda_graph=True)
    assert new.tolist() == _parallel_argmax(model, prompt, new).tolist()


@pytest.mark.parametrize("name", list_mixers())
def test_every_static_step_equals_the_dict_cache_step(name):
    """Registry-driven: each mixer with a static step (``static_cache`` not None) gives its dict-cache step's
    outputs (float64), with the buffers updated in place; the others say None."""
    torch.manual_seed(0)
    m = build_mixer(name, d_model=32, n_heads=2, causal=True, layer_idx=0, n_layers=2,
                    **MIXER_ARGS.get(name, {})).double().eval()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    with torch.no_grad():
        cache: dict = {}
        m(x[:, :3], cache=cache)
        state = m.static_cache(cache, 9)
        if state is None:
            pytest.skip(f"{name}: no static step (dict-cache loop)")
        ref = [m(x[:, t:t + 1], cache=cache)[:, 0] for t in range(3, 9)]
        ptrs = {k: v.data_ptr() for k, v in state.items()}
        got = [m.static_step(x[:, t], state, torch.tensor([t])) for t in range(3, 9)]
    torch.testing.assert_close(torch.stack(got, 1), torch.stack(ref, 1), rtol=1e-10, atol=1e-10)
    assert ptrs == {k: v.data_ptr() for k, v in state.items()}  # in place: no buffer rebound


def test_cli_has_a_no_cuda_graph_switch(capsys):
    from mixlab.eval.generate import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "--no-cuda-graph" in out and "--compile" in out


_TRITON_CHECK = """
import json, torch
from mixlab.ops.mesa import mesa_step_inplace
from tests.test_decode import _model, generate
g = torch.Generator().manual_seed(0)
b, h, k = 2, 3, 32
q, kk, v = (torch.nn.functional.normalize(torch.randn(b, h, k, generator=g), dim=-1) for _ in range(3))
gate, beta = -torch.rand(b, h, generator=g) * 0.1, torch.rand(b, h, generator=g)
lamb = torch.rand(h, k, generator=g) + 0.25
base = torch.randn(b, h, k, k, generator=g)
h_kk = base @ base.transpose(-1, -2) / k
h_kv = torch.randn(b, h, k, k, generator=g)
res = {}
outs = {}
for impl in ("torch", "triton"):
    state = (h_kk.clone(), h_kv.clone())
    outs[impl] = (mesa_step_inplace(q, kk, v, gate, beta, lamb, state, 30, 1e-4, cg_impl=impl), state)
res["o"] = ((outs["triton"][0] - outs["torch"][0]).abs().max() / outs["torch"][0].abs().max()).item()
res["state"] = max((a - b).abs().max().item() for a, b in zip(outs["triton"][1], outs["torch"][1]))
model = _model("mesa").float()
prompt = torch.randint(0, 50, (2, 5), generator=g)
res["ids_equal"] = generate(model, prompt, 10, temperature=0).tolist() == generate(
    model, prompt, 10, temperature=0, static=False).tolist()
print(json.dumps(res))
"""


def test_mesa_static_step_with_the_triton_cg_under_the_interpreter():
    """The CUDA choice of the Mesa decode step (one Triton CG launch for all systems) equals the torch CG,
    run on CPU by Triton's interpreter; a whole static decode with it gives the dict loop's ids."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "MIXLAB_MESA_DECODE_CG": "triton", "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", _TRITON_CHECK], env=env, capture_output=True, text=True,
                         timeout=600, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["o"] < 1e-4 and res["state"] == 0.0 and res["ids_equal"], res


@pytest.mark.parametrize("mixer", [*STATIC, "fg2gdn"])
def test_the_decode_step_never_reads_a_device_value_on_the_host(mixer):
    """The CPU stand-in for "capturable in a CUDA graph": the whole step (embedding -> blocks -> lm_head ->
    argmax) runs on meta tensors, where any host read of a value (``.item()``, ``bool()``, ``int()``:
    a sync on CUDA) raises. The dict-cache Mesa step (CG with early stopping) is the positive control."""
    model = _model(mixer)
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        caches = [{} for _ in model.backbone.blocks]
        model(prompt, None, caches)
        states = [{k: v.to("meta") for k, v in s.items()} for s in decode.static_states(model, caches, 9)]
        model = model.to("meta")
        dec = decode.StaticDecoder(model, states, 5, 9)
        logits = dec.step()
        assert logits.device.type == "meta" and logits.shape == (2, VOCAB)
        if mixer == "mesa":
            with pytest.raises(RuntimeError, match="meta tensors"):
                model(torch.zeros(2, 1, dtype=torch.long, device="meta"), None, [{} for _ in model.backbone.blocks])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mixer", [*STATIC, "fg2gdn"])
def test_cuda_graph_decoding_is_captured_and_equals_the_eager_step(mixer, capsys):
    """On a GPU: the step is captured (no fallback note), and graph, eager static and dict loop give the same
    greedy ids in float32 (attention up to the order of its masked sums: near-ties may differ, so the graph
    is compared with the eager static step, which runs the same kernels)."""
    model = _model(mixer).float().cuda()
    prompt = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(6)).cuda()
    graph = generate(model, prompt, 24, temperature=0, cuda_graph=True)
    assert "capture failed" not in capsys.readouterr().err
    eager = generate(model, prompt, 24, temperature=0, cuda_graph=False)
    assert graph.tolist() == eager.tolist()
    assert (graph == generate(model, prompt, 24, temperature=0, static=False)).float().mean() > 0.9
    with torch.no_grad():
        caches = [{} for _ in model.backbone.blocks]
        model(prompt, None, caches)
        dec = decode.StaticDecoder(model, decode.static_states(model, caches, 20), 7, 20, cuda_graph=True)
        for _ in range(5):
            dec.step()
        assert dec.graphed and int(dec.pos) == 12


@pytest.mark.parametrize("mixer", ["rope", "kda"])
def test_compiled_static_step_gives_the_eager_static_ids(mixer):
    """``compile_step=True`` (the step through torch.compile / Inductor; on CUDA then captured as a graph)
    decodes the same greedy ids as the eager static step and the parallel forward's argmax (CPU, float64)."""
    from torch._dynamo.utils import counters

    model = _model(mixer)
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    eager = generate(model, prompt, 9, temperature=0, static=True)
    graphs = counters["stats"]["unique_graphs"]
    compiled = generate(model, prompt, 9, temperature=0, static=True, compile_step=True)
    assert counters["stats"]["unique_graphs"] > graphs  # Dynamo traced the step
    assert compiled.tolist() == eager.tolist() == _parallel_argmax(model, prompt, eager).tolist()
    assert len(set(eager.flatten().tolist())) >= 3
