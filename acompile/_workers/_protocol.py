"""The framed protocol between the pool and its workers.

Each message is an 8-byte big-endian length followed by that many bytes of pickle. Pickle is safe
here because both ends are this package's own processes on a private pipe; nothing from a cache
or the network ever goes through it.

Messages, parent to worker::

    ("job", job_id, backend, payload)   compile payload with the named backend
    ("exit",)                           finish and exit (EOF on stdin means the same)

Worker to parent::

    ("ready", info)                     preload done: {"pid", "preload_s", "rss"}
    ("failed", message, traceback)      preload failed; the worker exits after this
    ("done", job_id, result)            the backend returned result
    ("error", job_id, error)            the backend raised; error is a picklable exception
"""

from __future__ import annotations

import os
import pickle
import struct
from typing import Any

_HEADER = struct.Struct(">Q")
HEADER_SIZE = _HEADER.size
# Larger than any artifact we expect (a 100 MB result must pass), small enough to catch a
# desynchronised stream before it allocates the machine's memory.
MAX_MESSAGE = 1 << 34


def encode(message: Any) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def decode_length(header: bytes) -> int:
    (length,) = _HEADER.unpack(header)
    if length > MAX_MESSAGE:
        raise ValueError(f"frame of {length} bytes: the worker's stream is out of sync")
    return int(length)


def decode(body: bytes) -> Any:
    return pickle.loads(body)


# --- the worker's side: plain blocking file descriptors ------------------------------------------


def read_exactly(fd: int, n: int) -> bytes | None:
    """Read n bytes from fd; None on EOF before the first byte (the parent closed the pipe)."""
    chunks = []
    got = 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            if got == 0:
                return None
            raise EOFError(f"pipe closed after {got} of {n} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_message(fd: int) -> Any:
    header = read_exactly(fd, HEADER_SIZE)
    if header is None:
        return None
    body = read_exactly(fd, decode_length(header))
    if body is None:
        raise EOFError("pipe closed between a frame's header and its body")
    return decode(body)


def write_message(fd: int, message: Any) -> None:
    view = memoryview(encode(message))
    while view:
        written = os.write(fd, view)
        view = view[written:]
