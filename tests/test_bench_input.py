"""scripts/bench_input.py --quick on CPU: synthetic shards, both decode modes, a well-formed Markdown table."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_bench_input_quick_writes_a_well_formed_table(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # DataLoader workers may import the script too
    import bench_input

    out = tmp_path / "bench.md"
    text = bench_input.main(["--quick", "--out", str(out), "--workdir", str(tmp_path / "data"), "--profile", "1",
                             "--profile-end-to-end", "2", "--decoders", "torchvision", "--decode-under-load"])
    assert out.read_text() == text
    lines = text.splitlines()
    assert lines[0].startswith("## Input pipeline vs model (20") and "- device: CPU only" in text
    assert "- command: `python scripts/bench_input.py --quick --out " in text and "synthetic: 48 JPEGs 64x48" in text
    pattern = re.search(r"; shards (\S+)\)", text).group(1)  # --workdir: where the shards are, to reuse them
    from mixlab.datamodules.imagenet import expand_shards

    assert pattern.startswith(str(tmp_path / "data")) and expand_shards(pattern), pattern
    head = lines.index("| pipeline | decode | workers | measured | img/s | ms/batch | note |")
    assert lines[head + 1] == "|---|---|---|---|---:|---:|---|"
    rows = []
    for line in lines[head + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 7, line
        ips = float(cells[4].replace(",", ""))
        assert math.isfinite(ips) and ips > 0, line
        rows.append(tuple(cells[:4]))
    assert rows[0][:2] == ("model", "-") and rows[0][3].startswith("tiny fwd+bwd+AdamW")
    measured = {(p, d, m) for p, d, _, m in rows}
    assert ("train", "cpu", "loader (decoded, augmented)") in measured
    assert ("val", "cpu", "loader (decoded, resized, cropped)") in measured  # evaluation is not augmented
    for split in ("train", "val"):
        for m in ("loader (bytes + parameters)", "loader + device stage", "device stage alone",
                  "loader + device stage, prefetched (2 ahead)"):
            assert (split, "gpu", m) in measured
    assert {("train", "cpu", "end to end (loader + model step)"),
            ("train", "gpu", "end to end (loader + device stage + model step)")} <= measured
    assert ("train", "gpu", "end to end, device stage prefetched (2 ahead)") in measured
    assert rows[1][:2] == ("model", "-") and rows[1][3].startswith("tiny evaluation forward")
    assert len(rows) == 17 and "PIL `draft`" in text
    decode_row = next(line for line in lines if "JPEG decode alone" in line)  # libjpeg-turbo equals PIL to 1-2 levels
    assert "| train | gpu, torchvision |" in decode_row and "host " in decode_row
    mx, mean = re.search(r"vs PIL: max (\d+), mean ([\d.e-]+) levels \(8 images\)", decode_row).groups()
    assert int(mx) <= 4 and float(mean) < 1 and "CPU device: torchvision's libjpeg-turbo" in decode_row
    loaded = next(line for line in lines if "JPEG decode next to training steps" in line)  # --decode-under-load
    step_ms, alone, speed = re.search(r"model step meanwhile ([\d.]+) ms against ([\d.]+) alone \(([\d.]+)x",
                                      loaded).groups()
    step_ms, alone, speed = float(step_ms), float(alone), float(speed)
    assert "| train | gpu, torchvision |" in loaded and step_ms > 0 and alone > 0
    assert re.search(r"(no decode|\d+ of \d+ decodes) over twice the median", loaded), loaded
    rounding = 0.005 + alone / step_ms * (0.05 / alone + 0.05 / step_ms)  # the printed 1- and 2-decimal values
    assert abs(speed - alone / step_ms) <= rounding + 1e-9
    # --profile: each split's device stage by phase (host time measured on the CPU; no kernels without a GPU)
    for split in ("train", "val"):
        at = lines.index(f"### Device stage profile, {split}, 1 calls on one held batch of 8")
        phases = lines.index("| phase | host ms/batch | device ms/batch |", at)
        got = [line.split("|")[1].strip() for line in lines[phases + 2:phases + 5]]
        assert got == ["stage/augment", "stage/crop_resize", "stage/decode"], got
        assert all(float(line.split("|")[2]) > 0 for line in lines[phases + 2:phases + 5])
        assert lines[phases + 6] == "(no accelerator kernels: the stage ran on cpu)"  # not an empty kernel table
    at = lines.index("### End-to-end profile, train, 2 steps (stage 2 ahead)")
    assert lines[at + 2] == "(no CUDA streams: the run is on cpu)"
    ops = int(re.search(r"ops per batch of 8: train \(gpu\) ([\d,]+) ", text).group(1).replace(",", ""))
    assert ops > 300 and "0 syncing" in text  # the ops inside the phase labels are counted (it read 1 once)


def test_end_to_end_rows_above_the_model_alone_are_flagged(monkeypatch):
    """An end-to-end rate above the model-alone rate is not a steady state (a model row slowed by a busy
    host, batches prepared during the warm-up): the row says so instead of printing e.g. 1538% silently."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_input

    assert bench_input.of_model(4583, 5568) == "82% of the model alone"
    assert bench_input.of_model(157 * 15, 157).startswith("1500% of the model alone (above the model alone: not a ")


