"""The bytes of one cache entry: the only format any tier stores.

::

    b"ACMPL" version:u8 header_len:u32 sha256:32 header(JSON) blob blob ...

The header is small JSON: the entry's key, backend and kernel name, the names, sizes and
SHA-256 digests of the blobs, which of them are ASCII text (``ascii``: found once, by the
writer), and backend metadata. The SHA-256 of the prefix covers the header (format 2, written
now); the header's digests cover each blob. An entry of format 1 (still read) has no digest per
blob, and its prefix's SHA-256 covers the header and every blob. Nothing in an entry is ever
unpickled; a reader that finds anything out of place (magic, version, lengths, digests, key)
treats the entry as missing.

An entry read from bytes (``decode``) keeps its blobs where they were read (``Blobs``): a blob is
copied out the first time it is asked for, so that reading an entry costs one copy of the file,
not two. An entry read from a file (``read_entry_at``) reads only what loading it needs where
its backend says so: a Triton kernel's binary and metadata, a fifth of its bytes, each checked
against its digest. Its text stages (IRs, PTX: what a warm start never looks at) are read, and
checked, the first time someone asks for one (``BlobSource``).
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol

MAGIC = b"ACMPL"
VERSION = 2  # written; format 1 is still read
_VERSIONS = (1, 2)
_PREFIX = struct.Struct(">5sBI32s")
_HEX_DIGEST = frozenset("0123456789abcdef")

# The backends whose entries' text stages are read from a file only when asked for (their
# loaders never read them): everything else is read whole.
_LAZY_BACKENDS = frozenset({"triton"})
# The first read of an entry file: the prefix and the header, most of the time in one call.
_HEAD_READ = 8192


class CorruptEntry(ValueError):
    """The bytes are not a whole, intact entry (for the key asked)."""


# How much of a blob ``blob_isascii`` copies at a time: small enough to stay in a CPU's cache
# and in memory the allocator hands out again, rather than fresh pages for a copy of the blob.
_SCAN = 1 << 16


class BlobSource(Protocol):
    """Where the blobs of an entry read in part are (``read_entry_at``): ``read`` returns each
    pending blob, by name, checked against its digest, or raises ``CorruptEntry`` (the entry is
    gone, damaged, or not the one read first)."""

    def read(self, pending: Mapping[str, tuple[int, int, bytes]]) -> dict[str, bytes]: ...


class _Pending(tuple[int, int, bytes]):
    """A blob not read yet: its (start, end) in the entry's file, and its SHA-256."""

    __slots__ = ()


class Blobs(MutableMapping[str, bytes]):
    """The blobs of an entry read from bytes, by name, in their order: each one stays a span of
    those bytes until it is asked for, then is copied out once (and kept). Set, replace or
    remove blobs as in a dict. ``blob_view`` and ``blob_isascii`` read a blob without copying it.

    Copying every blob out at once costs a second copy of the whole entry in fresh memory (and
    a page fault per 4 KiB of it), while a warm start needs only each kernel's binary and
    metadata: its IRs and PTX are read only where someone looks at them.

    An entry read in part from a file (``read_entry_at``) holds the others as pending: the
    first one asked for reads them all from the file (``BlobSource``), once."""

    __slots__ = ("_ascii", "_data", "_items", "_reading", "_source")

    def __init__(
        self,
        data: bytes,
        spans: Mapping[str, bytes | tuple[int, int] | _Pending],
        ascii: dict[str, bool] | None = None,
        source: BlobSource | None = None,
    ) -> None:
        self._data = data
        # A blob not copied out yet is its (start, end) in _data; one not read yet, a _Pending.
        self._items: dict[str, bytes | tuple[int, int] | _Pending] = dict(spans)
        # What isascii() found, by blob; or what the entry's header says its writer found.
        self._ascii: dict[str, bool] = ascii or {}
        self._source = source
        # Held while pending blobs are read: one read of the file for threads asking at once.
        self._reading = threading.Lock() if source is not None else None

    def nbytes(self) -> int:
        """The blobs' bytes in all, read or not (nothing is read to say it)."""
        items = self._items.values()
        return sum(len(item) if isinstance(item, bytes) else item[1] - item[0] for item in items)

    def __getitem__(self, name: str) -> bytes:
        item = self._items[name]
        if isinstance(item, tuple):
            if isinstance(item, _Pending):
                self.read_pending()
                return self[name]
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
        return f"Blobs({ {name: self.size(name) for name in self._items} })"

    @property
    def pending(self) -> list[str]:
        """The blobs not read yet (an entry read in part), in their order."""
        return [name for name, item in self._items.items() if isinstance(item, _Pending)]

    def size(self, name: str) -> int:
        """The blob's size, without reading or copying it."""
        item = self._items[name]
        return item[1] - item[0] if isinstance(item, tuple) else len(item)

    def view(self, name: str) -> bytes | memoryview:
        """The blob's bytes without a copy: a view of the bytes it was read from, or the blob."""
        item = self._items[name]
        if isinstance(item, tuple):
            if isinstance(item, _Pending):
                return self[name]
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

    def read_pending(self) -> None:
        """Read every pending blob from the entry's file, at once, if not done (blocking; raises
        ``CorruptEntry``, and the next call tries again)."""
        if self._reading is None:
            return
        with self._reading:
            source = self._source
            if source is None:
                return  # another thread read them meanwhile
            pending: dict[str, _Pending] = {}
            for name, item in self._items.items():
                if isinstance(item, _Pending):
                    pending[name] = item
            self._items.update(source.read(pending))
            self._source = None


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
    """A blob's size, without reading or copying it out of a ``Blobs``."""
    return blobs.size(name) if isinstance(blobs, Blobs) else len(blobs[name])


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
            "blobs": [
                [name, len(data), hashlib.sha256(data).hexdigest()]
                for name, data in zip(self.blobs, views, strict=True)
            ],
            # Found once here, so that no reader scans megabytes of text stages for it (see decode).
            "ascii": [name for name in self.blobs if blob_isascii(self.blobs, name)],
            "meta": self.meta,
        }
        head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
        digest = hashlib.sha256(head).digest()
        return b"".join([_PREFIX.pack(MAGIC, VERSION, len(head), digest), head, *views])

    @property
    def size(self) -> int:
        return sum(blob_size(self.blobs, name) for name in self.blobs)


