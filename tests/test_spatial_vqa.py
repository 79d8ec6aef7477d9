"""Spatial VQA: generator, scan-order split, answers, CIFAR-10 pickles, GOAT mixed coordinates, head."""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mixlab.backbone import BackboneConfig
from mixlab.coords import Coords
from mixlab.datamodules.spatial_vqa import (
    CELL_NAMES,
    DEFAULT_HELDOUT_ORDERS,
    DEFAULT_TRAIN_ORDERS,
    SpatialVQADataModule,
    ask,
    scan_order,
)
from mixlab.heads.vqa import SpatialVQA
from mixlab.mixers.attention import Attention

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "vqa"


def _dm(**kw) -> SpatialVQADataModule:
    args = dict(n_train=256, n_val=64, n_test=120, batch_size=32)
    args.update(kw)
    dm = SpatialVQADataModule(**args)
    dm.setup()
    return dm


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------- scan orders
def test_scan_orders_values_and_split():
    assert scan_order("row_major", 2).tolist() == list(range(16))
    assert scan_order("col_major", 2).tolist() == [0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15]
    assert scan_order("snake_rows", 2).tolist() == [0, 1, 2, 3, 7, 6, 5, 4, 8, 9, 10, 11, 15, 14, 13, 12]
    assert scan_order("spiral", 2).tolist() == [0, 1, 2, 3, 7, 11, 15, 14, 13, 12, 8, 4, 5, 6, 10, 9]
    # image by image: top-right (1), top-left (0), bottom-right (3), bottom-left (2)
    assert scan_order("cells_1032", 2).tolist() == [2, 3, 6, 7, 0, 1, 4, 5, 10, 11, 14, 15, 8, 9, 12, 13]
    assert scan_order("cells_3210", 1).tolist() == [3, 2, 1, 0]
    assert scan_order("diagonal", 1).tolist() == [0, 1, 2, 3]
    names = list(DEFAULT_TRAIN_ORDERS) + list(DEFAULT_HELDOUT_ORDERS)
    perms = {tuple(scan_order(n, 2)) for n in names}
    assert len(perms) == len(names)  # all distinct permutations
    assert all(sorted(p) == list(range(16)) for p in perms)
    with pytest.raises(ValueError, match="unknown scan order 'zigzag'"):
        scan_order("zigzag", 2)
    with pytest.raises(ValueError, match="cells_0124"):
        scan_order("cells_0124", 2)
    # with one patch per image, col_major == cells_0213 (a training order): refused
    with pytest.raises(ValueError, match="held-out scan order 'col_major' equals training order 'cells_0213'"):
        SpatialVQADataModule(patch_size=8)
    with pytest.raises(ValueError, match=r"\['spiral'\] are in both"):
        SpatialVQADataModule(train_orders=["row_major", "spiral"], heldout_orders=["spiral"])
    with pytest.raises(ValueError, match="data.init_args.heldout_orders: unknown scan order 'zigzag'"):
        SpatialVQADataModule(train_orders=["row_major"], heldout_orders=["spiral", "zigzag"])
    with pytest.raises(ValueError, match="data.init_args.train_orders: unknown scan order 'zigzag'"):
        SpatialVQADataModule(train_orders=["zigzag"])


# ---------------------------------------------------------------------------- generator
def test_generator_is_deterministic():
    a, b = _dm(seed=3), _dm(seed=3)
    for split in ("train", "val", "test"):
        idx = [7, 0, 63, 7]
        items_a = [a.datasets[split][i] for i in idx]
        items_b = [b.datasets[split][i] for i in reversed(idx)][::-1]  # access order does not matter
        assert all(_same(x, y) for x, y in zip(items_a, items_b))
        assert _same(items_a[0], items_a[3])
    c = _dm(seed=4)
    assert not all(_same(a.datasets["train"][i], c.datasets["train"][i]) for i in range(8))
    assert not all(_same(a.datasets["train"][i], a.datasets["val"][i]) for i in range(8))
    # scenes do not depend on the dataset length (a scene is a function of seed, split, index)
    assert _same(_dm(seed=3, n_train=1000).datasets["train"][100], _dm(seed=3, n_train=101).datasets["train"][100])


