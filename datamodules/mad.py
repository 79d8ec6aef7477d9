"""MAD synthetic suite (Poli et al. 2024, "Mechanistic Architecture Design"; public repo athms/mad-lab).

Six tasks, each a generator ``f(rng, ...) -> {"inputs", "targets", "eval_targets"}`` of
int64 arrays ``[T]`` (``-100`` = unscored) and one :class:`MADDataModule` (``task_name =
"mad_<task>"``) with :class:`~mixlab.heads.synthetic.SyntheticLM`:

=================  =====  ======  =========================================================
task               vocab  length  scored (test)
=================  =====  ======  =========================================================
in_context_recall  16     128     values following a key already seen in the sequence
noisy_recall       32     128     same; slots replaced by 2 noise tokens w.p. ``frac_noise``
fuzzy_recall       16     128     value tuples following a key tuple seen before
selective_copy     16     256     the i-th trailing blank outputs the i-th content token
compression        16     32      every token, decoded from the last hidden state
memorization       256    32      the value of each key at the following insert token
=================  =====  ======  =========================================================

Recall tasks train with next-token loss on every (non-noise, non-pad) token and score
only the recall positions (``eval_targets``). The difficulty grid (:func:`mad_grid`) and
the score (:func:`mad_score`: task score = mean over the default and each single-factor
change; MAD score = mean over tasks) follow the design note; report both micro accuracy
(``test/acc``: correct scored tokens / scored tokens) and macro accuracy
(``test/acc_macro``: torchmetrics ``MulticlassAccuracy`` macro average, the reference's).
Compression needs ``SyntheticLM(decoder="compression", max_len=seq_len)``.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np

from mixlab.datamodules.synthetic import SyntheticDataModule

__all__ = [
    "TASKS", "DEFAULTS", "in_context_recall", "fuzzy_recall", "selective_copy", "compression",
    "memorization", "memorization_map", "task_minimums", "mad_grid", "mad_score", "MADDataModule",
]

TASKS = ("in_context_recall", "noisy_recall", "fuzzy_recall", "selective_copy", "compression", "memorization")
DEFAULTS: dict[str, dict] = {
    "in_context_recall": {"vocab_size": 16, "seq_len": 128},
    "noisy_recall": {"vocab_size": 32, "seq_len": 128, "frac_noise": 0.2},
    "fuzzy_recall": {"vocab_size": 16, "seq_len": 128},
    "selective_copy": {"vocab_size": 16, "seq_len": 256, "num_tokens_to_copy": 16},
    "compression": {"vocab_size": 16, "seq_len": 32},
    "memorization": {"vocab_size": 256, "seq_len": 32, "n_train": 256},
}
IGNORE = -100


def _shift(seq: np.ndarray, train_mask: np.ndarray, eval_mask: np.ndarray) -> dict[str, np.ndarray]:
    """Next-token sample from ``seq [T+1]``; masks are over target positions ``1..T``."""
    inputs, nxt = seq[:-1].astype(np.int64), seq[1:].astype(np.int64)
    return {"inputs": inputs, "targets": np.where(train_mask, nxt, IGNORE),
            "eval_targets": np.where(eval_mask, nxt, IGNORE)}


def in_context_recall(rng: np.random.Generator, vocab_size: int = 16, seq_len: int = 128,
                      noise_vocab_size: int = 0, frac_noise: float = 0.0) -> dict[str, np.ndarray]:
    """In-context (multi-query associative) recall, optionally noisy.

    Keys ``0..K-1``, values ``K..2K-1`` with ``K = (vocab_size - noise_vocab_size) // 2``,
    noise ``2K..vocab_size-1``. A fresh random key->value bijection per sequence;
    ``seq_len // 2`` slots "key value"; the last slot repeats a key of an earlier clean
    slot and is always clean. With ``frac_noise`` each other slot becomes two random noise
    tokens. Inputs are the first ``2 * slots - 1`` tokens. Train targets: every next token
    that is not noise; eval targets: each value whose key occurred in an earlier clean slot.

    Raises:
        ValueError: fewer than 2 keys or 2 slots.
    """
    k = (vocab_size - noise_vocab_size) // 2
    slots = seq_len // 2
    if k < 2 or slots < 2:
        raise ValueError(f"in_context_recall needs >= 2 keys and >= 2 slots; got vocab_size={vocab_size}, "
                         f"noise_vocab_size={noise_vocab_size}, seq_len={seq_len}")
    value_of = k + rng.permutation(k)
    keys = rng.integers(0, k, size=slots)
    noisy = rng.random(slots) < frac_noise if noise_vocab_size > 0 else np.zeros(slots, bool)
    noisy[-1] = False
    if noisy[:-1].all():
        noisy[0] = False
    clean_before = keys[:-1][~noisy[:-1]]
    keys[-1] = rng.choice(clean_before)
    seq = np.empty(2 * slots, dtype=np.int64)
    seq[0::2], seq[1::2] = keys, value_of[keys]
    if noisy.any():
        noise = rng.integers(2 * k, vocab_size, size=(slots, 2))
        seq.reshape(slots, 2)[noisy] = noise[noisy]
    seen: set[int] = set()
    recall = np.zeros(2 * slots, bool)  # over token positions
    for s in range(slots):
        if noisy[s]:
            continue
        if keys[s] in seen:
            recall[2 * s + 1] = True
        seen.add(int(keys[s]))
    is_noise = np.repeat(noisy, 2)
    return _shift(seq, ~is_noise[1:], recall[1:])


def fuzzy_recall(rng: np.random.Generator, vocab_size: int = 16, seq_len: int = 128, max_key_len: int = 3,
                 max_value_len: int = 3, n_pairs: int = 8, test: bool = False) -> dict[str, np.ndarray]:
    """Fuzzy recall: keys and values are tuples of 1..3 tokens.

    Key tokens ``0..K-1`` with ``K = (vocab_size - 1) // 2``, value tokens ``K..vocab_size-2``,
    pad ``vocab_size - 1``. Per sequence ``n_pairs`` distinct key tuples (distinct tokens
    inside a key; exactly ``max_key_len`` tokens when ``test``) map to random value tuples.
    Pairs drawn uniformly are concatenated while they fit; the last pair repeats a key seen
    before; the rest is padding. Train targets: every next token that is not pad; eval
    targets: every value token of a pair whose key tuple occurred earlier.

    Raises:
        ValueError: too few key tokens for the tuple sizes or for ``n_pairs`` distinct keys (test keys:
            ``perm(K, max_key_len) >= n_pairs``; the key draw would never end), or ``seq_len`` too short.
    """
    k = (vocab_size - 1) // 2
    pad = vocab_size - 1
    n_val_tok = vocab_size - 1 - k
    if k < max_key_len or n_val_tok < 1 or seq_len < 2 * (max_key_len + max_value_len):
        raise ValueError(f"fuzzy_recall: vocab_size={vocab_size}, seq_len={seq_len} too small for "
                         f"keys of {max_key_len} and values of {max_value_len} tokens")
    n_keys = math.perm(k, max_key_len) if test else sum(math.perm(k, n) for n in range(1, max_key_len + 1))
    if n_keys < n_pairs:
        raise ValueError(f"fuzzy_recall: vocab_size={vocab_size} gives {k} key tokens, {n_keys} distinct "
                         f"{'test ' if test else ''}keys, fewer than n_pairs={n_pairs}")
    keys: list[tuple[int, ...]] = []
    while len(keys) < n_pairs:
        n = max_key_len if test else int(rng.integers(1, max_key_len + 1))
        key = tuple(int(t) for t in rng.choice(k, size=n, replace=False))
        if key not in keys:
            keys.append(key)
    values = [tuple(int(t) for t in k + rng.integers(0, n_val_tok, size=int(rng.integers(1, max_value_len + 1))))
              for _ in keys]
    seq: list[int] = []
    recall: list[bool] = []
    seen: set[int] = set()
    order: list[int] = []
    while True:
        i = int(rng.integers(n_pairs))
        if len(seq) + len(keys[i]) + len(values[i]) + 2 * (max_key_len + max_value_len) > seq_len + 1:
            break
        order.append(i)
        seq += list(keys[i]) + list(values[i])
        recall += [False] * len(keys[i]) + [i in seen] * len(values[i])
        seen.add(i)
    i = int(rng.choice(sorted(seen))) if seen else int(rng.integers(n_pairs))
    seq += list(keys[i]) + list(values[i])
    recall += [False] * len(keys[i]) + [i in seen] * len(values[i])
    n_pad = seq_len + 1 - len(seq)
    arr = np.array(seq + [pad] * n_pad, dtype=np.int64)
    rec = np.array(recall + [False] * n_pad)
    return _shift(arr, arr[1:] != pad, rec[1:])


def selective_copy(rng: np.random.Generator, vocab_size: int = 16, seq_len: int = 256,
                   num_tokens_to_copy: int = 16) -> dict[str, np.ndarray]:
    """Selective copying: content ``0..V-3``, blank ``V-2``, copy marker ``V-1``.

    ``inputs [seq_len]``: ``num_tokens_to_copy`` random content tokens at sorted random
    positions among blanks in the first ``seq_len - n - 1`` positions, then the marker,
    then ``n`` blanks. ``targets`` (= ``eval_targets``): the i-th trailing blank's target
    is the i-th content token; -100 elsewhere.

    Raises:
        ValueError: ``seq_len < 2 * num_tokens_to_copy + 1`` or ``vocab_size < 3``.
    """
    n = num_tokens_to_copy
    if vocab_size < 3 or seq_len < 2 * n + 1:
        raise ValueError(f"selective_copy needs vocab_size >= 3 and seq_len >= 2*num_tokens_to_copy+1; "
                         f"got {vocab_size}, {seq_len}, {n}")
    blank, marker = vocab_size - 2, vocab_size - 1
    prefix = seq_len - n - 1
    tokens = rng.integers(0, vocab_size - 2, size=n)
    pos = np.sort(rng.choice(prefix, size=n, replace=False))
    inputs = np.full(seq_len, blank, dtype=np.int64)
    inputs[pos] = tokens
    inputs[prefix] = marker
    targets = np.full(seq_len, IGNORE, dtype=np.int64)
    targets[prefix + 1:] = tokens
    return {"inputs": inputs, "targets": targets, "eval_targets": targets.copy()}


def compression(rng: np.random.Generator, vocab_size: int = 16, seq_len: int = 32) -> dict[str, np.ndarray]:
    """Compression: ``seq_len - 1`` random tokens ``0..V-2`` plus the compression token ``V-1``.

    ``targets`` (= ``eval_targets``): ``targets[t] = inputs[t]`` for every random token,
    -100 at the compression token (reconstructed by the compression decoder).
    """
    inputs = np.empty(seq_len, dtype=np.int64)
    inputs[:-1] = rng.integers(0, vocab_size - 1, size=seq_len - 1)
    inputs[-1] = vocab_size - 1
    targets = inputs.copy()
    targets[-1] = IGNORE
    return {"inputs": inputs, "targets": targets, "eval_targets": targets.copy()}


def memorization_map(vocab_size: int = 256, seed: int = 0) -> np.ndarray:
    """Fixed ``[K]`` key -> value table: keys ``0..K-1`` (``K = (V-1)//2``), values ``K..V-2``."""
    k = (vocab_size - 1) // 2
    return np.random.default_rng([seed, 7919]).integers(k, vocab_size - 1, size=k)


def memorization(rng: np.random.Generator, kv_map: np.ndarray, vocab_size: int = 256,
                 seq_len: int = 32) -> dict[str, np.ndarray]:
    """Memorization: ``seq_len // 2`` pairs ``[key, insert]`` (insert = ``V-1``).

    The target at each insert position is ``kv_map[key]``; values never appear in inputs.
    """
    pairs = seq_len // 2
    keys = rng.integers(0, len(kv_map), size=pairs)
    inputs = np.full(2 * pairs, vocab_size - 1, dtype=np.int64)
    inputs[0::2] = keys
    targets = np.full(2 * pairs, IGNORE, dtype=np.int64)
    targets[1::2] = kv_map[keys]
    return {"inputs": inputs, "targets": targets, "eval_targets": targets.copy()}


def task_minimums(task: str, num_tokens_to_copy: int = 16) -> dict[str, tuple[int, str]]:
    """``{"vocab": (least, why), "seq_len": (least, why)}``: the smallest vocabulary and length ``task`` generates
    samples for (:class:`MADDataModule` refuses less in one line naming the option).

    Raises:
        ValueError: unknown task.
    """
    if task not in TASKS:
        raise ValueError(f"unknown MAD task {task!r}; choose from {TASKS}")
    if task == "in_context_recall":
        return {"vocab": (4, "2 keys and 2 values"), "seq_len": (4, "2 key-value slots")}
    if task == "noisy_recall":
        return {"vocab": (7, "half of it noise tokens, then 2 keys and 2 values"),
                "seq_len": (4, "2 key-value slots")}
    if task == "fuzzy_recall":
        return {"vocab": (9, "4 key tokens for 8 distinct 3-token test keys, a value token and the pad"),
                "seq_len": (12, "a 3-token key and a 3-token value twice")}
    if task == "selective_copy":
        n = num_tokens_to_copy
        return {"vocab": (3, "a content token, the blank and the copy marker"),
                "seq_len": (2 * n + 1, f"2 * num_tokens_to_copy + 1 with num_tokens_to_copy={n}")}
    if task == "compression":
        return {"vocab": (2, "a content token and the compression token"),
                "seq_len": (2, "a content token and the compression token")}
    return {"vocab": (3, "a key, a value and the insert token"), "seq_len": (2, "one key-insert pair")}


def mad_grid(task: str) -> dict[str, dict]:
    """Settings of one task: ``{"default": {}, "<factor>=<value>": overrides, ...}``.

    Factors (single changes of the default): vocab 32/64/128, length 256/512/1024, train
    examples 6,400/3,200/1,600/800 (all recall tasks and selective copy), noise
    0.4/0.6/0.8 (noisy recall), tokens to copy 32/64/96 (selective copy). Our choices
    where the note gives none: compression lengths 64/128/256; memorization vocab 512/1024
    (its default vocab is already 256) and no example-count factor (256 fixed facts).

    Raises:
        ValueError: unknown task.
    """
    if task not in TASKS:
        raise ValueError(f"unknown MAD task {task!r}; choose from {TASKS}")
    grid: dict[str, dict] = {"default": {}}
    base = DEFAULTS[task]
    vocabs = [512, 1024] if task == "memorization" else [v for v in (32, 64, 128) if v != base["vocab_size"]]
    grid.update({f"vocab={v}": {"vocab": v} for v in vocabs})
    if task == "compression":
        lengths = [64, 128, 256]
    elif task == "memorization":
        lengths = []
    else:
        lengths = [n for n in (256, 512, 1024) if n != base["seq_len"]]
    grid.update({f"seq_len={n}": {"seq_len": n} for n in lengths})
    if task != "memorization":
        grid.update({f"n_train={n}": {"n_train": n} for n in (6400, 3200, 1600, 800)})
    if task == "noisy_recall":
        grid.update({f"frac_noise={f}": {"frac_noise": f} for f in (0.4, 0.6, 0.8)})
    if task == "selective_copy":
        grid.update({f"num_tokens_to_copy={n}": {"num_tokens_to_copy": n} for n in (32, 64, 96)})
    return grid


def mad_score(results: dict[str, dict[str, float]]) -> tuple[float, dict[str, float]]:
    """``(MAD score, {task: task score})`` from ``results[task][setting] = accuracy``.

    Task score: mean over the settings run (default + single-factor changes); MAD score:
    mean of the task scores. Apply it to micro and to macro accuracies separately.

    Raises:
        ValueError: empty results or a task with no setting.
    """
    if not results:
        raise ValueError("mad_score: no results")
    per_task = {}
    for task, settings in results.items():
        if not settings:
            raise ValueError(f"mad_score: task {task!r} has no setting")
        per_task[task] = float(np.mean(list(settings.values())))
    return float(np.mean(list(per_task.values()))), per_task


class MADDataModule(SyntheticDataModule):
    """One MAD task (``task_name = "mad_<task>"``).

    Args:
        task: one of :data:`TASKS`.
        vocab, seq_len: vocabulary size and sequence length; the task's default
            (:data:`DEFAULTS`) when ``None``. (Named ``vocab`` so it does not clash with
            the model's ``vocab_size`` in the merged hyperparameters.)
        frac_noise: noisy recall noise probability (0.2).
        num_tokens_to_copy: selective copying (16; always passed explicitly).
        n_train: training examples (12,800; memorization 256 when ``None``).
        n_test: test examples (1,280); ``n_val``: validation examples.

    Raises:
        ValueError: unknown task; ``vocab`` or ``seq_len`` < 1, or below the task's least
            (:func:`task_minimums`, e.g. ``vocab must be >= 2 for task compression (a content token and the
            compression token); got 1``); ``num_tokens_to_copy`` < 1 (selective copy); ``frac_noise`` outside
            [0, 1); a ``seed``, split size or ``num_workers`` refused by
            :class:`~mixlab.datamodules.synthetic.SyntheticDataModule`.
    """

    def __init__(self, task: Literal["in_context_recall", "noisy_recall", "fuzzy_recall", "selective_copy",
                                     "compression", "memorization"] = "in_context_recall",
                 vocab: int | None = None, seq_len: int | None = None, frac_noise: float = 0.2,
                 num_tokens_to_copy: int = 16, batch_size: int = 128, n_train: int | None = None,
                 n_val: int = 256, n_test: int = 1280, seed: int = 0, num_workers: int = 0,
                 cache: bool = True) -> None:
        if task not in TASKS:
            raise ValueError(f"unknown MAD task {task!r} (data.init_args.task); choose from {TASKS}")
        base = DEFAULTS[task]
        n_train = n_train if n_train is not None else base.get("n_train", 12800)
        super().__init__(batch_size, n_train, n_val, n_test, seed, num_workers, cache)
        self.save_hyperparameters()
        self.task = task
        self.task_name = f"mad_{task}"
        for name, value in (("vocab", vocab), ("seq_len", seq_len)):  # 0 was read as "the task's default"
            if value is not None and value < 1:
                raise ValueError(f"data.init_args.{name} must be >= 1 (null: the task's default); got {value}")
        if not 0 <= frac_noise < 1:  # NaN fails too
            raise ValueError(f"data.init_args.frac_noise must be in [0, 1) (a probability); got {frac_noise}")
        self.vocab_size = base["vocab_size"] if vocab is None else vocab
        self.seq_len = base["seq_len"] if seq_len is None else seq_len
        if task == "selective_copy" and num_tokens_to_copy < 1:  # a negative one: numpy's "negative dimensions"
            raise ValueError(f"num_tokens_to_copy must be >= 1 for task selective_copy; got {num_tokens_to_copy}")
        for name, value in (("vocab", self.vocab_size), ("seq_len", self.seq_len)):
            least, why = task_minimums(task, num_tokens_to_copy)[name]
            if value < least:  # below it numpy's errors ("high <= 0") or a sample with nothing to score
                raise ValueError(f"{name} must be >= {least} for task {task} ({why}); got {value}")
        self.frac_noise, self.num_tokens_to_copy = frac_noise, num_tokens_to_copy
        self.kv_map = memorization_map(self.vocab_size, seed) if task == "memorization" else None
        self.sample(np.random.default_rng(0), "train")  # validate the settings now

    def sample(self, rng, split):
        v, n = self.vocab_size, self.seq_len
        if self.task == "in_context_recall":
            return in_context_recall(rng, v, n)
        if self.task == "noisy_recall":
            return in_context_recall(rng, v, n, noise_vocab_size=v // 2, frac_noise=self.frac_noise)
        if self.task == "fuzzy_recall":
            return fuzzy_recall(rng, v, n, test=split != "train")
        if self.task == "selective_copy":
            return selective_copy(rng, v, n, self.num_tokens_to_copy)
        if self.task == "compression":
            return compression(rng, v, n)
        return memorization(rng, self.kv_map, v, n)
