"""Object stores and shared folders as the shared tier's storage.

``SharedTier`` speaks to its storage through a handful of calls (the ones an aiocache cache
has: ``get``, ``set``, ``add``, ``delete``, ``close``). The two kinds here give those calls, and
three more that the tier uses where a storage has them:

- ``get_bounded(name, bound)``: the value, None where there is none, or its size where it is
  larger than ``bound`` (never read whole);
- ``set(name, value, _cas_token=old)``: write only where the value is still ``old``
  (compare-and-set: a lease renewed or taken over, a document changed);
- ``delete_if(name, value)``: delete only a value that is still ``value`` (a lease given back).

``expires_keys`` is False for both: neither forgets a lease by itself, so a dead holder's lease
is taken over (by a compare-and-set) rather than waited out. ``can_lease()`` says whether the
storage can hold one at all (a create that fails where the object exists, by a process that may
write).

**Object stores** (``s3://bucket/prefix``, ``gs://``, ``az://``) go through obstore (Rust's
object_store): async-native, one connection pool for many small reads at once, conditional
writes on each store (``If-None-Match: *`` and ``If-Match`` on S3, preconditions on GCS and
Azure). Endpoint, region and credentials are read the way the AWS SDKs read them (environment
variables, instance or container roles; ``?profile=`` names a profile of ``~/.aws``, read
through boto3), or from the URL's options for an S3-compatible server (``?endpoint=``,
``?region=``, ``?allow_http=true``). A store that ignores conditional writes (it accepts a
second create of the same object) is found at ``check()``: there is no single flight through
it, said once, and every replica compiles what it misses.

**Shared folders** (``file:///mnt/nfs/acompile``): a folder many hosts mount. A value is written
whole to a file of its own under ``.incoming/``, flushed to the server, then published in one
step: ``link()`` for a create (it fails where the name exists: atomic on NFS, where ``O_EXCL``
was not before v3 and ``flock`` is not shared across hosts) and ``rename()`` over the name for
a replacement (atomic on the server). A reader opens the name: it sees a whole value or none,
never part of one. Its calls run on threads (a hung mount must not stop the event loop); a
call the tier gives up on (its deadline) leaves its thread to finish alone.

Names come from the tier (``<namespace>:<key>``, ``lease:<namespace>:<key>``,
``<kind>:<namespace>``); each ``:`` is a ``/`` in the store. A name with anything but letters,
digits, ``_``, ``-`` and ``.`` in a part, or a part that starts with ``.``, is refused.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import logging
import os
import re
import secrets
import socket
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, unquote, urlparse

import anyio
import anyio.to_thread

T = TypeVar("T")
logger = logging.getLogger("acompile")

STORE_SCHEMES = ("s3", "gs", "az")
FOLDER_SCHEME = "file"
# What an object store's URL may say besides the shared tier's own options.
STORE_OPTIONS = frozenset({"endpoint", "region", "allow_http", "profile"})
_NAME_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_KEY = re.compile(r"[0-9a-f]{64}")
# What prune may remove: an entry (<namespace>:<key>) or a lease (lease:<namespace>:<key>), the
# namespace a signing key's id or "unsigned"; nothing else it finds under the folder or prefix.
_LAYOUT = re.compile(r"(lease:)?(k[0-9a-f]{16}|unsigned):[0-9a-f]{64}")
# A staged value older than this was left by a writer that died (prune removes it).
_STALE_STAGED_S = 3600.0
# The slowest transfer rate a value's deadline allows for, past its first byte (bytes a second).
_MIN_RATE = 16 << 20
# Where a folder's values are written before they are published.
INCOMING = ".incoming"


class StoreError(Exception):
    """A call to an object store or a shared folder that failed: one line, no credentials."""


def store_path(name: str) -> str:
    """The tier's name as a path in the store (``a:b:c`` is ``a/b/c``); ``ValueError`` for a
    name that could leave the tier's folder or prefix."""
    parts = name.split(":")
    if not all(_NAME_PART.fullmatch(p) for p in parts):
        raise ValueError(f"not a name of the shared tier: {name[:80]!r}")
    return "/".join(parts)


