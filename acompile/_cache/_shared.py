"""The shared tier: an aiocache cache (Redis, Memcached) that a fleet of processes shares.

**Namespaces.** Entries live under ``<namespace>:<cache key>``, where the namespace is the signing
key's id (``k`` and 16 hex digits of a hash of the key; ``unsigned`` without a key). Replicas
with different keys (a misconfigured one, say) each keep their own entries: one can neither
overwrite nor delete another's, and nothing is recompiled because of it.

**Signing keys.** The key is the ``signing_key`` argument, else ``$ACOMPILE_SIGNING_KEY``. A key
that is set is a key: an empty one, or one of whitespace only (a secret that failed to mount),
is an error that says where it came from, never "no key" (which would turn signing off).

**Signatures.** With a signing key, a value is ``b"ACSIG2" + HMAC-SHA256(key, name + entry) +
entry`` (``name``: the namespaced key, so a value cannot be moved to another key), and a value
whose signature does not verify is refused (and counted): only holders of the key can publish
what others will load. Nothing read from the tier is ever unpickled.

**Host code.** Without a key anyone who can write to the tier decides what it serves. Device code
(cubins, PTX) and data keep that rule, but an entry that holds code this host runs (a C++ or
nvcc shared library, an object file: ``native_host_code``) is refused from an unsigned tier unless
its owner trusts it (``SharedCache(url, unsafe_trust_unsigned=True)``: this tier's
``unsafe_unsigned_host_code``). torch.compile's entries are gated where they are served
(``acompile.inductor.serve`` refuses a tier that is neither signed nor trusted).

**Bounded values.** A value larger than ``max_value`` (``?max_value=64MiB`` in the URL; 32 MiB
by default, 1 MiB less 1 KiB on Memcached, whose items are at most 1 MiB unless its server says
otherwise) is refused as a miss, counted with the refused values and logged; on Redis it is
refused unread (one script answers with its size). A value the server itself refuses as too
large (a Memcached started with a smaller ``-I``) is a publication that did not happen, said
once: not an outage. Verifying a signature and reading a header
run on a worker thread for values of 256 KiB and more, never on the event loop.

**Faults are misses.** The tier never fails a compile. At most ``max_in_flight`` operations run
at once (the client's connection pool size: a burst queues instead of exhausting the pool), and
a read or a lease waits at most ``queue_wait`` for its turn (a publication waits as long as its
starter lets it: skipped, it would be lost to the fleet). Every operation has a short deadline; an
error or a timeout counts as a miss and, the first time, declares an outage: one warning, and
the tier is skipped for a back-off (0.25 s, doubling to 30 s each time a probe fails). Back-off is
per outage, not per failed operation: operations that were already under way when it began
fail without extending it. Past the back-off one operation probes the server (the others still
skip); any success turns the tier back on at once.

**Fleet-wide single flight** uses leases: ``SET lease:<namespace>:<key> <lease> NX PX <ttl>``.
A lease says that its holder is alive and compiling: it holds the holder's id, a renewal number
and an expiry (wall clock), signed like entries, and lasts seconds (``MAX_LEASE_TTL`` at most).
The replica that takes it compiles and publishes, renewing it every third of its life until then
(each renewal writes a new value: a compare-and-set on the value it last wrote); the others poll
for the entry. A reader honours a lease only while it verifies, has not expired, claims no more
than ``MAX_LEASE_TTL`` (give or take the hosts' clocks) and keeps changing: a value seen unchanged
for ``MAX_LEASE_TTL`` is a dead holder's, a planted one or a copy replayed after its release. So
a planted or replayed lease (no TTL, garbage, another key's, a stale genuine one) costs a replica
seconds at most, and a holder that dies, stalls or loses the tier stops holding anyone within
seconds. A replica gives back its leases as it publishes, and again, bounded, as it closes (after
an outage that made the first try fail); those it cannot give back expire within seconds.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import logging
import math
import os
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs, urlparse

import anyio
import anyio.to_thread

from acompile._cache._entry import CorruptEntry, peek_header
from acompile._cache._layout import human_bytes
from acompile._cache._stores import FOLDER_SCHEME, STORE_OPTIONS, STORE_SCHEMES, StoreError, check_store_url
from acompile._cache._tier import MAX_LEASE_TTL
from acompile._sizing import parse_size

logger = logging.getLogger("acompile")

SIGNING_KEY_ENV = "ACOMPILE_SIGNING_KEY"
_SIGNED = b"ACSIG2"
# Format 3: holder, renewal number, expiry. Leases of format 2 (holder, expiry: a replica of an
# older acompile) are not honoured: during an upgrade, both may compile the same kernel.
_LEASE = b"ACLEASE3"
_DIGEST = 32
_BACKOFF_FIRST = 0.25
_BACKOFF_MAX = 30.0
# A lease claiming to expire later than now plus its longest life and this is not honoured: room
# for the clocks of two hosts to differ. (A lease honoured wrongly, a planted one, is still
# bounded: its value must keep changing.)
_CLOCK_SKEW = 30.0
# Lease values seen, to tell a live holder (its lease keeps changing) from a dead or replayed one.
_MAX_SIGHTINGS = 4096
# A lease value is some 100 bytes: anything larger is not one, and is not read.
_MAX_LEASE_VALUE = 1024
# How many times a document is read and changed again when another writer changed it meanwhile.
_SWAP_TRIES = 8
# How long close() spends giving back the leases that are still this replica's.
_RELEASE_AT_CLOSE = 1.0
# Values at least this large are verified (and their header read) on a worker thread: an HMAC
# runs at about 1 GB/s, so this is some 0.25 ms of the event loop.
_VERIFY_INLINE_MAX = 256 * 1024
# The largest value read from or written to the tier, unless the URL says (?max_value=64MiB).
DEFAULT_MAX_VALUE = 32 << 20
# ... on Memcached, whose items are at most 1 MiB unless the server is started with another -I
# (the key and the item's header count against that too): larger values are not sent.
MEMCACHED_MAX_VALUE = (1 << 20) - 1024

# Operations at once where the client does not say (Redis URLs default to this many connections).
DEFAULT_MAX_IN_FLIGHT = 16
# ... on an object store or a shared folder: many small reads at once is what they are good at.
STORE_MAX_IN_FLIGHT = 64
# An object store or a folder holds large artifacts (Inductor's Mega-Cache blobs, JIT modules).
STORE_MAX_VALUE = 256 << 20
# Each operation's deadline, by kind of tier (?timeout= in the URL says otherwise): a memory cache
# answers within milliseconds; an object store's first byte can take a hundred, and a value of
# megabytes more.
DEFAULT_TIMEOUT = 0.5
STORE_TIMEOUT = 2.0
UNSIGNED_NAMESPACE = "unsigned"

# One round trip: the value, unless it is larger than ARGV[1] (then its size, and the value is
# never sent) or not a string (-1); nil where there is none.
_BOUNDED_GET = """
local kind = redis.call('TYPE', KEYS[1]).ok
if kind == 'none' then return false end
if kind ~= 'string' then return -1 end
local size = redis.call('STRLEN', KEYS[1])
if size > tonumber(ARGV[1]) then return size end
return redis.call('GET', KEYS[1])
"""
# Replace a document (ARGV[3]) only while it is what the writer read: ARGV[1] says how it was
# read: "none" (there was none), "sha1" (a value whose SHA-1 is ARGV[2]) or "over" (a value that
# was not read: larger than ARGV[2] bytes, or not a string). 1: written; 0: it changed since.
_SWAP = """
local kind = redis.call('TYPE', KEYS[1]).ok
if ARGV[1] == 'none' then
  if kind ~= 'none' then return 0 end
