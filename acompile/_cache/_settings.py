"""``SharedCache``: the tier a fleet shares, as one object the user holds.

Where the tier is, how its entries are trusted and how long a replica waits for another that is
compiling the same thing: checked once, here, and read by everything that uses the tier (the
pool, torch.compile's serving, the command line), so that a policy has one name.
"""

from __future__ import annotations

import warnings
from typing import Any

from acompile._cache._shared import check_target, redact_url, signing_key_from


class SharedCache:
    """A tier a fleet shares, after memory and disk.

    Args:
        where: a URL (``"redis://host:6379/0"``, ``"rediss://..."``, ``"memcached://host:11211"``,
            an object store's ``"s3://bucket/prefix"``, ``"gs://..."``, ``"az://..."``, a shared
            folder's ``"file:///mnt/nfs/acompile"``), an aiocache cache (its serializer is set
            to pass bytes through), or a list of these, fastest first (``["redis://...",
            "s3://..."]``): one chain of shared tiers (docs/caching.md).
        signing_key: the fleet's key: what this process publishes is signed (HMAC-SHA256) and
            what does not verify is refused. Default ``$ACOMPILE_SIGNING_KEY``, read now; None
            (and the variable unset) signs nothing. An empty key, one of whitespace only, or one
            under 16 bytes raises ``ValueError``: a key that is set is never "no key".
        unsafe_trust_unsigned: without a signing key, still load from the tier what runs on this
            host (C++ libraries, nvcc's ``.so`` and ``.o``, torch.compile's entries, JIT
            libraries' modules). Unsafe: whoever can write to the tier can then run code in this
            process. Without it, an unsigned tier serves only cubins and PTX, and serving
            torch.compile through it is refused.
        fleet_wait: how long a replica waits for another that is compiling the same thing (it
            holds the key's lease in the tier) before compiling it itself, in seconds.
        copy_back: with several tiers, write a hit in a later one back to the earlier ones (in
            the background), so that the next replica finds it in the fast one.
        write: ``"behind"`` (a compiled entry goes to the shared tiers in the background; the
            request returns once it is on the disk) or ``"through"`` (the request returns once
            the shared tiers have it, or have failed to take it).

    With several tiers, an entry over a tier's ``?max_value=`` skips that tier and goes to the
    next (a Redis kept for small entries before an object store for all).

    A local hit never touches the tier; its faults are misses, never errors. The key is never
    part of ``repr()``.
    """

    __slots__ = ("_key", "copy_back", "fleet_wait", "unsafe_trust_unsigned", "where", "write")

    def __init__(
        self,
        where: Any,
        *,
        signing_key: str | bytes | None = None,
        unsafe_trust_unsigned: bool = False,
        fleet_wait: float = 60.0,
        copy_back: bool = True,
        write: str = "behind",
    ) -> None:
        places = list(where) if isinstance(where, (list, tuple)) else [where]
        if not places:
            raise ValueError("SharedCache needs at least one place: a URL or an aiocache cache")
        for place in places:
            if place is None or (not isinstance(place, str) and not hasattr(place, "get")):
                raise TypeError(f"SharedCache needs a URL or an aiocache cache, got {type(place).__name__}")
            check_target(place)
            _check_client(place)
        urls = [p for p in places if isinstance(p, str)]
        if len(set(urls)) != len(urls):
            raise ValueError(
                "SharedCache: the same URL twice in one chain (each entry would be written twice)"
            )
        if not isinstance(copy_back, bool):
            raise TypeError(f"copy_back must be True or False, got {copy_back!r}")
        if write not in ("behind", "through"):
            raise ValueError(f"write must be 'behind' or 'through', got {write!r}")
        if signing_key is not None and not isinstance(signing_key, (str, bytes)):
            raise TypeError(f"signing_key must be a string or bytes, got {type(signing_key).__name__}")
        if not isinstance(unsafe_trust_unsigned, bool):
            raise TypeError(f"unsafe_trust_unsigned must be True or False, got {unsafe_trust_unsigned!r}")
        if (
            isinstance(fleet_wait, bool)
            or not isinstance(fleet_wait, (int, float))
            or not 0 < fleet_wait < float("inf")
        ):
            raise ValueError(f"fleet_wait must be a positive number of seconds, got {fleet_wait!r}")
        self.where = where if len(places) == 1 and not isinstance(where, (list, tuple)) else tuple(places)
        self.copy_back = copy_back
        self.write = write
        # None reads the environment: a fleet's key there is never dropped by a default.
        self._key = signing_key_from(signing_key)
        self.unsafe_trust_unsigned = unsafe_trust_unsigned
        self.fleet_wait = float(fleet_wait)

    @property
    def places(self) -> tuple[Any, ...]:
        """Each shared tier's URL (or cache), fastest first."""
        return self.where if isinstance(self.where, tuple) else (self.where,)

    @property
    def signing_key(self) -> bytes | None:
        """The key entries are signed and checked with, or None."""
        return self._key

    @property
    def signed(self) -> bool:
        return self._key is not None

    @property
    def trusted(self) -> bool:
        """Whether code that runs on this host may be loaded from the tier: it is signed, or its
        owner said to trust it unsigned."""
        return self._key is not None or self.unsafe_trust_unsigned

    def __setattr__(self, name: str, value: Any) -> None:
        if hasattr(self, "fleet_wait"):
            raise AttributeError("a SharedCache is not changed once made: make another")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise AttributeError("a SharedCache is not changed once made: make another")

    def __reduce__(self) -> tuple[Any, ...]:
        # It holds the fleet's key: a pickle of it would be the key in clear, wherever the bytes
        # go. Each process makes its own (the key from its environment).
        raise TypeError("a SharedCache holds a signing key and is not pickled: make one in each process")

    def __repr__(self) -> str:
        shown = [redact_url(p) if isinstance(p, str) else type(p).__name__ for p in self.places]
        where = shown[0] if len(shown) == 1 else shown
        trust = "signed" if self.signed else "unsigned, trusted" if self.unsafe_trust_unsigned else "unsigned"
        policy = "" if len(shown) == 1 else f", copy_back={self.copy_back}"
        policy += "" if self.write == "behind" else f", write={self.write!r}"
        return f"SharedCache({where!r}, {trust}, fleet_wait={self.fleet_wait:g}{policy})"


