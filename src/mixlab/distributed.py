"""Data splitting by rank and worker, and resumable data order, for multi-GPU and resumed runs.

Three pieces, all CPU-only and independent of the model:

* :class:`ResumableSampler` - a :class:`~torch.utils.data.DistributedSampler` for map-style
  datasets. Rank ``r`` of ``W`` gets items ``r::W`` of one seeded permutation of the whole
  dataset, so ``W`` ranks at batch ``B`` see exactly the samples of one process at batch
  ``W * B`` (same order, no duplicates). It is ``Stateful`` (epoch, seed, position):
  resuming mid-epoch continues with the next unseen sample. Lightning leaves it in place
  (it is already a ``DistributedSampler``) instead of wrapping the loader in its own.
* :func:`sampler_state` / :func:`restore_sampler` - the two lines a LightningDataModule
  needs in ``state_dict`` / ``load_state_dict`` so the train sampler's position is saved in
  every checkpoint (Lightning stores ``datamodule.state_dict()`` in the ``.ckpt``). The
  position comes from the trainer's batch progress, not from the loader's iterator, so
  prefetching and worker processes cannot shift it.
* :func:`consumer_slice`, :func:`stream_seed`, :func:`worker_skip` and
  :class:`SeededStream` - for iterable data (synthetic streams, WebDataset shards): every
  (rank, worker) pair gets a disjoint slice of the shards or its own seed, with a clear
  error (or explicit resampling) when there are fewer shards than ranks x workers.
* :class:`FSDPStrategy` - Lightning's, keeping weight decay on sharded matrices
  (``configs/trainer/fsdp.yaml``).

Typical use in a datamodule (see ``datamodules/genome.py``)::

    def train_dataloader(self):
        self._train_sampler = ResumableSampler(self.train_dataset, shuffle=True, seed=self.seed)
        restore_sampler(self._train_sampler, self._pending_sampler_state)
        return DataLoader(self.train_dataset, self.batch_size, sampler=self._train_sampler,
                          drop_last=True)

    def state_dict(self):
        return sampler_state(self.trainer, self._train_sampler, self.batch_size)

    def load_state_dict(self, state):
        self._pending_sampler_state = state.get("train_sampler")
"""

from __future__ import annotations

import hashlib
import logging
import random
from typing import Any, Callable, Iterator, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import FSDPStrategy as _LightningFSDP
from torch.utils.data import DistributedSampler, IterableDataset, get_worker_info

__all__ = ["FSDPStrategy", "rank_world", "ResumableSampler", "sampler_state", "restore_sampler", "consumer_slice",
           "stream_seed", "worker_skip", "SeededStream"]

log = logging.getLogger("mixlab.distributed")


def rank_world(num_replicas: int | None = None, rank: int | None = None) -> tuple[int, int]:
    """``(rank, world_size)``: the given values, else ``torch.distributed``'s, else ``(0, 1)``.

    Raises ValueError when ``rank`` is not in ``[0, num_replicas)``.
    """
    initialized = dist.is_available() and dist.is_initialized()
    world = num_replicas if num_replicas is not None else (dist.get_world_size() if initialized else 1)
    rank = rank if rank is not None else (dist.get_rank() if initialized else 0)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, num_replicas), got rank={rank}, num_replicas={world}")
    return rank, world


