"""The shared tier: an aiocache cache (Redis, Memcached) that a fleet of processes shares.

**Namespaces.** Entries live under ``<namespace>:<cache key>``, where the namespace is the signing
key's id (``k`` and 16 hex digits of a hash of the key; ``unsigned`` without a key). Replicas
with different keys (a misconfigured one, say) each keep their own entries: one can neither
overwrite nor delete another's, and nothing is recompiled because of it.

**Signatures.** With a signing key, a value is ``b"ACSIG2" + HMAC-SHA256(key, name + entry) +
entry`` (``name``: the namespaced key, so a value cannot be moved to another key), and a value
whose signature does not verify is refused (and counted): only holders of the key can publish
what others will load. Nothing read from the tier is ever unpickled.

**Faults are misses.** The tier never fails a compile. At most ``max_in_flight`` operations run
at once (the client's connection pool size: a burst queues instead of exhausting the pool), and
an operation waits at most ``queue_wait`` for its turn. Every operation has a short deadline; an
error or a timeout counts as a miss and, the first time, declares an outage: one warning, and
the tier is skipped for a back-off (0.25 s, doubling to 30 s each time a probe fails). Back-off is
per outage, not per failed operation: operations that were already under way when it began
fail without extending it. Past the back-off one operation probes the server (the others still
skip); any success turns the tier back on at once.

**Fleet-wide single flight** uses leases: ``SET lease:<namespace>:<key> <lease> NX EX <ttl>``.
A lease holds its owner and its expiry (wall clock), signed like entries; a reader honours only
a lease that verifies and has not expired (and expires within ``_LEASE_HORIZON``), so a planted
key (no TTL, garbage, another key's) never makes a replica wait. The replica that takes the lease
compiles and publishes, renewing the lease every third of its life until then (its job may wait
in a queue); the others poll for the entry, and compile themselves if it does not come in time
or the lease goes away (a replica that died mid-compile stops renewing, and its lease expires).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import time
from collections import Counter
from typing import Any
from urllib.parse import parse_qs, urlparse

import anyio

logger = logging.getLogger("acompile")

_SIGNED = b"ACSIG2"
_LEASE = b"ACLEASE2"
_DIGEST = 32
_BACKOFF_FIRST = 0.25
_BACKOFF_MAX = 30.0
# A lease claiming to last longer than this is not honoured (no compile takes a day; a planted
# lease must not stall a kernel for longer than a reader's fleet_wait anyway).
_LEASE_HORIZON = 24 * 3600.0
# Operations at once where the client does not say (Redis URLs default to this many connections).
DEFAULT_MAX_IN_FLIGHT = 16
UNSIGNED_NAMESPACE = "unsigned"


def signing_key_from(value: str | bytes | None) -> bytes | None:
    """The signing key: the argument, else ``$ACOMPILE_SIGNING_KEY``; None for no signing."""
    if value is None:
        value = os.environ.get("ACOMPILE_SIGNING_KEY") or None
    if value is None:
        return None
    key = value.encode() if isinstance(value, str) else bytes(value)
    if len(key) < 16:
        raise ValueError("a signing key must be at least 16 bytes")
    return key


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


def check_target(target: Any) -> None:
    """Refuse a shared-cache argument that cannot work, without importing any client."""
    if isinstance(target, str):
        if urlparse(target).scheme not in ("redis", "rediss", "memcached"):
            raise ValueError(
                f"unknown shared cache URL {target!r}: use redis://host:port/db or memcached://host:port"
            )
        _url_max_connections(target)
    elif not all(hasattr(target, m) for m in ("get", "set", "add", "delete", "close")):
        raise ValueError(f"shared_cache must be an aiocache cache or a URL, got {type(target).__name__}")


def open_cache(target: Any) -> Any:
    """An aiocache cache from an instance (its serializer is set to pass bytes through) or a URL:
    ``redis://host:6379/0``, ``rediss://...``, ``memcached://host:11211``. A URL may say
    ``?max_connections=N`` (default 16): the most connections, and operations at once, this
    process opens to the server."""
    if not isinstance(target, str):
        if not all(hasattr(target, m) for m in ("get", "set", "add", "delete", "close")):
            raise ValueError(f"shared_cache must be an aiocache cache or a URL, got {type(target).__name__}")
        target.serializer = _bytes_serializer()
        return target
    url = urlparse(target)
    namespace = parse_qs(url.query).get("namespace", ["acompile"])[0]
    size = _url_max_connections(target)
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
        raise ValueError(f"the shared cache {target!r} needs its client: {exc}") from exc
    raise ValueError(
        f"unknown shared cache URL {target!r}: use redis://host:port/db or memcached://host:port"
    )


def _url_max_connections(url: str) -> int:
    value = parse_qs(urlparse(url).query).get("max_connections", [str(DEFAULT_MAX_IN_FLIGHT)])[0]
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise ValueError(f"max_connections in the shared cache URL must be a positive integer, got {value!r}")
    return size


def _pool_size(cache: Any) -> int:
    """How many operations the cache's client can run at once: its connection pool's size."""
    pool = getattr(getattr(cache, "client", None), "connection_pool", None)
    size = getattr(pool, "max_connections", None) or getattr(cache, "pool_size", None)
    return size if isinstance(size, int) and size > 0 else DEFAULT_MAX_IN_FLIGHT


class SharedTier:
    """Bytes in, bytes out, over an aiocache cache; faults are misses (see the module's docstring).

    ``counts``: ``writes`` (values published), ``write_failures`` (publications that did not
    make it: a fault, the tier off or full), ``rejected`` (values refused: not signed, or a
    signature that does not verify), ``errors`` (operations that failed or timed out),
    ``skipped`` (operations not tried: the tier was off, or no turn came within ``queue_wait``),
    ``ignored_leases`` (leases not honoured: unsigned, forged, garbage or expired).
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
    ) -> None:
        self.cache = cache
        self.signing_key = signing_key
        self.namespace = key_id(signing_key)
        self.timeout = timeout
        self.queue_wait = queue_wait
        self.max_in_flight = max_in_flight or _pool_size(cache)
        self.counts: Counter[str] = Counter()
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

    @classmethod
    def connect_later(cls, target: Any, signing_key: bytes | None) -> SharedTier:
        """A tier for ``target`` (a URL or an aiocache cache) whose client is made by ``open()``:
        the client's import (aiocache, redis) takes tens of ms, so not on the loop."""
        check_target(target)
        tier = cls(None, signing_key)
        tier._target = target
        return tier

    async def open(self) -> None:
        """Make the client of a tier from ``connect_later()`` (in a thread); no-op otherwise."""
        if self.cache is None and self._target is not None:
            self.cache = await anyio.to_thread.run_sync(open_cache, self._target)
            self.max_in_flight = _pool_size(self.cache)
            self._turns = anyio.Semaphore(self.max_in_flight)

    def stats(self) -> dict[str, Any]:
        """This tier's part of ``stats()["cache"]``."""
        return {
            "shared_rejected": self.counts["rejected"],
            "shared_errors": self.counts["errors"],
            "shared_writes": self.counts["writes"],
            "shared_write_failures": self.counts["write_failures"],
            "shared_skipped": self.counts["skipped"],
            "shared_ignored_leases": self.counts["ignored_leases"],
            "shared_available": self.available,
            "shared_namespace": self.namespace,
        }

    @property
    def available(self) -> bool:
        """False during an outage (until an operation succeeds again)."""
        return not self._down

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
        # the tier off.
        with anyio.move_on_after(self.queue_wait) as queued:
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
                with anyio.fail_after(self.timeout):
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
            logger.warning("shared cache is reachable again")

    def _fault(self, what: str, exc: BaseException, started: float) -> None:
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
        logger.log(level, "shared cache unavailable (%s %s); going on with the local tiers", what, reason)

    def _name(self, key: str) -> str:
        return f"{self.namespace}:{key}"

    async def get(self, key: str) -> bytes | None:
        """The entry's bytes, or None: absent, refused (its signature), or a fault."""
        name = self._name(key)
        ok, value = await self._call("get", self.cache.get, name)
        if not ok or value is None:
            return None
        if isinstance(value, str):
            value = value.encode("latin-1")
        return self._unwrap(name, bytes(value))

    async def set(self, key: str, data: bytes) -> bool:
        """Publish an entry (signed where there is a key); True where it arrived."""
        name = self._name(key)
        ok, _ = await self._call("set", self.cache.set, name, self._wrap(name, data))
        self.counts["writes" if ok else "write_failures"] += 1
        return ok

    async def delete(self, key: str) -> None:
        """Remove this namespace's entry for ``key`` (a fault is a no-op)."""
        await self._call("delete", self.cache.delete, self._name(key))

    async def close(self) -> None:
        """Close the client (bounded: a server that is gone must not hold up the exit)."""
        if self.cache is None:
            return
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

    # -- signatures -----------------------------------------------------------------------------

    def _mac(self, kind: bytes, name: str, data: bytes) -> bytes:
        assert self.signing_key is not None
        return hmac.new(
            self.signing_key, kind + b"\0" + name.encode() + b"\0" + data, hashlib.sha256
        ).digest()

    def _wrap(self, name: str, data: bytes) -> bytes:
        if self.signing_key is None:
            return data
        return _SIGNED + self._mac(b"entry", name, data) + data

    def _unwrap(self, name: str, value: bytes) -> bytes | None:
        if self.signing_key is None:
            # No key, the unsigned namespace: the entry's own checksum still applies.
            return value
        if not value.startswith(_SIGNED):
            self._refuse(name, "is not signed")
            return None
        mac, data = value[len(_SIGNED) : len(_SIGNED) + _DIGEST], value[len(_SIGNED) + _DIGEST :]
        if not hmac.compare_digest(mac, self._mac(b"entry", name, data)):
            self._refuse(name, "has a signature that does not verify")
            return None
        return data

    def _refuse(self, name: str, why: str) -> None:
        level = logging.DEBUG if self.counts["rejected"] else logging.WARNING
        self.counts["rejected"] += 1
        logger.log(level, "shared cache entry %s… %s with this signing key; refused", name[:24], why)

    # -- fleet-wide single flight ----------------------------------------------------------------

    def _lease_name(self, key: str) -> str:
        return f"lease:{self.namespace}:{key}"

    def lease_value(self, key: str, owner: str, expires: float) -> bytes:
        """A lease for ``key`` held by ``owner`` until ``expires`` (seconds since the epoch)."""
        body = f"{owner} {expires:.3f}".encode()
        mac = self._mac(b"lease", self._lease_name(key), body) if self.signing_key is not None else b""
        return _LEASE + mac + body

    def _lease_holder(self, key: str, value: Any) -> str | None:
        """The owner of a lease value that is ours to honour (it verifies and has not expired)."""
        if value is None:
            return None
        raw = value.encode("latin-1") if isinstance(value, str) else bytes(value)
        body = raw[len(_LEASE) :]
        ok = raw.startswith(_LEASE)
        if ok and self.signing_key is not None:
            mac, body = body[:_DIGEST], body[_DIGEST:]
            ok = hmac.compare_digest(mac, self._mac(b"lease", self._lease_name(key), body))
        try:
            owner, expires_text = body.decode("ascii").split(" ")
            expires = float(expires_text)
        except (UnicodeDecodeError, ValueError):
            ok = False
        else:
            now = time.time()
            ok = ok and now < expires < now + _LEASE_HORIZON
        if not ok:
            level = logging.DEBUG if self.counts["ignored_leases"] else logging.WARNING
            self.counts["ignored_leases"] += 1
            logger.log(
                level,
                "shared cache lease for %s… is unsigned, forged, damaged or expired; not waiting on it",
                key[:16],
            )
            return None
        return owner

    async def take_lease(self, key: str, ttl: float) -> bool | None:
        """True: ours to compile; False: another replica compiles it; None: no single flight
        (the tier is unavailable, or the lease found there is not one to honour)."""
        value = self.lease_value(key, self.owner, time.time() + ttl)
        ok, added = await self._call(
            "lease", self.cache.add, self._lease_name(key), value, ttl=max(1, int(ttl))
        )
        if not ok:
            return None
        if added:
            return True
        ok, holder = await self._call("lease", self.cache.get, self._lease_name(key))
        if not ok:
            return None
        return False if self._lease_holder(key, holder) is not None else None

    async def renew_lease(self, key: str, ttl: float) -> bool | None:
        """Extend this replica's lease on ``key`` to ``ttl`` from now. True: renewed (or taken
        again where it was gone: it expired while the tier was unreachable); False: it is
        another replica's, or unreadable (nothing is written; stop renewing); None: the tier
        could not say (a fault, its back-off, a busy client: try again later).

        On Redis the write is a compare-and-set (one script: set it only if it still holds the
        value read), so a lease that expired and was taken by another replica in between is
        never overwritten. Memcached has no such command through aiocache: there, a lease taken
        over between the read and the write (a window of one round trip) is overwritten."""
        name = self._lease_name(key)
        ok, holder = await self._call("lease", self.cache.get, name)
        if not ok:
            return None
        if holder is None:
            return await self.take_lease(key, ttl)
        if self._lease_holder(key, holder) != self.owner:
            return False
        value = self.lease_value(key, self.owner, time.time() + ttl)
        if "Memcached" in type(self.cache).__name__:
            ok, _ = await self._call("lease", self.cache.multi_set, [(name, value)], ttl=max(1, int(ttl)))
            return True if ok else None
        ok, done = await self._call(
            "lease", self.cache.set, name, value, ttl=max(1, int(ttl)), _cas_token=holder
        )
        if not ok:
            return None
        return bool(done)  # no: it changed since it was read (another replica's now)

    async def release_lease(self, key: str) -> None:
        ok, holder = await self._call("lease", self.cache.get, self._lease_name(key))
        if ok and holder is not None and self._lease_holder(key, holder) == self.owner:
            await self._call("lease", self.cache.delete, self._lease_name(key))

    async def lease_held(self, key: str) -> bool:
        """Whether another replica holds a lease on ``key`` that is to be honoured."""
        ok, holder = await self._call("lease", self.cache.get, self._lease_name(key))
        return bool(ok and self._lease_holder(key, holder) is not None)
