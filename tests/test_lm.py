"""CausalLM head, backbone, optimiser groups, CLI: training reduces loss, resume continues, configs parse."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from mixlab.backbone import Backbone, BackboneConfig, parse_pattern
from mixlab.cli import main
from mixlab.datamodules.genome import GenomeDataModule
from mixlab.heads.lm import CausalLM
from mixlab.optim import OptimConfig, build_optimizer, param_groups, warmup_cosine

ROOT = Path(__file__).resolve().parents[1]


def _fasta(tmp_path: Path) -> str:
    """A learnable genome: a repeated 37-base motif with a few random substitutions."""
    g = torch.Generator().manual_seed(0)
    motif = "".join("ACGT"[int(i)] for i in torch.randint(0, 4, (37,), generator=g))
    seq = list(motif * 400)
    for i in torch.randint(0, len(seq), (200,), generator=g).tolist():
        seq[i] = "ACGT"[i % 4]
    p = tmp_path / "toy.fa"
    p.write_text(">toy\n" + "\n".join("".join(seq[i : i + 60]) for i in range(0, len(seq), 60)) + "\n")
    return str(p)


def _tiny_model(mixer: str = "goat", **kw) -> CausalLM:
    cfg = BackboneConfig(d_model=32, n_layers=2, n_heads=2, mixer=mixer,
                         mixer_args={"goat": {"position_args": {"n_modes": 2}}})
    return CausalLM(vocab_size=5, backbone=cfg, optim=OptimConfig(lr=3e-3, warmup_steps=2), **kw)


def _trainer(tmp_path: Path, **kw) -> pl.Trainer:
    args = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                num_sanity_val_steps=0, limit_val_batches=2, default_root_dir=str(tmp_path))
    args.update(kw)
    return pl.Trainer(**args)


def _eval_loss(model: CausalLM, batch: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        logits = model(batch[:, :-1])
        return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()))


@pytest.mark.parametrize("mixer", ["goat", "rope"])
def test_fit_steps_reduce_loss(tmp_path, mixer):
    pl.seed_everything(0)
    dm = GenomeDataModule(fasta=_fasta(tmp_path), context_length=64, batch_size=8, region_size=2048)
    dm.setup("fit")
    batch = torch.stack([dm.val_dataset[i] for i in range(4)])
    model = _tiny_model(mixer)
    before = _eval_loss(model, batch)
    assert abs(before - math.log(5)) < 0.2  # near-uniform at init
    _trainer(tmp_path, max_steps=40, enable_checkpointing=False, limit_val_batches=0).fit(model, dm)
    after = _eval_loss(model, batch)
    assert after < before - 0.3, (before, after)


def test_metrics_are_exact_sums(tmp_path):
    """val/loss equals the NLL summed over every token of every batch / token count (not a mean of means)."""
    pl.seed_everything(0)
    dm = GenomeDataModule(fasta=_fasta(tmp_path), context_length=48, batch_size=8, eval_batch_size=3, region_size=1024)
    model = _tiny_model()
    trainer = _trainer(tmp_path, limit_val_batches=None)
    out = trainer.validate(model, dm, verbose=False)[0]
    nll, n, hits = 0.0, 0, 0
    model.eval()
    with torch.no_grad():
        for b in dm.val_dataloader():  # last batch is smaller: a mean of means would differ
            logits = model(b[:, :-1])
            nll += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), b[:, 1:].flatten(), reduction="sum"))
            hits += int((logits.argmax(-1) == b[:, 1:]).sum())
            n += b[:, 1:].numel()
    assert out["val/loss"] == pytest.approx(nll / n, rel=1e-5)
    assert out["val/bits_per_base"] == pytest.approx(nll / n / math.log(2), rel=1e-5)
    assert out["val/ppl"] == pytest.approx(math.exp(nll / n), rel=1e-5)
    assert out["val/acc"] == pytest.approx(hits / n, rel=1e-6)


def test_save_and_resume_continues_from_same_step(tmp_path):
    pl.seed_everything(0)
    dm = GenomeDataModule(fasta=_fasta(tmp_path), context_length=32, batch_size=4, region_size=1024)
    model = _tiny_model()
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True)
    t1 = _trainer(tmp_path, max_steps=6, callbacks=[ckpt], limit_val_batches=0)
    t1.fit(model, dm)
    last = tmp_path / "ck" / "last.ckpt"
    state = torch.load(last, weights_only=False)
    assert state["global_step"] == 6
    resumed = _tiny_model()
    t2 = _trainer(tmp_path, max_steps=9, limit_val_batches=0, enable_checkpointing=False)
    t2.fit(resumed, dm, ckpt_path=str(last))
    assert t2.global_step == 9
    # the LR schedule resumed at step 6, not from warmup again
    lr = t2.optimizers[0].param_groups[0]["lr"]
    want = 3e-3 * warmup_cosine(9, 2, int(t2.estimated_stepping_batches), 0.1)
    assert lr == pytest.approx(want, rel=1e-6)


def test_param_groups_exclude_norms_biases_embeddings_and_priors():
    model = _tiny_model()
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decay_names = {names[id(p)] for p in decay["params"]}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert "embed.weight" in no_decay_names  # tied with lm_head
    assert any(n.endswith("pos.prior") for n in no_decay_names)  # alpha, beta, slope, MLP: one flat vector
    assert any("norm1.weight" in n for n in no_decay_names)
    assert all(("pos." not in n) and ("norm" not in n) for n in decay_names)
    assert any(n.endswith("qkv.weight") for n in decay_names) and any("mlp.fc2.weight" in n for n in decay_names)
    assert len(decay_names) + len(no_decay_names) == len(list(model.parameters()))


def test_fused_adamw_takes_the_same_steps_as_torchs_default():
    """optim.fused true: torch's fused AdamW (one kernel per group; CPU here) takes the same three steps as the
    default path to float rounding; a value that is not a bool is a one-line error naming the field."""
    steps = {}
    for fused in (None, True):
        torch.manual_seed(0)
        model = _tiny_model()
        cfg = OptimConfig(lr=1e-2, weight_decay=0.1, warmup_steps=1, fused=fused)
        opt = build_optimizer(model, cfg, total_steps=10)["optimizer"]
        assert opt.defaults["fused"] is fused
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        steps[fused] = [p.detach().clone() for p in model.parameters()]
    moved = max((a - b).abs().max().item() for a, b in zip(steps[None], steps[True], strict=True))
    assert moved < 1e-6
    with pytest.raises(ValueError, match=r"optim.fused must be true, false or null; got 'yes'"):
        OptimConfig(fused="yes")


def test_lr_scales_give_marked_parameters_their_own_learning_rate():
    """optim.lr_scales {"position_prior": 30}: GOAT's prior trains at 30x the lr under the same
    schedule (one Adam step moves it ~30x as far); everything else is grouped as before."""
    model = _tiny_model()
    groups = param_groups(model, 0.1, lr=1e-3, lr_scales={"position_prior": 30.0})
    names = {id(p): n for n, p in model.named_parameters()}
    scaled = [g for g in groups if "lr" in g]
    assert len(scaled) == 1 and scaled[0]["lr"] == pytest.approx(3e-2) and scaled[0]["weight_decay"] == 0.0
    assert {names[id(p)].rsplit(".", 1)[-1] for p in scaled[0]["params"]} == {"prior"}
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    prior = scaled[0]["params"][0]
    opt = torch.optim.AdamW(groups, lr=1e-3)
    before = prior.detach().clone()
    prior.grad = torch.ones_like(prior)
    opt.step()
    assert torch.allclose(before - prior.detach(), torch.full_like(prior, 3e-2), rtol=1e-3)  # Adam's first step = lr
    with pytest.raises(ValueError, match=r"lr_scales\['position_prior'\] must be > 0"):
        param_groups(model, 0.1, lr=1e-3, lr_scales={"position_prior": 0.0})


def test_pattern_parsing_and_residual_init():
    assert parse_pattern("alibi*3, goat", 8) == ["alibi", "alibi", "alibi", "goat"] * 2
    assert parse_pattern(["rope", "goat"], 4) == ["rope", "goat", "rope", "goat"]
    with pytest.raises(ValueError, match="n_layers=3 is not a multiple"):
        parse_pattern("rope,goat", 3)
    with pytest.raises(ValueError, match="unknown mixer 'nop'"):
        parse_pattern("rope,nop", 2)
    torch.manual_seed(0)
    bb = Backbone(BackboneConfig(d_model=256, n_layers=8, n_heads=4, mixer="rope"))
    std_proj = bb.blocks[0].mixer.proj.weight.std().item()
    std_qk = bb.blocks[0].mixer.qkv.weight.std().item()
    assert std_qk == pytest.approx(0.02, rel=0.05)
    assert std_proj == pytest.approx(0.02 / math.sqrt(16), rel=0.05)


def test_backbone_owns_the_pattern_grammar_and_answers_position_questions():
    from mixlab.backbone import mixer_names, pattern_name

    assert mixer_names("kda*3, mla") == ["kda", "kda", "kda", "mla"] and pattern_name("kda*3, mla") == "kdax3-mla"
    with pytest.raises(ValueError, match="expected 'name\\*count'"):
        mixer_names("kda*x")
    cfg = BackboneConfig(d_model=64, n_layers=5, n_heads=2, causal=False, mixer="goat,rope,nope,mla,swa",
                         mixer_args={"goat": {"position_args": {"n_modes": 2, "default_bias": False}}})
    assert Backbone(cfg).position_axes() == {1}  # goat, rope, swa (RoPE), mla (decoupled RoPE); nope reads none
    two = cfg.with_position_axes(2, defaults={"default_bias": True})
    assert two.mixer_args["goat"]["position_args"] == {"n_modes": 2, "default_bias": False, "axes": 2}  # set keys kept
    assert two.mixer_args["rope"]["position_args"] == {"axes": 2}  # GOAT's default_bias is not a RoPE key
    assert "nope" not in two.mixer_args and two.mixer_args["mla"] == {"rope_axes": 2}  # MLA's decoupled RoPE
    assert cfg.mixer_args == {"goat": {"position_args": {"n_modes": 2, "default_bias": False}}}  # a copy
    assert {b.mixer_name: b.mixer.position_axes for b in Backbone(two).blocks} == \
        {"goat": 2, "rope": 2, "nope": None, "mla": 2, "swa": 2}
    forced = cfg.with_position_axes(3, force={"default_bias": True})
    assert forced.mixer_args["goat"]["position_args"] == {"n_modes": 2, "default_bias": True, "axes": 3}


def test_vocab_mismatch_is_a_clear_error(tmp_path):
    dm = GenomeDataModule(fasta=_fasta(tmp_path), context_length=32, batch_size=4, region_size=1024)
    model = CausalLM(vocab_size=4, backbone=BackboneConfig(d_model=16, n_layers=1, n_heads=2, mixer="nope"))
    with pytest.raises(ValueError, match="model.init_args.vocab_size=4 .* vocab_size=5"):
        _trainer(tmp_path, max_steps=1).fit(model, dm)


def test_cli_fit_then_test_writes_tensorboard_run(tmp_path, capsys):
    fasta = _fasta(tmp_path)
    common = ["--config", str(ROOT / "configs/genome/goat.yaml"), f"--data.init_args.fasta={fasta}",
              "--data.init_args.context_length=32", "--data.init_args.region_size=1024",
              "--model.init_args.backbone.d_model=32", "--model.init_args.backbone.n_layers=1",
              f"--run_root={tmp_path / 'runs'}", "--trainer.enable_progress_bar=false"]
    main(["fit", *common, "--trainer.max_steps=3", "--trainer.val_check_interval=3", "--trainer.limit_val_batches=2"])
    run = tmp_path / "runs" / "genome" / "goat" / "version_0"
    assert list(run.glob("events.out.tfevents.*")), list(run.rglob("*"))
    last = run / "checkpoints" / "last.ckpt"
    assert last.exists() and (run / "config.yaml").exists()
    main(["test", *common, "--ckpt_path=last", "--trainer.limit_test_batches=2"])
    out = capsys.readouterr().out
    assert "test/bits_per_base" in out
    assert not (tmp_path / "runs" / "genome" / "goat" / "version_1").exists()  # tested into the same run
    assert len(list(run.glob("events.out.tfevents.*"))) == 2


@pytest.mark.parametrize("cfg", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").rglob("*.yaml")
                                       if p.parent.name not in ("trainer", "data")))  # overlays
def test_every_shipped_config_parses(cfg):
    with pytest.raises(SystemExit) as e:
        main(["fit", "--config", str(ROOT / cfg), "--print_config"])
    assert e.value.code in (0, None)


def test_abs_pos_decoding_equals_parallel_forward_with_a_recurrent_first_layer():
    """Learned absolute positions in cached decoding come from the head's own counter, not from
    layer 0's KV length (layer 0 here is recurrent and has none)."""
    torch.manual_seed(0)
    model = CausalLM(vocab_size=5, abs_pos_len=16,
                     backbone=BackboneConfig(d_model=16, n_layers=2, n_heads=2, mixer="hawk,nope")).double().eval()
    tokens = torch.randint(0, 5, (2, 9))
    with torch.no_grad():
        full = model(tokens)
        caches = [{} for _ in model.backbone.blocks]
        steps = torch.cat([model(tokens[:, :4], None, caches)] + [model(tokens[:, i:i + 1], None, caches)
                                                                  for i in range(4, 9)], dim=1)
    torch.testing.assert_close(steps, full, rtol=1e-9, atol=1e-9)


