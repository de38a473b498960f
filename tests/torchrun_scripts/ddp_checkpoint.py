"""The checkpoint example of PyTorch's DDP tutorial, in its structure: rank 0 saves the
DDP model's state_dict, a barrier, every rank loads it with a map_location, one step,
then rank 0 removes the file. As in the tutorial it is a function of (rank, world_size)
that sets up and cleans up its own process group.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


def setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
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


def demo_checkpoint(rank, world_size, checkpoint_dir=None):
    print(f"Running DDP checkpoint example on rank {rank}.")
    setup(rank, world_size)

    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(rank)  # different initial weights on every rank: the load must fix it
    model = ToyModel().to(device)
    ddp_model = DDP(model, device_ids=[rank] if device.type == "cuda" else None)

    CHECKPOINT_PATH = os.path.join(checkpoint_dir or tempfile.gettempdir(), "model.checkpoint")
    if rank == 0:
        # All processes should see same parameters as they all start from same
        # random parameters and gradients are synchronized in backward passes.
        # Therefore, saving it in one process is sufficient.
        with torch.no_grad():
            for p in ddp_model.parameters():
                p.fill_(0.5)
        torch.save(ddp_model.state_dict(), CHECKPOINT_PATH)

    # Use a barrier() to make sure that process 1 loads the model after process
    # 0 saves it.
    dist.barrier()
    # configure map_location properly
    map_location = {"cuda:%d" % 0: "cuda:%d" % rank} if device.type == "cuda" else device  # noqa: UP031
    ddp_model.load_state_dict(
        torch.load(CHECKPOINT_PATH, map_location=map_location, weights_only=True))
    loaded = all(bool((p == 0.5).all()) for p in ddp_model.parameters())
    print(f"rank {rank}: loaded rank 0's checkpoint: {loaded}")

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10, device=device))
    labels = torch.randn(20, 5, device=device)

    loss_fn(outputs, labels).backward()
    optimizer.step()

    # Not necessary to use a dist.barrier() to guard the file deletion below
    # as the AllReduce ops in the backward pass of DDP already served as
    # a synchronization.

    if rank == 0:
        os.remove(CHECKPOINT_PATH)

    cleanup()
    print(f"Finished running DDP checkpoint example on rank {rank}.")