def test_launch_ms_is_the_median_host_time_of_a_step_started_on_an_idle_device(monkeypatch):
    """The model row's host launch time: each step timed from a device sync to its return (a fake clock: the
    steps take 5, 9 and 7 ms), the median in milliseconds, the device synchronised before every step."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_input

    clock, syncs, shapes = [0.0], [], []
    costs = iter([0.005, 0.009, 0.007])

    def step(x, y):
        shapes.append((tuple(x.shape), tuple(y.shape)))
        clock[0] += next(costs)

    monkeypatch.setattr(bench_input.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(bench_input, "sync", lambda device: syncs.append(clock[0]))
    ms = bench_input.launch_ms(step, 4, 32, 10, bench_input.torch.device("cpu"))
    assert ms == pytest.approx(7.0)
    assert shapes == [((4, 3, 32, 32), (4,))] * 3
    assert syncs == pytest.approx([0.0, 0.005, 0.014, 0.021])  # before each step and after the last


def test_slow_decodes_counts_decodes_over_twice_the_median_and_the_allocator_calls_in_them(monkeypatch):
    """``--decode-under-load``'s slow decodes: over twice the median, with the decodes during which the caching
    allocator called cudaMalloc/cudaFree counted among them and among the others; no allocator off CUDA."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_input

    times = [20.0, 21.0, 19.0, 80.0, 125.0, 20.5, 41.0]  # median 21: 80, 125 are slow, 41 is not (< 42)
    allocs = [0, 2, 0, 1, 0, 0, 0]
    assert bench_input.slow_decodes(times, allocs) == (
        "2 of 7 decodes over twice the median (max 125.0 ms; cudaMalloc/cudaFree during 1 of them and 1 of the "
        "other 5)")
    assert bench_input.slow_decodes([10.0, 11.0, 12.0], [0, 0, 3]) == (
        "no decode over twice the median (cudaMalloc/cudaFree during 1 of 3)")
    assert bench_input.allocator_calls(bench_input.torch.device("cpu")) == 0


def test_kernel_overlap_counts_concurrent_stream_time(monkeypatch):
    """``--profile-end-to-end``'s arithmetic: per stream the union of its kernels' intervals, over all streams
    the union, and the overlap = the per-stream sum minus that union."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_input

    serial = bench_input.kernel_overlap([(7, 0, 10), (7, 5, 12), (13, 12, 20)])  # stream 7 busy 0-12, 13: 12-20
    assert serial == {7: 12.0, 13: 8.0, "union": 20.0, "overlap": 0.0}
    both = bench_input.kernel_overlap([(7, 0, 10), (13, 4, 6), (13, 8, 14), (7, 20, 21)])
    assert both == {7: 11.0, 13: 8.0, "union": 15.0, "overlap": 4.0}  # 4-6 and 8-10 ran side by side
    assert bench_input.kernel_overlap([]) == {"union": 0.0, "overlap": 0.0}


def test_bench_input_cli_rows_put_the_shards_run_next_to_random_tensors(tmp_path, monkeypatch, capsys):
    """``--cli-steps``: ``python -m mixlab fit`` of the ViT ImageNet config on the shards (here with half of each
    batch decoded in the workers) and on random tensors, each a row with its images/s and the ratios. With
    ``--no-loader`` only the model row and the CLI rows are measured (a device call fits them), each run is
    reported on stderr as it ends, and ``--out`` holds the final table."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_input

    tiny = ("--model.init_args.backbone.d_model=64 --model.init_args.backbone.n_layers=1 "
            "--model.init_args.backbone.n_heads=1 --trainer.precision=32")
    out = tmp_path / "report" / "bench_input.md"
    text = bench_input.main(["--quick", "--workdir", str(tmp_path / "data"), "--decode", "gpu", "--no-eval",
                             "--no-loader", "--cpu-decode-fraction", "0.5", "--cli-steps", "4", "--cli-args", tiny,
                             "--cli-stacks", "0.5", "--out", str(out)])
    table = [tuple(c.strip() for c in line.strip("|").split("|")) for line in text.splitlines()
             if line.startswith("| train") or line.startswith("| model")]
    assert [r[0] for r in table] == ["model", "train", "train"], table  # no loader or device-stage rows
    rows = {r for r in table if "through the CLI" in r[3]}
    assert {r[:4] for r in rows} == {("train", "-", "-", "through the CLI, random tensors (4 steps)"),
                                     ("train", "gpu, 50% in workers", "2", "through the CLI, shards (4 steps)")}
    for r in rows:
        # --quick's model row is timm's tiny ViT, not the config's: no ratio to it
        assert float(r[4].replace(",", "")) > 0 and "the model row is another model" in r[6], r
    assert any("x the CLI on random tensors" in r[6] for r in rows)
    err = capsys.readouterr().err
    assert "CLI fit on random tensors, run 1/1:" in err and "CLI fit on gpu, 50% in workers, run 1/1:" in err
    assert "model | - | - | tiny fwd+bwd+AdamW" in err  # rows on stderr as they are measured
    assert "the model row is tiny, the CLI fits train goat_imagenet.yaml's model: no ratio" in err
    assert out.read_text() == text and "partial" not in text
    # each fit's wall time split, and its main thread sampled every 0.5 s into report.stacks/
    assert text.count("CLI fit on ") == 2 and "startup ~" in text and "after step 3" in text, text
    # the input path's host ms per step from the fits' logs: the loop's wait between steps in both, the device
    # stage's prefetcher (decode gpu, prefetched on the CPU device) in the shards fit only
    assert text.count("input ms/step: between steps ") == 2 and text.count(", stage thread waiting for workers ") == 1
    stacks = sorted(p.name for p in (tmp_path / "report" / "bench_input.stacks").iterdir())
    assert stacks == ["gpu_50_in_workers-run1.txt", "random_tensors-run1.txt"], stacks
    assert text.count("  - main thread, sampled every 0.5 s") == 2
    assert re.search(r"\b0\.5(-[\d.]+)? s: ", text), text  # the first sample, alone or starting a run of equal ones


