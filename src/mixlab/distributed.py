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
* :class:`ResumableDataModule` - the LightningDataModule base that wires both into every
  map-style datamodule (genome, text, synthetic tasks, digits, spatial VQA, ImageFolder).
* :func:`consumer_slice`, :func:`stream_seed`, :func:`worker_skip` and
  :class:`SeededStream` - for iterable data (synthetic streams, WebDataset shards): every
  (rank, worker) pair gets a disjoint slice of the shards or its own seed, with a clear
  error (or explicit resampling) when there are fewer shards than ranks x workers.
  :func:`fit_progress` and :class:`EpochSyncLoader` give a stream the trainer's epoch and
  position (``datamodules/imagenet.py``'s ``ShardStream`` resumes WebDataset shards exactly).
* :class:`FSDPStrategy` - Lightning's, keeping weight decay on sharded matrices
  (``configs/trainer/fsdp.yaml``).

Typical use in a datamodule (see ``datamodules/genome.py``)::

    class MyData(ResumableDataModule):
        def train_dataloader(self):
            return self.resumable_loader(self.train_dataset, self.batch_size, train=True,
                                         seed=self.seed, num_workers=self.num_workers)

        def val_dataloader(self):
            return self.resumable_loader(self.val_dataset, self.batch_size, train=False,
                                         seed=self.seed, num_workers=self.num_workers)
"""

from __future__ import annotations

import functools
import hashlib
import logging
import multiprocessing
import os
import random
import signal
import threading
from typing import Any, Callable, Iterator, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import FSDPStrategy as _LightningFSDP
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, get_worker_info

__all__ = ["FSDPStrategy", "rank_world", "worker_init_ignoring_sigterm", "ResumableSampler", "sampler_state",
           "restore_sampler",
           "ResumableDataModule", "SplitLoaders", "consumer_slice", "stream_seed", "worker_skip", "SeededStream",
           "fit_progress", "EpochSyncLoader", "as_batch_end_checkpoint",
           "check_validation_on_optimizer_steps", "check_at_least", "check_num_workers", "check_seed",
           "MAX_NUM_WORKERS", "changed_data_options", "LOADER_OPTIONS", "MAX_SEED", "loader_generator"]

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


def _exit_on_a_sigterm_from(parents: set[int]) -> None:
    while signal.sigwaitinfo({signal.SIGTERM}).si_pid not in parents:
        pass
    os._exit(0)  # what torch's own worker SIGTERM handler does for its parent's SIGTERM


def _ignore_sigterm_then(init: Callable[[int], Any] | None, worker_id: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: the main process stops the workers
    if hasattr(signal, "sigwaitinfo"):  # Linux; elsewhere SIGTERM keeps its default
        parents = {os.getppid()}
        logical_parent = multiprocessing.parent_process()  # the main process under forkserver too
        if logical_parent is not None and logical_parent.pid:
            parents.add(logical_parent.pid)
        # Blocked here, SIGTERM stays blocked in every thread the worker starts later; one thread takes it.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        threading.Thread(target=_exit_on_a_sigterm_from, args=(parents,), daemon=True,
                         name="mixlab-worker-sigterm").start()
    if init is not None:
        init(worker_id)


def worker_init_ignoring_sigterm(init: Callable[[int], Any] | None = None) -> Callable[[int], None]:
    """A DataLoader ``worker_init_fn``: the worker ignores SIGTERM unless its main process sends it, and Ctrl-C
    (SIGINT, which a terminal sends to the whole process group: the main process stops at the end of its step and
    shuts the workers down), then ``init(worker_id)`` runs.

    A cluster's preemption (``kill -TERM`` to the whole process group, ``scancel``) reaches the workers too; a
    worker killed by it makes the main process raise "DataLoader worker ... is killed by signal" before
    Lightning's SIGTERM handling saves ``last.ckpt``. Ignoring it, the workers live until the main process
    has saved and shut them down. A SIGTERM from the main process itself (``multiprocessing`` terminating its
    daemonic workers at interpreter exit, the DataLoader stopping a straggler) still ends the worker: a
    worker that ignored that one too would hang the main process's exit. Workers also exit when the main
    process is gone (torch's worker watchdog). Linux only (``signal.sigwaitinfo`` names the sender);
    elsewhere the workers keep SIGTERM's default. SIGTERM stays blocked in the worker's threads, and a program
    the worker starts inherits that mask (it then ignores SIGTERM too). Picklable (``functools.partial`` of a
    module function) for spawn-started workers.
    """
    return functools.partial(_ignore_sigterm_then, init)


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

    A state whose position covers the whole epoch (a checkpoint written at the epoch's last
    batch or at its end) loads as the start of epoch ``epoch + 1``: Lightning builds the
    resumed run's iterator (which already pulls indices from the sampler, in the prefetch or
    the workers) before it calls ``set_epoch(epoch + 1)``, so the sampler must already be
    there. ``set_epoch`` with either number then keeps position 0 of ``epoch + 1``.

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
        self._done_epoch: int | None = None  # a loaded, fully consumed epoch (see load_state_dict)
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
        """Select the permutation of ``epoch``; a new epoch forgets any resume position.

        The same epoch keeps a loaded mid-epoch position. The number of a loaded, fully
        consumed epoch means the next one (see :meth:`load_state_dict`)."""
        epoch = int(epoch)
        if epoch == self._done_epoch:
            epoch += 1
        else:
            self._done_epoch = None
        if epoch != self.epoch:
            self._start = 0
        self.epoch = epoch

    def state_dict(self, position: int = 0) -> dict[str, int]:
        """State to resume from after ``position`` items of this rank in the current epoch."""
        return {"epoch": self.epoch, "seed": self.seed, "position": int(position),
                "num_replicas": self.num_replicas, "length": len(self.dataset)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at ``state["position"]`` of ``state["epoch"]`` (rescaled to this world size);
        a position covering the whole epoch continues at the start of ``state["epoch"] + 1``."""
        if state["length"] != len(self.dataset):
            raise ValueError(f"ResumableSampler.load_state_dict: the checkpoint's dataset has "
                             f"{state['length']} items, this one {len(self.dataset)}; the data "
                             f"settings changed since the checkpoint")
        if state["seed"] != self.seed:
            raise ValueError(f"ResumableSampler.load_state_dict: checkpoint seed {state['seed']} "
                             f"!= seed {self.seed}")
        consumed = state["position"] * state["num_replicas"]  # global prefix of the order
        n, world = len(self.dataset), state["num_replicas"]
        epoch_total = n - n % world if self.drop_last else (-(-n // world) * world if self.pad else n)
        self._done_epoch = None
        if consumed >= epoch_total:  # the epoch is over: resume at the start of the next one
            self._done_epoch, self.epoch, self._start = int(state["epoch"]), int(state["epoch"]) + 1, 0
            return
        if consumed % self.num_replicas:
            raise ValueError(f"cannot resume {state['num_replicas']} rank(s) at position "
                             f"{state['position']} on {self.num_replicas} rank(s): "
                             f"{consumed} consumed samples do not split evenly")
        self.epoch, self._start = state["epoch"], consumed // self.num_replicas


def sampler_state(trainer: Any, sampler: ResumableSampler | None, batch_size: int) -> dict[str, Any]:
    """``{"train_sampler": state}`` for a datamodule's ``state_dict`` (``{}`` outside fit).

    The position is ``batch_size`` x the batches the trainer has processed in the current
    epoch (``fit_loop.epoch_loop.batch_progress.current.processed``), i.e. what the model
    has seen when the checkpoint is written, whatever the loader prefetched. At the epoch's
    last batch (``batch_progress.is_last_batch``) it is the whole epoch (``len(sampler)``,
    including a tail that ``drop_last`` or ``limit_train_batches`` leaves unread), so the
    resume starts the next epoch.
    """
    if sampler is None or trainer is None:
        return {}
    progress = trainer.fit_loop.epoch_loop.batch_progress
    position = progress.current.processed * batch_size
    if getattr(progress, "is_last_batch", False):
        position = max(position, len(sampler))
    return {"train_sampler": sampler.state_dict(position)}


def restore_sampler(sampler: ResumableSampler, state: dict[str, Any] | None) -> None:
    """Apply a state saved by :func:`sampler_state` (no-op for ``None``)."""
    if state:
        sampler.load_state_dict(state)


def as_batch_end_checkpoint(trainer: Any, checkpoint: dict[str, Any], epoch: int | None = None) -> None:
    """Write the fit loop's progress in ``checkpoint`` (in place) as Lightning records it at the end of
    the last trained batch (``on_train_batch_end``), the state it resumes exactly.

    Checkpoints written later in a step (``on_train_epoch_end``: an epoch without validation;
    ``on_train_end``: the final state of ``fit``) hold the loops after their end-of-batch and
    end-of-epoch bookkeeping, and Lightning resumes those wrongly: when ``fit`` stopped inside an
    epoch (``max_steps`` reached, ``trainer.should_stop``) the epoch is already counted as processed,
    so a run extended with a larger ``max_steps`` started the next epoch's data order (with the
    remaining batch count of the stopped one) and never trained on the rest of the stopped epoch;
    at an epoch end without validation it trained one extra batch. Here the last batch's
    ``completed`` count and ``_batches_that_stepped`` are taken back by one and the epoch counted as
    started, not processed (``checkpoint["epoch"]`` too); Lightning then finishes that batch's
    bookkeeping on resume and continues inside the epoch, or with the next one after its last batch,
    as the uninterrupted run does, and the data states (:func:`sampler_state`, streams) agree.
    A checkpoint written by a validation after the last batch (Lightning 2.6 has counted the batch
    completed by then) is treated the same, except ``_batches_that_stepped``: Lightning advances it only
    after that validation, so it is kept (taken back, the resumed run logged every step one too early).
    Checkpoints written at a batch end keep their batch counts. In every case the epoch counts say that the
    epoch of the last batch (``epoch``: Lightning's ``epoch_progress.current.processed`` when that batch started,
    recorded by :meth:`mixlab.heads.common.Head.on_train_batch_start`) is started and not processed. Lightning's
    own ``started`` count is not used for it: after a resume Lightning no longer counts the epochs it starts, so
    a run resumed twice, the first resume crossing an epoch boundary, went back a whole epoch (``epoch`` None,
    before any batch of this process: ``started - 1``). Called by
    :meth:`mixlab.heads.common.Head.on_save_checkpoint`.
    """
    if trainer is None or getattr(trainer.state, "fn", None) != "fit" or "loops" not in checkpoint:
        return
    loops = checkpoint["loops"]["fit_loop"]
    batches = loops["epoch_loop.batch_progress"]
    if batches["current"]["processed"] > 0:
        _epoch_in_progress(checkpoint, epoch)
    if getattr(trainer.state, "status", None) == "interrupted" and _as_interrupt_checkpoint(trainer, loops):
        return
    if not (0 < batches["current"]["processed"] == batches["current"]["completed"]):
        return  # written at a batch end (completed lags), or before any batch
    for counts in (batches["total"], batches["current"]):
        counts["completed"] -= 1
    # the last batch stepped: Lightning counts it again on resume, unless a validation inside that step wrote
    # the checkpoint before Lightning counted it (docstring)
    if not trainer.fit_loop.epoch_loop._should_accumulate() and not trainer.validating:
        loops["epoch_loop.state_dict"]["_batches_that_stepped"] -= 1


def _epoch_in_progress(checkpoint: dict[str, Any], epoch: int | None) -> None:
    """Epoch ``epoch`` (default: Lightning's ``started`` count - 1) as started and not processed in
    ``checkpoint``'s fit loop and in ``checkpoint["epoch"]`` (:func:`as_batch_end_checkpoint`)."""
    epochs = checkpoint["loops"]["fit_loop"]["epoch_progress"]
    if epoch is None:
        epoch = epochs["current"]["started"] - 1
    for counts in (epochs["total"], epochs["current"]):
        counts["ready"] = counts["started"] = epoch + 1
        counts["processed"] = counts["completed"] = epoch
    checkpoint["epoch"] = epoch


def _as_interrupt_checkpoint(trainer: Any, loops: dict[str, Any]) -> bool:
    """:func:`as_batch_end_checkpoint` for a checkpoint written on an interrupt (Ctrl-C, SIGTERM:
    :meth:`mixlab.callbacks.LastCheckpoint.on_exception`, Lightning's status ``interrupted``), which can land where
    no scheduled checkpoint is written. Returns True when it rewrote ``loops`` (the fit loop's state, in place):

    * inside a training batch (started, not processed; its optimizer step not taken, else ``LastCheckpoint`` does
      not save): the state at the end of the batch before it. Left as it was, the batch counter resumed one
      behind the global step and every later validation (and its checkpoint) came one step early.
    * inside a validation of ``fit``: that validation restarts from its first batch on resume, and the training
      batch before it is counted as at its end. Left as it was, Lightning finished the validation with the
      batches left (its metrics from part of the data) or skipped it, and logged every later step one too late.

    Returns False (nothing changed) for any other state, which the batch-end rules cover."""
    batches = loops["epoch_loop.batch_progress"]
    current = batches["current"]
    validating = trainer.validating and not trainer.sanity_checking and "epoch_loop.val_loop.batch_progress" in loops
    if validating:
        val = loops["epoch_loop.val_loop.batch_progress"]
        done = val["total"]["completed"] - val["current"]["completed"]  # val batches of the earlier validations
        val["total"].update(ready=done + 1, started=done + 1, processed=done, completed=done)
        val["current"].update(ready=1, started=1, processed=0, completed=0)  # Lightning: "restarted mid-evaluation"
        if 0 < current["processed"] == current["completed"]:
            for counts in (batches["total"], batches["current"]):
                counts["completed"] -= 1
    elif current["started"] > current["processed"] > 0:  # a training batch in flight
        for counts in (batches["total"], batches["current"]):
            counts["ready"] = counts["started"] = counts["processed"]
            counts["completed"] = counts["processed"] - 1
    else:
        return False
    # Lightning counts the last batch again on resume (and, inside a validation, once more after rerunning it)
    if not trainer.fit_loop.epoch_loop._should_accumulate():
        loops["epoch_loop.state_dict"]["_batches_that_stepped"] -= 1
    return True


def check_validation_on_optimizer_steps(trainer: Any) -> None:
    """Refuse a validation schedule that falls inside a gradient-accumulation cycle.

    ``val_check_interval`` counts training batches (forward passes), not optimizer steps, and
    validation is where the checkpoints are written. With ``accumulate_grad_batches = k > 1`` a
    validation after a batch that does not end a cycle (Lightning steps the optimizer after every
    ``k``-th batch of an epoch and after its last batch) would write a checkpoint holding a
    half-summed gradient that no checkpoint stores: the resumed run would lose it and differ from
    the uninterrupted one. Called at the start of training (:meth:`mixlab.heads.common.Head.on_train_start`),
    after Lightning has set ``trainer.val_check_batch``; no-op without accumulation or validation, and when the
    first such validation lies beyond the run's ``max_steps * accumulate_grad_batches`` training batches.

    Raises:
        ValueError: one line naming ``val_check_interval``, the first batch it would fall inside a
            cycle and the values that work.
    """
    import math

    k, v = int(trainer.accumulate_grad_batches), trainer.val_check_batch
    n = trainer.num_training_batches
    if k <= 1 or v is None or v == float("inf") or not sum(trainer.num_val_batches or [0]):
        return
    v = int(v)
    per_epoch = trainer.check_val_every_n_epoch is not None
    if n == float("inf"):  # no epoch length: cycles run over the whole stream
        bad = [v] if v % k else []
    elif per_epoch:  # validation after batches v, 2v, ... of every epoch
        bad = [p for p in range(v, int(n) + 1, v) if p % k and p != n][:1]
    else:  # after training batches v, 2v, ... of the run; the cycle count restarts every epoch
        n = int(n)
        for j in range(1, n // math.gcd(v, n) + 1):
            p = j * v % n
            if p and p % k:
                bad = [j * v]
                break
        else:
            bad = []
    # the run ends after max_steps optimizer steps: at most max_steps * k training batches (fewer where an epoch's
    # last cycle is short); a schedule whose first bad validation lies beyond them never meets it
    max_steps = getattr(trainer, "max_steps", -1)
    if not bad or (max_steps is not None and max_steps >= 0 and bad[0] > max_steps * k):
        return
    fix = f"give val_check_interval a multiple of {k}" if n == float("inf") or per_epoch or int(n) % k == 0 else (
        f"the {int(n)} training batches of an epoch are not a multiple of {k} either, so give val_check_interval a "
        f"multiple of {int(n)} or set trainer.limit_train_batches to a multiple of {k}")
    raise ValueError(f"trainer.val_check_interval={trainer.val_check_interval} counts training batches, not optimizer "
                     f"steps: with accumulate_grad_batches={k} validation and its checkpoints would fall inside a "
                     f"gradient-accumulation cycle (first after training batch {bad[0]}), whose half-summed gradient "
                     f"a checkpoint cannot hold; {fix}")


class SplitLoaders:
    """Mixin (before the datamodule base) for datamodules whose three loaders differ only by split:
    subclasses implement :meth:`split_loader`; ``train_dataloader``, ``val_dataloader`` and
    ``test_dataloader`` call it with ``"train"``, ``"val"`` and ``"test"``."""

    def split_loader(self, split: str) -> DataLoader:
        """The loader of ``split`` (``"train"``: shuffled and resumable; ``"val"``/``"test"``: in order)."""
        raise NotImplementedError(f"{type(self).__name__} must implement split_loader(split)")

    def train_dataloader(self) -> DataLoader:
        return self.split_loader("train")

    def val_dataloader(self) -> DataLoader:
        return self.split_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self.split_loader("test")


class ResumableDataModule(pl.LightningDataModule):
    """LightningDataModule base for map-style data: rank-split loaders and exact resume.

    :meth:`resumable_loader` builds every loader on a :class:`ResumableSampler` (rank ``r``
    of ``W`` reads items ``r::W`` of one seeded order; DataLoader workers only fetch what the
    sampler yields, so the split by worker is implicit and never duplicates an item).
    Training: a new permutation per epoch, the ``n % W`` tail dropped so ranks stay even.
    Evaluation: dataset order, every item exactly once (uneven ranks) outside a trainer and
    under DDP with ``broadcast_buffers: false`` (``configs/trainer/ddp.yaml``); under any
    other multi-process strategy (FSDP, DDP broadcasting buffers) the forward is collective,
    so ranks are padded to even counts with up to ``W - 1`` repeated items (no hang).

    :meth:`state_dict` returns ``{"train_sampler": {"epoch", "seed", "position",
    "num_replicas", "length"}}`` (``{}`` before a train loader exists or outside a
    trainer); Lightning stores it in every checkpoint under the datamodule's class name,
    and :meth:`load_state_dict` makes the next train loader start at the first unseen
    sample. Subclasses call ``super().__init__()`` and do not override the two methods
    (extend them with ``super()`` if they need more state).

    A checkpoint whose training set or sample-order seed differs from this datamodule's (its
    data settings changed since) cannot continue its data order: the train loader raises a
    ``ValueError`` naming the options that differ between :attr:`checkpoint_hparams` and
    ``hparams`` (:func:`changed_data_options`), e.g. ``data.init_args.context_length: 256 in
    the checkpoint, 128 now; the checkpoint's dataset has 1000 items, this one 2000: the data
    settings changed since the checkpoint``; where none can be named (no record in the
    checkpoint, equal options), :class:`ResumableSampler`'s own message.
    """

    split_arguments: tuple[str, ...] = ()
    """Arguments that decide which sample falls into which split (a seeded fraction, a hash seed): ``validate`` /
    ``test`` of a checkpoint refuse other values than its run's (:func:`mixlab.cli.check_checkpoint_split`); empty
    where the splits are files."""

    _train_sampler: ResumableSampler | None = None
    _train_batch_size: int = 1
    _pending_sampler_state: dict[str, Any] | None = None
    checkpoint_hparams: dict[str, Any] | None = None
    """The datamodule arguments recorded in the checkpoint being resumed (set by
    :meth:`mixlab.heads.common.Head.on_load_checkpoint`; None: not resuming, or not recorded)."""

    def __getstate__(self) -> dict[str, Any]:
        """Pickle without the attached trainer (its model and optimizer need not pickle).

        DataLoader workers started by ``spawn`` or ``forkserver`` (the default start method
        from Python 3.14, and on some images before) pickle the dataset, and datasets that
        call back into their datamodule (e.g. :class:`~mixlab.datamodules.synthetic.GeneratedDataset`)
        pickle it too; a worker never needs the trainer.
        """
        state = self.__dict__.copy()
        state["trainer"] = None
        return state

    @staticmethod
    def order_seed(seed: int) -> int:
        """Seed of the sample order: the data seed and ``seed_everything``'s
        (``PL_GLOBAL_SEED``), so seed sweeps reshuffle too."""
        return int(seed) * 1_000_003 + int(os.environ.get("PL_GLOBAL_SEED", 0))

    def resumable_loader(self, dataset: Any, batch_size: int, train: bool, seed: int = 0,
                         num_workers: int = 0, drop_last: bool | None = None,
                         **loader_kwargs: Any) -> DataLoader:
        """DataLoader over ``dataset`` with a :class:`ResumableSampler` (see the class doc).

        Args:
            dataset: a sized map-style dataset.
            batch_size: per-device batch size (the train one also scales the saved position).
            train: shuffle per epoch, drop the rank tail and record the sampler for
                :meth:`state_dict` (a pending checkpoint state is applied here).
            seed: the datamodule's data seed (combined by :meth:`order_seed`).
            num_workers: DataLoader workers (``persistent_workers`` defaults to ``> 0``).
            drop_last: the DataLoader's (default ``train``: full batches only).
            loader_kwargs: other DataLoader arguments (``collate_fn``, ``pin_memory``...).

        Raises:
            ValueError: ``batch_size`` below 1 or ``num_workers`` outside ``[0, MAX_NUM_WORKERS]`` (named as the
                datamodule's options: :func:`check_num_workers`);
                a checkpoint state (``train``) whose dataset length or seed differs from this one, naming
                the options that differ from the checkpoint's (see the class doc).
        """
        check_at_least(batch_size=(batch_size, 1))
        check_num_workers(num_workers)
        sampler = ResumableSampler(dataset, shuffle=train, seed=self.order_seed(seed),
                                   drop_last=train, pad=not train and self._collective_forward())
        if train:
            self._train_sampler, self._train_batch_size = sampler, batch_size
            state, self._pending_sampler_state = self._pending_sampler_state, None
            self._restore_train_sampler(sampler, state)
        loader_kwargs.setdefault("persistent_workers", num_workers > 0)
        loader_kwargs.setdefault("generator", loader_generator(self.order_seed(seed)))
        loader_kwargs["worker_init_fn"] = worker_init_ignoring_sigterm(loader_kwargs.get("worker_init_fn"))
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                          drop_last=train if drop_last is None else drop_last,
                          num_workers=num_workers, **loader_kwargs)

    def _restore_train_sampler(self, sampler: ResumableSampler, state: dict[str, Any] | None) -> None:
        """:func:`restore_sampler`; a state of another dataset length or seed is refused naming the datamodule
        options that differ from the checkpoint's (:func:`changed_data_options`), else as the sampler says."""
        try:
            restore_sampler(sampler, state)
        except ValueError:
            if state is None:
                raise
            changed = changed_data_options(self.checkpoint_hparams, self.hparams)
            if state["length"] != len(sampler.dataset):
                why = f"the checkpoint's dataset has {state['length']} items, this one {len(sampler.dataset)}"
            elif state["seed"] != sampler.seed:  # the data seed, or seed_everything (not a data option)
                why = f"the checkpoint's sample-order seed is {state['seed']}, this one {sampler.seed}"
                changed = [c for c in changed if c.startswith("data.init_args.seed:")]
                if not changed:  # the same data seed: seed_everything differs (order_seed adds it)
                    now = int(os.environ.get("PL_GLOBAL_SEED", 0))
                    was = int(state["seed"]) - (int(sampler.seed) - now)
                    raise ValueError(f"seed_everything: the checkpoint's run shuffled its data with seed_everything "
                                     f"{was}, this command with {now}; resume with --seed_everything {was} (true "
                                     f"draws a new seed in every command)") from None
            else:  # e.g. a world size the position does not split over: not the data options
                raise
            if not changed:
                raise
            raise ValueError(f"{'; '.join(changed)}; {why}: the data settings changed since the checkpoint") \
                from None

    def _collective_forward(self) -> bool:
        """Whether the trainer's strategy may run a collective in every forward (then
        evaluation ranks need even batch counts): all but DDP with ``broadcast_buffers=False``
        (no trainer: ``False``; one process: padding is a no-op)."""
        from lightning.pytorch.strategies import DDPStrategy

        strategy = getattr(self.trainer, "strategy", None) if self.trainer is not None else None
        if strategy is None:
            return False
        return not (isinstance(strategy, DDPStrategy)
                    and strategy._ddp_kwargs.get("broadcast_buffers", True) is False)

    def state_dict(self) -> dict[str, Any]:
        """Train sampler (epoch, seed, position) for exact mid-epoch resume (saved in .ckpt)."""
        return sampler_state(self.trainer, self._train_sampler, self._train_batch_size)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the train sampler position saved by :meth:`state_dict` (next train loader)."""
        self._pending_sampler_state = state_dict.get("train_sampler")


LOADER_OPTIONS = frozenset({"batch_size", "num_workers", "pin_memory", "persistent_workers", "prefetch_factor",
                            "worker_nice"})
"""Datamodule options that shape the loaders, not the dataset (:func:`changed_data_options` names them only
when no other option differs)."""


def changed_data_options(before: dict[str, Any] | None, now: dict[str, Any] | None,
                         prefix: str = "data.init_args.") -> list[str]:
    """``["<prefix><option>: <value before> in the checkpoint, <value now> now", ...]`` for the datamodule
    options set on both sides with different values (nested dicts compared key by key, ``a.b``; lists and
    tuples alike; keys starting with ``_`` left out), in ``now``'s order. Options in
    :data:`LOADER_OPTIONS` only when nothing else differs. ``[]`` when either side is missing or nothing
    differs."""
    if not before or not now:
        return []

    def leaves(tree: Any, key: str = "") -> dict[str, Any]:
        if isinstance(tree, dict) and (tree or not key):
            out: dict[str, Any] = {}
            for k, v in tree.items():
                if not str(k).startswith("_"):
                    out.update(leaves(v, f"{key}.{k}" if key else str(k)))
            return out
        return {key: list(tree) if isinstance(tree, tuple) else tree}

    def show(value: Any) -> str:
        return repr(value) if isinstance(value, str) else str(value)

    def same(a: Any, b: Any) -> bool:
        try:
            return bool(a == b)
        except (TypeError, ValueError, RuntimeError):  # e.g. arrays: no single truth value
            return a is b

    was, is_ = leaves(dict(before)), leaves(dict(now))
    differ = [k for k in is_ if k in was and not same(was[k], is_[k])]
    differ = [k for k in differ if k.split(".")[0] not in LOADER_OPTIONS] or differ
    return [f"{prefix}{k}: {show(was[k])} in the checkpoint, {show(is_[k])} now" for k in differ]


# --------------------------------------------------------------------------- iterable data
def loader_generator(seed: int) -> torch.Generator:
    """A DataLoader's own generator, seeded from the data seed (its iterators draw their workers' base seed from
    it). Without one every iterator draws that seed from torch's global generator, so where a loader is created
    (a resume, a new epoch, a validation) would shift the numbers the model draws next (Mixup / CutMix, dropout,
    stochastic depth), which a checkpoint restores (:func:`mixlab.heads.common.rng_states`)."""
    return torch.Generator().manual_seed(int(seed) % 2**63)


def check_at_least(nullable: tuple[str, ...] = (), **limits: tuple[int | None, int]) -> None:
    """Refuse datamodule options below their least value: ``limits`` maps each option to ``(value, least)``;
    ``None`` is "not set" (the options in ``nullable`` say so in the message).

    Raises:
        ValueError: ``data.init_args.<name> must be >= <least>[ (or null)]; got <value>``, the first option out
            of range.
    """
    for name, (value, least) in limits.items():
        if value is not None and value < least:
            raise ValueError(f"data.init_args.{name} must be >= {least}{' (or null)' if name in nullable else ''}; "
                             f"got {value}")


MAX_SEED = 2**32 - 1
"""The largest data ``seed`` of every datamodule (:func:`check_seed`): the range of ``--seed_everything``; numpy
refuses negative seeds, and the sample order's seed (:meth:`ResumableDataModule.order_seed`) must stay in torch's
64-bit range."""
MAX_NUM_WORKERS = 64
"""The most DataLoader workers a datamodule accepts (:func:`check_num_workers`). Each worker is a process holding
its own copy of the dataset, and a persistent train and val loader each start theirs: ``num_workers 1000`` spent
minutes starting 2,000 processes before the first batch (64 start in about a second on 2 cores). A fixed number,
not one per CPU core, so a config, or a checkpoint's recorded data arguments that evaluation commands rebuild the
datamodule from, is accepted on every machine; more workers than cores only queue for them (torch warns)."""


def check_seed(seed: int, use: str = "seeds the split and the sample order") -> None:
    """Refuse a data ``seed`` outside ``[0, MAX_SEED]``; ``use`` says what the seed does (in the message).

    Raises:
        ValueError: ``seed must be in [0, 4294967295] (numpy seeds each sample with [seed, split, index]); got -1``.
    """
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be in [0, {MAX_SEED}] ({use}); got {seed}")


def check_num_workers(num_workers: int) -> None:
    """Refuse a ``num_workers`` below 0 or above :data:`MAX_NUM_WORKERS`.

    Raises:
        ValueError: ``data.init_args.num_workers must be >= 0; got -1``, or ``num_workers must be <= 64
            (DataLoader worker processes, each with its own copy of the dataset; this machine has 2 CPU cores);
            got 1000``.
    """
    check_at_least(num_workers=(num_workers, 0))
    if num_workers > MAX_NUM_WORKERS:
        raise ValueError(f"num_workers must be <= {MAX_NUM_WORKERS} (DataLoader worker processes, each with its own "
                         f"copy of the dataset; this machine has {os.cpu_count()} CPU cores); got {num_workers}")


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


def fit_progress(trainer: Any) -> tuple[int, int]:
    """``(epoch, batches)`` of a trainer's fit loop: the epoch Lightning passes to samplers'
    ``set_epoch`` (``fit_loop.epoch_progress.current.processed``) and the batches trained on in
    it (``fit_loop.epoch_loop.batch_progress.current.processed``, as :func:`sampler_state`);
    ``(0, 0)`` for ``trainer=None``."""
    if trainer is None:
        return 0, 0
    loop = trainer.fit_loop
    return int(loop.epoch_progress.current.processed), int(loop.epoch_loop.batch_progress.current.processed)


class EpochSyncLoader(DataLoader):
    """DataLoader for an iterable dataset with ``set_epoch(epoch)``: every ``iter()`` first calls
    ``dataset.set_epoch(epoch_fn())`` (skipped when ``epoch_fn`` is ``None`` or returns ``None``).

    Lightning calls ``set_epoch`` on samplers only, and an IterableDataset's DataLoader may not
    have a custom sampler, so a stream would never learn the epoch. Pass e.g.
    ``epoch_fn=lambda: fit_progress(dm.trainer)[0] if dm.trainer else None``. With
    ``persistent_workers`` the workers keep their own copy of the dataset: its ``set_epoch``
    must write to shared memory (a ``share_memory_()`` tensor) for them to see it.
    On resume Lightning may call ``iter()`` before it restores its loops (a model that reads
    ``trainer.estimated_stepping_batches``), so ``epoch_fn`` then still gives 0: a dataset with
    a loaded resume state must not go back to an earlier epoch (``ShardStream`` does not).
    Other arguments: :class:`torch.utils.data.DataLoader`'s.
    """

    def __init__(self, dataset: IterableDataset, *args: Any,
                 epoch_fn: Callable[[], int | None] | None = None, **kwargs: Any) -> None:
        super().__init__(dataset, *args, **kwargs)
        self.epoch_fn = epoch_fn

    def __iter__(self):
        epoch = self.epoch_fn() if self.epoch_fn is not None else None
        if epoch is not None:
            self.dataset.set_epoch(epoch)
        return super().__iter__()


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
