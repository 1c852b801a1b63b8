"""The bytes of one cache entry: the only format any tier stores.

::

    b"ACMPL" version:u8 header_len:u32 sha256:32 header(JSON) blob blob ...

The SHA-256 covers the header and every blob. The header is small JSON: the entry's key, backend
and kernel name, the names and sizes of the blobs, and backend metadata. Nothing in an entry is
ever unpickled; a reader that finds anything out of place (magic, version, lengths, digest, key)
treats the entry as missing.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from typing import Any

MAGIC = b"ACMPL"
VERSION = 1
_PREFIX = struct.Struct(">5sBI32s")


class CorruptEntry(ValueError):
    """The bytes are not a whole, intact entry (for the key asked)."""


@dataclass
class Entry:
    key: str
    backend: str
    name: str
    blobs: dict[str, bytes]
    meta: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        header = {
            "key": self.key,
            "backend": self.backend,
            "name": self.name,
            "blobs": [[name, len(data)] for name, data in self.blobs.items()],
            "meta": self.meta,
        }
        head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
        digest = hashlib.sha256(head)
        for data in self.blobs.values():
            digest.update(data)
        return b"".join(
            [_PREFIX.pack(MAGIC, VERSION, len(head), digest.digest()), head, *self.blobs.values()]
        )

    @property
    def size(self) -> int:
        return sum(len(b) for b in self.blobs.values())


def peek_header(data: bytes) -> dict[str, Any]:
    """The header alone, unverified (for listings)."""
    if len(data) < _PREFIX.size:
        raise CorruptEntry("truncated before the header")
    magic, version, head_len, digest = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise CorruptEntry("not an acompile cache entry")
    if version != VERSION:
        raise CorruptEntry(f"entry format {version}, this acompile reads {VERSION}")
    end = _PREFIX.size + head_len
    if len(data) < end:
        raise CorruptEntry("truncated inside the header")
    try:
        header = json.loads(data[_PREFIX.size : end])
    except ValueError as exc:
        raise CorruptEntry(f"unreadable header: {exc}") from None
    if not isinstance(header, dict):
        raise CorruptEntry("header is not an object")
    header["_end"] = end
    header["_digest"] = digest
    return header


def decode(data: bytes, expect_key: str | None = None, *, verify: bool = True) -> Entry:
    """Parse and check an entry; raises ``CorruptEntry`` for anything but a whole, intact one."""
    header = peek_header(data)
    try:
        offset = header.pop("_end")
        expected_digest = header.pop("_digest")
        head_start = _PREFIX.size
        blobs: dict[str, bytes] = {}
        for name, size in header["blobs"]:
            if not isinstance(name, str) or not isinstance(size, int) or size < 0:
                raise CorruptEntry("malformed blob table")
            blobs[name] = data[offset : offset + size]
            offset += size
        key, backend, name, meta = header["key"], header["backend"], header["name"], header["meta"]
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptEntry(f"malformed header: {exc}") from None
    if not isinstance(meta, dict) or not all(isinstance(x, str) for x in (key, backend, name)):
        raise CorruptEntry("malformed header: key, backend and name must be text, meta an object")
    if offset != len(data):
        raise CorruptEntry(f"length mismatch: header describes {offset} bytes, entry has {len(data)}")
    if expect_key is not None and key != expect_key:
        raise CorruptEntry(f"entry holds key {key[:16]}…, not {expect_key[:16]}…")
    if verify:
        # The header and the blobs, as stored: one hash over everything after the prefix.
        if hashlib.sha256(memoryview(data)[head_start:]).digest() != expected_digest:
            raise CorruptEntry("content does not match its checksum")
    return Entry(key=key, backend=backend, name=name, blobs=blobs, meta=meta)
