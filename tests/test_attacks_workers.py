"""Attacks by code that runs in a worker on the process that owns the pool.

A worker runs code the pool's owner does not control: a Triton kernel given as a source string has
its top-level code run there when it is compiled, and so do Inductor's jobs. That code can write
anything to the worker's pipe or socket to the pool, forged frames included. The pool reads every
frame from a worker or its template with a restricted unpickler (``_protocol``): a frame that names
anything but the protocol's messages, acompile's errors and a few plain data types is refused, its
job fails with an error that names what was refused, and nothing it names is called.
"""

from __future__ import annotations

import os
import pickle
import pickletools
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from conftest import TARGET
from kernels_for_tests import SOURCE_SIG, source_text
from processes import forked_and_fresh

import acompile
from acompile import _errors
from acompile._workers import _protocol as wire

SIG = SOURCE_SIG

# Top-level code that, in a worker only (the probe that keys the text runs it too, and has its own
# tests), writes a frame whose pickle makes the marker folder when it is unpickled to every pipe and
# socket the worker has open: its stream to the pool is among them, a pipe (asyncio's spawned
# workers), a socket pair (uvloop's) or a Unix socket (forked workers). All but the one it reads
# its jobs from, where that is another: under uvloop a spawned worker's input is a socket too, and
# whatever comes back up it (a frame or not) makes uvloop report a TypeError in the pool's loop,
# whose transport for it only writes; the transport closes, and only that worker is lost. That
# is no frame the pool reads, and not what this test is about.
FORGE = """
if "acompile._workers._main" in sys.modules:
    import gc, pickle, stat, struct
    from acompile._workers._main import Worker

    class _Forged:
        def __reduce__(self):
            return (os.mkdir, ({marker!r},))

    _body = pickle.dumps(_Forged(), protocol=pickle.HIGHEST_PROTOCOL)
    _frame = struct.pack(">Q", len(_body)) + _body
    _worker = next(o for o in gc.get_objects() if isinstance(o, Worker))
    for _name in os.listdir("/proc/self/fd"):
        try:
            _fd = int(_name)
            if _fd == _worker.fd_in != _worker.fd_out:
                continue
            _mode = os.fstat(_fd).st_mode
            if stat.S_ISFIFO(_mode) or stat.S_ISSOCK(_mode):
                os.write(_fd, _frame)
        except OSError:
            pass
"""


def source(top: str = "", n: int = 0) -> str:
    return source_text(top, n)


pytestmark = pytest.mark.anyio


@forked_and_fresh
async def test_a_forged_frame_from_a_worker_runs_no_code_in_the_pool(
    cache_dir: Path, tmp_path: Path, fork_workers: bool
) -> None:
    marker = tmp_path / "forged-frame-ran"
    text = source(FORGE.format(marker=str(marker)))
    pool = acompile.CompilePool(1, target=TARGET, cache_dir=cache_dir, fork_workers=fork_workers)
    async with pool as p:
        outcome: BaseException | None = None
        with anyio.fail_after(120):
            try:
                await p.triton(text, signature=SIG)
            except acompile.AcompileError as exc:
                outcome = exc
        assert not marker.exists(), "a frame a worker forged ran code in the pool's process"
        # The request fails, and says why: the class the frame named, refused.
        assert outcome is not None
        assert "refused" in str(outcome) and "posix.mkdir" in str(outcome), str(outcome)
        # The pool goes on: another kernel compiles (on a new worker).
        with anyio.fail_after(120):
            kernel = await p.triton(source(n=1), signature=SIG)
        assert kernel.cubin
    assert not marker.exists()


# --- the pool's reading of a frame, without processes ---------------------------------------------


def _ops(value: Any) -> bytes:
    """The pickle opcodes that push ``value`` (ints, strs, tuples of them): no protocol header, no
    frame, no memo, no stop, to be spliced into a pickle of any protocol."""
    return pickletools.optimize(pickle.dumps(value, protocol=2))[2:-1]


def _call(module: str, name: str, *args: Any) -> bytes:
    """The opcodes of a call of ``module.name(*args)``: what a class's ``__reduce__`` makes, spelled
    out, so that it can name anything, importable here or not."""
    return _ops(module) + _ops(name) + b"\x93" + _ops(args) + b"R"  # STACK_GLOBAL, REDUCE


def _pickle(ops: bytes) -> bytes:
    return b"\x80\x05" + ops + b"."


def _frame(body: bytes) -> bytes:
    return struct.pack(">Q", len(body)) + body


