"""Cache bundles, pruning and key explanations: the operations on a whole cache folder.

- ``export_bundle(root, path, keys=None, *, signing_key=None)``: the folder's entries (or the
  ones named) in one gzip'd tar archive, for seeding another machine or replica; signed where a
  signing key is configured.
- ``import_bundle(root, path, *, signing_key=None, allow_unsigned=False)``: load a bundle into a
  folder, verifying its signature (where a signing key is configured) and every entry.
- ``prune(root, max_bytes=..., max_age_s=...)``: bound a folder by size and age.
- ``explain(parts_a, parts_b)``, ``explain_key(root, key)``, ``explain_miss(root, parts)``: which
  factors of a key differ, from the key parts an entry records in its header.

A bundle is a tar archive (gzip) holding ``acompile-bundle.json`` first (the bundle's format,
acompile's version, when it was made, how many entries it holds, the SHA-256 of each entry and,
when signed, ``signature``: an HMAC-SHA256 with the signing key over all of that), then one member
per entry, ``entries/<key>``, holding the entry's bytes exactly as the disk tier stores them. The
description comes first and lists every entry's digest, so an importer verifies the signature
before it writes anything, and each entry as it streams past.

Nothing in a bundle is trusted: an importer takes only members whose name is a key and whose
bytes are a whole, intact entry for that key (``_entry.decode``), listed with that digest where
the description lists digests, and writes them through the disk tier (atomic). The signing key is
the shared tier's (the argument, else ``$ACOMPILE_SIGNING_KEY``).

Every blocking step (reading and writing files, hashing, compressing) runs in a worker thread,
never on the event loop; long ones check for cancellation between entries.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import io
import json
import logging
import os
import re
import secrets
import struct
import tarfile
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import anyio
import anyio.from_thread
import anyio.to_thread

from acompile._cache._disk import DiskTier
from acompile._cache._entry import _PREFIX, CorruptEntry, decode, peek_header
from acompile._cache._keys import make_key
from acompile._cache._shared import key_id, signing_key_from
from acompile._errors import AcompileError
from acompile._version import __version__

BUNDLE_FORMAT = 1
MANIFEST_NAME = "acompile-bundle.json"
ENTRY_PREFIX = "entries/"
# No entry comes near this: a bigger member is refused unread (a bundle is untrusted input).
MAX_MEMBER_BYTES = 1 << 30
# The description lists every entry's digest (~135 bytes each): room for ~500,000 entries.
_MAX_MANIFEST_BYTES = 64 << 20
# \Z, not $: "$" also matches before a final newline, and "<key>\n" is not a key.
_KEY_RE = re.compile(r"\A[0-9a-f]{64}\Z")
_SIGNATURE_ALGORITHM = "hmac-sha256"

logger = logging.getLogger("acompile")
# Temporary files (names starting with ".") older than this are left over from a writer that died.
STALE_TEMP_S = 3600.0


# --- reports -------------------------------------------------------------------------------------


@dataclass
class BundleReport:
    """What an export or an import did.

    ``entries``: entries written into the bundle (export) or into the folder (import).
    ``present``: (import) entries the folder already held with the same bytes.
    ``kept``: (import) entries the folder already held, intact, with other bytes: left as they were.
    ``repaired``: (import) damaged entries of the folder replaced by the bundle's (among ``entries``).
    ``rejected``: ``(name, reason)`` for each entry left out: damaged, unsafe or unexpected.
    ``missing``: (export) keys asked for that the folder does not hold.
    ``error``: (import) the archive itself is damaged part-way; what came before it was imported.
    ``signature``: (export) "signed" or "unsigned"; (import) "verified", "unsigned (allowed)",
    "unsigned" or "not verified (no signing key)" (no key configured here: nothing to check
    against).
    """

    operation: str
    path: Path
    entries: int = 0
    bytes: int = 0
    present: int = 0
    kept: int = 0
    repaired: int = 0
    rejected: list[tuple[str, str]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    error: str | None = None
    bundle_info: dict[str, Any] = field(default_factory=dict)
    signature: str = "unsigned"

    @property
    def ok(self) -> bool:
        return not self.rejected and not self.missing and self.error is None

    def summary(self) -> str:
        if self.operation == "export":
            text = f"exported {_count(self.entries, 'entry', 'entries')} ({_human(self.bytes)})"
            if self.rejected:
                text += f"; {_count(len(self.rejected), 'damaged entry', 'damaged entries')} left out"
            if self.missing:
                text += f"; {_count(len(self.missing), 'key')} not in the cache"
            return text + f"; {self.signature}"
        parts = [f"imported {_count(self.entries, 'entry', 'entries')} ({_human(self.bytes)})"]
        if self.repaired:
            parts.append(f"{self.repaired} of them replacing damaged ones")
        if self.present:
            parts.append(f"{self.present} already present")
        if self.kept:
            parts.append(f"{self.kept} present with other bytes (kept)")
        if self.rejected:
            parts.append(f"{len(self.rejected)} rejected")
        text = ", ".join(parts)
        if self.error:
            text += f"; the archive is damaged: {self.error}"
        if self.signature == "verified":
            text += "; signature verified"
        else:
            text += f"; NOT authenticated ({self.signature})"
        return text


@dataclass
class PruneReport:
    """What ``prune`` removed (or, with ``dry_run``, would remove)."""

    root: Path
    dry_run: bool = False
    entries_before: int = 0
    bytes_before: int = 0
    removed_by_age: int = 0
    removed_by_size: int = 0
    bytes_removed: int = 0
    temp_files_removed: int = 0
    # Native libraries (<root>/lib/<key>.so, .o) whose entry is gone: counted, never removed (a
    # running process may be loading one, and a `.o` path is handed to the caller to link with).
    orphan_libs: int = 0
    orphan_lib_bytes: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def removed(self) -> int:
        return self.removed_by_age + self.removed_by_size

    @property
    def entries_after(self) -> int:
        return self.entries_before - self.removed

    @property
    def bytes_after(self) -> int:
        return self.bytes_before - self.bytes_removed

    def summary(self) -> str:
        verb = "would remove" if self.dry_run else "removed"
        text = (
            f"{verb} {_count(self.removed, 'entry', 'entries')} ({_human(self.bytes_removed)}: "
            f"{self.removed_by_age} by age, {self.removed_by_size} by size); "
            f"{_count(self.entries_after, 'entry', 'entries')} ({_human(self.bytes_after)}) remain"
        )
        if self.temp_files_removed:
            text += f"; {verb} {_count(self.temp_files_removed, 'stale temporary file')}"
        if self.orphan_libs:
            text += (
                f"; {_count(self.orphan_libs, 'library file')} ({_human(self.orphan_lib_bytes)}) in lib/ "
                "outlived their entries (left in place)"
            )
        if self.errors:
            text += f"; {_count(len(self.errors), 'error')}: {self.errors[0]}"
        return text


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


# --- export --------------------------------------------------------------------------------------


class _Changed(Exception):
    """An entry changed between the two passes of an export: gone or damaged (``reason``), or
    rewritten, intact, with other bytes (``digest``: its new one)."""

    def __init__(self, key: str, reason: str | None, digest: str | None = None) -> None:
        self.key, self.reason, self.digest = key, reason, digest


async def export_bundle(
    root: Path,
    path: Path,
    keys: Iterable[str] | None = None,
    *,
    signing_key: str | bytes | None = None,
) -> BundleReport:
    """Write the entries of the cache folder ``root`` (all, or those of ``keys``) into a bundle.

    Each entry is verified before it goes in; damaged ones are left out and listed in
    ``rejected``, keys the folder does not hold in ``missing``. With a signing key (the argument,
    else ``$ACOMPILE_SIGNING_KEY``: the shared tier's key) the bundle is signed (HMAC-SHA256 over
    its description, which lists every entry's SHA-256). The bundle is written to a temporary
    file beside ``path`` and renamed over it: ``path`` is never a partial bundle. Raises
    ``OSError`` where ``path`` cannot be written, ``ValueError`` for a key under 16 bytes.
    """
    key = signing_key_from(signing_key)
    disk = DiskTier(root)
    report = BundleReport("export", Path(path), signature="signed" if key is not None else "unsigned")
    wanted = None if keys is None else list(dict.fromkeys(keys))
    return await anyio.to_thread.run_sync(_export, disk, Path(path), wanted, report, key)


def _export(
    disk: DiskTier, path: Path, keys: list[str] | None, report: BundleReport, signing_key: bytes | None
) -> BundleReport:
    candidates: list[tuple[str, Path]] = []
    if keys is None:
        for entry_path in disk.iter_paths():
            if _KEY_RE.match(entry_path.name):
                candidates.append((entry_path.name, entry_path))
            else:
                report.rejected.append((str(entry_path), "not a cache entry (its name is not a key)"))
    else:
        for key in keys:
            if not _KEY_RE.match(key):
                report.rejected.append((key, "not a cache key (64 hexadecimal digits)"))
                continue
            candidates.append((key, disk.path(key)))
    # Pass 1: verify, so that the bundle's description (written first) holds its true count and
    # every entry's digest.
    good: dict[str, tuple[Path, str]] = {}
    for key, entry_path in candidates:
        anyio.from_thread.check_cancelled()
        reason, digest = _check_file(entry_path, key)
        if digest is not None:
            good[key] = (entry_path, digest)
        elif reason == "absent":
            if keys is not None:
                report.missing.append(key)
        else:
            report.rejected.append((key, reason or "damaged"))
    # Pass 2: write. An entry removed, damaged or rewritten in between (another process pruning
    # or compiling, say) is left out or takes its new digest, and the bundle is written again,
    # rather than one whose description is wrong.
    for _ in range(5):
        try:
            report.entries, report.bytes = _write_bundle(path, good, signing_key)
            return report
        except _Changed as changed:
            if changed.digest is not None:
                good[changed.key] = (good[changed.key][0], changed.digest)
                continue
            del good[changed.key]
            if changed.reason is None:
                if keys is not None:
                    report.missing.append(changed.key)
            else:
                report.rejected.append((changed.key, changed.reason))
    raise AcompileError(f"cannot export {disk.root}: its entries kept changing while the bundle was written")


def _check_file(path: Path, key: str) -> tuple[str | None, str | None]:
    """(None, its SHA-256) for an intact entry, else ("absent", None) or (why it is damaged, None)."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return "absent", None
    except OSError as exc:
        return f"cannot read: {exc}", None
    try:
        decode(data, key)
    except CorruptEntry as exc:
        return str(exc), None
    return None, hashlib.sha256(data).hexdigest()


def _canonical(description: dict[str, Any]) -> bytes:
    """What a bundle's signature covers: its description without the signature, as canonical JSON."""
    unsigned = {k: v for k, v in description.items() if k != "signature"}
    return b"acompile bundle\0" + json.dumps(unsigned, sort_keys=True, separators=(",", ":")).encode()


def _sign(description: dict[str, Any], signing_key: bytes) -> dict[str, str]:
    mac = hmac.new(signing_key, _canonical(description), hashlib.sha256).hexdigest()
    return {"algorithm": _SIGNATURE_ALGORITHM, "key_id": key_id(signing_key), "mac": mac}


def _write_bundle(
    path: Path, entries: dict[str, tuple[Path, str]], signing_key: bytes | None
) -> tuple[int, int]:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    created = time.time()
    total = 0
    try:
        with open(tmp, "wb") as raw:
            with tarfile.open(fileobj=raw, mode="w:gz", compresslevel=6) as tar:
                description: dict[str, Any] = {
                    "format": BUNDLE_FORMAT,
                    "acompile": __version__,
                    "created": datetime.datetime.fromtimestamp(created, datetime.timezone.utc).isoformat(),
                    "count": len(entries),
                    "digests": {key: digest for key, (_, digest) in entries.items()},
                }
                if signing_key is not None:
                    description["signature"] = _sign(description, signing_key)
                _add_member(tar, MANIFEST_NAME, json.dumps(description, indent=1).encode(), created)
                for key, (entry_path, digest) in entries.items():
                    anyio.from_thread.check_cancelled()
                    try:
                        data = entry_path.read_bytes()
                        mtime = entry_path.stat().st_mtime
                    except (FileNotFoundError, NotADirectoryError):
                        raise _Changed(key, None) from None
                    except OSError as exc:
                        raise _Changed(key, f"cannot read: {exc}") from None
                    try:
                        decode(data, key)
                    except CorruptEntry as exc:
                        raise _Changed(key, str(exc)) from None
                    now = hashlib.sha256(data).hexdigest()
                    if now != digest:
                        raise _Changed(key, None, now)
                    _add_member(tar, ENTRY_PREFIX + key, data, mtime)
                    total += len(data)
            # The archive is whole (gzip trailer included) once tarfile has closed it.
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return len(entries), total


def _add_member(tar: tarfile.TarFile, name: str, data: bytes, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(mtime)
    info.mode = 0o600
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))


