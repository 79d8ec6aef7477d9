"""Parity (state tracking): the label of a bit string is the parity of its 2s.

Tokens: 0 pad, bits 1 and 2 (``vocab_size = 3``). A string of length ``n`` (uniform in
``[min_len, max_len]``, training 3..40, test 40..256) has ``n - 1`` random bits at
positions ``0..n-2``; the answer ``1 + (count(2) mod 2)`` (1: even, 2: odd) is the target
at the last bit's position only, so ``acc`` is final-token accuracy (chance 50%). Inputs
are padded with 0 after the bits (causal models never see the padding before the answer).
"""

from __future__ import annotations

import numpy as np
import torch

from mixlab.datamodules.synthetic import SyntheticDataModule

__all__ = ["parity_example", "ParityDataModule"]


def parity_example(rng: np.random.Generator, min_len: int, max_len: int, context: int) -> dict[str, np.ndarray]:
    """One sample: ``inputs [context]`` int64 bits + pad, ``targets [context]`` (-100 but the answer).

    Raises:
        ValueError: ``max_len - 1 > context`` or ``min_len < 2``.
    """
    if min_len < 2 or max_len < min_len or max_len - 1 > context:
        raise ValueError(f"parity lengths must satisfy 2 <= min_len <= max_len <= context + 1; "
                         f"got min_len={min_len}, max_len={max_len}, context={context}")
    n = int(rng.integers(min_len, max_len + 1))
    bits = rng.integers(1, 3, size=n - 1)
    inputs = np.zeros(context, dtype=np.int64)
    inputs[: n - 1] = bits
    targets = np.full(context, -100, dtype=np.int64)
    targets[n - 2] = 1 + int((bits == 2).sum() % 2)
    return {"inputs": inputs, "targets": targets}


class ParityDataModule(SyntheticDataModule):
    """Parity with length generalisation (``task_name = "parity"``).

    Args:
        train_min_len, train_max_len: training string lengths ``n`` (3..40).
        test_min_len, test_max_len: val/test lengths (40..256); val and test share them.
        Other args: :class:`~mixlab.datamodules.synthetic.SyntheticDataModule`.
    """

    task_name = "parity"
    vocab_size = 3

    def __init__(self, train_min_len: int = 3, train_max_len: int = 40, test_min_len: int = 40,
                 test_max_len: int = 256, batch_size: int = 256, n_train: int = 100_000, n_val: int = 512,
                 n_test: int = 2048, seed: int = 0, num_workers: int = 0,
                 cache: bool = True) -> None:
        super().__init__(batch_size, n_train, n_val, n_test, seed, num_workers, cache)
        self.save_hyperparameters()
        self.train_len, self.test_len = (train_min_len, train_max_len), (test_min_len, test_max_len)
        for lo, hi in (self.train_len, self.test_len):
            if lo < 2 or hi < lo:
                raise ValueError(f"parity lengths must satisfy 2 <= min <= max; got {lo}..{hi}")

    def sample(self, rng, split):
        lo, hi = self.train_len if split == "train" else self.test_len
        return parity_example(rng, lo, hi, hi - 1)

    def length_buckets(self) -> list[tuple[int, int]]:
        """Four equal ranges of the val/test string lengths ``n`` (inclusive), shortest first."""
        lo, hi = self.test_len
        edges = [lo + round(i * (hi - lo + 1) / 4) for i in range(5)]
        return [(a, b - 1) for a, b in zip(edges[:-1], edges[1:]) if b > a]

    def task_metrics(self, logits: torch.Tensor, batch: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Answer accuracy per quarter of the test length range, ``acc_len_<lo>_<hi>`` (hits, count): the
        longest quarter is the length-generalisation number (e.g. lengths 202..256 of 40..256)."""
        tgt = batch.get("eval_targets", batch["targets"])
        pos = (tgt != -100).int().argmax(-1)  # the answer's position: n - 2 for a string of length n
        n = pos + 2
        hit = logits.argmax(-1).gather(1, pos[:, None]).squeeze(1) == tgt.gather(1, pos[:, None]).squeeze(1)
        out = {}
        for a, b in self.length_buckets():
            sel = (n >= a) & (n <= b)
            out[f"acc_len_{a}_{b}"] = ((hit & sel).sum().double(), sel.sum().double())
        return out
