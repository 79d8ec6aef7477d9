"""Fast decoding for :func:`mixlab.eval.generate.generate`: static caches and a CUDA-graph decode step.

The dict-cache loop (``model.hidden(token, None, caches)`` per token) grows attention keys/values
with ``torch.cat``, rebuilds position features and, for Mesa, ends CG with a host sync per
iteration: on a fast GPU it is bound by kernel launches and host round trips. Here the prompt is
still prefilled by that path (one parallel forward filling the dict caches), then:

1. every layer's mixer copies its dict cache into fixed buffers
   (:meth:`~mixlab.mixers.base.Mixer.static_cache`): attention keys/values ``[B, H, capacity, d_h]``
   with ``capacity = prompt + max_new_tokens`` and position tables for every slot; delta-rule and
   Mesa states and short-convolution tails of fixed size;
2. one decode step (:meth:`StaticDecoder.step`: embedding -> every block's
   :meth:`~mixlab.mixers.base.Mixer.static_step` -> final norm -> ``lm_head``) reads the position from
   a ``[1]`` int64 device tensor, writes keys/values at that slot (``index_copy_``), attends over all
   slots with the mask ``slot <= pos``, updates recurrent states in place and increments the
   position on the device: no host sync, no allocation that outlives the step, no Python branch on
   device values;
3. on CUDA the step is captured once in a :class:`torch.cuda.CUDAGraph` after eager warm-up steps
   on a side stream (real decoding steps, not discarded) and replayed per token. Greedy decoding
   takes the argmax inside the graph (the next input token never leaves the device); sampling
   (temperature, top-k, the caller's generator) runs eagerly on the graph's logits. Without CUDA,
   or with ``cuda_graph=False``, the same step runs eagerly;
4. optionally (``compile_step=True``) the step goes through ``torch.compile`` (Inductor, static shapes)
   before it is captured: a captured graph replays every kernel of the step back to back, and at batch
   8 a step of small kernels is bound by their count, which Inductor's fusion of the element-wise work
   (norms, rotations, gates, residuals, the state updates) cuts. The first call compiles (tens of
   seconds, once per model and shape in a process).

Static steps: attention ``goat``/``rope``/``alibi``/``nope`` (``impl="sdpa"``), the delta-rule family
(``deltanet``, ``gdn``, ``kda``, ``fg2gdn``, ...), ``mesa`` (its own in-place steps), and ``hawk``,
``gla``, ``mamba2`` (their dict-cache step on fixed buffers,
:meth:`~mixlab.mixers.base.Mixer.fixed_state_static_step`). A model with a layer that has none
(``static_cache`` returns None: the reference attention impl, ``swa``, ``mla``) or a head other than
:class:`~mixlab.heads.CausalLM`'s embedding + backbone decodes with the dict-cache loop.

Mesa's solve inside the step has no host-visible data-dependent control flow on CUDA: there (float32) one
Triton kernel runs CG with per-system stopping on the device, or the torch CG runs its full iteration cap
with converged systems masked (same output as the early-stopping CG), as it does under ``torch.compile``;
eagerly on a CPU, where nothing is captured, the torch CG ends once every system has converged.

If graph capture raises, a one-line note goes to stderr and decoding continues with eager steps. Each
:func:`~mixlab.eval.generate.generate` call captures its own graph (prompt and capacity fixed per call),
so the capture cost is paid per call.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

__all__ = ["StaticDecoder", "static_states", "check_memory", "supports_static"]


def supports_static(model) -> bool:
    """Whether ``model`` decodes through :class:`StaticDecoder`: a :class:`~mixlab.heads.CausalLM`
    (or subclass) in eval mode (static steps apply no dropout) whose ``hidden`` is the plain embedding
    (+ learned absolute positions) -> backbone, with every mixer implementing
    :meth:`~mixlab.mixers.base.Mixer.static_step`."""
    from mixlab.heads.lm import CausalLM
    from mixlab.mixers.base import Mixer

    if not isinstance(model, CausalLM) or type(model).hidden is not CausalLM.hidden or model.training:
        return False
    return all(type(blk.mixer).static_step is not Mixer.static_step for blk in model.backbone.blocks)


def static_states(model, caches: list[dict], capacity: int) -> list[dict[str, Tensor]] | None:
    """Per-layer static buffers from the prefill's dict ``caches`` (one per block), or None if some
    layer has no static step (its :meth:`~mixlab.mixers.base.Mixer.static_cache` returned None)."""
    states = []
    for blk, cache in zip(model.backbone.blocks, caches):
        state = blk.mixer.static_cache(cache, capacity)
        if state is None:
            return None
        states.append(state)
    return states


def check_memory(model, batch: int, capacity: int, device: torch.device, static: bool = True) -> int:
    """Bytes decoding ``capacity`` positions (prompt + new tokens) for ``batch`` sequences allocates up front:
    the ``[B, max_new_tokens]`` int64 output ids and, with ``static``, every layer's
    :meth:`~mixlab.mixers.base.Mixer.static_cache_bytes`; checked against the memory free on ``device``
    before anything is allocated.

    Raises:
        ValueError: more than is free (one line, with the sizes and the way out).
    """
    dtype = next(model.parameters()).dtype
    need = 8 * batch * capacity
    if static:
        need += sum(blk.mixer.static_cache_bytes(batch, capacity, dtype) for blk in model.backbone.blocks)
    from mixlab.eval.common import free_bytes

    free = free_bytes(device)
    if need > free:
        what = "static caches and output ids" if static else "output ids"
        raise ValueError(f"generate: decoding {capacity} positions (prompt + max_new_tokens) for batch {batch} needs "
                         f"{need / 2**30:.1f} GiB of {what}, more than the {free / 2**30:.1f} GiB free on {device}; "
                         "lower max_new_tokens")
    return need


class StaticDecoder:
    """One decoding token per :meth:`step` through fixed buffers, optionally as a replayed CUDA graph.

    Args:
        model: a :class:`~mixlab.heads.CausalLM` for which :func:`supports_static` holds, in eval mode.
        states: :func:`static_states` of its prefilled caches (updated in place by every step).
        start: tokens already in the caches (the prompt length P): the first step's position.
        capacity: positions the buffers hold; a step at position ``>= capacity`` raises.
        vocab_limit: ids ``>= vocab_limit`` get logit ``-inf`` (None: all ids allowed).
        greedy: take the argmax inside the step and feed it back as the next input (``token``).
        cuda_graph: capture the step in a CUDA graph (CUDA only) after ``warmup`` eager steps.
        warmup: eager steps (on a side stream) before the capture; they are real decoding steps.
        compile_step: run the step through ``torch.compile`` (module docstring, item 4); on any device.

    Attributes:
        pos: ``[1]`` int64 device tensor, position of the next input token (incremented by the step).
        token: ``[B]`` int64 device tensor, the next input token: set it before :meth:`step` when
            sampling; with ``greedy`` the step leaves its argmax there.
        logits: ``[B, V]`` float32 (float64 for a float64 model) logits of the last step (a static
            buffer once the graph is captured: read or copy it before the next step).
        graphed: whether steps replay a captured graph (False until capture, or when capture failed).
    """

    def __init__(self, model, states: list[dict[str, Tensor]], start: int, capacity: int,
                 vocab_limit: int | None = None, greedy: bool = True, cuda_graph: bool = False,
                 warmup: int = 2, compile_step: bool = False) -> None:
        self.model, self.states, self.capacity = model, states, capacity
        dev = model.embed.weight.device
        batch = next(iter(states[0].values())).shape[0]
        self.vocab_limit, self.greedy = vocab_limit, greedy
        self.pos = torch.full((1,), start, dtype=torch.long, device=dev)
        self.token = torch.zeros(batch, dtype=torch.long, device=dev)
        self.logits: Tensor | None = None
        self.fed = start  # host-side count of positions written (never read from the device)
        self.want_graph = cuda_graph and dev.type == "cuda"
        self.warmup, self.graphed = warmup, False
        self._graph: torch.cuda.CUDAGraph | None = None
        self._stream = torch.cuda.Stream(dev) if self.want_graph else None
        self._eager_steps = 0
        self._run = torch.compile(self._body, dynamic=False) if compile_step else self._body

    # ------------------------------------------------------------------ the step
    def _body(self) -> Tensor:
        """Embedding -> blocks' static steps -> norm -> ``lm_head`` -> masked float logits ``[B, V]``;
        position + 1; with ``greedy`` the argmax goes to ``token``. Graph-capturable."""
        m = self.model
        x = m.embed(self.token)  # [B, D]
        if m.abs_pos is not None:
            x = x + m.abs_pos.weight.index_select(0, self.pos)
        h = m.backbone.step(x, self.states, self.pos)
        logits = m.lm_head(h)
        logits = logits.double() if logits.dtype == torch.float64 else logits.float()
        if self.vocab_limit is not None and self.vocab_limit < logits.shape[-1]:
            logits[:, self.vocab_limit:] = float("-inf")
        self.pos.add_(1)
        if self.greedy:
            self.token.copy_(logits.argmax(-1))
        return logits

    @torch.no_grad()
    def step(self) -> Tensor:
        """Decode the token in :attr:`token` at position :attr:`pos`; returns :attr:`logits` ``[B, V]``.

        Raises:
            ValueError: the step would write position ``capacity`` or beyond (the host counts steps).
        """
        if self.fed >= self.capacity:
            raise ValueError(f"StaticDecoder: position {self.fed} is past the static capacity of {self.capacity} "
                             "positions (prompt + max_new_tokens)")
        self.fed += 1
        if self._graph is not None:
            self._graph.replay()
            return self.logits
        if not self.want_graph:
            self.logits = self._run()
            return self.logits
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up on a side stream (Triton/cuBLAS initialisation off the capture)
            self.logits = self._run()
        torch.cuda.current_stream().wait_stream(stream)
        self._eager_steps += 1
        if self._eager_steps >= self.warmup and self.fed < self.capacity:
            self._capture()
        return self.logits

    def _capture(self) -> None:
        """Record one step (nothing runs during capture: the caches are untouched); later steps replay it."""
        logits = self.logits.clone()  # the caller may still read the last eager step's logits
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                out = self._run()
        except Exception as err:  # noqa: BLE001 - a step that cannot be captured decodes eagerly
            print(f"generate: CUDA graph capture failed ({type(err).__name__}: {err}); decoding eagerly",
                  file=sys.stderr, flush=True)
            self.want_graph = False
            return
        self._graph, self.graphed = graph, True
        out.copy_(logits)
        self.logits = out