def _one_line(exc: BaseException) -> str:
    """An obstore error as one short line: its first line, without the debug dump that follows."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else type(exc).__name__
    return first if len(first) <= 300 else first[:300] + "…"


def _flag(value: str, what: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{what} in the shared cache URL must be true or false, got {value!r}")


def check_store_url(url: str, shown: str) -> None:
    """Refuse an object-store or folder URL that cannot work (``ValueError``), importing nothing."""
    parts = urlparse(url)
    query = parse_qs(parts.query, keep_blank_values=True)
    if parts.fragment or "#" in url:
        raise ValueError(f"shared cache URL {shown!r}: a '#' has no place in it (it would hide what follows)")
    path = unquote(parts.path)
    if any(part in (".", "..") for part in path.split("/")) or "//" in path.strip("/") or "\0" in path:
        raise ValueError(f"shared cache URL {shown!r}: the path must be plain, without '.', '..' or '//'")
    if parts.scheme == FOLDER_SCHEME:
        if parts.netloc not in ("", "localhost"):
            raise ValueError(
                f"shared cache URL {shown!r}: a folder URL names no host (file:///mnt/nfs/acompile)"
            )
        if not path.startswith("/") or os.path.normpath(path) in ("/", "//"):
            raise ValueError(
                f"shared cache URL {shown!r}: give the folder's absolute path (file:///mnt/nfs/acompile)"
            )
        if extra := sorted(set(query) & STORE_OPTIONS):
            raise ValueError(f"shared cache URL {shown!r}: {extra} are options of object stores, not folders")
        return
    if not parts.netloc:
        raise ValueError(f"shared cache URL {shown!r} names no bucket: write {parts.scheme}://bucket/prefix")
    if "@" in parts.netloc:
        raise ValueError(
            f"shared cache URL {shown!r}: credentials do not go in the URL: set them in the environment "
            "(AWS_ACCESS_KEY_ID, ...) or name a profile (?profile=)"
        )
    if parts.scheme != "s3" and (extra := sorted(set(query) & {"region", "profile"})):
        raise ValueError(f"shared cache URL {shown!r}: {extra} are options of s3:// URLs")
    if "allow_http" in query:
        _flag(query["allow_http"][0], "allow_http")
    if "region" in query and not re.fullmatch(r"[a-z0-9-]{1,40}", query["region"][0]):
        raise ValueError(f"shared cache URL {shown!r}: region must be a region's name, such as us-east-1")
    if "endpoint" in query:
        endpoint = urlparse(query["endpoint"][0])
        if "@" in endpoint.netloc:
            raise ValueError(
                f"shared cache URL {shown!r}: credentials do not go in the endpoint: set them in the "
                "environment (AWS_ACCESS_KEY_ID, ...) or name a profile (?profile=)"
            )
        if endpoint.scheme not in ("http", "https") or not endpoint.hostname:
            raise ValueError(
                f"shared cache URL {shown!r}: endpoint must be an http(s) URL, got {query['endpoint'][0]!r}"
            )
        if endpoint.scheme == "http" and not _flag(query.get("allow_http", ["false"])[0], "allow_http"):
            raise ValueError(
                f"shared cache URL {shown!r}: an http:// endpoint sends entries in clear: add "
                "&allow_http=true to say that is meant (a server on loopback, a test)"
            )


def _run_on_asyncio(what: str) -> None:
    import asyncio

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise ValueError(f"{what} needs the asyncio event loop (anyio's default backend), not trio") from None


class _Storage:
    """What both kinds share: the calls ``SharedTier`` makes, in terms of a few primitives."""

    expires_keys = False

    def __init__(self) -> None:
        self._known: dict[str, tuple[bytes, Any]] = {}
        self._read_only = False

    kind = ""
    where = ""

    def _refused_write(self, why: object) -> bool:
        """A write this process may not make (a read-only mount, a folder of another user's,
        read-only credentials): an answer, not an outage. The replica reads the fleet's entries
        and publishes none; said once."""
        if not self._read_only:
            self._read_only = True
            logger.warning(
                "shared cache %s refuses this process's writes (%s): it reads the fleet's "
                "entries, publishes none, and holds no leases",
                self.where,
                why,
            )
        return False

    async def can_lease(self) -> bool:
        """Whether a lease can be held here (a create fails where the object exists, and this
        process may write): True for a folder; an object store finds out at its first lease."""
        return True

    async def _read(self, path: str, bound: int) -> tuple[bytes | int | None, Any]:
        """(value, version): the value (None: absent; its size where over ``bound``) and what a
        compare-and-set needs to write over exactly this value."""
        raise NotImplementedError

    async def _write(self, path: str, value: bytes, *, mode: str, version: Any = None) -> bool:
        """Write ``value``: ``mode`` "put" (replace), "create" (False where it exists) or
        "update" (False where it is no longer ``version``)."""
        raise NotImplementedError

    async def _remove(self, path: str) -> None:
        raise NotImplementedError

    async def check(self) -> None:
        """Raise ``ValueError`` where the storage cannot work (no such bucket or folder, refused
        credentials); anything else (a server away) is left to the tier's outage handling."""
        raise NotImplementedError

    def names(self, prefix: str) -> Any:
        """An async iterator of (name, size, modified) for the values under ``prefix``."""
        raise NotImplementedError

    async def get_bounded(self, name: str, bound: int) -> bytes | int | None:
        value, _ = await self._read(store_path(name), bound)
        return value

    async def get(self, name: str) -> bytes | None:
        value, _ = await self._read(store_path(name), 1 << 62)
        return value if isinstance(value, bytes) else None

    # Small values this process last wrote or read (a lease, a document), by path, with their
    # versions: a compare-and-set over one of them writes at once, without reading it again.
    _KNOWN_MAX = 4096

    def _remember(self, path: str, value: bytes | None, version: Any) -> None:
        known = self._known
        known.pop(path, None)
        if value is not None and version is not None and len(value) <= self._KNOWN_MAX:
            known[path] = (value, version)
            while len(known) > self._KNOWN_MAX:
                del known[next(iter(known))]

    async def set(self, name: str, value: bytes, ttl: Any = None, _cas_token: bytes | None = None) -> bool:
        path = store_path(name)
        if _cas_token is None:
            return await self._write(path, value, mode="put")
        known = self._known.get(path)
        if known is not None and known[0] == _cas_token:
            # The value this process wrote last: one conditional write (it fails, and nothing
            # is written, where the object changed since).
            if await self._write(path, value, mode="update", version=known[1]):
                return True
        held, version = await self._read(path, len(_cas_token))
        if held != _cas_token:
            return False
        return await self._write(path, value, mode="update", version=version)

    async def add(self, name: str, value: bytes, ttl: Any = None) -> bool:
        return await self._write(store_path(name), value, mode="create")

    async def delete(self, name: str) -> int:
        await self._remove(store_path(name))
        return 1

    async def delete_if(self, name: str, value: bytes) -> bool:
        """Delete ``name`` where it holds ``value``; True where it did. Read, then deleted: a
        value written in between (a lease another replica took over in that moment) can go too."""
        path = store_path(name)
        held, _ = await self._read(path, len(value))
        if held != value:
            return False
        await self._remove(path)
        return True

    async def close(self) -> None:
        return None


