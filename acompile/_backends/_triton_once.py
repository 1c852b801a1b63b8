"""Work done once for all the tasks of an event loop that ask for it at the same moment.

A warm start, or a ``gather()`` of many specs, asks for the same kernel's Triton key (a parse of
its source and of everything it calls) or the same source string's run many times at once: one
task does the work and the others wait for it and read what it remembered. What they wait on
belongs to one event loop, and pools on loops in several threads of a process run at the same
time, so each loop has its own table (``this_loops``); the parse thread is one for the process.
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import anyio

from acompile import _pacing
from acompile._errors import InvalidSpecError

_T = TypeVar("_T")
_loops_lock = threading.Lock()


def this_loops(table: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _T], make: Callable[[], _T]) -> _T:
    """The running event loop's own value in table, made the first time. What tasks wait on
    (events, limiters) belongs to one loop, and pools on loops in several threads of a process
    run at the same time."""
    loop = asyncio.get_running_loop()
    with _loops_lock:
        value = table.get(loop)
        if value is None:
            value = table[loop] = make()
    return value


# The parses each loop's tasks wait for, by key (the parse thread is one for all loops).
_in_progress: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Any, anyio.Event]] = (
    weakref.WeakKeyDictionary()
)
_parser: tuple[int, ThreadPoolExecutor] | None = None
_parser_lock = threading.Lock()


def parse_thread() -> ThreadPoolExecutor:
    """The one thread that parses kernels (this process's: a forked child makes its own).

    Parsing is pure Python: in several threads at once, it would queue the event loop's thread
    behind them for the GIL. One thread with a queue takes each function straight after the
    last; a warm start asks for every function's key at once, and a round trip through the
    loop between two of them costs more than the parsing itself.
    """
    global _parser
    with _parser_lock:  # pools on loops in several threads: still one
        if _parser is None or _parser[0] != os.getpid():
            _parser = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="acompile-parse"))
        return _parser[1]


async def once(key: Any, done: Callable[[], Any], work: Callable[..., Any], *args: Any) -> Any:
    """Run work(*args) on the parsing thread, once for all the tasks that ask for key at the
    same time on this event loop; the others wait and then read the result with done()."""
    loop = asyncio.get_running_loop()

    async def on_the_parse_thread() -> Any:
        with _pacing.quick_switches():
            return await loop.run_in_executor(parse_thread(), _no_exit, work, *args)

    return await _once(this_loops(_in_progress, dict), key, done, on_the_parse_thread)


def _no_exit(work: Callable[..., _T], *args: Any) -> _T:
    """work(*args), where the kernel's code that it runs raising SystemExit or KeyboardInterrupt
    is an error of that kernel's requests. On this thread they end nothing (a thread's exit is
    not the program's); carried to the waiting task as they are, asyncio would stop the event
    loop for them, and cancel every later request of the pool."""
    try:
        return work(*args)
    except (SystemExit, KeyboardInterrupt) as exc:
        raise InvalidSpecError(
            f"the kernel's code raised {exc!r} while it was read (on acompile's parse thread, "
            "where that ends nothing)"
        ) from exc


def ahead(keys: list[Any], work: Callable[[int], None]) -> list[anyio.Event]:
    """Start, in one job of the parsing thread, the work of each of ``keys`` (``work(i)`` for
    ``keys[i]``, in their order) that no task of this loop does already: a task that asks for
    one of them with ``once`` meanwhile waits for this job's, and reads its result with its own
    ``done()`` (where there is none, the work failed: that task does it again, and raises
    what it raises). On the loop; returns at once.

    For the requests that arrive together (``gather()``): each would otherwise hand its
    function to the thread only when its turn on the loop comes, and the thread would wait for
    the loop between two of them. Returns the events set as each of those keys' work ends
    (whatever its outcome), for a caller that waits for them all."""
    loop = asyncio.get_running_loop()
    waits = this_loops(_in_progress, dict)
    todo = [(i, key) for i, key in enumerate(keys) if key not in waits]
    if not todo:
        return []
    events = {key: anyio.Event() for _, key in todo}
    waits.update(events)

    def finish(key: Any) -> None:
        if waits.get(key) is events[key]:
            del waits[key]
        events[key].set()

    # Entered here, not on the thread: the thread needs the interpreter's lock to start, and
    # the loop, busy with the requests, would hold it for the default interval first.
    switches = _pacing.quick_switches()
    switches.__enter__()

    def job() -> None:
        try:
            for i, key in todo:
                try:
                    work(i)
                except BaseException:
                    # The task that asks for it does it again, and raises this. Not only an
                    # Exception: whatever ended the job here would leave the keys after this
                    # one waited for on this loop for ever.
                    pass
                try:
                    loop.call_soon_threadsafe(finish, key)
                except RuntimeError:
                    return  # the loop is closed: nobody waits any more
        finally:
            switches.__exit__(None, None, None)

    try:
        parse_thread().submit(job)
    except BaseException as exc:
        # No job: no head start. Each task does its own work rather than wait for ever, and
        # meets the thread's refusal of new jobs (the interpreter shutting down) itself.
        switches.__exit__(None, None, None)
        for key in events:
            finish(key)
        if not isinstance(exc, RuntimeError):
            raise
    return list(events.values())


# The source strings each loop's tasks wait for, by key (see ``_triton_text``).
_in_flight: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Any, anyio.Event]] = (
    weakref.WeakKeyDictionary()
)


async def once_async(key: Any, done: Callable[[], Any], work: Callable[..., Any], *args: Any) -> Any:
    """await work(*args) once for all the tasks that ask for key at the same time; the others
    wait and read the result with done(). If the one doing it is cancelled, another takes over."""
    return await _once(this_loops(_in_flight, dict), key, done, work, *args)


async def _once(
    waits: dict[Any, anyio.Event], key: Any, done: Callable[[], Any], work: Callable[..., Any], *args: Any
) -> Any:
    """await work(*args) unless a task already does it for ``key`` (in ``waits``): then wait for
    it and read its result with done(); if it ended without one (cancelled), do it here."""
    while (pending := waits.get(key)) is not None:
        await pending.wait()
        result = done()
        if result is not None:
            return result
    event = waits[key] = anyio.Event()
    try:
        return await work(*args)
    finally:
        del waits[key]
        event.set()
