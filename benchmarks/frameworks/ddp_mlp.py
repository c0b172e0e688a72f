"""Plain DistributedDataParallel, no framework: an MLP, 50 steps of SGD (gloo on the CPU, nccl on a GPU).

Issue 37's "plain DDP, MLP, 50 steps" row; each rank trains on its own batches, DDP averages.
"""

import fwcommon
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

STEPS = 50  # fixed, unlike the framework scripts' FW_STEPS: the row issue 37 measured on a GPU

fwcommon.deterministic()
device = fwcommon.device()
dist.init_process_group(fwcommon.BACKEND)
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4)).to(device)
ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
generator = torch.Generator().manual_seed(1234 + rank)
for _ in range(STEPS):
    x = torch.randn(64, 32, generator=generator)
    y = torch.stack([x[:, :8].sum(1), x[:, 8:16].mean(1), x[:, 16:].abs().mean(1), x.norm(dim=1)], dim=1)
    loss = nn.functional.mse_loss(ddp(x.to(device)), y.to(device))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
fwcommon.report(model.named_parameters(), rank)
dist.destroy_process_group()