def _check_client(place: Any) -> None:
    """Refuse a URL whose client is not installed, naming the extra that brings it."""
    if not isinstance(place, str):
        return
    import importlib.util

    scheme = place.split(":", 1)[0]
    if scheme == "memcached" and importlib.util.find_spec("aiomcache") is None:
        raise ValueError(
            f'the shared cache {redact_url(place)!r} needs its client: pip install "acompile[memcached]"'
        )
    if scheme in ("s3", "gs", "az") and importlib.util.find_spec("obstore") is None:
        raise ValueError(
            f'the shared cache {place.split("?")[0]!r} needs its client: pip install "acompile[store]"'
        )


DEFAULT_FLEET_WAIT = 60.0


# The arguments that stood beside ``shared_cache`` before 0.2.1, and their names in SharedCache.
_RENAMED = {
    "signing_key": "signing_key",
    "unsafe_unsigned_host_code": "unsafe_trust_unsigned",
    "fleet_wait": "fleet_wait",
}


def shared_cache_argument(
    shared_cache: Any,
    signing_key: Any = None,
    unsafe_unsigned_host_code: Any = None,
    fleet_wait: Any = None,
    *,
    stacklevel: int = 3,
) -> SharedCache | None:
    """``CompilePool``'s ``shared_cache`` argument as a ``SharedCache`` (or None), with the
    arguments that once stood beside it (``signing_key``, ``unsafe_unsigned_host_code``,
    ``fleet_wait``; None where not given) checked and folded in: each given is deprecated (a
    ``DeprecationWarning`` at ``stacklevel``, naming the new form)."""
    given = [
        name
        for name, value in (
            ("signing_key", signing_key),
            ("unsafe_unsigned_host_code", unsafe_unsigned_host_code),
            ("fleet_wait", fleet_wait),
        )
        if value is not None
    ]
    if isinstance(shared_cache, SharedCache):
        if given:
            raise TypeError(
                f"give {', '.join(given)} to the SharedCache (SharedCache(where, signing_key=..., "
                "unsafe_trust_unsigned=..., fleet_wait=...)), not beside it"
            )
        return shared_cache
    if signing_key is not None and not isinstance(signing_key, (str, bytes)):
        raise TypeError(f"signing_key must be a string or bytes, got {type(signing_key).__name__}")
    if unsafe_unsigned_host_code is not None and not isinstance(unsafe_unsigned_host_code, bool):
        raise TypeError(f"unsafe_unsigned_host_code must be True or False, got {unsafe_unsigned_host_code!r}")
    if fleet_wait is not None and (
        isinstance(fleet_wait, bool)
        or not isinstance(fleet_wait, (int, float))
        or not 0 < fleet_wait < float("inf")
    ):
        raise ValueError(f"fleet_wait must be a positive number of seconds, got {fleet_wait!r}")
    shared: SharedCache | None = None
    if shared_cache is None:
        signing_key_from(signing_key)  # a key given is checked all the same: an empty one is a slip
    elif not isinstance(shared_cache, (str, list, tuple)) and not hasattr(shared_cache, "get"):
        raise TypeError(
            "shared_cache must be an acompile.SharedCache, a URL or an aiocache cache, got "
            f"{type(shared_cache).__name__}"
        )
    else:
        shared = SharedCache(
            shared_cache,
            signing_key=signing_key,
            unsafe_trust_unsigned=bool(unsafe_unsigned_host_code),
            fleet_wait=DEFAULT_FLEET_WAIT if fleet_wait is None else fleet_wait,
        )
    if given and shared_cache is None:
        warnings.warn(
            f"CompilePool's {', '.join(given)} without a shared_cache has no effect (checked, then "
            "dropped), is deprecated, and will be an error in 0.3: give them to "
            "shared_cache=acompile.SharedCache(url, ...), or leave them out",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
    elif given:  # once every value is known to work: a wrong one is the error that is raised
        fields = ", ".join(f"{_RENAMED[name]}=..." for name in given)
        wider = (
            " (unsafe_trust_unsigned is one trust: it also lets torch.compile's entries load from the "
            "unsigned tier)"
            if unsafe_unsigned_host_code
            else ""
        )
        warnings.warn(
            f"CompilePool's {', '.join(given)} beside shared_cache is deprecated and will be removed in "
            f"0.3: pass shared_cache=acompile.SharedCache(url, {fields}){wider}",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
    return shared


def with_shared_cache_fields(options: dict[str, Any]) -> dict[str, Any]:
    """``serve()``'s options as JSON carries them to another process: a ``shared_cache`` that is
    a table holds a ``SharedCache``'s fields (the key stays in each process's environment)."""
    shared = options.get("shared_cache")
    if isinstance(shared, dict):
        options = {**options, "shared_cache": SharedCache(**shared)}
    return options