# --- import --------------------------------------------------------------------------------------


@dataclass
class _Member:
    name: str
    key: str | None = None
    data: bytes | None = None
    reason: str | None = None  # why it is rejected


class _BundleReader:
    """Reads a bundle member by member (blocking: each call runs in a thread)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[bytes] | None = None
        self._tar: tarfile.TarFile | None = None
        self.info: dict[str, Any] = {}
        self.members_seen = 0
        # Each entry's SHA-256 as the description lists it (None for bundles that list none),
        # and whether a verified signature covers the list.
        self.digests: dict[str, str] | None = None
        self.signed = False

    def open(self) -> None:
        try:
            self._file = open(self.path, "rb")
        except FileNotFoundError:
            raise AcompileError(f"no bundle at {self.path}") from None
        except OSError as exc:
            raise AcompileError(f"cannot read the bundle {self.path}: {exc}") from None
        try:
            # Stream mode: one pass, no seeking, no member read twice.
            self._tar = tarfile.open(fileobj=self._file, mode="r|*")
            first = self._tar.next()
        except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
            self.close()
            raise AcompileError(
                f"{self.path} is not an acompile bundle: it is not a readable tar archive ({exc})"
            ) from None
        if first is None or first.name != MANIFEST_NAME or not first.isreg():
            self.close()
            found = "an empty archive" if first is None else f"its first member is {first.name!r}"
            raise AcompileError(
                f"{self.path} is not an acompile bundle: {found}, not {MANIFEST_NAME} "
                "(make bundles with `acompile cache export`)"
            )
        try:
            if first.size > _MAX_MANIFEST_BYTES:
                raise ValueError(f"{first.size} bytes")
            info = json.loads(self._read(first))
            if not isinstance(info, dict) or not isinstance(info.get("format"), int):
                raise ValueError("no format number")
            digests = info.get("digests")
            if digests is not None and not (
                isinstance(digests, dict) and all(isinstance(v, str) for v in digests.values())
            ):
                raise ValueError("its digests are not a table of key to SHA-256")
        except (ValueError, tarfile.TarError, EOFError, OSError, zlib.error) as exc:
            self.close()
            raise AcompileError(f"{self.path}: unreadable {MANIFEST_NAME} ({exc})") from None
        if info["format"] != BUNDLE_FORMAT:
            self.close()
            raise AcompileError(
                f"{self.path} is a bundle of format {info['format']} (made by acompile "
                f"{info.get('acompile', '?')}); this acompile ({__version__}) reads format {BUNDLE_FORMAT}"
            )
        self.info = info

    def _read(self, member: tarfile.TarInfo) -> bytes:
        assert self._tar is not None
        f = self._tar.extractfile(member)
        if f is None:
            raise tarfile.ReadError(f"{member.name} has no data")
        data = f.read()
        if len(data) != member.size:
            raise EOFError(f"{member.name} is cut short")
        return data

    def next(self) -> _Member | None:
        """The next member, checked and verified; None at the end. Raises ``_ArchiveDamaged``."""
        assert self._tar is not None
        try:
            member = self._tar.next()
            if member is None:
                return None
            self.members_seen += 1
            name = member.name
            reason = _unsafe(member)
            if reason is not None:
                return _Member(name, reason=reason)
            key = name[len(ENTRY_PREFIX) :]
            signed = "signed " if self.signed else ""
            if self.digests is not None and key not in self.digests:
                return _Member(name, reason=f"refused: not listed in the bundle's {signed}description")
            data = self._read(member)
        except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
            raise _ArchiveDamaged(f"after {self.members_seen} members: {exc}") from None
        if self.digests is not None and not hmac.compare_digest(
            hashlib.sha256(data).hexdigest(), self.digests[key]
        ):
            return _Member(
                name, key=key, reason=f"refused: its SHA-256 is not the {signed}digest the bundle lists"
            )
        try:
            decode(data, key)
        except CorruptEntry as exc:
            return _Member(name, key=key, reason=f"damaged entry: {exc}")
        return _Member(name, key=key, data=data)

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()
            self._tar = None
        if self._file is not None:
            self._file.close()
            self._file = None


class _ArchiveDamaged(Exception):
    pass


def _unsafe(member: tarfile.TarInfo) -> str | None:
    """Why a member may not be imported, or None: only ``entries/<key>`` regular files are."""
    name = member.name
    if name.startswith(("/", "\\")) or ".." in name.replace("\\", "/").split("/"):
        return "refused: a path outside the bundle"
    if name == MANIFEST_NAME:
        return "refused: a second bundle description"
    if not name.startswith(ENTRY_PREFIX) or not _KEY_RE.match(name[len(ENTRY_PREFIX) :]):
        # A name with a newline or another control character is shown escaped.
        shown = "" if name.isprintable() else f", got {name!r}"
        return f"refused: not an entry (expected entries/<64 hex digits>{shown})"
    if not member.isreg():
        return "refused: not a regular file (links and devices are never imported)"
    if member.size > MAX_MEMBER_BYTES:
        return f"refused: {_human(member.size)}, over the {_human(MAX_MEMBER_BYTES)} bound on an entry"
    return None


async def import_bundle(
    root: Path,
    path: Path,
    *,
    signing_key: str | bytes | None = None,
    allow_unsigned: bool = False,
) -> BundleReport:
    """Load a bundle into the cache folder ``root``, verifying its signature and every entry.

    With a signing key (the argument, else ``$ACOMPILE_SIGNING_KEY``: the shared tier's key), the
    bundle's signature must verify before anything is written: a bundle signed with another key,
    or whose signature does not verify, is refused whole; an unsigned one is refused unless
    ``allow_unsigned`` (then imported with a warning). Without a key there is nothing to verify
    against: the bundle is imported, and ``report.signature`` says it was not authenticated.

    Good entries are written through the disk tier (atomic publish); an entry the folder already
    holds intact is left as it is (``present``, or ``kept`` where its bytes differ); a damaged one
    in the folder is replaced (``repaired``). Members that are not intact entries, whose names
    are not ``entries/<key>``, or (where the description lists digests) that are not listed
    with their SHA-256, are ``rejected`` with the reason.

    Raises ``AcompileError`` when ``path`` is absent, not an acompile bundle, or refused by the
    signature check (nothing is imported then); ``ValueError`` for a key under 16 bytes. An
    archive damaged part-way sets ``error``; the entries before the damage are imported.
    """
    key = signing_key_from(signing_key)
    disk = DiskTier(root)
    report = BundleReport("import", Path(path))
    reader = _BundleReader(Path(path))
    await anyio.to_thread.run_sync(reader.open)
    try:
        report.signature = _check_signature(reader, key, allow_unsigned)
        report.bundle_info = dict(reader.info)
        await anyio.to_thread.run_sync(disk.prepare)
        entry_members = 0
        while True:
            try:
                member = await anyio.to_thread.run_sync(reader.next)
            except _ArchiveDamaged as exc:
                report.error = str(exc)
                break
            if member is None:
                break
            if member.name.startswith(ENTRY_PREFIX):
                entry_members += 1
            if member.data is None or member.key is None:
                report.rejected.append((member.name, member.reason or "rejected"))
                continue
            try:
                await _store(disk, member.key, member.data, report)
            except ValueError as exc:  # the disk tier refused the key: one member, not the import
                report.rejected.append((member.name, f"refused: {exc}"))
        count = len(reader.digests) if reader.digests is not None else reader.info.get("count")
        if report.error is None and isinstance(count, int) and entry_members < count:
            # Members are missing (more than it says is tampering, and those are rejected above).
            report.error = f"the bundle says it holds {count} entries, but only {entry_members} are there"
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(reader.close)
    return report


def _check_signature(reader: _BundleReader, signing_key: bytes | None, allow_unsigned: bool) -> str:
    """What the import may trust, as ``BundleReport.signature``; raises ``AcompileError`` for a
    bundle to refuse."""
    info, path = reader.info, reader.path
    signature = info.get("signature")
    digests = info.get("digests")
    reader.digests = dict(digests) if isinstance(digests, dict) else None
    if signing_key is None:
        status = "unsigned" if signature is None else "not verified (no signing key)"
        logger.warning("importing %s without verifying it: no signing key is configured", path)
        return status
    if signature is None:
        if not allow_unsigned:
            raise AcompileError(
                f"{path} is not signed, and a signing key is configured: refused (export it with "
                "the same signing key, or import it with allow_unsigned=True if you trust it)"
            )
        logger.warning("importing %s, which is not signed (allowed): its entries are not authenticated", path)
        return "unsigned (allowed)"
    if not isinstance(signature, dict) or signature.get("algorithm") != _SIGNATURE_ALGORITHM:
        raise AcompileError(f"{path}: its signature is not one this acompile reads ({_SIGNATURE_ALGORITHM})")
    if signature.get("key_id") != key_id(signing_key):
        raise AcompileError(
            f"{path} is signed with another signing key (key id {signature.get('key_id')!r}; this "
            f"key's id is {key_id(signing_key)!r}): refused"
        )
    mac = signature.get("mac")
    expected = hmac.new(signing_key, _canonical(info), hashlib.sha256).hexdigest()
    if not isinstance(mac, str) or not hmac.compare_digest(mac, expected):
        raise AcompileError(f"{path}: the bundle's signature does not verify (it was altered): refused")
    if reader.digests is None:
        raise AcompileError(f"{path}: a signed bundle that lists no digests: refused")
    reader.signed = True
    return "verified"


async def _store(disk: DiskTier, key: str, data: bytes, report: BundleReport) -> None:
    try:
        local = await disk.get(key)
    except OSError:
        local = None
    if local is not None:
        state = await anyio.to_thread.run_sync(_compare, local, data, key)
        if state == "same":
            report.present += 1
            return
        if state == "intact":
            # Both intact, for the same key: compilers are not always byte-for-byte
            # deterministic. The folder's own entry may be in use; leave it.
            report.kept += 1
            return
        report.repaired += 1
    await disk.set(key, data)
    report.entries += 1
    report.bytes += len(data)


def _compare(local: bytes, data: bytes, key: str) -> str:
    """How the folder's entry compares with the bundle's: "same", "intact" (other bytes) or
    "damaged" (blocking: entries can be large)."""
    if local == data:
        return "same"
    try:
        decode(local, key)
    except CorruptEntry:
        return "damaged"
    return "intact"


# --- prune ---------------------------------------------------------------------------------------


async def prune(
    root: Path,
    *,
    max_bytes: int | None = None,
    max_age_s: float | None = None,
    dry_run: bool = False,
) -> PruneReport:
    """Bound the cache folder ``root`` by age and size.

    First every entry written more than ``max_age_s`` seconds ago is removed, then the oldest
    entries until the entries left total at most ``max_bytes``. Age is the time since the entry
    was written into this folder (its mtime): the disk tier does not touch a file when it reads
    it, so this is not "least recently used". Temporary files left by writers that died (names
    starting with ".", older than an hour) are removed too. Files in ``<root>/lib`` are not
    counted against ``max_bytes`` and are never removed; the report counts those whose entry is
    gone. Removing an entry another process is reading is safe: it keeps the open file.
    """
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    if max_age_s is not None and max_age_s < 0:
        raise ValueError(f"max_age_s must be >= 0, got {max_age_s}")
    report = PruneReport(Path(root), dry_run=dry_run)
    return await anyio.to_thread.run_sync(_prune, DiskTier(root), max_bytes, max_age_s, report)


def _prune(
    disk: DiskTier, max_bytes: int | None, max_age_s: float | None, report: PruneReport
) -> PruneReport:
    now = time.time()
    entries: list[tuple[int, str, Path, int]] = []  # (mtime_ns, name, path, size)
    for entry_path in disk.iter_paths():
        try:
            st = entry_path.stat()
        except FileNotFoundError:
            continue
        except OSError as exc:
            report.errors.append(f"{entry_path}: {exc}")
            continue
        entries.append((st.st_mtime_ns, entry_path.name, entry_path, st.st_size))
    entries.sort()
    report.entries_before = len(entries)
    report.bytes_before = total = sum(e[3] for e in entries)

    def remove(mtime_ns: int, entry_path: Path, size: int) -> bool:
        anyio.from_thread.check_cancelled()
        if report.dry_run:
            report.bytes_removed += size
            return True
        try:
            # Skip an entry rewritten since the scan (a new compile, an import): it is new.
            if entry_path.stat().st_mtime_ns != mtime_ns:
                return False
            entry_path.unlink()
        except FileNotFoundError:
            pass  # someone else removed it: it is gone all the same
        except OSError as exc:
            report.errors.append(f"{entry_path}: {exc}")
            return False
        report.bytes_removed += size
        return True

    kept: list[tuple[int, str, Path, int]] = []
    cutoff_ns = None if max_age_s is None else int((now - max_age_s) * 1e9)
    for entry in entries:
        mtime_ns, _, entry_path, size = entry
        if cutoff_ns is not None and mtime_ns < cutoff_ns:
            if remove(mtime_ns, entry_path, size):
                report.removed_by_age += 1
                total -= size
                continue
        kept.append(entry)
    if max_bytes is not None:
        for mtime_ns, _, entry_path, size in kept:  # oldest first
            if total <= max_bytes:
                break
            if remove(mtime_ns, entry_path, size):
                report.removed_by_size += 1
                total -= size
    _remove_stale_temps(disk, now, report)
    _count_orphan_libs(disk, report)
    return report


def _remove_stale_temps(disk: DiskTier, now: float, report: PruneReport) -> None:
    # Writers' temporary files: the disk tier's (v1/<xx>/.<key>...tmp), native libraries'
    # (lib/.<key>.so.<pid>.<token>) and the toolchain memo's (toolchain/.<name>.<pid>.<token>).
    folders: list[Path] = []
    if disk.entries.is_dir():
        folders += [sub for sub in disk.entries.iterdir() if sub.is_dir()]
    folders += [disk.root / "lib", disk.root / "toolchain"]
    for folder in folders:
        try:
            names = [p for p in folder.iterdir() if p.name.startswith(".")]
        except OSError:
            continue
        for temp in names:
            try:
                st = temp.lstat()
                if not temp.is_file() or now - st.st_mtime < STALE_TEMP_S:
                    continue
                if not report.dry_run:
                    temp.unlink()
            except FileNotFoundError:
                continue
            except OSError as exc:
                report.errors.append(f"{temp}: {exc}")
                continue
            report.temp_files_removed += 1


def _count_orphan_libs(disk: DiskTier, report: PruneReport) -> None:
    lib = disk.root / "lib"
    try:
        files = [p for p in lib.iterdir() if not p.name.startswith(".") and p.suffix in (".so", ".o")]
    except OSError:
        return
    for file in files:
        key = file.stem
        try:
            if _KEY_RE.match(key) and not disk.path(key).exists():
                report.orphan_libs += 1
                report.orphan_lib_bytes += file.stat().st_size
        except OSError:
            continue


_AGE_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


def parse_age(value: str | float) -> float:
    """Seconds from a number of seconds or a string such as ``"30d"``, ``"12h"``, ``"90m"``, ``"3600s"``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        unit = text[-1:] if text[-1:] in _AGE_UNITS else "s"
        number = text[:-1] if text[-1:] in _AGE_UNITS else text
        try:
            seconds = float(number) * _AGE_UNITS[unit]
        except ValueError:
            raise ValueError(
                f"cannot read the age {value!r}: write e.g. '30d', '12h', '90m', '3600s'"
            ) from None
    else:
        raise ValueError(f"an age is seconds or a string such as '30d', got {value!r}")
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"an age must be a finite number >= 0, got {value!r}")
    return seconds