def test_heldout_orders_never_in_training_batches():
    dm = _dm(n_train=320, n_val=64, n_test=200)
    held = set(dm.heldout_order_ids)
    assert held == set(range(10, 20)) and dm.order_names[10:] == list(DEFAULT_HELDOUT_ORDERS)
    train = list(dm.train_dataloader())
    seen_train = torch.cat([b["order"] for b in train])
    seen_val = torch.cat([b["order"] for b in dm.val_dataloader()])
    assert len(seen_train) == 320 and len(seen_val) == 64
    assert not (set(seen_train.tolist()) | set(seen_val.tolist())) & held
    assert set(seen_train.tolist()) == set(range(10))  # every training order is used
    # the scan permutation in the batch is the named order's (no other path to a held-out order)
    train_perms = {tuple(scan_order(n, 2)) for n in DEFAULT_TRAIN_ORDERS}
    assert all(tuple(s) in train_perms for b in train for s in b["scan"].tolist())
    test_orders = torch.cat([b["order"] for b in dm.test_dataloader()])
    assert torch.bincount(test_orders, minlength=20).tolist() == [10] * 20  # cycles over all orders


# ---------------------------------------------------------------------------- answers
def test_answers_for_hand_built_scene():
    scene = [3, 7, 1, 0]  # top-left 3, top-right 7, bottom-left 1, bottom-right 0
    assert ask(scene, "what_at", 1) == (["what", "is", "at", "the", "top-right"], "seven")
    assert ask(scene, "what_at", 2)[1] == "one"
    assert ask(scene, "where", 1) == (["where", "is", "the", "one", "?"], "bottom-left")
    assert ask(scene, "where", 0)[1] == "bottom-right"
    assert ask(scene, "relation", 3, "right") == (["what", "is", "right", "of", "three"], "seven")
    assert ask(scene, "relation", 3, "below")[1] == "one"
    assert ask(scene, "relation", 0, "above")[1] == "seven"
    assert ask(scene, "relation", 0, "left")[1] == "one"
    assert ask(scene, "relation", 1, "above")[1] == "three"
    with pytest.raises(ValueError, match="nothing is left of the top-left image"):
        ask(scene, "relation", 3, "left")
    with pytest.raises(ValueError, match="class 5 is not in the scene"):
        ask(scene, "where", 5)
    with pytest.raises(ValueError, match="four distinct classes"):
        ask([1, 1, 2, 3], "what_at", 0)


def test_items_match_their_scene():
    """Patches come from images of the recorded classes at their canonical cells; text and answer agree."""
    dm = _dm()
    ds = dm.datasets["test"]
    pool = ds.pool
    for i in range(24):
        it = ds[i]
        scan, classes, images = it["scan"].numpy(), it["classes"].tolist(), it["images"].tolist()
        assert scan.tolist() == scan_order(dm.order_names[int(it["order"])], 2).tolist()
        assert [int(pool.labels[m]) for m in images] == classes and len(set(classes)) == 4
        raw = np.rint((it["patches"].numpy() * 0.5 + 0.5) * 255).astype(np.uint8)  # undo normalisation
        for t, k in enumerate(scan):
            y, x = divmod(int(k), 4)
            cell, inner = (y // 2) * 2 + x // 2, (y % 2) * 2 + x % 2
            np.testing.assert_array_equal(raw[t], pool.patches[images[cell], inner])
            assert it["coords"][t].tolist() == [0, y, x] and it["coord_mask"][t].tolist() == [False, True, True]
        assert it["coords"][16:, 0].tolist() == list(range(16, 22))
        assert it["coord_mask"][16:].tolist() == [[True, False, False]] * 6
        words = dm.vocab.decode(it["text"])
        assert words[-1] == "<ans>"
        answer = dm.vocab.answers[int(it["answer"])]
        qtype = dm.question_types[int(it["qtype"])]
        if qtype == "what_at":
            assert answer == dm.vocab.class_names[classes[CELL_NAMES.index(words[4])]]
        elif qtype == "where":
            assert CELL_NAMES.index(answer) == classes.index(dm.vocab.class_names.index(words[3]))
        else:
            subject = dm.vocab.class_names.index(words[4])
            assert ask(classes, "relation", subject, words[2], dm.vocab.class_names)[1] == answer
    seq = _dm(image_seq_axis=True).datasets["test"][0]
    assert seq["coords"][:16, 0].tolist() == list(range(16)) and bool(seq["coord_mask"][:16].all())


# ---------------------------------------------------------------------------- CIFAR-10 pickles
def _write_cifar(root: Path, n: int = 12) -> dict[str, tuple[np.ndarray, list[int]]]:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    written = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.permutation(np.arange(n) % 10)]
        with open(folder / name, "wb") as f:
            pickle.dump({"batch_label": name, "labels": labels, "data": data,
                         "filenames": [f"{j}.png" for j in range(n)]}, f)
        written[name] = (data, labels)
    with open(folder / "batches.meta", "wb") as f:
        names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
        pickle.dump({"label_names": names}, f)
    return written


