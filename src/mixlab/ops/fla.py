"""The one boundary between mixlab and fla-core's Triton kernels: dtypes, head dims, autotuning.

Every call into fla (``chunk_kda`` for the delta-rule family, ``chunk_gla`` for GLA and Mamba2,
``chunk_mesa_net`` for Mesa) goes through :func:`prepare`, so the kernels' conditions are met in
one place instead of in each caller:

* **one activation dtype.** fla's kernels multiply tiles of q, k and v with ``tl.dot``, which
  does not compile for mixed operands ("Both operands must be same dtype. Got fp32 and bf16").
  Under Lightning's ``bf16-mixed``/``16-mixed`` (autocast) the projections give bfloat16
  activations while l2-normalisation, gates and rate folding come out float32, so q, k, v
  reach the op in mixed dtypes. :func:`activation_dtype` picks the dtype all three are cast
  to: the autocast dtype when autocast is on for their device, else the lowest half-precision
  dtype among them (``bf16-true``), else float32 (``--trainer.precision 32``). Log-gates stay
  float32 and recurrent states float32, as fla asserts.
* **head dims >= 16.** ``tl.dot`` needs tiles of at least 16; smaller key/value dims are
  zero-padded (exact: zero key channels never enter ``k^T k``, ``q^T k`` or the state, and zero
  value channels are cut from the output).
* **bounded autotuning.** fla autotunes each kernel over 9-36 configs on first use of a shape
  (minutes per new head dim on the H200). ``MIXLAB_FLA_AUTOTUNE=N`` (environment) keeps N
  configs per kernel, the first one that of least shared memory (:func:`limit_autotune`); the
  GPU run matrix and the benchmark scripts use it. Unset or 0: fla's full search.

* **what each kernel serves** (:data:`LIMITS`, :func:`unserved`), measured on the device: the
  ``auto`` dispatch of every op takes its torch chunk path for the rest (float32 KDA at head
  dim 128, T=1 gradients, Mesa's K=32), and an explicit ``impl="fla"`` refuses them in one line.
"""

from __future__ import annotations

import importlib
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["activation_dtype", "prepare", "pad_last", "padded_dim", "unserved", "LIMITS", "MIN_HEAD_DIM",
           "limit_autotune", "import_op"]

#: Smallest key/value head dim fla's ``tl.dot`` tiles take; smaller dims are zero-padded to it.
MIN_HEAD_DIM = 16
_HALF = (torch.bfloat16, torch.float16)


def activation_dtype(*xs: Tensor) -> torch.dtype:
    """The dtype q, k, v are handed to fla in (module docstring).

    Args:
        xs: the activation tensors of one call (q, k, v), on one CUDA device.

    Returns:
        ``torch.get_autocast_dtype(device)`` when autocast is enabled there; else bfloat16 if
        any input is bfloat16, float16 if any is float16; else float32.
    """
    device = xs[0].device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    for half in _HALF:
        if any(x.dtype == half for x in xs):
            return half
    return torch.float32


def pad_last(x: Tensor | None, size: int, value: float = 0.0) -> Tensor | None:
    """``x [..., d]`` padded with ``value`` to ``[..., size]`` (``x`` itself if ``d >= size``)."""
    if x is None or x.shape[-1] >= size:
        return x
    return F.pad(x, (0, size - x.shape[-1]), value=value)


def prepare(*xs: Tensor, dtype: torch.dtype | None = None) -> tuple[Tensor, ...]:
    """Cast the activations of one fla call to one dtype and make them contiguous.

    Args:
        xs: q, k, v (or any activations that meet in a ``tl.dot``).
        dtype: target dtype; default :func:`activation_dtype` of ``xs``.

    Returns:
        The tensors in that dtype, contiguous, in the same order.
    """
    dtype = activation_dtype(*xs) if dtype is None else dtype
    return tuple(x.to(dtype).contiguous() for x in xs)


#: What each fla op serves, measured through this boundary with ``scripts/probe_fla.py`` on an H200
#: (fla-core 0.6.0, Triton 3.6; BENCHMARKS.md "fla kernels through mixlab's boundary"):
#: ``max_dim`` largest head dim; ``max_dim_fp32`` largest head dim in float32 (``chunk_kda``'s float32
#: kernels need 245 KiB of shared memory at K=128 and ``chunk_mesa_net``'s 296 KiB; the H200 has
#: 227 KiB); ``dims`` the head dims the op is handed (a smaller one is zero-padded up:
#: ``chunk_mesa_net`` read out of bounds at K=32 and T >= 127 and was 100% off at T=63, while 64 and
#: 128 passed at every length); ``min_tokens`` the shortest sequence sent to fla (``chunk_kda`` and
#: ``chunk_gla`` return gradients 1e22 off at T=1; T=2..65 matched the float64 reference).
LIMITS: dict[str, dict] = {
    "kda": {"max_dim": 256, "max_dim_fp32": 64, "dims": None, "min_tokens": 2},
    "gla": {"max_dim": 256, "max_dim_fp32": 256, "dims": None, "min_tokens": 2},
    "mesa": {"max_dim": 128, "max_dim_fp32": 64, "dims": (64, 128), "min_tokens": 2},
}


