"""Keeping the event loop responsive when many requests are ready at once.

asyncio runs every callback that is ready at the start of a pass of its loop before it looks at
timers and sockets again. A warm start makes dozens of tasks ready in the same pass (the requests
``gather()`` starts together, the kernels whose entries were read together): each needs a fraction
of a millisecond, but together they would hold the loop for several, and every other task of the
process (a server's requests, a heartbeat) would wait that long.

``checkpoint()`` lets tasks through while the ones it let through in the current pass have run for
less than ``SLICE``; the others wait in line, and a batch of them is woken for each later pass,
sized so that it takes about a slice. A request alone on the loop never waits: the check costs a
clock read. Waiting tasks are woken in the order they came, each once: a thousand requests cost a
thousand wake-ups, not a thousand per pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator

# How long the tasks let through a checkpoint may run in one pass of the loop, together.
SLICE = 0.0005


class _Pacer:
    """The tasks one event loop lets through its checkpoints, a slice per pass."""

    def __init__(self) -> None:
        self.slice_started: float | None = None  # None: no slice open (and nobody waiting)
        self.admitted = 0  # tasks let through since the slice started
        self.waiting: deque[asyncio.Future[None]] = deque()
        self.batch = 1  # how many waiting tasks to wake for one pass
        self.woken_at = 0.0  # when the last batch was woken (it runs in the next pass)

    async def checkpoint(self) -> None:
        loop = asyncio.get_running_loop()
        if not self.waiting:
            now = time.perf_counter()
            if self.slice_started is None:
                # The slice starts now; the callback below runs first thing in the next pass
                # (callbacks scheduled now run only then, in order).
                self.slice_started, self.admitted = now, 0
                loop.call_soon(self._next_pass)
            if now - self.slice_started < SLICE:
                self.admitted += 1
                return
        woken: asyncio.Future[None] = loop.create_future()
        self.waiting.append(woken)
        try:
            await woken
        except BaseException:
            # Cancelled while in line: leave it (a task already woken has left it).
            if woken in self.waiting:
                self.waiting.remove(woken)
            raise

    def _next_pass(self) -> None:
        """First in a pass after a slice: wake the next batch of waiting tasks, which run in the
        pass after this one, and come back after them."""
        now = time.perf_counter()
        if not self.waiting:
            self.slice_started, self.woken_at = None, 0.0
            return
        if self.woken_at:
            # Size the next batch by how long the last one took (its pass, to this callback).
            took = now - self.woken_at
            if took < SLICE / 2:
                self.batch *= 2
            elif took > SLICE:
                self.batch = max(1, self.batch // 2)
        else:
            self.batch = max(1, self.admitted)  # as many as the first slice let through
        for _ in range(min(self.batch, len(self.waiting))):
            woken = self.waiting.popleft()
            if not woken.done():
                woken.set_result(None)
        # The next pass's slice starts now: the woken batch runs in it, and a task that comes
        # to a checkpoint there (with nobody in line) shares what the batch leaves.
        self.slice_started = self.woken_at = now
        asyncio.get_running_loop().call_soon(self._next_pass)


_pacers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Pacer] = weakref.WeakKeyDictionary()


async def checkpoint() -> None:
    """Return at once while this pass of the loop has time left for checkpointed work; else wait
    in line for a later pass. A cancellation point only when it waits."""
    loop = asyncio.get_running_loop()
    pacer = _pacers.get(loop)
    if pacer is None:
        pacer = _pacers[loop] = _Pacer()
    await pacer.checkpoint()


# --- the interpreter's switch interval while the pool parses kernels on a thread --------------

# While the pool's threads run Python beside the event loop (the parse of kernels: Triton's key
# of a JIT function, a few ms each; the pool's start: Triton's backend imports, the walk and hash
# of its sources the first time in a cache folder), the loop's thread competes with them for the
# GIL; at the interpreter's default interval (5 ms) it waits up to that long for it after each of
# its system calls, and in a storm's first tens of milliseconds such waits ran back to back (loop
# lags of 9-15 ms on 16 cores).
QUICK_SWITCH = 0.0005

_switch_lock = threading.Lock()
_switch_holders = 0
# The interval to put back, in whole microseconds: the interpreter keeps whole microseconds and
# truncates what it is given, so a float read back and set again could lose one.
_switch_saved: int | None = None


def _microseconds(seconds: float) -> int:
    return round(seconds * 1e6)


@contextlib.contextmanager
def quick_switches() -> Iterator[None]:
    """Lower the interpreter's switch interval to ``QUICK_SWITCH`` while at least one caller is
    inside (any thread), and put back what it was when the last one leaves, unless somebody
    else set another value meanwhile (theirs is kept). Never raises it: an application that
    runs with a shorter interval keeps its own."""
    global _switch_holders, _switch_saved
    with _switch_lock:
        _switch_holders += 1
        if _switch_holders == 1:
            current = _microseconds(sys.getswitchinterval())
            if current > _microseconds(QUICK_SWITCH):
                _switch_saved = current
                sys.setswitchinterval(QUICK_SWITCH)
    try:
        yield
    finally:
        with _switch_lock:
            _switch_holders -= 1
            if _switch_holders == 0 and _switch_saved is not None:
                if _microseconds(sys.getswitchinterval()) == _microseconds(QUICK_SWITCH):  # ours still
                    # Half a microsecond over, so that the truncation lands on the value saved.
                    sys.setswitchinterval((_switch_saved + 0.5) / 1e6)
                _switch_saved = None