elseif ARGV[1] == 'over' then
  if kind == 'string' and redis.call('STRLEN', KEYS[1]) <= tonumber(ARGV[2]) then return 0 end
elseif kind ~= 'string' or redis.sha1hex(redis.call('GET', KEYS[1])) ~= ARGV[2] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[3])
return 1
"""
# Delete the key only while it holds ARGV[1]: a lease this replica holds, not one taken over since.
_DELETE_IF = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def signing_key_from(value: str | bytes | None) -> bytes | None:
    """The signing key: the argument, else ``$ACOMPILE_SIGNING_KEY``; None where neither is set.

    A key that is set is a key: an empty one, or one of whitespace only (a secret that failed to
    mount, a template variable left blank), raises ``ValueError`` saying where it came from,
    rather than turning signing off (which would trust whatever the tier or a bundle holds).
    Raises ``ValueError`` for a key under 16 bytes too."""
    where = "signing_key"
    if value is None:
        value = os.environ.get(SIGNING_KEY_ENV)
        if value is None:
            return None
        where = f"${SIGNING_KEY_ENV}"
    key = value.encode() if isinstance(value, str) else bytes(value)
    if not key.strip():
        problem = "empty" if not key else "holds only whitespace"
        raise ValueError(
            f"{where} is set but {problem}: give it the fleet's signing key (at least 16 bytes), "
            "or unset it to sign nothing"
        )
    if len(key) < 16:
        raise ValueError(f"{where}: a signing key must be at least 16 bytes")
    return key


# Blobs that hold code this host runs, by name: what the C++ and nvcc loaders take from an entry
# (the blob named for the request's output), whatever backend the entry's header names.
_HOST_BLOBS = {"so": "a shared library", "o": "an object file"}
TORCH_BACKEND = "torch"
# Modules built for another JIT library (FlashInfer, torch's C++ extensions): always host code.
JIT_BACKEND = "jit"


def native_host_code(header: dict[str, Any]) -> str | None:
    """What code for this host (not the GPU) an entry holds, from its header (``peek_header``):
    ``"a shared library"`` (C++, nvcc's ``.so``) or ``"an object file"``; None for device code
    (cubins, PTX) and data.

    The blobs' names decide, not the backend the header names: a loader takes the blob named
    for its request's output from whatever entry the key finds, so a forged entry cannot hide
    a library by calling itself a Triton kernel."""
    blobs = header.get("blobs")
    names = {b[0] for b in blobs if isinstance(b, list) and b} if isinstance(blobs, list) else set()
    for name, what in _HOST_BLOBS.items():
        if name in names:
            return what
    if header.get("backend") == JIT_BACKEND:
        return "a JIT library's module"
    return "a shared library" if header.get("backend") == "cpp" else None


def host_code(header: dict[str, Any]) -> str | None:
    """``native_host_code``, and torch.compile's entries (a graph's Python, its C++ libraries:
    read only from entries whose backend is ``torch``): ``"torch.compile's code"``."""
    what = native_host_code(header)
    if what is None and header.get("backend") == TORCH_BACKEND:
        return "torch.compile's code"
    return what


def key_id(signing_key: bytes | None) -> str:
    """The namespace of a signing key's entries: ``k`` and 16 hex digits of a hash of the key
    (which says nothing of the key), or ``unsigned``."""
    if signing_key is None:
        return UNSIGNED_NAMESPACE
    return "k" + hashlib.sha256(b"acompile signing key id\0" + signing_key).hexdigest()[:16]


def _bytes_serializer() -> Any:
    from aiocache.serializers import BaseSerializer

    class BytesSerializer(BaseSerializer):  # type: ignore[misc]
        """Bytes in, bytes out: aiocache's default serializers would decode or pickle."""

        DEFAULT_ENCODING = None

        def dumps(self, value: bytes) -> bytes:
            return value

        def loads(self, value: bytes | None) -> bytes | None:
            return value

    return BytesSerializer()


def redact_url(url: str) -> str:
    """``url`` as it may be printed: a password in it (``redis://:secret@host``) shown as
    ``***``, and so is the value of any query option that is not one of the tier's own (a
    credential put there by mistake, ``?aws_secret_access_key=...``), so that logs and CI output
    never carry them."""
    parts = urlparse(url)
    if parts.query:
        safe = _URL_OPTIONS | STORE_OPTIONS
        pairs = parse_qs(parts.query, keep_blank_values=True)

        def show(name: str, value: str) -> str:
            if name not in safe:
                return "***"
            if "@" in value:  # an endpoint carrying credentials (refused, but never printed)
                inner = urlparse(value)
                return inner._replace(netloc="***@" + inner.netloc.rsplit("@", 1)[1]).geturl()
            return value

        shown = [f"{k}={show(k, v)}" for k, vs in pairs.items() for v in vs]
        parts = parts._replace(query="&".join(shown))
    if parts.password is None:
        return parts.geturl()
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return parts._replace(netloc=f"{user}:***@{host}").geturl()


# What a shared cache URL's query may say (``?max_connections=32&max_value=64MiB&timeout=1``).
_URL_OPTIONS = frozenset({"namespace", "max_connections", "max_value", "timeout"})
_SCHEMES = ("redis", "rediss", "memcached", *STORE_SCHEMES, FOLDER_SCHEME)
_STORE_KINDS = frozenset({*STORE_SCHEMES, FOLDER_SCHEME})


def is_store_url(target: Any) -> bool:
    """Whether ``target`` is the URL of an object store (``s3://``, ``gs://``, ``az://``) or a
    shared folder (``file://``), rather than of a memory cache."""
    return isinstance(target, str) and urlparse(target).scheme in (*STORE_SCHEMES, FOLDER_SCHEME)


