"""Every head's hyperparameters survive ``torch.load(weights_only=True)``, as Lightning loads checkpoints."""

import io

import pytest
import torch

from mixlab.backbone import BackboneConfig
from mixlab.heads import CausalLM
from mixlab.heads.vit import ImageClassifier
from mixlab.heads.vqa import SpatialVQA

TINY = BackboneConfig(d_model=32, n_layers=1, n_heads=2, mixer="rope")


@pytest.mark.parametrize("make", [
    lambda: CausalLM(vocab_size=5, backbone=TINY),
    lambda: ImageClassifier(num_classes=10, img_size=16, patch_size=4, position="rope2d",
                            backbone=BackboneConfig(d_model=32, n_layers=1, n_heads=2, mixer="rope",
                                                    mixer_args={"rope": {"position_args": {"axes": 2}}}, causal=False)),
    lambda: SpatialVQA(backbone=BackboneConfig(d_model=32, n_layers=1, n_heads=2, mixer="nope", causal=False),
                       coordinates="sequence"),
], ids=["lm", "vit", "vqa"])
def test_hparams_reload_with_weights_only(make):
    model = make()
    buf = io.BytesIO()
    torch.save({"hyper_parameters": dict(model.hparams), "state_dict": model.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    rebuilt = type(model)(**{k: v for k, v in ck["hyper_parameters"].items() if not k.startswith("_")})
    rebuilt.load_state_dict(ck["state_dict"])
    for (n, a), (_, b) in zip(model.state_dict().items(), rebuilt.state_dict().items()):
        assert torch.equal(a, b), n
