"""What a training step makes the host wait for: ThroughputMemory's rates over windows of steps (two device
syncs per window, not two per step), ``train/loss`` never a progress-bar metric (Lightning reads those after every
step; LossProgressBar shows it without a wait), the ViT's label check on host tensors."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers.logger import Logger

from mixlab.backbone import BackboneConfig
from mixlab.callbacks import ThroughputMemory
from mixlab.datamodules.genome import GenomeDataModule
from mixlab.heads.lm import CausalLM
from mixlab.heads.vit import ImageClassifier


class _Record(Logger):
    name, version = "record", 0

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step=None):
        self.calls.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def _fit(tmp_path, cb: ThroughputMemory, max_steps: int, log_every: int, val_every: int | None = None,
         bar: bool = False, extra: list | None = None, input_timings=None) -> _Record:
    g = torch.Generator().manual_seed(0)
    fasta = tmp_path / "t.fa"
    fasta.write_text(">t\n" + "".join("ACGT"[int(i)] for i in torch.randint(0, 4, (1200,), generator=g)) + "\n")
    data = GenomeDataModule(fasta=str(fasta), context_length=16, batch_size=4, region_size=400, val_fraction=0.2,
                            test_fraction=0.2, train_stride=20)  # 5 training batches of 4 x 16 per epoch
    if input_timings is not None:
        data.input_timings = input_timings
    model = CausalLM(vocab_size=5, backbone=BackboneConfig(d_model=16, n_layers=1, n_heads=2, mixer="rope"))
    rec = _Record()
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=rec, enable_progress_bar=bar,
                         enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                         log_every_n_steps=log_every, callbacks=[cb, *(extra or [])],
                         **({"limit_val_batches": 0} if val_every is None else
                            {"val_check_interval": val_every, "check_val_every_n_epoch": None,
                             "limit_val_batches": 1}))
    trainer.fit(model, data)
    rec.trainer = trainer
    return rec


def test_rates_are_per_window_with_two_syncs_per_window(tmp_path):
    """log_every_n_steps 3, 9 steps (epochs of 5 batches: the windows cross an epoch change): values at steps
    3, 6, 9 (Lightning's 0-based steps 2, 5, 8), each over 3 steps of 4 x 16 scored tokens; a fake clock that
    advances 2 s per reading (the callback reads it once at each step's start and end) gives 10 s per window (its
    first start to its last end: 5 readings apart) and 2 s between one step's end and the next one's start
    (``perf/data_wait_ms``: 2000, over the window's 2 gaps and the one before it); 6 syncs in all."""
    cb = ThroughputMemory()
    ticks = itertools.count(0, 2.0)
    cb.clock = lambda: next(ticks)
    syncs = []
    cb._sync = lambda pl_module: syncs.append(1)
    rec = _fit(tmp_path, cb, max_steps=9, log_every=3)
    got = [(step, m["perf/tokens_per_s"], m["perf/steps_per_s"]) for step, m in rec.calls if "perf/tokens_per_s" in m]
    assert [step for step, _, _ in got] == [2, 5, 8]
    assert [v for _, tps, sps in got for v in (tps, sps)] == pytest.approx([3 * 64 / 10, 0.3] * 3)  # logged float32
    waits = [(step, m["perf/data_wait_ms"]) for step, m in rec.calls if "perf/data_wait_ms" in m]
    assert waits == [(2, 2000.0), (5, 2000.0), (8, 2000.0)]
    assert len(syncs) == 6
    assert not any(k.startswith("perf/input/") for _, m in rec.calls for k in m)  # no input_timings()
    assert all(m["perf/peak_mem_gb"] > 0 for _, m in rec.calls if "perf/peak_mem_gb" in m)


def test_a_datamodules_input_timings_are_logged_per_batch_of_each_window(tmp_path):
    """A datamodule with ``input_timings()`` (seconds so far, and ``batches``; ``ImageNetDataModule``'s device
    stage): each window logs the growth since the last log per batch, in ms. Here the stage took 10 ms per batch
    over the first 3 batches and 20 ms over the next 3; then the counters restart (a new loader: 10 ms over its 7
    batches), and the last window is measured from there (20 ms per batch over 2)."""
    readings = iter([{"stage": 0.03, "consumer_wait": 0.0, "batches": 3.0},
                     {"stage": 0.09, "consumer_wait": 0.003, "batches": 6.0},
                     {"stage": 0.01, "consumer_wait": 0.0, "batches": 7.0},  # restarted counters (a new loader)
                     {"stage": 0.05, "consumer_wait": 0.0, "batches": 9.0}])
    rec = _fit(tmp_path, ThroughputMemory(), max_steps=12, log_every=3, input_timings=lambda: next(readings))
    got = [(step, m["perf/input/stage_ms"], m["perf/input/consumer_wait_ms"]) for step, m in rec.calls
           if "perf/input/stage_ms" in m]
    assert [step for step, _, _ in got] == [2, 5, 8, 11] and not any("perf/input/batches_ms" in m for _, m in rec.calls)
    assert [v for _, a, b in got for v in (a, b)] == pytest.approx([10.0, 0.0, 20.0, 1.0, 10 / 7, 0.0, 20.0, 0.0])


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux /proc scheduler statistics")
def test_each_window_splits_the_training_threads_time_between_cpu_run_queue_and_blocked(tmp_path):
    """``perf/host/*``: per step, the training thread's CPU time, run-queue wait and blocked time add up to the
    step's wall time (1000 / steps_per_s ms); the process's other threads have their own CPU time. A thread that
    spins for 60 ms shows about that much CPU time in :func:`thread_schedstats`."""
    import threading

    from mixlab.callbacks import thread_schedstats

    class _SlowSteps(pl.Callback):  # 20 ms blocked per step: the few ms the windows' edges differ by stay small
        def on_train_batch_start(self, *args):
            time.sleep(0.02)

    rec = _fit(tmp_path, ThroughputMemory(), max_steps=6, log_every=3, extra=[_SlowSteps()])
    windows = [m for _, m in rec.calls if "perf/host/train_cpu_ms" in m]
    assert len(windows) == 2
    for m in windows:
        parts = m["perf/host/train_cpu_ms"] + m["perf/host/train_runqueue_ms"] + m["perf/host/train_blocked_ms"]
        assert m["perf/host/train_cpu_ms"] > 0 and min(m[k] for k in m if k.startswith("perf/host/")) >= 0, m
        assert parts == pytest.approx(1000 / m["perf/steps_per_s"], rel=0.25), m  # the rate's own window
    done = threading.Event()
    tid = []

    def spin():
        tid.append(str(threading.get_native_id()))
        t = time.thread_time()
        while time.thread_time() - t < 0.06:
            pass
        done.wait()

    worker = threading.Thread(target=spin)
    worker.start()
    while not tid:
        time.sleep(0.01)
    time.sleep(0.3)
    stats = thread_schedstats(threading.get_native_id())
    done.set()
    worker.join()
    assert stats is not None and "train" in stats and stats[tid[0]][0] >= 0.05, stats


def test_a_window_cut_by_validation_is_dropped(tmp_path):
    """Validation after every 4th batch: the window opened at batch 3 (0-based) is cut by the validation after
    it, so the next opens at batch 4 and closes at the logging step 5 over 2 steps; likewise the one opened at 6
    is cut after batch 7 and batch 8 logs alone. A fake clock advancing 1 s per reading, read at each step's start
    and end: a window of n steps lasts 2n - 1 s (3 steps: 5 s, 2 steps: 3 s, 1 step: 1 s)."""
    cb = ThroughputMemory()
    ticks = itertools.count(0, 1.0)
    cb.clock = lambda: next(ticks)
    rec = _fit(tmp_path, cb, max_steps=9, log_every=3, val_every=4)
    got = [(step, m["perf/steps_per_s"]) for step, m in rec.calls if "perf/steps_per_s" in m]
    assert [step for step, _ in got] == [2, 5, 8]
    assert [v for _, v in got] == pytest.approx([3 / 5, 2 / 3, 1.0])


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match=r"ThroughputMemory\(log_every_n_steps=0\)"):
        ThroughputMemory(0)


@pytest.mark.parametrize("bar", [False, True])
def test_train_loss_is_never_a_progress_bar_metric(tmp_path, bar):
    """Lightning would read it after every step; the logger still gets every step's value."""
    rec = _fit(tmp_path, ThroughputMemory(), max_steps=3, log_every=1, bar=bar)
    assert "train/loss" not in rec.trainer.progress_bar_metrics
    losses = [m["train/loss"] for _, m in rec.calls if "train/loss" in m]
    assert len(losses) == 3 and all(0 < v < 10 for v in losses)


def test_loss_progress_bar_shows_the_logged_loss(tmp_path):
    from mixlab.callbacks import LossProgressBar

    shown = []

    class _Bar(LossProgressBar):
        def get_metrics(self, trainer, pl_module):
            items = super().get_metrics(trainer, pl_module)
            shown.append((items.get("train/loss"), float(trainer.callback_metrics["train/loss"])))
            return items

    cb = ThroughputMemory()
    rec = _fit(tmp_path, cb, max_steps=3, log_every=1, bar=True, extra=[_Bar()])
    assert rec.trainer.progress_bar_callback.__class__ is _Bar
    assert shown and all(s == f"{v:.3g}" for s, v in shown)  # on the CPU: the newest value


def test_cli_adds_the_loss_bar_only_with_a_progress_bar(tmp_path):
    from mixlab.callbacks import LossProgressBar
    from mixlab.cli import MixlabCLI

    root = Path(__file__).resolve().parents[1]
    argv = ["--config", str(root / "configs/synthetic/parity.yaml"), "--run_root", str(tmp_path),
            "--trainer.enable_model_summary", "false", "--trainer.limit_val_batches", "0",
            "--model.init_args.backbone.d_model", "32", "--model.init_args.backbone.n_layers", "1",
            "--data.init_args.num_workers", "0", "--data.init_args.n_train", "64", "--data.init_args.batch_size", "8"]
    for on in ("true", "false"):
        cli = MixlabCLI(args=[*argv, "--trainer.enable_progress_bar", on], run=False)
        bars = [c for c in cli.trainer.callbacks if isinstance(c, pl.callbacks.ProgressBar)]
        assert [type(b) for b in bars] == ([LossProgressBar] if on == "true" else [])


def test_vit_label_check_reads_host_tensors_only():
    """Host labels are checked on every batch; a device batch's labels only the first time (a counted stand-in
    for a device tensor: its min/max reads are what would sync)."""
    from mixlab.heads.vit import ImageClassifier, vit_backbone

    model = ImageClassifier(10, 16, 4, position="nope", backbone=vit_backbone("nope", d_model=32, n_layers=1,
                                                                               n_heads=2, drop_path=0.0))
    with pytest.raises(ValueError, match=r"label out of range \[0, 10\): got \[0, 10\]"):
        model._check_labels(torch.tensor([0, 10]))
    model._check_labels(torch.tensor([0, 9]))  # host: checked again, passes

    class _Dev:
        device = torch.device("meta")
        reads = 0

        def numel(self):
            return 2

        def min(self):
            _Dev.reads += 1
            return torch.tensor(0)

        max = min

    model._labels_checked = False
    for _ in range(3):
        model._check_labels(_Dev())
    assert _Dev.reads == 2  # min and max of the first batch only


def test_constant_frequencies_are_built_on_the_device_under_compile(monkeypatch):
    """Under ``torch.compile`` the fixed frequency grids of GOAT and RoPE are built on the device inside the graph
    (a host-to-device copy there made the host wait once per layer and step), by the same functions that build
    the host grids; on the CPU the host grids themselves (``meta`` stands in for an accelerator)."""
    from mixlab.mixers.positions import GoatPrior, RotaryPositions, _goat_grid, _rope_inv_freq
    from mixlab.ops import goat as G

    goat, rope = GoatPrior(n_heads=2, head_dim=24, n_modes=4, axes=2), RotaryPositions(n_heads=2, head_dim=16)
    cpu = torch.device("cpu")
    assert goat._fixed_freqs_on(cpu) is goat._freqs_fixed and rope._inv_freq_on(cpu) is rope._inv_freq
    assert torch.equal(goat._freqs_fixed, torch.cat([G.geometric_frequencies(2, 10000.0)] * 2))
    assert torch.equal(rope._inv_freq, 10000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    assert torch.equal(_goat_grid((2, 2), 10000.0, cpu), goat._freqs_fixed)
    assert torch.equal(_rope_inv_freq(16, 10000.0, cpu), rope._inv_freq)
    goat.to("meta")
    outside = goat.freqs()
    assert goat.freqs() is outside  # outside a graph: one shared copy
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    a, b = goat.freqs(), goat.freqs()
    assert a is not b and a is not outside and a.device.type == "meta" and a.shape == (4,)  # built per trace
    r = rope._inv_freq_on(torch.device("meta"))
    assert r.device.type == "meta" and r.shape == (8,)


def test_goat_constant_frequencies_are_copied_to_the_device_once():
    """The fixed frequency grids reach an accelerator once, not in every forward (``meta`` stands in for it: the
    same tensor object comes back); on the CPU the host grid itself, with the reference values."""
    from mixlab.ops import goat as G

    a, b = G.geometric_frequencies(6, 10000.0, "meta"), G.geometric_frequencies(6, 10000.0, "meta")
    assert a is b and a.device.type == "meta" and a.dtype == torch.float64 and a.shape == (6,)
    want = 10000.0 ** (-torch.arange(6, dtype=torch.float64) / 5)
    assert torch.equal(G.geometric_frequencies(6, 10000.0), want)

    from mixlab.mixers.positions import GoatPrior

    pos = GoatPrior(n_heads=2, head_dim=16, n_modes=2)
    assert pos.log_freqs is None and pos.freqs() is pos._freqs_fixed
    pos.to("meta")
    assert pos.freqs() is pos.freqs() and pos.freqs().device.type == "meta"


def test_the_image_classifier_logs_images_per_s():
    """A user test: the ViT's ``perf/tokens_per_s`` counted images (21 steps/s x 32 = 678), not its 37 tokens each."""
    import types

    cb = ThroughputMemory()
    ticks = itertools.count(0, 2.0)
    cb.clock = lambda: next(ticks)
    logged = {}
    module = types.SimpleNamespace(throughput_unit=ImageClassifier.throughput_unit, device=torch.device("cpu"),
                                   batch_tokens=ImageClassifier.batch_tokens, log=logged.__setitem__)
    trainer = types.SimpleNamespace(global_step=1, log_every_n_steps=1, world_size=1)
    batch = (torch.zeros(32, 3, 24, 24), torch.zeros(32, dtype=torch.long))
    cb.on_train_batch_start(trainer, module, batch, 0)
    cb.on_train_batch_end(trainer, module, None, batch, 0)
    assert logged["perf/images_per_s"] == 32 / 2 and "perf/tokens_per_s" not in logged
