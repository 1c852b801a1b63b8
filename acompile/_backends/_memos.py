"""The memos of the backends' parent halves, each registered where it is made.

A parent half remembers what is costly to work out again (Triton's toolchain and environment,
the types and option names its specs take, kernels' descriptions, source strings' kernels, the
launch code of a parameter list). Each memo is registered here as it is defined
(``remembered``, or ``on_forget`` for one held in a global), so that ``forget_all()`` empties
every one of them without knowing where they live: a test that changes what they hold (another
Triton installation) forgets them all, and a new memo cannot be missed by a list kept elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ("forget_all", "on_forget", "remembered")

T = TypeVar("T")

_FORGETTERS: list[Callable[[], Any]] = []


def remembered(memo: T) -> T:
    """Register ``memo`` (a dict, set or ordered dict, or a ``functools`` cache) and return it:
    ``forget_all()`` empties it (``cache_clear()``, else ``clear()``)."""
    forget = getattr(memo, "cache_clear", None) or memo.clear  # type: ignore[attr-defined]
    _FORGETTERS.append(forget)
    return memo


def on_forget(forget: Callable[[], T]) -> Callable[[], T]:
    """Register ``forget``, a function that forgets a memo held some other way (a global), and
    return it (a decorator)."""
    _FORGETTERS.append(forget)
    return forget


def forget_all() -> None:
    """Empty every memo registered so far (those of modules not imported yet hold nothing)."""
    for forget in list(_FORGETTERS):
        forget()
