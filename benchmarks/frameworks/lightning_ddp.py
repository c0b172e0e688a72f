"""PyTorch Lightning with strategy="ddp" on the CPU (gloo) or the GPUs (nccl, ``FW_DEVICE=cuda``), ranks
started by torchrun (or monarch)."""

import os

import fwcommon
import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

fwcommon.deterministic()
L.seed_everything(0, verbose=False)


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch: tuple, _i: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


generator = torch.Generator().manual_seed(1234)
x = torch.randn(256, 16, generator=generator)
data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
trainer = L.Trainer(
    accelerator="gpu" if fwcommon.DEVICE_TYPE == "cuda" else "cpu",
    devices=local,
    num_nodes=world // local,
    strategy=DDPStrategy(process_group_backend=fwcommon.BACKEND),
    max_steps=fwcommon.STEPS,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    deterministic=True,
)
model = Regressor()
trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8, shuffle=True))
fwcommon.report(model.named_parameters(), trainer.global_rank)