def _read_as_the_pool(frame: bytes) -> Any:
    """A frame as the pool reads a worker's (``decode_or_undecodable``): whole, and from a stream
    that brings it in pieces of 7 bytes, which must read the same."""
    whole = wire.decode_or_undecodable([frame[8:]])
    reader = wire.FrameReader()
    for at in range(0, len(frame), 7):
        reader.feed(frame[at : at + 7])
    parts = reader.next_parts()
    assert parts is not None and reader.next_parts() is None
    in_pieces = wire.decode_or_undecodable(parts)
    assert type(in_pieces) is type(whole)
    if isinstance(whole, wire.Undecodable):
        assert in_pieces == whole
    return whole


class _Calls:
    """Pickles as a call of ``fn(*args)``: a forged frame as an attacker makes it."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.fn, self.args)


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("posix", "system"),
        ("os", "system"),
        ("posix", "mkdir"),
        ("builtins", "eval"),
        ("builtins", "exec"),
        ("builtins", "getattr"),
        ("builtins", "__import__"),
        ("builtins", "type"),
        ("builtins", "SystemExit"),
        ("builtins", "KeyboardInterrupt"),
        ("subprocess", "Popen"),
        ("ctypes", "CDLL"),
        ("copyreg", "_reconstructor"),
        ("acompile._backends._native", "SharedLibrary"),
        ("acompile._workers._protocol", "_PoolUnpickler"),
        ("acompile._workers._queue", "JobCancelled"),
        # A dotted name reaches an attribute of what is allowed: never.
        ("acompile._errors", "CompileError.__init__"),
        ("builtins", "ValueError.__reduce__"),
        ("acompile._workers._protocol", "os.system"),
        ("__main__", "anything"),
    ],
)
def test_a_frame_that_names_anything_else_is_refused_and_nothing_runs(
    tmp_path: Path, module: str, name: str
) -> None:
    marker = str(tmp_path / "ran")
    call = _call(module, name, marker)
    # Alone; as a job's result, deep in it; in a compile error's state, in the reply to a job.
    error_with_it = (
        _ops("acompile._errors")
        + _ops("_rebuild_compile_error")
        + b"\x93"
        + _ops("acompile._errors")
        + _ops("CompileError")
        + b"\x93"
        + _ops("rejected")
        + b"}"  # EMPTY_DICT
        + _ops("log_path")
        + call
        + b"s"  # SETITEM
        + b"\x87R"  # TUPLE3, REDUCE
    )
    for ops in (
        call,
        _ops(1) + _ops(7) + call + b"\x87",
        _ops(1) + _ops(7) + b"}" + _ops("result") + b"]" + call + b"a" + b"s" + b"\x87",
        _ops(2) + _ops(7) + error_with_it + b"\x87",
    ):
        body = _pickle(ops)
        got = _read_as_the_pool(_frame(body))
        assert isinstance(got, wire.Undecodable), got
        assert "refused" in got.error and f"{module}.{name}" in got.error, got.error
        with pytest.raises(wire.Refused):
            wire.decode([body])
    assert not os.path.exists(marker)


def test_the_forgeries_of_a_real_attack_are_refused(tmp_path: Path) -> None:
    """Pickles made as an attacker makes them, by ``pickle.dumps`` of an object whose
    ``__reduce__`` calls what it wants run: alone, as a job's result, as a job's error."""
    from acompile import SharedLibrary

    marker = tmp_path / "ran"
    for forged, named in (
        (_Calls(os.system, f"touch {marker}"), "posix.system"),
        (_Calls(os.mkdir, str(marker)), "posix.mkdir"),
        (_Calls(eval, f"__import__('os').mkdir({str(marker)!r})"), "builtins.eval"),
        (_Calls(SharedLibrary, "n", "k", str(marker), None), "acompile._backends._native.SharedLibrary"),
    ):
        for message in (forged, (1, 3, forged), (2, 3, forged)):
            body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
            got = _read_as_the_pool(_frame(body))
            assert isinstance(got, wire.Undecodable) and named in got.error, (named, got)
    assert not marker.exists()


def test_an_error_must_carry_an_acompile_error() -> None:
    for error in (ValueError("not ours"), 5, None):
        got = _read_as_the_pool(_frame(pickle.dumps((2, 1, error), protocol=5)))
        assert isinstance(got, wire.Undecodable) and "not an acompile error" in got.error, got
    # Nor may a compile error's pickle rebuild anything else as one.
    for cls in (_ops("builtins") + _ops("ValueError"), _ops("acompile._errors") + _ops("PoolError")):
        ops = (
            _ops("acompile._errors")
            + _ops("_rebuild_compile_error")
            + b"\x93"
            + cls
            + b"\x93"
            + _ops("message")
            + b"}"
            + b"\x87R"
        )
        got = _read_as_the_pool(_frame(_pickle(_ops(2) + _ops(1) + ops + b"\x87")))
        assert isinstance(got, wire.Undecodable) and "as a compile error" in got.error, got


def _every_acompile_error() -> list[BaseException]:
    """An instance of each error class of ``_errors``, with its fields set."""
    made: list[BaseException] = []
    for value in vars(_errors).values():
        if not (isinstance(value, type) and issubclass(value, BaseException)):
            continue
        if issubclass(value, _errors.WorkerCrashedError):
            made.append(
                value("crashed", exit_code=-11, cause="memory", kernel="k", backend="b", stderr_tail="tail")
            )
        elif issubclass(value, _errors.CompileError):
            err = value(
                "rejected", kernel="k", backend="b", log="log", stderr_tail="t", worker_traceback="tb"
            )
            err.log_path = "/tmp/log"
            if isinstance(err, _errors.CUDACompileError | _errors.CppCompileError):
                err.line, err.source_line = 3, "int x = ;"
            made.append(err)
        else:
            made.append(value(f"a {value.__name__}"))
    return made


def _comparable(value: Any) -> Any:
    """value, with each exception in it (exceptions compare by identity) as its class and state."""
    if isinstance(value, BaseException):
        return (type(value), _comparable(value.args), _comparable(vars(value)))
    if isinstance(value, list | tuple):
        return type(value)(map(_comparable, value))
    if isinstance(value, dict):
        return {key: _comparable(item) for key, item in value.items()}
    if isinstance(value, wire.Done | wire.Error):
        return (type(value), value.id, _comparable(getattr(value, "result", getattr(value, "error", None))))
    return value


def _same(got: Any, sent: Any) -> bool:
    return type(got) is type(sent) and _comparable(got) == _comparable(sent)


def test_every_legitimate_message_reads_back_as_it_was_sent() -> None:
    errors = _every_acompile_error()
    assert {type(e) for e in errors} >= {acompile.CompileError, acompile.WorkerCrashedError}
    messages: list[Any] = [
        {"target": "cuda:90", "preload": ["x"], "sys_path": ["/a"], "nice": 5},
        wire.RunJob(7, "fake_backend", {"name": "k", "value": (1, 2)}),
        wire.Exit(),
        wire.Ready(pid=1, preload_s=0.5, threads=3, forked=True),
        wire.Failed("ImportError: no triton", "Traceback ..."),
        wire.Done(7, b"\x01" * 100_000),  # a cache entry: not a pickle (see _protocol)
        wire.Done(8, b""),
        wire.Done(2**64 - 1, b"x"),
        wire.Done(9, ("a", 1, 2.5, None, True, [b"x"], {"k": (1,)})),
        wire.Done(10, {1, 2}),
        wire.Done(11, frozenset({"a"})),
        wire.Done(12, bytearray(b"xy")),
        wire.Done(13, (1 + 2j, slice(1, 5, 2), range(3))),
        wire.Done(
            14,
            [
                ValueError("v"),
                FileNotFoundError(2, "gone", "/p"),
                UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"),
            ],
        ),
        wire.Done(15, None),
        wire.Done(-1, b"a negative id: pickled"),
        *(wire.Error(20 + i, e) for i, e in enumerate(errors) if isinstance(e, acompile.AcompileError)),
        wire.Pause(7),
        wire.Resume(7, 0.25),
        wire.Fork(3, {"address": "/tmp/x", "token": "t"}),
        wire.Forked(3, 1234),
        wire.Exited(1234, -9),
        wire.Hello(0, 1, "token"),
    ]
    for message in messages:
        frame = wire.encode(message)
        got = _read_as_the_pool(frame)
        assert _same(got, message), (message, got)
        # And the worker's side (plain pickle) reads what the pool sends just the same.
        ours, theirs = os.pipe()
        try:
            if len(frame) < 60_000:
                os.write(theirs, frame)
                assert _same(wire.read_message(ours), message), message
        finally:
            os.close(ours)
            os.close(theirs)
    # A big result in pieces, as a stream brings it.
    big = wire.Done(5, os.urandom(3 << 20))
    frame = wire.encode(big)
    reader = wire.FrameReader()
    for at in range(0, len(frame), 1 << 20):
        reader.feed(frame[at : at + (1 << 20)])
    assert reader.next() == big
    # Every error class the pool allows is one of _errors' exceptions, a built-in Exception, or
    # a protocol message; nothing else of acompile.
    for (module, name), value in wire._ALLOWED.items():
        if module == "builtins":
            assert value in (complex, slice, range, set, frozenset, bytearray) or issubclass(value, Exception)
        elif module == "acompile._errors":
            assert name == "_rebuild_compile_error" or issubclass(value, BaseException)
        else:
            assert module == "acompile._workers._protocol" and getattr(wire, name) is value
