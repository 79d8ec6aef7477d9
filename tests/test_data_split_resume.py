"""Every map-style datamodule under DDP and resume (mixlab.distributed.ResumableDataModule).

Ranks are simulated in one process by patching ``torch.distributed`` (what the sampler reads);
workers are real DataLoader worker processes. Checked by value:
* text windows and a synthetic task: the ranks' batches are exactly the ``r::2`` halves of a
  single process's batches at twice the batch (so every sample is seen once), with or
  without workers; evaluation covers every window / sample exactly once;
* state round trip for text, synthetic tasks, digits, spatial VQA, genome and ImageFolder:
  take k batches, save ``state_dict()``, load it into a fresh datamodule: the next batches
  equal the uninterrupted run's.
"""
import io
import random
from collections import Counter
from itertools import islice
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from helpers.training import fit_two_epochs
from torch.utils.data import default_collate

from mixlab.datamodules.copy_mixture import CopyMixtureDataModule
from mixlab.datamodules.digits import DigitsDataModule
from mixlab.datamodules.genome import GenomeDataModule
from mixlab.datamodules.parity import ParityDataModule
from mixlab.datamodules.spatial_vqa import SpatialVQADataModule
from mixlab.datamodules.text import TextDataModule
from mixlab.distributed import ResumableDataModule, ResumableSampler


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(1, 7))) for _ in range(300)]
    path = tmp_path_factory.mktemp("text") / "doc.txt"
    path.write_text(" ".join(words))
    return path