class _ShortHeader(Exception):
    """The bytes given end inside the header: ``needed`` bytes hold it."""

    def __init__(self, needed: int) -> None:
        self.needed = needed


def _prefix(data: bytes) -> tuple[int, int, bytes]:
    """(version, the header's end, the prefix's digest); raises ``CorruptEntry``."""
    if len(data) < _PREFIX.size:
        raise CorruptEntry("truncated before the header")
    magic, version, head_len, digest = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise CorruptEntry("not an acompile cache entry")
    if version not in _VERSIONS:
        raise CorruptEntry(f"entry format {version}, this acompile reads {', '.join(map(str, _VERSIONS))}")
    return version, _PREFIX.size + head_len, digest


def _header(data: bytes | memoryview, end: int) -> dict[str, Any]:
    try:
        header = json.loads(bytes(data[_PREFIX.size : end]))
    except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested past the stack
        raise CorruptEntry(f"unreadable header: {type(exc).__name__}: {exc}") from None
    if not isinstance(header, dict):
        raise CorruptEntry("header is not an object")
    return header


def peek_header(data: bytes) -> dict[str, Any]:
    """The header alone, unverified (for listings)."""
    _, end, digest = _prefix(data)
    if len(data) < end:
        raise CorruptEntry("truncated inside the header")
    header = _header(data, end)
    header["_end"] = end
    header["_digest"] = digest
    return header


@dataclass
class _Layout:
    """What an entry's prefix and header say, checked for shape (not yet for digests)."""

    version: int
    end: int  # the header's end: the first blob's start
    digest: bytes  # the prefix's
    key: str
    backend: str
    name: str
    meta: dict[str, Any]
    spans: dict[str, tuple[int, int]]
    digests: dict[str, bytes]  # each blob's SHA-256 (format 2; none in format 1)
    ascii: dict[str, bool] | None


def _layout(data: bytes, size: int, expect_key: str | None) -> _Layout:
    """The layout of an entry of ``size`` bytes whose first bytes are ``data``. Raises
    ``_ShortHeader`` where they end inside the header, ``CorruptEntry`` for anything out of
    place."""
    version, end, digest = _prefix(data)
    if size < end:
        raise CorruptEntry("truncated inside the header")
    if len(data) < end:
        raise _ShortHeader(end)
    header = _header(data, end)
    offset = end
    spans: dict[str, tuple[int, int]] = {}
    digests: dict[str, bytes] = {}
    try:
        for row in header["blobs"]:
            if version == 1:
                name, blob_size = row
            else:
                name, blob_size, hexdigest = row
                if (
                    not isinstance(hexdigest, str)
                    or len(hexdigest) != 64
                    or not _HEX_DIGEST.issuperset(hexdigest)
                ):
                    raise CorruptEntry("malformed blob table")
                digests[name] = bytes.fromhex(hexdigest)
            if not isinstance(name, str) or type(blob_size) is not int or blob_size < 0 or name in spans:
                raise CorruptEntry("malformed blob table")
            spans[name] = (offset, offset + blob_size)
            offset += blob_size
        key, backend, name, meta = header["key"], header["backend"], header["name"], header["meta"]
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, CorruptEntry):
            raise
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
    if offset != size:
        raise CorruptEntry(f"length mismatch: header describes {offset} bytes, entry has {size}")
    if expect_key is not None and key != expect_key:
        raise CorruptEntry(f"entry holds key {key[:16]}…, not {expect_key[:16]}…")
    return _Layout(version, end, digest, key, backend, name, meta, spans, digests, ascii)


