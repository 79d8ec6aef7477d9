"""Scale-out and fault tolerance: trainer fragments, rank/worker data splits, exact resume, DDP.

The subprocess tests run ``python -m mixlab fit`` on a tiny genome config:
* kill-and-resume: SIGKILL after step 6 (checkpoint at step 4), ``--ckpt_path last``; the
  losses of steps 5..10 must equal an uninterrupted run bitwise, in the same TensorBoard run;
* DDP: two CPU processes (gloo) at batch B vs one process at batch 2B, losses to 1e-5.
"""
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from mixlab.cli import main
from mixlab.datamodules.genome import GenomeDataModule
from mixlab.distributed import (
    ResumableSampler,
    SeededStream,
    consumer_slice,
    stream_seed,
    worker_init_ignoring_sigterm,
    worker_skip,
)

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "configs" / "trainer"


# --------------------------------------------------------------------------- configs
@pytest.mark.parametrize("fragment", ["ddp.yaml", "fsdp.yaml"])
def test_trainer_fragment_parses_with_an_experiment(fragment, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", str(ROOT / "configs/genome/goat.yaml"), "--config",
              str(TRAINER / fragment), "--print_config"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "mixlab.heads.CausalLM" in out
    if fragment == "ddp.yaml":
        assert "find_unused_parameters: false" in out and "broadcast_buffers: false" in out
    else:
        assert "FSDPStrategy" in out and "- mixlab.backbone.Block" in out


def test_fsdp_fragment_wraps_backbone_blocks():
    import yaml
    from jsonargparse import ArgumentParser
    from lightning.pytorch.strategies import Strategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from mixlab.backbone import Block
    from mixlab.distributed import FSDPStrategy

    parser = ArgumentParser()
    parser.add_argument("--strategy", type=Strategy)
    cfg = yaml.safe_load((TRAINER / "fsdp.yaml").read_text())["trainer"]["strategy"]
    strategy = parser.instantiate(parser.parse_object({"strategy": cfg})).strategy
    assert isinstance(strategy, FSDPStrategy)
    policy = strategy.kwargs["auto_wrap_policy"]
    assert isinstance(policy, ModuleWrapPolicy) and policy._module_classes == {Block}


# --------------------------------------------------------------------------- map-style splits
def write_fasta(path: Path, n: int = 3000, seed: int = 0) -> Path:
    rng = random.Random(seed)
    seq = "".join(rng.choice("ACGT") for _ in range(n))
    path.write_text(">chrT test\n" + "\n".join(seq[i:i + 60] for i in range(0, n, 60)) + "\n")
    return path


@pytest.fixture(scope="module")
def genome(tmp_path_factory):
    fasta = write_fasta(tmp_path_factory.mktemp("fa") / "t.fa")
    dm = GenomeDataModule(fasta=str(fasta), context_length=15, region_size=64, val_fraction=0.2,
                          test_fraction=0.2, batch_size=4)
    dm.setup("fit")
    return dm


class Indexed(Dataset):
    """(index, item) pairs, to check which items a loader yields."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        return i, self.ds[i]


@pytest.mark.parametrize("split,train", [("train", True), ("val", False)])
def test_ranks_and_workers_cover_every_genome_sample_once(genome, split, train):
    ds = Indexed(genome.datasets[split])
    n, batch = len(ds), 4
    single = ResumableSampler(ds, num_replicas=1, rank=0, shuffle=train, seed=7, drop_last=train)
    single_order = list(single)
    seen, per_rank = [], []
    for r in range(2):
        sampler = ResumableSampler(ds, num_replicas=2, rank=r, shuffle=train, seed=7, drop_last=train)
        loader = DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=2, drop_last=False)
        idx = [i for b in loader for i in b[0].tolist()]
        for b in DataLoader(ds, batch_size=batch, sampler=sampler):  # values = dataset items
            for i, x in zip(b[0].tolist(), b[1]):
                assert torch.equal(x, ds.ds[i])
            break
        assert idx == single_order[r::2][:len(idx)] and len(idx) == len(sampler)
        per_rank.append(idx)
        seen += idx
    assert len(seen) == len(set(seen))  # no duplicates across ranks
    expected = set(single_order[: n - n % 2]) if train else set(range(n))
    assert set(seen) == expected  # training drops only the n % 2 tail; eval sees all once
    if train:  # rank r's batch k = items r::2 of the single-process batch k at batch 2B
        big = [single_order[k:k + 2 * batch] for k in range(0, 2 * batch * 3, 2 * batch)]
        for k in range(3):
            for r in range(2):
                assert per_rank[r][k * batch:(k + 1) * batch] == big[k][r::2]
    else:
        assert len(per_rank[0]) - len(per_rank[1]) == n % 2


def test_loader_workers_ignore_sigterm_so_the_main_process_can_save(genome):
    """A user test: ``kill -TERM`` to the whole process group (a cluster's preemption) killed the DataLoader
    workers first, and the main process died of "worker is killed by signal" before saving ``last.ckpt``.
    The datamodules' workers ignore SIGTERM and keep serving every batch."""
    import time

    from mixlab.distributed import _ignore_sigterm_then

    assert genome.train_dataloader().worker_init_fn.func is _ignore_sigterm_then  # every resumable_loader
    loader = DataLoader(list(range(16)), batch_size=2, num_workers=1, worker_init_fn=worker_init_ignoring_sigterm())
    it = iter(loader)
    first = next(it)
    worker = it._workers[0]
    subprocess.run(["kill", "-TERM", str(worker.pid)], check=True)  # sent by another process: ignored
    time.sleep(0.5)
    assert worker.is_alive()
    assert torch.cat([first, *it]).tolist() == list(range(16))


def test_a_worker_ignoring_sigterm_still_lets_the_main_process_exit(tmp_path):
    """CI hung after the suite's last test: at interpreter exit ``multiprocessing`` SIGTERMs the daemonic
    workers of a DataLoader iterator still alive and joins them, and workers ignoring every SIGTERM never
    ended. A SIGTERM from the main process ends the worker (exit code 0, as torch's own handler does)."""
    script = tmp_path / "keep_an_iterator.py"
    script.write_text(
        "from torch.utils.data import DataLoader\n"
        "from mixlab.distributed import worker_init_ignoring_sigterm\n"
        "loader = DataLoader(list(range(64)), batch_size=4, num_workers=2, persistent_workers=True,\n"
        "                    worker_init_fn=worker_init_ignoring_sigterm())\n"
        "it = iter(loader)\n"
        "print(next(it).tolist())\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[0, 1, 2, 3]" and "Error" not in done.stderr
    loader = DataLoader(list(range(8)), batch_size=2, num_workers=1, worker_init_fn=worker_init_ignoring_sigterm())
    it = iter(loader)
    next(it)
    worker = it._workers[0]
    os.kill(worker.pid, signal.SIGTERM)  # from this process, the worker's parent
    worker.join(timeout=30)
    assert worker.exitcode == 0
    it._shutdown_workers()


def test_plain_distributed_sampler_with_workers_covers_every_crop(genome):
    """What Lightning does by default for a map-style loader: DistributedSampler per rank;
    worker processes only fetch, so the split is by rank alone (tail padded)."""
    from torch.utils.data import DistributedSampler
    ds = Indexed(genome.train_dataset)
    seen = []
    for r in range(2):
        s = DistributedSampler(ds, num_replicas=2, rank=r, shuffle=True, seed=3)
        seen += [i for b in DataLoader(ds, batch_size=8, sampler=s, num_workers=2) for i in b[0].tolist()]
    assert set(seen) == set(range(len(ds))) and len(seen) - len(ds) == len(ds) % 2


def test_sampler_resume_and_world_size_change():
    ds = list(range(103))
    a = ResumableSampler(ds, num_replicas=2, rank=1, seed=5)
    a.set_epoch(3)
    full = list(a)
    state = a.state_dict(position=20)
    b = ResumableSampler(ds, num_replicas=2, rank=1, seed=5)
    b.load_state_dict(state)
    b.set_epoch(3)  # Lightning calls set_epoch with the same epoch: position kept
    assert list(b) == full[20:] and list(b) == full  # the position applies to one pass
    b.load_state_dict(state)
    b.set_epoch(4)  # a new epoch starts from its beginning
    assert len(list(b)) == len(full)
    one = ResumableSampler(ds, num_replicas=1, rank=0, seed=5)  # 2 ranks -> 1 rank
    one.load_state_dict(state)
    two_rank_prefix = set()
    for r in range(2):
        s = ResumableSampler(ds, num_replicas=2, rank=r, seed=5)
        s.set_epoch(3)
        two_rank_prefix |= set(list(s)[:20])
    rest = list(one)
    assert not two_rank_prefix & set(rest) and len(rest) == 103 - 40
    with pytest.raises(ValueError, match="do not split evenly"):
        ResumableSampler(ds, num_replicas=3, rank=0, seed=5).load_state_dict(
            {**state, "position": 1})
    with pytest.raises(ValueError, match="dataset has 103 items"):
        ResumableSampler(list(range(50)), seed=5).load_state_dict(state)


# --------------------------------------------------------------------------- iterable streams
class ShardIds(IterableDataset):
    def __init__(self, n_shards, rank, on_short="error"):
        self.n, self.rank, self.on_short = n_shards, rank, on_short

    def __iter__(self):
        yield from consumer_slice(self.n, rank=self.rank, world=2, on_short=self.on_short)


@pytest.mark.parametrize("n_shards", [4, 7])
def test_shards_split_by_rank_and_worker_exactly_once(n_shards):
    seen = []
    for r in range(2):
        seen += [int(x) for x in DataLoader(ShardIds(n_shards, r), batch_size=None, num_workers=2)]
    assert sorted(seen) == list(range(n_shards))


def test_fewer_shards_than_consumers_errors_or_resamples():
    with pytest.raises(ValueError, match=r"3 shard\(s\) for 4 consumers"):
        consumer_slice(3, rank=0, world=2, worker=1, num_workers=2)
    with pytest.raises(ValueError, match="3 shard"):  # inside a worker: no hang, an error
        list(DataLoader(ShardIds(3, 0), batch_size=None, num_workers=2))
    orders = [consumer_slice(3, rank=r, world=2, worker=w, num_workers=2, on_short="resample",
                             seed=1) for r in range(2) for w in range(2)]
    assert all(sorted(o) == [0, 1, 2] for o in orders)
    assert consumer_slice(3, rank=1, world=2, worker=0, num_workers=2, on_short="resample",
                          seed=1) == orders[2]  # deterministic


def test_stream_seeds_are_disjoint_and_resume_per_worker():
    assert len({stream_seed(0, e, g) for e in range(3) for g in range(64)}) == 192
    assert [worker_skip(7, w, 3) for w in range(3)] == [3, 2, 2]
    assert [worker_skip(0, w, 2) for w in range(2)] == [0, 0]

    def make(gen):
        return torch.randint(0, 1000, (3,), generator=gen)

    def batches(stream, workers):
        return [b for b in DataLoader(stream, batch_size=2, num_workers=workers)]

    full = batches(SeededStream(make, seed=3, batch_size=2, length=10), 2)  # 2 workers x 5 batches
    assert len(full) == 10
    flat = torch.cat(full).tolist()
    assert len({tuple(x) for x in flat}) == len(flat)  # workers draw different samples
    resumed = SeededStream(make, seed=3, batch_size=2, length=10)
    resumed.load_state_dict(SeededStream(make, 3, 2).state_dict(consumed_batches=3))
    rest = batches(resumed, 2)
    assert [b.tolist() for b in rest] == [b.tolist() for b in full[3:]]


# --------------------------------------------------------------------------- subprocess runs
CONFIG = """\
seed_everything: 0
trainer:
  max_steps: {max_steps}
  val_check_interval: 4
  check_val_every_n_epoch: null
  limit_val_batches: 1
  num_sanity_val_steps: 0
  log_every_n_steps: 1
  gradient_clip_val: 1.0
  enable_progress_bar: false
  enable_model_summary: false
  accelerator: cpu
  devices: 1
  callbacks:
  - class_path: steplog.StepLoss
    init_args: {{path: {log}, kill_at_step: {kill}}}
model:
  class_path: mixlab.heads.CausalLM
  init_args:
    vocab_size: 5
    backbone: {{d_model: 32, n_layers: 2, n_heads: 2, mixer: goat}}
    optim: {{lr: 1.0e-2, warmup_steps: 2}}
data:
  class_path: mixlab.datamodules.genome.GenomeDataModule
  init_args: {{fasta: {fasta}, context_length: 15, region_size: 64, batch_size: {batch},
               val_fraction: 0.2, test_fraction: 0.2}}
"""


def launch(tmp: Path, name: str, *extra: str, max_steps=10, kill=-1, batch=4) -> subprocess.Popen:
    fasta = tmp / "t.fa"
    if not fasta.exists():
        write_fasta(fasta)
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(CONFIG.format(max_steps=max_steps, log=tmp / f"{name}.log", kill=kill,
                                 fasta=fasta, batch=batch))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "helpers"),
                                                        os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "mixlab", "fit", "--config", str(cfg), "--run_root",
           str(tmp / "runs"), *extra]
    return subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finish(proc: subprocess.Popen, expect_rc=0) -> str:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == expect_rc, out[-4000:]
    return out


def losses(path: Path) -> dict[int, tuple[str, str]]:
    rows = [line.split() for line in path.read_text().splitlines()]
    return {int(step): (loss, batch_sum) for step, _, loss, batch_sum in rows}


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_continues_bitwise(tmp_path):
    (tmp_path / "ref").mkdir()
    ref = launch(tmp_path / "ref", "ref")
    run = tmp_path / "run"
    run.mkdir()
    killed = launch(run, "run", kill=6)  # checkpoint (last.ckpt) at step 4, killed at step 6
    finish(killed, expect_rc=-9)
    finish(ref)
    before = losses(run / "run.log.rank0")
    assert sorted(before) == list(range(1, 7))
    ckpts = list((run / "runs/genome/goat").glob("version_*/checkpoints/last.ckpt"))
    assert len(ckpts) == 1 and "version_0" in str(ckpts[0])
    state = torch.load(ckpts[0], weights_only=False)
    assert state["global_step"] == 4 and state["GenomeDataModule"]["train_sampler"]["position"] == 16
    (run / "run.log.rank0").rename(run / "killed.log.rank0")
    finish(launch(run, "run", "--ckpt_path", "last"))
    after, full = losses(run / "run.log.rank0"), losses(tmp_path / "ref" / "ref.log.rank0")
    assert sorted(after) == list(range(5, 11)) and sorted(full) == list(range(1, 11))
    for step in range(5, 11):  # same next batch (token sum) and bitwise-equal loss
        assert after[step] == full[step], step
    for step in range(1, 7):
        assert before[step] == full[step], step
    versions = sorted(p.name for p in (run / "runs/genome/goat").iterdir())
    assert versions == ["version_0"]  # the resumed run logs into the same TensorBoard run
    assert len(list((run / "runs/genome/goat/version_0").glob("events.out.tfevents*"))) == 2


@pytest.mark.slow
def test_ddp_two_cpu_processes_match_one_process_at_twice_the_batch(tmp_path):
    """gloo DDP via configs/trainer/ddp.yaml: mean of the two ranks' losses per step equals
    the single-process loss at batch 2B (same samples: rank r gets r::2 of each big batch)."""
    ddp = launch(tmp_path, "ddp", "--config", str(TRAINER / "ddp.yaml"), "--trainer.accelerator",
                 "cpu", "--trainer.devices", "2", "--trainer.strategy.init_args.process_group_backend",
                 "gloo", max_steps=3, batch=4)
    single = launch(tmp_path, "single", "--run_name", "single", max_steps=3, batch=8)
    finish(single)
    finish(ddp)
    ref = losses(tmp_path / "single.log.rank0")
    ranks = [losses(tmp_path / f"ddp.log.rank{r}") for r in range(2)]
    assert sorted(ref) == sorted(ranks[0]) == sorted(ranks[1]) == [1, 2, 3]
    for step in ref:
        mean = (float.fromhex(ranks[0][step][0]) + float.fromhex(ranks[1][step][0])) / 2
        assert mean == pytest.approx(float.fromhex(ref[step][0]), abs=1e-5, rel=0), step
        assert int(ranks[0][step][1]) + int(ranks[1][step][1]) == int(ref[step][1])  # same tokens


def test_fsdp_strategy_keeps_weight_decay_on_sharded_matrices(monkeypatch):
    """FSDP (use_orig_params) hands configure_optimizers 1-D shard views; the ndims recorded
    before wrapping keep matrices in the weight-decay group."""
    from lightning.pytorch.strategies import FSDPStrategy as LightningFSDP

    from mixlab.backbone import Backbone, BackboneConfig
    from mixlab.distributed import FSDPStrategy
    from mixlab.optim import param_groups

    model = Backbone(BackboneConfig(d_model=32, n_layers=1, n_heads=2, mixer="goat"))
    before = [[id(p) for p in g["params"]] for g in param_groups(model, 0.1)]

    def shard(self, m):  # stand-in for the wrap: flatten every parameter in place
        for p in m.parameters():
            p.data = p.data.flatten()
        return m

    monkeypatch.setattr(LightningFSDP, "_setup_model", shard)
    FSDPStrategy()._setup_model(model)
    assert all(p.ndim == 1 for p in model.parameters())
    after = [[id(p) for p in g["params"]] for g in param_groups(model, 0.1)]
    assert after == before and len(before[0]) > 0


def test_fsdp_clipping_goes_through_the_root_modules_global_norm():
    """Lightning's FSDP precision plugin refuses clipping by norm; the heads call the root FSDP
    module's ``clip_grad_norm_`` instead (any other strategy: Lightning's own clipping)."""
    from mixlab.backbone import BackboneConfig
    from mixlab.heads.lm import CausalLM

    model = CausalLM(vocab_size=5, backbone=BackboneConfig(d_model=16, n_layers=1, n_heads=2, mixer="nope"))
    calls = []

    class FSDPRoot:  # stands in for torch's FullyShardedDataParallel root module
        def clip_grad_norm_(self, max_norm):
            calls.append(("fsdp", max_norm))

    class Strategy:
        model = FSDPRoot()

    class FakeTrainer:
        strategy = Strategy()

    model._trainer = FakeTrainer()
    model.clip_gradients = lambda opt, gradient_clip_val=None, gradient_clip_algorithm=None: calls.append(
        ("lightning", gradient_clip_val, gradient_clip_algorithm))
    model.configure_gradient_clipping(None, 1.0, "norm")
    model.configure_gradient_clipping(None, 0.5, None)
    model.configure_gradient_clipping(None, 0.5, "value")  # by value: Lightning's path
    Strategy.model = object()  # DDP-like root without clip_grad_norm_
    model.configure_gradient_clipping(None, 1.0, "norm")
    assert calls == [("fsdp", 1.0), ("fsdp", 0.5), ("lightning", 0.5, "value"), ("lightning", 1.0, "norm")]