# --- explain -------------------------------------------------------------------------------------


class _Absent:
    """A factor one of the two key-part dicts does not have."""

    def __repr__(self) -> str:
        return "(absent)"

    def __str__(self) -> str:
        return "(absent)"


ABSENT: Any = _Absent()

# The factors of a key, in the order a reader wants them, with what each stands for where the name
# does not say it. Triton's key parts and the native backends' overlap; any other factor is
# reported under its own name.
FACTORS: dict[str, str] = {
    "kernel": "source",  # Triton's hash of the function's source and of every JIT function it calls
    "source": "",
    "name": "kernel name",
    "signature": "",
    "constexprs": "",
    "attrs": "",
    "options": "",
    "name_expressions": "",
    "include_dirs": "",
    "target": "",
    "arch": "",
    "output": "",
    "kind": "compiler",
    "toolchain": "compiler versions",
    "compiler": "compiler version",
    "env": "environment",
    "acompile": "version",
    "backend": "",
    "format": "key format",
}
# Factors whose values are tables: a difference is reported entry by entry ("toolchain.ptxas").
_NESTED = frozenset({"toolchain", "env", "options", "constexprs"})


def explain(parts_a: dict[str, Any], parts_b: dict[str, Any]) -> list[tuple[str, object, object]]:
    """The factors that differ between two keys' parts, as ``(factor, value_a, value_b)``.

    Factors follow ``FACTORS``' order (then any others by name). Where a table differs
    (``toolchain``, ``env``, ``options``, ``constexprs``), each of its differing entries is one
    item named ``factor.entry`` (``"toolchain.ptxas"``, ``"env.TRITON_DEFAULT_FP_FUSION"``). A
    factor one side lacks is ``ABSENT`` there. Values are compared as JSON, as the key is.
    """
    a, b = _as_json(parts_a), _as_json(parts_b)
    names = [n for n in FACTORS if n in a or n in b] + sorted((set(a) | set(b)) - set(FACTORS))
    diffs: list[tuple[str, object, object]] = []
    for name in names:
        va, vb = a.get(name, ABSENT), b.get(name, ABSENT)
        if _same(va, vb):
            continue
        if name in _NESTED and isinstance(va, dict) and isinstance(vb, dict):
            for sub in sorted(set(va) | set(vb)):
                sa, sb = va.get(sub, ABSENT), vb.get(sub, ABSENT)
                if not _same(sa, sb):
                    diffs.append((f"{name}.{sub}", sa, sb))
        else:
            diffs.append((name, va, vb))
    return diffs