def fake_ranks(monkeypatch, rank: int, world: int) -> None:
    """Make torch.distributed report ``rank`` of ``world`` (read by ResumableSampler)."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: rank)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: world)


def fake_trainer(processed: int) -> SimpleNamespace:
    """What ``sampler_state`` reads from a Trainer: batches processed in the current epoch."""
    current = SimpleNamespace(processed=processed)
    return SimpleNamespace(strategy=None, fit_loop=SimpleNamespace(
        epoch_loop=SimpleNamespace(batch_progress=SimpleNamespace(current=current))))


def flat(batch) -> list[torch.Tensor]:
    """A batch (tensor, tuple or dict of tensors) as a list of tensors, keys sorted."""
    if isinstance(batch, dict):
        return [t for k in sorted(batch) for t in flat(batch[k])]
    if isinstance(batch, (list, tuple)):
        return [t for b in batch for t in flat(b)]
    return [batch]


def same(a, b) -> bool:
    fa, fb = flat(a), flat(b)
    return len(fa) == len(fb) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(fa, fb))


def rows(batch) -> list[tuple]:
    """One hashable value per sample of a batch (all its fields' numbers)."""
    parts = flat(batch)
    return [tuple(v for p in parts for v in p[i].flatten().tolist()) for i in range(len(parts[0]))]


def half(batch, r: int):
    """Samples ``r::2`` of a batch."""
    if isinstance(batch, dict):
        return {k: half(v, r) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(half(b, r) for b in batch)
    return batch[r::2]


def make_text(text_file, batch_size=4, num_workers=0):
    return TextDataModule(path=str(text_file), tokenizer="byte", context_length=15,
                          batch_size=batch_size, val_fraction=0.2, num_workers=num_workers)


def make_parity(batch_size=4, num_workers=0):
    return ParityDataModule(train_min_len=3, train_max_len=12, test_min_len=12, test_max_len=16,
                            batch_size=batch_size, n_train=48, n_val=10, n_test=10,
                            num_workers=num_workers)


@pytest.mark.parametrize("kind", ["text", "parity"])
def test_ranks_split_text_and_synthetic_like_one_process_at_twice_the_batch(kind, text_file, monkeypatch):
    make = (lambda **kw: make_text(text_file, **kw)) if kind == "text" else make_parity
    one = make(batch_size=8)
    one.setup("fit")
    ref = list(one.train_dataloader())
    ref_val = [r for b in one.val_dataloader() for r in rows(b)]
    ds = one.train_dataloader().dataset
    train_items = Counter(r for i in range(len(ds)) for r in rows(default_collate([ds[i]])))
    seen, seen_val = Counter(), []
    for rank in range(2):
        fake_ranks(monkeypatch, rank, 2)
        dm = make(batch_size=4, num_workers=2 if rank else 0)  # rank 1 reads through 2 workers
        dm.setup("fit")
        loader = dm.train_dataloader()
        assert isinstance(loader.sampler, ResumableSampler) and loader.sampler.rank == rank
        batches = list(loader)
        assert len(batches) == len(ref)
        for k, (mine, big) in enumerate(zip(batches, ref)):
            assert same(mine, half(big, rank)), (rank, k)  # DDP at B == one process at 2B
            seen.update(rows(mine))
        seen_val += [r for b in dm.val_dataloader() for r in rows(b)]
    assert not seen - train_items  # a sub-multiset of the samples: no sample twice
    assert sum(seen.values()) == 8 * len(ref)
    if kind == "parity":  # 48 samples = 2 ranks x 6 batches x 4: every sample exactly once
        assert seen == train_items and sum(seen.values()) == 48
    assert Counter(seen_val) == Counter(ref_val)  # evaluation: every sample exactly once


def make_copy():
    return CopyMixtureDataModule(length=12, vocab=8, batch_size=4, n_train=40, n_val=8, n_test=8)


def make_digits():
    return DigitsDataModule(image_size=16, batch_size=4, augment=False)


def make_vqa():
    return SpatialVQADataModule(source="digits", n_train=40, n_val=8, n_test=8, batch_size=4)


def make_genome(tmp_path_factory):
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("fa") / "t.fa"
    path.write_text(">chrT\n" + "".join(rng.choice("ACGT") for _ in range(1500)) + "\n")
    return lambda: GenomeDataModule(fasta=str(path), context_length=15, region_size=64, batch_size=4,
                                    val_fraction=0.2, test_fraction=0.2)


def make_folder(tmp_path_factory):
    from PIL import Image

    from mixlab.datamodules.imagenet import ImageNetDataModule, eval_transform
    root = tmp_path_factory.mktemp("folder")
    g = torch.Generator().manual_seed(0)
    for c in range(2):
        (root / f"c{c}").mkdir()
        for k in range(6):
            px = torch.randint(0, 256, (12, 12, 3), generator=g, dtype=torch.uint8).numpy()
            Image.fromarray(px).save(root / f"c{c}" / f"{k}.png")
    def make():
        dm = ImageNetDataModule(format="folder", train_path=str(root), val_path=str(root),
                                num_classes=2, image_size=8, batch_size=2, num_workers=0)
        dm.transform = lambda split: eval_transform(8)  # no random augmentation: batches are a
        return dm                                         # function of the sample order only
    return make


@pytest.mark.parametrize("kind,world", [("text", 1), ("text", 2), ("parity", 2), ("copy", 1),
                                        ("digits", 1), ("vqa", 1), ("genome", 2), ("folder", 1)])
def test_state_round_trip_resumes_with_the_next_batch(kind, world, text_file, tmp_path_factory, monkeypatch):
    make = {"text": lambda: make_text(text_file), "parity": make_parity, "copy": make_copy,
            "digits": make_digits, "vqa": make_vqa}.get(kind)
    if kind == "genome":
        make = make_genome(tmp_path_factory)
    elif kind == "folder":
        make = make_folder(tmp_path_factory)
    if world == 2:
        fake_ranks(monkeypatch, 1, 2)
    k, epoch, n_next = 3, 1, 3
    dm = make()
    assert isinstance(dm, ResumableDataModule)
    dm.setup("fit")
    assert dm.state_dict() == {}  # no train loader yet: nothing to save
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(epoch)  # what Lightning does at each epoch start
    full = list(islice(iter(loader), k + n_next))
    dm.trainer = fake_trainer(processed=k)  # the trainer has trained on k batches
    state = dm.state_dict()
    bs = loader.batch_size
    assert state["train_sampler"] == {"epoch": epoch, "seed": loader.sampler.seed, "position": k * bs,
                                      "num_replicas": world, "length": len(loader.dataset)}
    buf = io.BytesIO()
    torch.save({type(dm).__name__: state}, buf)  # as in a Lightning checkpoint
    buf.seek(0)
    fresh = make()
    fresh.load_state_dict(torch.load(buf, weights_only=True)[type(dm).__name__])
    fresh.setup("fit")
    resumed = fresh.train_dataloader()
    resumed.sampler.set_epoch(epoch)
    rest = list(islice(iter(resumed), n_next))
    for j in range(n_next):
        assert same(rest[j], full[k + j]), (kind, j)
    assert not same(rest[0], full[0])
    assert len(list(resumed.sampler)) == len(resumed.sampler)  # the position applies to one pass
    again = make()  # without the state: the same epoch from its start
    again.setup("fit")
    plain = again.train_dataloader()
    plain.sampler.set_epoch(epoch)
    assert same(next(iter(plain)), full[0])


def test_eval_ranks_are_padded_only_where_the_forward_is_collective(monkeypatch):
    """11 val samples on 2 ranks: exact (6 + 5) under DDP without buffer broadcast and outside a
    trainer; padded to 6 + 6 (one sample repeated, no hang) under FSDP or buffer-broadcasting DDP."""
    from lightning.pytorch.strategies import DDPStrategy

    from mixlab.distributed import FSDPStrategy
    fake_ranks(monkeypatch, 0, 2)
    cases = [(None, 11), (DDPStrategy(broadcast_buffers=False), 11), (DDPStrategy(), 12), (FSDPStrategy(), 12)]
    for strategy, total in cases:
        counts, seen = [], []
        for rank in range(2):
            fake_ranks(monkeypatch, rank, 2)
            dm = ParityDataModule(batch_size=4, n_train=8, n_val=11, n_test=4)
            if strategy is not None:
                dm.trainer = SimpleNamespace(strategy=strategy)
            idx = list(dm.val_dataloader().sampler)
            counts.append(len(idx))
            seen += idx
        assert sum(counts) == total and set(seen) == set(range(11)), strategy
        assert counts == ([6, 6] if total == 12 else [6, 5]) and seen.count(0) == 1 + (total == 12)


class _IndexData(ResumableDataModule):
    """``n`` samples whose value is their index (so a batch shows which samples it holds)."""

    def __init__(self, n: int, batch_size: int, num_workers: int):
        super().__init__()
        self.data, self.batch_size, self.num_workers = torch.arange(n), batch_size, num_workers

    def train_dataloader(self):
        return self.resumable_loader(self.data, self.batch_size, train=True, seed=1, num_workers=self.num_workers)


@pytest.mark.parametrize("n,workers", [(12, 0), (12, 2), (13, 2)])
def test_map_style_resume_under_lightning_mid_epoch_and_at_the_last_batch(n, workers, tmp_path):
    """Real Trainer, 2 epochs x 6 steps of 2 samples (13 samples: the last one of each epoch's order is
    dropped), a checkpoint every step: resuming from step 3 (mid epoch 0) or step 6 (the last batch of
    epoch 0: Lightning builds the resumed loader's iterator, which pulls from the sampler, before it
    moves on to epoch 1) trains on exactly the uninterrupted run's remaining batches, with DataLoader
    workers or without."""
    import lightning.pytorch as pl

    class Rec(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.w, self.seen = torch.nn.Parameter(torch.zeros(())), []

        def training_step(self, batch, i):
            self.seen.append((self.current_epoch, batch.tolist()))
            return (self.w * batch.float()).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(ckpt=None, every=None):
        return fit_two_epochs(Rec(), _IndexData(n, 2, workers), tmp_path, ckpt, every).seen

    full = fit(every=1)
    assert [e for e, _ in full] == [0] * 6 + [1] * 6
    for e in range(2):  # each epoch: 12 distinct samples of a fresh permutation
        assert len({i for ep, b in full if ep == e for i in b}) == 12
    assert [b for ep, b in full if ep == 0] != [b for ep, b in full if ep == 1]
    for step in (3, 6):
        rest = fit(str(tmp_path / f"step={step}.ckpt"))
        assert rest == full[step:], step


def test_sampler_state_at_the_end_of_an_epoch_loads_as_the_next_epoch():
    """A state covering this rank's whole epoch (here 13 samples, 2 ranks: 6 each, the 13th dropped)
    restores epoch e + 1 at position 0, whatever set_epoch Lightning then calls (e or e + 1), also on
    3 ranks (12 consumed samples do not split over 3 but none is left); a mid-epoch state keeps its
    position under set_epoch(e). At the trainer's last batch sampler_state saves the whole epoch even
    when drop_last leaves a tail the position does not reach."""
    from mixlab.distributed import sampler_state
    data = list(range(13))
    ref = {}
    for e in range(3):
        s = ResumableSampler(data, num_replicas=2, rank=1, seed=4)
        s.set_epoch(e)
        ref[e] = list(s)
    full = ResumableSampler(data, num_replicas=2, rank=1, seed=4)
    full.set_epoch(1)
    done = full.state_dict(position=6)
    for follow in (None, 1, 2):
        s = ResumableSampler(data, num_replicas=2, rank=1, seed=4)
        s.load_state_dict(done)
        if follow is not None:
            s.set_epoch(follow)
        assert s.epoch == 2 and list(s) == ref[2], follow
    s.set_epoch(0)  # an explicit other epoch later is honoured
    assert list(s) == ref[0]
    three = ResumableSampler(data, num_replicas=3, rank=2, seed=4)
    three.load_state_dict(done)
    assert three.epoch == 2 and len(list(three)) == 4
    mid = ResumableSampler(data, num_replicas=2, rank=1, seed=4)
    mid.load_state_dict(full.state_dict(position=4))
    mid.set_epoch(1)
    assert list(mid) == ref[1][4:] and list(mid) == ref[1]  # the position applies to one pass
    one = ResumableSampler(data, seed=4)  # 1 rank, batches of 4 with drop_last: 3 batches, 1 left
    trainer = fake_trainer(processed=3)
    trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = True
    assert sampler_state(trainer, one, 4)["train_sampler"]["position"] == 13
    trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = False
    assert sampler_state(trainer, one, 4)["train_sampler"]["position"] == 12
