"""How much memory this host can still give: the bench's check before it makes its
buffers, and the notebook's before it starts ranks here. Standard library only: the
notebook imports it without torch."""

from __future__ import annotations


def available_memory() -> int | None:
    """Bytes this process may still allocate: the host's available memory, within its
    cgroup's limit where it has one (a Slurm job's); None where Linux does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    try:
        with open("/proc/self/cgroup") as cgroup:
            path = next(line.split("::", 1)[1].strip() for line in cgroup
                        if line.startswith("0::"))
        base = f"/sys/fs/cgroup{path}"
        with open(f"{base}/memory.max") as limit, open(f"{base}/memory.current") as used:
            text = limit.read().strip()
            if text != "max":
                available = min(available, int(text) - int(used.read()))
    except (OSError, StopIteration, ValueError):
        pass
    return available
