"""The disk tier: one file per entry, published atomically, shared by any number of processes.

Layout: ``<root>/v1/<key[:2]>/<key>``. A writer writes the whole entry to a private temporary
file in the same folder and renames it over the final name, so a reader (in this process or
another) sees either no entry or a whole one, never a torn one. Entries are verified by the
layer above; the tier itself only moves bytes, through aiofiles, off the event loop.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import aiofiles
import aiofiles.os
import anyio

LAYOUT = "v1"


def default_cache_dir() -> Path:
    """``$ACOMPILE_CACHE_DIR``, else ``$XDG_CACHE_HOME/acompile``, else ``~/.cache/acompile``."""
    explicit = os.environ.get("ACOMPILE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "acompile"


class DiskTier:
    name = "disk"

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.entries = self.root / LAYOUT

    def path(self, key: str) -> Path:
        if len(key) < 3 or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"not a cache key: {key!r}")
        return self.entries / key[:2] / key

    def prepare(self) -> None:
        """Create the folder, private to this user (blocking: call from a thread)."""
        self.entries.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            os.chmod(self.root, 0o700)
        except PermissionError:
            pass  # a shared folder made by someone else: we read and write what we may

    async def get(self, key: str) -> bytes | None:
        # Shielded, like set(): a read cancelled between open and close would leak the file.
        with anyio.CancelScope(shield=True):
            data = await self._read(key)
        return data

    async def _read(self, key: str) -> bytes | None:
        try:
            async with aiofiles.open(self.path(key), "rb") as f:
                data: bytes = await f.read()
                return data
        except (FileNotFoundError, NotADirectoryError):
            return None

    async def set(self, key: str, data: bytes) -> None:
        # Shielded: a write is short, and one cut in half by a cancellation would leave its
        # temporary file (and handle) behind.
        with anyio.CancelScope(shield=True):
            final = self.path(key)
            await aiofiles.os.makedirs(final.parent, mode=0o700, exist_ok=True)
            tmp = final.with_name(f".{key[:16]}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
            try:
                async with aiofiles.open(tmp, "wb") as f:
                    await f.write(data)
                await aiofiles.os.replace(tmp, final)
            except BaseException:
                try:
                    await aiofiles.os.remove(tmp)
                except OSError:
                    pass
                raise

    async def delete(self, key: str) -> None:
        try:
            await aiofiles.os.remove(self.path(key))
        except FileNotFoundError:
            pass

    async def close(self) -> None:
        pass

    def iter_paths(self) -> Iterator[Path]:
        """Every entry file (blocking: for the command line and threads)."""
        if not self.entries.is_dir():
            return
        for sub in sorted(self.entries.iterdir()):
            if sub.is_dir():
                for path in sorted(sub.iterdir()):
                    if not path.name.startswith("."):
                        yield path
