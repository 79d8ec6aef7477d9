"""RegBench: in-context learning of regular languages from random DFAs (Akyurek et al. 2024).

Follows ``berlino/seq_icl`` (``src/dataloaders/dfa.py`` at HEAD) as summarised in the design
note. Vocabulary: letters a..r = ids 0..17, ``"|"`` = 18 (string delimiter), ``"."`` = 19
(padding); ``vocab_size = 20``.

Automata (:func:`random_dfa`): states uniform in 4..12; alphabet a random subset of the 18
letters of size uniform in 4..18; each state gets 1..3 outgoing edges with distinct symbols
to distinct *other* states; state 0 starts; every state accepts. The automaton is then
trimmed (unreachable states dropped), minimised (Moore partition refinement, missing
transitions going to a rejecting sink) and renumbered canonically (BFS from the start,
symbols in order), so equal languages give equal tables: automata are deduplicated by
table and split train/val/test by automaton.

A sample: ``k`` strings (``k`` uniform 10..19), each of length uniform 1..49, each a random
walk from state 0 choosing uniformly among outgoing edges, joined by ``"|"``, cut/padded
to ``context_length + 1`` tokens. Next-token targets equal to ``"|"`` or padding are
masked. Batches carry ``valid_next [T, 20]`` (symbols the automaton accepts after the
prefix). Metrics (:func:`regbench_metrics`, logged as ``regbench_acc`` and ``tvd``):
accuracy = fraction of scored positions whose argmax is a valid next symbol; TVD = half
the L1 distance between the model's softmax over all 20 ids and the uniform distribution
over the valid next symbols.
"""

from __future__ import annotations

import hashlib
from collections import deque

import numpy as np
import torch

from mixlab.datamodules.synthetic import SyntheticDataModule

__all__ = [
    "N_LETTERS", "DELIM", "PAD", "VOCAB_SIZE", "MAX_AUTOMATA", "MAX_CONTEXT", "random_dfa", "minimize", "canonical",
    "accepts_walk", "sample_strings", "regbench_example", "regbench_metrics", "RegBenchDataModule", "decode",
]

N_LETTERS, DELIM, PAD = 18, 18, 19
VOCAB_SIZE = 20
MAX_AUTOMATA = 100_000
"""Most automata one split may ask for: all are generated up front in memory (~0.3 ms and ~1 KB each), so
100,000 take about 30 s; the paper's largest training set is 40,000."""
MAX_CONTEXT = 65_536
"""Most tokens a sample may hold (``context_length``, or its default ``max_strings * (max_string_len + 1)``):
samples are built token by token in Python (~10 us a token), so 65,536 tokens take ~0.7 s a sample."""


def canonical(trans: np.ndarray, start: int = 0) -> np.ndarray:
    """Keep states reachable from ``start`` and renumber them in BFS order (symbols ascending).

    ``trans [S, 18]`` int: next state or -1. Returns the renumbered ``[S', 18]`` table
    (the start state becomes 0).
    """
    order, index = [start], {start: 0}
    queue = deque([start])
    while queue:
        s = queue.popleft()
        for a in range(trans.shape[1]):
            d = int(trans[s, a])
            if d >= 0 and d not in index:
                index[d] = len(order)
                order.append(d)
                queue.append(d)
    out = np.full((len(order), trans.shape[1]), -1, dtype=np.int64)
    for s in order:
        for a in range(trans.shape[1]):
            d = int(trans[s, a])
            if d >= 0:
                out[index[s], a] = index[d]
    return out


