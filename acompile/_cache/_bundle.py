"""Cache bundles: a cache folder's entries in one archive, to seed another machine or replica.

- ``export_bundle(root, path, keys=None, *, signing_key=None)``: the folder's entries (or the
  ones named) in one gzip'd tar archive, for seeding another machine or replica; signed where a
  signing key is configured.
- ``import_bundle(root, path, *, signing_key=None, allow_unsigned=False,
  unsafe_unsigned_host_code=False)``: load a bundle into a folder, verifying its signature (where
  a signing key is configured) and every entry.

A bundle is a tar archive (gzip) holding ``acompile-bundle.json`` first (the bundle's format,
acompile's version, when it was made, how many entries it holds, the SHA-256 of each entry and,
when signed, ``signature``: an HMAC-SHA256 with the signing key over all of that), then one member
per entry, ``entries/<key>``, holding the entry's bytes exactly as the disk tier stores them. The
description comes first and lists every entry's digest, so an importer verifies the signature
before it writes anything, and each entry as it streams past.

Nothing in a bundle is trusted: an importer takes only members whose name is a key and whose
bytes are a whole, intact entry for that key (``_entry.decode``), listed with that digest where
the description lists digests, and writes them through the disk tier (atomic). The signing key is
the shared tier's (the argument, else ``$ACOMPILE_SIGNING_KEY``; set but empty is an error).

Host code (C++ and nvcc libraries, object files, torch.compile's entries: ``_shared.host_code``)
is imported only from a bundle whose signature verified with the configured key: from any other
(no key configured, or an unsigned bundle let in by ``allow_unsigned``) those entries are
rejected, and only device code (cubins, PTX) and data go in, unless
``unsafe_unsigned_host_code=True`` (which lets in an unsigned bundle as ``allow_unsigned`` does).

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

from acompile import _files
from acompile._cache._disk import DiskTier
from acompile._cache._entry import CorruptEntry, decode, peek_header
from acompile._cache._layout import MAX_ENTRY_BYTES, human_bytes, is_key, plural, read_state
from acompile._cache._shared import host_code, key_id, signing_key_from
from acompile._errors import AcompileError
from acompile._version import __version__

BUNDLE_FORMAT = 1
MANIFEST_NAME = "acompile-bundle.json"
ENTRY_PREFIX = "entries/"
# No entry comes near this: a bigger member is refused unread (a bundle is untrusted input).
MAX_MEMBER_BYTES = 1 << 30
# The description lists every entry's digest (~135 bytes each): room for ~500,000 entries.
_MAX_MANIFEST_BYTES = 64 << 20
_SIGNATURE_ALGORITHM = "hmac-sha256"

logger = logging.getLogger("acompile")


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
    ``keys``: (import) the bundle's keys the folder holds now (imported, present or kept).
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
    # (import) every key the folder holds an intact entry of after the import, from the bundle.
    keys: list[str] = field(default_factory=list)
    error: str | None = None
    bundle_info: dict[str, Any] = field(default_factory=dict)
    signature: str = "unsigned"

    @property
    def ok(self) -> bool:
        return not self.rejected and not self.missing and self.error is None

    def summary(self) -> str:
        if self.operation == "export":
            text = f"exported {plural(self.entries, 'entry', 'entries')} ({human_bytes(self.bytes)})"
            if self.rejected:
                text += f"; {plural(len(self.rejected), 'damaged entry', 'damaged entries')} left out"
            if self.missing:
                text += f"; {plural(len(self.missing), 'key')} not in the cache"
            return text + f"; {self.signature}"
        parts = [f"imported {plural(self.entries, 'entry', 'entries')} ({human_bytes(self.bytes)})"]
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
    # The bundle is signed with this user's key: only a folder of this user's is vouched for.
    disk.check()
    candidates: list[tuple[str, Path]] = []
    if keys is None:
        for entry_path in disk.iter_paths():
            if is_key(entry_path.name):
                candidates.append((entry_path.name, entry_path))
            else:
                report.rejected.append((str(entry_path), "not a cache entry (its name is not a key)"))
    else:
        for key in keys:
            if not is_key(key):
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
        # Not followed if a link, not waited on if a FIFO, not read if past an entry's bound.
        data = read_state(path, MAX_ENTRY_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        return "absent", None
    except OSError as exc:
        return f"cannot read: {exc}", None
    if data is None:
        return "absent", None
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
    created = time.time()
    total = 0
    # The archive is whole (gzip trailer included) once tarfile has closed it; it is flushed to
    # the disk before it takes the bundle's name (fsync): a bundle is carried to other machines.
    with _files.writing(path, fsync=True) as raw:
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
                    found = read_state(entry_path, MAX_ENTRY_BYTES)
                    if found is None:
                        raise _Changed(key, None)
                    data = found
                    mtime = entry_path.stat(follow_symlinks=False).st_mtime
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
        # Whether entries holding host code may go in: a verified signature, or the unsafe switch.
        self.host_code = False

    def open(self) -> None:
        try:
            self._file = open(self.path, "rb")
        except FileNotFoundError:
            raise AcompileError(f"no bundle at {self.path}") from None
        except OSError as exc:
            raise AcompileError(f"cannot read the bundle {self.path}: {exc}") from None
        try:
            # Stream mode: one pass, no seeking, no member read twice.
            self._tar = tarfile.open(fileobj=self._file, mode="r|*", tarinfo=_BoundedTarInfo)
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
        if not self.host_code and (what := host_code(peek_header(data))) is not None:
            return _Member(
                name,
                key=key,
                reason=f"refused: host code ({what}, which would run on this host) from a bundle "
                "no signing key verified (set $ACOMPILE_SIGNING_KEY to the key that signed it, or "
                "pass unsafe_unsigned_host_code=True to trust whoever made or altered this one)",
            )
        return _Member(name, key=key, data=data)

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()
            self._tar = None
        if self._file is not None:
            self._file.close()
            self._file = None


# The most a bundle's extended headers (pax, GNU long names) may hold: an entry's name is 73
# characters; tar reads such a header whole before any member is seen.
_MAX_EXTENDED_HEADER = 64 * 1024


class _BoundedTarInfo(tarfile.TarInfo):
    """A member's header whose extended headers are read only up to ``_MAX_EXTENDED_HEADER``:
    a few compressed bytes announcing gigabytes of pax header would otherwise be read into
    memory whole before any check of ours."""

    def _proc_pax(self, tarfile: Any) -> Any:
        self._bound()
        return super()._proc_pax(tarfile)  # type: ignore[misc]

    def _proc_gnulong(self, tarfile: Any) -> Any:
        self._bound()
        return super()._proc_gnulong(tarfile)  # type: ignore[misc]

    def _bound(self) -> None:
        if self.size > _MAX_EXTENDED_HEADER:
            raise tarfile.HeaderError(
                f"an extended header of {self.size} bytes (an acompile bundle's are under "
                f"{_MAX_EXTENDED_HEADER})"
            )


class _ArchiveDamaged(Exception):
    pass


def _unsafe(member: tarfile.TarInfo) -> str | None:
    """Why a member may not be imported, or None: only ``entries/<key>`` regular files are."""
    name = member.name
    if name.startswith(("/", "\\")) or ".." in name.replace("\\", "/").split("/"):
        return "refused: a path outside the bundle"
    if name == MANIFEST_NAME:
        return "refused: a second bundle description"
    if not name.startswith(ENTRY_PREFIX) or not is_key(name[len(ENTRY_PREFIX) :]):
        # A name with a newline or another control character is shown escaped.
        shown = "" if name.isprintable() else f", got {name!r}"
        return f"refused: not an entry (expected entries/<64 hex digits>{shown})"
    if not member.isreg():
        return "refused: not a regular file (links and devices are never imported)"
    if member.size > MAX_MEMBER_BYTES:
        return (
            f"refused: {human_bytes(member.size)}, over the {human_bytes(MAX_MEMBER_BYTES)} bound on an entry"
        )
    return None


async def import_bundle(
    root: Path,
    path: Path,
    *,
    signing_key: str | bytes | None = None,
    allow_unsigned: bool = False,
    unsafe_unsigned_host_code: bool = False,
) -> BundleReport:
    """Load a bundle into the cache folder ``root``, verifying its signature and every entry.

    With a signing key (the argument, else ``$ACOMPILE_SIGNING_KEY``: the shared tier's key), the
    bundle's signature must verify before anything is written: a bundle signed with another key,
    or whose signature does not verify, is refused whole; an unsigned one is refused unless
    ``allow_unsigned`` (then imported with a warning). Without a key there is nothing to verify
    against: the bundle is imported, and ``report.signature`` says it was not authenticated.

    Host code (libraries, object files, torch.compile's entries) goes in only where the
    signature verified: from a bundle that is not authenticated, those entries are ``rejected``
    (device code and data go in as above), unless ``unsafe_unsigned_host_code``, which trusts
    whoever made or altered the bundle to run code on this host (and implies
    ``allow_unsigned``).

    Good entries are written through the disk tier (atomic publish); an entry the folder already
    holds intact is left as it is (``present``, or ``kept`` where its bytes differ); a damaged one
    in the folder is replaced (``repaired``). Members that are not intact entries, whose names
    are not ``entries/<key>``, or (where the description lists digests) that are not listed
    with their SHA-256, are ``rejected`` with the reason.

    Raises ``AcompileError`` when ``path`` is absent, not an acompile bundle, or refused by the
    signature check (nothing is imported then); ``ValueError`` for a key under 16 bytes, or
    one that is set but empty. An archive damaged part-way sets ``error``; the entries before
    the damage are imported.
    """
    key = signing_key_from(signing_key)
    disk = DiskTier(root)
    report = BundleReport("import", Path(path))
    reader = _BundleReader(Path(path))
    await anyio.to_thread.run_sync(reader.open)
    try:
        report.signature = _check_signature(reader, key, allow_unsigned or unsafe_unsigned_host_code)
        reader.host_code = reader.signed or unsafe_unsigned_host_code
        if not reader.signed and unsafe_unsigned_host_code:
            logger.warning(
                "importing host code from %s, which is not authenticated (allowed): whoever made or "
                "altered it can run code on this host",
                path,
            )
        report.bundle_info = dict(reader.info)
        await anyio.to_thread.run_sync(disk.make_or_check)
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
        logger.warning(
            "importing %s without checking who made it: no signing key is configured (each "
            "entry's checksum is still verified; host code goes in only with $ACOMPILE_SIGNING_KEY "
            "set to the key that signed the bundle, or the unsafe opt-in: "
            "unsafe_unsigned_host_code=True, --unsafe-unsigned-host-code)",
            path,
        )
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
    report.keys.append(key)  # the folder holds it now (its own copy, or the bundle's)
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


__all__ = [
    "BUNDLE_FORMAT",
    "MANIFEST_NAME",
    "MAX_MEMBER_BYTES",
    "BundleReport",
    "export_bundle",
    "import_bundle",
]
