"""The fused Triton augmentation layer (``mixlab.datamodules.imagenet_triton``) against the family-batched torch
reference (``imagenet_gpu._Layer``), run by ``tests/test_imagenet_gpu.py`` under ``TRITON_INTERPRET=1`` (or on CUDA
with ``--device cuda``). Prints one JSON object: per case, the pixels compared and, per family, how many output
levels differ from the reference and by how much at most."""

import json
import sys

import numpy as np
import torch

from mixlab.datamodules.imagenet_gpu import (
    _FAMILY,
    _GEOMETRIC,
    RA_OPS,
    _FusedLayer,
    _Layer,
    _Upload,
    fused_scratch,
    run_fused_layers,
)


def images(n: int, h: int, w: int, g: torch.Generator) -> torch.Tensor:
    """Integer levels with image-like structure: a smooth gradient per image and channel, texture, a few flat
    images (AutoContrast's and Equalize's degenerate channels) and saturated spots."""
    yy = torch.linspace(0, 1, h).view(1, 1, h, 1)
    xx = torch.linspace(0, 1, w).view(1, 1, 1, w)
    a, b, c = (torch.rand(n, 3, 1, 1, generator=g) for _ in range(3))
    x = 255 * (0.2 + 0.6 * (a * yy + b * xx) * c) + 20 * torch.randn(n, 3, h, w, generator=g)
    x[0] = 77.0  # flat image
    x[1, 1] = 200.0  # one flat channel
    x[2, :, : h // 3, : w // 3] = 255.0
    return x.round().clamp(0, 255).contiguous()


def draws(n: int, g: torch.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every op at least once (then random), timm-like arguments, some images without an op, random resampling."""
    rng = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=g)))
    op = np.concatenate([np.arange(len(RA_OPS)), rng.integers(-1, len(RA_OPS), max(0, n - len(RA_OPS)))])[:n]
    rng.shuffle(op)
    arg = np.zeros(n)
    for i, o in enumerate(op):
        name = RA_OPS[o] if o >= 0 else ""
        if name == "Rotate":
            arg[i] = rng.uniform(-30, 30)
        elif name.startswith(("Shear", "Translate")):
            arg[i] = rng.uniform(-0.45, 0.45) * (1 if name.endswith("Rel") or name.startswith("Shear") else 40)
        elif name.startswith("Posterize"):
            arg[i] = rng.integers(0, 9)
        elif name == "SolarizeAdd":
            arg[i] = rng.integers(0, 111)
        elif name.startswith("Solarize"):
            arg[i] = rng.integers(0, 257)
        else:
            arg[i] = rng.uniform(0.1, 1.9)
    interp = rng.choice([0, 2, 3], n)
    return op, arg, interp


def compare(x: torch.Tensor, op, arg, interp, fill=(124.0, 116.0, 104.0)) -> dict:
    n, _, h, w = x.shape
    dev = x.device
    up = _Upload()
    ref_layer = _Layer(up, op, arg, interp, (h, w), {"affine", "blend", "lut", "equalize"}, (0, 2, 3))
    s_fill = up.add(fill, np.float64)
    segs = up.to(dev)
    ref = x.clone()
    ref_layer(ref, segs, segs[s_fill].to(x.dtype).view(1, 3, 1, 1))
    up2 = _Upload()
    layer = _FusedLayer(up2, op, arg, interp, (h, w))
    s_fill2 = up2.add(fill, np.float64)
    segs2 = up2.to(dev)
    got = run_fused_layers([layer], x.clone(), torch.full_like(x, -1.0), segs2, segs2[s_fill2],
                           fused_scratch(n, dev))
    out = {"pixels": int(x.numel())}
    fam = np.array([_FAMILY[RA_OPS[o]] if o >= 0 else "none" for o in op])
    for f in ("none", "lut", "equalize", "blend", "affine"):
        sel = torch.as_tensor(np.flatnonzero(fam == f), device=dev)
        if len(sel) == 0:
            continue
        d = (got[sel] - ref[sel]).abs()
        out[f] = {"images": len(sel), "differ": int((d > 0).sum()), "max": float(d.max()),
                  "integer": bool((got[sel] == got[sel].round()).all()), "range_ok": bool(
                      ((got[sel] >= 0) & (got[sel] <= 255)).all())}
    return out


def two_layers(x: torch.Tensor, g: torch.Generator) -> dict:
    """Two layers in turn (the ping-pong of :func:`run_fused_layers`) against two reference layers."""
    n, _, h, w = x.shape
    dev = x.device
    plans = [draws(n, g) for _ in range(2)]
    up, up2 = _Upload(), _Upload()
    refs = [_Layer(up, *p, (h, w), {"affine", "blend", "lut", "equalize"}, (0, 2, 3)) for p in plans]
    fused = [_FusedLayer(up2, *p, (h, w)) for p in plans]
    s_fill, s_fill2 = up.add((128.0,) * 3), up2.add((128.0,) * 3)
    segs, segs2 = up.to(dev), up2.to(dev)
    ref = x.clone()
    for layer in refs:
        layer(ref, segs, segs[s_fill].to(x.dtype).view(1, 3, 1, 1))
    geometric = [k for k in range(n) if any(RA_OPS[p[0][k]] in _GEOMETRIC for p in plans if p[0][k] >= 0)]
    spare = torch.empty_like(x)
    got = run_fused_layers(fused, x.clone(), spare, segs2, segs2[s_fill2], fused_scratch(n, dev))
    other = [k for k in range(n) if k not in geometric]
    d = (got[other] - ref[other]).abs()
    return {"non_geometric_differ": int((d > 0).sum()),
            "geometric_share_differ": float(((got[geometric] - ref[geometric]).abs() > 0).float().mean())
            if geometric else 0.0}


def main() -> None:
    dev = torch.device(sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cpu")
    g = torch.Generator().manual_seed(0)
    res = {}
    for n, h, w in ((30, 21, 17), (26, 3, 5), (28, 40, 33)):
        x = images(n, h, w, g).to(dev)
        res[f"one_layer_{n}x{h}x{w}"] = compare(x, *draws(n, g))
    x = images(27, 19, 23, g).to(dev)
    res["two_layers"] = two_layers(x, g)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
