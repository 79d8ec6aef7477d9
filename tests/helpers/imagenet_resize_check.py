"""The Triton crop + resize (``resized_crops(..., impl="triton")``, ``mixlab.datamodules.imagenet_triton``)
against torchvision's ``resized_crop`` per image and against the GEMM path, run by ``tests/test_imagenet_gpu.py``
under ``TRITON_INTERPRET=1`` (or on CUDA with ``--device cuda``, at ImageNet sizes). Prints one JSON object: per
case, the largest level difference to torchvision and the share of pixels that differ, and the same against the
float32 GEMM path."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from test_imagenet_gpu import _diff_to_torchvision, _random_crops  # noqa: E402

from mixlab.datamodules.imagenet_gpu import resized_crops  # noqa: E402


def case(imgs, boxes, flip, size, **kw) -> dict:
    got = resized_crops(imgs, boxes, size, flip, impl="triton", **kw)
    gemm = resized_crops(imgs, boxes, size, flip, tf32=False, **kw)
    ref = _diff_to_torchvision(got, imgs, boxes, flip, size) if "resized" not in kw else (got - gemm).abs()
    d = (got - gemm).abs()
    return {"pixels": got.numel(), "tv_max": float(ref.max()), "tv_share": float((ref > 0).float().mean()),
            "gemm_max": float(d.max()), "gemm_share": float((d > 0).float().mean()),
            "integer": bool((got == got.round()).all()), "range_ok": bool(((got >= 0) & (got <= 255)).all())}


def main() -> None:
    dev = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cpu"
    big = dev != "cpu"
    res = {}
    for seed, size, shape in ((0, (12, 20), "any"), (1, (20, 12), "tall"), (2, (9, 9), "wide")):
        imgs, boxes, flip = _random_crops(64 if big else 6, seed, *((100, 500) if big else (4, 40)), shape=shape,
                                          device=dev)
        res[f"train_{shape}_{size[0]}x{size[1]}"] = case(imgs, boxes, flip, (224, 224) if big else size)
    # photo-like images (smooth colour fields, texture, JPEG-decoded), as the stage sees them
    import numpy as np
    from torchvision.io import decode_jpeg

    from mixlab.datamodules.imagenet import synthetic_jpeg

    rng = np.random.default_rng(7)
    sizes = [(160, 120), (120, 160), (200, 150)] if big else [(40, 30), (30, 40)]
    imgs = [decode_jpeg(torch.frombuffer(bytearray(synthetic_jpeg(rng, w, h)), dtype=torch.uint8)).to(dev)
            for w, h in sizes]
    boxes = torch.tensor([[h // 5, w // 7, h - h // 3, w - w // 4] for w, h in sizes])
    flip = torch.tensor([True, False, True][:len(imgs)])
    res["photo"] = case(imgs, boxes, flip, (224, 224) if big else (24, 20))
    # a scratch cap that splits the batch into runs of one or two images
    imgs, boxes, flip = _random_crops(5, 5, 4, 30, device=dev)
    res["runs"] = case(imgs, boxes, flip, (6, 10), max_bytes=4 * 3 * 10 * 12)  # 12 crop rows a run: 3 runs
    # one image, a 1 x 1 crop, T = 1 output row
    imgs, boxes, flip = _random_crops(1, 3, 5, 9, device=dev)
    res["one_image"] = case(imgs, boxes, flip, (1, 7))
    # evaluation: Resize (short side) + CenterCrop as a resized size and a window offset per image
    imgs, _, flip = _random_crops(32 if big else 4, 4, *((200, 600) if big else (10, 30)), device=dev)
    short, crop = (256, 224) if big else (12, 10)
    hw = [tuple(im.shape[-2:]) for im in imgs]
    rs = torch.tensor([[short * h // min(h, w), short * w // min(h, w)] for h, w in hw])
    res["eval"] = case(imgs, torch.tensor([[0, 0, h, w] for h, w in hw]), None, (crop, crop), resized=rs,
                       offsets=(rs - crop) // 2)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