def minimize(trans: np.ndarray) -> np.ndarray:
    """Minimal DFA of a trimmed, all-accepting partial DFA (then :func:`canonical`).

    Moore refinement: start with one block of real states (all accept) and a rejecting
    sink for missing transitions; split blocks by the blocks of their successors until
    stable; merge each block.
    """
    trans = canonical(trans)
    n, sink = trans.shape[0], trans.shape[0]
    block = np.zeros(n + 1, dtype=np.int64)
    block[sink] = 1
    while True:
        succ = np.where(trans >= 0, trans, sink)
        sigs = [(int(block[s]),) + tuple(int(block[d]) for d in succ[s]) for s in range(n)]
        sigs.append((1,) + (1,) * trans.shape[1])
        ids: dict[tuple, int] = {}
        new = np.array([ids.setdefault(sig, len(ids)) for sig in sigs], dtype=np.int64)
        if len(ids) == len(set(block.tolist())):
            break
        block = new
    nb = int(block[:n].max()) + 1
    out = np.full((nb, trans.shape[1]), -1, dtype=np.int64)
    for s in range(n):
        for a in range(trans.shape[1]):
            d = int(trans[s, a])
            if d >= 0:
                out[block[s], a] = block[d]
    return canonical(out, start=int(block[0]))


def random_dfa(rng: np.random.Generator, min_states: int = 4, max_states: int = 12, min_alphabet: int = 4,
               max_alphabet: int = N_LETTERS, min_edges: int = 1, max_edges: int = 3) -> np.ndarray:
    """A random automaton as a minimal canonical table ``[S, 18]`` (-1 = no transition)."""
    n = int(rng.integers(min_states, max_states + 1))
    alphabet = rng.choice(N_LETTERS, size=int(rng.integers(min_alphabet, max_alphabet + 1)), replace=False)
    trans = np.full((n, N_LETTERS), -1, dtype=np.int64)
    for s in range(n):
        k = min(int(rng.integers(min_edges, max_edges + 1)), n - 1, len(alphabet))
        syms = rng.choice(alphabet, size=k, replace=False)
        dests = rng.choice([o for o in range(n) if o != s], size=k, replace=False)
        trans[s, syms] = dests
    return minimize(trans)


def accepts_walk(trans: np.ndarray, string: list[int] | np.ndarray) -> bool:
    """True if every symbol of ``string`` is a valid transition from state 0 on."""
    s = 0
    for a in string:
        if a < 0 or a >= trans.shape[1] or trans[s, a] < 0:
            return False
        s = int(trans[s, a])
    return True


def sample_strings(rng: np.random.Generator, trans: np.ndarray, min_strings: int = 10, max_strings: int = 19,
                   min_len: int = 1, max_len: int = 49, max_tokens: int | None = None) -> list[list[int]]:
    """Random walks from state 0 (uniform over outgoing edges).

    With ``max_tokens`` the walks stop once ``s1 | s2 | ...`` holds that many tokens (delimiters included): the
    strings are those of the uncut draw, cut there (later random draws are not made), so
    :func:`regbench_example` with ``context_length + 1 <= max_tokens`` gives the same sample, in time bounded by
    ``max_tokens`` however large ``max_len`` or ``max_strings`` are.
    """
    out: list[list[int]] = []
    total = 0
    for _ in range(int(rng.integers(min_strings, max_strings + 1))):
        if max_tokens is not None and total >= max_tokens:
            break
        total += 1 if out else 0  # the delimiter before this string
        s, walk = 0, []
        for _ in range(int(rng.integers(min_len, max_len + 1))):
            if max_tokens is not None and total >= max_tokens:
                break
            edges = np.flatnonzero(trans[s] >= 0)
            a = int(rng.choice(edges))
            walk.append(a)
            s = int(trans[s, a])
            total += 1
        out.append(walk)
    return out


