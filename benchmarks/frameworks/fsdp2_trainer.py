"""A torchtitan-style trainer: a small transformer, FSDP2 (``fully_shard`` per block, then the
root) over a DeviceMesh, DTensor parameters, AdamW; CPU and gloo, or the GPU and nccl (``FW_DEVICE``)."""

import fwcommon
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class Tiny(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.out = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


fwcommon.deterministic()
device = fwcommon.device()
dist.init_process_group(fwcommon.BACKEND)
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
torch.manual_seed(0)
model = Tiny().to(device)  # initialised on the CPU: the same weights on either device
for layer in model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
generator = torch.Generator().manual_seed(1234 + rank)
for _ in range(fwcommon.STEPS):
    tokens = torch.randint(0, 128, (4, 16), generator=generator).to(device)
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, 128), tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
full = [(name, p.full_tensor()) for name, p in model.named_parameters()]  # a collective: every rank
fwcommon.report(full, rank)
dist.destroy_process_group()