def test_bench_input_out_keeps_what_a_run_cut_short_measured(tmp_path, monkeypatch):
    """``--out`` is rewritten as rows and CLI fits end, so a run stopped during its second fit (a device call's
    time limit, Ctrl-C) leaves the model row and the first fit's images/s there, marked partial."""
    import pytest

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_input

    calls = []

    def fake_fit(args, run_root, from_step, stacks=None, gil_hold_ms=0.0, gil_profile=None, env=None):
        calls.append(args)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return 1234.0, 1200.0, 1300.0

    monkeypatch.setattr(bench_input, "cli_images_per_s", fake_fit)
    out = tmp_path / "b.md"
    with pytest.raises(KeyboardInterrupt):
        bench_input.main(["--quick", "--workdir", str(tmp_path / "data"), "--decode", "gpu", "--no-eval", "--no-loader",
                          "--cli-steps", "4", "--out", str(out)])
    text = out.read_text()
    assert "| model | - | - | tiny fwd+bwd+AdamW (random tensors) |" in text
    assert "- CLI fit on random tensors, run 1/1: 1,234 images/s (the model row is another model)" in text
    assert "(partial: the run has not finished)" in text and len(calls) == 2


def test_bench_input_cli_gil_hold_adds_random_tensor_fits_with_a_gil_holding_thread(tmp_path, monkeypatch):
    """``--cli-gil-hold MS ...``: one more random-tensor fit per value, its process wrapped so that a thread holds
    the GIL MS ms of every 50 ms, each a row with its ratio to the plain random-tensor fit; bad values are refused
    in one line; the wrapper runs the CLI (its ``--help`` here)."""
    import subprocess
    import sys

    import pytest

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_input

    calls = []

    def fake_fit(args, run_root, from_step, stacks=None, gil_hold_ms=0.0, gil_profile=None, env=None):
        calls.append(gil_hold_ms)
        return (2000.0 if gil_hold_ms else 4000.0), 1000.0, 5000.0

    monkeypatch.setattr(bench_input, "cli_images_per_s", fake_fit)
    text = bench_input.main(["--quick", "--workdir", str(tmp_path / "data"), "--decode", "gpu", "--no-eval",
                             "--no-loader", "--cli-steps", "4", "--cli-gil-hold", "10", "20"])
    assert sorted(calls) == [0.0, 0.0, 10.0, 20.0], calls
    for ms in (10, 20):
        row = next(r for r in text.splitlines() if f"holding the GIL {ms} ms of every 50 ms (4 steps) | 2,000 |" in r)
        assert "| 0.500x the CLI on random tensors" in row, row
    for bad in (["--cli-gil-hold", "0"], ["--cli-gil-hold", "60"], ["--cli-gil-hold", "5", "--cli-stacks", "1"]):
        with pytest.raises(SystemExit):
            bench_input.main(["--quick", "--no-loader", "--cli-steps", "4", *bad])
    done = subprocess.run([sys.executable, "-c", bench_input._GIL_MAIN, "5", "--help"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0 and "fit" in done.stdout, done.stderr[-2000:]


def test_bench_input_cli_gil_profile_reads_py_spy_and_needs_it(tmp_path, monkeypatch, capsys):
    """``--cli-gil-profile START SECONDS``: each fit gets a py-spy file next to --out and its line says which threads
    and frames held the GIL, as shares of the sampled wall time; without py-spy on PATH, or with bad values, one
    line and no work."""
    import shutil
    import subprocess

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_input

    raw = ("thread (7): MainThread;main (mixlab/cli.py:9);forward (torch/nn/linear.py:134) 120\n"
           "thread (7): MainThread;main (mixlab/cli.py:9) 40\n"
           "thread (9): mixlab-device-prefetch;_work (mixlab/datamodules/imagenet_gpu.py:1985) 80\n"
           "thread (11): Thread-2 (_pin_memory_loop);get (multiprocessing/queues.py:122) 20\n")
    assert bench_input.gil_summary(raw, 100, 2) == (
        "GIL held, % of 2 s: MainThread 80.0% (linear.py:134 forward 60.0%, cli.py:9 main 20.0%); "
        "mixlab-device-prefetch 40.0% (imagenet_gpu.py:1985 _work 40.0%); Thread-2 (_pin_memory_loop) 10.0% "
        "(queues.py:122 get 10.0%)")
    assert bench_input.gil_summary("", 100, 2) == "GIL: no samples"

    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/py-spy" if name == "py-spy" else None)
    seen = []

    def fake_fit(args, run_root, from_step, stacks=None, gil_hold_ms=0.0, gil_profile=None, env=None):
        seen.append(gil_profile)
        return bench_input.CliFit(4000.0, 3000.0, 5000.0, "GIL held, % of 3 s: MainThread 20.0%")

    monkeypatch.setattr(bench_input, "cli_images_per_s", fake_fit)
    out = tmp_path / "b.md"
    bench_input.main(["--quick", "--workdir", str(tmp_path / "data"), "--decode", "gpu", "--no-eval", "--no-loader",
                      "--cli-steps", "4", "--cli-gil-profile", "20", "3", "--out", str(out)])
    assert [(p.parent, p.name, start, sec) for p, start, sec in seen] == [
        (tmp_path / "b.gil", "random_tensors-run1.txt", 20.0, 3.0), (tmp_path / "b.gil", "gpu-run1.txt", 20.0, 3.0)]
    assert "GIL held, % of 3 s: MainThread 20.0%" in capsys.readouterr().err

    class Ended:  # a fit that ends before the profile's start: no py-spy call
        pid = 1

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("py-spy ran"))
    ended = bench_input.gil_profile_run(Ended(), tmp_path / "x.txt", 5, 1)
    assert ended == "GIL: the fit ended before the profile's start"

    monkeypatch.setattr(shutil, "which", lambda name: None)
    for argv, message in ((["--cli-gil-profile", "20", "3"], "--cli-gil-profile needs py-spy on PATH"),
                          (["--cli-gil-profile", "20", "0"], "--cli-gil-profile START SECONDS: START >= 0")):
        with pytest.raises(SystemExit) as exc:
            bench_input.main(["--quick", "--workdir", str(tmp_path / "data"), "--cli-steps", "4", *argv])
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_bench_input_writes_synthetic_shards_in_parallel(tmp_path, monkeypatch):
    """``write_shards_parallel``: the images split over processes (seed k in part k), one ``::``-joined pattern
    that the datamodule expands to every shard; every image written once, labels ``i % classes`` per part."""
    import webdataset as wds

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_input

    from mixlab.datamodules.imagenet import expand_shards

    pattern = bench_input.write_shards_parallel(tmp_path, 11, (40, 30), 3, 4, procs=2)
    parts = pattern.split("::")
    assert len(parts) == 2 and all(f"part{k}" in p for k, p in enumerate(parts)), pattern
    urls = expand_shards(pattern)
    samples = list(wds.tarfile_samples([{"url": u} for u in urls]))
    assert len(urls) == 4 and len(samples) == 11  # parts of 6 and 5 images, shards of up to 4
    labels = sorted(int(s["cls"]) for s in samples)
    assert labels == sorted([i % 3 for i in range(6)] + [i % 3 for i in range(5)])
    first = {p.split("/part")[1][0]: next(wds.tarfile_samples([{"url": expand_shards(p)[0]}]))["jpg"] for p in parts}
    assert first["0"] != first["1"]  # different seeds, different pictures


def test_bench_input_refuses_bad_options_in_one_line(monkeypatch, capsys):
    """Counts, sizes, the image shape, the model name and --quick's own settings are checked before any shard is
    written: one argparse line naming the option, exit 2 (they were tracebacks, a division by zero, or --quick
    silently replacing the user's values)."""
    import pytest
    import torch

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_input

    cases = {("--workers", "-1"): "--workers must be >= 0; got -1", ("--batch-size", "0"): "--batch-size must be >= 2",
             ("--images", "0"): "--images must be >= 1; got 0", ("--batches", "0"): "--batches must be >= 1; got 0",
             ("--prefetch", "-2"): "--prefetch must be >= 0; got -2",
             ("--image-wh", "10"): "--image-wh must be WIDTHxHEIGHT in pixels, e.g. 500x375; got '10'",
             ("--model", "nosuchmodel"): "--model 'nosuchmodel' is not a timm model name",
             ("--quick", "--batch-size", "4", "--model=tiny"): "--quick sets --batch-size, --model itself; drop them",
             ("--quick", "--shards", "/nonexist/x-{0000..0003}.tar"):  # a traceback before (user test)
             "--shards: 4 of 4 shards from pattern '/nonexist/x-{0000..0003}.tar' do not exist",
             ("--cpu-decode-fraction", "0", "2"): "--cpu-decode-fraction values must be in [0, 1]; got [0.0, 2.0]",
             ("--cli-steps", "-1"): "--cli-steps must be >= 0 and --cli-repeats >= 1; got -1, 1",
             ("--cli-steps", "4", "--cli-config", "/nonexist.yaml"): "--cli-config '/nonexist.yaml': no such file",
             ("--no-loader", "--profile", "3"): "--no-loader skips the device stage that --profile",
             ("--decode-under-load",): "--decode-under-load times the decoders of --decoders next to the training"}
    if not torch.cuda.is_available():
        cases[("--device", "cuda")] = "--device cuda: no CUDA device is available here"
    for argv, message in cases.items():
        with pytest.raises(SystemExit) as exit_info:
            bench_input.main(list(argv))
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err, argv


def _make_wds_shards(monkeypatch, capsys):
    """``scripts/make_wds_shards.py``'s ``main`` in this process (a subprocess per call cost seconds of imports):
    ``run(*argv)`` gives ``(exit status, stderr)``."""
    import pytest

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import make_wds_shards

    def run(*argv) -> tuple[int, str]:
        capsys.readouterr()
        try:
            make_wds_shards.main([str(v) for v in argv])
            code = 0
        except SystemExit as exit_info:
            code = exit_info.code
        except Exception as err:  # a traceback for the user
            pytest.fail(f"make_wds_shards {argv}: {type(err).__name__}: {err}")
        captured = capsys.readouterr()
        run.out = captured.out  # the summary line
        return code, captured.err

    return run


def test_make_wds_shards_refuses_a_missing_root_in_one_line(monkeypatch, capsys, tmp_path):
    """``scripts/make_wds_shards.py`` with a root that is not a folder, or a shard size below 1: one argparse line,
    exit 2, nothing written (a traceback before: user test)."""
    run = _make_wds_shards(monkeypatch, capsys)
    for argv, says in (([tmp_path / "nope", tmp_path / "out-%04d.tar"], "is not a directory"),
                       ([tmp_path, tmp_path / "out-%04d.tar", "--maxcount", "0"], "--maxcount must be >= 1")):
        code, err = run(*argv)
        assert code == 2 and says in err.strip().splitlines()[-1] and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.glob("out-*"))