def check_target(target: Any) -> None:
    """Refuse a shared-cache argument that cannot work, without importing any client: the
    constructor says so, not the pool's entry (``ValueError`` naming what is wrong)."""
    if isinstance(target, str):
        parts = urlparse(target)
        shown = redact_url(target)
        if parts.scheme not in _SCHEMES:
            raise ValueError(
                f"unknown shared cache URL {shown!r}: use redis://host:port/db, "
                "rediss://host:port/db (TLS), memcached://host:port, s3://bucket/prefix (gs://, az://) "
                "or file:///shared/folder"
            )
        options = set(parse_qs(parts.query, keep_blank_values=True))
        if is_store_url(target):
            check_store_url(target, shown)
            if unknown := sorted(options - _URL_OPTIONS - STORE_OPTIONS | (options & {"namespace"})):
                known = sorted((_URL_OPTIONS | STORE_OPTIONS) - {"namespace"})
                raise ValueError(f"shared cache URL {shown!r}: unknown option(s) {unknown}; known: {known}")
            _url_max_connections(target)
            _url_max_value(target)
            _url_timeout(target)
            return
        if not parts.hostname:
            raise ValueError(
                f"shared cache URL {shown!r} names no host: write {parts.scheme}://host:port/..."
            )
        try:
            parts.port  # noqa: B018 (urllib parses the port as it is read)
        except ValueError:
            raise ValueError(
                f"shared cache URL {shown!r}: the port must be a number from 1 to 65535"
            ) from None
        database = parts.path.strip("/")
        if parts.scheme != "memcached" and database and not database.isdigit():
            raise ValueError(
                f"shared cache URL {shown!r}: the database must be a number (redis://host:6379/0), "
                f"got {database!r}"
            )
        if unknown := sorted(options - _URL_OPTIONS):
            raise ValueError(
                f"shared cache URL {shown!r}: unknown option(s) {unknown}; known: {sorted(_URL_OPTIONS)}"
            )
        _url_max_connections(target)
        _url_max_value(target)
        _url_timeout(target)
    elif not all(hasattr(target, m) for m in ("get", "set", "add", "delete", "close")):
        raise ValueError(f"shared_cache must be an aiocache cache or a URL, got {type(target).__name__}")


def open_cache(target: Any) -> Any:
    """An aiocache cache from an instance (its serializer is set to pass bytes through) or a URL:
    ``redis://host:6379/0``, ``rediss://...``, ``memcached://host:11211``. A URL may say
    ``?max_connections=N`` (default 16): the most connections, and operations at once, this
    process opens to the server; and ``?max_value=64MiB`` (default 32 MiB): the largest value
    the tier reads or writes (read by ``SharedTier.connect_later``)."""
    if not isinstance(target, str):
        if not all(hasattr(target, m) for m in ("get", "set", "add", "delete", "close")):
            raise ValueError(f"shared_cache must be an aiocache cache or a URL, got {type(target).__name__}")
        target.serializer = _bytes_serializer()
        return target
    url = urlparse(target)
    namespace = parse_qs(url.query).get("namespace", ["acompile"])[0]
    size = _url_max_connections(target)
    if is_store_url(target):
        from acompile._cache._stores import open_storage

        return open_storage(target, max_connections=size)
    try:
        if url.scheme in ("redis", "rediss"):
            from aiocache import RedisCache
            from redis.asyncio import BlockingConnectionPool

            db = int((url.path or "/0").lstrip("/") or 0)
            return RedisCache(
                serializer=_bytes_serializer(),
                endpoint=url.hostname or "127.0.0.1",
                port=url.port or 6379,
                db=db,
                password=url.password,
                ssl=url.scheme == "rediss",
                namespace=namespace,
                pool_max_size=size,
                # Waits for a free connection instead of raising "Too many connections" (the
                # tier's own limit keeps it from waiting at all; this is the second guard).
                connection_pool_class=BlockingConnectionPool,
                connection_pool_kwargs={"timeout": 5},
            )
        if url.scheme == "memcached":
            from aiocache import MemcachedCache

            return MemcachedCache(
                serializer=_bytes_serializer(),
                endpoint=url.hostname or "127.0.0.1",
                port=url.port or 11211,
                namespace=namespace,
                pool_size=size,
            )
    except ImportError as exc:
        client = '"acompile[memcached]"' if urlparse(target).scheme == "memcached" else "redis"
        raise ValueError(
            f"the shared cache {redact_url(target)!r} needs its client ({exc}): pip install {client}"
        ) from exc
    raise ValueError(
        f"unknown shared cache URL {redact_url(target)!r}: use redis://host:port/db or memcached://host:port"
    )


def _url_max_connections(url: str) -> int:
    default = STORE_MAX_IN_FLIGHT if is_store_url(url) else DEFAULT_MAX_IN_FLIGHT
    value = parse_qs(urlparse(url).query).get("max_connections", [str(default)])[0]
    try:
        size = int(value)
    except ValueError:
        size = 0
    if not 1 <= size <= 1024:
        raise ValueError(
            f"max_connections in the shared cache URL must be a positive integer, at most 1024, got {value!r}"
        )
    return size


def _url_max_value(url: str) -> int:
    value = parse_qs(urlparse(url).query).get("max_value")
    if not value:
        if is_store_url(url):
            return STORE_MAX_VALUE
        return MEMCACHED_MAX_VALUE if urlparse(url).scheme == "memcached" else DEFAULT_MAX_VALUE
    try:
        return parse_size(value[0])
    except ValueError as exc:
        raise ValueError(f"max_value in the shared cache URL: {exc}") from None


def _url_timeout(url: str) -> float:
    value = parse_qs(urlparse(url).query).get("timeout")
    if not value:
        return STORE_TIMEOUT if is_store_url(url) else DEFAULT_TIMEOUT
    text = value[0].strip().lower()
    scale = 0.001 if text.endswith("ms") else 1.0
    try:
        seconds = float(text.removesuffix("ms").removesuffix("s")) * scale
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= 600:
        raise ValueError(
            f"timeout in the shared cache URL must be seconds, above 0 and at most 600, got {value[0]!r}"
        )
    return seconds


def _refused_as_too_large(exc: BaseException) -> bool:
    """Whether the server refused a value for its size (Memcached: ``SERVER_ERROR object too
    large for cache``): an answer about that value, not a fault of the server."""
    return "too large" in str(exc).lower()


def _pool_size(cache: Any) -> int:
    """How many operations the cache's client can run at once: its connection pool's size."""
    pool = getattr(getattr(cache, "client", None), "connection_pool", None)
    size = getattr(pool, "max_connections", None) or getattr(cache, "pool_size", None)
    size = size or getattr(cache, "max_connections", None)
    return size if isinstance(size, int) and size > 0 else DEFAULT_MAX_IN_FLIGHT


