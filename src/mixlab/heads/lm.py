"""Causal language-model head (tokens -> next-token NLL) for DNA, text and synthetic tasks."""

from __future__ import annotations

import functools
import logging
import math
import os

import torch
from torch import Tensor, nn
from torchmetrics import SumMetric

from mixlab.backbone import Backbone, BackboneConfig, pattern_name
from mixlab.coords import Coords
from mixlab.heads.common import Head, as_config, float_logits, plain_hparams
from mixlab.heads.loss import LOSS_KERNELS, fused_linear_cross_entropy, linear_cross_entropy, token_nll
from mixlab.optim import OptimConfig

__all__ = ["CausalLM", "token_nll", "pattern_name", "AUTO_CHUNK_TOKENS", "AUTO_CHUNK_MIN_VOCAB"]

log = logging.getLogger(__name__)

AUTO_CHUNK_TOKENS = 4096
"""Tokens per loss chunk when ``loss_chunk_tokens`` is left at None and the vocabulary is large."""
AUTO_CHUNK_MIN_VOCAB = 8192
"""Smallest vocabulary for which ``loss_chunk_tokens=None`` chunks the loss (GPT-2's 50257 does, DNA's 5 not)."""


class CausalLM(Head):
    """Decoder LM: token embedding -> :class:`~mixlab.backbone.Backbone` -> tied/untied output.

    Batches are ``LongTensor [B, L + 1]`` token ids; inputs are ``[:, :-1]``, targets
    ``[:, 1:]``. Targets equal to ``ignore_index`` (-100) are not scored.

    Logged (``train/`` per step, ``val/`` and ``test/`` per epoch, exact over all tokens
    and ranks: sums of NLL, tokens and hits, not means of means):
    ``loss`` (mean NLL, nats/token), ``ppl`` (exp loss), ``bits_per_token`` (loss/ln 2),
    ``bits_per_<unit>`` when the datamodule's ``token_unit`` is not ``"token"`` (DNA:
    ``bits_per_base``), ``acc`` (top-1 next-token accuracy). Throughput and peak memory
    come from :class:`mixlab.callbacks.ThroughputMemory`.

    Args:
        vocab_size: number of token ids (DNA: 5). Checked against the datamodule.
        backbone: :class:`BackboneConfig` (``causal`` is forced to True).
        optim: :class:`OptimConfig`.
        tie_embeddings: share the input embedding and output matrix.
        abs_pos_len: > 0 adds learned absolute position embeddings for up to this many
            tokens (the "learned absolute" baseline; combine with ``mixer: nope``).
        loss_chunk_tokens: training and evaluation losses compute the output layer and the cross
            entropy this many tokens at a time, so the ``[B*T, vocab]`` float32 logits never exist
            whole (training, :meth:`mean_loss`: :func:`mixlab.heads.loss.fused_linear_cross_entropy`,
            each chunk's gradients formed in forward, no recomputation; per-token scores,
            :meth:`scores`: :func:`mixlab.heads.loss.linear_cross_entropy`, each chunk recomputed in
            backward where a gradient is asked for); ``0`` never chunks; ``None`` (default) chunks by
            :data:`AUTO_CHUNK_TOKENS` tokens for vocabularies of at least :data:`AUTO_CHUNK_MIN_VOCAB`
            ids and never for smaller ones. Same loss and gradients either way; :meth:`forward` still
            returns the whole logits.
        loss_kernel: the chunked training loss's cross-entropy kernel (``kernel`` of
            :func:`~mixlab.heads.loss.fused_linear_cross_entropy`): ``"auto"`` (default: ``"fla"`` where it
            applies, on CUDA with bf16 or float32 matmuls, else ``"torch"``), ``"torch"`` (float32 logits, any
            device), ``"fla"`` (fla's Triton kernels over the bf16 logits: fewer passes over the
            ``[chunk, vocab]`` buffer; CUDA, bf16 or float32 matmuls; needs ``loss_chunk_tokens > 0``).
            Same loss to float32 rounding. On one H200 (124M model, BENCHMARKS.md, ninth session) ``fla``
            trains 1.30x faster than ``torch`` at 0.85x its peak memory.
            :class:`~mixlab.heads.synthetic.SyntheticLM` trains through :meth:`scores` and has no such option.
        compile: the whole model compiled: the training step's loss (:meth:`mean_loss`: embedding, backbone, output
            layer, cross entropy) and the validation/test scores (:meth:`scores`) each run through ``torch.compile``
            (``dynamic=False``: a last partial batch compiles once more) on CUDA; CPU runs stay eager (logged once) and
            unchanged. Compiled, ``loss_chunk_tokens: null`` means whole logits (0): Inductor fuses the whole-logits
            cross entropy, while the chunked fused loss breaks the graph. On one H200 the 124M GOAT model trains at 455k
            tokens/s, 0.97x a textbook GPT compiled whole, at its peak memory; with ``backbone.compile: true``
            (blocks compiled one by one) at 0.78-0.83x (BENCHMARKS.md, sixteenth and seventeenth sessions). Excludes
            ``backbone.compile``. Same parameters and checkpoints.

    Raises:
        ValueError: vocab mismatch with the datamodule; a negative ``abs_pos_len`` or a sequence longer than
            it; a negative ``loss_chunk_tokens``; ``loss_kernel`` not torch, fla or auto, or ``fla``
            without chunking; ``compile`` together with ``backbone.compile``; at fit start, ``fla`` off CUDA or
            under float16 precision.
    """

    def __init__(
        self,
        vocab_size: int = 5,
        backbone: BackboneConfig | None = None,
        optim: OptimConfig | None = None,
        tie_embeddings: bool = True,
        abs_pos_len: int = 0,
        loss_chunk_tokens: int | None = None,
        loss_kernel: str = "auto",
        compile: bool = False,
    ) -> None:
        super().__init__()
        if abs_pos_len < 0:
            raise ValueError(f"abs_pos_len must be >= 0 (0: no learned absolute positions); got {abs_pos_len}")
        if loss_chunk_tokens is not None and loss_chunk_tokens < 0:
            raise ValueError(f"loss_chunk_tokens must be >= 0 (0: no chunking) or null (automatic); "
                             f"got {loss_chunk_tokens}")
        if loss_kernel not in LOSS_KERNELS:
            raise ValueError(f"loss_kernel must be one of {', '.join(LOSS_KERNELS)}; got {loss_kernel!r}")
        self.save_hyperparameters()
        plain_hparams(self)
        backbone, optim = as_config(BackboneConfig, backbone), as_config(OptimConfig, optim)
        backbone.causal = True
        if compile and backbone.compile:
            raise ValueError("model.init_args.compile: true compiles the whole model, backbone.compile: true its "
                             "blocks one by one; set only one of them")
        self.compile_model = bool(compile)  # (``self.compile`` is nn.Module's method)
        self.vocab_size, self.optim_cfg = vocab_size, optim
        self.embed = nn.Embedding(vocab_size, backbone.d_model)
        self.abs_pos = nn.Embedding(abs_pos_len, backbone.d_model) if abs_pos_len > 0 else None
        self.backbone = Backbone(backbone)
        self.lm_head = nn.Linear(backbone.d_model, vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, 0.0, backbone.init_std)
        if self.abs_pos is not None:
            nn.init.normal_(self.abs_pos.weight, 0.0, backbone.init_std)
        if tie_embeddings:
            self.lm_head.weight = self.embed.weight
        else:
            nn.init.normal_(self.lm_head.weight, 0.0, backbone.init_std)
        automatic = loss_chunk_tokens is None
        if automatic:
            loss_chunk_tokens = AUTO_CHUNK_TOKENS if vocab_size >= AUTO_CHUNK_MIN_VOCAB else 0
        if loss_kernel == "fla" and not loss_chunk_tokens:
            raise ValueError(f"loss_kernel 'fla' runs inside the chunked training loss, but loss_chunk_tokens is 0 "
                             f"(automatic chunking starts at a vocabulary of {AUTO_CHUNK_MIN_VOCAB}; this one has "
                             f"{vocab_size}): set loss_chunk_tokens > 0, or loss_kernel 'torch' or 'auto'")
        self.loss_chunk_tokens, self.loss_kernel = loss_chunk_tokens, loss_kernel
        # the compiled training loss (CUDA): whole logits when chunking is automatic (Inductor fuses the
        # whole-logits cross entropy; the chunked fused loss breaks the graph), except for fla's chunked kernels
        self.compiled_chunk_tokens = 0 if automatic and loss_kernel != "fla" else loss_chunk_tokens
        self.run_name = pattern_name(backbone.mixer) + ("-ape" if abs_pos_len > 0 else "")
        self.token_unit = "token"
        self.metric_sums = nn.ModuleDict(
            {f"{s}_{k}": SumMetric() for s in ("val", "test") for k in ("nll", "count", "hits")}
        )

    # ------------------------------------------------------------------ model
    def forward(self, tokens: Tensor, coords: Coords | None = None, caches: list[dict] | None = None) -> Tensor:
        """``tokens [B, T]`` int64 -> logits ``[B, T, vocab]`` (float32; float64 for a float64 model).

        With ``caches`` (one dict per layer, filled in place) successive calls continue the sequence:
        a prompt's parallel forward then one token per call equals the parallel forward of it all.
        """
        return float_logits(self.lm_head(self.hidden(tokens, coords, caches)))

    def hidden(self, tokens: Tensor, coords: Coords | None = None, caches: list[dict] | None = None) -> Tensor:
        """``tokens [B, T]`` int64 -> final hidden states ``[B, T, D]`` (after the backbone's final norm;
        the input of ``lm_head``).

        Raises:
            ValueError: the sequence (with ``caches``: so far) is longer than ``abs_pos_len``.
        """
        x = self.embed(tokens)
        if self.abs_pos is not None:
            # decoding position kept by the head itself (layer 0 may be a recurrent mixer with no KV length)
            start = caches[0].get("head_position", 0) if caches else 0
            end = start + tokens.shape[1]
            if end > self.abs_pos.num_embeddings:
                raise ValueError(f"sequence of {end} tokens exceeds abs_pos_len={self.abs_pos.num_embeddings}")
            x = x + self.abs_pos.weight[start:end]
            if caches:
                caches[0]["head_position"] = end
        return self.backbone(x, coords, caches)

    @staticmethod
    def batch_tokens(batch: Tensor) -> int:
        """Scored tokens in a batch (for throughput)."""
        return batch.shape[0] * (batch.shape[1] - 1)

    @staticmethod
    def _split(batch: Tensor) -> tuple[Tensor, Tensor]:
        if batch.dim() != 2:
            raise ValueError(f"CausalLM expects LongTensor [B, L+1] batches; got shape {tuple(batch.shape)}")
        return batch[:, :-1], batch[:, 1:]

    def _nll(self, batch: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The evaluation scores of a batch (:meth:`scores`, compiled where ``compile`` says)."""
        inputs, targets = self._split(batch)
        return self._step_fn("scores", inputs.device)(inputs, targets)

    def _step_fn(self, name: str, device: torch.device):
        """The method ``name`` (``"mean_loss"`` or ``"scores"``), through ``torch.compile`` when ``compile`` is set
        and the model is on CUDA (built once per method, kept out of the module tree)."""
        fn = getattr(self, name)
        if not self.compile_model:
            return fn
        if device.type != "cuda":
            self.compile_notice(device)
            return fn
        compiled = self.__dict__.setdefault("_compiled_fns", {})
        if name not in compiled:
            if name == "mean_loss":
                fn = functools.partial(fn, chunk_tokens=self.compiled_chunk_tokens)
            compiled[name] = torch.compile(fn, dynamic=False)
        return compiled[name]

    def compile_notice(self, device: torch.device) -> None:
        """Say once (INFO) that ``compile: true`` has no effect on ``device`` when it is not CUDA (from the first
        step, and from :meth:`mixlab.heads.common.Head.on_fit_start`, before the progress bars)."""
        if self.compile_model and device.type != "cuda" and not self.__dict__.get("_said_eager"):
            self.__dict__["_said_eager"] = True
            log.info("model.init_args.compile: true has no effect on %s: the model runs eagerly (compiled on CUDA "
                     "only)", device)

    def scores(self, inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Per-token next-token scores of a batch, as training and evaluation use them.

        Args:
            inputs: ``[B, T]`` int64 token ids.
            targets: ``[B, T]`` int64 ids to predict at each position; ``-100`` is not scored.

        Returns:
            ``(nll [B*T] float32 nats (0 where not scored), valid [B*T] bool, hits [B*T] bool)`` as
            :func:`token_nll`; the output layer and cross entropy chunked by ``loss_chunk_tokens`` tokens
            when set (the mean training loss is ``nll.sum() / valid.sum()``).
        """
        if not self.loss_chunk_tokens:
            return token_nll(self(inputs), targets)
        h = self.hidden(inputs).flatten(0, 1)
        return linear_cross_entropy(h, self.lm_head.weight, targets.flatten(), chunk=self.loss_chunk_tokens)

    def mean_loss(self, inputs: Tensor, targets: Tensor, chunk_tokens: int | None = None
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The training loss: mean NLL over scored tokens, with the per-token scores.

        With ``loss_chunk_tokens`` set, the output layer and cross entropy run through
        :func:`~mixlab.heads.loss.fused_linear_cross_entropy` (gradients computed chunk by chunk in
        forward: no ``[B*T, vocab]`` logits, no recomputation); otherwise through :meth:`scores`.

        Args:
            inputs, targets: as :meth:`scores`.
            chunk_tokens: tokens per loss chunk, 0 for whole logits (default: ``loss_chunk_tokens``).

        Returns:
            ``(loss [] float32, nll [B*T], valid [B*T] bool, hits [B*T] bool)``; ``loss`` is
            ``nll.sum() / max(valid.sum(), 1)`` and carries the gradient.
        """
        chunk = self.loss_chunk_tokens if chunk_tokens is None else chunk_tokens
        if not chunk:
            nll, valid, hits = self.scores(inputs, targets)
            return nll.sum() / valid.sum().clamp_min(1), nll, valid, hits
        h = self.hidden(inputs).flatten(0, 1)
        return fused_linear_cross_entropy(h, self.lm_head.weight, targets.flatten(), chunk=chunk,
                                          kernel=self.loss_kernel)

    def _update_sums(self, stage: str, nll: Tensor, valid: Tensor, hits: Tensor) -> None:
        self.metric_sums[f"{stage}_nll"].update(nll.sum().double())
        self.metric_sums[f"{stage}_count"].update(valid.sum().double())
        self.metric_sums[f"{stage}_hits"].update(hits.sum().double())

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, stage: str) -> None:
        dm_vocab = self.data_attr("vocab_size")
        if dm_vocab is not None and dm_vocab > self.vocab_size:
            raise ValueError(f"model.init_args.vocab_size={self.vocab_size} is smaller than the datamodule's "
                             f"vocab_size={dm_vocab} ({type(self.data).__name__}); "
                             f"set model.init_args.vocab_size: {dm_vocab}")
        self.token_unit = self.data_attr("token_unit", "token")

    def on_fit_start(self) -> None:
        """``loss_kernel: fla`` needs CUDA and bf16 or float32 matmuls: refused in one line before the sanity
        check and any step."""
        super().on_fit_start()
        if self.loss_kernel != "fla":
            return
        if self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"loss_kernel 'fla' (fla's Triton cross entropy) needs a CUDA device; this run trains "
                             f"on {self.device.type}: use 'torch' or 'auto'")
        precision = str(getattr(self._trainer, "precision", ""))
        if precision.startswith("16"):  # float16 matmuls: G would underflow in the logits' buffer
            raise ValueError(f"loss_kernel 'fla' supports bf16 and float32 matmuls; precision {precision} uses "
                             f"float16: use loss_kernel 'torch' or 'auto', or precision bf16-mixed")

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        inputs, targets = self._split(batch)
        loss, _, valid, hits = self._step_fn("mean_loss", inputs.device)(inputs, targets)
        self.log_train_loss(loss)
        self.log("train/acc", hits.sum() / valid.sum().clamp_min(1))
        return loss

    def _eval_step(self, batch: Tensor, stage: str) -> None:
        self._update_sums(stage, *self._nll(batch))

    def _eval_epoch_end(self, stage: str) -> None:
        sums = {k: self.metric_sums[f"{stage}_{k}"] for k in ("nll", "count", "hits")}
        count = sums["count"].compute().clamp_min(1)
        loss = sums["nll"].compute() / count
        metrics = {
            f"{stage}/loss": loss,
            f"{stage}/ppl": torch.exp(loss.clamp_max(80)),
            f"{stage}/bits_per_token": loss / math.log(2),
            f"{stage}/acc": sums["hits"].compute() / count,
        }
        if self.token_unit != "token":
            metrics[f"{stage}/bits_per_{self.token_unit}"] = loss / math.log(2)
        self.log_dict({k: v.float() for k, v in metrics.items()}, prog_bar=stage == "val", sync_dist=False)
        for m in sums.values():
            m.reset()