# obstore answers each call from a thread of its Rust runtime, which takes the interpreter's lock
# once more after the answer is delivered. A short-lived process (a CLI command) that exits at
# that moment is aborted by the runtime as the interpreter finalizes (seen: 1 exit in 6 after a
# single listing). Once an object store is made, the exit first lets those threads finish:
# an atexit hook runs while the interpreter is whole, and its sleep releases the lock.
_SETTLE_AT_EXIT = 0.05
_settling = False


def _settle_at_exit() -> None:
    global _settling
    if not _settling:
        import atexit
        import time

        atexit.register(time.sleep, _SETTLE_AT_EXIT)
        _settling = True


class ObjectStore(_Storage):
    """An S3, GCS or Azure Blob bucket (or an S3-compatible server) through obstore."""

    def __init__(self, url: str, *, max_connections: int) -> None:
        super().__init__()
        _settle_at_exit()
        parts = urlparse(url)
        self.kind = parts.scheme
        self.bucket = parts.netloc
        self.prefix = parts.path.strip("/")
        self.where = f"{parts.scheme}://{parts.netloc}/{self.prefix}".rstrip("/")
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        self._store = self._make(url, query, max_connections)
        self._leases: bool | None = None  # found at the first lease
        self._pid = os.getpid()
        # The first byte's deadline (the tier's ?timeout=, set as it opens); the rest of a
        # transfer is given time at _MIN_RATE, so that a large value is not a timeout.
        self.first_byte = 2.0

    def _make(self, url: str, query: dict[str, str], max_connections: int) -> Any:
        try:
            import obstore.store
        except ImportError as exc:
            raise ValueError(
                f'the shared cache {self.where!r} needs its client ({exc}): pip install "acompile[store]"'
            ) from exc
        base = f"{self.kind}://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")
        client: dict[str, Any] = {
            "connect_timeout": datetime.timedelta(seconds=2),
            # One value's transfer; the tier's own deadline per call is shorter where it matters.
            "timeout": datetime.timedelta(seconds=120),
            "pool_max_idle_per_host": str(max_connections),
        }
        retry = {
            "max_retries": 2,
            "retry_timeout": datetime.timedelta(seconds=3),
            "backoff": {
                "init_backoff": datetime.timedelta(milliseconds=50),
                "max_backoff": datetime.timedelta(milliseconds=500),
                "base": 2.0,
            },
        }
        config: dict[str, Any] = {}
        credentials = None
        endpoint = query.get("endpoint") or _env_endpoint(self.kind)
        allowed = _flag(query.get("allow_http", os.environ.get("AWS_ALLOW_HTTP", "false")), "allow_http")
        if endpoint and urlparse(endpoint).scheme == "http" and not allowed:
            raise ValueError(
                f"the shared cache {self.where!r}: its endpoint {endpoint!r} (from "
                f"{'the URL' if 'endpoint' in query else 'the environment'}) is http://, which sends entries "
                "in clear: add &allow_http=true to the URL (or set AWS_ALLOW_HTTP=true) to say that is meant"
            )
        if allowed:
            client["allow_http"] = True
        if self.kind == "s3":
            # Compare-and-set through If-Match on the object's ETag (creates use If-None-Match).
            config["conditional_put"] = "etag"
            if "endpoint" in query:
                config["endpoint"] = query["endpoint"]
            if "region" in query:
                config["region"] = query["region"]
            if "profile" in query:
                try:
                    import boto3
                    from obstore.auth.boto3 import Boto3CredentialProvider
                except ImportError as exc:
                    raise ValueError(
                        f"the shared cache {self.where!r} names a profile, read through boto3 ({exc}): "
                        "pip install boto3, or set the credentials in the environment"
                    ) from exc
                try:
                    credentials = Boto3CredentialProvider(boto3.Session(profile_name=query["profile"]))
                except Exception as exc:  # botocore's ProfileNotFound, a malformed ~/.aws/config
                    raise ValueError(
                        f"the shared cache {self.where!r}: profile {query['profile']!r}: "
                        f"{type(exc).__name__}: {_one_line(exc)}"
                    ) from None
        elif "endpoint" in query:  # a GCS or Azure emulator, a private endpoint
            config["base_url" if self.kind == "gs" else "endpoint"] = query["endpoint"]
        try:
            make: Any = obstore.store.from_url  # (its overloads type each store's options apart)
            return make(
                base,
                config=config or None,
                client_options=client,
                retry_config=retry,
                credential_provider=credentials,
            )
        except Exception as exc:  # a malformed endpoint, an unknown region: said at the pool's entry
            raise ValueError(f"the shared cache {self.where!r} cannot be opened: {_one_line(exc)}") from None

    async def _call(self, what: str, path: str, run: Callable[[], Any], seconds: float) -> Any:
        """``run()`` within ``seconds``; obstore's errors as one-line ``StoreError``s, but for an
        absent object (``FileNotFoundError``) and one this process may not read (``_Refused``)."""
        from obstore.exceptions import PermissionDeniedError

        if os.getpid() != self._pid:
            # obstore's runtime does not survive fork(): every call of a child would hang.
            raise StoreError(
                f"{self.where} was opened before this process was forked (obstore's runtime does not "
                "survive fork()): open the pool in the child"
            )
        try:
            with anyio.fail_after(seconds):
                return await run()
        except FileNotFoundError:
            raise
        except PermissionDeniedError as exc:
            # One object this process may not read (archived to a cold storage class, a key it
            # may not decrypt): that value is refused; the tier stays on.
            raise _Refused(_one_line(exc)) from None
        except TimeoutError:
            raise StoreError(f"{what} {path}: no answer within {seconds:.1f} s") from None
        except Exception as exc:
            # obstore's errors carry the request and a debug dump; the tier logs one line.
            raise StoreError(f"{what} {path}: {type(exc).__name__}: {_one_line(exc)}") from None

    def _seconds(self, size: int) -> float:
        """A deadline for moving ``size`` bytes: the first byte's, and the rest at _MIN_RATE."""
        return self.first_byte + size / _MIN_RATE

    async def _read(self, path: str, bound: int) -> tuple[bytes | int | None, Any]:
        import obstore

        # At most bound + 1 bytes cross the network: the object's size says the rest.
        options: Any = {"range": (0, bound + 1)}
        try:
            try:
                result = await self._call(
                    "GET",
                    path,
                    lambda: obstore.get_async(self._store, path, options=options),
                    self.first_byte,
                )
            except StoreError as exc:
                if "416" not in str(exc):
                    raise
                # An empty object: no byte range of it can be satisfied. Read it plainly.
                result = await self._call(
                    "GET", path, lambda: obstore.get_async(self._store, path), self.first_byte
                )
        except FileNotFoundError:
            return None, None
        except _Refused:
            return -1, None
        size = int(result.meta["size"])
        version = {"e_tag": result.meta["e_tag"], "version": result.meta.get("version")}
        if size > bound:
            return size, version
        data = await self._call("GET", path, result.bytes_async, self._seconds(size))
        return bytes(data), version

    async def can_lease(self) -> bool:
        if self._leases is None:
            probe = f"probe/{secrets.token_hex(8)}"
            able = await self._write(probe, b"", mode="create")
            if able:
                # A second create of the same object must fail: a store that takes it ignores
                # conditional writes, and a lease there would hold nobody.
                able = not await self._write(probe, b"", mode="create")
                await self._remove(probe)
                if not able:
                    logger.warning(
                        "shared cache %s takes a second create of the same object (it ignores "
                        "conditional writes): no single flight through it; each replica compiles "
                        "what it misses",
                        self.where,
                    )
            self._leases = able
        return self._leases

    async def _write(self, path: str, value: bytes, *, mode: str, version: Any = None) -> bool:
        import obstore
        from obstore.exceptions import (
            AlreadyExistsError,
            PermissionDeniedError,
            PreconditionError,
            UnauthenticatedError,
        )

        how: Any = "overwrite"
        if mode == "create":
            how = "create"
        elif mode == "update":
            how = {k: v for k, v in version.items() if v is not None}
        if os.getpid() != self._pid:
            raise StoreError(
                f"{self.where} was opened before this process was forked: open the pool in the child"
            )
        try:
            with anyio.fail_after(self._seconds(len(value))):
                result = await obstore.put_async(self._store, path, value, mode=how)
        except TimeoutError:
            raise StoreError(f"PUT {path}: no answer within {self._seconds(len(value)):.1f} s") from None
        except (AlreadyExistsError, PreconditionError):
            self._remember(path, None, None)
            return False
        except (PermissionDeniedError, UnauthenticatedError) as exc:
            return self._refused_write(_one_line(exc))  # read-only credentials
        except Exception as exc:
            if mode != "put" and "409" in str(exc):  # S3: another conditional write of it at once
                return False
            raise StoreError(f"PUT {path}: {type(exc).__name__}: {_one_line(exc)}") from None
        tag = result.get("e_tag")
        self._remember(path, value, {"e_tag": tag, "version": result.get("version")} if tag else None)
        return True

    async def _remove(self, path: str) -> None:
        import obstore

        try:
            await self._call("DELETE", path, lambda: obstore.delete_async(self._store, path), self.first_byte)
        except (FileNotFoundError, _Refused):
            pass

    async def check(self) -> None:
        import obstore
        from obstore.exceptions import PermissionDeniedError, UnauthenticatedError

        _run_on_asyncio(f"the shared cache {self.where!r}")
        try:
            with anyio.fail_after(10):
                # A listing: the bucket is there and this process may read it. Writing is not
                # asked for: a replica may read a fleet's tier with credentials that cannot write.
                await obstore.list_with_delimiter_async(self._store, prefix="probe/none")
        except FileNotFoundError:
            raise ValueError(f"the shared cache {self.where!r}: the bucket does not exist") from None
        except (PermissionDeniedError, UnauthenticatedError) as exc:
            raise ValueError(
                f"the shared cache {self.where!r}: the store refused this process's credentials "
                f"({type(exc).__name__}: {_one_line(exc)})"
            ) from None
        except Exception as exc:
            text = str(exc)
            if "169.254.169.254" in text or "credential" in text.lower():
                raise ValueError(
                    f"the shared cache {self.where!r}: found no credentials for the store (set them in "
                    "the environment, e.g. AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, name a profile "
                    "with ?profile=, or run where an instance or container role gives them)"
                ) from None
            if "NoSuchBucket" in text or "404" in text:
                raise ValueError(f"the shared cache {self.where!r}: the bucket does not exist") from None
            if any(code in text for code in ("403 ", "401 ", "AccessDenied", "InvalidAccessKeyId")):
                raise ValueError(
                    f"the shared cache {self.where!r}: the store refused this process's credentials "
                    f"({_one_line(exc)})"
                ) from None
            raise StoreError(f"{self.where}: {type(exc).__name__}: {_one_line(exc)}") from None

    async def names(self, prefix: str) -> Any:
        import obstore

        stream = obstore.list(
            self._store, prefix=store_path(prefix) + "/" if prefix else None, chunk_size=1000
        )
        try:
            while True:
                try:
                    with anyio.fail_after(30):
                        chunk = await stream.__anext__()
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise StoreError(f"LIST {self.where}: no answer within 30 s") from None
                except Exception as exc:
                    raise StoreError(f"LIST {self.where}: {type(exc).__name__}: {_one_line(exc)}") from None
                for item in chunk:
                    yield item["path"].replace("/", ":"), int(item["size"]), item["last_modified"].timestamp()
        finally:
            del stream


