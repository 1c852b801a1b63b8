"""The bytes of one cache entry: the only format any tier stores.

::

    b"ACMPL" version:u8 header_len:u32 sha256:32 header(JSON) blob blob ...

The SHA-256 covers the header and every blob. The header is small JSON: the entry's key, backend
and kernel name, the names and sizes of the blobs, which of them are ASCII text (``ascii``: found
once, by the writer), and backend metadata. Nothing in an entry is ever unpickled; a reader that
finds anything out of place (magic, version, lengths, digest, key) treats the entry as missing.

An entry read from bytes (``decode``) keeps its blobs where they were read (``Blobs``): a blob is
copied out the first time it is asked for, so that reading an entry costs one copy of the file,
not two, and the stages nobody asks for (a warm start's IRs and PTX) are never copied at all.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

MAGIC = b"ACMPL"
VERSION = 1
_PREFIX = struct.Struct(">5sBI32s")


class CorruptEntry(ValueError):
    """The bytes are not a whole, intact entry (for the key asked)."""


# How much of a blob ``blob_isascii`` copies at a time: small enough to stay in a CPU's cache
# and in memory the allocator hands out again, rather than fresh pages for a copy of the blob.
_SCAN = 1 << 16


class Blobs(MutableMapping[str, bytes]):
    """The blobs of an entry read from bytes, by name, in their order: each one stays a span of
    those bytes until it is asked for, then is copied out once (and kept). Set, replace or
    remove blobs as in a dict. ``blob_view`` and ``blob_isascii`` read a blob without copying it.

    Copying every blob out at once costs a second copy of the whole entry in fresh memory (and
    a page fault per 4 KiB of it), while a warm start needs only each kernel's binary and
    metadata: its IRs and PTX are read only where someone looks at them."""

    __slots__ = ("_ascii", "_data", "_items")

    def __init__(
        self, data: bytes, spans: dict[str, tuple[int, int]], ascii: dict[str, bool] | None = None
    ) -> None:
        self._data = data
        # A blob not copied out yet is its (start, end) in _data.
        self._items: dict[str, bytes | tuple[int, int]] = dict(spans)
        # What isascii() found, by blob; or what the entry's header says its writer found.
        self._ascii: dict[str, bool] = ascii or {}

    def __getitem__(self, name: str) -> bytes:
        item = self._items[name]
        if isinstance(item, tuple):
            item = self._items[name] = self._data[item[0] : item[1]]
        return item

    def __setitem__(self, name: str, blob: bytes) -> None:
        self._items[name] = blob
        self._ascii.pop(name, None)

    def __delitem__(self, name: str) -> None:
        del self._items[name]
        self._ascii.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __repr__(self) -> str:
        return f"Blobs({ {name: blob_size(self, name) for name in self._items} })"

    def view(self, name: str) -> bytes | memoryview:
        """The blob's bytes without a copy: a view of the bytes it was read from, or the blob."""
        item = self._items[name]
        if isinstance(item, tuple):
            return memoryview(self._data)[item[0] : item[1]]
        return item

    def isascii(self, name: str) -> bool:
        """Whether the blob is ASCII (found once, without copying it out)."""
        found = self._ascii.get(name)
        if found is None:
            found = self._ascii[name] = _isascii(self.view(name))
        return found

    def copy_out_binaries(self) -> None:
        """Find which blobs are ASCII text, and copy out the others now: the binaries, which
        loading an entry reads (a kernel's cubin), where text (IRs, sources, metadata) is read
        only where someone asks. For the thread that read the entry, so that what loads it
        next, on the event loop, finds both done."""
        for name in self._items:
            if not self.isascii(name):
                self[name]  # copied out, and kept


def _isascii(view: bytes | memoryview) -> bool:
    """Whether bytes are ASCII, read a slice at a time (a view is not copied whole)."""
    if isinstance(view, bytes):
        return view.isascii()
    size = len(view)
    if size <= _SCAN:
        return bytes(view).isascii()
    chunk = bytearray(_SCAN)
    start = 0
    while start + _SCAN <= size:
        chunk[:] = view[start : start + _SCAN]  # the same length: copied in place
        if not chunk.isascii():
            return False
        start += _SCAN
    return bytes(view[start:]).isascii()


def blob_view(blobs: Mapping[str, bytes], name: str) -> bytes | memoryview:
    """A blob's bytes, without copying them out of a ``Blobs``: for reading (hashing, writing,
    decoding) what is not kept."""
    return blobs.view(name) if isinstance(blobs, Blobs) else blobs[name]


def blob_size(blobs: Mapping[str, bytes], name: str) -> int:
    return len(blob_view(blobs, name))


def blob_isascii(blobs: Mapping[str, bytes], name: str) -> bool:
    """Whether a blob is ASCII, without copying it out of a ``Blobs`` (which remembers)."""
    return blobs.isascii(name) if isinstance(blobs, Blobs) else blobs[name].isascii()


@dataclass
class Entry:
    key: str
    backend: str
    name: str
    blobs: MutableMapping[str, bytes]
    meta: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        # Views of a decoded entry's blobs: encoding copies each blob once, into the result.
        views = [blob_view(self.blobs, name) for name in self.blobs]
        header = {
            "key": self.key,
            "backend": self.backend,
            "name": self.name,
            "blobs": [[name, len(data)] for name, data in zip(self.blobs, views, strict=True)],
            # Found once here, so that no reader scans megabytes of text stages for it (see decode).
            "ascii": [name for name in self.blobs if blob_isascii(self.blobs, name)],
            "meta": self.meta,
        }
        head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
        digest = hashlib.sha256(head)
        for data in views:
            digest.update(data)
        return b"".join([_PREFIX.pack(MAGIC, VERSION, len(head), digest.digest()), head, *views])

    @property
    def size(self) -> int:
        return sum(blob_size(self.blobs, name) for name in self.blobs)


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
        spans: dict[str, tuple[int, int]] = {}
        for name, size in header["blobs"]:
            if not isinstance(name, str) or not isinstance(size, int) or size < 0:
                raise CorruptEntry("malformed blob table")
            spans[name] = (offset, offset + size)
            offset += size
        key, backend, name, meta = header["key"], header["backend"], header["name"], header["meta"]
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptEntry(f"malformed header: {exc}") from None
    # Which blobs are ASCII, as the writer found (the checksum holds it to what was written):
    # entries written before it was recorded, or with a list that is not one, are scanned where
    # asked. Only whoever could forge the checksum could make it lie, and such a writer could
    # put any binary in the entry anyway.
    listed = header.get("ascii")
    ascii = None
    if isinstance(listed, list) and all(isinstance(x, str) for x in listed):
        text = set(listed)
        ascii = {blob: blob in text for blob in spans}
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
    return Entry(key=key, backend=backend, name=name, blobs=Blobs(data, spans, ascii), meta=meta)
