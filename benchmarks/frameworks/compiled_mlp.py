"""A ``torch.compile``d 8-layer MLP under DDP, 20 steps (gloo on the CPU, nccl on a GPU).

Issue 37's compiled row: a fresh process compiles it from scratch on every run (21.5 s on one
H100 with warm on-disk caches, 8.8 s of it in the script); a kept rank (``--keep-ranks``) finds
its compiled graphs in memory. The checksum is compared with cold torchrun's like the others.
"""

import fwcommon
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

STEPS = 20

fwcommon.deterministic()
device = fwcommon.device()
dist.init_process_group(fwcommon.BACKEND)
rank = dist.get_rank()
torch.manual_seed(0)
layers: list[nn.Module] = []
for i in range(8):
    layers += [nn.Linear(64 if i else 32, 64), nn.ReLU()]
model = nn.Sequential(*layers, nn.Linear(64, 4)).to(device)
ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
compiled = torch.compile(ddp)
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
generator = torch.Generator().manual_seed(1234 + rank)
for _ in range(STEPS):
    x = torch.randn(64, 32, generator=generator)
    y = torch.stack([x[:, :8].sum(1), x[:, 8:16].mean(1), x[:, 16:].abs().mean(1), x.norm(dim=1)], dim=1)
    loss = nn.functional.mse_loss(compiled(x.to(device)), y.to(device))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
fwcommon.report(model.named_parameters(), rank)
dist.destroy_process_group()
