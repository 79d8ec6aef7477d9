"""``BackboneConfig.compile``: blocks through torch.compile on CUDA only, same values, same state keys."""

import logging

import torch

import mixlab.backbone as bb
from mixlab.backbone import Backbone, BackboneConfig
from mixlab.coords import Coords


def _model(compile: bool) -> Backbone:
    torch.manual_seed(0)
    return Backbone(BackboneConfig(d_model=32, n_layers=2, n_heads=2, mixer="goat,kda", compile=compile)).double()


def test_compile_option_keeps_cpu_eager_and_the_state_keys(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(bb.torch, "compile", lambda m, **kw: calls.append(m) or m)
    eager, comp = _model(False), _model(True)
    assert list(comp.state_dict()) == list(eager.state_dict())
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    with caplog.at_level(logging.INFO, logger="mixlab.backbone"):
        torch.testing.assert_close(comp(x), eager(x), rtol=0, atol=0)
        comp(x)
        assert calls == []  # a CPU forward never compiles, and says so once (a user test set it and heard nothing)
        said = [r.getMessage() for r in caplog.records if "no effect" in r.getMessage()]
        assert said == ["backbone.compile: true has no effect on cpu: the blocks run eagerly (compiled on CUDA only)"]
        comp._compiled_blocks()  # on CUDA: the blocks whose mixers are not compile_safe are named
    said = [r.getMessage() for r in caplog.records]
    assert "backbone.compile: blocks [1] stay eager (mixers that are not compile_safe: ['kda'])" in said, said


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


def test_stochastic_depth_rates_share_one_compiled_graph():
    """The blocks of a linearly increasing drop-path schedule differ only in the rate, a buffer: compiled one by
    one (as ``_compiled_blocks`` does), 12 training blocks need 2 graphs (rate 0 is an ``Identity``) and none is
    left eager. With timm's float rate each block needed its own graph, and Dynamo's limit of 8 per code object
    left blocks 9-12 eager on the GPU (BENCHMARKS.md, thirty-fifth session)."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Backbone(BackboneConfig(d_model=32, n_layers=12, n_heads=2, mixer="goat", causal=False, drop_path=0.1))
    cnt = CompileCounter()
    x, c = torch.randn(2, 5, 32), Coords.seq(5)
    for blk in model.blocks:
        x = torch.compile(blk, backend=cnt, dynamic=False)(x, c)
    assert cnt.frame_count == 2 and x.isfinite().all()
    torch._dynamo.reset()


def test_drop_path_drops_whole_samples_at_its_rate_and_keeps_the_mean():
    """Training: each sample's branch is 0 or ``x / (1 - p)`` (one draw per sample), dropped at rate ``p``, the
    mean kept; bf16 in, bf16 out; evaluation returns ``x``; the rate is not in the state dict; bad rates raise."""
    import pytest

    torch.manual_seed(0)
    dp = bb.DropPath(0.25)
    x = torch.ones(40000, 3, 2)
    y = dp(x)
    per_sample = y.flatten(1)
    assert (per_sample == per_sample[:, :1]).all()  # whole samples
    assert per_sample[:, 0].unique().tolist() == [0.0, torch.tensor(4 / 3).item()]
    assert abs((per_sample[:, 0] == 0).float().mean().item() - 0.25) < 0.01
    assert abs(y.mean().item() - 1) < 0.02
    assert dp(x.bfloat16()).dtype == torch.bfloat16
    assert dp.eval()(x) is x and list(dp.state_dict()) == [] and "drop_prob=0.25" in repr(dp)
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="DropPath: drop_prob must be in"):
            bb.DropPath(bad)


def test_goat_key_range_of_sequence_coordinates_needs_no_host_sync():
    """The key-range check of GOAT's key-linear lane (bf16 holds it exactly below 32768) reads the
    largest position of ``Coords.seq`` coordinates from their key, so a compiled layer does not sync
    with the host per layer (it did: a graph break at ``int(j_hi.max())`` in every layer under
    ``torch.compile`` on the H200); other coordinates are still read from the tensor."""
    from mixlab.mixers import build_mixer

    pos = build_mixer("goat", d_model=32, n_heads=2, causal=True).pos
    for length, offset in ((1, 0), (40, 0), (300, 129), (5, 32760)):
        c = Coords.seq(length, offset)
        f = pos._features(c, torch.float32)
        assert f["j_hi_max"] == int(f["j_hi"].max())
    shifted = Coords(torch.arange(3, 9).view(1, 6, 1), key=("shifted", 6))  # not Coords.seq: no key bound
    assert "j_hi_max" not in pos._features(shifted, torch.float32)


def test_whole_lm_training_loss_traces_in_one_graph_per_position_scheme():
    """``torch.compile`` of a whole CausalLM training loss (the fused chunked output layer included) has
    no graph break for the attention schemes (GOAT's torch lanes broke once per layer on CPU: Dynamo
    refuses one tensor passed twice to an autograd.Function)."""
    from mixlab.heads.lm import CausalLM

    for mixer in ("goat", "rope", "nope"):
        torch.manual_seed(0)
        lm = CausalLM(vocab_size=300, backbone=BackboneConfig(d_model=32, n_layers=2, n_heads=2, mixer=mixer),
                      loss_chunk_tokens=16)
        x = torch.randint(0, 300, (2, 21))
        torch._dynamo.reset()
        ex = torch._dynamo.explain(lambda a, b: lm.mean_loss(a, b)[0])(x[:, :-1], x[:, 1:])
        assert ex.graph_break_count == 0, (mixer, [str(b.reason)[:200] for b in ex.break_reasons])
        assert ex.graph_count == 1, mixer


def test_lazily_compiled_helpers_are_traced_inline_inside_a_compiled_graph(monkeypatch):
    """A ``cuda_compiled`` helper (RoPE's rotation, the lane builders) called while ``torch.compile`` traces
    a block runs inline in that graph (a nested ``torch.compile`` broke every RoPE block's graph on the H200)."""
    import lightning  # noqa: F401  (Lightning wraps torch.compile: the break came through its wrapper)

    from mixlab.ops.compile import cuda_compiled

    monkeypatch.setenv("MIXLAB_COMPILE", "force")
    helper = cuda_compiled(lambda x: torch.sin(x) * 2)
    block = torch.compile(lambda x: helper(x) + 1, fullgraph=True, backend="eager")
    x = torch.linspace(-3, 3, 7, dtype=torch.float64)
    assert torch.equal(block(x), torch.sin(x) * 2 + 1)


def test_lm_compile_option_whole_model(monkeypatch, caplog):
    """``CausalLM(compile=True)``: whole logits by default, refused with ``backbone.compile``, eager (and said
    once) on CPU, and on CUDA the compiled training loss and evaluation scores equal the eager ones (checked
    here through the aot_eager backend on CPU tensors), gradients included."""
    import pytest

    import mixlab.heads.lm as lm_mod
    from mixlab.heads.lm import CausalLM

    with pytest.raises(ValueError, match="set only one of them"):
        CausalLM(vocab_size=300, backbone=BackboneConfig(d_model=32, n_layers=1, n_heads=2, compile=True),
                 compile=True)
    big = CausalLM(vocab_size=50304, backbone=BackboneConfig(d_model=32, n_layers=1, n_heads=2), compile=True)
    # whole logits only where compiled (CUDA): a CPU run keeps the automatic chunks (and its memory)
    assert big.compiled_chunk_tokens == 0 and big.loss_chunk_tokens == CausalLM(vocab_size=50304).loss_chunk_tokens > 0
    fla = CausalLM(vocab_size=50304, backbone=BackboneConfig(d_model=32, n_layers=1, n_heads=2), compile=True,
                   loss_kernel="fla")
    assert fla.compiled_chunk_tokens == fla.loss_chunk_tokens > 0  # fla's kernels run chunked, compiled or not

    torch.manual_seed(0)
    lm = CausalLM(vocab_size=300, backbone=BackboneConfig(d_model=32, n_layers=2, n_heads=2, mixer="goat"),
                  compile=True).double()
    batch = torch.randint(0, 300, (2, 22))
    with caplog.at_level(logging.INFO, logger="mixlab.heads.lm"):
        assert lm._step_fn("mean_loss", batch.device) == lm.mean_loss
        lm._step_fn("scores", batch.device)
    said = [r.getMessage() for r in caplog.records if "no effect" in r.getMessage()]
    assert said == ["model.init_args.compile: true has no effect on cpu: the model runs eagerly (compiled on CUDA "
                    "only)"]
    orig = torch.compile
    monkeypatch.setattr(lm_mod.torch, "compile", lambda f, **kw: orig(f, backend="aot_eager", **kw))
    cuda = torch.device("cuda")
    loss_fn, score_fn = lm._step_fn("mean_loss", cuda), lm._step_fn("scores", cuda)
    assert lm._step_fn("mean_loss", cuda) is loss_fn and loss_fn != lm.mean_loss  # built once
    inputs, targets = lm._split(batch)
    ref = lm.mean_loss(inputs, targets)
    (g_ref,) = torch.autograd.grad(ref[0], lm.embed.weight)
    out = loss_fn(inputs, targets)
    (g_out,) = torch.autograd.grad(out[0], lm.embed.weight)
    torch.testing.assert_close(out[0], ref[0])
    torch.testing.assert_close(g_out, g_ref)
    for a, b in zip(score_fn(inputs, targets), lm.scores(inputs, targets)):
        torch.testing.assert_close(a, b)


def test_compile_notices_come_before_the_first_step_of_a_fit(caplog):
    """A CPU fit with ``compile: true`` (the model's, or the backbone's) says once that it has no effect, from
    ``on_fit_start``: before the sanity check and the first training step, so the line is not printed inside the
    progress bar (a user test saw it there)."""
    import lightning.pytorch as pl

    from mixlab.heads.lm import CausalLM

    order = []

    class Watch(pl.Callback):
        def on_sanity_check_start(self, trainer, pl_module):
            order.append("sanity")

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            order.append("step")

    class Record(logging.Handler):
        def emit(self, record):
            if "no effect" in record.getMessage():
                order.append(record.getMessage().split(":")[0])

    handler = Record()
    for name in ("mixlab.heads.lm", "mixlab.backbone"):
        logging.getLogger(name).addHandler(handler)
    try:
        with caplog.at_level(logging.INFO):
            for kwargs in ({"compile": True}, {"backbone": BackboneConfig(d_model=32, n_layers=1, n_heads=2,
                                                                           compile=True)}):
                torch.manual_seed(0)
                lm = CausalLM(vocab_size=64, **{"backbone": BackboneConfig(d_model=32, n_layers=1, n_heads=2),
                                                **kwargs})
                data = torch.utils.data.DataLoader(torch.randint(0, 64, (8, 9)), batch_size=4)
                trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                                     enable_progress_bar=False, enable_model_summary=False, callbacks=[Watch()],
                                     num_sanity_val_steps=1, limit_val_batches=1)
                trainer.fit(lm, data, data)
    finally:
        for name in ("mixlab.heads.lm", "mixlab.backbone"):
            logging.getLogger(name).removeHandler(handler)
    assert order == ["model.init_args.compile", "sanity", "step", "step",
                     "backbone.compile", "sanity", "step", "step"], order