def _check_blob(layout: _Layout, name: str, blob: bytes | memoryview) -> None:
    if hashlib.sha256(blob).digest() != layout.digests[name]:
        raise CorruptEntry(f"content does not match its checksum (blob {name})")


def decode(data: bytes, expect_key: str | None = None, *, verify: bool = True) -> Entry:
    """Parse and check an entry; raises ``CorruptEntry`` for anything but a whole, intact one."""
    try:
        layout = _layout(data, len(data), expect_key)
    except _ShortHeader:  # the size check comes first: unreachable with the whole entry
        raise CorruptEntry("truncated inside the header") from None
    if verify:
        view = memoryview(data)
        if layout.version == 1:
            # The header and the blobs, as stored: one hash over everything after the prefix.
            if hashlib.sha256(view[_PREFIX.size :]).digest() != layout.digest:
                raise CorruptEntry("content does not match its checksum")
        else:
            if hashlib.sha256(view[_PREFIX.size : layout.end]).digest() != layout.digest:
                raise CorruptEntry("content does not match its checksum (header)")
            for blob, (start, end) in layout.spans.items():
                _check_blob(layout, blob, view[start:end])
    return Entry(
        key=layout.key,
        backend=layout.backend,
        name=layout.name,
        blobs=Blobs(data, layout.spans, layout.ascii),
        meta=layout.meta,
    )


def read_entry_at(read: Callable[[int, int], bytes], size: int, key: str, source: BlobSource) -> Entry:
    """The verified entry ``key`` of a file of ``size`` bytes, ``read(start, length)`` reading
    it (blocking). Where the entry's backend loads without its text stages (a Triton kernel's
    IRs and PTX: four fifths of its bytes), only the header, the binaries and the metadata are
    read and checked now; the text stages are read, and checked, from ``source`` the first time
    one is asked for. Anything else is read whole. Raises ``CorruptEntry``; binaries are copied
    out (``Blobs.copy_out_binaries``)."""
    head = read(0, min(size, _HEAD_READ))
    try:
        layout = _layout(head, size, key)
    except _ShortHeader as short:
        head += read(len(head), short.needed - len(head))
        try:
            layout = _layout(head, size, key)
        except _ShortHeader:  # the file shrank under the read: never an entry's doing
            raise CorruptEntry("truncated inside the header") from None
    eager = [
        name for name in layout.spans if name == "json" or layout.ascii is None or not layout.ascii[name]
    ]
    if layout.version == 1 or layout.backend not in _LAZY_BACKENDS or len(eager) == len(layout.spans):
        data = read(0, size) if size > len(head) else head  # one read, no copy to join two
        entry = decode(data, key)
        assert isinstance(entry.blobs, Blobs)
        entry.blobs.copy_out_binaries()
        return entry
    if hashlib.sha256(memoryview(head)[_PREFIX.size : layout.end]).digest() != layout.digest:
        raise CorruptEntry("content does not match its checksum (header)")
    # One read of the span holding every blob loading needs (the last ones, as Triton's
    # entries are written); a blob it spans that is not needed is read and dropped.
    low = min(layout.spans[name][0] for name in eager)
    high = max(layout.spans[name][1] for name in eager)
    chunk = memoryview(head)[low:high] if high <= len(head) else memoryview(read(low, high - low))
    if len(chunk) != high - low:
        raise CorruptEntry("truncated")
    items: dict[str, bytes | tuple[int, int] | _Pending] = {}
    for name, (start, end) in layout.spans.items():
        if name in eager:
            blob = items[name] = bytes(chunk[start - low : end - low])
            _check_blob(layout, name, blob)
        else:
            items[name] = _Pending((start, end, layout.digests[name]))
    blobs = Blobs(b"", items, layout.ascii, source)
    return Entry(key=layout.key, backend=layout.backend, name=layout.name, blobs=blobs, meta=layout.meta)
