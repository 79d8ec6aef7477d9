"""Bound fla-core's Triton autotuning for benchmark scripts (device time is scarce).

fla-core 0.6.0 autotunes every kernel over 9-36 configs (warps x stages x block sizes) the
first time it meets a new key (head dims, dtype, ...). chunk_kda fwd+bwd is ~15 kernels, and
every config is a separate Triton compile: on the H200 device image the first fwd+bwd of a
new shape took more than 160 s, longer than a whole benchmark call.

:func:`limit_fla_autotune` keeps, per fla kernel, the ``n`` configs closest to a common
default (4 warps, 2 stages, larger blocks first; with ``n = 1`` the config of least shared
memory, so correctness checks cannot fail on resources); Triton then autotunes among those. All fla
timings of one run share the choice, so ratios between fla-based layers stay fair; absolute
fla numbers can be a little slower than with the full search (``--fla-max-configs 0`` runs
the full search).
"""

from __future__ import annotations

import math
import sys


def _blocks(cfg) -> int:
    kw = getattr(cfg, "kwargs", {}) or {}
    return math.prod(int(v) for v in kw.values() if isinstance(v, int) and v > 0) if kw else 1


def _score(cfg) -> tuple:
    return (abs(math.log2(max(cfg.num_warps, 1) / 4)), abs(cfg.num_stages - 2), -_blocks(cfg))


def _safe(cfg) -> tuple:
    """Least shared memory first: with one config Triton does not benchmark, so an
    out-of-resources config cannot be skipped (seen: fp32 ``chunk_gated_delta_rule_bwd_kernel_dhu``
    at BV=64, 2 stages needs 288 KiB on the H200)."""
    return (cfg.num_stages, _blocks(cfg), abs(math.log2(max(cfg.num_warps, 1) / 4)))


def limit_fla_autotune(n: int) -> int:
    """Prune every loaded fla Triton autotuner to its ``n`` best-scored configs; returns how many were pruned.

    ``n <= 0`` leaves fla untouched. Imports ``fla`` (CUDA code paths only).
    """
    if n <= 0:
        return 0
    import importlib

    from triton.runtime.autotuner import Autotuner

    for m in ("fla.ops", "fla.ops.kda", "fla.ops.gla", "fla.ops.simple_gla", "fla.ops.hgrn", "fla.ops.mesa_net",
              "fla.modules"):  # the kernels mixlab calls (decorated at import)
        try:
            importlib.import_module(m)
        except Exception as e:  # noqa: BLE001
            print(f"[fla_tune] import {m} failed: {type(e).__name__}: {e}", flush=True)

    seen, pruned = set(), 0
    for name, mod in list(sys.modules.items()):
        if not (name == "fla" or name.startswith("fla.")) or mod is None:
            continue
        for obj in list(vars(mod).values()):
            while obj is not None and id(obj) not in seen:
                seen.add(id(obj))
                if isinstance(obj, Autotuner) and len(obj.configs) > n:
                    obj.configs = sorted(obj.configs, key=_safe if n == 1 else _score)[:n]
                    pruned += 1
                obj = getattr(obj, "fn", None)
    return pruned


def limit_for_device(device, n: int) -> None:
    """On CUDA, apply :func:`limit_fla_autotune` and print what it did (scripts' common start)."""
    if getattr(device, "type", str(device)) == "cuda":
        print(f"fla autotuners limited to {n} configs: {limit_fla_autotune(n)}", flush=True)