def test_cifar10_pickles_from_disk(tmp_path):
    written = _write_cifar(tmp_path)
    dm = _dm(source="cifar10", root=str(tmp_path), verify_md5=False, n_test=20)
    assert dm.patch_dim == 192 and dm.n_image_tokens == 64 and dm.vocab.class_names[0] == "airplane"
    test_data, test_labels = written["test_batch"]
    mean = torch.tensor([0.4914, 0.4822, 0.4465]).repeat_interleave(64)
    std = torch.tensor([0.2470, 0.2435, 0.2616]).repeat_interleave(64)
    for i in range(3):
        it = dm.datasets["test"][i]
        img = int(it["images"][0])  # top-left image, an index into test_batch
        assert test_labels[img] == int(it["classes"][0])
        chw = torch.from_numpy(test_data[img].reshape(3, 32, 32)).float() / 255
        first = (chw[:, :8, :8].reshape(-1) - mean) / std  # canonical patch 0 = top-left 8x8 of the top-left image
        t = it["scan"].tolist().index(0)
        torch.testing.assert_close(it["patches"][t], first)
    train_labels = sum((written[f"data_batch_{i}"][1] for i in range(1, 6)), [])
    it = dm.datasets["train"][0]
    assert [train_labels[m] for m in it["images"].tolist()] == it["classes"].tolist()
    with pytest.raises(RuntimeError, match="md5"):  # fixture bytes are not the real CIFAR-10
        _dm(source="cifar10", root=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="CIFAR-10 not found.*data_batch_1.*Downloads are disabled"):
        _dm(source="cifar10", root=str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="data.init_args.root"):
        _dm(source="cifar10")


# ---------------------------------------------------------------------------- GOAT mixed coordinates
@torch.no_grad()
def goat_explicit_batched(m: Attention, x: torch.Tensor, pos: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """Per sample b: z_ij = q_c.k_c/sqrt(d_c) + sum_r [alpha cos(w d) + beta sin(w d)] + u(j), by loops.

    Only axes both tokens have contribute to the relative term (text-patch pairs: none);
    ``u(j) = g(phi_abs(j))`` computed from its own feature formula (bidirectional: no lambda j, no bos).
    """
    p = m.pos
    B, T, _ = x.shape
    H, dc, dh = m.n_heads, m.d_c, m.head_dim
    w, axis = p.freqs(), p.mode_axis.tolist()
    v_abs = torch.tensor([10000.0 ** (-k / (p.key_mlp_freqs - 1)) for k in range(p.key_mlp_freqs)], dtype=torch.float64)
    q_all, k_all, v_all = m._split(x)  # content q, k [B, H, T, d_c], v [B, H, T, d_h] (the module's projections)
    out = []
    for b in range(B):
        qc, kc, v = q_all[b].transpose(0, 1), k_all[b].transpose(0, 1), v_all[b].transpose(0, 1)  # [T, H, d]
        c, pr = pos[b].double(), present[b].double()
        phi = torch.cat([torch.cat([torch.sin(c[:, a:a + 1] * v_abs), torch.cos(c[:, a:a + 1] * v_abs),
                                    c[:, a:a + 1] / p.abs_scale, torch.ones(T, 1, dtype=torch.float64)], -1)
                         * pr[:, a:a + 1] for a in range(3)], -1)
        z = torch.empty(H, T, T, dtype=torch.float64)
        for h in range(H):
            g = F.silu(phi @ p.mlp_w1[h] + p.mlp_b1[h]) @ p.mlp_w2[h]
            for i in range(T):
                for j in range(T):
                    rel = sum(float(p.alpha[h, r]) * math.cos(float(w[r]) * float(pos[b, i, a] - pos[b, j, a]))
                              + float(p.beta[h, r]) * math.sin(float(w[r]) * float(pos[b, i, a] - pos[b, j, a]))
                              for r, a in enumerate(axis) if present[b, i, a] and present[b, j, a])
                    z[h, i, j] = float(qc[i, h] @ kc[j, h]) / math.sqrt(dc) + rel + float(g[j])
        o = torch.softmax(z, -1) @ v.transpose(0, 1)
        out.append(m.proj(o.transpose(0, 1).reshape(T, H * dh)))
    return torch.stack(out)


def test_goat_mixed_coordinate_logits_equal_explicit_formula():
    """Real VQA coordinates, two samples with different scan orders (per-sample [B, T, 3] coords)."""
    dm = _dm()
    batch = next(iter(dm.test_dataloader()))
    pos, mask = batch["coords"][:2], batch["coord_mask"][:2]
    assert batch["order"][0] != batch["order"][1]
    torch.manual_seed(0)
    m = Attention(32, 2, causal=False, position="goat",
                  position_args=dict(n_modes=3, axes=3, freq_base=100.0, abs_scale=16.0, key_mlp_hidden=8)).double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for prm in m.pos.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g, dtype=prm.dtype))
    x = torch.randn(2, pos.shape[1], 32, dtype=torch.float64)
    want = goat_explicit_batched(m, x, pos, mask)
    torch.testing.assert_close(m(x, Coords(pos, mask)), want, rtol=1e-10, atol=1e-10)
    m.impl = "reference"
    torch.testing.assert_close(m(x, Coords(pos, mask)), want, rtol=1e-10, atol=1e-10)


