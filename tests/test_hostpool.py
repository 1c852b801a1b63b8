"""The host's pool as a client meets it when something is wrong with the server: no server can
listen at the path (too long for a Unix socket), the server ends as it starts, a server that
closes each connection before its hello, a server stopped by a signal, one that is mute. Each is
a prompt fallback with the reason (or, for a stopped server, its replacement), never a wait of a
minute or an error that ends the pool. Real sockets and real server processes."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from pathlib import Path

import psutil
import pytest
from processes import reaped

import acompile
from acompile._torch import HostPool, HostPoolError, HostPoolExecutor
from acompile._torch._hostpool import HELLO_TIMEOUT, _connect, _ensure_server, run_folder, socket_name

pytestmark = pytest.mark.anyio


def test_a_socket_path_too_long_for_a_unix_socket_is_refused_at_once(tmp_path: Path) -> None:
    # The server died at once (it cannot listen there) and each process waited 60 s for it.
    deep = tmp_path / ("a-fairly-deep-project-folder/" * 3) / "acompile-cache"
    t0 = time.monotonic()
    with pytest.raises(
        HostPoolError, match=r"socket path .* is \d+ bytes, over the 107 .* shorter cache folder"
    ):
        _ensure_server(deep, 1, 5.0)
    assert time.monotonic() - t0 < 5


def test_a_server_that_ends_as_it_starts_is_said_at_once_with_its_reason(tmp_path: Path) -> None:
    # A server whose pool cannot be made (a count no machine runs) exits at once; the process
    # that started it said nothing for 60 s, then only that nothing listened.
    t0 = time.monotonic()
    with pytest.raises(HostPoolError, match=r"ended as it started: .*more than this machine can run"):
        _ensure_server(tmp_path / "cache", 10**6, 5.0)
    assert time.monotonic() - t0 < 45


async def test_a_server_that_closes_a_connection_before_its_hello_is_no_server(tmp_path: Path) -> None:
    # Its idle exit racing a new connection, or a kill mid-hello: an anyio stream error that
    # ended the pool instead of a fallback.
    root = tmp_path / "cache"
    path = run_folder(root) / socket_name()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    stop = threading.Event()

    def accept_and_close() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            with contextlib.suppress(OSError):  # a probe that connects and goes at once
                connection.sendall(b"\x00\x00")  # half of a frame's length, then gone
            connection.close()

    thread = threading.Thread(target=accept_and_close, daemon=True)
    thread.start()
    try:
        with pytest.raises(HostPoolError, match=r"cannot reach the host pool: (IncompleteRead|EndOfStream)"):
            await _connect(root, 1, 5.0)
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def _too_deep(tmp_path: Path) -> Path:
    return tmp_path / ("a-fairly-deep-project-folder/" * 3) / "acompile-cache"


async def test_a_pool_whose_host_pool_socket_cannot_fit_compiles_on_its_own_workers_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # What a served process does with serve(host_pool=True) (its pool's workers are HostPool()):
    # the socket's path is over Linux's limit, said once with the reason, and its own workers
    # compile, with no wait for a server that could never listen.
    caplog.set_level(logging.WARNING, logger="acompile")
    t0 = time.monotonic()
    async with acompile.CompilePool(
        HostPool(1), target="cuda:90", cache_dir=_too_deep(tmp_path), prestart=False
    ) as pool:
        assert not isinstance(pool.executor, HostPoolExecutor)
        entered = time.monotonic() - t0
    assert entered < 5, entered
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        "socket path" in m and "over the 107" in m and "compiling on this process's own workers" in m
        for m in warned
    ), warned
    assert not list((tmp_path / "a-fairly-deep-project-folder").rglob("*.sock"))


async def test_a_server_stopped_by_a_signal_is_replaced_within_seconds(tmp_path: Path) -> None:
    # A SIGSTOPped server kept its socket (the kernel takes connections for it) and was never
    # replaced: each process that came later waited for its hello, then compiled alone.
    root = tmp_path / "cache"
    with reaped([], tmp_path):  # the servers end with the test, however it ends
        first = await _connect(root, 1, 60.0)
        await first.stream.aclose()
        old = psutil.Process(first.hello["pid"])
        assert "acompile._torch._hostpool" in " ".join(old.cmdline())
        old.suspend()
        try:
            t0 = time.monotonic()
            second = await _connect(root, 1, 60.0)
            took = time.monotonic() - t0
            await second.stream.aclose()
            assert second.hello["pid"] not in (None, old.pid)
            # The wait for a hello, then a new server's start (no torch: its workers import it).
            assert took < HELLO_TIMEOUT + 20, took
            with contextlib.suppress(psutil.NoSuchProcess):
                assert old.status() == psutil.STATUS_ZOMBIE  # killed: never two servers at once
            # The next process finds the new server at once.
            t0 = time.monotonic()
            third = await _connect(root, 1, 60.0)
            await third.stream.aclose()
            assert third.hello["pid"] == second.hello["pid"] and time.monotonic() - t0 < 2
        finally:
            with contextlib.suppress(psutil.NoSuchProcess):
                old.resume()


async def test_a_mute_process_at_the_socket_that_is_no_server_of_ours_is_left_alone_promptly(
    tmp_path: Path,
) -> None:
    # It takes connections and says nothing (here: this very process, running). It is not a
    # host pool server stopped by a signal, so it is not killed; a client gives up on it within
    # seconds, not the 10 s of silence that took a server for gone.
    root = tmp_path / "cache"
    path = run_folder(root) / socket_name()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    stop = threading.Event()
    held: list[socket.socket] = []

    def accept_and_hold() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            held.append(connection)  # never a word

    thread = threading.Thread(target=accept_and_hold, daemon=True)
    thread.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(
            HostPoolError, match=r"said nothing within 3 s, and is not replaced: .* not this user's"
        ):
            await _connect(root, 1, 5.0)
        assert time.monotonic() - t0 < HELLO_TIMEOUT + 2
    finally:
        stop.set()
        thread.join(5)
        for connection in held:
            connection.close()
        listener.close()
