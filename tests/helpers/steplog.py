"""Test helper callback: appends ``<global_step> <rank> <loss as float.hex>`` per training step
to ``<path>.rank<r>`` (flushed and fsynced, so it survives SIGKILL), and can SIGKILL its own
process right after a given step (used by tests/test_distributed.py)."""
import os
import signal

import lightning.pytorch as pl


class StepLoss(pl.Callback):
    def __init__(self, path: str, kill_at_step: int = -1) -> None:
        self.path, self.kill_at_step = path, kill_at_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = float(outputs["loss"].detach())
        with open(f"{self.path}.rank{trainer.global_rank}", "a") as fh:
            fh.write(f"{trainer.global_step} {trainer.global_rank} {loss.hex()} "
                     f"{int(batch.sum())}\n")
            fh.flush()
            os.fsync(fh.fileno())
        if trainer.global_step == self.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
