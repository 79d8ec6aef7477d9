"""``python -m mixlab generate`` on tiny checkpoints written by the real CLI (``fit``, a few steps):
greedy decoding through the caches equals the argmax of the full parallel forward at every step, for
attention (goat, rope) and recurrent (kda, mesa) mixers; sampling is seeded; mistakes are one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from mixlab.cli import main as cli_main
from mixlab.eval.common import load_run
from mixlab.eval.generate import generate
from mixlab.eval.generate import main as generate_main

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model.init_args.backbone.d_model=32", "--model.init_args.backbone.n_layers=2",
        "--model.init_args.backbone.n_heads=2", "--data.init_args.context_length=32", "--data.init_args.batch_size=4",
        "--trainer.max_steps=50", "--trainer.val_check_interval=50", "--trainer.limit_val_batches=1",
        "--model.init_args.optim.lr=0.01", "--model.init_args.optim.warmup_steps=1",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
TEXT_RUNS = {"goat": ("text/goat.yaml", []), "rope": ("text/rope.yaml", []),
             "kda": ("text/goat.yaml", ["--model.init_args.backbone.mixer=kda"]),
             "mesa": ("text/goat.yaml", ["--model.init_args.backbone.mixer=mesa"])}


def _fit(root: Path, config: str, extra: list[str]) -> Path:
    with mock.patch.object(sys, "argv", ["mixlab"]):  # LightningCLI warns when given args and a pytest argv
        cli_main(["fit", "--config", str(ROOT / "configs" / config), *TINY, *extra, f"--run_root={root}"])
    (ckpt,) = root.rglob("last.ckpt")
    return ckpt


@pytest.fixture(scope="module")
def text_ckpts(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("generate_text")
    corpus = base / "pangram.txt"  # learnable in a few dozen steps, so greedy continuations are not one repeated byte
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 300)
    return {name: _fit(base / name, cfg, [f"--data.init_args.path={corpus}", *extra])
            for name, (cfg, extra) in TEXT_RUNS.items()}


@pytest.fixture(scope="module")
def genome_ckpt(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("generate_genome")
    g = torch.Generator().manual_seed(0)
    seq = "".join("ACGT"[int(i)] for i in torch.randint(0, 4, (3000,), generator=g))
    fasta = base / "toy.fa"
    fasta.write_text(">toy\n" + "\n".join(seq[i:i + 60] for i in range(0, len(seq), 60)) + "\n")
    ckpt = _fit(base / "runs", "genome/goat.yaml", [f"--data.init_args.fasta={fasta}",
                                                     "--data.init_args.region_size=512"])
    prompt = base / "prompt.fa"
    prompt.write_text(">first some words\nACGTA\nCGTTN\n>second\nGGGG\n")
    return ckpt, prompt


def _check_greedy(ckpt: Path, prompt_ids: list[int], new: list[int], vocab: int) -> None:
    """Every generated id is the argmax of the full parallel forward (no cache) over all ids before it."""
    model = load_run(ckpt).model.double()
    ids = torch.tensor([prompt_ids + new])
    with torch.no_grad():
        logits = model(ids)[0, len(prompt_ids) - 1:-1, :vocab]  # [n, vocab]: the predictions of the new ids
    assert logits.argmax(-1).tolist() == new


@pytest.mark.parametrize("mixer", list(TEXT_RUNS))
def test_greedy_generation_equals_the_argmax_of_the_parallel_forward(mixer, text_ckpts, capsys):
    out = generate_main(["--ckpt", str(text_ckpts[mixer]), "--prompt", "the quick", "--max-new-tokens", "24",
                         "--temperature", "0", "--dtype", "float64", "--ignore-eos", "--device", "cpu"])
    assert out["prompt_ids"] == list("the quick".encode())  # the run's byte tokenizer
    assert len(out["ids"]) == 24 and len(set(out["ids"])) >= 4  # a real continuation, not one repeated byte
    _check_greedy(text_ckpts[mixer], out["prompt_ids"], out["ids"], 257)
    captured = capsys.readouterr()
    assert captured.out == out["text"] + "\n"  # only the generated text on stdout
    assert out["text"] == bytes(i for i in out["ids"] if i < 256).decode("utf-8", errors="replace")
    assert "24 new tokens" in captured.err and f"CausalLM {mixer}, step 50" in captured.err


def test_sampling_is_seeded_and_top_k_1_is_greedy(text_ckpts, capsys):
    ckpt = str(text_ckpts["goat"])
    common = ["--ckpt", ckpt, "--prompt", "First", "--max-new-tokens", "16", "--ignore-eos", "--device", "cpu"]
    a = generate_main([*common, "--temperature", "1.5", "--seed", "3"])["ids"]
    b = generate_main([*common, "--temperature", "1.5", "--seed", "3"])["ids"]
    c = generate_main([*common, "--temperature", "1.5", "--seed", "4"])["ids"]
    assert a == b and a != c
    greedy = generate_main([*common, "--temperature", "0"])["ids"]
    assert generate_main([*common, "--temperature", "0.7", "--top-k", "1", "--seed", "5"])["ids"] == greedy


def test_generate_stops_at_eos_and_never_samples_ids_the_tokenizer_cannot_decode():
    """A model whose argmax is EOS from the start stops at once; ids beyond vocab_limit are masked."""
    from mixlab.backbone import BackboneConfig
    from mixlab.heads.lm import CausalLM

    class Fixed(torch.nn.Module):  # logits that do not depend on the hidden state: id 11 best, then 7
        def forward(self, h):
            logits = torch.zeros(h.shape[0], 12)
            logits[:, 11], logits[:, 7] = 2.0, 1.0
            return logits

    torch.manual_seed(0)
    model = CausalLM(vocab_size=12, backbone=BackboneConfig(d_model=16, n_layers=1, n_heads=2, mixer="nope"),
                     tie_embeddings=False).eval()
    model.lm_head = Fixed()
    prompt = torch.tensor([[1, 2]])
    assert generate(model, prompt, 5, temperature=0).tolist() == [[11] * 5]
    assert generate(model, prompt, 5, temperature=0, vocab_limit=11).tolist() == [[7] * 5]
    assert generate(model, prompt, 5, temperature=0, eos_id=11).tolist() == [[11]]
    assert generate(model, prompt, 0).shape == (1, 0)


def test_genome_generation_from_a_fasta_prompt(genome_ckpt, capsys):
    ckpt, prompt = genome_ckpt
    out = generate_main(["--ckpt", str(ckpt), "--fasta", str(prompt), "--max-new-tokens", "30", "--temperature", "0",
                         "--dtype", "float64", "--device", "cpu"])
    assert out["prompt_ids"] == ["ACGTN".index(c) for c in "ACGTACGTTN"]  # the first record only
    assert len(out["text"]) == 30 and set(out["text"]) <= set("ACGTN")
    _check_greedy(ckpt, out["prompt_ids"], out["ids"], 5)
    err = capsys.readouterr().err
    assert "holds 2 records; the prompt is the first, 'first'" in err
    lower = generate_main(["--ckpt", str(ckpt), "--prompt", "acgt a\ncgttn", "--max-new-tokens", "2",
                           "--device", "cpu"])
    assert lower["prompt_ids"] == out["prompt_ids"]  # whitespace dropped, soft-masked lowercase folded


def _one_line_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        cli_main(["generate", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_generate_mistakes_are_one_line_errors(text_ckpts, genome_ckpt, tmp_path, capsys):
    text, (genome, _) = str(text_ckpts["goat"]), genome_ckpt
    missing = tmp_path / "nope.ckpt"
    assert "file not found" in _one_line_error(["--ckpt", str(missing), "--prompt", "a"], capsys)
    vit = ROOT / "tests" / "fixtures" / "digits_goat2d.ckpt"
    line = _one_line_error(["--ckpt", str(vit), "--prompt", "a"], capsys)
    assert "ImageClassifier checkpoint" in line and "decoder language model" in line
    assert "prompt is empty" in _one_line_error(["--ckpt", text, "--prompt", ""], capsys)
    line = _one_line_error(["--ckpt", str(genome), "--prompt", "ACGXT"], capsys)
    assert "'X' at position 4" in line and "not a DNA letter" in line
    assert "--fasta is for genome LM" in _one_line_error(["--ckpt", text, "--fasta", str(tmp_path / "x.fa")], capsys)
    # found by a user test: tracebacks before
    not_ckpt = tmp_path / "notes.txt"
    not_ckpt.write_text("not a checkpoint\n")
    assert "not a PyTorch Lightning checkpoint (not a torch.save zip archive)" in _one_line_error(
        ["--ckpt", str(not_ckpt), "--prompt", "a"], capsys)
    truncated = tmp_path / "cut.ckpt"
    truncated.write_bytes(Path(text).read_bytes()[:4096])
    assert "a truncated or damaged checkpoint (the start of a torch.save archive without its end" in _one_line_error(
        ["--ckpt", str(truncated), "--prompt", "a"], capsys)  # a user test: it read "not a torch.save zip archive"
    plain = tmp_path / "plain.pt"  # a torch.save file that Lightning did not write (a KeyError traceback before)
    torch.save({"a": 1}, plain)
    assert "not a PyTorch Lightning checkpoint (no state_dict)" in _one_line_error(
        ["--ckpt", str(plain), "--prompt", "a"], capsys)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "a directory; give a checkpoint file (no .ckpt file within 4 folders below it)" in _one_line_error(
        ["--ckpt", str(empty), "--prompt", "a"], capsys)
    # the hint names a checkpoint that exists (it named <dir>/last.ckpt, which a run never writes)
    run_dir = Path(text).parents[2]  # <run_root>/<task>/<run>/version_0/checkpoints/last.ckpt -> <run>
    assert f"(e.g. {text})" in _one_line_error(["--ckpt", str(run_dir), "--prompt", "a"], capsys)
    # the torch message is whole, not cut at 120 characters
    assert _one_line_error(["--ckpt", str(not_ckpt), "--prompt", "a"], capsys).endswith(
        "); give a .ckpt file written by python -m mixlab fit")
    # a device string torch cannot parse (a RuntimeError traceback before; seventh session's user test)
    assert "--device 'banana' is not a device: use cpu, cuda or cuda:N" in _one_line_error(
        ["--ckpt", text, "--prompt", "a", "--device", "banana"], capsys)
    for option, value in (("--max-new-tokens", "-5"), ("--top-k", "0")):
        line = _one_line_error(["--ckpt", text, "--prompt", "a", option, value], capsys)
        assert line == f"error: {option} must be >= {1 if option == '--top-k' else 0}; got {value}"
    for value in ("-1", "nan", "inf"):
        line = _one_line_error(["--ckpt", text, "--prompt", "a", "--temperature", value], capsys)
        assert line == f"error: --temperature must be a finite number >= 0 (0: greedy); got {float(value)}"
    if not torch.cuda.is_available():
        line = _one_line_error(["--ckpt", text, "--prompt", "a", "--device", "cuda"], capsys)
        assert "CUDA is not available on this machine" in line


def test_a_tiny_temperature_samples_the_argmax_instead_of_nan(text_ckpts):
    """``--temperature 1e-45`` overflowed the scaled logits to inf and the softmax to NaN (a user test)."""
    from mixlab.eval.generate import _next_token
    from mixlab.eval.generate import main as generate_main

    logits = torch.tensor([[1.0, 3.0, 2.0], [0.5, -1.0, 0.25]])
    for t in (1e-300, 1e-46, 1e-45, 1e-30, 1e-6):  # below 1.2e-38 float32 holds the temperature only as 0
        ids = _next_token(logits, t, None, torch.Generator().manual_seed(0))
        assert ids.tolist() == [1, 0]

    common = ["--ckpt", str(text_ckpts["goat"]), "--prompt", "the", "--max-new-tokens", "5", "--ignore-eos",
              "--device", "cpu"]
    out = generate_main([*common, "--temperature", "1e-45"])
    greedy = generate_main([*common, "--temperature", "0"])
    assert out["ids"] == greedy["ids"]


def test_python_m_mixlab_generate_writes_text_to_stdout_and_progress_to_stderr(text_ckpts):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-m", "mixlab", "generate", "--ckpt", str(text_ckpts["rope"]), "--prompt",
                          "QUEEN:", "--max-new-tokens", "10", "--temperature", "0", "--ignore-eos", "--device", "cpu"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "10 new tokens" in res.stderr and "rope" in res.stderr
    assert res.stdout.endswith("\n") and len(res.stdout[:-1].encode()) <= 10 * 3  # the continuation only


def test_generating_past_the_training_context_says_so(text_ckpts, capsys):
    """A user test: a prompt far past the training context decoded without a word about length extrapolation."""
    common = ["--ckpt", str(text_ckpts["rope"]), "--prompt", "the", "--temperature", "0", "--ignore-eos"]
    generate_main([*common, "--max-new-tokens", "8"])
    assert "note:" not in capsys.readouterr().err  # within the 32 tokens of training
    new = generate_main([*common, "--max-new-tokens", "40"])["ids"]
    err = capsys.readouterr().err
    assert len(new) == 40 and "tokens, 1." in err
    assert "x the 32 the model was trained on" in err and "length-extrapolation" in err


def test_a_fasta_prompt_keeps_the_training_context_unless_last_tokens_says_otherwise(genome_ckpt, capsys):
    """A user test: ``--fasta`` of a 200k-base record on a 256-context model ran for minutes without a word."""
    ckpt, _ = genome_ckpt
    fasta = ckpt.parents[5] / "toy.fa"  # the 3000 bases the model was trained on
    common = ["--ckpt", str(ckpt), "--max-new-tokens", "2", "--temperature", "0"]
    from mixlab.datamodules.genome import read_fasta

    bases = read_fasta(str(fasta), "fold", "n")[0][0][1].tolist()
    out = generate_main([*common, "--fasta", str(fasta)])
    assert out["prompt_ids"] == bases[-32:]  # context_length 32
    assert "the prompt's last 32 of its 3000 tokens are kept (the training context" in capsys.readouterr().err
    assert generate_main([*common, "--fasta", str(fasta), "--last-tokens", "100"])["prompt_ids"] == bases[-100:]
    full = generate_main([*common, "--prompt", "ACGTACGT"])["prompt_ids"]
    assert len(full) == 8 and generate_main([*common, "--prompt", "ACGTACGT", "--last-tokens", "3"])["prompt_ids"] \
        == full[-3:]
    with pytest.raises(ValueError, match="--last-tokens must be >= 1; got 0"):
        generate_main([*common, "--prompt", "ACGT", "--last-tokens", "0"])
