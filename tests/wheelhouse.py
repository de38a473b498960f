"""Wheels of the distributions installed in this environment, for installing mpilab into
a fresh virtual environment without a network (`pip install --no-index --find-links`).

Each installed distribution is packed back into a wheel from the files its RECORD lists:
modules as they are; what it installed beside the package folder (executables in bin/,
mpich's libraries and headers) as the wheel's data, so that pip puts them in the new
environment's own prefix. Console scripts are left out (pip writes them again from the
entry points) and Python scripts get the `#!python` line pip rewrites. The same versions
as here, so the fresh environment is this one's, minus the editable install.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata as md
import io
import os
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

_SKIPPED_METADATA = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}


def closure(requirements: list[str]) -> list[md.Distribution]:
    """The installed distributions these requirements need, their dependencies included
    (markers evaluated here; the extras asked for followed)."""
    seen: dict[str, md.Distribution] = {}
    followed: set[tuple[str, str]] = set()  # (distribution, extra) whose needs are in
    todo = [(Requirement(r), "") for r in requirements]
    environment = default_environment()
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker and not requirement.marker.evaluate({**environment,
                                                                   "extra": extra}):
            continue
        name = canonicalize_name(requirement.name)
        dist = seen.setdefault(name, md.distribution(requirement.name))
        for wanted in ["", *requirement.extras]:  # an extra asked for later counts too
            if (name, wanted) not in followed:
                followed.add((name, wanted))
                todo += [(Requirement(r), wanted) for r in dist.requires or []]
    return sorted(seen.values(), key=lambda d: canonicalize_name(d.metadata["Name"]))


def _record_line(path: str, data: bytes) -> list[str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [path, f"sha256={digest}", str(len(data))]


def pack(dist: md.Distribution, folder: Path) -> Path:
    """Write `dist` as a wheel in `folder` (once; an existing one is kept) and return it."""
    name = canonicalize_name(dist.metadata["Name"]).replace("-", "_")
    version = dist.version
    wheel_info = dist.read_text("WHEEL") or "Tag: py3-none-any\n"
    tags = [line.split(":", 1)[1].strip().split("-") for line in wheel_info.splitlines()
            if line.startswith("Tag:")]
    # several Tag lines (py2-none-any, py3-none-any) make one compressed tag: py2.py3-…
    tag = "-".join(".".join(dict.fromkeys(part)) for part in zip(*tags))
    target = folder / f"{name}-{version}-{tag}.whl"
    if target.exists():
        return target
    site = Path(os.path.normpath(dist.locate_file("")))
    prefix = Path(os.path.normpath(sys.prefix))
    data_dir = f"{name}-{version}.data"
    scripts = {ep.name for ep in dist.entry_points
               if ep.group in ("console_scripts", "gui_scripts")}
    info_dir = None
    record: list[list[str]] = []
    partial = target.with_suffix(".part")
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_STORED) as wheel:
        for file in dist.files or []:
            text = str(file)
            if "__pycache__" in text or text.endswith(".pyc"):
                continue
            source = Path(dist.locate_file(file))
            if not source.is_file():
                continue
            top = text.split("/")[0]
            if top.endswith(".dist-info"):  # its own (vendored ones lie deeper)
                info_dir = top
                if text.split("/")[-1] in _SKIPPED_METADATA:
                    continue
            data = source.read_bytes()
            if text.startswith(".."):  # beside the package folder: relative to the prefix
                relative = Path(os.path.normpath(site / text)).relative_to(prefix)
                if relative.parts[0] == "bin":
                    if relative.name in scripts:
                        continue  # pip writes it again from the entry point
                    first, _, rest = data.partition(b"\n")
                    if first.startswith(b"#!") and b"python" in first:
                        data = b"#!python\n" + rest
                    arcname = f"{data_dir}/scripts/{relative.name}"
                else:
                    arcname = f"{data_dir}/data/{relative.as_posix()}"
            else:
                arcname = text
            entry = zipfile.ZipInfo(arcname, date_time=(2020, 1, 1, 0, 0, 0))
            entry.external_attr = (source.stat().st_mode & 0xFFFF) << 16
            wheel.writestr(entry, data)
            record.append(_record_line(arcname, data))
        if info_dir is None:
            raise RuntimeError(f"{name}: no dist-info in its RECORD")
        lines = io.StringIO()
        csv.writer(lines).writerows([*record, [f"{info_dir}/RECORD", "", ""]])
        wheel.writestr(f"{info_dir}/RECORD", lines.getvalue())
    partial.rename(target)
    return target


def wheelhouse(requirements: list[str], folder: Path) -> list[Path]:
    """Wheels for everything `requirements` need, packed from this environment."""
    folder.mkdir(parents=True, exist_ok=True)
    return [pack(dist, folder) for dist in closure(requirements)]
