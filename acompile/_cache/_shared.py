"""The shared tier: an aiocache cache (Redis, Memcached) that a fleet of processes shares.

Values are the entries' own bytes, optionally signed: with a signing key, a value is
``b"ACSIG1" + HMAC-SHA256(key, cache key + entry) + entry`` and a value whose signature does not
verify is refused (and counted), so only holders of the key can publish what others will load.
Nothing read from the tier is ever unpickled.

The tier never fails a compile. Every operation has a short deadline; an error or a timeout
counts as a miss, logs one warning per outage, and takes the tier out of use for a growing
back-off (1 s, then doubling to 30 s) so that a dead Redis costs requests nothing; after the
back-off the next operation tries again, and the client reconnects by itself.

Fleet-wide single flight uses leases: ``SET lease:<key> <owner> NX PX <ttl>``. The replica
that takes the lease compiles and publishes; the others poll for the entry, and compile
themselves if it does not come in time (a replica that died mid-compile lets its lease expire).
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

_SIGNED = b"ACSIG1"
_DIGEST = 32
_BACKOFF_MAX = 30.0


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
    elif not all(hasattr(target, m) for m in ("get", "set", "add", "delete", "close")):
        raise ValueError(f"shared_cache must be an aiocache cache or a URL, got {type(target).__name__}")


def open_cache(target: Any) -> Any:
    """An aiocache cache from an instance (its serializer is set to pass bytes through) or a URL:
    ``redis://host:6379/0``, ``rediss://...``, ``memcached://host:11211``."""
    if not isinstance(target, str):
        if not all(hasattr(target, m) for m in ("get", "set", "add", "delete", "close")):
            raise ValueError(f"shared_cache must be an aiocache cache or a URL, got {type(target).__name__}")
        target.serializer = _bytes_serializer()
        return target
    url = urlparse(target)
    try:
        if url.scheme in ("redis", "rediss"):
            from aiocache import RedisCache

            db = int((url.path or "/0").lstrip("/") or 0)
            return RedisCache(
                serializer=_bytes_serializer(),
                endpoint=url.hostname or "127.0.0.1",
                port=url.port or 6379,
                db=db,
                password=url.password,
                ssl=url.scheme == "rediss",
                namespace=parse_qs(url.query).get("namespace", ["acompile"])[0],
            )
        if url.scheme == "memcached":
            from aiocache import MemcachedCache

            return MemcachedCache(
                serializer=_bytes_serializer(),
                endpoint=url.hostname or "127.0.0.1",
                port=url.port or 11211,
                namespace=parse_qs(url.query).get("namespace", ["acompile"])[0],
            )
    except ImportError as exc:
        raise ValueError(f"the shared cache {target!r} needs its client: {exc}") from exc
    raise ValueError(
        f"unknown shared cache URL {target!r}: use redis://host:port/db or memcached://host:port"
    )


class SharedTier:
    name = "shared"

    def __init__(self, cache: Any, signing_key: bytes | None, *, timeout: float = 0.5) -> None:
        self.cache = cache
        self.signing_key = signing_key
        self.timeout = timeout
        self.counts: Counter[str] = Counter()
        self._down_until = 0.0
        self._backoff = 1.0
        self._down = False
        self.owner = secrets.token_hex(8)

    # -- bytes in, bytes out, faults as misses -------------------------------------------------

    async def _call(self, what: str, operation: Any, *args: Any, **kwargs: Any) -> tuple[bool, Any]:
        """(ok, result): never raises for the tier's own faults."""
        now = time.monotonic()
        if now < self._down_until:
            self.counts["skipped_while_down"] += 1
            return False, None
        try:
            with anyio.fail_after(self.timeout):
                result = await operation(*args, **kwargs)
        except anyio.get_cancelled_exc_class():
            raise
        except ValueError as exc:
            if what == "lease" and "already exists" in str(exc):  # aiocache's add(): key taken
                return True, False
            self._fault(what, exc)
            return False, None
        except Exception as exc:
            self._fault(what, exc)
            return False, None
        if self._down:
            self._down = False
            logger.warning("shared cache is reachable again")
        self._backoff = 1.0
        return True, result

    def _fault(self, what: str, exc: BaseException) -> None:
        self.counts["errors"] += 1
        self._down_until = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, _BACKOFF_MAX)
        level = logging.DEBUG if self._down else logging.WARNING
        self._down = True
        reason = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
        logger.log(level, "shared cache unavailable (%s %s); going on with the local tiers", what, reason)

    async def get(self, key: str) -> bytes | None:
        ok, value = await self._call("get", self.cache.get, key)
        if not ok or value is None:
            return None
        if isinstance(value, str):
            value = value.encode("latin-1")
        return self._unwrap(key, bytes(value))

    async def set(self, key: str, data: bytes) -> bool:
        ok, _ = await self._call("set", self.cache.set, key, self._wrap(key, data))
        if ok:
            self.counts["writes"] += 1
        return ok

    async def delete(self, key: str) -> None:
        await self._call("delete", self.cache.delete, key)

    async def close(self) -> None:
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

    def _mac(self, key: str, data: bytes) -> bytes:
        assert self.signing_key is not None
        return hmac.new(self.signing_key, key.encode() + b"\0" + data, hashlib.sha256).digest()

    def _wrap(self, key: str, data: bytes) -> bytes:
        if self.signing_key is None:
            return data
        return _SIGNED + self._mac(key, data) + data

    def _unwrap(self, key: str, value: bytes) -> bytes | None:
        signed = value.startswith(_SIGNED)
        if self.signing_key is None:
            # No key here: nothing to verify against; the entry's own checksum still applies.
            return value[len(_SIGNED) + _DIGEST :] if signed else value
        if not signed:
            self._refuse(key, "is not signed")
            return None
        mac, data = value[len(_SIGNED) : len(_SIGNED) + _DIGEST], value[len(_SIGNED) + _DIGEST :]
        if not hmac.compare_digest(mac, self._mac(key, data)):
            self._refuse(key, "has a signature that does not verify")
            return None
        return data

    def _refuse(self, key: str, why: str) -> None:
        level = logging.DEBUG if self.counts["rejected"] else logging.WARNING
        self.counts["rejected"] += 1
        logger.log(level, "shared cache entry %s… %s with this signing key; refused", key[:16], why)

    # -- fleet-wide single flight ----------------------------------------------------------------

    async def take_lease(self, key: str, ttl: float) -> bool | None:
        """True: ours to compile; False: another replica compiles it; None: tier unavailable."""
        ok, added = await self._call(
            "lease", self.cache.add, f"lease:{key}", self.owner.encode(), ttl=max(1, int(ttl))
        )
        if not ok:
            return None
        return bool(added)

    async def release_lease(self, key: str) -> None:
        ok, holder = await self._call("lease", self.cache.get, f"lease:{key}")
        if (
            ok
            and holder is not None
            and bytes(holder if isinstance(holder, bytes) else holder.encode()) == self.owner.encode()
        ):
            await self._call("lease", self.cache.delete, f"lease:{key}")

    async def lease_held(self, key: str) -> bool:
        ok, holder = await self._call("lease", self.cache.exists, f"lease:{key}")
        return bool(ok and holder)
