"""Copy-mixture (GOAT Fig. 1): each token copies the first token, copies the previous one, or is noise.

Our choice of the (caption-only) task: ``x_0`` uniform over ``vocab_size`` tokens; for
``t >= 1``, independently, ``x_t = x_0`` with probability ``p_first`` (default 0.3),
``x_t = x_{t-1}`` with ``p_prev`` (0.3), else uniform noise (``1 - p_first - p_prev``).
The mode is hidden, so the Bayes-optimal predictor is the mixture
``p(x_t) = p_first 1[x_t = x_0] + p_prev 1[x_t = x_{t-1}] + p_noise / V``: an attention
layer solves it by routing to key 0 (a key-only default) and to the previous key (a
relative offset), which is exactly the split GOAT's prior exposes
(``python -m mixlab copy-prior``). Every next token is trained and scored; the
datamodule's task metrics ``opt_nll`` (Bayes NLL) and ``excess_nll`` (model minus Bayes,
nats/token, 0 is optimal) are logged.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from mixlab.datamodules.synthetic import SyntheticDataModule

__all__ = ["copy_mixture_example", "CopyMixtureDataModule"]


def copy_mixture_example(rng: np.random.Generator, length: int, vocab_size: int, p_first: float,
                         p_prev: float) -> dict[str, np.ndarray]:
    """``inputs``/``targets`` ``[length]`` (next tokens) and ``opt_nll [length]`` (Bayes NLL per target)."""
    x = np.empty(length + 1, dtype=np.int64)
    x[0] = rng.integers(vocab_size)
    mode = rng.random(length)
    noise = rng.integers(vocab_size, size=length)
    for t in range(1, length + 1):
        m = mode[t - 1]
        x[t] = x[0] if m < p_first else (x[t - 1] if m < p_first + p_prev else noise[t - 1])
    tgt, prev = x[1:], x[:-1]
    p = p_first * (tgt == x[0]) + p_prev * (tgt == prev) + (1 - p_first - p_prev) / vocab_size
    return {"inputs": x[:-1], "targets": tgt.copy(), "opt_nll": -np.log(p)}


class CopyMixtureDataModule(SyntheticDataModule):
    """Copy-mixture sequences (``task_name = "copy_mixture"``).

    Args:
        length: tokens per sequence.
        vocab: token count V (``vocab_size``; named so it does not clash with the model's).
        p_first, p_prev: mixture probabilities (noise gets the rest).

    Raises:
        ValueError: ``length`` or ``vocab`` below 1 (``length must be >= 1; got 0``); probabilities outside
            ``[0, 1]`` or summing above 1; a ``seed``, split size or ``num_workers`` refused by
            :class:`~mixlab.datamodules.synthetic.SyntheticDataModule`.
    """

    task_name = "copy_mixture"

    def __init__(self, length: int = 64, vocab: int = 16, p_first: float = 0.3, p_prev: float = 0.3,
                 batch_size: int = 32, n_train: int = 20000, n_val: int = 256, n_test: int = 1024,
                 seed: int = 0, num_workers: int = 0,
                 cache: bool = True) -> None:
        super().__init__(batch_size, n_train, n_val, n_test, seed, num_workers, cache)
        self.save_hyperparameters()
        for name, value in (("length", length), ("vocab", vocab)):  # 0: numpy's "high <= 0", an empty batch
            if value < 1:
                raise ValueError(f"{name} must be >= 1; got {value}")
        if not (p_first >= 0 and p_prev >= 0 and p_first + p_prev <= 1):  # NaN fails too
            raise ValueError(f"copy-mixture needs p_first, p_prev >= 0 and p_first + p_prev <= 1; "
                             f"got {p_first}, {p_prev}")
        self.length, self.vocab_size, self.p_first, self.p_prev = length, vocab, p_first, p_prev

    def sample(self, rng, split):
        return copy_mixture_example(rng, self.length, self.vocab_size, self.p_first, self.p_prev)

    @staticmethod
    def task_metrics(logits: torch.Tensor, batch: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``opt_nll`` and ``excess_nll`` sums over all targets (nats)."""
        nll = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), reduction="none")
        opt = batch["opt_nll"].flatten().to(nll)
        n = torch.tensor(float(nll.numel()))
        return {"opt_nll": (opt.sum(), n), "excess_nll": ((nll - opt).sum(), n)}
