"""A folder as a tar stream, written as it is read: an exported model of many GB is sent
without a temporary copy. Only regular files inside the folder go in (symlinks are left out,
so nothing outside the run can be sent through one)."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path
from typing import Iterator

CHUNK = 1024 * 1024


def folder_files(folder: Path) -> list[Path]:
    """Regular files under ``folder`` (not following symlinks), in a stable order."""
    found = []
    for root, dirs, files in os.walk(folder, followlinks=False):
        dirs.sort()
        for name in sorted(files):
            path = Path(root) / name
            if path.is_file() and not path.is_symlink():
                found.append(path)
    return found


def tar_stream(folder: Path, top: str) -> Iterator[bytes]:
    """The bytes of an uncompressed tar of ``folder`` whose members sit under ``top/``.

    Uncompressed on purpose: safetensors weights do not compress, and the size is known.
    """
    for path in folder_files(folder):
        stat = path.stat()
        info = tarfile.TarInfo(f"{top}/{path.relative_to(folder).as_posix()}")
        info.size, info.mtime, info.mode = stat.st_size, int(stat.st_mtime), 0o644
        yield info.tobuf(format=tarfile.PAX_FORMAT)
        sent = 0
        with open(path, "rb") as handle:
            while sent < info.size:
                chunk = handle.read(min(CHUNK, info.size - sent))
                if not chunk:  # the file shrank while being sent: pad to the size the header announced
                    chunk = b"\0" * (info.size - sent)
                sent += len(chunk)
                yield chunk
        if info.size % tarfile.BLOCKSIZE:
            yield b"\0" * (tarfile.BLOCKSIZE - info.size % tarfile.BLOCKSIZE)
    yield b"\0" * (2 * tarfile.BLOCKSIZE)  # end of archive


def tar_size(folder: Path, top: str) -> int:
    """The length of ``tar_stream(folder, top)``, for Content-Length."""
    total = 2 * tarfile.BLOCKSIZE
    for path in folder_files(folder):
        size = path.stat().st_size
        info = tarfile.TarInfo(f"{top}/{path.relative_to(folder).as_posix()}")
        info.size, info.mtime, info.mode = size, int(path.stat().st_mtime), 0o644
        total += len(info.tobuf(format=tarfile.PAX_FORMAT)) + -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
    return total
