"""Buffers that mpilab keeps for itself (DataParallel's buckets, fusion's flat buffers):
on the host, on transparent huge pages where the kernel grants them.

Why: on one node the large collectives move their bytes between processes
(process_vm_readv, MPI's cross-memory attach) or through shared slots, and both go
faster on 2 MiB pages than on 4 KiB ones, which the kernel must look up and pin one by
one: a 32 MiB broadcast ran 1.5-2x faster, mpilab's and MPI's alike, and a 25 MiB
allreduce read from the other rank's buffer 15-45% faster (one-off measurements,
docs/performance.md). torch's CPU allocator does not ask for huge pages, and most
kernels give them only where asked (`madvise` mode), so these buffers ask themselves.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE_BYTES = 2 << 20
# below this a buffer is torch's: huge pages would only round it up
HUGE_MIN_BYTES = 4 << 20


def kept_zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed 1-D tensor of `numel` elements for mpilab to keep. On the host from
    HUGE_MIN_BYTES on: a private anonymous mapping (shared anonymous memory is shmem,
    which the kernel's huge pages treat apart), aligned to a huge page and advised to be
    backed by them; the tensor holds the mapping. Elsewhere torch's."""
    nbytes = numel * dtype.itemsize
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if device.type != "cpu" or nbytes < HUGE_MIN_BYTES or advise is None:
        return torch.zeros(numel, dtype=dtype, device=device)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES,
                        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zero-filled
    start = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    offset = -start % HUGE_PAGE_BYTES
    try:
        mapping.madvise(advise, offset, nbytes)
    except OSError:  # a kernel without transparent huge pages: 4 KiB pages, as torch's
        pass
    return torch.frombuffer(mapping, dtype=dtype, count=numel, offset=offset)