def test_make_wds_shards_summary_counts_the_unreadable_files_it_skipped(monkeypatch, capsys, tmp_path):
    """A file that is no image is skipped with a warning naming it, and the summary line says how many were skipped
    (it said only ``wrote N shards`` before: user test)."""
    import numpy as np
    from PIL import Image

    run = _make_wds_shards(monkeypatch, capsys)
    (tmp_path / "imgs" / "cat").mkdir(parents=True)
    for i in range(2):
        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "imgs" / "cat" / f"{i}.jpg")
    (tmp_path / "imgs" / "cat" / "bad.png").write_bytes(b"not an image")
    code, err = run(tmp_path / "imgs", tmp_path / "out" / "train-%04d.tar")
    assert code == 0 and "bad.png" in err and "not a readable image" in err
    shard = tmp_path / "out" / "train-0000.tar"
    assert run.out.splitlines()[0] == f"wrote 1 shard: {shard} (1 unreadable file(s) skipped, named above)"


def test_make_wds_shards_refuses_existing_shards_and_a_flat_folder(monkeypatch, capsys, tmp_path):
    """A user test: a second run into the same pattern replaced shard 0 and left the old 1..3 beside it (a glob
    then read duplicates), and a folder of images without class folders gave a traceback."""
    import numpy as np
    from PIL import Image

    run = _make_wds_shards(monkeypatch, capsys)
    rng = np.random.default_rng(0)
    for c in ("cat", "dog"):
        (tmp_path / "imgs" / c).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(tmp_path / "imgs" / c / f"{i}.jpg")
    out = tmp_path / "out"
    pattern = out / "train-%04d.tar"
    assert run(tmp_path / "imgs", pattern, "--maxcount", 2)[0] == 0
    first = sorted(p.name for p in out.glob("train-*.tar"))
    assert first == ["train-0000.tar", "train-0001.tar", "train-0002.tar"]
    before = (out / "train-0000.tar").read_bytes()
    code, err = run(tmp_path / "imgs", pattern, "--maxcount", 4)
    assert code == 2 and "3 shards exist already" in err.strip().splitlines()[-1] and "--overwrite" in err
    assert (out / "train-0000.tar").read_bytes() == before  # nothing lost
    (out / "train-old.tar").write_bytes(b"x")  # not a file of the pattern: kept
    assert run(tmp_path / "imgs", pattern, "--maxcount", 4, "--overwrite")[0] == 0
    assert sorted(p.name for p in out.glob("train-*.tar")) == ["train-0000.tar", "train-0001.tar", "train-old.tar"]
    (tmp_path / "map").mkdir()
    (tmp_path / "map" / "classes.txt").write_text("cat\n")  # no "dog": one argparse line, nothing written
    code, err = run(tmp_path / "imgs", tmp_path / "mapped-%04d.tar", "--classes-from", tmp_path / "map" / "classes.txt")
    assert code == 2 and "1 class folder(s)" in err.strip().splitlines()[-1] and "first: dog" in err
    assert not list(tmp_path.glob("mapped-*"))
    code, err = run(tmp_path / "imgs" / "cat", tmp_path / "flat-%04d.tar")
    assert code == 2
    assert ("has no class sub-folders (3 images directly in it): the layout is <root>/<class>/<image>"
            in err.strip().splitlines()[-1])
    assert not list(tmp_path.glob("flat-*"))


