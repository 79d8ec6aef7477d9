"""Synthetic suites: generators against hand-checked examples, metrics against hand values, a CPU run."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from mixlab.backbone import BackboneConfig
from mixlab.datamodules import copy_mixture as CM
from mixlab.datamodules import mad as M
from mixlab.datamodules import regbench as R
from mixlab.datamodules import retrieval as RT
from mixlab.datamodules.parity import ParityDataModule, parity_example
from mixlab.heads.synthetic import SyntheticLM
from mixlab.optim import OptimConfig

ROOT = Path(__file__).resolve().parents[1]
IGN = -100


# ---------------------------------------------------------------------- MAD
def test_in_context_recall_hand_example():
    # seed 0, vocab 16, 6 slots: (1,12) (6,9) (5,8) (7,15) (4,13) (4,13); keys 0-7, values 8-15
    d = M.in_context_recall(np.random.default_rng(0), 16, 12)
    assert d["inputs"].tolist() == [1, 12, 6, 9, 5, 8, 7, 15, 4, 13, 4]
    assert d["targets"].tolist() == [12, 6, 9, 5, 8, 7, 15, 4, 13, 4, 13]
    # only the value of the repeated key 4 (last slot, input position 10) is scored
    assert d["eval_targets"].tolist() == [IGN] * 10 + [13]


@pytest.mark.parametrize("seed", range(5))
def test_recall_answer_positions_match_an_independent_scan(seed):
    rng = np.random.default_rng(seed)
    d = M.in_context_recall(rng, 32, 64, noise_vocab_size=16, frac_noise=0.3)
    seq = np.concatenate([d["inputs"], d["targets"][-1:]])
    seen, expected = {}, []
    for s in range(len(seq) // 2):
        k, v = seq[2 * s], seq[2 * s + 1]
        if k >= 16:  # a noise slot: two noise tokens, never scored
            assert v >= 16
            continue
        assert 0 <= k < 8 and 8 <= v < 16
        assert seen.setdefault(k, v) == v  # one value per key within the sequence
        if any(seq[2 * j] == k for j in range(s)):  # key seen in an earlier (clean) slot
            expected.append(2 * s)  # input position of the key: its target is the value
    assert seq[-2] < 8 and seq[-1] < 16  # last slot is clean and repeats a key
    assert np.flatnonzero(d["eval_targets"] != IGN).tolist() == expected
    noise_targets = d["targets"][(d["targets"] != IGN)]
    assert (noise_targets < 16).all()  # noise is never a target


def test_fuzzy_recall_hand_example():
    d = M.fuzzy_recall(np.random.default_rng(1), 16, 32)
    # hand-read: key tuples (1,4,2)->(8,11,9), (0,3)->(10,7), (1,)->(8,10,10), then (1,4,2) twice; pad 15
    assert d["inputs"].tolist() == [1, 4, 2, 8, 11, 9, 0, 3, 10, 7, 1, 8, 10, 10, 1, 4, 2, 8, 11, 9,
                                    1, 4, 2, 8, 11, 9] + [15] * 6
    # the values of the two repeats (tokens 17-19 and 23-25) are scored from the position before
    assert np.flatnonzero(d["eval_targets"] != IGN).tolist() == [16, 17, 18, 22, 23, 24]
    assert d["eval_targets"][[16, 17, 18]].tolist() == [8, 11, 9]
    assert (d["targets"][25:] == IGN).all() and (d["targets"][:25] != IGN).all()
    ev = d["eval_targets"]
    scored = np.flatnonzero(ev != IGN)
    assert (ev[scored] >= 7).all() and (ev[scored] <= 14).all()  # only value tokens are scored
    assert (d["targets"][d["inputs"] == 15] == IGN).all()  # no target after padding starts


def test_fuzzy_recall_repeated_pairs_are_scored():
    for seed in range(5):
        d = M.fuzzy_recall(np.random.default_rng(seed), 16, 64, test=True)
        seq = np.concatenate([[d["inputs"][0]], d["targets"].clip(-1)])
        # test keys are exactly 3 key tokens (0-6); pairs = 3 key tokens + 1..3 values
        assert (seq[:3] < 7).all()
        assert (d["eval_targets"] != IGN).sum() > 0


def test_selective_copy_hand_example():
    d = M.selective_copy(np.random.default_rng(0), 16, 12, 3)
    # content at sorted random prefix positions, marker 15 at 8, then blanks 14
    assert d["inputs"].tolist() == [11, 8, 7, 14, 14, 14, 14, 14, 15, 14, 14, 14]
    assert d["targets"].tolist() == [IGN] * 9 + [11, 8, 7]
    assert np.array_equal(d["eval_targets"], d["targets"])


def test_compression_and_memorization():
    d = M.compression(np.random.default_rng(0), 8, 6)
    assert d["inputs"][-1] == 7 and d["targets"].tolist() == d["inputs"][:-1].tolist() + [IGN]
    kv = M.memorization_map(16, 0)
    assert len(kv) == 7 and kv.min() >= 7 and kv.max() <= 14
    d = M.memorization(np.random.default_rng(0), kv, 16, 8)
    assert d["inputs"][1::2].tolist() == [15] * 4  # insert token
    assert d["targets"][1::2].tolist() == kv[d["inputs"][0::2]].tolist()
    assert (d["targets"][0::2] == IGN).all() and not np.isin(d["inputs"], kv).any()


def test_mad_grid_and_score():
    g = M.mad_grid("selective_copy")
    assert g["default"] == {} and g["num_tokens_to_copy=96"] == {"num_tokens_to_copy": 96}
    assert "seq_len=256" not in g and "seq_len=512" in g and "vocab=32" in g and "n_train=800" in g
    assert "frac_noise=0.8" in M.mad_grid("noisy_recall") and "frac_noise=0.8" not in M.mad_grid("fuzzy_recall")
    score, per_task = M.mad_score({"a": {"default": 1.0, "x": 0.5}, "b": {"default": 0.0}})
    assert per_task == {"a": 0.75, "b": 0.0} and score == 0.375
    with pytest.raises(ValueError, match="unknown MAD task"):
        M.MADDataModule(task="nope")


# ---------------------------------------------------------------------- RegBench
def test_dfa_minimisation_hand_examples():
    t = np.full((3, 18), -1)
    t[0, 0], t[0, 1], t[1, 2], t[2, 2] = 1, 2, 0, 0  # states 1 and 2 accept the same futures
    m = R.minimize(t)
    assert m.shape[0] == 2 and m[0, 0] == 1 and m[0, 1] == 1 and m[1, 2] == 0
    c = np.full((4, 18), -1)
    c[0, 0], c[1, 1], c[2, 2], c[3, 3] = 1, 2, 3, 0  # a 4-cycle is already minimal
    assert R.minimize(c).shape[0] == 4
    u = np.full((3, 18), -1)
    u[0, 0], u[1, 0], u[2, 1] = 1, 0, 0  # state 2 unreachable: trimmed; 0,1 then equivalent
    assert R.minimize(u).shape[0] == 1


def test_random_dfas_and_strings_are_valid():
    rng = np.random.default_rng(0)
    for _ in range(20):
        t = R.random_dfa(rng)
        assert np.array_equal(R.minimize(t), t)  # minimal and canonical
        assert ((t >= 0).sum(1) >= 1).all() and t.max() < t.shape[0]
        strings = R.sample_strings(rng, t, 3, 5, 1, 10)
        assert 3 <= len(strings) <= 5 and all(R.accepts_walk(t, s) for s in strings)
        ex = R.regbench_example(t, strings, 40)
        # valid_next recomputed by hand from the table
        s = 0
        for i, tok in enumerate(ex["inputs"]):
            if tok == R.PAD:
                assert not ex["valid_next"][i].any()
                break
            s = 0 if tok == R.DELIM else t[s, tok]
            assert ex["valid_next"][i].tolist() == (t[s] >= 0).tolist() + [False, False]
        tgt = ex["targets"]
        assert not np.isin(tgt, [R.DELIM, R.PAD]).any()
        assert all(tgt[i] == IGN or ex["valid_next"][i, tgt[i]] for i in range(len(tgt)))
    assert not R.accepts_walk(t, [int(np.flatnonzero(t[0] < 0)[0])] if (t[0] < 0).any() else [99])


def test_regbench_metrics_hand_values():
    valid = torch.zeros(1, 3, 20, dtype=torch.bool)
    valid[0, 0, [0, 1]] = True
    valid[0, 1, [2]] = True
    valid[0, 2, [0]] = True
    logits = torch.full((1, 3, 20), -1e9)
    logits[0, 0, 0] = 0.0  # p = 1 on symbol 0: valid; TVD = 0.5 * (|1 - .5| + |0 - .5|) = 0.5
    logits[0, 1, 0] = logits[0, 1, 2] = 0.0  # p = .5/.5 on {0, 2}: argmax 0 invalid; TVD = 0.5
    targets = torch.tensor([[1, 2, IGN]])  # third position unscored
    m = R.regbench_metrics(logits, targets, valid)
    assert m["regbench_acc"][0].item() == 1 and m["regbench_acc"][1].item() == 2
    assert math.isclose(m["tvd"][0].item(), 1.0, abs_tol=1e-9)


# ---------------------------------------------------------------------- parity, copy-mixture, retrieval
def test_parity_labels():
    d = parity_example(np.random.default_rng(3), 3, 6, 6)
    assert d["inputs"].tolist() == [1, 1, 1, 1, 2, 0]  # one 2 -> odd -> label 2 at the last bit
    assert d["targets"].tolist() == [IGN, IGN, IGN, IGN, 2, IGN]
    for seed in range(20):
        d = parity_example(np.random.default_rng(seed), 3, 40, 39)
        n_bits = int((d["inputs"] > 0).sum())
        pos = np.flatnonzero(d["targets"] != IGN)
        assert pos.tolist() == [n_bits - 1]
        assert d["targets"][pos[0]] == 1 + (d["inputs"] == 2).sum() % 2
    dm = ParityDataModule(batch_size=4, n_train=8, n_val=4, n_test=4)
    b = next(iter(dm.test_dataloader()))
    assert b["inputs"].shape == (4, 255) and ((b["targets"] != IGN).sum(1) == 1).all()


def test_parity_accuracy_per_length_quarter():
    """``task_metrics`` counts each answer in the quarter of the test range its string length falls in:
    logits right on strings of length >= 150 only give 0 in the two short quarters, 1 in the longest, and
    the boundary quarter's exact fraction."""
    dm = ParityDataModule(batch_size=64, n_train=8, n_val=4, n_test=64)
    assert dm.length_buckets() == [(40, 93), (94, 147), (148, 202), (203, 256)]
    b = next(iter(dm.test_dataloader()))
    tgt = b["targets"]
    pos = (tgt != IGN).int().argmax(-1)
    n = pos + 2
    logits = torch.zeros(*tgt.shape, 3)
    right = n >= 150
    answer = tgt.gather(1, pos[:, None]).squeeze(1)
    pred = torch.where(right, answer, 3 - answer)  # the wrong bit for short strings
    logits[torch.arange(64), pos, pred] = 1.0
    m = dm.task_metrics(logits, b)
    assert set(m) == {"acc_len_40_93", "acc_len_94_147", "acc_len_148_202", "acc_len_203_256"}
    assert sum(int(c) for _, c in m.values()) == 64
    assert m["acc_len_40_93"][0] == 0 and m["acc_len_94_147"][0] == 0
    assert m["acc_len_203_256"][0] == m["acc_len_203_256"][1]
    sel = (n >= 148) & (n <= 202)
    assert int(m["acc_len_148_202"][0]) == int((sel & right).sum())


