"""A small but real DDP training script: run it with torchrun, or with `monarch run-spmd`.

    torchrun --nproc-per-node=2 train_ddp.py --epochs 3
    monarch run-spmd -- torchrun --nproc-per-node=2 train_ddp.py --epochs 3

gloo on CPU, NCCL when every rank on a host has a GPU of its own. Synthetic regression data, so it needs no
download; the loss printed by rank 0 falls epoch by epoch.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    # NCCL only when every rank on this host gets a GPU of its own: deciding per rank (is there a
    # GPU for my LOCAL_RANK?) splits one group between nccl and gloo, which hangs, and NCCL refuses
    # two ranks on one GPU.
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # same data and initial weights on every rank
    x = torch.randn(4096, 16)
    y = x @ torch.randn(16, 1) + 0.1 * torch.randn(4096, 1)
    data = TensorDataset(x, y)
    sampler: DistributedSampler[int] = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)

    model = DDP(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(device),
        device_ids=[device.index] if use_cuda else None,
    )
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = nn.MSELoss()

    start = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2, device=device)
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            opt.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            opt.step()
            total += torch.stack([loss.detach() * len(xb), torch.tensor(float(len(xb)), device=device)])
        dist.all_reduce(total)
        if rank == 0:
            print(f"epoch {epoch}: loss {total[0].item() / total[1].item():.4f}", flush=True)

    # Every replica must hold identical weights after DDP training.
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    assert torch.allclose(flat, ref), f"rank {rank}: weights diverged"
    if rank == 0:
        backend = dist.get_backend()
        print(
            f"trained on {world} ranks ({backend}) in {time.perf_counter() - start:.2f} s; replicas in sync", flush=True
        )
    # Drop DDP (its reducer holds the process group) and let pending work finish before the
    # group goes: otherwise the reducer, freed when main() returns, frees gloo's group last,
    # which can deadlock in torch (pytorch/pytorch#56297). monarch's warm ranks sidestep that
    # race themselves (docs/spmd.md), but this is the safe ending under any launcher.
    del model, opt
    dist.barrier(device_ids=[device.index] if use_cuda else None)  # (NCCL: on this rank's own GPU)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
