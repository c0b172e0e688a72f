"""A bare all-reduce: torch.distributed and nothing else (gloo on the CPU, nccl on a GPU).

The floor of a distributed run: what is left of a re-run when the script itself does almost nothing.
"""

import fwcommon
import torch
import torch.distributed as dist

fwcommon.deterministic()
device = fwcommon.device()
dist.init_process_group(fwcommon.BACKEND)
rank, world = dist.get_rank(), dist.get_world_size()
tensor = torch.arange(4096, dtype=torch.float32, device=device) * (rank + 1)
for _ in range(fwcommon.STEPS):
    dist.all_reduce(tensor)
    tensor /= world
fwcommon.report([("reduced", tensor)], rank)
dist.destroy_process_group()