def test_last_ckpt_holds_the_newest_state_not_the_best(tmp_path, monkeypatch):
    """``--ckpt_path last`` must resume where a run stopped: Lightning 2.6's ``save_last`` only
    rewrites last.ckpt when the monitored (best) checkpoint improves, so the CLI adds its own
    (every validation and the end of training)."""
    import sys

    monkeypatch.setattr(sys, "argv", ["mixlab"])
    config = Path(__file__).resolve().parents[1] / "configs" / "genome" / "goat.yaml"
    main(["fit", "--config", str(config), "--data.init_args.train_stride", "4096", "--trainer.max_steps", "7",
              "--trainer.val_check_interval", "null", "--trainer.check_val_every_n_epoch", "1",
              "--trainer.limit_val_batches", "1", "--model.init_args.optim.lr", "0.05",
              "--model.init_args.optim.warmup_steps", "1", "--model.init_args.optim.weight_decay", "0.0",
              "--model.init_args.backbone.d_model", "32", "--model.init_args.backbone.n_layers", "2",
              "--data.init_args.context_length", "64",  # a small model: the checkpoints' steps are the point
              "--trainer.enable_progress_bar", "false", "--run_root", str(tmp_path)])
    ckpts = sorted((tmp_path / "genome" / "goat" / "version_0" / "checkpoints").glob("*.ckpt"))
    steps = {p.name: torch.load(p, map_location="cpu", weights_only=False)["global_step"] for p in ckpts}
    assert steps["last.ckpt"] == 7  # the end of training (step 7 is mid-epoch, after the last validation)
    best = [s for n, s in steps.items() if n != "last.ckpt"]
    assert len(best) == 1 and best[0] in (3, 6)  # validations at steps 3 and 6 only