def test_copy_mixture_optimal_nll_hand_values():
    d = CM.copy_mixture_example(np.random.default_rng(0), 64, 16, 0.3, 0.3)
    x = np.concatenate([d["inputs"], d["targets"][-1:]])
    for t in range(1, 65):
        p = 0.3 * (x[t] == x[0]) + 0.3 * (x[t] == x[t - 1]) + 0.4 / 16
        assert math.isclose(d["opt_nll"][t - 1], -math.log(p))
    assert math.isclose(-math.log(0.6 + 0.025), 0.4700036292457356)
    # the three cases (both copies agree / one copy / noise only): -log .625, -log .325, -log .025
    assert np.isclose(d["opt_nll"][:, None], [0.4700036, 1.1239300, 3.6888795], atol=1e-6).any(axis=0).all()


def test_retrieval_examples_and_span_metrics():
    rng = np.random.default_rng(0)
    for task in ("passkey", "niah"):
        for hay in ("noise", "filler", "essay"):
            ex = RT.make_example(rng, task, 100, 0.5, hay, RT.load_essay() if hay == "essay" else None)
            text = RT.decode(np.concatenate([ex["inputs"], ex["targets"][-1:]]))
            answer = RT.decode(ex["eval_targets"][ex["span"]])
            assert len(ex["inputs"]) == 100 and text.endswith("? " + answer)
            assert f"{'passkey' if task == 'passkey' else 'needle'}: {answer}." in text
            assert len(answer) == (8 if task == "passkey" else 12)
            assert (ex["targets"] != IGN).all() if task == "passkey" else (ex["targets"] == ex["eval_targets"]).all()
    logits = torch.zeros(2, 3, 5)
    logits[0, 1, 2] = logits[0, 2, 3] = 5.0  # sample 0: both span tokens right
    logits[1, 1, 2] = logits[1, 2, 0] = 5.0  # sample 1: second wrong
    tgt = torch.tensor([[IGN, 2, 3], [IGN, 2, 3]])
    span = tgt != IGN
    m = RT.span_metrics(logits, tgt, span)
    assert m["span_acc"][0].item() == 3 and m["span_acc"][1].item() == 4
    assert m["strict_acc"][0].item() == 1 and m["strict_acc"][1].item() == 2
    lp_right, lp_wrong = 5 - math.log(math.exp(5) + 4), -math.log(math.exp(5) + 4)
    assert math.isclose(m["span_logprob"][0].item(), 3 * lp_right + lp_wrong, rel_tol=1e-9)


