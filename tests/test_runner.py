"""The launcher of runs side by side (mixlab.eval.runner): commands start by priority, and a private CUDA MPS
daemon (checked with a stand-in ``nvidia-cuda-mps-control`` on the PATH that records its arguments, stdin and
MPS environment)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from mixlab.eval.runner import Launcher, MpsDaemon, _Slots

ROOT = Path(__file__).resolve().parents[1]


def _fake_binary(tmp_path: Path, rc: int = 0, say: str = "") -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / MpsDaemon.BINARY
    exe.write_text(f"""#!/bin/sh
stdin=$(cat </dev/null)
[ "$1" = "-d" ] || stdin=$(cat)
echo "args=$* stdin=$stdin pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >> {tmp_path}/calls.txt
echo "{say}"
exit {rc}
""")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def test_no_binary_auto_is_nothing_and_on_raises(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    d = MpsDaemon("auto")
    assert not d.running and d.env == {}
    with pytest.raises(RuntimeError, match="nvidia-cuda-mps-control is not on the PATH"):
        MpsDaemon("on")
    with pytest.raises(ValueError, match="mps must be 'auto', 'on' or 'off'; got 'maybe'"):
        MpsDaemon("maybe")


def test_daemon_started_for_the_launchers_commands_and_quit_on_close(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{_fake_binary(tmp_path)}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    launch = Launcher(3, {"OMP_NUM_THREADS": "1"}, timeout=60, cwd=tmp_path)
    try:
        env = launch.mps.env
        assert launch.mps.running and set(env) == {"CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"}
        assert all(Path(v).is_dir() and len(v) < 80 for v in env.values())  # short: Unix socket paths
        assert launch.env == {"OMP_NUM_THREADS": "1", **env}  # every command gets the pipe folder
        folder = Path(env["CUDA_MPS_PIPE_DIRECTORY"]).parent
    finally:
        launch.close()
    launch.close()  # idempotent
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert calls == [f"args=-d stdin= pipe={env['CUDA_MPS_PIPE_DIRECTORY']} log={env['CUDA_MPS_LOG_DIRECTORY']}",
                     f"args= stdin=quit pipe={env['CUDA_MPS_PIPE_DIRECTORY']} log={env['CUDA_MPS_LOG_DIRECTORY']}"]
    assert not folder.exists() and not launch.mps.running


def test_not_started_for_one_worker_off_or_an_mps_already_set(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{_fake_binary(tmp_path)}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    for launch in (Launcher(1, {}, 60, tmp_path), Launcher(4, {}, 60, tmp_path, mps="off")):
        assert not launch.mps.running
        launch.close()
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/tmp/somebody-elses")
    assert not MpsDaemon("auto").running
    assert not (tmp_path / "calls.txt").exists()


def test_failed_start_auto_warns_and_goes_on_on_raises(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", f"{_fake_binary(tmp_path, rc=1, say='permission denied')}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    assert not MpsDaemon("auto").running
    err = capsys.readouterr().err
    assert "no CUDA MPS daemon" in err and "failed: permission denied" in err
    with pytest.raises(RuntimeError, match="-d` failed: permission denied"):
        MpsDaemon("on")


def test_reproduce_mps_on_without_a_daemon_is_one_line(tmp_path, monkeypatch, capsys):
    from mixlab.eval.reproduce import main

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit) as e:
        main(["mesa", "--quick", "--only", "cg_iters", "--mps", "on", "--out", str(tmp_path / "out")])
    assert e.value.code == 2
    assert "--mps on: nvidia-cuda-mps-control is not on the PATH" in capsys.readouterr().err


def test_slots_go_to_the_highest_priority_then_the_earliest_waiter():
    import threading
    import time

    slots, got, threads = _Slots(1), [], []
    slots.acquire(0)  # held: everyone below waits
    for name, prio in (("a", 1), ("b", 3), ("c", 2), ("d", 3)):
        def take(name=name, prio=prio):
            slots.acquire(prio)
            got.append(name)
            slots.release()
        threads.append(threading.Thread(target=take))
        threads[-1].start()
        while len(slots._heap) < len(threads):  # queued in this order
            time.sleep(0.001)
    slots.release()
    for t in threads:
        t.join(10)
    assert got == ["b", "d", "c", "a"]


def test_cpu_seconds_counts_this_process_and_waited_children():
    import subprocess
    import sys
    import time

    from mixlab.eval.runner import cpu_seconds

    c0 = cpu_seconds()
    t = time.process_time()
    while time.process_time() - t < 0.2:  # busy: 0.2 s of CPU here
        pass
    subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\n"
                    "while time.process_time() - t < 0.3: pass"], check=True)  # 0.3 s in a waited child
    assert cpu_seconds() - c0 >= 0.45


def test_launcher_records_start_wall_and_cpu_seconds_per_command(tmp_path):
    import sys

    launch = Launcher(1, {"OMP_NUM_THREADS": "1"}, timeout=120, cwd=ROOT, mps="off")
    try:
        log = tmp_path / "bad.log"
        rc, text = launch(["reproduce", "nosuch"], log)
    finally:
        launch.close()
    assert rc == 2 and "invalid choice: 'nosuch'" in text
    t = launch.timing[str(log)]
    assert set(t) == {"start_s", "wall_s", "cpu_s"} and t["start_s"] >= 0 and t["wall_s"] >= 0  # 0.1 s steps
    if sys.version_info >= (3, 11):  # the forked path measures the command's CPU (imports are preloaded: ~0 here)
        assert isinstance(t["cpu_s"], float) and 0 <= t["cpu_s"] < 60
    else:
        assert t["cpu_s"] is None


def test_a_command_past_the_timeout_is_stopped_and_says_so(tmp_path):
    """The command stops itself at the launcher's timeout (not only its result is given up): exit status 124,
    a line in its log, and the slot is free again at once."""
    import time

    from mixlab.eval.runner import TIMED_OUT

    launch = Launcher(1, {"OMP_NUM_THREADS": "1"}, timeout=4, cwd=ROOT, mps="off")
    try:
        log = tmp_path / "long.log"
        argv = ["fit", "--config", "configs/reproduce/parity_deltanet_neg.yaml", "--trainer.max_steps", "100000",
                "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
                "--data.init_args.num_workers", "0", "--run_root", str(tmp_path / "runs")]
        rc, text = launch(argv, log)
        assert rc == TIMED_OUT and "stopped after the launcher's timeout of 4 s (--timeout)" in text
        assert launch.timing[str(log)]["wall_s"] < 60  # stopped, not waited for
        t0 = time.perf_counter()
        rc, text = launch(["reproduce", "nosuch"], tmp_path / "next.log")  # the one worker is free again
        assert rc == 2 and time.perf_counter() - t0 < 60
    finally:
        launch.close()
