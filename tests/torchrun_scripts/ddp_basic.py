"""The basic example of PyTorch's "Getting Started with Distributed Data Parallel"
tutorial, in its structure: setup() sets MASTER_ADDR/MASTER_PORT and initialises the
group, a toy model wrapped in DDP takes one step, cleanup() destroys the group, and the
__main__ block starts one process per device with mp.spawn.

Run on its own with `python ddp_basic.py`; on mpilab's ranks, paste it into a `%%ranks`
cell and call `demo_basic(rank, world_size)` (mp.spawn is what the ranks already are).
"""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


def setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"

    # initialize the process group
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


class ToyModel(nn.Module):
    def __init__(self):
        super(ToyModel, self).__init__()  # noqa: UP008 - as the tutorial writes it
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(rank, world_size):
    print(f"Running basic DDP example on rank {rank}.")
    setup(rank, world_size)

    # create model and move it to the device of this rank (CPU where there is no GPU)
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    model = ToyModel().to(device)
    ddp_model = DDP(model, device_ids=[rank] if device.type == "cuda" else None)

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10, device=device))
    labels = torch.randn(20, 5, device=device)
    loss_fn(outputs, labels).backward()
    optimizer.step()

    # the gradients were averaged: every rank holds the same weights after the step
    weights = [p.detach().clone() for p in ddp_model.parameters()]
    first = [w.clone() for w in weights]
    for w in first:
        dist.broadcast(w, src=0)
    same = all(torch.equal(a, b) for a, b in zip(weights, first))
    print(f"rank {rank}: one DDP step done, weights equal to rank 0's: {same}")

    cleanup()
    print(f"Finished running basic DDP example on rank {rank}.")


def run_demo(demo_fn, world_size):
    mp.spawn(demo_fn,
             args=(world_size,),
             nprocs=world_size,
             join=True)


if __name__ == "__main__":
    world_size = max(2, torch.cuda.device_count())
    run_demo(demo_basic, world_size)