def test_make_wds_shards_refuses_duplicate_sample_keys_and_two_pattern_fields(monkeypatch, capsys, tmp_path):
    """A user test: ``a/dup.jpg`` and ``a/dup.png`` (or ``x y.jpg`` and ``x_y.jpg``) got one sample key, which
    readers reject as a duplicate tar member (a webdataset traceback), and a pattern with two ``%d`` fields gave a
    TypeError. Now one argparse line naming both files, and older shards of the pattern are kept (``--overwrite``
    removes them only once the root passed the checks)."""
    import numpy as np
    from PIL import Image

    run = _make_wds_shards(monkeypatch, capsys)
    rng = np.random.default_rng(0)
    (tmp_path / "imgs" / "a").mkdir(parents=True)
    for name in ("dup.jpg", "ok.jpg"):
        Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(tmp_path / "imgs" / "a" / name)
    pattern = tmp_path / "out" / "train-%04d.tar"
    save = lambda name: Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(  # noqa: E731
        tmp_path / "imgs" / "a" / name)
    save("x y.jpg")
    assert run(tmp_path / "imgs", pattern)[0] == 0
    before = (tmp_path / "out" / "train-0000.tar").read_bytes()
    for extra, key in (("dup.png", "a_dup"), ("x_y.jpg", "a_x_y")):
        save(extra)
        code, err = run(tmp_path / "imgs", pattern, "--overwrite")
        last = err.strip().splitlines()[-1]
        assert code == 2 and len(err.strip().splitlines()) == 1 and f"both get the sample key '{key}'" in last, err
        (tmp_path / "imgs" / "a" / extra).unlink()
    assert "x y.jpg" in last and "x_y.jpg" in last
    assert (tmp_path / "out" / "train-0000.tar").read_bytes() == before  # --overwrite removed nothing
    code, err = run(tmp_path / "imgs", tmp_path / "c-%d-%d.tar")
    assert code == 2 and "exactly one printf field" in err.strip().splitlines()[-1] and "found 2" in err
    assert not list(tmp_path.glob("c-*"))