def regbench_example(trans: np.ndarray, strings: list[list[int]], context_length: int) -> dict[str, np.ndarray]:
    """Tokens of ``s1 | s2 | ...`` cut/padded to ``context_length + 1``; next-token sample.

    Returns ``inputs``/``targets`` ``[T]`` (targets ``|`` and pad -> -100) and
    ``valid_next [T, 20]`` bool (valid next symbols after ``inputs[:t+1]``).
    """
    seq: list[int] = []
    for i, s in enumerate(strings):
        seq += ([DELIM] if i else []) + list(s)
    seq = (seq + [PAD] * (context_length + 1))[: context_length + 1]
    arr = np.array(seq, dtype=np.int64)
    valid = np.zeros((context_length, VOCAB_SIZE), dtype=bool)
    s = 0
    for t in range(context_length):
        tok = arr[t]
        if tok == PAD:
            break
        s = 0 if tok == DELIM else int(trans[s, tok])
        valid[t, np.flatnonzero(trans[s] >= 0)] = True
    tgt = arr[1:].copy()
    tgt[(tgt == DELIM) | (tgt == PAD)] = -100
    return {"inputs": arr[:-1], "targets": tgt, "valid_next": valid}


def regbench_metrics(logits: torch.Tensor, targets: torch.Tensor, valid_next: torch.Tensor) -> dict:
    """Sums over scored positions (``targets != -100``).

    Args:
        logits: ``[B, T, 20]``; targets ``[B, T]``; valid_next ``[B, T, 20]`` bool.

    Returns:
        ``{"regbench_acc": (hits, n), "tvd": (tvd_sum, n)}`` as float64 tensors; ``hits``
        counts argmax in the valid set; per-position TVD is
        ``0.5 * sum_v |softmax(logits)_v - valid_v / |valid||``.
    """
    scored = targets != -100
    valid = valid_next.to(torch.bool)
    hit = valid.gather(-1, logits.argmax(-1, keepdim=True)).squeeze(-1) & scored
    p = torch.softmax(logits.double(), -1)
    u = valid.double() / valid.double().sum(-1, keepdim=True).clamp_min(1)
    tvd = 0.5 * (p - u).abs().sum(-1)
    n = scored.sum().double()
    return {"regbench_acc": (hit.sum().double(), n), "tvd": ((tvd * scored).sum(), n)}


def decode(ids) -> str:
    """ids -> text (``a..r``, ``|``, ``.``)."""
    chars = [chr(ord("a") + i) for i in range(N_LETTERS)] + ["|", "."]
    return "".join(chars[int(i)] for i in ids if 0 <= int(i) < VOCAB_SIZE)


