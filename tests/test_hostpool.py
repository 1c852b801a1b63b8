"""The host's pool as a client meets it when something is wrong with the server: no server can
listen at the path (too long for a Unix socket), the server ends as it starts, a server that
closes each connection before its hello. Each is a prompt fallback with the reason, never a
wait of a minute or an error that ends the pool. Real sockets and real server processes."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path

import pytest

from acompile._torch import HostPoolError
from acompile._torch._hostpool import _connect, _ensure_server, run_folder, socket_name

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