def test_bench_input_fit_timeline_and_stack_summary():
    """A fit's wall time split from its logged steps' times (startup: before step 0 at the steps' pace; after: past
    the last logged step), and a --cli-stacks file read back as the main thread's innermost frame per sample, equal
    consecutive samples merged, the innermost mixlab/Lightning frame named when the innermost is another's."""
    import bench_input

    scalars = {"perf/images_per_s": [(110.0, 10, 1.0), (120.0, 30, 1.0)], "train/loss": [(115.0, 20, 2.0)],
               "val/top1": [(500.0, 30, 0.1)]}  # not a training tag: ignored
    line = bench_input.fit_timeline(100.0, 200.0, scalars)
    assert line == ("wall 100.0 s: startup ~5.0 s, steps 10..30 10.00 s (500 ms/step by the logs' clock), after step "
                    "30 80.0 s"), line
    assert bench_input.fit_timeline(0.0, 3.0, {}) == "wall 3.0 s (too few logged steps for a split)"
    waits = {"perf/data_wait_ms": [(0, 10, 9.0), (0, 20, 1.0), (0, 30, 3.0)], "perf/input/stage_ms": [(0, 20, 12.0)]}
    assert bench_input.input_summary(waits, 20) == "input ms/step: between steps 2.0, stage 12.0"
    assert bench_input.input_summary({}, 0) == ""
    host = {**waits, "perf/host/train_cpu_ms": [(0, 20, 30.0)], "perf/host/train_blocked_ms": [(0, 20, 15.0)],
            "perf/host/other_cpu_ms": [(0, 20, 22.5)]}
    assert bench_input.input_summary(host, 20) == ("input ms/step: between steps 2.0, stage 12.0; host ms/step: "
                                                   "training thread on a CPU 30.0, blocked 15.0, the process's other "
                                                   "threads on a CPU 22.5")
    text = """sample 1.0 s
thread bench_input-stacks-other
  File "/x/other.py", line 3, in spin
thread MainThread
  File "<string>", line 14, in <module>
  File "/site/mixlab/cli.py", line 9, in main
    x = f()
  File "/lib/python3.11/threading.py", line 337, in wait
sample 2.0 s
thread MainThread
  File "/site/mixlab/cli.py", line 9, in main
  File "/lib/python3.11/threading.py", line 337, in wait
sample 3.1 s
thread MainThread
  File "/site/datamodules/imagenet.py", line 40, in setup
"""
    assert bench_input.stack_summary(text) == ["1.0-2.0 s: python3.11/threading.py:337 wait < mixlab/cli.py:9 main",
                                               "3.1 s: datamodules/imagenet.py:40 setup"]