def describe_factor(name: str) -> str:
    """A reader's name for an item of ``explain``: ``"kernel"`` -> ``"kernel (source)"``,
    ``"toolchain.ptxas"`` -> ``"toolchain.ptxas (compiler versions)"``."""
    label = FACTORS.get(name.partition(".")[0], "")
    return f"{name} ({label})" if label else name


def _as_json(parts: dict[str, Any]) -> dict[str, Any]:
    # Tuples and lists alike, as make_key sees them.
    value = json.loads(json.dumps(parts, sort_keys=True, default=str))
    if not isinstance(value, dict):
        raise TypeError("key parts must be a dict")
    return value


def _same(a: object, b: object) -> bool:
    if a is ABSENT or b is ABSENT:
        return a is b
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


NO_PARTS_NOTE = (
    "this entry predates key recording: the acompile that wrote it did not store its key's parts, "
    "so what it was compiled from cannot be shown (compile it again to record them)"
)


async def explain_key(root: Path, key: str) -> dict[str, Any]:
    """What the cache folder ``root`` knows of the entry ``key``.

    A dict: ``key``, ``backend``, ``name``, ``bytes``, ``written`` (the file's mtime, seconds since
    the epoch), ``key_parts`` (the parts the key was computed from, or None where the entry
    predates key recording, with ``note`` saying so) and ``parts_match_key`` (whether those parts
    hash to ``key``; None without parts). Raises ``AcompileError`` for an absent or damaged entry
    and ``ValueError`` for a string that is not a key.
    """
    disk = DiskTier(root)
    entry_path = disk.path(key)
    try:
        data = await disk.get(key)
        st = await anyio.to_thread.run_sync(entry_path.stat) if data is not None else None
    except OSError as exc:
        raise AcompileError(f"cannot read the entry {key} in {root}: {exc}") from None
    if data is None or st is None:
        raise AcompileError(f"no entry {key} in {root}")
    try:
        entry = await anyio.to_thread.run_sync(decode, data, key)
    except CorruptEntry as exc:
        raise AcompileError(f"the entry {key} in {root} is damaged: {exc}") from None
    parts = entry.meta.get("key_parts") if isinstance(entry.meta, dict) else None
    result: dict[str, Any] = {
        "key": key,
        "backend": entry.backend,
        "name": entry.name,
        "bytes": len(data),
        "written": st.st_mtime,
        "key_parts": None,
        "parts_match_key": None,
        "note": None,
    }
    if isinstance(parts, dict) and parts:
        result["key_parts"] = parts
        result["parts_match_key"] = make_key(parts) == key
        if not result["parts_match_key"]:
            result["note"] = (
                "the recorded parts do not hash to this key: the acompile that wrote it keyed "
                "with more (or other) parts than it recorded"
            )
    else:
        result["note"] = NO_PARTS_NOTE
    return result


