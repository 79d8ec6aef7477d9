"""Causal LM for synthetic tasks: explicit per-position targets and task metrics.

Batches are dicts from the synthetic datamodules (``mixlab.datamodules.{mad, regbench,
parity, copy_mixture, retrieval}``):

* ``inputs``  ``LongTensor [B, T]`` token ids;
* ``targets`` ``LongTensor [B, T]``: what the model must output AT each input position
  (``-100`` = not trained); for next-token tasks ``targets[:, t] = tokens[:, t + 1]``;
* ``eval_targets`` (optional) ``[B, T]``: the scored positions for val/test (MAD recall
  trains on every token but scores only the recall answers); default ``targets``;
* ``span`` (optional) ``[B, T]`` bool: answer span (passkey / NIAH); with
  ``span_weight = w`` the training loss is ``(mean NLL + w * mean span NLL) / (1 + w)``
  (GOAT's passkey loss uses ``w = 10``);
* any extra tensors the datamodule's ``task_metrics`` needs.

Plain ``LongTensor [B, L + 1]`` batches (text) are accepted too.

Logged at val/test (exact sums over the epoch): ``loss``, ``ppl``, ``acc`` (micro:
correct scored tokens / scored tokens), ``acc_macro`` (torchmetrics
``MulticlassAccuracy(average="macro", ignore_index=-100)``, the MAD reference metric:
mean over classes of per-class recall, over the classes that occur as a scored target or
as a prediction at a scored position; a predicted-only class counts 0) and every ``name`` returned by the datamodule's
``task_metrics(logits, batch) -> {name: (sum, count)}`` as ``sum / count``.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn
from torchmetrics import SumMetric
from torchmetrics.classification import MulticlassAccuracy

from mixlab.backbone import BackboneConfig
from mixlab.coords import Coords
from mixlab.heads.common import float_logits
from mixlab.heads.lm import CausalLM, token_nll
from mixlab.optim import OptimConfig

__all__ = ["SyntheticLM", "split_batch"]


def split_batch(batch) -> tuple[Tensor, Tensor, dict]:
    """``(inputs [B, T], targets [B, T], batch dict)`` from a dict or a ``[B, L + 1]`` tensor.

    Raises:
        ValueError: a tensor batch that is not 2-D, or a dict without ``inputs``/``targets``.
    """
    if isinstance(batch, dict):
        if "inputs" not in batch or "targets" not in batch:
            raise ValueError(f"synthetic batches need 'inputs' and 'targets'; got keys {sorted(batch)}")
        return batch["inputs"], batch["targets"], batch
    if batch.dim() != 2:
        raise ValueError(f"expected LongTensor [B, L+1] or a dict batch; got shape {tuple(batch.shape)}")
    return batch[:, :-1], batch[:, 1:], {"inputs": batch[:, :-1], "targets": batch[:, 1:]}


class SyntheticLM(CausalLM):
    """:class:`~mixlab.heads.lm.CausalLM` with explicit targets, macro accuracy and task metrics.

    Args:
        vocab_size, backbone, optim, tie_embeddings, abs_pos_len, loss_chunk_tokens: as :class:`CausalLM`
            (the training loss of ``decoder="lm"`` is chunked; evaluation needs the whole logits for
            the task metrics).
        span_weight: extra weight ``w`` of the answer-span NLL (batches with ``span``).
        decoder: ``"lm"`` (per-position output) or ``"compression"`` (MAD compression:
            the last hidden state plus a learned position embedding goes through an MLP
            decoder that reconstructs every position; needs ``max_len``).
        max_len: positions of the compression decoder.

    Raises:
        ValueError: ``decoder="compression"`` without ``max_len``; unknown decoder. In ``setup``, as
            :class:`CausalLM` (vocabulary), and for the compression decoder a datamodule whose ``seq_len`` exceeds
            ``max_len`` (``max_len must be >= the datamodule's seq_len 64 ...; got 32``); in ``forward``, a
            compression input longer than ``max_len``.
    """

    def __init__(
        self,
        vocab_size: int = 16,
        backbone: BackboneConfig | None = None,
        optim: OptimConfig | None = None,
        tie_embeddings: bool = True,
        abs_pos_len: int = 0,
        span_weight: float = 0.0,
        decoder: Literal["lm", "compression"] = "lm",
        max_len: int = 0,
        loss_chunk_tokens: int | None = None,
    ) -> None:
        super().__init__(vocab_size, backbone, optim, tie_embeddings, abs_pos_len, loss_chunk_tokens)
        if decoder not in ("lm", "compression"):
            raise ValueError(f"SyntheticLM decoder must be 'lm' or 'compression'; got {decoder!r}")
        self.span_weight, self.decoder = float(span_weight), decoder
        d = self.embed.embedding_dim
        if decoder == "compression":
            if max_len <= 0:
                raise ValueError("SyntheticLM(decoder='compression') needs max_len > 0 (the sequence length)")
            self.dec_pos = nn.Embedding(max_len, d)
            self.dec_mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
            nn.init.normal_(self.dec_pos.weight, 0.0, 0.02)
        self.acc_macro = nn.ModuleDict({s: MulticlassAccuracy(vocab_size, average="macro", ignore_index=-100)
                                        for s in ("val", "test")})
        self.task_sums = nn.ModuleDict()
        self._task_metrics = None

    def forward(self, tokens: Tensor, coords: Coords | None = None, caches: list[dict] | None = None) -> Tensor:
        """``tokens [B, T]`` -> logits ``[B, T, vocab]`` float32 (float64 for a float64 model)."""
        if self.decoder == "lm":
            return super().forward(tokens, coords, caches)
        t = tokens.shape[1]
        if t > self.dec_pos.num_embeddings:  # else a shape mismatch deep in the loss
            raise ValueError(f"sequence of {t} tokens exceeds max_len={self.dec_pos.num_embeddings} (the compression "
                             f"decoder's positions)")
        h = self.backbone(self.embed(tokens), coords, caches)  # [B, T, D]
        z = h[:, -1:, :] + self.dec_pos.weight[:t].unsqueeze(0)
        return float_logits(self.lm_head(self.dec_mlp(z)))

    @staticmethod
    def batch_tokens(batch) -> int:
        return split_batch(batch)[0].numel()

    def _nll(self, batch) -> tuple[Tensor, Tensor, Tensor]:
        inp, tgt, _ = split_batch(batch)
        return self.scores(inp, tgt)

    def scores(self, inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self.decoder != "lm":
            return token_nll(self(inputs), targets)
        return super().scores(inputs, targets)

    def setup(self, stage: str) -> None:
        super().setup(stage)
        seq_len = self.data_attr("seq_len") if self.decoder == "compression" else None
        if isinstance(seq_len, int) and seq_len > self.dec_pos.num_embeddings:  # MAD compression's data length
            raise ValueError(f"max_len must be >= the datamodule's seq_len {seq_len} (the compression decoder "
                             f"reconstructs every position; raise max_len or lower data.init_args.seq_len); "
                             f"got {self.dec_pos.num_embeddings}")
        self._task_metrics = self.data_attr("task_metrics")  # looked up once, not per batch

    def teardown(self, stage: str) -> None:
        self._task_metrics = None  # a bound method of the datamodule: do not keep it alive with the model

    def training_step(self, batch, batch_idx: int) -> Tensor:
        inp, tgt, b = split_batch(batch)
        nll, valid, hits = self.scores(inp, tgt)
        n = valid.sum().clamp_min(1)
        loss = nll.sum() / n
        if self.span_weight > 0 and "span" in b:
            span = b["span"].flatten() & valid
            loss = (loss + self.span_weight * (nll * span).sum() / span.sum().clamp_min(1)) / (1 + self.span_weight)
        self.log_train_loss(loss)
        self.log("train/acc", hits.sum() / n)
        return loss

    def _task_sum(self, name: str) -> SumMetric:
        if name not in self.task_sums:
            self.task_sums[name] = SumMetric().to(self.device)
        return self.task_sums[name]

    def _eval_step(self, batch, stage: str) -> None:
        inp, _, b = split_batch(batch)
        tgt = b.get("eval_targets", b["targets"])
        logits = self(inp)
        nll, valid, hits = token_nll(logits, tgt)
        self._update_sums(stage, nll, valid, hits)
        if valid.any():
            self.acc_macro[stage].update(logits.argmax(-1).flatten(), tgt.flatten())
        if self._task_metrics is not None:
            for name, (s, c) in self._task_metrics(logits, b).items():
                self._task_sum(f"{stage}_{name}_sum").update(torch.as_tensor(s, dtype=torch.float64))
                self._task_sum(f"{stage}_{name}_count").update(torch.as_tensor(c, dtype=torch.float64))

    def _eval_epoch_end(self, stage: str) -> None:
        super()._eval_epoch_end(stage)
        extra = {f"{stage}/acc_macro": self.acc_macro[stage].compute().float()}
        self.acc_macro[stage].reset()
        for key in list(self.task_sums):
            if key.startswith(f"{stage}_") and key.endswith("_sum"):
                name = key[len(stage) + 1:-4]
                s, c = self.task_sums[key], self.task_sums[f"{stage}_{name}_count"]
                extra[f"{stage}/{name}"] = (s.compute() / c.compute().clamp_min(1)).float()
                s.reset()
                c.reset()
        self.log_dict(extra, sync_dist=False)
