"""Sample a continuation from a trained decoder LM: text, DNA or a character-level synthetic task.

``python -m mixlab generate --ckpt X.ckpt (--prompt TEXT | --fasta FILE) --max-new-tokens N
[--temperature T --top-k K --seed S --device D --dtype float32|float64|bfloat16 --ignore-eos --no-cuda-graph
--compile]``

The prompt is encoded with the checkpoint's own tokenizer (:func:`codec_for`: the text datamodule's
GPT-2 BPE or bytes, DNA letters for genome runs, the passkey/NIAH characters, whitespace-separated
token ids for other tasks), run through the model once in parallel (prefill, filling every layer's
cache: attention keys/values, recurrent states), then decoded one token per step through the caches
(the mixers' recurrent paths; equal to the parallel forward, see ``tests/test_registry.py``). When every
layer has a static decoding step (attention goat/rope/alibi/nope, the delta-rule family, Mesa, Hawk, GLA,
Mamba2) the steps run on fixed buffers of prompt + ``--max-new-tokens`` positions, on CUDA as one
replayed CUDA graph per token (:mod:`mixlab.eval.decode`; ``--no-cuda-graph``: eager steps; ``--compile``:
the step through ``torch.compile`` first, worth it for long generations); the ids are the same.
Temperature 0 is greedy decoding; otherwise the logits are divided by the temperature, cut to the
``top_k`` largest and sampled with a generator seeded by ``--seed``. Ids the tokenizer cannot decode
(a model vocabulary padded beyond the tokenizer's) are never sampled; generation stops at the
tokenizer's end-of-document id unless ``--ignore-eos``.

The generated text (the continuation only) goes to stdout, progress and timings to stderr.
Mistakes end with one ``error:`` line (and the ``MIXLAB_TRACEBACK=1`` hint) and exit status 2: a missing
checkpoint, a checkpoint that is not a decoder LM (a ViT, VQA or MAD-compression run), an empty prompt,
characters the tokenizer cannot encode (named with their position), ``--fasta`` for a run that is not a genome
LM.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from mixlab.eval.common import OneLineParser, check_device, import_class, load_run, refuse_below

__all__ = ["Codec", "codec_for", "generate", "main"]

_LM_HINT = "generate needs a decoder language model (mixlab.heads.CausalLM or SyntheticLM)"


@dataclass
class Codec:
    """How a run's text and token ids map to each other.

    Attributes:
        name: ``"gpt2"``, ``"byte"``, ``"dna"``, ``"chars"`` or ``"ids"``.
        encode: prompt text -> token ids (raises ``ValueError`` naming a character it cannot encode).
        decode: token ids -> text.
        vocab_size: ids ``0 .. vocab_size - 1`` can be decoded (sampling never leaves them).
        eos_id: end-of-document id, or None.
    """

    name: str
    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    vocab_size: int
    eos_id: int | None = None


def _char_codec(name: str, alphabet: str, where: str) -> Codec:
    index = {c: i for i, c in enumerate(alphabet)}

    def encode(text: str) -> list[int]:
        for pos, c in enumerate(text):
            if c not in index:
                raise ValueError(f"{where}: character {c!r} at position {pos + 1} is not in the model's "
                                 f"alphabet {alphabet!r}")
        return [index[c] for c in text]

    return Codec(name, encode, lambda ids: "".join(alphabet[int(i)] for i in ids), len(alphabet))


def _ids_codec(vocab_size: int) -> Codec:
    def encode(text: str) -> list[int]:
        ids = []
        for pos, word in enumerate(text.split()):
            if not word.isdigit() or int(word) >= vocab_size:
                raise ValueError(f"--prompt: item {pos + 1} ({word!r}) is not a token id in 0..{vocab_size - 1} "
                                 f"(this run's prompts are whitespace-separated token ids)")
            ids.append(int(word))
        return ids

    return Codec("ids", encode, lambda ids: " ".join(str(int(i)) for i in ids), vocab_size)


def codec_for(data: str | None, data_args: dict, model_vocab: int) -> Codec:
    """The :class:`Codec` of a run from its datamodule class path and arguments (the checkpoint's record).

    Text runs (``TextDataModule``): its tokenizer (``gpt2`` BPE or ``byte``; EOS is the end of a
    document). Genome runs: DNA letters ``ACGTN`` (lowercase and IUPAC codes as the run's
    ``lowercase`` / ``iupac`` options say; whitespace and newlines are dropped). Passkey / NIAH runs:
    their character vocabulary. Anything else (MAD and the other synthetic tasks, or no datamodule):
    whitespace-separated token ids below ``model_vocab``.
    """
    cls = import_class(data) if data else None
    from mixlab.datamodules.genome import GenomeDataModule, encode_sequence
    from mixlab.datamodules.retrieval import CHARS, RetrievalDataModule
    from mixlab.datamodules.text import TextDataModule, get_tokenizer

    if cls is not None and issubclass(cls, TextDataModule):
        tok = get_tokenizer(data_args.get("tokenizer", "gpt2"), data_args.get("tokenizer_file"))

        def encode(text: str) -> list[int]:
            try:
                return tok.encode(text)
            except UnicodeEncodeError as err:  # a lone surrogate: not UTF-8
                raise ValueError(f"--prompt: character {text[err.start]!r} at position {err.start + 1} cannot be "
                                 f"encoded by the {tok.name} tokenizer") from None

        return Codec(tok.name, encode, tok.decode, min(int(tok.vocab_size), model_vocab), tok.eos_id)
    if cls is not None and issubclass(cls, GenomeDataModule):
        lowercase, iupac = data_args.get("lowercase", "fold"), data_args.get("iupac", "n")

        def encode_dna(text: str) -> list[int]:
            return encode_sequence("".join(text.split()), lowercase, iupac, where="--prompt").tolist()

        alphabet = GenomeDataModule.alphabet
        return Codec("dna", encode_dna, lambda ids: "".join(alphabet[int(i)] for i in ids), len(alphabet))
    if cls is not None and issubclass(cls, RetrievalDataModule):
        return _char_codec("chars", CHARS, "--prompt")
    return _ids_codec(model_vocab)


def _next_token(logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator) -> Tensor:
    """``logits [B, V]`` float -> ``[B]`` int64 ids: argmax at temperature 0 (and below float32's smallest
    normal number, 1.2e-38, which float32 division would turn into 0/0), else a top-k sample."""
    if temperature < torch.finfo(torch.float32).tiny:  # 0, or a temperature float32 holds only as 0
        return logits.argmax(-1)
    # shift by the row maximum first: at a tiny temperature the division overflows to inf, and inf - inf
    # in the softmax gave NaN probabilities; shifted, the maximum stays 0 and the rest go to -inf
    logits = logits.float()
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def _check_positions(model, prompt_len: int, max_new_tokens: int, option: str = "max_new_tokens",
                     prefix: str = "generate: ") -> None:
    """Refuse a prompt + ``max_new_tokens`` that needs more learned absolute positions than the model has (the
    last new token is never fed back: ``prompt_len + max_new_tokens - 1`` positions).

    Raises:
        ValueError: naming ``option`` and the model's ``abs_pos_len``.
    """
    abs_len = model.abs_pos.num_embeddings if getattr(model, "abs_pos", None) is not None else None
    if abs_len is not None and prompt_len + max_new_tokens - 1 > abs_len:
        raise ValueError(f"{prefix}prompt ({prompt_len} tokens) + {option} {max_new_tokens} - 1 exceeds the model's "
                         f"learned absolute positions (abs_pos_len={abs_len})")


def generate(model, prompt: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             generator: torch.Generator | None = None, vocab_limit: int | None = None,
             eos_id: int | None = None, cuda_graph: bool | None = None, static: bool | None = None,
             compile_step: bool = False) -> Tensor:
    """Continue ``prompt`` with up to ``max_new_tokens`` tokens: one parallel forward of the prompt fills
    the per-layer caches, then one cached step per new token.

    The steps run through static caches (:mod:`mixlab.eval.decode`: fixed buffers of ``P +
    max_new_tokens`` positions, one step captured in a CUDA graph on CUDA) when every layer supports
    them, else through the dict caches (``model.hidden(token, None, caches)``). Both give the same ids.

    Args:
        model: a :class:`~mixlab.heads.CausalLM` (``hidden(tokens, coords, caches)``, ``lm_head``, ``backbone``).
        prompt: ``[B, P]`` int64 token ids, ``P >= 1``, on the model's device.
        max_new_tokens: tokens to generate (>= 0).
        temperature: 0 for greedy decoding (argmax), else the softmax temperature (> 0).
        top_k: sample among the ``top_k`` most likely ids only (None, or at least the vocabulary size: all).
        generator: random generator for sampling (on the model's device).
        vocab_limit: only ids below it are generated (the tokenizer's vocabulary; None: all).
        eos_id: stop once every sequence has produced this id (it is included in the output).
        cuda_graph: replay the static step as a CUDA graph; None (default): on CUDA whenever the static
            path runs; False: eager static steps. True on a model without a static step is ignored (dict loop).
        static: None (default): static caches when every layer has a static step; False: the dict-cache
            loop (the reference; what ``cuda_graph`` is compared with); True: static or a ValueError.
        compile_step: run the static step through ``torch.compile`` (then captured as a CUDA graph on CUDA;
            :mod:`mixlab.eval.decode`); the first call per model compiles (tens of seconds). Ignored by the
            dict-cache loop.

    Returns:
        ``[B, n]`` int64 new token ids, ``n <= max_new_tokens`` (the prompt not included).

    Raises:
        ValueError: an empty prompt; a negative ``max_new_tokens``; a negative, NaN or infinite ``temperature``;
            ``top_k < 1``; prompt + ``max_new_tokens`` beyond the model's learned absolute positions; static caches
            larger than the free memory; ``static=True`` for a model without static steps.
    """
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(f"generate: the prompt is empty (shape {tuple(prompt.shape)}); give at least one token")
    if max_new_tokens < 0 or not 0 <= temperature < math.inf or (top_k is not None and top_k < 1):
        raise ValueError(f"generate: need max_new_tokens >= 0, a finite temperature >= 0, top_k >= 1; got "
                         f"{max_new_tokens}, {temperature}, {top_k}")
    from mixlab.eval import decode

    use_static = static is not False and max_new_tokens > 1 and decode.supports_static(model)
    if static and not use_static and max_new_tokens > 1:
        raise ValueError(f"generate: static=True, but {type(model).__name__} "
                         f"({', '.join(blk.mixer_name for blk in model.backbone.blocks)}) has no static decoding step "
                         "(a layer without one, or a head other than CausalLM's); use static=None")
    b, p = prompt.shape
    capacity = p + max_new_tokens
    _check_positions(model, p, max_new_tokens)
    decode.check_memory(model, b, capacity, prompt.device, static=use_static)
    caches: list[dict] = [{} for _ in model.backbone.blocks]
    out = prompt.new_zeros(b, max_new_tokens)
    if max_new_tokens == 0:
        return out
    pick = lambda logits: _next_token(logits, temperature, top_k, generator)  # noqa: E731
    out[:, 0] = pick(_dict_step(model, prompt, caches, vocab_limit))  # prefill: the prompt's parallel forward
    states = decode.static_states(model, caches, capacity) if use_static else None
    if states is None:
        if static and use_static:
            raise ValueError("generate: static=True, but a layer has no static cache for this configuration "
                             f"({', '.join(blk.mixer_name for blk in model.backbone.blocks)}); use static=None")
        return _dict_loop(model, caches, out, pick, vocab_limit, eos_id)
    del caches
    graph = prompt.is_cuda if cuda_graph is None else (cuda_graph and prompt.is_cuda)
    dec = decode.StaticDecoder(model, states, p, capacity, vocab_limit, greedy=temperature == 0, cuda_graph=graph,
                               compile_step=compile_step)
    dec.token.copy_(out[:, 0])
    for n in range(1, max_new_tokens + 1):
        if eos_id is not None and (n % 16 == 0 or n == max_new_tokens or n == 1):  # a host sync every 16 tokens
            stop = _all_done_at(out[:, :n], eos_id)
            if stop is not None:
                return out[:, :stop]
        if n == max_new_tokens:
            break
        logits = dec.step()  # the token in dec.token at position p + n - 1
        if dec.greedy:  # the argmax was taken inside the step and is already the next input
            out[:, n] = dec.token
        else:
            tok = pick(logits)
            out[:, n] = tok
            dec.token.copy_(tok)
    return out


def _dict_step(model, tokens: Tensor, caches: list[dict], vocab_limit: int | None) -> Tensor:
    """Logits ``[B, V]`` (float32; float64 for a float64 model) of the last of ``tokens [B, T]`` through the
    dict ``caches`` (filled in place)."""
    from mixlab.heads.common import float_logits

    h = model.hidden(tokens, None, caches)[:, -1]  # [B, D]; the prompt's last position, then each new token
    logits = float_logits(model.lm_head(h))
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits[:, vocab_limit:] = float("-inf")
    return logits


def _dict_loop(model, caches: list[dict], out: Tensor, pick, vocab_limit: int | None,
               eos_id: int | None) -> Tensor:
    """The dict-cache loop (the reference path): ``out[:, 0]`` holds the first new token; fills the rest."""
    done = torch.zeros(out.shape[0], dtype=torch.bool, device=out.device)
    for n in range(1, out.shape[1] + 1):
        if eos_id is not None:
            done |= out[:, n - 1] == eos_id
            if bool(done.all()):
                return out[:, :n]
        if n == out.shape[1]:
            break
        out[:, n] = pick(_dict_step(model, out[:, n - 1:n], caches, vocab_limit))
    return out


def _all_done_at(ids: Tensor, eos_id: int) -> int | None:
    """Length of the output when every row of ``ids [B, n]`` has produced ``eos_id`` (the step of the last
    row's first EOS, plus one), or None if some row has none yet (one host sync)."""
    hit = ids == eos_id
    if not bool(hit.any(1).all()):
        return None
    return int(hit.int().argmax(1).max()) + 1


def _log(msg: str) -> None:
    print(f"generate: {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> dict:
    """CLI entry (``python -m mixlab generate``); returns ``{"prompt_ids", "ids", "text"}`` (lists of ints, str).

    Raises:
        FileNotFoundError: ``--ckpt`` or ``--fasta`` missing.
        ValueError: ``--max-new-tokens`` below 0, ``--temperature`` not a finite number >= 0, ``--top-k`` or
            ``--last-tokens`` below 1; not an LM checkpoint; an empty prompt; characters the tokenizer cannot encode;
            ``--fasta`` for a run that is not a genome LM; a prompt plus new tokens longer than the
            model's learned absolute positions.
    """
    p = OneLineParser(prog="python -m mixlab generate", description=__doc__, allow_abbrev=False,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="checkpoint of a CausalLM / SyntheticLM run")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (DNA letters for a genome run, token ids for other synthetic runs)")
    src.add_argument("--fasta", help="genome runs: the prompt is the first record of this FASTA(.gz) file")
    p.add_argument("--last-tokens", type=int, default=None, metavar="N",
                   help="keep only the last N tokens of the prompt (default: all of --prompt; for --fasta, the "
                        "training context length when the record is longer)")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy (argmax)")
    p.add_argument("--top-k", type=int, default=None,
                   help="sample among the K most likely ids (default, or K >= the vocabulary size: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-document token")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "float64", "bfloat16"], default="float32",
                   help="parameter and activation dtype (float64: exact comparisons with a parallel forward)")
    p.add_argument("--no-cuda-graph", action="store_true",
                   help="decode with eager static-cache steps instead of a replayed CUDA graph (CUDA only)")
    p.add_argument("--compile", action="store_true",
                   help="compile the static decoding step with torch.compile (fewer, fused kernels per token; "
                        "the compilation takes tens of seconds, once)")
    args = p.parse_args(argv)
    refuse_below(("--max-new-tokens", args.max_new_tokens, 0), ("--top-k", args.top_k, 1),
                 ("--last-tokens", args.last_tokens, 1))
    if not 0 <= args.temperature < math.inf:  # NaN fails too
        raise ValueError(f"--temperature must be a finite number >= 0 (0: greedy); got {args.temperature}")

    from mixlab.heads.lm import CausalLM

    t0 = time.perf_counter()
    device = check_device(args.device)
    run = load_run(args.ckpt, "cpu", head=CausalLM, hint=_LM_HINT)
    model = run.model
    if getattr(model, "decoder", "lm") != "lm":
        raise ValueError(f"--ckpt {args.ckpt}: a SyntheticLM with decoder={model.decoder!r} reconstructs a whole "
                         f"sequence at once and does not generate; {_LM_HINT} with decoder 'lm'")
    model = model.to(device=args.device, dtype=getattr(torch, args.dtype))
    codec = codec_for(run.data, run.data_args, model.vocab_size)
    if args.fasta is not None:
        if codec.name != "dna":
            raise ValueError(f"--fasta is for genome LM checkpoints; {args.ckpt} reads {codec.name!r} tokens "
                             "(use --prompt)")
        from mixlab.datamodules.genome import read_fasta

        records, _ = read_fasta(args.fasta, run.data_args.get("lowercase", "fold"), run.data_args.get("iupac", "n"))
        name, codes = records[0]
        if len(records) > 1:
            _log(f"{args.fasta} holds {len(records)} records; the prompt is the first, {name!r}")
        ids = codes.tolist()
    else:
        ids = codec.encode(args.prompt)
    if not ids:
        raise ValueError("--prompt: the prompt is empty (no token to start from); give at least one character")
    keep = args.last_tokens
    if keep is None and args.fasta is not None and run.data_args.get("context_length"):
        keep = int(run.data_args["context_length"])  # a chromosome is no prompt for a model of that context
    if keep is not None and len(ids) > keep:
        _log(f"the prompt's last {keep} of its {len(ids)} tokens are kept"
             + ("" if args.last_tokens is not None else " (the training context; --last-tokens N keeps another N)"))
        ids = ids[-keep:]
    _check_positions(model, len(ids), args.max_new_tokens, option="--max-new-tokens", prefix="")
    trained, total = int(run.data_args.get("context_length") or 0), len(ids) + args.max_new_tokens
    if trained and total > trained:
        _log(f"note: prompt + --max-new-tokens = {total} tokens, {total / trained:.1f}x the {trained} the model was "
             "trained on: past that it extrapolates in length (python -m mixlab length-extrapolation measures how "
             "well)")
    _log(f"{args.ckpt}: {type(model).__name__} {model.run_name}, step {run.step}, {args.dtype} on {args.device}; "
         f"{codec.name} prompt of {len(ids)} token{'' if len(ids) == 1 else 's'} "
         f"(loaded in {time.perf_counter() - t0:.1f}s)")
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    prompt = torch.tensor([ids], dtype=torch.long, device=args.device)
    t1 = time.perf_counter()
    from mixlab.eval.decode import supports_static

    if args.compile and not supports_static(model):
        _log(f"--compile: {model.run_name} has a layer without a static decoding step; it decodes through the "
             "dict caches, not compiled")
    elif args.compile:
        _log("--compile: compiling the decoding step first (tens of seconds, once per model)")
        if device.type == "cpu":  # torch's note about the missing CUDA runtime, once per compile
            logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    new = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, gen, codec.vocab_size,
                   None if args.ignore_eos else codec.eos_id,
                   cuda_graph=False if args.no_cuda_graph else None, compile_step=args.compile)[0].tolist()
    dt = time.perf_counter() - t1
    stopped = not args.ignore_eos and codec.eos_id is not None and bool(new) and new[-1] == codec.eos_id
    if stopped:
        new = new[:-1]  # the end-of-document id is not text
    text = codec.decode(new)
    _log(f"{len(new)} new tokens in {dt:.2f}s ({len(new) / max(dt, 1e-9):.1f} tokens/s, prefill"
         + (" and compilation" if args.compile else "") + " included)"
         + (", stopped at end-of-document" if stopped else ""))
    print(text, flush=True)
    return {"prompt_ids": ids, "ids": new, "text": text}