async def explain_miss(
    root: Path, key_parts: dict[str, Any], *, limit: int = 5
) -> list[tuple[str, list[tuple[str, object, object]]]]:
    """Why a request with these key parts misses: the folder's entries of the same kernel (same
    backend and name) that recorded their parts, nearest first, each with ``explain``'s
    differences from ``key_parts``. Empty where the folder holds no other compile of that kernel;
    an entry for exactly these parts is not listed (that would be a hit).
    """
    disk = DiskTier(root)
    want = make_key(key_parts)
    backend, name = key_parts.get("backend"), key_parts.get("name")

    def scan() -> list[tuple[str, dict[str, Any]]]:
        found = []
        for entry_path in disk.iter_paths():
            anyio.from_thread.check_cancelled()
            header = read_header(entry_path)
            if header is None or entry_path.name == want:
                continue
            if header.get("backend") != backend or header.get("name") != name:
                continue
            meta = header.get("meta")
            parts = meta.get("key_parts") if isinstance(meta, dict) else None
            if isinstance(parts, dict) and parts:
                found.append((entry_path.name, parts))
        return found

    candidates = await anyio.to_thread.run_sync(scan)
    ranked = sorted(((key, explain(key_parts, parts)) for key, parts in candidates), key=lambda r: len(r[1]))
    return ranked[:limit]


def read_header(path: Path) -> dict[str, Any] | None:
    """An entry file's header, unverified, reading only as much of the file as it takes
    (blocking); None where the file is absent or is not an entry."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(_PREFIX.size)
            if len(prefix) < _PREFIX.size:
                return None
            _, _, head_len, _ = _PREFIX.unpack(prefix)
            head = f.read(head_len)
        header = peek_header(prefix + head)
    except (OSError, CorruptEntry, struct.error):
        return None
    header.pop("_end", None)
    header.pop("_digest", None)
    return header


__all__ = [
    "ABSENT",
    "BUNDLE_FORMAT",
    "FACTORS",
    "MANIFEST_NAME",
    "MAX_MEMBER_BYTES",
    "BundleReport",
    "PruneReport",
    "describe_factor",
    "explain",
    "explain_key",
    "explain_miss",
    "export_bundle",
    "import_bundle",
    "parse_age",
    "prune",
    "read_header",
]
