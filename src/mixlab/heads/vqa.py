"""Spatial VQA head: image patches + question words in one sequence -> answer.

Reproduces the GOAT paper's four-image spatial VQA (Litman & Guo 2026, Sec. 6 and
Tables 9-10): a model reads a 2x2 scene in some scan order and answers a spatial
question; test scan orders never appear in training. With ``coordinates="mixed"`` image
tokens carry canonical 2D coordinates and text tokens 1D positions (GOAT: ``position_args:
{axes: 3}``), so the answer cannot depend on the scan order; ``coordinates="sequence"``
gives every token its index in the flattened sequence (RoPE over the scan order, NoPE).
``causal=True`` reads the scene and the question left to right, as the paper's decoder VLM
does; a causal mask is also what lets NoPE tell positions apart at all (a bidirectional NoPE
model sees the patches as a set and cannot answer "what is at the top-left").
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import Metric

from mixlab.backbone import Backbone, BackboneConfig, pattern_name
from mixlab.coords import Coords
from mixlab.heads.common import Head, as_config, float_logits, plain_hparams
from mixlab.optim import OptimConfig

__all__ = ["SpatialVQA", "GroupedSums"]


class GroupedSums(Metric):
    """Exact per-group sums of answer NLL (nats), hits and counts (summed over ranks).

    ``update(group [B] int64, nll [B] float, hit [B] bool)``; ``compute()`` returns
    ``[n_groups, 3]`` float64 columns (nll sum, hits, count).

    Raises:
        ValueError: a group id outside ``0 .. n_groups - 1``.
    """

    full_state_update = False

    def __init__(self, n_groups: int) -> None:
        super().__init__()
        self.n_groups = n_groups
        self.add_state("sums", default=torch.zeros(n_groups, 3, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, group: Tensor, nll: Tensor, hit: Tensor) -> None:  # type: ignore[override]
        if group.numel() and (int(group.min()) < 0 or int(group.max()) >= self.n_groups):
            raise ValueError(f"group ids must be in 0..{self.n_groups - 1}; "
                             f"got {group.min().item()}..{group.max().item()}")
        vals = torch.stack([nll.double(), hit.double(), torch.ones_like(nll, dtype=torch.float64)], dim=-1)
        self.sums.index_add_(0, group.long(), vals)

    def compute(self) -> Tensor:
        return self.sums


class SpatialVQA(Head):
    """Patch + word embeddings -> :class:`~mixlab.backbone.Backbone` -> answer.

    Sequence: ``N`` image patches in the batch's scan order, then ``L`` text tokens ending
    with ``<ans>``; the answer logits come from the final hidden state of ``<ans>``.

    Batch (dict, see :class:`mixlab.datamodules.spatial_vqa.SpatialVQADataset`):
    ``patches`` float ``[B, N, patch_dim]``, ``text`` int64 ``[B, L]``, ``coords`` int64
    ``[B, N + L, 3]`` (sequence, y, x), ``coord_mask`` bool ``[B, N + L, 3]``, ``order``
    int64 ``[B]`` (scan-order id), ``qtype`` int64 ``[B]``, ``answer`` int64 ``[B]``.

    Logged: ``train/loss`` (mean answer NLL, nats), ``train/acc``; ``val/loss``,
    ``val/acc``; ``test/loss``, ``test/acc``, ``test/loss_seen``, ``test/acc_seen``,
    ``test/loss_heldout``, ``test/acc_heldout``, per scan order ``test/acc_order/<name>``
    and ``test/nll_order/<name>``, per question type ``test/acc_q/<type>``. All are exact
    sums over the epoch (not means of batch means); accuracy is exact answer match.

    Args:
        vocab_size: word ids (checked against the datamodule).
        n_answers: answer classes (checked against the datamodule).
        patch_dim: flattened patch size ``C p p`` (digits 4x4 grey: 16; CIFAR-10 8x8 RGB: 192).
        backbone: :class:`BackboneConfig` (its ``causal`` is replaced by this head's ``causal``).
        optim: :class:`OptimConfig`.
        coordinates: ``"mixed"`` (the batch's 3-axis coordinates: needs position schemes
            with ``axes: 3``) or ``"sequence"`` (``Coords.seq(T)``: the scan index).
        max_orders / max_qtypes: sizes of the per-group metric tables.
        causal: decoder (causal mask; the answer is read at the last token, which sees the
            whole sequence) instead of the default bidirectional encoder.

    Raises:
        ValueError: unknown ``coordinates``; ``coordinates="mixed"`` with a position
            scheme that does not read 3 axes; sizes that do not match the datamodule.
    """

    legacy_defaults = {"causal": False}
    """Options absent from checkpoints written before they existed, with the value those were trained with
    (read by the CLI when a checkpoint's hyperparameters replace the config's)."""

    def __init__(
        self,
        vocab_size: int = 26,
        n_answers: int = 14,
        patch_dim: int = 16,
        backbone: BackboneConfig | None = None,
        optim: OptimConfig | None = None,
        coordinates: Literal["mixed", "sequence"] = "mixed",
        max_orders: int = 64,
        max_qtypes: int = 8,
        causal: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        plain_hparams(self)  # checkpoints reload with weights_only=True
        backbone, optim = as_config(BackboneConfig, backbone), as_config(OptimConfig, optim)
        backbone.causal = bool(causal)
        if coordinates not in ("mixed", "sequence"):
            raise ValueError(f"model.init_args.coordinates must be 'mixed' or 'sequence'; got {coordinates!r}")
        self.vocab_size, self.n_answers, self.patch_dim = vocab_size, n_answers, patch_dim
        self.coordinates, self.optim_cfg = coordinates, optim
        d = backbone.d_model
        self.patch_embed = nn.Linear(patch_dim, d)
        self.text_embed = nn.Embedding(vocab_size, d)
        self.backbone = Backbone(backbone)
        self.answer_head = nn.Linear(d, n_answers)
        for lin in (self.patch_embed, self.answer_head):
            nn.init.normal_(lin.weight, 0.0, backbone.init_std)
            nn.init.zeros_(lin.bias)
        nn.init.normal_(self.text_embed.weight, 0.0, backbone.init_std)
        if coordinates == "mixed":
            for blk in self.backbone.blocks:
                axes = blk.mixer.position_axes
                if axes is not None and axes != 3:
                    raise ValueError(
                        f"coordinates='mixed' passes 3 axes (sequence, y, x) but mixer {blk.mixer_name!r} reads "
                        f"{axes}; set model.init_args.backbone.mixer_args.{blk.mixer_name}.position_args.axes: 3 "
                        f"or coordinates: sequence")
        self.run_name = pattern_name(backbone.mixer)
        self.order_names = [f"order{i}" for i in range(max_orders)]
        self.qtype_names = [f"q{i}" for i in range(max_qtypes)]
        self.heldout_ids: list[int] = []
        self.metric_orders = nn.ModuleDict({s: GroupedSums(max_orders) for s in ("val", "test")})
        self.metric_qtypes = nn.ModuleDict({s: GroupedSums(max_qtypes) for s in ("val", "test")})

    # ------------------------------------------------------------------ model
    def coords(self, batch: dict[str, Tensor]) -> Coords:
        """Token coordinates of a batch: mixed ``[B, T, 3]`` or ``Coords.seq(T)``."""
        if self.coordinates == "mixed":
            return Coords(batch["coords"], batch["coord_mask"])
        t = batch["patches"].shape[1] + batch["text"].shape[1]
        return Coords.seq(t, device=batch["text"].device)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        """Batch dict -> answer logits ``[B, n_answers]`` float32 (float64 for a float64 model)."""
        x = torch.cat([self.patch_embed(batch["patches"]), self.text_embed(batch["text"])], dim=1)  # [B, T, D]
        h = self.backbone(x, self.coords(batch))
        return float_logits(self.answer_head(h[:, -1]))

    @staticmethod
    def batch_tokens(batch: dict[str, Tensor]) -> int:
        """Tokens per batch (image patches + text), for throughput."""
        return batch["text"].shape[0] * (batch["patches"].shape[1] + batch["text"].shape[1])

    def _step(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        logits = self(batch)
        nll = F.cross_entropy(logits, batch["answer"], reduction="none")
        return nll, logits.argmax(-1) == batch["answer"]

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, stage: str) -> None:
        if self.data is None:
            return
        mine_sizes = (("vocab_size", self.vocab_size), ("n_answers", self.n_answers), ("patch_dim", self.patch_dim))
        for field, mine in mine_sizes:
            theirs = self.data_attr(field)
            if theirs is not None and theirs != mine:
                raise ValueError(f"model.init_args.{field}={mine} does not match the datamodule's {field}={theirs} "
                                 f"({type(self.data).__name__}); set model.init_args.{field}: {theirs}")
        names = list(self.data_attr("order_names", []))
        if len(names) > len(self.order_names):
            raise ValueError(f"{len(names)} scan orders exceed model.init_args.max_orders={len(self.order_names)}")
        self.order_names[: len(names)] = names
        self.heldout_ids = list(self.data_attr("heldout_order_ids", []))
        qtypes = list(self.data_attr("question_types", []))
        if len(qtypes) > len(self.qtype_names):
            raise ValueError(f"{len(qtypes)} question types exceed model.init_args.max_qtypes={len(self.qtype_names)}")
        self.qtype_names[: len(qtypes)] = qtypes

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        nll, hits = self._step(batch)
        loss = nll.mean()
        self.log_train_loss(loss)
        self.log("train/acc", hits.float().mean())
        return loss

    def _eval_step(self, batch: dict[str, Tensor], stage: str) -> None:
        nll, hits = self._step(batch)
        self.metric_orders[stage].update(batch["order"], nll, hits)
        self.metric_qtypes[stage].update(batch["qtype"], nll, hits)

    @staticmethod
    def _ratio(sums: Tensor) -> tuple[Tensor, Tensor]:
        """``[*, 3]`` (nll, hits, count) sums -> (mean NLL, accuracy)."""
        n = sums[..., 2].clamp_min(1)
        return sums[..., 0] / n, sums[..., 1] / n

    def _eval_epoch_end(self, stage: str) -> None:
        per_order = self.metric_orders[stage].compute()  # [max_orders, 3]
        per_q = self.metric_qtypes[stage].compute()
        loss, acc = self._ratio(per_order.sum(0))
        metrics = {f"{stage}/loss": loss, f"{stage}/acc": acc}
        if stage == "test":
            held = torch.zeros(per_order.shape[0], dtype=torch.bool, device=per_order.device)
            held[self.heldout_ids] = True
            seen_sums, held_sums = per_order[~held].sum(0), per_order[held].sum(0)
            if seen_sums[2] > 0:
                metrics["test/loss_seen"], metrics["test/acc_seen"] = self._ratio(seen_sums)
            if held_sums[2] > 0:
                metrics["test/loss_heldout"], metrics["test/acc_heldout"] = self._ratio(held_sums)
            for i, name in enumerate(self.order_names):
                if per_order[i, 2] > 0:
                    metrics[f"test/nll_order/{name}"], metrics[f"test/acc_order/{name}"] = self._ratio(per_order[i])
            for i, name in enumerate(self.qtype_names):
                if per_q[i, 2] > 0:
                    metrics[f"test/acc_q/{name}"] = self._ratio(per_q[i])[1]
        self.log_dict({k: v.float() for k, v in metrics.items()}, prog_bar=stage == "val", sync_dist=False)
        self.metric_orders[stage].reset()
        self.metric_qtypes[stage].reset()