# ---------------------------------------------------------------------- head + training on CPU
class _FixedDM(pl.LightningDataModule):
    task_name = "fixed"
    vocab_size = 20

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def val_dataloader(self):
        return self.inner.val_dataloader()

    def task_metrics(self, logits, batch):
        return self.inner.task_metrics(logits, batch)


def test_synthetic_lm_metrics_are_exact_sums():
    torch.manual_seed(0)
    dm = R.RegBenchDataModule(n_train_automata=5, n_val_automata=3, n_test_automata=3, min_strings=2,
                              max_strings=3, max_string_len=6, batch_size=3, n_val=7, seed=0)
    model = SyntheticLM(20, BackboneConfig(d_model=32, n_layers=1, n_heads=2, mixer="goat"))
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    out = trainer.validate(model, datamodule=_FixedDM(dm), verbose=False)[0]
    batch = {k: torch.stack([dm.dataset("val")[i][k] for i in range(7)]) for k in ("inputs", "targets", "valid_next")}
    with torch.no_grad():
        logits = model(batch["inputs"])
    tgt, pred = batch["targets"], logits.argmax(-1)
    scored = tgt != IGN
    assert math.isclose(out["val/acc"], ((pred == tgt) & scored).sum().item() / scored.sum().item(), rel_tol=1e-5)
    # torchmetrics macro (the MAD reference): mean per-class recall over the classes that occur as
    # targets or as predictions at scored positions (a predicted-only class counts 0)
    classes = torch.cat([tgt[scored], pred[scored]]).unique()
    macro = np.mean([((pred == c) & (tgt == c)).sum().item() / max((tgt == c).sum().item(), 1)
                     for c in classes.tolist()])
    assert math.isclose(out["val/acc_macro"], macro, rel_tol=1e-5)
    m = R.regbench_metrics(logits, tgt, batch["valid_next"])
    assert math.isclose(out["val/regbench_acc"], (m["regbench_acc"][0] / m["regbench_acc"][1]).item(), rel_tol=1e-5)
    assert math.isclose(out["val/tvd"], (m["tvd"][0] / m["tvd"][1]).item(), rel_tol=1e-5)