def test_packed_swiglu_loads_the_separate_projections_of_older_checkpoints():
    """The backbone's SwiGLU is timm's ``SwiGLUPacked`` (gate and value projections as the two halves of one
    ``fc1``: one matmul); a state dict with timm ``SwiGLU``'s separate ``fc1_g`` / ``fc1_x`` (checkpoints
    written before) loads strictly into it and gives the same output, and the packed layer equals timm's
    ``SwiGLU`` with those weights."""
    from timm.layers import SwiGLU

    from mixlab.backbone import Backbone, BackboneConfig

    torch.manual_seed(0)
    cfg = BackboneConfig(d_model=32, n_layers=2, n_heads=2, mixer="rope", bias=True)
    new = Backbone(cfg).double().eval()
    old = {}
    for k, v in new.state_dict().items():
        if ".mlp.fc1." in k:
            h = v.shape[0] // 2
            old[k.replace(".fc1.", ".fc1_g.")], old[k.replace(".fc1.", ".fc1_x.")] = v[:h] + 0.1, v[h:] - 0.1
        else:
            old[k] = v
    loaded = Backbone(cfg).double().eval()
    loaded.load_state_dict(old, strict=True)
    ref = SwiGLU(32, loaded.blocks[0].mlp.fc2.in_features, bias=True).double()
    ref.load_state_dict({k.split("mlp.", 1)[1]: v for k, v in old.items() if k.startswith("blocks.0.mlp.")})
    x = torch.randn(3, 5, 32, dtype=torch.float64)
    torch.testing.assert_close(loaded.blocks[0].mlp(x), ref(x), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(loaded(x), new(x))  # the shifted weights did arrive