class ResumableSampler(DistributedSampler):
    """Seeded, rank-split, resumable sampler for map-style datasets.

    Epoch ``e`` uses the permutation ``torch.randperm(n, generator=seed + e)`` (identity when
    ``shuffle=False``); rank ``r`` of ``W`` yields its items ``r::W``.

    Args:
        dataset: any sized dataset (only ``len`` is used).
        num_replicas, rank: the split; default from ``torch.distributed`` when initialized,
            else one replica.
        shuffle: permute each epoch (training) or keep the order (evaluation).
        seed: base seed of the permutation (the same on every rank).
        drop_last: ``True`` drops the last ``n % W`` items of the permutation so every rank
            gets the same count (training: no duplicates, no hangs). ``False`` with
            ``pad=False`` gives uneven ranks (evaluation: every item exactly once; only safe
            where the forward has no collective, e.g. DDP with ``broadcast_buffers: false``).
        pad: with ``drop_last=False``, repeat items from the start so ranks are even (what
            Lightning's default sampler does; needed by FSDP evaluation; up to ``W - 1``
            items are then seen twice).

    ``state_dict()`` gives ``{"epoch", "seed", "position", "num_replicas", "length"}``
    where ``position`` counts this rank's items already consumed in ``epoch``; after
    ``load_state_dict`` the next ``__iter__`` starts there. ``__len__`` stays the full
    per-rank count so Lightning's epoch length is unchanged. A different world size on
    resume is accepted when the consumed prefix splits evenly over the new ranks.

    Raises:
        ValueError: bad rank; on ``load_state_dict``, a dataset length or seed that differs
            from the checkpoint, or a position that cannot be split over the new world size.
    """

    def __init__(self, dataset: Any, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = True, pad: bool = False) -> None:
        rank, world = rank_world(num_replicas, rank)
        # DistributedSampler.__init__ would query torch.distributed; set its fields directly.
        self.dataset, self.num_replicas, self.rank = dataset, world, rank
        self.shuffle, self.seed, self.drop_last, self.pad = shuffle, int(seed), drop_last, pad
        self.epoch, self._start = 0, 0
        n = len(dataset)
        if drop_last:
            self.total_size = n - n % world
        elif pad:
            self.total_size = -(-n // world) * world
        else:
            self.total_size = n
        self.num_samples = len(range(rank, self.total_size, world))

    def _order(self) -> list[int]:
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        if self.total_size > n:  # pad by wrapping around
            order += (order * (-(-self.total_size // max(n, 1))))[: self.total_size - n]
        return order[: self.total_size]

    def __iter__(self) -> Iterator[int]:
        start, self._start = self._start, 0  # a resume position applies to one pass only
        return iter(self._order()[self.rank:self.total_size:self.num_replicas][start:])

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of ``epoch``; a new epoch forgets any resume position."""
        if epoch != self.epoch:
            self._start = 0
        self.epoch = epoch

    def state_dict(self, position: int = 0) -> dict[str, int]:
        """State to resume from after ``position`` items of this rank in the current epoch."""
        return {"epoch": self.epoch, "seed": self.seed, "position": int(position),
                "num_replicas": self.num_replicas, "length": len(self.dataset)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at ``state["position"]`` of ``state["epoch"]`` (rescaled to this world size)."""
        if state["length"] != len(self.dataset):
            raise ValueError(f"ResumableSampler.load_state_dict: the checkpoint's dataset has "
                             f"{state['length']} items, this one {len(self.dataset)}; the data "
                             f"settings changed since the checkpoint")
        if state["seed"] != self.seed:
            raise ValueError(f"ResumableSampler.load_state_dict: checkpoint seed {state['seed']} "
                             f"!= seed {self.seed}")
        consumed = state["position"] * state["num_replicas"]  # global prefix of the order
        if consumed % self.num_replicas:
            raise ValueError(f"cannot resume {state['num_replicas']} rank(s) at position "
                             f"{state['position']} on {self.num_replicas} rank(s): "
                             f"{consumed} consumed samples do not split evenly")
        self.epoch, self._start = state["epoch"], consumed // self.num_replicas


def sampler_state(trainer: Any, sampler: ResumableSampler | None, batch_size: int) -> dict[str, Any]:
    """``{"train_sampler": state}`` for a datamodule's ``state_dict`` (``{}`` outside fit).

    The position is ``batch_size`` x the batches the trainer has processed in the current
    epoch (``fit_loop.epoch_loop.batch_progress.current.processed``), i.e. what the model
    has seen when the checkpoint is written, whatever the loader prefetched.
    """
    if sampler is None or trainer is None:
        return {}
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    return {"train_sampler": sampler.state_dict(progress.processed * batch_size)}


def restore_sampler(sampler: ResumableSampler, state: dict[str, Any] | None) -> None:
    """Apply a state saved by :func:`sampler_state` (no-op for ``None``)."""
    if state:
        sampler.load_state_dict(state)


# --------------------------------------------------------------------------- iterable data
def _consumer(rank: int | None, world: int | None, worker: int | None,
              num_workers: int | None) -> tuple[int, int]:
    """(global consumer id, number of consumers) for this rank and DataLoader worker."""
    rank, world = rank_world(world, rank)
    info = get_worker_info()
    worker = worker if worker is not None else (info.id if info is not None else 0)
    num_workers = num_workers if num_workers is not None else (info.num_workers if info is not None else 1)
    num_workers = max(num_workers, 1)
    if not 0 <= worker < num_workers:
        raise ValueError(f"worker must be in [0, num_workers), got {worker}, {num_workers}")
    return rank * num_workers + worker, world * num_workers


def consumer_slice(n_shards: int, rank: int | None = None, world: int | None = None,
                   worker: int | None = None, num_workers: int | None = None,
                   on_short: Literal["error", "resample"] = "error", seed: int = 0,
                   epoch: int = 0) -> list[int]:
    """Shard indices read by one (rank, DataLoader worker): ``g::G`` with ``g = rank *
    num_workers + worker`` and ``G = world * num_workers``. Missing values come from
    ``torch.distributed`` and ``torch.utils.data.get_worker_info()``.

    Every shard goes to exactly one consumer. With fewer shards than consumers
    (``n_shards < G``) some consumer would get nothing (WebDataset then hangs or stops
    early): ``on_short="error"`` raises ValueError naming the counts and the fixes;
    ``on_short="resample"`` gives every consumer all shards in its own seeded order
    (sampling with replacement across consumers, like ``wds.ResampledShards``: use with an
    epoch length in steps, not "one pass").
    """
    if n_shards < 1:
        raise ValueError(f"n_shards must be >= 1, got {n_shards}")
    g, total = _consumer(rank, world, worker, num_workers)
    if n_shards >= total:
        return list(range(g, n_shards, total))
    if on_short == "resample":
        if g == 0:
            log.warning("%d shard(s) for %d consumers (ranks x workers): resampling shards "
                        "with replacement per consumer", n_shards, total)
        order = list(range(n_shards))
        random.Random(stream_seed(seed, epoch, g)).shuffle(order)
        return order
    if on_short != "error":
        raise ValueError(f"on_short must be 'error' or 'resample', got {on_short!r}")
    raise ValueError(f"{n_shards} shard(s) for {total} consumers (ranks x DataLoader "
                     f"num_workers): some rank/worker would read nothing; write at least "
                     f"{total} shards, lower num_workers, or use on_short='resample'")


def stream_seed(seed: int, epoch: int, consumer: int) -> int:
    """A 63-bit seed unique to (base seed, epoch, consumer id) - disjoint random streams."""
    key = f"{seed}\x1f{epoch}\x1f{consumer}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") >> 1


def worker_skip(consumed_batches: int, worker: int, num_workers: int) -> int:
    """Batches worker ``worker`` produced among the first ``consumed_batches`` of a rank.

    A DataLoader with ``num_workers = W > 0`` yields batch ``b`` from worker ``b % W`` (in
    order), so worker ``w`` made ``ceil((n - w) / W)`` of the first ``n``.
    """
    num_workers = max(num_workers, 1)
    return max(0, -(-(consumed_batches - worker) // num_workers))


class SeededStream(IterableDataset):
    """Endless (or ``length``-limited) synthetic stream; sample ``i`` of consumer ``g`` is
    ``make_sample(torch.Generator seeded with stream_seed(seed, epoch, g) + i)``.

    Consumers (rank x DataLoader worker) draw disjoint seeds, so no two produce the same
    sample stream, and skipping ahead is O(1): set ``epoch`` and ``consumed_batches``
    (this rank's batches already trained on, of size ``batch_size``) before iterating and
    each worker starts at its first unseen sample (see :func:`worker_skip`); the batch order
    of an uninterrupted run is kept (the DataLoader must use the same ``num_workers``).

    Args:
        make_sample: ``generator -> sample`` (e.g. a tensor); must use only the generator.
        seed: base seed. batch_size: the DataLoader's batch size (for the skip).
        length: samples per consumer per epoch (``None``: endless).
    """

    def __init__(self, make_sample: Callable[[torch.Generator], Any], seed: int = 0,
                 batch_size: int = 1, length: int | None = None) -> None:
        self.make_sample, self.seed, self.batch_size, self.length = make_sample, seed, batch_size, length
        self.epoch, self.consumed_batches = 0, 0

    def state_dict(self, consumed_batches: int = 0) -> dict[str, int]:
        return {"epoch": self.epoch, "seed": self.seed, "consumed_batches": int(consumed_batches)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.consumed_batches = state["epoch"], state["consumed_batches"]

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        # A fresh DataLoader starts its round robin at worker 0, but the next batch is due from
        # worker consumed % W: physical worker w plays the role of worker (w + consumed) % W.
        worker = (worker + self.consumed_batches) % n_workers
        g, _ = _consumer(None, None, worker, n_workers)
        i = worker_skip(self.consumed_batches, worker, n_workers) * self.batch_size
        base = stream_seed(self.seed, self.epoch, g)
        gen = torch.Generator()
        while self.length is None or i < self.length:
            gen.manual_seed((base + i) % 2**63)
            yield self.make_sample(gen)
            i += 1


# --------------------------------------------------------------------------- FSDP

class FSDPStrategy(_LightningFSDP):
    """Lightning's FSDPStrategy that records every parameter's ``ndim`` (as ``_mixlab_ndim``)
    before wrapping.

    With ``use_orig_params=True`` the parameters seen by ``configure_optimizers`` are 1-D
    views of the local shard, so the ``ndim < 2 -> no weight decay`` rule of
    :func:`mixlab.optim.param_groups` would silently disable weight decay for every
    matrix; it reads ``_mixlab_ndim`` instead. Same arguments as the Lightning class.
    """

    def _setup_model(self, model):
        for p in model.parameters():
            p._mixlab_ndim = p.ndim
        return super()._setup_model(model)