CONFIGS = sorted((ROOT / "configs" / "synthetic").glob("*.yaml"))
FIT_CONFIGS = {"parity", "regbench", "mad_compression", "passkey", "copy_mixture"}  # fit + test on CPU


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_configs_build_and_one_step(config, tmp_path):
    from mixlab.cli import MixlabCLI

    argv = ["--config", str(config), "--trainer.max_steps", "1", "--trainer.limit_val_batches", "1",
            "--trainer.limit_test_batches", "1", "--trainer.val_check_interval", "1",
            "--run_root", str(tmp_path / "runs"),
            "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false",
            "--model.init_args.backbone.d_model", "32", "--data.init_args.batch_size", "2",
            "--data.init_args.n_val", "2", "--data.init_args.n_test", "2"]
    old = sys.argv
    sys.argv = old[:1]
    try:
        cli = MixlabCLI(args=argv, run=False)
    finally:
        sys.argv = old
    if config.stem not in FIT_CONFIGS:  # the rest: one loss on one batch (keeps the suite fast)
        cli.datamodule.setup("fit")
        batch = next(iter(cli.datamodule.train_dataloader()))
        nll, valid, _ = cli.model._nll(batch)
        assert valid.any() and torch.isfinite(nll[valid]).all()
        return
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    res = cli.trainer.test(cli.model, datamodule=cli.datamodule, verbose=False)[0]
    task = cli.datamodule.task_name
    expected = {"regbench": "test/regbench_acc", "copy_mixture": "test/excess_nll", "passkey": "test/span_acc",
                "niah": "test/span_acc"}.get(task, "test/acc_macro")
    assert expected in res and math.isfinite(res[expected]) and math.isfinite(res["test/loss"])