def test_bench_input_cli_variants_add_one_shards_fit_each(tmp_path, monkeypatch):
    """``--cli-variants``: one fit on the shards per string of extra CLI arguments (after the config's data
    arguments, so they win), each a row labelled with its arguments, next to the one fit on random tensors; the
    empty string is the config as it is. A string given twice is refused."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_input

    calls = []

    envs = []

    def fake_fit(args, run_root, from_step, stacks=None, gil_hold_ms=0.0, gil_profile=None, env=None):
        calls.append(args)
        envs.append(env)
        return bench_input.CliFit(1000.0 + 10 * len(calls), 900.0, 1100.0, "wall 1.0 s")

    monkeypatch.setattr(bench_input, "cli_images_per_s", fake_fit)
    checked = []
    built = {"model": "ImageClassifier", "data": "ImageNetDataModule", "num_workers": 2}
    monkeypatch.setattr(bench_input, "cli_args_check",
                        lambda args, config, env=None: (checked.append(args) or "", built))
    text = bench_input.main(["--quick", "--workdir", str(tmp_path / "data"), "--decode", "gpu", "--no-eval",
                             "--no-loader", "--cli-steps", "4", "--cli-variants", "",
                             "--data.init_args.worker_nice 10 --data.init_args.decode_thread true"])
    assert envs == [{}, {}, {}]
    assert len(calls) == 3 and not any("worker_nice" in a for a in calls[0] + calls[1])
    assert calls[2][-4:] == ["--data.init_args.worker_nice", "10", "--data.init_args.decode_thread", "true"]
    rows = [line for line in text.splitlines() if "through the CLI, shards" in line]
    assert [r.split("|")[2].strip() for r in rows] == [
        "gpu", "gpu, --data.init_args.worker_nice 10 --data.init_args.decode_thread true"]
    assert "1,020" in rows[0] and "1,030" in rows[1]
    workers = ["--data.init_args.num_workers", "2"]  # --quick's, before the variant as in the fits
    assert checked == [workers, [*workers, "--data.init_args.worker_nice", "10", "--data.init_args.decode_thread",
                                 "true"]]


def test_bench_input_cli_variants_leading_assignments_set_the_fits_environment(tmp_path, monkeypatch):
    """A ``--cli-variants`` string's leading ``NAME=value`` words are the fit's environment (as in a shell), the rest
    its CLI arguments; the CLI check sees only the arguments; the row is labelled with the whole string. The fit's
    process gets the variables on top of this one's environment."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_input

    assert bench_input.split_env(["A=1", "B_2=x=y", "--data.x", "C=3"]) == ({"A": "1", "B_2": "x=y"},
                                                                           ["--data.x", "C=3"])
    assert bench_input.split_env([]) == ({}, [])
    run_fit = bench_input.cli_images_per_s
    seen = []

    def fake_fit(args, run_root, from_step, stacks=None, gil_hold_ms=0.0, gil_profile=None, env=None):
        seen.append((args[-2:], env))
        return bench_input.CliFit(1000.0, 900.0, 1100.0, "wall 1.0 s")

    monkeypatch.setattr(bench_input, "cli_images_per_s", fake_fit)
    checked = []
    built = {"model": "ImageClassifier", "data": "ImageNetDataModule", "num_workers": 2}
    checks_env = []

    def fake_check(args, config, env=None):
        checked.append(args)
        checks_env.append(env)
        return "", built

    monkeypatch.setattr(bench_input, "cli_args_check", fake_check)
    text = bench_input.main(["--quick", "--workdir", str(tmp_path / "data"), "--decode", "gpu", "--no-eval",
                             "--no-loader", "--cli-steps", "4", "--cli-variants",
                             "CUDA_DEVICE_MAX_CONNECTIONS=8 --data.init_args.worker_nice 3"])
    assert seen[1] == (["--data.init_args.worker_nice", "3"], {"CUDA_DEVICE_MAX_CONNECTIONS": "8"})
    assert seen[0][1] == {}  # the random-tensor anchor
    assert checked == [["--data.init_args.num_workers", "2", "--data.init_args.worker_nice", "3"]]
    assert checks_env == [{"CUDA_DEVICE_MAX_CONNECTIONS": "8"}]  # the check runs as the fit will
    assert "| gpu, CUDA_DEVICE_MAX_CONNECTIONS=8 --data.init_args.worker_nice 3 |" in text

    # the real runner passes the variables to the fit's process, on top of this one's environment
    monkeypatch.setenv("MIXLAB_BENCH_OUTER", "kept")
    got = {}

    def fake_run(cmd, capture_output, text, env):
        got.update(env)
        raise SystemExit(0)

    monkeypatch.setattr(bench_input.subprocess, "run", fake_run)
    with pytest.raises(SystemExit):
        run_fit(["--config", "x.yaml"], tmp_path / "run", 0, env={"A_B": "1"})
    assert got["A_B"] == "1" and got["MIXLAB_BENCH_OUTER"] == "kept"


