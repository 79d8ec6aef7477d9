"""RandomImageDataModule: the model's speed through the CLI without an input pipeline."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mixlab import cli
from mixlab.datamodules.random_images import RandomImageDataModule

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_batches_repeat_the_images_and_draw_seeded_labels():
    dm = RandomImageDataModule(num_classes=7, image_size=[16, 24], batch_size=4, steps_per_epoch=3, seed=2)
    batches = [dm.on_after_batch_transfer(b, 0) for b in dm.train_dataloader()]
    assert len(batches) == 3
    (x0, y0), (x1, _) = batches[0], batches[1]
    assert x0.shape == (4, 3, 16, 24) and x0.dtype == torch.float32 and y0.dtype == torch.int64
    assert torch.equal(x0, x1) and abs(float(x0.std()) - 1) < 0.1  # one N(0, 1) tensor, every step
    labels = torch.cat([y for _, y in batches])
    assert 0 <= int(labels.min()) and int(labels.max()) < 7 and len(set(labels.tolist())) > 3
    again = RandomImageDataModule(num_classes=7, image_size=[16, 24], batch_size=4, steps_per_epoch=3, seed=2)
    assert torch.equal(torch.cat(list(again.train_dataloader())), labels)  # seeded
    assert dm.num_classes == 7 and dm.image_size == dm.eval_size == [16, 24]


@pytest.mark.parametrize("kwargs,name", [(dict(batch_size=0), "batch_size"), (dict(image_size=[8, 0]), "image_size"),
                                         (dict(num_classes=0), "num_classes"),
                                         (dict(image_size=[8, 8, 8]), "image_size")])
def test_bad_arguments_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=f"RandomImageDataModule: {name} must be"):
        RandomImageDataModule(**kwargs)


def test_overlay_on_the_imagenet_config_trains_through_the_cli(tmp_path, monkeypatch):
    """``--config configs/vit/goat_imagenet.yaml --config configs/data/random_images.yaml`` (a small model) trains
    and logs images/s under ``runs/random_images/goat2d``."""
    monkeypatch.setattr("sys.argv", ["mixlab"])
    cli.main(["fit", "--config", str(CONFIGS / "vit" / "goat_imagenet.yaml"), "--config",
              str(CONFIGS / "data" / "random_images.yaml"),
              "--model.init_args.img_size=32", "--model.init_args.backbone.d_model=64",
              "--model.init_args.backbone.n_layers=1", "--model.init_args.backbone.n_heads=1",
              "--data.init_args.image_size=32", "--data.init_args.batch_size=4", "--trainer.max_steps=3",
              "--trainer.limit_val_batches=0", "--trainer.precision=32", "--trainer.log_every_n_steps=1",
              "--trainer.enable_progress_bar=false", "--run_root", str(tmp_path)])
    run = tmp_path / "random_images" / "goat2d" / "version_0"
    assert (run / "checkpoints" / "last.ckpt").exists()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run))
    ea.Reload()
    assert "train/loss" in ea.Tags()["scalars"] and len(ea.Scalars("train/loss")) == 3


def test_mixup_with_batches_of_one_is_refused_before_training(tmp_path, monkeypatch, capsys):
    """A batch of one image under Mixup/CutMix (the ImageNet configs' recipe) is one error line naming the batch
    size (it was a warning, then a reshape error deep in attention on an empty batch; user test)."""
    monkeypatch.setattr("sys.argv", ["mixlab"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--config", str(CONFIGS / "vit" / "goat_imagenet.yaml"), "--config",
                  str(CONFIGS / "data" / "random_images.yaml"), "--model.init_args.img_size=32",
                  "--model.init_args.backbone.d_model=64", "--model.init_args.backbone.n_layers=1",
                  "--model.init_args.backbone.n_heads=1", "--data.init_args.image_size=32",
                  "--data.init_args.batch_size=1", "--trainer.max_steps=1", "--trainer.precision=32",
                  "--trainer.limit_val_batches=0",  # random images have no val split: fit without one is refused
                  "--run_root", str(tmp_path)])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert "data.init_args.batch_size=1: Mixup/CutMix mixes the images of a batch in pairs" in err, err[-800:]
    assert "Traceback" not in err