# ---------------------------------------------------------------------- passkey / NIAH eval, copy-mixture prior plot
def test_prior_panels_split_into_terms():
    from mixlab.eval.figures import goat_prior_panels
    from mixlab.mixers.positions import GoatPrior

    torch.manual_seed(0)
    prior = GoatPrior(n_heads=2, head_dim=16, n_modes=2, init="random")
    with torch.no_grad():
        prior.slope.fill_(0.1)
        prior.bos.fill_(2.0)
    p = goat_prior_panels(prior, head=1, length=9)
    low = np.tril(np.ones((9, 9), dtype=bool))
    np.testing.assert_allclose(p["total"], p["key_only"] + p["relative"], atol=1e-12)
    assert (p["causal_prior"][~low] == 0).all()
    np.testing.assert_allclose(p["causal_prior"].sum(-1), 1.0, atol=1e-12)
    np.testing.assert_allclose(p["key_only"][5], p["key_only"][0])  # key-only: the same for every query row
    assert np.allclose(p["relative"][3, :4], p["relative"][7, 4:8])  # relative: a function of i - j
    row = p["total"][4, :5]
    np.testing.assert_allclose(p["causal_prior"][4, :5], np.exp(row - row.max()) / np.exp(row - row.max()).sum())


def test_retrieval_eval_chunked_and_cli(tmp_path):
    from mixlab.eval import retrieval as E
    from mixlab.eval.figures import copy_prior

    torch.manual_seed(0)
    model = SyntheticLM(75, BackboneConfig(d_model=32, n_layers=1, n_heads=2, mixer="goat",
                                           mixer_args={"goat": {"position_args": {"n_modes": 2}}}),
                        OptimConfig(lr=1e-2, warmup_steps=1), span_weight=10.0)
    dm = RT.RetrievalDataModule("passkey", context_length=64, batch_size=4, n_train=8, n_val=4, n_test=4)
    trainer = pl.Trainer(max_steps=2, limit_val_batches=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(model, datamodule=dm)
    model.eval()
    plain = E.evaluate_cell(model, "passkey", 70, 0.3, samples=3, batch_size=2, chunk=None)
    chunked = E.evaluate_cell(model, "passkey", 70, 0.3, samples=3, batch_size=2, chunk=16)
    for k in plain:
        assert math.isclose(plain[k], chunked[k], rel_tol=1e-5, abs_tol=1e-6)
    ckpt = tmp_path / "pk.ckpt"
    trainer.save_checkpoint(ckpt)
    res = E.passkey_main(["--ckpt", str(ckpt), "--lengths", "64", "96", "--depths", "0.2", "0.8",
                          "--samples", "2", "--out", str(tmp_path / "ev")])
    assert sorted(res) == [(64, 0.2), (64, 0.8), (96, 0.2), (96, 0.8)]
    assert all(0 <= m["span_acc"] <= 1 and m["span_logprob"] <= 0 for m in res.values())
    for f in ("passkey_noise.md", "passkey_noise.csv", "passkey_noise_heatmap.png"):
        assert (tmp_path / "ev" / f).stat().st_size > 0
    from mixlab.eval.common import load_run

    run = load_run(ckpt)
    assert type(run.model) is SyntheticLM  # the head class is recorded in the checkpoint
    assert run.data == "mixlab.datamodules.retrieval.RetrievalDataModule" and run.data_args["context_length"] == 64
    res = copy_prior(["--ckpt", str(ckpt), "--length", "12", "--out", str(tmp_path / "prior"), "--all-heads"])
    assert sorted(res) == [0, 1] and res[1]["causal_prior"].shape == (12, 12)
    assert (tmp_path / "prior" / "goat_prior_l0_h1.png").stat().st_size > 0


def test_generated_datasets_pickle_for_forkserver_workers():
    """DataLoader workers started by ``forkserver`` (the default on some images, and from Python
    3.14) pickle the dataset, and a generated dataset calls back into its datamodule: before the
    fix, the attached trainer came along and its optimizer's LambdaLR did not pickle (the parity
    reproduce run crashed at the first batch on the H200)."""
    import pickle

    from torch.utils.data import DataLoader

    class Trainer:  # stands for the attached trainer: holds an unpicklable closure
        schedule = staticmethod(lambda step: 1.0)

    dm = ParityDataModule(batch_size=4, n_train=16, num_workers=1)
    dm.trainer = Trainer()
    ds = dm.dataset("train")
    with pytest.raises((AttributeError, pickle.PicklingError)):
        pickle.dumps(Trainer.schedule)
    again = pickle.loads(pickle.dumps(ds))
    assert again.make.__self__.trainer is None and dm.trainer is not None
    loader = DataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context="forkserver")
    first = next(iter(loader))
    want = torch.stack([ds[i]["targets"] for i in range(4)])
    assert torch.equal(first["targets"], want)


