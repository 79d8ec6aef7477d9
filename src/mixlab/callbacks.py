"""Callbacks shared by every head."""

from __future__ import annotations

import resource
import sys
import threading
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar

__all__ = ["ThroughputMemory", "MixerMetrics", "LastCheckpoint", "BestCheckpoint", "LossProgressBar"]


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory in GB: CUDA ``max_memory_allocated`` on GPU, process peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux
    return rss_kb / 1e6


def thread_schedstats(main_tid: int) -> dict[str, tuple[float, float]] | None:
    """Linux scheduler statistics of this process's threads (``/proc/self/task/<tid>/schedstat``): by thread id
    (as a string), seconds on a CPU and seconds runnable but waiting for one (the run queue: CPU contention); the
    training thread ``main_tid`` under the key ``"train"``. None where ``/proc`` has no such files (not Linux).
    Time a thread spends blocked (waiting for the GIL, a lock, the device, I/O) is in neither number."""
    import os

    out: dict[str, tuple[float, float]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run, wait = f.read().split()[:2]
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
        out["train" if tid == str(main_tid) else tid] = (int(run) / 1e9, int(wait) / 1e9)
    return out if "train" in out else None


class ThroughputMemory(pl.Callback):
    """Logs ``perf/tokens_per_s`` (``perf/<unit>_per_s`` for a head whose ``throughput_unit`` is another unit:
    ``images`` for the image classifier), ``perf/steps_per_s`` and ``perf/peak_mem_gb`` (GB) once per window of
    ``log_every_n_steps`` training steps (default: the trainer's ``log_every_n_steps``, so that every value
    reaches the logger).

    The rates are wall time over the window, from the start of its first step to the end of its last
    (the loader's waits between steps and epoch changes included; a window that validation interrupts is
    dropped). On CUDA the device is synchronised at the two ends of a window only, never inside it: a sync per
    step would stop the host from queueing the next step while the device runs this one, and with several
    runs sharing one GPU (``reproduce``) each waiting process would hold a CPU core. Tokens per batch come
    from the head's ``batch_tokens(batch)`` (falls back to ``batch.numel()``); they are host integers.

    The input side, per window: ``perf/data_wait_ms``, the mean host time between one step's end and the next
    step's start (fetching the batch, Lightning's transfer hooks and its own work between steps such as logging;
    timm's training script calls it data time);
    and for a datamodule with ``input_timings()`` (seconds so far by name, and ``batches``; ``ImageNetDataModule``'s
    prefetched device stage), each name's growth per batch as ``perf/input/<name>_ms``.

    The host's CPUs, per step of the window (Linux; :func:`thread_schedstats`): ``perf/host/train_cpu_ms``, the
    training thread's time on a CPU; ``perf/host/train_runqueue_ms``, its time runnable but waiting for a CPU;
    ``perf/host/train_blocked_ms``, the rest of the step's wall time (waiting for the GIL, the device, the loader,
    or CUDA's autograd thread, which runs the backward pass); ``perf/host/other_cpu_ms`` and
    ``perf/host/other_runqueue_ms``, the same two summed over the process's other threads (the device stage's,
    the loader's pin thread, autograd's; not the DataLoader worker processes). A step that waits for the GIL shows
    as blocked time of the training thread next to CPU time of the others.
    """

    def __init__(self, log_every_n_steps: int | None = None) -> None:
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"ThroughputMemory(log_every_n_steps={log_every_n_steps}): must be >= 1 or None")
        self.every = log_every_n_steps
        self._t0: float | None = None  # None: no window open
        self._tokens = 0
        self._steps = 0
        self._last_end: float | None = None  # the previous step's end (None: none, or validation since)
        self._wait, self._waits = 0.0, 0  # gaps between steps since the last log (seconds, count)
        self._input: dict[str, float] = {}  # the datamodule's input_timings() at the last log
        self._sched: dict[str, tuple[float, float]] | None = None  # thread_schedstats() at the window's start
        self._sched_t0 = 0.0  # time.perf_counter() then
        self.clock = time.perf_counter  # seconds (a test may replace it)

    def _sync(self, pl_module: pl.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._t0 = None  # the window that validation interrupts is dropped
        self._last_end = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        now = self.clock()  # before a window's opening sync: that wait is the device's, not the data's
        if self._last_end is not None:
            self._wait += now - self._last_end
            self._waits += 1
        if self._t0 is None:
            self._sync(pl_module)  # (the previous window's closing sync left little to wait for)
            self._t0, self._tokens, self._steps = now, 0, 0
            self._sched = thread_schedstats(threading.get_native_id())
            self._sched_t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._last_end = self._log_window(trainer, pl_module, batch)

    def _log_window(self, trainer, pl_module, batch) -> float:
        """Count the step into the open window and log the window at its last step; returns the step's end time
        (read after the window's sync when it logs)."""
        if self._t0 is None:
            return self.clock()
        fn = getattr(pl_module, "batch_tokens", None)
        self._tokens += fn(batch) if fn is not None else (batch.numel() if torch.is_tensor(batch) else 0)
        self._steps += 1
        if trainer.global_step % (self.every or trainer.log_every_n_steps or 1):
            return self.clock()
        self._sync(pl_module)
        now = self.clock()
        host = (time.perf_counter(), thread_schedstats(threading.get_native_id())) if self._sched else None
        dt = max(now - self._t0, 1e-9)
        unit = getattr(pl_module, "throughput_unit", "tokens")
        pl_module.log(f"perf/{unit}_per_s", self._tokens * trainer.world_size / dt)
        pl_module.log("perf/steps_per_s", self._steps / dt)
        pl_module.log("perf/peak_mem_gb", peak_memory_gb(pl_module.device))
        if self._waits:
            pl_module.log("perf/data_wait_ms", 1000 * self._wait / self._waits)
        self._wait, self._waits = 0.0, 0
        self._log_input(trainer, pl_module)
        self._log_host(pl_module, host)
        self._t0 = None
        return now

    def _log_host(self, pl_module, host: tuple[float, dict | None] | None) -> None:
        """``perf/host/*_ms`` per step of the window (see the class docstring), from :func:`thread_schedstats` at
        its start and ``host = (perf_counter, thread_schedstats)`` at its end; threads that started or ended within
        the window are left out."""
        before, self._sched = self._sched, None
        if host is None or host[1] is None or before is None or not self._steps:
            return
        dt, now = host[0] - self._sched_t0, host[1]
        per_step = 1000 / self._steps
        run, wait = (now["train"][k] - before["train"][k] for k in (0, 1))
        others = [k for k in now if k != "train" and k in before]
        pl_module.log("perf/host/train_cpu_ms", run * per_step)
        pl_module.log("perf/host/train_runqueue_ms", wait * per_step)
        pl_module.log("perf/host/train_blocked_ms", max(0.0, dt - run - wait) * per_step)
        pl_module.log("perf/host/other_cpu_ms", sum(now[k][0] - before[k][0] for k in others) * per_step)
        pl_module.log("perf/host/other_runqueue_ms", sum(now[k][1] - before[k][1] for k in others) * per_step)

    def _log_input(self, trainer, pl_module) -> None:
        """``perf/input/<name>_ms``: the datamodule's ``input_timings()`` since the last log, per batch."""
        fn = getattr(getattr(trainer, "datamodule", None), "input_timings", None)
        now = fn() if callable(fn) else {}
        before, self._input = self._input, dict(now)
        if any(v < before.get(k, 0.0) for k, v in now.items()):
            before = {}  # the counters restarted (a new loader): measured from their start
        batches = now.get("batches", 0.0) - before.get("batches", 0.0)
        if batches <= 0:
            return
        for name, seconds in now.items():
            if name != "batches":
                pl_module.log(f"perf/input/{name}_ms", 1000 * (seconds - before.get(name, 0.0)) / batches)


class MixerMetrics(pl.Callback):
    """Logs every mixer's :meth:`~mixlab.mixers.base.Mixer.extra_metrics` (e.g. Mesa's mean
    CG iterations per head) as ``<stage>/mixer/layer<i>/<key>``: per step in training
    (``train/``), as the mean over batches in validation and test."""

    def _log(self, pl_module: pl.LightningModule, stage: str) -> None:
        from mixlab.mixers.base import Mixer

        for name, mod in pl_module.named_modules():
            if not isinstance(mod, Mixer):
                continue
            metrics = mod.extra_metrics()
            layer = getattr(mod, "layer_idx", name)
            for key, value in metrics.items():
                pl_module.log(f"{stage}/mixer/layer{layer}/{key}", value.float(), on_step=stage == "train",
                              on_epoch=stage != "train", batch_size=1)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._log(pl_module, "train")

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._log(pl_module, "val")

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._log(pl_module, "test")


def final_validation(trainer: pl.Trainer) -> bool:
    """Whether ``fit`` is validating after its last training step (``max_steps`` reached, or the last batch of the
    last epoch). A stop there would leave that validation to a resume that has nothing left to train, which then
    never runs it (a user test): the interrupt handlers let it finish instead."""
    from lightning.pytorch.trainer.states import RunningStage

    if trainer.state.fn != "fit" or trainer.state.stage != RunningStage.VALIDATING or trainer.sanity_checking:
        return False
    steps = trainer.max_steps not in (None, -1) and trainer.global_step >= trainer.max_steps
    epochs = (trainer.max_epochs not in (None, -1) and trainer.current_epoch + 1 >= trainer.max_epochs
              and trainer.fit_loop.epoch_loop._num_ready_batches_reached())
    return bool(steps or epochs)


class LastCheckpoint(ModelCheckpoint):
    """``checkpoints/last.ckpt`` holding the NEWEST state, for ``--ckpt_path last``.

    Rewritten at every validation (at every train epoch end when validation runs once per
    epoch or not at all), at the end of training and on an interrupt (Ctrl-C, i.e.
    KeyboardInterrupt, which Lightning turns into exit status 1 after this callback ran), so a
    killed, interrupted or finished run resumes where it stopped. Lightning 2.6's
    ``ModelCheckpoint(save_last=True)`` rewrites ``last.ckpt`` only when its monitored top-k
    checkpoint is saved, i.e. when the metric improves. Keyword arguments go to
    :class:`~lightning.pytorch.callbacks.ModelCheckpoint` (``dirpath``, ``every_n_train_steps``, ...).
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(filename="last", save_top_k=1, enable_version_counter=False, **kwargs)
        #: the global step training started from in this process (after a resume's restore); None before
        self.start_step: int | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start_step = trainer.global_step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._batch_start_step = trainer.global_step

    def _mid_step(self, trainer: pl.Trainer) -> bool:
        """Whether an interrupt landed inside a training batch whose state no checkpoint can hold: its optimizer
        step taken (the weights moved, its loop bookkeeping not done), a half-summed gradient, or an epoch's first
        batch; or inside the last validation (:func:`final_validation`). A batch in flight before its optimizer
        step is saved as the end of the batch before it (:func:`mixlab.distributed.as_batch_end_checkpoint`)."""
        progress = trainer.fit_loop.epoch_loop.batch_progress.current
        if final_validation(trainer):  # saved, a resume would have nothing to train and never run it: rerun from
            return True                # the checkpoint before (the handlers let this validation finish instead)
        if trainer.validating or progress.started <= progress.processed:
            return False
        return (trainer.global_step != getattr(self, "_batch_start_step", trainer.global_step)
                or trainer.accumulate_grad_batches > 1 or progress.processed == 0)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._should_skip_saving_checkpoint(trainer):  # steps after the last save
            self._save_none_monitor_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """On Ctrl-C (KeyboardInterrupt) or SIGTERM (``kill``, a cluster's preemption: Lightning
        raises ``SIGTERMException`` at the next batch boundary) during ``fit``, save the steps done
        since the last save and say where on stderr (none done: say that nothing was saved). Other
        exceptions save nothing: the state may be the cause. An interrupt inside a training batch whose state no
        checkpoint can hold (:meth:`_mid_step`) saves nothing either: the line names the older step
        ``last.ckpt`` holds."""
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if not isinstance(exception, (KeyboardInterrupt, SIGTERMException)) or trainer.state.fn != "fit":
            return
        mid_step = self._mid_step(trainer)
        if (self.dirpath is not None and trainer.global_step > 0 and self._last_global_step_saved != trainer.global_step
                and not mid_step):
            self._save_none_monitor_checkpoint(trainer, self._monitor_candidates(trainer))
        what = getattr(trainer, "mixlab_stop_signal", None) or (
            "SIGTERM" if isinstance(exception, SIGTERMException) else "interrupted")
        if trainer.is_global_zero and self.dirpath is not None and self._last_global_step_saved > 0:
            print(f"mixlab: {what} at step {trainer.global_step}; {self.dirpath}/last.ckpt holds step "
                  f"{self._last_global_step_saved} (resume: the same command with --ckpt_path last)", file=sys.stderr)
        elif trainer.is_global_zero and trainer.global_step == 0 and (
                isinstance(exception, KeyboardInterrupt) or trainer.received_sigterm):  # (else mixlab's handler said)
            print(f"mixlab: {what} before the first training step ended; nothing saved", file=sys.stderr)


class BestCheckpoint(ModelCheckpoint):
    """The best checkpoint of a run: Lightning's ``ModelCheckpoint`` as the CLI's ``checkpoint`` group
    (``checkpoint.monitor``, ``checkpoint.mode``, ...; ``--ckpt_path best`` reads the file it keeps).

    Bad settings are one-line errors naming the option before any training step, where Lightning raised
    ``MisconfigurationException`` tracebacks: a ``mode`` other than ``min``/``max`` when it is built, a
    ``monitor`` that validation does not log at the first validation (the sanity check, which Lightning runs
    before training; else the first real one, after ``last.ckpt`` is written). Before any validation has run
    (a fit shorter than ``val_check_interval``, ``limit_val_batches: 0``) there is nothing to rank and nothing is
    kept, silently: Lightning warned that the monitored key was missing, in every short fit.

    Raises:
        ValueError: ``mode`` not ``min``/``max``; ``monitor`` not among the validation metrics.
    """

    def __init__(self, *args, mode: str = "min", **kwargs) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"checkpoint.mode must be 'min' or 'max'; got {mode!r}")
        super().__init__(*args, mode=mode, **kwargs)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        logged = trainer.callback_metrics
        if self.monitor is not None and self.monitor not in logged and any(k.startswith("val/") for k in logged):
            names = ", ".join(sorted(k for k in logged if k.startswith("val/")))
            raise ValueError(f"checkpoint.monitor {self.monitor!r} is not logged by validation; it logs {names}")
        super().on_validation_end(trainer, pl_module)

    def _save_topk_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict[str, torch.Tensor]) -> None:
        if self.monitor is not None and self.monitor not in monitor_candidates \
                and not trainer.fit_loop.epoch_loop.val_loop._has_run:
            return  # no validation yet: Lightning would warn and then keep nothing
        super()._save_topk_checkpoint(trainer, monitor_candidates)


class LossProgressBar(TQDMProgressBar):
    """Lightning's TQDM bar with ``train/loss`` shown without making the host wait for the device.

    A metric logged with ``prog_bar=True`` is read to a Python number after every training step (Lightning's
    logger connector), a device sync per step that stops the host from queueing the next step while the device
    runs this one. So the heads log ``train/loss`` without ``prog_bar`` and this bar shows it: at each refresh
    it starts a non-blocking copy of the newest ``train/loss`` (``trainer.callback_metrics``) into pinned host
    memory and shows the newest copy that has completed (a CUDA event query, never a wait): the number shown
    is at most a refresh or two old. On the CPU the value is read directly. ``mixlab``'s CLI adds this bar
    when the progress bar is on and no other progress bar is configured."""

    def __init__(self, refresh_rate: int = 1, leave: bool = False) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=leave)
        self._pending: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        self._shown: float | None = None
        self._epoch_bar = False

    def on_train_start(self, *args) -> None:
        super().on_train_start(*args)
        self._epoch_bar = False

    def on_train_epoch_start(self, trainer: pl.Trainer, *args) -> None:
        super().on_train_epoch_start(trainer, *args)
        self._epoch_bar = True

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        """A resume inside an epoch: Lightning skips ``on_train_epoch_start``, so the bar read ``Training: 305/?``
        with a rate counted from batch 0 (a user test). Set it up as that hook would, starting at ``batch_idx``."""
        if self._epoch_bar or self.train_progress_bar is None:
            return
        self._epoch_bar = True
        bar = self.train_progress_bar
        bar.reset()
        total = trainer.num_training_batches
        if trainer.max_epochs == -1 and trainer.max_steps is not None and trainer.max_steps > 0:  # as Lightning's bar,
            total = min(total, batch_idx + trainer.max_steps - trainer.global_step)  # counted from the epoch's start
        bar.total = None if total == float("inf") else total
        bar.initial = bar.n = batch_idx  # the rate counts the batches of this process only
        bar.set_description(f"Epoch {trainer.current_epoch}")

    def _loss(self, trainer: pl.Trainer) -> float | None:
        loss = trainer.callback_metrics.get("train/loss")
        if torch.is_tensor(loss) and loss.device.type == "cuda":
            while self._pending and self._pending[0][1].query():
                self._shown = float(self._pending.pop(0)[0])  # a completed copy: host memory
            if len(self._pending) < 4:
                buf = torch.empty((), dtype=torch.float32, pin_memory=True)
                buf.copy_(loss.detach().float(), non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._pending.append((buf, event))
        elif loss is not None:  # a host tensor or number
            self._shown = float(loss)
        return self._shown

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict:
        items = super().get_metrics(trainer, pl_module)
        if trainer.training:
            loss = self._loss(trainer)
            if loss is not None:
                items["train/loss"] = f"{loss:.3g}"
        return items