class RegBenchDataModule(SyntheticDataModule):
    """RegBench (``task_name = "regbench"``), for :class:`~mixlab.heads.synthetic.SyntheticLM`.

    Args:
        n_train_automata, n_val_automata, n_test_automata: distinct automata per split
            (paper: 2.5k-40k train, 1,000 held out).
        min_strings, max_strings, min_string_len, max_string_len: sample shape (10..19
            strings of 1..49 symbols).
        context_length: tokens per sample (default ``max_strings * (max_string_len + 1)``).
        n_train, n_val, n_test: samples per split (each draws an automaton of its split).

    Raises:
        ValueError: fewer than 1 or more than :data:`MAX_AUTOMATA` automata for a split
            (``n_train_automata must be <= 100000 ...; got 1000000000``); string counts or lengths not
            ``1 <= min <= max``; ``context_length`` below 1 or above :data:`MAX_CONTEXT` tokens, or, with
            ``context_length`` null, ``max_strings * (max_string_len + 1)`` above it (named as the larger of the
            two options); a ``seed``, split size or ``num_workers`` refused by
            :class:`~mixlab.datamodules.synthetic.SyntheticDataModule`.
    """

    split_arguments: tuple[str, ...] = ("seed", "n_train_automata", "n_val_automata", "n_test_automata")
    """The seed and the automata counts: which automata each split holds."""

    task_name = "regbench"
    vocab_size = VOCAB_SIZE

    def __init__(self, n_train_automata: int = 2500, n_val_automata: int = 100, n_test_automata: int = 1000,
                 min_strings: int = 10, max_strings: int = 19, min_string_len: int = 1,
                 max_string_len: int = 49, context_length: int | None = None, batch_size: int = 32,
                 n_train: int = 50000, n_val: int = 256, n_test: int = 1000, seed: int = 0,
                 num_workers: int = 0,
                 cache: bool = True) -> None:
        super().__init__(batch_size, n_train, n_val, n_test, seed, num_workers, cache)
        self.save_hyperparameters()
        counts = {"train": n_train_automata, "val": n_val_automata, "test": n_test_automata}
        if min(counts.values()) < 1:
            raise ValueError(f"RegBench needs >= 1 automaton per split; got {counts}")
        for split, n in counts.items():  # generated up front: 10**9 ran for days, then out of memory
            if n > MAX_AUTOMATA:
                raise ValueError(f"n_{split}_automata must be <= {MAX_AUTOMATA} (distinct automata are generated "
                                 f"up front in memory, ~0.3 ms each; the paper's largest training set is "
                                 f"40000); got {n}")
        self.counts = counts
        for (low, lo), (high, hi) in ((("min_strings", min_strings), ("max_strings", max_strings)),
                                      (("min_string_len", min_string_len), ("max_string_len", max_string_len))):
            if not 1 <= lo <= hi:
                raise ValueError(f"data.init_args.{low} and {high} must satisfy 1 <= {low} <= {high}; got {lo}, {hi}")
        if context_length is not None and context_length < 1:  # 0 was read as "the default"
            raise ValueError(f"data.init_args.context_length must be >= 1 tokens (null: max_strings * "
                             f"(max_string_len + 1)); got {context_length}")
        if context_length is not None and context_length > MAX_CONTEXT:
            raise ValueError(f"context_length must be <= {MAX_CONTEXT} tokens (samples are built token by token, "
                             f"~10 us each); got {context_length}")
        if context_length is None and max_strings * (max_string_len + 1) > MAX_CONTEXT:
            # the default context holds every string whole: max_string_len 10**9 never made a sample
            name, value = (("max_string_len", max_string_len) if max_string_len + 1 >= max_strings
                           else ("max_strings", max_strings))
            raise ValueError(f"{name} must keep the default context_length max_strings * (max_string_len + 1) "
                             f"<= {MAX_CONTEXT} tokens (here {max_strings} * {max_string_len + 1}); set "
                             f"context_length (longer strings are cut there) or lower it; got {value}")
        self.shape = (min_strings, max_strings, min_string_len, max_string_len)
        self.context_length = max_strings * (max_string_len + 1) if context_length is None else context_length
        self._automata: dict[str, list[np.ndarray]] | None = None

    @property
    def automata(self) -> dict[str, list[np.ndarray]]:
        """Distinct automata per split (generated once, deterministic in ``seed``)."""
        if self._automata is None:
            rng = np.random.default_rng([self.seed, 4242])
            seen, pool = set(), []
            total = sum(self.counts.values())
            tries = 0
            while len(pool) < total:
                tries += 1
                if tries > 50 * total + 1000:
                    raise RuntimeError(f"RegBench: could only find {len(pool)} distinct automata of {total}")
                t = random_dfa(rng)
                key = hashlib.sha1(np.ascontiguousarray(t).tobytes() + bytes(str(t.shape), "ascii")).hexdigest()
                if key not in seen:
                    seen.add(key)
                    pool.append(t)
            a, b = self.counts["train"], self.counts["train"] + self.counts["val"]
            self._automata = {"train": pool[:a], "val": pool[a:b], "test": pool[b:]}
        return self._automata

    def setup(self, stage: str | None = None) -> None:
        self.automata  # noqa: B018  (build before the loaders fork)

    def sample(self, rng, split):
        autos = self.automata[split]
        trans = autos[int(rng.integers(len(autos)))]
        strings = sample_strings(rng, trans, *self.shape, max_tokens=self.context_length + 1)
        return regbench_example(trans, strings, self.context_length)

    @staticmethod
    def task_metrics(logits: torch.Tensor, batch: dict) -> dict:
        return regbench_metrics(logits, batch["targets"], batch["valid_next"])
