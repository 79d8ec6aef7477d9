"""scripts/bench_lm.py --quick on CPU: two mixlab models beside the plain anchor, a well-formed table
(no timing is asserted)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    sys.modules.pop("bench_lm", None)
    import bench_lm

    return bench_lm


def test_bench_lm_quick_writes_a_well_formed_table(tmp_path, monkeypatch, capsys):
    bench = _bench(monkeypatch)
    out = tmp_path / "sub" / "bench_lm.md"
    md = bench.main(["--quick", "--models", "goat", "kda", "--out", str(out)])
    assert out.read_text() == md
    captured = capsys.readouterr()
    assert md in captured.out and "round 2/2" in captured.err  # table on stdout, progress on stderr
    lines = md.splitlines()
    assert lines[0] == ("| model | mode | params (M) | tokens/s | ratio to plain: median [min, max] | MFU % "
                        "| peak mem (GiB) |")
    assert lines[1] == "|---|---|---|---|---|---|---|"
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:5]]
    assert [r[:2] for r in rows] == [["plain", "eager"], ["goat", "eager"], ["kda", "eager"]]
    assert lines[5] == "" and "2 interleaved rounds of 2 steps" in lines[6] and "device cpu" in lines[6]
    for name, mode, params, tps, ratio, mfu, mem in rows:
        assert float(params) > 0 and float(tps.replace(",", "")) > 0 and mfu == mem == "-"  # no GPU peak on CPU
        med, lo, hi = map(float, re.fullmatch(r"([\d.]+) \[([\d.]+), ([\d.]+)\]", ratio).groups())
        assert 0 < lo <= med <= hi
    assert rows[0][4] == "1.000 [1.000, 1.000]"  # the anchor against itself, round by round


def test_the_plain_anchor_matches_mixlab_in_size_and_learns(monkeypatch):
    """The anchor is the textbook model mixlab's nope LM is (RMSNorm, SwiGLU of the same width, tied
    output): equal parameter counts; its loss starts at about ln(vocab) and decreases under AdamW."""
    import math

    import torch

    bench = _bench(monkeypatch)
    args = bench.parse(["--quick"])
    plain, nope = bench.build("plain", args), bench.build("nope", args)
    assert sum(p.numel() for p in plain.parameters()) == sum(p.numel() for p in nope.parameters())
    x = torch.randint(0, args.vocab, (2, 17))
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        loss = plain(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(args.vocab)) < 0.1 and losses[-1] < losses[0] - 0.5


def test_bench_lm_refuses_bad_options_in_one_line(monkeypatch, capsys):
    """Bad shapes and counts are argparse errors naming the option (were tracebacks from deep in the model)."""
    import pytest

    bench = _bench(monkeypatch)
    cases = {("--seq-len", "0"): "--seq-len must be >= 1; got 0", ("--n-heads", "5"): "--d-model (768) must be "
             "divisible by --n-heads (5)", ("--warmup", "-1"): "--warmup must be >= 0; got -1",
             ("--loss-chunk-tokens", "-1"): "--loss-chunk-tokens must be >= 0", ("--peak-tflops", "0"): "must be > 0",
             ("--device", "tpu"): "--device must be cpu, cuda or cuda:N; got 'tpu'",
             ("--models", "hybrid", "--hybrid", "kda*3,bogus"): "--hybrid 'kda*3,bogus': unknown mixer 'bogus'",
             }
    if bench.torch.cuda.is_available():  # fla's loss kernels run only inside the chunked loss
        cases[("--models", "goat_fla_loss", "--loss-chunk-tokens", "0")] = "goat_fla_loss needs the chunked loss"
        cases[("--models", "rope_fla_loss", "--vocab", "512")] = "(got --vocab 512, --loss-chunk-tokens None)"
    else:  # without CUDA that comes first
        cases[("--device", "cuda")] = "no CUDA device is available here (use --device cpu, or --quick)"
        cases[("--device", "cuda", "--quick")] = "no CUDA device is available here (use --device cpu)"
        cases[("--models", "goat_fla_loss")] = "goat_fla_loss needs CUDA; nothing besides the plain anchor is left"
        cases[("--models", "goat_fla_loss", "--loss-chunk-tokens", "0")] = "goat_fla_loss needs CUDA"
        cases[("--quick", "--modes", "eager", "compile-blocks")] = "--modes compile-blocks needs CUDA"
        cases[("--quick", "--modes", "compile-cudagraphs")] = "--modes compile-cudagraphs needs CUDA: there are no CUDA"
    cases[("--quick", "--host-time")] = "--host-time needs CUDA (it holds the GPU busy while the host enqueues a step)"
    for argv, message in cases.items():
        with pytest.raises(SystemExit) as exit_info:
            bench.parse(list(argv))
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if "error:" in line]
        assert len(errors) == 1 and message in errors[0] and "usage:" not in err, (argv, err)  # one line, no usage


def test_bench_lm_quick_sets_defaults_and_a_given_option_still_applies(monkeypatch):
    """A user test: ``--quick --seq-len 128`` measured T 64 without a word (--quick replaced the shape)."""
    bench = _bench(monkeypatch)
    args = bench.parse(["--quick", "--seq-len", "128", "--hybrid", "goat,kda"])
    assert (args.seq_len, args.d_model, args.n_layers, args.batch, args.rounds) == (128, 64, 2, 2, 2)
    assert args.hybrid == "goat,kda" and args.modes == ["eager"] and args.device == "cpu" and not args.amp
    args = bench.parse(["--quick"])
    assert (args.seq_len, args.vocab, args.hybrid) == (64, 512, "kda,goat")


@pytest.mark.parametrize("impl", ["where", "scatter"])
def test_goat_where_is_goat_with_the_where_packing(monkeypatch, impl):
    """``goat_where`` / ``goat_scatter`` build GOAT with ``lane_impl: where`` / ``scatter`` (the lanes by one
    pointwise op, for ``--modes compile-max-autotune``): the same initial weights and the same loss as ``goat``."""
    import torch

    bench = _bench(monkeypatch)
    args = bench.parse(["--quick", "--models", f"goat_{impl}", "--modes", "compile-max-autotune"])
    assert args.models == [f"goat_{impl}"] and args.modes == ["compile-max-autotune"]
    goat, where = bench.build("goat", args), bench.build(f"goat_{impl}", args)
    lanes = {m.lane_impl for m in where.modules() if hasattr(m, "lane_impl")}
    assert lanes == {impl} and {m.lane_impl for m in goat.modules() if hasattr(m, "lane_impl")} == {"auto"}
    x = torch.randint(0, args.vocab, (2, 17))
    torch.testing.assert_close(where(x[:, :-1], x[:, 1:]), goat(x[:, :-1], x[:, 1:]), rtol=1e-6, atol=1e-6)
    if impl == "scatter":
        assert {m.lane_impl for m in bench.build("goat_scatter_full_loss", args).modules()
                if hasattr(m, "lane_impl")} == {"scatter"}