def _reorder(item: dict, new_scan: np.ndarray) -> dict:
    """The same scene read in another scan order (patches and their coordinates permuted)."""
    inv = np.argsort(item["scan"].numpy())  # canonical k -> position
    take = torch.from_numpy(inv[new_scan])
    out = {k: v.clone() for k, v in item.items()}
    out["patches"] = item["patches"][take]
    out["coords"][:16] = item["coords"][:16][take]
    out["coord_mask"][:16] = item["coord_mask"][:16][take]
    out["scan"] = torch.from_numpy(new_scan)
    return out


def _tiny_model(mixer: str, coordinates: str, causal: bool = False, **pos_args) -> SpatialVQA:
    bb = BackboneConfig(d_model=48, n_layers=2, n_heads=2, mixer=mixer,
                        mixer_args={mixer: {"position_args": pos_args}} if pos_args else {})
    return SpatialVQA(backbone=bb, coordinates=coordinates, causal=causal).double().eval()


def _scene_in_two_orders() -> tuple[dict, dict]:
    """Four test scenes as a float64 batch in their scan order and read in spiral order."""
    torch.manual_seed(0)
    items = [_dm().datasets["test"][i] for i in range(4)]
    a = torch.utils.data.default_collate(items)
    b = torch.utils.data.default_collate([_reorder(it, scan_order("spiral", 2)) for it in items])
    a["patches"], b["patches"] = a["patches"].double(), b["patches"].double()
    return a, b


def test_goat_answers_do_not_depend_on_scan_order_rope_1d_does():
    a, b = _scene_in_two_orders()
    goat = _tiny_model("goat", "mixed", n_modes=6, axes=3, init="random")
    torch.testing.assert_close(goat(a), goat(b), rtol=1e-9, atol=1e-9)
    rope = _tiny_model("rope", "sequence")
    assert (rope(a) - rope(b)).abs().max() > 1e-4
    with pytest.raises(ValueError, match="position_args.axes: 3"):
        _tiny_model("goat", "mixed", n_modes=2, axes=1)


def test_causal_option_gives_nope_positions():
    """Bidirectional NoPE reads the patches as a set (a reordered scene gives the same answer logits, so
    "what is at the top-left" has no answer it could compute); the causal decoder's mask breaks that
    symmetry, which is why the shipped VQA configs are causal."""
    a, b = _scene_in_two_orders()
    torch.manual_seed(1)
    enc = _tiny_model("nope", "sequence")
    torch.testing.assert_close(enc(a), enc(b), rtol=1e-9, atol=1e-9)
    torch.manual_seed(1)
    dec = _tiny_model("nope", "sequence", causal=True)
    assert all(blk.mixer.causal for blk in dec.backbone.blocks)
    assert not any(blk.mixer.causal for blk in enc.backbone.blocks)
    assert (dec(a) - dec(b)).abs().max() > 1e-4
    # same weights, only the mask differs: the last token's answer differs from the bidirectional one
    assert (dec(a) - enc(a)).abs().max() > 1e-4