class _Refused(Exception):
    """Something other than a folder or a file where the tier's layout has one (a link, a FIFO,
    a device): not followed, not opened for reading; a value there is refused, not an outage."""


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Errors about one path (what another user placed there, its mode), not about the folder's
# server: that value is refused (a read), not published (a write), or left (a removal); the
# tier stays on. Any other error (EIO, ESTALE, a timeout) is the mount's: an outage.
_ONE_PATH = frozenset(
    {errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR, errno.ENOTEMPTY, errno.EEXIST,
     errno.ELOOP, errno.ENXIO, errno.ENAMETOOLONG, errno.ENOSPC, errno.EDQUOT, errno.EROFS}
)  # fmt: skip


class SharedFolder(_Storage):
    """A folder many hosts mount (NFS, a shared volume), published into atomically.

    Every path under the folder is walked one component at a time from a descriptor of the
    folder (``O_NOFOLLOW``), so a link planted where a folder or a value goes is never followed:
    nothing is read from, or written to, anywhere else. Values are opened ``O_NONBLOCK`` and
    checked to be regular files (a FIFO would block its reader for ever)."""

    kind = FOLDER_SCHEME

    def __init__(self, url: str, *, max_connections: int) -> None:
        super().__init__()
        self.root = Path(unquote(urlparse(url).path))
        self.where = f"file://{self.root}"
        self._threads = anyio.CapacityLimiter(max_connections)
        self._said: set[str] = set()
        self._host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:40] or "host"

    async def _thread(self, call: Callable[..., T], *args: Any) -> T:
        # A hung mount: the tier's deadline abandons the thread, which ends when the mount does.
        return await anyio.to_thread.run_sync(call, *args, limiter=self._threads, abandon_on_cancel=True)

    def _folder(self, parts: list[str], *, create: bool) -> int:
        """A descriptor of the folder ``parts`` under the root (made where ``create``), every
        component opened without following a link; ``FileNotFoundError`` where it is not there."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for part in parts:
                try:
                    inner = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                    inner = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise _Refused(f"{part} is not a folder (a link or a file): not followed") from None
                    if exc.errno in _ONE_PATH:
                        raise _Refused(f"{part}: {exc.strerror}") from None
                    raise
                os.close(fd)
                fd = inner
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _read_now(self, path: str, bound: int) -> tuple[bytes | int | None, Any]:
        *parts, leaf = path.split("/")
        try:
            folder = self._folder(parts, create=False)
        except FileNotFoundError:
            return None, None
        except _Refused:
            return -1, None
        except OSError as exc:
            raise StoreError(f"read {path}: {exc.strerror or exc}") from None
        try:
            fd = os.open(leaf, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
        except FileNotFoundError:
            return None, None
        except OSError as exc:
            if exc.errno in _ONE_PATH:
                return -1, None  # a link, a FIFO or socket, a folder, a file it may not read
            raise StoreError(f"read {path}: {exc.strerror}") from None
        finally:
            os.close(folder)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                return -1, None
            if info.st_size > bound:
                return info.st_size, None
            chunks = []
            left = bound + 1
            while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
                chunks.append(chunk)
                left -= len(chunk)
            data = b"".join(chunks)
            if len(data) > bound:
                return len(data), None
            return data, (info.st_ino, info.st_mtime_ns, info.st_size)
        except OSError as exc:
            raise StoreError(f"read {path}: {exc.strerror or exc}") from None
        finally:
            os.close(fd)

    def _stage(self, incoming: int, value: bytes) -> str:
        """``value`` in a file of its own in ``.incoming/`` (``incoming``: its descriptor),
        flushed to the server; its name."""
        name = f"{self._host}.{os.getpid()}.{secrets.token_hex(8)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(name, flags, 0o644, dir_fd=incoming)
        try:
            view = memoryview(value)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=incoming)
            raise
        os.close(fd)
        return name

    def _write_now(self, path: str, value: bytes, mode: str, version: Any) -> bool:
        *parts, leaf = path.split("/")
        try:
            incoming = self._folder([INCOMING], create=True)
        except _Refused as exc:
            return self._not_published(path, f"{INCOMING}: {exc}")
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                return self._refused_write(exc.strerror or exc)
            raise StoreError(f"write {path}: {exc.strerror or exc}") from None
        try:
            try:
                folder = self._folder(parts, create=True)
            except _Refused as exc:
                return self._not_published(path, str(exc))
            try:
                staged = self._stage(incoming, value)
                try:
                    return self._publish(folder, incoming, staged, leaf, path, mode, version)
                finally:
                    with contextlib.suppress(OSError):
                        os.unlink(staged, dir_fd=incoming)
            finally:
                os.close(folder)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                return self._refused_write(exc.strerror or exc)
            if exc.errno in _ONE_PATH:
                return self._not_published(path, exc.strerror or str(exc))
            raise StoreError(f"publish {path}: {exc.strerror or exc}") from None
        finally:
            os.close(incoming)

    def _not_published(self, path: str, why: str) -> bool:
        """A value that cannot go where the layout puts it (something of another user's there, a
        full disk): not published, said once per kind of reason; the tier stays on."""
        topic = why.split(":")[-1].strip()
        level = logging.DEBUG if topic in self._said else logging.WARNING
        self._said.add(topic)
        logger.log(level, "shared folder %s: %s not published: %s", self.where, path[:48], why)
        return False

    def _publish(
        self, folder: int, incoming: int, staged: str, leaf: str, path: str, mode: str, version: Any
    ) -> bool:
        if mode == "create":
            try:
                os.link(staged, leaf, src_dir_fd=incoming, dst_dir_fd=folder, follow_symlinks=False)
            except FileExistsError:
                # NFS answers a retried link that had succeeded with EEXIST: the staged file's
                # two names say whether this one made it.
                return os.stat(staged, dir_fd=incoming, follow_symlinks=False).st_nlink == 2
            return True
        if mode == "update":
            # Compare, then replace: a value written in between (a lease another replica took
            # over in that moment) is replaced; the loser's next renewal finds so.
            if self._read_now(path, 1 << 62)[1] != version or version is None:
                return False
        # Over whatever is there (a link, a FIFO: replaced, never opened).
        os.rename(staged, leaf, src_dir_fd=incoming, dst_dir_fd=folder)
        return True

    def _remove_now(self, path: str) -> None:
        *parts, leaf = path.split("/")
        try:
            folder = self._folder(parts, create=False)
        except (FileNotFoundError, _Refused):
            return
        except OSError as exc:
            raise StoreError(f"remove {path}: {exc.strerror or exc}") from None
        try:
            os.unlink(leaf, dir_fd=folder)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno not in _ONE_PATH:
                raise StoreError(f"remove {path}: {exc.strerror or exc}") from None
            logger.debug("shared folder %s: %s not removed: %s", self.where, path[:48], exc.strerror)
        finally:
            os.close(folder)

    async def _read(self, path: str, bound: int) -> tuple[bytes | int | None, Any]:
        return await self._thread(self._read_now, path, bound)

    async def _write(self, path: str, value: bytes, *, mode: str, version: Any = None) -> bool:
        return await self._thread(self._write_now, path, value, mode, version)

    async def _remove(self, path: str) -> None:
        await self._thread(self._remove_now, path)

    def _check_now(self) -> None:
        try:
            info = os.stat(self.root)
        except FileNotFoundError:
            raise ValueError(
                f"the shared cache {self.where!r}: the folder does not exist (is the share mounted?)"
            ) from None
        if not stat.S_ISDIR(info.st_mode):
            raise ValueError(f"the shared cache {self.where!r} is not a folder")
        if not os.access(self.root, os.R_OK | os.X_OK):
            raise ValueError(f"the shared cache {self.where!r}: this user cannot read the folder")

    async def check(self) -> None:
        with anyio.fail_after(10):
            await self._thread(self._check_now)

    def _list_now(self, prefix: str) -> list[tuple[str, int, float]]:
        found = []
        for item in _walk(self.root / store_path(prefix) if prefix else self.root):
            relative = Path(item.path).relative_to(self.root)
            if relative.parts[0] == INCOMING:
                continue
            info = item.stat(follow_symlinks=False)
            if stat.S_ISREG(info.st_mode):
                found.append((relative.as_posix().replace("/", ":"), info.st_size, info.st_mtime))
        return found

    async def names(self, prefix: str) -> Any:
        for found in await self._thread(self._list_now, prefix):
            yield found

    def _remove_staged_now(self, before: float, dry_run: bool) -> int:
        removed = 0
        try:
            incoming = self._folder([INCOMING], create=False)
        except (FileNotFoundError, _Refused):
            return 0
        try:
            for name in os.listdir(incoming):
                try:
                    info = os.stat(name, dir_fd=incoming, follow_symlinks=False)
                    if info.st_mtime < before:
                        if not dry_run:
                            os.unlink(name, dir_fd=incoming)
                        removed += 1
                except OSError:
                    continue
        finally:
            os.close(incoming)
        return removed

    async def remove_staged(self, before: float, *, dry_run: bool = False) -> int:
        """Remove the values staged under ``.incoming/`` before ``before`` (their writers died)."""
        return await self._thread(self._remove_staged_now, before, dry_run)


def _walk(folder: Path) -> Iterator[os.DirEntry[str]]:
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            yield from _walk(Path(entry.path))
        else:
            yield entry


# A lease object not rewritten for this long is a dead holder's (a live one rewrites it every
# ten seconds on a store or a folder, whose leases last 30 s): ``prune_storage`` removes it
# whatever the age asked for.
STALE_LEASE_S = 60.0


async def prune_storage(url: str, max_age_s: float, *, dry_run: bool = False) -> dict[str, Any]:
    """Remove the entries of an object store or shared folder written more than ``max_age_s``
    ago (every namespace's), and leases left by dead holders. Returns what it did: ``removed``,
    ``removed_bytes``, ``kept``, ``leases_removed``, ``errors``. An object store can do the
    same by itself with a lifecycle rule on the prefix (docs/caching.md)."""
    import time

    storage = open_storage(url, max_connections=16)
    await storage.check()
    now = time.time()
    report: dict[str, Any] = {"removed": 0, "removed_bytes": 0, "kept": 0, "leases_removed": 0, "errors": []}
    async for name, size, modified in storage.names(""):
        lease = name.startswith("lease:")
        if not _LAYOUT.fullmatch(name):
            continue  # not an entry nor a lease of the tier's: its documents, probes, anything else
        if not (now - modified > (STALE_LEASE_S if lease else max_age_s)):
            report["kept"] += not lease
            continue
        if not dry_run:
            try:
                with anyio.fail_after(30):
                    await storage.delete(name)
            except (StoreError, ValueError, TimeoutError) as exc:
                report["errors"].append(str(exc) or f"{name}: no answer within 30 s")
                continue
        if lease:
            report["leases_removed"] += 1
        else:
            report["removed"] += 1
            report["removed_bytes"] += size
    if isinstance(storage, SharedFolder):
        report["staged_removed"] = await storage.remove_staged(now - _STALE_STAGED_S, dry_run=dry_run)
    await storage.close()
    return report


def _env_endpoint(kind: str) -> str | None:
    """The endpoint the environment gives an object store, as its SDK reads it."""
    names = {
        "s3": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"),
        "gs": ("GOOGLE_BASE_URL",),
        "az": ("AZURE_STORAGE_ENDPOINT", "AZURE_ENDPOINT"),
    }.get(kind, ())
    return next((os.environ[n] for n in names if os.environ.get(n)), None)


def open_storage(url: str, *, max_connections: int) -> _Storage:
    """The storage of an object-store or folder URL (``ValueError`` where it cannot be made)."""
    scheme = urlparse(url).scheme
    if scheme == FOLDER_SCHEME:
        return SharedFolder(url, max_connections=max_connections)
    return ObjectStore(url, max_connections=max_connections)
