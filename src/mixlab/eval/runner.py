"""Run many ``python -m mixlab ...`` commands side by side (GPU run matrix, ``reproduce``).

Each command runs in its own fresh process, as a user's would, but forked from a server process
that has already imported torch, Lightning and mixlab, which saves about ten seconds of imports
per command (before Python 3.11: plain ``python -m mixlab`` subprocesses). Several small runs
share one GPU well; :class:`Launcher` bounds how many run at once.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

__all__ = ["Launcher", "run_cli"]

_PRELOAD = ["torch", "lightning.pytorch", "mixlab.cli", "mixlab.heads", "mixlab.mixers", "mixlab.datamodules"]


def run_cli(argv: list[str], log: str, env: dict[str, str], cwd: str) -> int:
    """``python -m mixlab <argv>`` in this process with stdout and stderr sent to ``log``.

    Returns the exit status: 0, the ``SystemExit`` code (2 for a one-line bad-input error), or 1
    for any other exception (its traceback goes to the log).
    """
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
    from mixlab.cli import main

    try:
        main(argv)
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - a crash is a result here
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


class Launcher:
    """Runs CLI commands, at most ``workers`` at once, each in a fresh (forked, preloaded) process.

    Args:
        workers: processes at a time.
        env: environment of every command (e.g. ``OMP_NUM_THREADS``, ``MIXLAB_FLA_AUTOTUNE``).
        timeout: seconds per command; a command past it counts as exit status 124.
        cwd: working directory of the commands (config paths are relative to it).
    """

    def __init__(self, workers: int, env: dict[str, str], timeout: float, cwd: str | Path = ".") -> None:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        self.env, self.timeout, self.cwd, self.pool = dict(env), timeout, str(Path(cwd).resolve()), None
        if sys.version_info >= (3, 11):
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(_PRELOAD)
            self.pool = ProcessPoolExecutor(workers, mp_context=ctx, max_tasks_per_child=1)

    def __call__(self, argv: list[str], log: str | Path) -> tuple[int, str]:
        """Run ``python -m mixlab <argv>``; returns (exit status, its output)."""
        log = Path(log)
        log.parent.mkdir(parents=True, exist_ok=True)
        if self.pool is not None:
            try:
                rc = self.pool.submit(run_cli, argv, str(log), self.env, self.cwd).result(timeout=self.timeout)
            except FutureTimeout:
                rc = 124
            except Exception as e:  # noqa: BLE001 - e.g. the child died (BrokenProcessPool)
                rc = 1
                with open(log, "a") as f:
                    f.write(f"\n{type(e).__name__}: {e}\n")
        else:
            try:
                with open(log, "w") as f:
                    rc = subprocess.run([sys.executable, "-m", "mixlab", *argv], cwd=self.cwd, env=self.env, stdout=f,
                                        stderr=subprocess.STDOUT, timeout=self.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        return rc, log.read_text(errors="replace") if log.exists() else ""

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