@pytest.mark.parametrize("argv, message", [
    (["--cli-steps", "4", "--cli-variants", "--x  1", "--x 1"], "--cli-variants has the same arguments twice"),
    (["--cli-steps", "4", "--cli-variants", "--data.init_args.worker_nice '3"],
     "--cli-variants \"--data.init_args.worker_nice '3\": No closing quotation"),
    (["--cli-variants", "--data.init_args.worker_nice 3"], "give --cli-steps N too"),
    (["--cli-args", "--trainer.max_epochs 1"], "give --cli-steps N too"),
    (["--cli-stacks", "2"], "--cli-stacks must be > 0 seconds (0: off) and needs --cli-steps"),
    # checked by building the CLI's classes before any fit (not after minutes of earlier ones)
    (["--cli-steps", "4", "--cli-variants", "", "--data.init_args.bogus 3"],
     "'--data.init_args.bogus 3': `python -m mixlab fit` refuses them: error: unknown option --data.init_args.bogus"),
    (["--cli-steps", "4", "--cli-variants", "", "--data.init_args.worker_nice 25"],
     "'--data.init_args.worker_nice 25': `python -m mixlab fit` refuses them: error: --data.init_args.worker_nice: "
     "ImageNetDataModule: worker_nice must be in [0, 19]"),
    # environment words (user test): misplaced, misnamed, a queue count CUDA cannot take, a plugin that is missing
    (["--cli-steps", "4", "--cli-variants", "--data.init_args.worker_nice 5 CUDA_DEVICE_MAX_CONNECTIONS=8"],
     "'CUDA_DEVICE_MAX_CONNECTIONS=8' is not an option; environment variables go first, as NAME=value"),
    (["--cli-steps", "4", "--cli-variants", "1FOO=3"], "'1FOO=3' is not an option; environment variables go first"),
    (["--cli-steps", "4", "--cli-variants", "CUDA_DEVICE_MAX_CONNECTIONS=abc"],
     "CUDA_DEVICE_MAX_CONNECTIONS must be an int in [1, 32]; got 'abc'"),
    (["--cli-steps", "4", "--cli-variants", "MIXLAB_IMPORT=no_such_module_xyz"],
     "'MIXLAB_IMPORT=no_such_module_xyz': `python -m mixlab fit` refuses them"),
    # --quick writes 48 images, 6 per shard: 8 shards
    (["--cli-steps", "4", "--cli-variants", "", "--data.init_args.num_workers 50"],
     "--cli-variants '--data.init_args.num_workers 50': num_workers 50 for 8 shards; every DataLoader worker needs "
     "at least one shard"),
    (["--cli-steps", "4", "--cli-config", str(ROOT / "configs" / "synthetic" / "parity.yaml")],
     "parity.yaml' trains SyntheticLM on ParityDataModule; the --cli-steps fits need an ImageClassifier on "
     "ImageNetDataModule"),
    (["--workers", "9"], "--quick sets --workers itself"),
])
def test_bench_input_refuses_bad_cli_options_before_any_fit(argv, message, monkeypatch, capsys, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_input

    monkeypatch.setattr(bench_input, "cli_images_per_s", lambda *a, **k: pytest.fail("a fit ran"))
    with pytest.raises(SystemExit) as exc:
        bench_input.main(["--quick", "--workdir", str(tmp_path), *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--images", "48", "--shard-size", "6", "--workers", "9"],
     "--images / --shard-size: 8 shards for --workers 9; every DataLoader worker needs at least one shard: lower "
     "--workers or --shard-size"),
    (["--images", "1000", "--shard-size", "128"], "--images / --shard-size: 8 shards for --workers 15"),
    (["--quick", "--out", "/proc/bench_input.md"], "--out '/proc/bench_input.md' cannot be written"),
    (["--quick", "--out", "."], "--out '.' is a folder; give a file path"),
    (["--quick", "--out", ""], "--out is empty; give a file path"),  # it was read as the current folder
    (["--quick", "--out", "newdir/"], "--out 'newdir/' ends in '/' (a folder); give a file path"),  # was a file
    (["--quick", "--out", "README.md/x.md"], "--out 'README.md/x.md' cannot be written: 'README.md' is a file, not a "
                                              "folder"),  # run from the project root
])
def test_bench_input_refuses_unusable_shards_and_outputs_before_any_work(argv, message, monkeypatch, capsys,
                                                                         tmp_path):
    """Too few shards for the workers (each DataLoader worker reads whole shards) and an ``--out`` that cannot be
    written are one-line errors before any shard is written or anything is timed."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_input

    monkeypatch.setattr(bench_input, "write_shards_parallel", lambda *a, **k: pytest.fail("shards written"))
    monkeypatch.setattr(bench_input, "time_model", lambda *a, **k: pytest.fail("the model was timed"))
    with pytest.raises(SystemExit) as exc:
        monkeypatch.chdir(ROOT)
        bench_input.main(["--workdir", str(tmp_path), "--device", "cpu", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_bench_input_refuses_a_file_where_the_stacks_folder_goes(monkeypatch, capsys, tmp_path):
    """``--cli-stacks`` writes next to ``--out`` (``X.md`` -> ``X.stacks/``): a file there is refused before any
    work (it was a FileExistsError after the measurements), and the file is kept."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_input

    (tmp_path / "st.stacks").write_text("keep")
    monkeypatch.setattr(bench_input, "write_shards_parallel", lambda *a, **k: pytest.fail("shards written"))
    with pytest.raises(SystemExit) as exc:
        bench_input.main(["--quick", "--workdir", str(tmp_path), "--no-loader", "--cli-steps", "2", "--cli-stacks",
                          "1", "--out", str(tmp_path / "st.md")])
    assert exc.value.code == 2
    assert f"--cli-stacks (its folder next to --out) {str(tmp_path / 'st.stacks')!r} is a file; give a folder" \
        in capsys.readouterr().err
    assert (tmp_path / "st.stacks").read_text() == "keep"


def test_synthetic_shard_count_matches_the_shards_written(tmp_path, monkeypatch):
    """The up-front count (:func:`bench_input.synthetic_shard_count`) is the number of shards the writer makes (the
    last one short)."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_input

    from mixlab.datamodules.files import expand_pattern

    pattern = bench_input.write_shards_parallel(tmp_path, 21, (32, 24), 2, 4, bench_input.writer_procs(21))
    assert len(expand_pattern(pattern, kind="shards")) == bench_input.synthetic_shard_count(21, 4) == 6


def test_bench_batch_release_measures_both_modes_and_refuses_bad_sizes(monkeypatch, capsys):
    """``scripts/bench_batch_release.py``: batches from a real DataLoader worker, released in both modes (freed by the
    last reference, pages given back first), one line each with the count; bad sizes are one argparse line."""
    import re

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_batch_release

    bench_batch_release.main(["--mb", "1", "--batches", "3", "--workers", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["freed by the last reference", "pages given back first (madvise)"]
    for line in lines:
        m = re.search(r": (\d+) releases of 1 MB, other threads stalled (\d+\.\d\d) ms per release "
                      r"\(largest (\d+\.\d\d) ms\)$", line)
        assert m is not None and m[1] == "3", line
    for argv, says in ((["--mb", "0"], "--mb must be >= 0.01"), (["--workers", "0"], "--workers must be >= 1")):
        with pytest.raises(SystemExit) as exit_info:
            bench_batch_release.main(argv)
        assert exit_info.value.code == 2 and says in capsys.readouterr().err
