"""How torch's threads reach the pool's event loop.

torch.compile runs on threads of its own (the caller's, ``anyio.to_thread.run_sync``, Inductor's
compile threads); the pool lives on its event loop. A ``Portal`` runs a coroutine function in the
pool's task group on behalf of such a thread and hands back a ``concurrent.futures.Future``: so
every piece of work it starts belongs to the pool (cancelled when the pool leaves, which fails the
future), a thread waits for it with a deadline of its own, and a thread that stops waiting
(``future.cancel()``) cancels it on the loop.

A thread must never wait on the loop's own thread: the loop would wait for itself. ``call()``
refuses that with ``LoopThreadError``, which the served code turns into "not served here".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

from acompile._errors import PoolClosedError

_T = TypeVar("_T")


class LoopThreadError(RuntimeError):
    """A blocking call into the pool from the pool's own event-loop thread."""


class PortalTimeout(TimeoutError):
    """The loop did not answer within the caller's deadline (the work was cancelled);
    ``unstarted``: it did not even take the call (it is held by something)."""

    def __init__(self, message: str, unstarted: bool = False) -> None:
        super().__init__(message)
        self.unstarted = unstarted


# How long a thread waits for the loop to start its work: a loop that does not, within this, is
# held by something (torch.compile run on the loop's own thread, waiting for a thread that waits
# for the loop): the caller goes on without the pool instead of joining a deadlock. A healthy loop
# starts work within milliseconds, even in a storm.
START_TIMEOUT = 2.0


class Portal:
    """Runs coroutine functions in one pool's task group from other threads.

    ``loop`` and ``thread`` are the pool's event loop and the thread that runs it; ``start_soon``
    is the pool's task group's, which only a task of the loop may call: the pool runs ``pump()``
    in its task group, and the pump starts what threads hand in.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, thread: int, start_soon: Callable[..., Any]) -> None:
        self.loop = loop
        self.thread = thread
        self._start_soon = start_soon
        self._closed = False
        self._inbox: deque[tuple[Any, ...]] = deque()  # appended by any thread, taken by the pump
        self._wake = asyncio.Event()

    async def pump(self) -> None:
        """Start the work threads hand in, until cancelled (with the pool's task group)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._inbox:
                future, fn, args = self._inbox.popleft()
                if future.done():
                    continue  # cancelled before it started
                if self._closed:
                    _settle(future, error=PoolClosedError("the pool serving torch.compile has shut down"))
                    continue
                self._start_soon(self._run, future, fn, args)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Take no more work (on the loop, as the pool leaves); what runs is the pool's to
        cancel."""
        self._closed = True

    def on_loop_thread(self) -> bool:
        return threading.get_ident() == self.thread

    def spawn(
        self, fn: Callable[..., Awaitable[_T]], *args: Any, started: threading.Event | None = None
    ) -> concurrent.futures.Future[_T]:
        """Start ``fn(*args)`` in the pool's task group; its outcome arrives in the future
        (``started`` is set once the loop took it).

        Thread-safe and non-blocking. The future fails with ``PoolClosedError`` where the pool
        is gone or leaves first; cancelling the future cancels the work."""
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        if self._closed:
            future.set_exception(PoolClosedError("the pool serving torch.compile has shut down"))
            return future
        self._inbox.append((future, _announced(fn, started), args))
        try:
            self.loop.call_soon_threadsafe(self._wake.set)
        except RuntimeError:  # the loop is closed
            _settle(future, error=PoolClosedError("the pool serving torch.compile has shut down"))
        return future

    def call(self, fn: Callable[..., Awaitable[_T]], *args: Any, timeout: float | None) -> _T:
        """``fn(*args)`` on the loop, waited for from this (other) thread for at most
        ``timeout`` seconds (None: as long as it takes, once the loop has taken it). Raises what
        ``fn`` raises, ``PortalTimeout`` (the work is cancelled; also where the loop does not take
        it within ``START_TIMEOUT``), ``PoolClosedError``, or ``LoopThreadError`` on the loop's own
        thread."""
        if self.on_loop_thread():
            raise LoopThreadError("a blocking call into the pool from its own event loop's thread")
        started = threading.Event()
        future = self.spawn(fn, *args, started=started)
        try:
            if not started.wait(START_TIMEOUT) and not future.done():
                raise concurrent.futures.TimeoutError
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            what = "answer" if started.is_set() else "take the call"
            limit = timeout if started.is_set() and timeout is not None else START_TIMEOUT
            message = f"the pool's event loop did not {what} within {limit:g} s"
            raise PortalTimeout(message, not started.is_set()) from None
        except concurrent.futures.CancelledError:
            raise PoolClosedError("the pool serving torch.compile has shut down") from None

    # -- on the loop -------------------------------------------------------------------------------

    async def _run(
        self, future: concurrent.futures.Future[_T], fn: Callable[..., Awaitable[_T]], args: Any
    ) -> None:
        with anyio.CancelScope() as scope:

            def cancelled(done: concurrent.futures.Future[_T]) -> None:
                # The waiting thread gave up (future.cancel(), from any thread): stop the work.
                if done.cancelled():
                    try:
                        self.loop.call_soon_threadsafe(scope.cancel)
                    except RuntimeError:
                        pass  # the loop closed: the work went with it

            future.add_done_callback(cancelled)
            try:
                _settle(future, result=await fn(*args))
            except anyio.get_cancelled_exc_class():
                if not future.cancelled():
                    # Not the future's cancellation: the pool leaves.
                    _settle(future, error=PoolClosedError("the pool serving torch.compile has shut down"))
                raise
            except BaseException as exc:
                _settle(future, error=exc)
                if not isinstance(exc, Exception):
                    raise


def _announced(
    fn: Callable[..., Awaitable[_T]], started: threading.Event | None
) -> Callable[..., Awaitable[_T]]:
    """``fn``, which sets ``started`` as the loop begins it."""
    if started is None:
        return fn

    async def begun(*args: Any) -> _T:
        started.set()
        return await fn(*args)

    return begun


def _settle(
    future: concurrent.futures.Future[_T], *, result: Any = None, error: BaseException | None = None
) -> None:
    """Set a future's outcome unless it has one (a cancelled future keeps being cancelled)."""
    if future.done():
        return
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass  # cancelled by its thread meanwhile