# ---------------------------------------------------------------------------- head + trainer
def test_fit_and_test_report_seen_and_heldout(tmp_path):
    pl.seed_everything(0)
    dm = SpatialVQADataModule(n_train=128, n_val=32, n_test=100, batch_size=32)
    model = SpatialVQA(backbone=BackboneConfig(d_model=32, n_layers=1, n_heads=2, mixer="goat",
                                               mixer_args={"goat": {"position_args": {"n_modes": 3, "axes": 3}}}))
    trainer = pl.Trainer(max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, val_check_interval=2,
                         limit_val_batches=1)
    trainer.fit(model, datamodule=dm)
    res = trainer.test(model, datamodule=dm, verbose=False)[0]
    # recompute every reported number from the model's own predictions on the test set
    model.eval()
    with torch.no_grad():
        rows = [(b["order"], *model._step(b)) for b in dm.test_dataloader()]
    order = torch.cat([r[0] for r in rows])
    nll, hits = torch.cat([r[1] for r in rows]).double(), torch.cat([r[2] for r in rows]).double()
    held = order >= 10
    assert res["test/acc_seen"] == pytest.approx(float(hits[~held].mean()), abs=1e-6)
    assert res["test/acc_heldout"] == pytest.approx(float(hits[held].mean()), abs=1e-6)
    assert res["test/loss_heldout"] == pytest.approx(float(nll[held].mean()), rel=1e-5)
    assert res["test/loss"] == pytest.approx(float(nll.mean()), rel=1e-5)
    assert res["test/acc_order/spiral"] == pytest.approx(float(hits[order == 14].mean()), abs=1e-6)
    assert {f"test/acc_q/{q}" for q in ("what_at", "where", "relation")} <= set(res)


@pytest.mark.parametrize("name", ["goat_digits", "rope_digits", "nope_digits", "goat_cifar10", "rope_cifar10",
                                  "nope_cifar10"])
def test_shipped_configs_build_and_answer(name, tmp_path):
    """Every shipped YAML parses, builds model + datamodule + trainer, and the model answers a real batch."""
    from mixlab.cli import MixlabCLI

    extra = []
    if "cifar10" in name:
        _write_cifar(tmp_path / "cifar")
        extra = ["--data.init_args.root", str(tmp_path / "cifar"), "--data.init_args.verify_md5", "false"]
    cli = MixlabCLI(args=["--config", str(CONFIGS / f"{name}.yaml"), "--run_root", str(tmp_path),
                          "--data.init_args.batch_size", "2", "--data.init_args.num_workers", "0", *extra], run=False)
    model, dm = cli.model, cli.datamodule
    assert isinstance(model, SpatialVQA) and model.backbone.pattern[0] == name.split("_")[0]
    assert (model.vocab_size, model.n_answers, model.patch_dim) == (dm.vocab_size, dm.n_answers, dm.patch_dim)
    assert model.coordinates == ("mixed" if name.startswith("goat") else "sequence")
    assert (dm.n_train, dm.n_test) == (50_000, 10_000)
    assert dm.train_orders == ["row_major"] and len(dm.heldout_orders) == 10  # the paper's protocol
    assert all(blk.mixer.causal for blk in model.backbone.blocks)
    with torch.no_grad():
        logits = model.eval()(next(iter(dm.test_dataloader())))
    assert logits.shape == (2, dm.n_answers) and bool(torch.isfinite(logits).all())


def test_cli_fit_fast_dev_run(tmp_path):
    from mixlab.cli import main

    main(["fit", "--config", str(CONFIGS / "goat_digits.yaml"), "--trainer.fast_dev_run", "1",
          "--trainer.default_root_dir", str(tmp_path), "--run_root", str(tmp_path),
          "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
          "--data.init_args.batch_size", "4"])


def test_a_zero_patch_size_is_refused_not_read_as_the_default():
    """A user test: ``patch_size 0`` trained with 4 while config.yaml said 0."""
    from mixlab.datamodules.spatial_vqa import SpatialVQADataModule

    with pytest.raises(ValueError, match=r"data.init_args.patch_size must be >= 1 pixel \(null: 4 for digits, 8 for "
                                         r"cifar10\); got 0"):
        SpatialVQADataModule(patch_size=0)