def padded_dim(d: int, op: str = "kda") -> int:
    """The head dim handed to fla op ``op`` for a model head dim ``d`` (>= ``d``; see :data:`LIMITS`)."""
    dims = LIMITS[op]["dims"]
    if dims is None:
        return max(d, MIN_HEAD_DIM)
    return next((s for s in dims if s >= d), d)


def unserved(op: str, q: Tensor, k: Tensor, v: Tensor) -> str | None:
    """Why fla op ``op`` cannot take these inputs (one sentence), or None if it can.

    Args:
        op: ``"kda"`` | ``"gla"`` | ``"mesa"`` (keys of :data:`LIMITS`).
        q, k, v: ``[B, T, H, K]``, ``[B, T, H, K]``, ``[B, T, H, V]`` as the caller has them.

    The ``auto`` dispatch of each op takes its torch chunk path when this is not None; an
    explicit ``impl="fla"`` raises ``ValueError`` with it.
    """
    lim = LIMITS[op]
    dim = max(q.shape[-1], v.shape[-1])
    if dim > lim["max_dim"]:
        return f"fla {op} serves head dims up to {lim['max_dim']}; got {dim}"
    if not q.is_cuda:
        return "fla kernels need CUDA tensors"
    if q.dtype == torch.float64:
        return "fla has no float64 kernels"
    if activation_dtype(q, k, v) == torch.float32 and dim > lim["max_dim_fp32"]:
        return (f"fla {op}'s float32 kernels serve head dims up to {lim['max_dim_fp32']} (shared memory); got {dim} "
                "(bf16-mixed precision serves it)")
    if q.shape[1] < lim["min_tokens"]:
        return f"fla {op} is used from {lim['min_tokens']} tokens on; got T={q.shape[1]}"
    return None


# ------------------------------------------------------------------------------- autotuning
def _blocks(cfg) -> int:
    kw = getattr(cfg, "kwargs", {}) or {}
    return math.prod(int(v) for v in kw.values() if isinstance(v, int) and v > 0) if kw else 1


def _least_shared_memory(cfg) -> tuple:
    """Sort key: fewest pipeline stages, smallest blocks, then 4 warps: a config that fits the
    shared memory of any recent GPU (seen: fp32 ``chunk_gated_delta_rule_bwd_kernel_dhu`` at
    BV=64, 2 stages needs 288 KiB on the H200)."""
    return (cfg.num_stages, _blocks(cfg), abs(math.log2(max(cfg.num_warps, 1) / 4)))


def _common_default(cfg) -> tuple:
    """Sort key: closest to 4 warps and 2 stages, larger blocks first (usually among the fastest)."""
    return (abs(math.log2(max(cfg.num_warps, 1) / 4)), abs(cfg.num_stages - 2), -_blocks(cfg))


def _keep(configs: list, n: int) -> list:
    """The config needing the least shared memory (so a pruned autotuner is never left with
    only out-of-resources configs; with one config Triton does not benchmark), then the
    ``n - 1`` closest to the common default (Triton autotunes among those, skipping any that
    does not fit)."""
    safe = min(configs, key=_least_shared_memory)
    return [safe] + sorted((c for c in configs if c is not safe), key=_common_default)[: n - 1]


_FLA_MODULES = ("fla.ops", "fla.ops.kda", "fla.ops.gla", "fla.ops.simple_gla", "fla.ops.hgrn", "fla.ops.mesa_net",
                "fla.modules")
_LIMITED: list[int] = []


def limit_autotune(n: int) -> int:
    """Keep ``n`` configs per loaded fla Triton autotuner (:func:`_keep`).

    Args:
        n: configs kept per kernel; ``n <= 0`` leaves fla untouched.

    Returns:
        How many autotuners were pruned. Imports fla's op modules (CUDA code paths only).
    """
    if n <= 0:
        return 0
    from triton.runtime.autotuner import Autotuner

    for m in _FLA_MODULES:  # the kernels mixlab calls (decorated at import)
        importlib.import_module(m)
    seen, pruned = set(), 0
    for name, mod in list(sys.modules.items()):
        if not (name == "fla" or name.startswith("fla.")) or mod is None:
            continue
        for obj in list(vars(mod).values()):
            while obj is not None and id(obj) not in seen:
                seen.add(id(obj))
                if isinstance(obj, Autotuner) and len(obj.configs) > n:
                    obj.configs = _keep(obj.configs, n)
                    pruned += 1
                obj = getattr(obj, "fn", None)
    return pruned


def import_op(module: str, name: str):
    """``from fla.<module> import <name>``, after applying ``MIXLAB_FLA_AUTOTUNE`` once per process.

    Raises:
        ValueError: ``MIXLAB_FLA_AUTOTUNE`` is not an integer.
    """
    if not _LIMITED:
        raw = os.environ.get("MIXLAB_FLA_AUTOTUNE", "0").strip() or "0"
        if not raw.lstrip("-").isdigit():
            raise ValueError(f"MIXLAB_FLA_AUTOTUNE must be an integer (configs per fla kernel, 0 = full search); "
                             f"got {raw!r}")
        _LIMITED.append(limit_autotune(int(raw)))
    return getattr(importlib.import_module(f"fla.{module}"), name)
