"""Passkey retrieval and needle-in-a-haystack (NIAH) at character level (GOAT Sec. 6, Fig. 3).

Vocabulary (:data:`CHARS`, 75 ids): newline, space, a-z, A-Z, 0-9 and ``.,;:!?'"-()``.
A sample of length ``L`` is ``L + 1`` characters::

    <haystack ... | needle | ... haystack><question><answer>

* passkey: needle ``" passkey: DDDDDDDD. "`` (8 random digits) at depth U(0, 0.8),
  question ``" what is the passkey? "``, answer the 8 digits; trained on every next
  character with the answer span up-weighted (``SyntheticLM(span_weight=10)``: loss =
  (whole + 10 x span) / 11);
* niah: needle ``" needle: XXXXXXXXXXXX. "`` (12 chars of a-d) at depth U(0.1, 0.9),
  question ``" what is the needle? "``; trained on the answer span only.

Depth = fraction of the haystack before the needle. Haystacks: ``"noise"`` (random
characters: a-z and space for passkey, ``{a, b, c, d, space}`` for NIAH, as GOAT),
``"filler"`` (one filler sentence repeated: the classic / MesaNet "noise" haystack) and
``"essay"`` (natural prose: the shipped tinyshakespeare or ``essay_path``; characters outside
the vocabulary are dropped). Val/test score only the answer span; the task metrics are
span token accuracy (``span_acc``), strict accuracy (every answer character right,
``strict_acc``) and the answer's log-probability (``span_logprob``, nats per sample), all
with teacher forcing (:func:`span_metrics`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import torch

from mixlab.datamodules.synthetic import SyntheticDataModule

__all__ = ["CHARS", "encode", "decode", "make_example", "span_metrics", "load_essay", "RetrievalDataModule",
           "TASK_DEFAULTS"]

CHARS = "\n " + "abcdefghijklmnopqrstuvwxyz" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ" + "0123456789" + ".,;:!?'\"-()"
_INDEX = {c: i for i, c in enumerate(CHARS)}
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
TASK_DEFAULTS = {
    "passkey": {"depth": (0.0, 0.8), "noise": "abcdefghijklmnopqrstuvwxyz ", "answer": "0123456789", "n": 8,
                "needle": " passkey: {}. ", "question": " what is the passkey? "},
    "niah": {"depth": (0.1, 0.9), "noise": "abcd ", "answer": "abcd", "n": 12,
             "needle": " needle: {}. ", "question": " what is the needle? "},
}


def encode(text: str) -> np.ndarray:
    """Characters -> int64 ids; characters outside :data:`CHARS` are dropped."""
    return np.array([_INDEX[c] for c in text if c in _INDEX], dtype=np.int64)


def decode(ids) -> str:
    return "".join(CHARS[int(i)] for i in ids if 0 <= int(i) < len(CHARS))


def _haystack(rng: np.random.Generator, kind: str, n: int, task: str, essay: np.ndarray | None) -> np.ndarray:
    if kind == "noise":
        alphabet = encode(TASK_DEFAULTS[task]["noise"])
        return alphabet[rng.integers(len(alphabet), size=n)]
    src = encode(FILLER) if kind == "filler" else essay
    if src is None or len(src) == 0:
        raise ValueError(f"haystack {kind!r} needs text (essay_path)")
    start = 0 if kind == "filler" else int(rng.integers(len(src)))
    reps = (start + n) // len(src) + 1
    return np.tile(src, reps)[start:start + n]


def make_example(rng: np.random.Generator, task: str, length: int, depth: float | None = None,
                 haystack: str = "noise", essay: np.ndarray | None = None, train_all: bool | None = None
                 ) -> dict[str, np.ndarray]:
    """One sample of exactly ``length`` input characters.

    Args:
        task: ``"passkey"`` or ``"niah"``.
        depth: needle depth in [0, 1] (``None``: the task's training range, uniform).
        haystack: ``"noise"``, ``"filler"`` or ``"essay"`` (with ``essay`` ids).
        train_all: train on every next character (default: passkey yes, niah no).

    Returns:
        ``inputs``, ``targets`` (training), ``eval_targets`` (answer only) ``[length]``
        int64 and ``span [length]`` bool (positions whose target is an answer character).

    Raises:
        ValueError: unknown task/haystack, or ``length`` too short for needle + question.
    """
    if task not in TASK_DEFAULTS:
        raise ValueError(f"retrieval task must be 'passkey' or 'niah'; got {task!r}")
    if haystack not in ("noise", "filler", "essay"):
        raise ValueError(f"haystack must be 'noise', 'filler' or 'essay'; got {haystack!r}")
    d = TASK_DEFAULTS[task]
    ans_chars = d["answer"]
    answer = "".join(ans_chars[i] for i in rng.integers(len(ans_chars), size=d["n"]))
    needle, question, ans = encode(d["needle"].format(answer)), encode(d["question"]), encode(answer)
    n_hay = length + 1 - len(needle) - len(question) - len(ans)
    if n_hay < 1:
        raise ValueError(f"{task}: length {length} is too short for the needle and question "
                         f"({length + 1 - n_hay} characters)")
    if depth is None:
        lo, hi = d["depth"]
        depth = float(rng.uniform(lo, hi))
    hay = _haystack(rng, haystack, n_hay, task, essay)
    cut = int(round(depth * n_hay))
    seq = np.concatenate([hay[:cut], needle, hay[cut:], question, ans])
    inputs, nxt = seq[:-1], seq[1:]
    span = np.zeros(length, dtype=bool)
    span[length - len(ans):] = True
    train_all = task == "passkey" if train_all is None else train_all
    return {"inputs": inputs, "targets": nxt.copy() if train_all else np.where(span, nxt, -100),
            "eval_targets": np.where(span, nxt, -100), "span": span}


def span_metrics(logits: torch.Tensor, targets: torch.Tensor, span: torch.Tensor) -> dict:
    """Teacher-forced answer-span metrics, as sums.

    Args:
        logits: ``[B, T, V]``; targets ``[B, T]`` (answer ids at span positions); span
            ``[B, T]`` bool.

    Returns:
        ``{"span_acc": (correct span tokens, span tokens), "strict_acc": (samples with
        every span token right, samples), "span_logprob": (sum over samples of the summed
        log-probability of the answer (nats), samples)}`` (float64 tensors).
    """
    span = span.to(torch.bool)
    tgt = targets.clamp_min(0)
    hit = (logits.argmax(-1) == tgt) & span
    logp = torch.log_softmax(logits.double(), -1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
    n_tok = span.sum().double()
    b = torch.tensor(float(span.shape[0]), dtype=torch.float64)
    strict = (hit.sum(-1) == span.sum(-1)).double().sum()
    return {"span_acc": (hit.sum().double(), n_tok), "strict_acc": (strict, b),
            "span_logprob": ((logp * span).sum(), b)}


class RetrievalDataModule(SyntheticDataModule):
    """Passkey / NIAH training data (``task_name`` = ``task``).

    Args:
        task: ``"passkey"`` or ``"niah"``.
        context_length: characters per sample (GOAT trains NIAH at 256).
        haystack: ``"noise"``, ``"filler"`` or ``"essay"``.
        essay_path: prose for the essay haystack (default: shipped tinyshakespeare).
        Other args: :class:`~mixlab.datamodules.synthetic.SyntheticDataModule`.

    Raises:
        ValueError: unknown task or haystack; ``essay_path`` missing.
    """

    def __init__(self, task: Literal["passkey", "niah"] = "passkey", context_length: int = 256,
                 haystack: Literal["noise", "filler", "essay"] = "noise", essay_path: str | None = None,
                 batch_size: int = 32, n_train: int = 50000, n_val: int = 128, n_test: int = 512,
                 seed: int = 0, num_workers: int = 0,
                 cache: bool = True) -> None:
        super().__init__(batch_size, n_train, n_val, n_test, seed, num_workers, cache)
        self.save_hyperparameters()
        if task not in TASK_DEFAULTS:
            raise ValueError(f"data.init_args.task must be 'passkey' or 'niah'; got {task!r}")
        self.task, self.task_name = task, task
        self.context_length, self.haystack = context_length, haystack
        self.essay = load_essay(essay_path) if haystack == "essay" else None
        self.vocab_size = len(CHARS)
        self.sample(np.random.default_rng(0), "train")  # validate now

    def sample(self, rng, split):
        return make_example(rng, self.task, self.context_length, None, self.haystack, self.essay)

    @staticmethod
    def task_metrics(logits: torch.Tensor, batch: dict) -> dict:
        return span_metrics(logits, batch["eval_targets"], batch["span"])


def load_essay(path: str | None = None) -> np.ndarray:
    """Character ids of an essay haystack text (default: the shipped tinyshakespeare).

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    if path is None:
        from mixlab.datamodules.text import shipped_file

        p = shipped_file("tinyshakespeare.txt")
    else:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"essay text not found: {p} (essay_path / --text)")
    return encode(p.read_text(encoding="utf-8", errors="replace"))