def test_sample_cache_returns_the_generated_samples_and_generates_each_once(monkeypatch):
    """``cache`` (the default) keeps generated samples per process: the values equal a fresh
    generation's, a second read does not call the generator, a caller's change to the returned dict
    does not reach the cache, and past ``max_cache_bytes`` samples are generated again."""
    from mixlab.datamodules.synthetic import GeneratedDataset

    dm = M.MADDataModule(task="in_context_recall", batch_size=8, n_train=64)
    fresh = M.MADDataModule(task="in_context_recall", batch_size=8, n_train=64, cache=False).dataset("train")
    ds = dm.dataset("train")
    calls = []
    make = ds.make
    ds.make = lambda rng, split: calls.append(1) or make(rng, split)
    for i in (0, 5, 63):
        first = ds[i]
        first["extra"] = torch.zeros(1)
        again = ds[i]
        assert "extra" not in again
        for key, value in fresh[i].items():
            assert torch.equal(again[key], value), (i, key)
    assert len(calls) == 3  # each index generated once

    monkeypatch.setattr(GeneratedDataset, "max_cache_bytes", 1)  # full after one sample
    small = dm.dataset("val")
    small[0], small[1], small[1]
    assert list(small._cache) == [0]
    assert torch.equal(small[1]["inputs"], fresh.make.__self__.dataset("val")[1]["inputs"])


@pytest.mark.parametrize(("cls", "kwargs", "message"), [
    # a user test: 0 was read as "the default" (the config still said 0), negatives and NaN were accepted
    ("mad", dict(vocab=0), "data.init_args.vocab must be >= 1 (null: the task's default); got 0"),
    ("mad", dict(seq_len=0), "data.init_args.seq_len must be >= 1 (null: the task's default); got 0"),
    ("mad", dict(task="noisy_recall", frac_noise=5), "data.init_args.frac_noise must be in [0, 1)"),
    ("mad", dict(task="noisy_recall", frac_noise=float("nan")), "data.init_args.frac_noise must be in [0, 1)"),
    ("regbench", dict(context_length=0), "data.init_args.context_length must be >= 1 tokens"),
    ("regbench", dict(min_string_len=-3), "1 <= min_string_len <= max_string_len; got -3, 49"),
    ("regbench", dict(min_strings=20, max_strings=19), "1 <= min_strings <= max_strings; got 20, 19"),
])
def test_synthetic_sizes_of_zero_or_out_of_range_are_refused(cls, kwargs, message):
    from mixlab.datamodules.mad import MADDataModule
    from mixlab.datamodules.regbench import RegBenchDataModule

    with pytest.raises(ValueError, match=re.escape(message)):
        (MADDataModule if cls == "mad" else RegBenchDataModule)(**kwargs)
