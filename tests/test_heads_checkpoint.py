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


# ---------------------------------------------------------------------- the Head base and the run record
def _tiny_head_class():
    """A new head in four methods (forward, training_step, _eval_step, _eval_epoch_end)."""
    import torch.nn.functional as F
    from torch import nn
    from torchmetrics import SumMetric

    from mixlab.backbone import Backbone
    from mixlab.heads.common import Head
    from mixlab.optim import OptimConfig

    class Regressor(Head):
        def __init__(self, d_model: int = 16):
            super().__init__()
            self.save_hyperparameters()
            self.optim_cfg, self.run_name = OptimConfig(lr=1e-2, warmup_steps=1), "regressor"
            self.backbone = Backbone(BackboneConfig(d_model=d_model, n_layers=1, n_heads=2, mixer="nope"))
            self.out = nn.Linear(d_model, 1)
            self.sums = nn.ModuleDict({k: SumMetric() for k in ("sse", "n")})

        def forward(self, x):
            return self.out(self.backbone(x)).squeeze(-1)

        def training_step(self, batch, batch_idx):
            return F.mse_loss(self(batch[0]), batch[1])

        def _eval_step(self, batch, stage):
            self.sums["sse"].update(((self(batch[0]) - batch[1]) ** 2).sum().double())
            self.sums["n"].update(torch.tensor(float(batch[1].numel()), dtype=torch.float64))

        def _eval_epoch_end(self, stage):
            self.log(f"{stage}/mse", (self.sums["sse"].compute() / self.sums["n"].compute()).float())
            for m in self.sums.values():
                m.reset()

    return Regressor


def test_a_head_is_a_subclass_with_four_methods(tmp_path):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    class Data(pl.LightningDataModule):
        def __init__(self, n: int = 8, length: int = 5):
            super().__init__()
            self.save_hyperparameters()
            g = torch.Generator().manual_seed(0)
            self.ds = TensorDataset(torch.randn(n, length, 16, generator=g), torch.randn(n, length, generator=g))

        def train_dataloader(self):
            return DataLoader(self.ds, batch_size=4)

        val_dataloader = test_dataloader = train_dataloader

    torch.manual_seed(0)
    model = _tiny_head_class()()
    trainer = pl.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", default_root_dir=tmp_path)
    dm = Data(n=8, length=5)
    trainer.fit(model, dm)
    res = trainer.test(model, dm, verbose=False)[0]
    with torch.no_grad():
        want = torch.stack([((model(x) - y) ** 2) for x, y in dm.test_dataloader()]).mean()
    assert res["test/mse"] == pytest.approx(float(want), rel=1e-5)  # the base ran _eval_step / _eval_epoch_end
    assert trainer.optimizers[0].param_groups[0]["weight_decay"] == 0.1  # AdamW groups from optim_cfg
    trainer.save_checkpoint(tmp_path / "r.ckpt")
    ck = torch.load(tmp_path / "r.ckpt", weights_only=False)
    assert ck["mixlab"] == {"head": f"{type(model).__module__}.{type(model).__qualname__}",
                            "data": f"{Data.__module__}.{Data.__qualname__}", "data_args": {"n": 8, "length": 5}}


@pytest.mark.parametrize("make, data", [
    (lambda: CausalLM(vocab_size=257, backbone=TINY), lambda: __import__("mixlab.datamodules.text", fromlist=["x"])
     .TextDataModule(tokenizer="byte", context_length=32, batch_size=2)),
    (lambda: SpatialVQA(backbone=BackboneConfig(d_model=32, n_layers=1, n_heads=2, mixer="nope", causal=False),
                        coordinates="sequence"),
     lambda: __import__("mixlab.datamodules.spatial_vqa", fromlist=["x"])
     .SpatialVQADataModule(n_train=8, n_val=4, n_test=4, batch_size=4)),
], ids=["lm-text", "vqa-digits"])
def test_every_head_records_its_run_and_load_run_reads_it(make, data, tmp_path):
    import lightning.pytorch as pl

    from mixlab.eval.common import load_run

    model, dm = make(), data()
    trainer = pl.Trainer(max_steps=1, limit_val_batches=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                         default_root_dir=tmp_path)
    trainer.fit(model, dm)
    trainer.save_checkpoint(tmp_path / "x.ckpt")
    run = load_run(tmp_path / "x.ckpt")
    assert type(run.model) is type(model) and run.head == f"{type(model).__module__}.{type(model).__qualname__}"
    assert run.data == f"{type(dm).__module__}.{type(dm).__qualname__}"
    assert run.data_args == {k: v for k, v in dm.hparams.items()}
    rebuilt = run.datamodule(batch_size=1)
    assert type(rebuilt) is type(dm) and rebuilt.hparams["batch_size"] == 1
    x = next(iter(dm.train_dataloader()))
    with torch.no_grad():
        torch.testing.assert_close(run.model(x if isinstance(x, dict) else x[:, :-1]),
                                   model.eval()(x if isinstance(x, dict) else x[:, :-1]), rtol=0, atol=0)
