"""A torchrun training script of the usual shape: argparse, the process group from
torchrun's environment (env://), LOCAL_RANK for the device, DDP, a DistributedSampler
with set_epoch, rank 0 printing, destroy_process_group at the end.

    torchrun --nproc-per-node 2 train.py --epochs 2
    %%ranks
    %run train.py --epochs 2

--fail-rank R makes rank R raise inside its first backward pass, while the other ranks
wait in DDP's gradient allreduce; --hang-rank R makes rank R call one all_reduce more
than the others at the end (the failure tests).
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    parser = argparse.ArgumentParser(description="DDP training, torchrun style")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--hang-rank", type=int, default=-1)
    parser.add_argument("--report", action="store_true",
                        help="print samples/s (and CPU per sample) on rank 0")
    return parser.parse_args()


def make_dataset(samples, features=32):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, features, generator=generator)
    y = (x[:, :4].sum(dim=1) > 0).long()
    index = torch.arange(samples)  # which samples each rank saw, for the checks
    return TensorDataset(x, y, index)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo",
                            init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")

    torch.manual_seed(0)
    dataset = make_dataset(args.samples)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    model = nn.Sequential(nn.Linear(32, args.width), nn.ReLU(), nn.Linear(args.width, 2))
    model = DDP(model.to(device), device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        seen = []
        start, cpu_start = time.perf_counter(), time.process_time()
        for x, y, index in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            if rank == args.fail_rank:
                loss.register_hook(fail_in_backward)
            loss.backward()
            optimizer.step()
            seen.append(index)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        seen = torch.cat(seen)
        # every sample once per epoch across the ranks, a different order each epoch
        everyone = [torch.zeros_like(seen) for _ in range(world_size)]
        dist.all_gather(everyone, seen)
        covered = torch.cat(everyone).unique().numel() == len(dataset)
        total = torch.tensor([loss.item()], device=device)
        dist.all_reduce(total)
        if rank == 0:
            print(f"epoch {epoch}: loss {total.item() / world_size:.4f}, every sample once: "
                  f"{covered}, first samples {seen[:4].tolist()}")
            if args.report:
                # CPU seconds of this process per 1,000 of its samples: what the epoch
                # cost rank 0, whatever else the machine ran meanwhile
                print(f"samples/s {len(seen) * world_size / elapsed:.1f} "
                      f"cpu_ms_per_sample {1000 * cpu / len(seen):.4f}")

    if rank == args.hang_rank:
        # the other ranks never join this one
        dist.all_reduce(total)
    dist.destroy_process_group()


def fail_in_backward(grad):
    raise RuntimeError(f"rank {dist.get_rank()} failed in backward")


if __name__ == "__main__":
    main()
