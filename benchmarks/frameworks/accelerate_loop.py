"""A hand-written training loop under Hugging Face Accelerate (CPU and gloo, or the GPU and nccl: fwcommon)."""

import fwcommon
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn

fwcommon.deterministic()
accelerator = Accelerator(cpu=fwcommon.DEVICE_TYPE == "cpu")  # else LOCAL_RANK's GPU, nccl
set_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
generator = torch.Generator().manual_seed(1234)
x = torch.randn(256, 16, generator=generator)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.flip(1)), batch_size=8, shuffle=True)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
step = 0
while step < fwcommon.STEPS:
    for xb, yb in loader:
        loss = nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if step == fwcommon.STEPS:
            break
accelerator.wait_for_everyone()
fwcommon.report(accelerator.unwrap_model(model).named_parameters(), accelerator.process_index)
accelerator.end_training()