class SharedTier:
    """Bytes in, bytes out, over an aiocache cache; faults are misses (see the module's docstring).

    Args:
        cache: the aiocache cache (None with ``connect_later``).
        signing_key: sign what is published and refuse what does not verify; None for the
            unsigned namespace.
        timeout: each operation's deadline, in seconds.
        max_in_flight: operations at once (default: the client's connection pool size).
        queue_wait: how long a read or a lease waits for its turn before it is skipped
            (publications wait their turn, however long the queue).
        max_value: the largest value read or written, in bytes; a larger one is a miss.
        unsafe_unsigned_host_code: without a signing key, serve entries that hold code this
            host runs (libraries, object files) too: whoever can write to the tier can run code
            in this process. Ignored with a key (every value is verified then).

    ``counts``: ``writes`` (values published), ``write_failures`` (publications that did not
    make it: a fault, the tier off or full, a value over ``max_value``), ``rejected`` (values
    refused: not signed, a signature that does not verify, over ``max_value``, host code from an
    unsigned tier; the log says which), ``errors`` (operations that failed or timed out),
    ``skipped`` (operations not tried: the tier was off, or no turn came within ``queue_wait``),
    ``ignored_leases`` (leases not honoured: unsigned, forged, garbage, expired, or not renewed).
    """

    name = "shared"

    def __init__(
        self,
        cache: Any,
        signing_key: bytes | None,
        *,
        timeout: float = 0.5,
        max_in_flight: int | None = None,
        queue_wait: float = 5.0,
        max_value: int = DEFAULT_MAX_VALUE,
        unsafe_unsigned_host_code: bool = False,
    ) -> None:
        self.cache = cache
        self.signing_key = signing_key
        self.namespace = key_id(signing_key)
        self.timeout = timeout
        self.queue_wait = queue_wait
        self.max_in_flight = max_in_flight or _pool_size(cache)
        self.max_value = max_value
        self.unsafe_unsigned_host_code = unsafe_unsigned_host_code
        self.counts: Counter[str] = Counter()
        # Each operation's deadline (an object store's transfers are timed by their size).
        self._deadline = timeout
        self.owner = secrets.token_hex(8)
        self._turns = anyio.Semaphore(self.max_in_flight)
        self._target: Any = None
        self._down = False
        self._down_until = 0.0
        self._backoff = _BACKOFF_FIRST
        self._probing = False
        # When the tier last went off or came back (monotonic): an operation that began before
        # it is part of what was already known, and its failure changes nothing.
        self._changed_at = 0.0
        # Why the tier is off (the fault that began the outage, or the last probe's), or None.
        self._problem: str | None = None
        # Redis's scripts, made at first use (None: not Redis, or not yet).
        self._scripts: dict[str, Any] = {}
        # What has been warned about once (later ones go to the debug log).
        self._warned: set[str] = set()
        # The leases this replica holds: lease name to (cache key, the value it last wrote).
        self._held: dict[str, tuple[str, bytes]] = {}
        # Leases whose create may have landed though no answer said so (a fault, a cancelled
        # caller): not held (nothing waits on them), but given back at close where they are there.
        self._maybe_held: dict[str, tuple[str, bytes]] = {}
        self._serial = 0
        # Other replicas' lease values, by lease name: the value and when it was first seen.
        self._sightings: dict[str, tuple[bytes, float]] = {}

    @classmethod
    def connect_later(
        cls, target: Any, signing_key: bytes | None, *, unsafe_unsigned_host_code: bool = False
    ) -> SharedTier:
        """A tier for ``target`` (a URL or an aiocache cache) whose client is made by ``open()``:
        the client's import (aiocache, redis) takes tens of ms, so not on the loop. A URL's
        ``?max_value=`` sets ``max_value``."""
        check_target(target)
        is_url = isinstance(target, str)
        tier = cls(
            None,
            signing_key,
            max_value=_url_max_value(target) if is_url else DEFAULT_MAX_VALUE,
            timeout=_url_timeout(target) if is_url else DEFAULT_TIMEOUT,
            unsafe_unsigned_host_code=unsafe_unsigned_host_code,
        )
        tier._target = target
        return tier

    async def open(self) -> None:
        """Make the client of a tier from ``connect_later()`` (in a thread); no-op otherwise.

        An object store or a shared folder is checked too: one that cannot work (no such bucket
        or folder, credentials refused) raises ``ValueError``, saying so at the pool's entry; one
        that does not answer is an outage, as anywhere (its operations are misses until it
        does). Writing is not asked for at entry (a replica may read with credentials that cannot
        write); a store that ignores conditional writes is found at the first lease."""
        if self.cache is None and self._target is not None:
            self.cache = await anyio.to_thread.run_sync(open_cache, self._target)
            self.max_in_flight = _pool_size(self.cache)
            self._turns = anyio.Semaphore(self.max_in_flight)
            if hasattr(self.cache, "first_byte"):
                # An object store times each transfer by its size (the first byte within the
                # tier's timeout, the rest at a floor rate): this deadline is only a backstop.
                self.cache.first_byte = self.timeout
                self._deadline = self.cache._seconds(self.max_value) + self.timeout
            check = getattr(self.cache, "check", None)
            if check is not None:
                started = time.monotonic()
                try:
                    # Bounded as two operations are: a store that does not answer (stopped, a
                    # hung mount) holds the pool's entry this long at most, then is an outage.
                    with anyio.fail_after(2 * self.timeout):
                        await check()
                except (StoreError, TimeoutError) as exc:
                    self._fault("open", exc, started)
            else:
                # A memory cache (Redis, Memcached): one look-up, so that a URL that parses but
                # cannot work (a Redis database the server does not have, a password it
                # refuses) or a server that does not answer is said at the pool's entry, with
                # the reason, and shows in stats() from then on (shared_problem). Bounded as
                # two operations are; a failure is an outage, as anywhere, though not one of
                # the entries' operations that shared_errors counts.
                started = time.monotonic()
                try:
                    with anyio.fail_after(2 * self.timeout):
                        await self.cache.exists(self._name("acompile-entry-probe"))
                except anyio.get_cancelled_exc_class():
                    raise
                except Exception as exc:
                    self._fault("open", exc, started, counted=False)

    def stats(self) -> dict[str, Any]:
        """This tier's part of ``stats()["cache"]``."""
        return {
            "shared_rejected": self.counts["rejected"],
            "shared_errors": self.counts["errors"],
            "shared_writes": self.counts["writes"],
            "shared_write_failures": self.counts["write_failures"],
            "shared_skipped": self.counts["skipped"],
            "shared_ignored_leases": self.counts["ignored_leases"],
            "shared_leases_taken_over": self.counts["leases_taken_over"],
            "shared_available": self.available,
            "shared_problem": self.problem,
            "shared_namespace": self.namespace,
            "shared_kind": self.kind,
        }

    @property
    def max_lease_ttl(self) -> float:
        """The longest a lease lasts here unless renewed: ``MAX_LEASE_TTL`` on a memory cache,
        five times that on an object store or a folder (each renewal a billed request, or a
        write to a network mount; a dead holder holds the others 30 s at most there)."""
        return MAX_LEASE_TTL * (5 if self.kind in _STORE_KINDS else 1)

    @property
    def polls_per_second(self) -> float:
        """How many look-ups a second this process's waits on other replicas may make in all:
        a memory cache answers thousands; an object store bills each request and a small one
        answers a few hundred a second; a folder is a stat and a read on a network mount."""
        return {"file": 100.0}.get(self.kind, 25.0 if self.kind in _STORE_KINDS else 1000.0)

    @property
    def kind(self) -> str:
        """What the tier is kept in: ``redis``, ``memcached``, ``s3``, ``gs``, ``az``, ``file``."""
        kind = getattr(self.cache, "kind", None)
        if isinstance(kind, str) and kind:
            return kind
        if isinstance(self._target, str):
            return {"rediss": "redis"}.get(urlparse(self._target).scheme, urlparse(self._target).scheme)
        return "memcached" if self._memcached else "redis" if self.cache is not None else "unknown"

    @property
    def available(self) -> bool:
        """False during an outage (until an operation succeeds again)."""
        return not self._down

    @property
    def problem(self) -> str | None:
        """Why the tier is off (what the server said, or that it did not answer), None while it
        is available."""
        return self._problem if self._down else None

    @property
    def backoff(self) -> float:
        """The back-off of the current (or next) outage, in seconds."""
        return self._backoff

    # -- bytes in, bytes out, faults as misses -------------------------------------------------

    def _skip(self) -> bool:
        if not self._down:
            return False
        # Past the back-off, one operation probes the server; the others keep skipping.
        return time.monotonic() < self._down_until or self._probing

    async def _call(self, what: str, operation: Any, *args: Any, **kwargs: Any) -> tuple[bool, Any]:
        """(ok, result): never raises for the tier's own faults."""
        if self._skip():
            self.counts["skipped"] += 1
            return False, None
        # A burst queues here rather than in (or past) the client's connection pool. The wait is
        # not the server's fault: it neither counts against the operation's deadline nor turns
        # the tier off. A read or a lease has a caller waiting, so its wait is bounded; a
        # publication is not bounded here: one skipped for a long queue is an entry the fleet
        # never gets, and how long a burst of them queues depends on the machine and its load,
        # not on the server. Whoever started it bounds it (the pool's drain at exit, a caller's
        # deadline).
        with anyio.move_on_after(math.inf if what == "set" else self.queue_wait) as queued:
            await self._turns.acquire()
        if queued.cancelled_caught:
            self.counts["skipped"] += 1
            level = logging.DEBUG if self.counts["full"] else logging.WARNING
            self.counts["full"] += 1
            logger.log(level, "shared cache busy: no turn within %.1f s (%s skipped)", self.queue_wait, what)
            return False, None
        try:
            if self._skip():  # it went off while this one queued
                self.counts["skipped"] += 1
                return False, None
            probe = self._down
            self._probing = self._probing or probe
            started = time.monotonic()
            try:
                with anyio.fail_after(self._deadline):
                    result = await operation(*args, **kwargs)
            except anyio.get_cancelled_exc_class():
                raise
            except ValueError as exc:
                if what == "lease" and "already exists" in str(exc):  # aiocache's add(): key taken
                    self._up()
                    return True, False
                self._fault(what, exc, started)
                return False, None
            except Exception as exc:
                if _refused_as_too_large(exc):
                    # The server answered: it takes no value that large (Memcached's item size,
                    # its -I, 1 MiB by default). That one value is not there; the tier is.
                    self._up()
                    logger.log(
                        self._once("too-large"),
                        "shared cache: the server refused a value as too large (%s); entries that "
                        "large are not shared (raise the server's limit, e.g. memcached -I, or set "
                        "?max_value= in the shared cache URL below it so that they are not sent)",
                        exc,
                    )
                    return False, None
                self._fault(what, exc, started)
                return False, None
            finally:
                if probe:
                    self._probing = False
            self._up()
            return True, result
        finally:
            self._turns.release()

    def _up(self) -> None:
        if self._down:
            self._down = False
            self._down_until = 0.0
            self._backoff = _BACKOFF_FIRST
            self._changed_at = time.monotonic()
            self._problem = None
            logger.warning("shared cache is reachable again")

    def _fault(self, what: str, exc: BaseException, started: float, *, counted: bool = True) -> None:
        if counted:
            self.counts["errors"] += 1
        reason = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
        if started < self._changed_at:
            # Under way when the outage began (or ended): already accounted for.
            logger.debug("shared cache: %s failed (%s)", what, reason)
            return
        now = time.monotonic()
        if self._down:  # the probe failed: the server is still away
            self._backoff = min(self._backoff * 2, _BACKOFF_MAX)
            level = logging.DEBUG
        else:
            self._down = True
            self._backoff = _BACKOFF_FIRST
            level = logging.WARNING
        self._down_until = now + self._backoff
        self._changed_at = now
        self._problem = f"{what}: {reason}"
        logger.log(level, "shared cache unavailable (%s %s); going on with the local tiers", what, reason)

    def _name(self, key: str) -> str:
        return f"{self.namespace}:{key}"

    def _once(self, topic: str) -> int:
        """The level of a log line about ``topic``: a warning the first time, then debug."""
        if topic in self._warned:
            return logging.DEBUG
        self._warned.add(topic)
        return logging.WARNING

    def _script(self, source: str) -> Any:
        """A Redis script of the client (``register_script``: EVALSHA, EVAL the first time), or
        None where the cache is not Redis."""
        client = getattr(self.cache, "client", None)
        if client is None or not hasattr(client, "register_script") or not hasattr(self.cache, "build_key"):
            return None
        if source not in self._scripts:
            self._scripts[source] = client.register_script(source)
        return self._scripts[source]

    async def _fetch(self, what: str, name: str, bound: int) -> tuple[bool, bytes | int | None]:
        """(ok, value): the value's bytes, None where there is none, or, for a value larger than
        ``bound`` (or not a string: -1), its size. On Redis one script answers, and a value that
        large never crosses the network; elsewhere it is read, then refused."""
        script = self._script(_BOUNDED_GET)
        if script is not None:
            ok, value = await self._call(what, script, keys=[self.cache.build_key(name)], args=[bound])
            if not ok or value is None:
                return ok, None
            return True, value if isinstance(value, (bytes, int)) else -1
        if hasattr(self.cache, "get_bounded"):  # an object store, a folder: at most bound + 1 read
            return await self._call(what, self.cache.get_bounded, name, bound)
        ok, value = await self._call(what, self.cache.get, name)
        if not ok or value is None:
            return ok, None
        if isinstance(value, str):
            value = value.encode("latin-1")
        if not isinstance(value, (bytes, bytearray, memoryview)):
            return True, -1
        value = bytes(value)
        return True, len(value) if len(value) > bound else value

    async def get(self, key: str) -> bytes | None:
        """The entry's bytes, or None: absent, refused (its signature, its size, host code from
        an unsigned tier), or a fault."""
        name = self._name(key)
        ok, value = await self._fetch("get", name, self.max_value)
        if not ok or value is None:
            return None
        if isinstance(value, int):
            self._refuse(name, "size", self._size_problem(value))
            return None
        if len(value) < _VERIFY_INLINE_MAX:
            return self._unwrap(name, value)
        # An HMAC over megabytes, a large header: not on the event loop.
        data, topic, why = await anyio.to_thread.run_sync(self._check, name, value)
        if data is None:
            self._refuse(name, topic, why)
        return data

    def _size_problem(self, size: int) -> str:
        if size < 0:
            return "is not a value this tier writes (not a string)"
        return (
            f"is {human_bytes(size)}, over the {human_bytes(self.max_value)} bound on a shared "
            "value (?max_value= in the shared cache URL raises it)"
        )

    async def set(self, key: str, data: bytes) -> bool:
        """Publish an entry (signed where there is a key); True where it arrived. An entry over
        ``max_value`` is not published (readers would refuse it)."""
        name = self._name(key)
        if self.too_large(data):
            self.counts["write_failures"] += 1
            logger.log(
                self._once("size-write"),
                "shared cache entry %s… not published: %s",
                name[:24],
                self._size_problem(len(data)),
            )
            return False
        if len(data) < _VERIFY_INLINE_MAX:
            value = self._wrap(name, data)
        else:
            value = await anyio.to_thread.run_sync(self._wrap, name, data)
        ok, answer = await self._call("set", self.cache.set, name, value)
        stored = ok and answer is not False  # False: the store answered that it took nothing
        self.counts["writes" if stored else "write_failures"] += 1
        return stored

    def too_large(self, data: bytes) -> bool:
        """Whether an entry of ``data`` is over ``max_value`` once signed (not published here)."""
        return len(data) + len(_SIGNED) + _DIGEST > self.max_value

    async def delete(self, key: str) -> None:
        """Remove this namespace's entry for ``key`` (a fault is a no-op)."""
        await self._call("delete", self.cache.delete, self._name(key))

    async def close(self) -> None:
        """Give back the leases this replica still holds, then close the client (both bounded:
        a server that is gone must not hold up the exit)."""
        if self.cache is None:
            return
        if self._held or self._maybe_held:
            # Their release failed (an outage, its back-off): one more try each, past the
            # back-off. Those that stay expire within MAX_LEASE_TTL anyway.
            with anyio.move_on_after(_RELEASE_AT_CLOSE):
                for name, (key, value) in [*self._held.items(), *self._maybe_held.items()]:
                    try:
                        with anyio.fail_after(self.timeout):
                            await self._give_back_now(key, name, value)
                    except Exception as exc:
                        logger.debug("shared cache: giving back the lease on %s… at exit: %s", key[:16], exc)
        client = getattr(self.cache, "client", None)
        try:
            with anyio.move_on_after(1):
                if client is not None and hasattr(client, "aclose"):
                    # aiocache 0.12 closes a Redis client with the call redis-py 5 deprecated,
                    # and leaves its connection pool open: close both the current way.
                    await client.aclose()
                    await client.connection_pool.disconnect()
                else:
                    await self.cache.close()
        except Exception as exc:  # closing a cache whose server is gone
            logger.debug("closing the shared cache: %s", exc)

    # -- documents: one small value per namespace that the fleet keeps together ----------------

    def _document_name(self, kind: str) -> str:
        # Not under the entries' names (``<namespace>:<key>``): a listing of entries never
        # shows it, and a value signed for it cannot pass for an entry (the name is signed).
        return f"{kind}:{self.namespace}"

    async def _read_document(self, kind: str, bound: int) -> tuple[bool, bytes | None, bytes | int | None]:
        """(ok, the document's bytes or None, the value as read: its bytes, its size where it is
        over ``bound`` (or -1), None where there is none). A document refused (its signature, its
        size) is None, counted and logged as an entry would be."""
        bound = min(bound, self.max_value)
        name = self._document_name(kind)
        ok, raw = await self._fetch(kind, name, bound + len(_SIGNED) + _DIGEST)
        if not ok or raw is None:
            return ok, None, None
        if isinstance(raw, int):
            size = f"{human_bytes(raw)}, over {human_bytes(bound)}" if raw >= 0 else "not a string"
            self._refuse(name, "size", f"is {size}")
            return True, None, raw
        if len(raw) < _VERIFY_INLINE_MAX:
            data, topic, why = self._check(name, raw)
        else:
            data, topic, why = await anyio.to_thread.run_sync(self._check, name, raw)
        if data is None:
            self._refuse(name, topic, why)
        return True, data, raw

    async def get_document(self, kind: str, bound: int) -> bytes | None:
        """The fleet's document ``kind`` (``<kind>:<namespace>``, signed as entries are), or None:
        absent, over ``bound`` bytes (not read), refused, or a fault."""
        _, data, _ = await self._read_document(kind, bound)
        return data

    async def update_document(
        self, kind: str, bound: int, change: Callable[[bytes | None], Awaitable[bytes | None] | bytes | None]
    ) -> bool:
        """Read the document ``kind``, change it and write it back: ``change(data)`` (``data`` as
        ``get_document`` returns it; it may be a coroutine function) gives the new bytes, or None
        to write nothing. True where it was written; faults are False, never raised.

        On Redis the write is a compare-and-set (one script): it lands only where the document
        is still the one read, else it is read and changed again (up to ``_SWAP_TRIES`` times),
        so writers at once lose nothing of each other's; on an object store or a folder, a
        conditional write does the same. On Memcached it is a plain write: of two
        writers at once, the last one wins. A document over ``bound`` is not written."""
        name = self._document_name(kind)
        bound = min(bound, self.max_value)
        script = self._script(_SWAP)
        for _ in range(_SWAP_TRIES):
            ok, data, raw = await self._read_document(kind, bound)
            if not ok:
                return False
            new = change(data)
            if inspect.isawaitable(new):
                new = await new
            if new is None:
                return False
            if len(new) > bound:
                logger.debug("shared %s document of %s not written: over %s", kind, len(new), bound)
                return False
            value = self._wrap(name, new)
            if script is None and not getattr(self.cache, "expires_keys", True) and not isinstance(raw, int):
                # An object store, a folder: a create where there was none, else a write over
                # exactly the value read (If-Match on its version).
                if raw is None:
                    ok, written = await self._call(kind, self.cache.add, name, value)
                else:
                    ok, written = await self._call(kind, self.cache.set, name, value, _cas_token=raw)
                if not ok:
                    return False
                if written:
                    return True
                continue
            if script is None:
                ok, _ = await self._call(kind, self.cache.set, name, value)
                return ok
            if raw is None:
                read, token = "none", ""
            elif isinstance(raw, int):
                read, token = "over", str(bound + len(_SIGNED) + _DIGEST)
            else:
                # Equality, not trust: whoever can write the document can write it anyway.
                read, token = "sha1", hashlib.sha1(raw, usedforsecurity=False).hexdigest()
            args = [read, token, value]
            ok, written = await self._call(kind, script, keys=[self.cache.build_key(name)], args=args)
            if not ok:
                return False
            if written:
                return True
        logger.debug("shared %s document not written: changed under each of %d tries", kind, _SWAP_TRIES)
        return False

    # -- signatures -----------------------------------------------------------------------------

    def _mac(self, kind: bytes, name: str, data: bytes) -> bytes:
        assert self.signing_key is not None
        mac = hmac.new(self.signing_key, kind + b"\0" + name.encode() + b"\0", hashlib.sha256)
        mac.update(data)  # not concatenated: an entry can be megabytes
        return mac.digest()

    def _wrap(self, name: str, data: bytes) -> bytes:
        if self.signing_key is None:
            return data
        return _SIGNED + self._mac(b"entry", name, data) + data

    def _check(self, name: str, value: bytes) -> tuple[bytes | None, str, str]:
        """(the entry's bytes, "", "") for a value to serve, else (None, what is wrong, why)
        (blocking for large values: runs on a thread; counts nothing, logs nothing)."""
        if self.signing_key is not None:
            if not value.startswith(_SIGNED):
                return None, "signature", "is not signed with this signing key"
            mac, data = value[len(_SIGNED) : len(_SIGNED) + _DIGEST], value[len(_SIGNED) + _DIGEST :]
            if not hmac.compare_digest(mac, self._mac(b"entry", name, data)):
                return None, "signature", "has a signature that does not verify with this signing key"
            return data, "", ""  # signed with the fleet's key: whatever it holds
        # No key, the unsigned namespace: the entry's own checksum still applies (the chain's).
        if self.unsafe_unsigned_host_code:
            return value, "", ""
        try:
            what = native_host_code(peek_header(value))
        except CorruptEntry:
            return value, "", ""  # the chain's check counts it as damaged
        if what is None:
            return value, "", ""
        return (
            None,
            "host code",
            f"holds code this host would run ({what}), and this shared tier is not signed: set a "
            "signing key (or give SharedCache(url, unsafe_trust_unsigned=True) to let whoever can "
            "write to the tier run code here)",
        )

    def _unwrap(self, name: str, value: bytes) -> bytes | None:
        """The entry inside a value read from ``name``, or None where it is refused (counted and
        logged): ``_check`` on the calling thread, for small values."""
        data, topic, why = self._check(name, value)
        if data is None:
            self._refuse(name, topic, why)
        return data

    def _refuse(self, name: str, topic: str, why: str) -> None:
        self.counts["rejected"] += 1
        self.counts["rejected_" + topic.replace(" ", "_")] += 1  # which rule refused it
        logger.log(self._once(topic), "shared cache entry %s… %s; refused (a miss)", name[:24], why)

    # -- fleet-wide single flight ----------------------------------------------------------------

    def _lease_name(self, key: str) -> str:
        return f"lease:{self.namespace}:{key}"

    def lease_value(self, key: str, owner: str, expires: float, serial: int = 0) -> bytes:
        """A lease for ``key`` held by ``owner`` until ``expires`` (seconds since the epoch);
        ``serial`` numbers the holder's writes, so that each renewal is a new value."""
        body = f"{owner} {serial} {expires:.3f}".encode()
        mac = self._mac(b"lease", self._lease_name(key), body) if self.signing_key is not None else b""
        return _LEASE + mac + body

    def _new_lease(self, key: str, ttl: float) -> bytes:
        self._serial += 1
        return self.lease_value(key, self.owner, time.time() + ttl, self._serial)

    def _read_lease(self, key: str, raw: bytes, *, live: bool = True) -> str | None:
        """The holder of a lease value that verifies (and, ``live``, has not expired and claims
        no more than a lease's life), else None."""
        body = raw[len(_LEASE) :]
        if not raw.startswith(_LEASE):
            return None
        if self.signing_key is not None:
            mac, body = body[:_DIGEST], body[_DIGEST:]
            if not hmac.compare_digest(mac, self._mac(b"lease", self._lease_name(key), body)):
                return None
        try:
            owner, serial, expires_text = body.decode("ascii").split(" ")
            int(serial)
            expires = float(expires_text)
        except (UnicodeDecodeError, ValueError):
            return None
        now = time.time()
        if live and not (now < expires <= now + self.max_lease_ttl + _CLOCK_SKEW):
            return None
        return owner

    def _honoured(self, key: str, raw: bytes | int | None) -> str | None:
        """The holder of a lease value that is ours to honour, else None (counted, logged): it
        verifies, has not expired, and (another replica's) has changed within MAX_LEASE_TTL.

        A live holder writes a new value every third of a lease's life. One that stays the same
        longer is its dead holder's, planted, or a genuine one copied and set again after its
        release: honoured for MAX_LEASE_TTL from when this replica first saw it, no longer."""
        name = self._lease_name(key)
        if raw is None:
            self._sightings.pop(name, None)
            return None
        owner = self._read_lease(key, raw) if isinstance(raw, bytes) else None
        if owner is None or not isinstance(raw, bytes):
            self._sightings.pop(name, None)
            self._ignore(key, "is unsigned, forged, damaged or expired")
            return None
        if owner == self.owner:
            if name in self._held and self._held[name][1] == raw:
                return owner
            # This replica's own, but not one it holds: left by a request cancelled while it was
            # taken. Nobody is compiling under it.
            self._ignore(key, "is this replica's own, left by a cancelled request")
            return None
        now = time.monotonic()
        seen = self._sightings.pop(name, None)
        if seen is not None and seen[0] == raw:
            self._sightings[name] = seen
            if now - seen[1] > self.max_lease_ttl:
                self._ignore(
                    key,
                    f"has not changed for {self.max_lease_ttl:.0f} s (its holder is gone, or it was set "
                    "again after its release)",
                )
                return None
            return owner
        self._sightings[name] = (raw, now)
        while len(self._sightings) > _MAX_SIGHTINGS:
            del self._sightings[next(iter(self._sightings))]
        return owner

    def _ignore(self, key: str, why: str) -> None:
        self.counts["ignored_leases"] += 1
        logger.log(self._once("lease"), "shared cache lease for %s… %s; not waiting on it", key[:16], why)

    @property
    def _memcached(self) -> bool:
        return "Memcached" in type(self.cache).__name__

    def _ttl(self, ttl: float) -> float | int:
        """A TTL as the client takes it: Redis, milliseconds (a float); Memcached, whole seconds."""
        return max(1, math.ceil(ttl)) if self._memcached else float(ttl)

    async def take_lease(self, key: str, ttl: float) -> bool | None:
        """True: ours to compile; False: another replica compiles it; None: no single flight
        (the tier is unavailable, or the lease found there is not one to honour). ``ttl`` is at
        most ``MAX_LEASE_TTL``: the holder renews the lease to keep it."""
        can_lease = getattr(self.cache, "can_lease", None)
        if can_lease is not None:
            ok, able = await self._call("lease", can_lease)
            if not ok or not able:
                return None  # it ignores conditional writes, or this process may not write (said)
        ttl = min(ttl, self.max_lease_ttl)
        name = self._lease_name(key)
        value = self._new_lease(key, ttl)
        # Held before it is asked for: a caller cancelled while the create is on its way (it may
        # land all the same) leaves a lease that close() gives back, not an orphan.
        self._maybe_held[name] = (key, value)
        while len(self._maybe_held) > _MAX_SIGHTINGS:  # an outage's worth: the oldest expire anyway
            del self._maybe_held[next(iter(self._maybe_held))]
        ok, added = await self._call("lease", self.cache.add, name, value, ttl=self._ttl(ttl))
        if ok:  # an answer: it was taken, or it was not
            del self._maybe_held[name]
        if not ok:
            return None
        if added:
            self._held[name] = (key, value)
            return True
        ok, holder = await self._fetch("lease", name, _MAX_LEASE_VALUE)
        if not ok:
            return None
        if self._honoured(key, holder) is not None:
            return False
        if holder is not None and not getattr(self.cache, "expires_keys", True):
            # A store that forgets nothing by itself (an object store, a folder): a dead
            # holder's lease, or a planted one, stays until someone replaces it. Replaced only
            # where it is still what was read, so that of several replicas one takes it.
            return await self._take_over(key, name, holder, value, ttl)
        return None

    async def _take_over(
        self, key: str, name: str, holder: bytes | int, value: bytes, ttl: float
    ) -> bool | None:
        """Replace a lease not to be honoured (``holder``: as read) with this replica's."""
        if isinstance(holder, int):  # not a lease at all (too large, not a file): remove it
            ok, _ = await self._call("lease", self.cache.delete, name)
            if not ok:
                return None
            ok, added = await self._call("lease", self.cache.add, name, value, ttl=self._ttl(ttl))
            if ok and not added:
                return None  # still no lease there that is one (a link, a FIFO): no single flight
            taken = ok and added
        else:
            ok, taken = await self._call(
                "lease", self.cache.set, name, value, ttl=self._ttl(ttl), _cas_token=holder
            )
        if not ok:
            return None
        if taken:
            self._held[name] = (key, value)
            self.counts["leases_taken_over"] += 1
            return True
        return False  # another replica replaced it first: it compiles

    async def renew_lease(self, key: str, ttl: float) -> bool | None:
        """Extend this replica's lease on ``key`` to ``ttl`` from now (a new value: a replayed
        copy of the old one expires with it). True: renewed (or taken again where it was gone:
        it expired while the tier was unreachable); False: it is another replica's, or
        unreadable (nothing is written; stop renewing); None: the tier could not say (a fault,
        its back-off, a busy client: try again later).

        On Redis the write is a compare-and-set (one script: set it only if it still holds the
        value this replica last wrote), so a lease that expired and was taken by another replica
        in between is never overwritten; it is one round trip while all is well. Memcached has
        no such command through aiocache: there, a lease taken over between the read and the
        write (a window of one round trip) is overwritten."""
        ttl = min(ttl, self.max_lease_ttl)
        name = self._lease_name(key)
        value = self._new_lease(key, ttl)
        mine = self._held.get(name)
        if mine is not None and not self._memcached:
            ok, done = await self._call(
                "lease", self.cache.set, name, value, ttl=self._ttl(ttl), _cas_token=mine[1]
            )
            if not ok:
                return None
            if done:
                self._held[name] = (key, value)
                return True
        # Not the value last written (gone, taken over, or a write whose answer was lost): look.
        ok, holder = await self._fetch("lease", name, _MAX_LEASE_VALUE)
        if not ok:
            return None
        if holder is None:
            return await self.take_lease(key, ttl)
        if not isinstance(holder, bytes) or self._read_lease(key, holder) != self.owner:
            self._held.pop(name, None)
            return False
        if self._memcached:
            ok, _ = await self._call("lease", self.cache.multi_set, [(name, value)], ttl=self._ttl(ttl))
            if ok:
                self._held[name] = (key, value)
            return True if ok else None
        ok, done = await self._call(
            "lease", self.cache.set, name, value, ttl=self._ttl(ttl), _cas_token=holder
        )
        if not ok:
            return None
        if done:
            self._held[name] = (key, value)
        return bool(done)  # no: it changed since it was read (another replica's now)

    async def release_lease(self, key: str) -> None:
        """Give back this replica's lease on ``key`` (no-op where it holds none). A fault leaves
        it to ``close()`` (one more try) and to its expiry."""
        name = self._lease_name(key)
        ok, holder = await self._fetch("lease", name, _MAX_LEASE_VALUE)
        if not ok:
            return
        if isinstance(holder, bytes) and self._read_lease(key, holder, live=False) == self.owner:
            if not await self._drop_lease(name, holder):
                return
        self._held.pop(name, None)

    async def _drop_lease(self, name: str, value: bytes) -> bool:
        """Delete the lease ``name`` where it still holds ``value`` (on Redis, in one script; a
        plain delete elsewhere); True where the tier answered."""
        script = self._script(_DELETE_IF)
        if script is not None:
            ok, _ = await self._call("lease", script, keys=[self.cache.build_key(name)], args=[value])
        elif hasattr(self.cache, "delete_if"):
            ok, _ = await self._call("lease", self.cache.delete_if, name, value)
        else:
            ok, _ = await self._call("lease", self.cache.delete, name)
        return ok

    async def _give_back_now(self, key: str, name: str, value: bytes) -> None:
        """``release_lease`` at exit: now, past the tier's back-off and queue; raises its faults."""
        script = self._script(_DELETE_IF)
        if script is not None:
            await script(keys=[self.cache.build_key(name)], args=[value])
        elif hasattr(self.cache, "delete_if"):
            await self.cache.delete_if(name, value)
        else:
            held = await self.cache.get(name)
            if isinstance(held, bytes) and self._read_lease(key, held, live=False) == self.owner:
                await self.cache.delete(name)
        self._held.pop(name, None)

    async def lease_held(self, key: str) -> bool:
        """Whether a lease on ``key`` is held that is to be honoured (see ``_honoured``)."""
        ok, holder = await self._fetch("lease", self._lease_name(key), _MAX_LEASE_VALUE)
        return ok and self._honoured(key, holder) is not None
