"""Run many ``python -m mixlab ...`` commands side by side (GPU run matrix, ``reproduce``).

Each command runs in its own fresh process, as a user's would, but forked from a server process
that has already imported torch, Lightning and mixlab, which saves about ten seconds of imports
per command (before Python 3.11: plain ``python -m mixlab`` subprocesses). Several small runs
share one GPU well; :class:`Launcher` bounds how many run at once, and on a CUDA machine with the
CUDA MPS control binary it starts a private MPS server for them (:class:`MpsDaemon`).
"""

from __future__ import annotations

import atexit
import heapq
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

__all__ = ["Launcher", "MpsDaemon", "run_cli", "cpu_seconds", "TIMED_OUT", "CommandTimeout"]

_PRELOAD = ["torch", "lightning.pytorch", "mixlab.cli", "mixlab.heads", "mixlab.mixers", "mixlab.datamodules"]


def cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and of its waited-for children (DataLoader workers)."""
    import resource

    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


#: exit status of a command stopped by the launcher's ``timeout`` (as coreutils ``timeout``)
TIMED_OUT = 124


class CommandTimeout(BaseException):
    """Raised in a command's process when its wall-time limit (the launcher's ``timeout``) is reached; a
    ``BaseException`` (as ``KeyboardInterrupt``), so that no ``except Exception`` on the way swallows it."""


def run_cli(argv: list[str], log: str, env: dict[str, str], cwd: str,
            timeout: float | None = None) -> tuple[int, float]:
    """``python -m mixlab <argv>`` in this process with stdout and stderr sent to ``log``.

    ``timeout`` (seconds): a ``SIGALRM`` timer stops the command (Lightning tears the run down: DataLoader
    workers end, checkpoints already written stay), a line in the log says so, and the status is
    :data:`TIMED_OUT`.

    Returns (exit status, CPU seconds): the status is 0, the ``SystemExit`` code (2 for a one-line
    bad-input error), :data:`TIMED_OUT`, or 1 for any other exception (its traceback goes to the log); the CPU
    seconds are :func:`cpu_seconds` at the end (this process is a fresh fork: its count starts near zero).
    """
    import signal
    import traceback

    import torch

    os.environ.update(env)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    os.chdir(cwd)
    sys.argv = ["python -m mixlab", *argv]  # as typed by a user (LightningCLI reads sys.argv: no args= warning)
    from mixlab.cli import main

    def expire(signum, frame):
        raise CommandTimeout(f"mixlab: stopped after the launcher's timeout of {timeout:g} s (--timeout)")

    if timeout is not None:
        signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        main()
        rc = 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except CommandTimeout as e:
        print(f"\n{e}", file=sys.stderr)
        rc = TIMED_OUT
    except BaseException:  # noqa: BLE001 - a crash is a result here
        traceback.print_exc()
        rc = 1
    finally:
        if timeout is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
        sys.stdout.flush()
        sys.stderr.flush()
    return rc, cpu_seconds()


class MpsDaemon:
    """A private CUDA MPS (Multi-Process Service) control daemon for the commands of one :class:`Launcher`.

    Without MPS the GPU time-slices between the processes' contexts, so the small kernels of many runs
    cannot overlap, and a process waiting for its kernels holds a CPU core. Measured on one H200 with 16
    CPU cores, 24 MAD runs side by side (4 mixers x 6 tasks, 60 s of training each, BENCHMARKS.md
    "Twelfth session"): 274 training steps/s in all without MPS, 465 with it (1.70x).

    The daemon gets its own pipe and log folders (a fresh ``/tmp/mixlab-mps-*``; Unix socket paths must be
    short), and only processes whose environment holds :attr:`env` (``CUDA_MPS_PIPE_DIRECTORY``,
    ``CUDA_MPS_LOG_DIRECTORY``) use it; other processes on the GPU are unaffected. Caveat (NVIDIA's MPS
    documentation): a fatal GPU fault in one client (an illegal memory access) also ends the other clients
    on that GPU; ``--mps off`` isolates the runs.

    Args:
        mode: ``"auto"`` (start when ``nvidia-cuda-mps-control`` is on the PATH and no MPS pipe folder is
            set in the environment already; silently nothing otherwise), ``"on"`` (start or raise), ``"off"``.

    Raises:
        ValueError: unknown ``mode``.
        RuntimeError: ``mode="on"`` and the daemon cannot be started (names the binary and its output).
    """

    BINARY = "nvidia-cuda-mps-control"
    MODES = ("auto", "on", "off")

    def __init__(self, mode: str = "auto") -> None:
        if mode not in self.MODES:
            raise ValueError(f"mps must be 'auto', 'on' or 'off'; got {mode!r}")
        #: environment the clients need (empty when no daemon runs)
        self.env: dict[str, str] = {}
        self._dir: str | None = None
        self._binary = binary = shutil.which(self.BINARY)
        if mode == "off" or (mode == "auto" and (binary is None or "CUDA_MPS_PIPE_DIRECTORY" in os.environ)):
            return
        if binary is None:
            raise RuntimeError(f"{self.BINARY} is not on the PATH (CUDA MPS comes with the NVIDIA driver)")
        self._dir = tempfile.mkdtemp(prefix="mixlab-mps-")
        env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(self._dir, "pipe"),
               "CUDA_MPS_LOG_DIRECTORY": os.path.join(self._dir, "log")}
        for d in env.values():
            os.mkdir(d)
        try:
            res = subprocess.run([binary, "-d"], env={**os.environ, **env}, capture_output=True, text=True, timeout=30)
            ok = res.returncode == 0
            why = (res.stdout + res.stderr).strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            ok, why = False, str(e)
        if not ok:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
            if mode == "on":
                raise RuntimeError(f"`{binary} -d` failed: {why or 'no output'}")
            print(f"mixlab: no CUDA MPS daemon (`{binary} -d` failed: {why or 'no output'}); runs time-slice the GPU",
                  file=sys.stderr)
            return
        self.env = env
        atexit.register(self.close)  # also on an exception or Ctrl-C in the launching process

    @property
    def running(self) -> bool:
        return bool(self.env)

    def close(self) -> None:
        """Stops the daemon (``quit`` on its control pipe; the server exits once its clients have) and removes
        its folders. Idempotent."""
        if not self.env:
            return
        try:
            subprocess.run([self._binary], input="quit\n", env={**os.environ, **self.env}, capture_output=True,
                           text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            pass
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self.env, self._dir = {}, None


class _Slots:
    """``n`` slots handed out by priority: :meth:`acquire` blocks until a slot is free and no waiter of a
    higher priority (then earlier arrival) is waiting."""

    def __init__(self, n: int) -> None:
        self._free, self._cond, self._heap, self._seq = n, threading.Condition(), [], itertools.count()

    def acquire(self, priority: float) -> None:
        with self._cond:
            key = (-priority, next(self._seq))
            heapq.heappush(self._heap, key)
            self._cond.wait_for(lambda: self._free > 0 and self._heap[0] == key)
            heapq.heappop(self._heap)
            self._free -= 1
            self._cond.notify_all()

    def release(self) -> None:
        with self._cond:
            self._free += 1
            self._cond.notify_all()


class Launcher:
    """Runs CLI commands, at most ``workers`` at once, each in a fresh (forked, preloaded) process.

    Args:
        workers: processes at a time.
        env: environment of every command (e.g. ``OMP_NUM_THREADS``, ``MIXLAB_FLA_AUTOTUNE``).
        timeout: seconds per command; a command past it is stopped (exit status :data:`TIMED_OUT`, 124, and a
            line in its log).
        cwd: working directory of the commands (config paths are relative to it).
        mps: CUDA MPS for the commands (:class:`MpsDaemon`: ``"auto"``, ``"on"``, ``"off"``); ``auto`` starts it
            only for more than one worker.

    Raises:
        ValueError, RuntimeError: from :class:`MpsDaemon`.
    """

    def __init__(self, workers: int, env: dict[str, str], timeout: float, cwd: str | Path = ".",
                 mps: str = "auto") -> None:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        self.mps = MpsDaemon("off" if mps == "auto" and workers < 2 else mps)
        self.env, self.timeout, self.cwd, self.pool = {**env, **self.mps.env}, timeout, str(Path(cwd).resolve()), None
        self.slots = _Slots(workers)
        #: per log file: ``start_s`` (seconds after this launcher was made), ``wall_s`` and ``cpu_s`` (the
        #: command's CPU seconds with its DataLoader workers; None on the subprocess path before Python 3.11)
        self.timing: dict[str, dict[str, float | None]] = {}
        self._t0 = time.perf_counter()
        if sys.version_info >= (3, 11):
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(_PRELOAD)
            self.pool = ProcessPoolExecutor(workers, mp_context=ctx, max_tasks_per_child=1)

    def __call__(self, argv: list[str], log: str | Path, priority: float = 0.0) -> tuple[int, str]:
        """Run ``python -m mixlab <argv>`` once one of the ``workers`` slots is free; returns (exit status, its
        output). Waiting commands start by ``priority``, highest first (then in call order): ``reproduce``
        passes a run's steps, so the longest runs start first and the suite's wall time is not set by a long
        run started last. The ``timeout`` counts from the start of the command's process (the first command
        also waits for the server's preloaded imports before it). :attr:`timing` gets the command's start, wall
        and CPU seconds under ``str(log)``."""
        log = Path(log)
        log.parent.mkdir(parents=True, exist_ok=True)
        self.slots.acquire(priority)
        start = time.perf_counter()
        try:
            rc, cpu = self._run(argv, log)
        finally:
            self.slots.release()
        self.timing[str(log)] = {"start_s": round(start - self._t0, 1),
                                 "wall_s": round(time.perf_counter() - start, 1),
                                 "cpu_s": None if cpu is None else round(cpu, 1)}
        return rc, log.read_text(errors="replace") if log.exists() else ""

    def _run(self, argv: list[str], log: Path) -> tuple[int, float | None]:
        cpu = None
        if self.pool is not None:
            try:
                # the command stops itself at `timeout` (run_cli); the grace covers its teardown
                rc, cpu = self.pool.submit(run_cli, argv, str(log), self.env, self.cwd,
                                           self.timeout).result(timeout=self.timeout + 120)
            except FutureTimeout:
                rc = TIMED_OUT
            except Exception as e:  # noqa: BLE001 - e.g. the child died (BrokenProcessPool)
                rc = 1
                with open(log, "a") as f:
                    f.write(f"\n{type(e).__name__}: {e}\n")
        else:
            try:
                with open(log, "w") as f:
                    rc = subprocess.run([sys.executable, "-m", "mixlab", *argv], cwd=self.cwd, env=self.env, stdout=f,
                                        stderr=subprocess.STDOUT, timeout=self.timeout).returncode
            except subprocess.TimeoutExpired:  # the child is killed
                rc = TIMED_OUT
                with open(log, "a") as f:
                    f.write(f"\nmixlab: stopped after the launcher's timeout of {self.timeout:g} s (--timeout)\n")
        return rc, cpu

    def close(self) -> None:
        """Shuts the process pool down, then stops the MPS daemon if this launcher started one."""
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
        self.mps.close()
