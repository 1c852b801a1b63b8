"""Run a kernel source string in a short-lived process and report what the pool needs to key it.

A source string's top-level code is arbitrary user code: it may sleep, loop forever, import
torch, fill memory, start processes, or write to any file descriptor it finds. Run in the pool's
own process it would hold a thread (and the GIL) that no deadline can take back, and every other
request would wait behind it. Run here, it is a process group that the pool kills as a whole
when the request ends, however it ends, and whose memory the pool holds to its ``memory_limit``.

The process the pool starts (``BOOT``) leads a process group of its own and is the *supervisor*:
it never runs the text. Before it reads anything it forks the *runner*, which closes every
descriptor that reaches the pool (its input comes from ``/dev/null``, its output goes to its
stderr), reads the request from the supervisor on a pipe of their own, runs the text and writes
its findings back on another. The supervisor then reads the pool's request, which carries a
random token the runner never sees, and answers the pool on its stdout with a header line
(``acompile-probe 1 TOKEN STATUS CUT LENGTH``) and the runner's findings as they came.

The pool reads all of it as data, never as a pickle: a header that is not exactly this, with this
probe's token, or any byte after the findings, and the answer is refused; the findings are JSON
that ``read_answer`` checks field by field (names, Triton's cache key, the parameters and their
defaults, in a closed set of value types). So whatever the text writes, wherever it writes it,
it can make its own request fail and at most misdescribe its own kernel, which its code can do
anyway by changing Triton: it cannot run anything in the pool's process.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import select
import signal
import sys
import traceback
from typing import Any

from acompile._errors import bounded

# How the pool starts the supervisor: a process group of its own before anything else, so that
# killing the group reaches whatever the text starts. A group, not a session: as the pool's
# workers (see _pool._BOOT).
BOOT = "import os; os.setpgid(0, 0); from acompile._backends._triton_probe import main; main()"
# The most the runner's findings may hold: kernel names, a key, parameters, a bounded message.
ANSWER_LIMIT = 4 << 20
_HEADER = re.compile(rb"acompile-probe 1 ([0-9a-f]{64}) (-?[0-9]{1,4}) ([01]) ([0-9]{1,8})\n")
HEADER_LIMIT = 128
# A name as the answer may give it (Python identifiers; bounded), and Triton's cache key (a
# hex digest and the number of the kernel's first line).
_NAME_LIMIT = 1024
_KEY = re.compile(r"[0-9A-Za-z_:.+-]{1,512}")
# How deep a parameter's default may nest (tuples of tuples).
_DEPTH_LIMIT = 16


class BadAnswer(ValueError):
    """What came back is not an answer this probe gives (garbled, forged, cut, or malformed)."""


# --- the pool's half ----------------------------------------------------------------------------


def make_request(text: str, filename: str, kernel_name: str | None, sys_path: list[str]) -> tuple[bytes, str]:
    """The supervisor's input for one text, and the token its answer must carry."""
    token = secrets.token_hex(32)
    request = {
        "token": token,
        "text": text,
        "filename": filename,
        "kernel_name": kernel_name,
        "sys_path": sys_path,
    }
    return json.dumps(request).encode(), token


def read_envelope(data: bytes, token: str) -> tuple[int, bytes]:
    """The runner's exit status and findings, from all the supervisor wrote. Raises
    ``BadAnswer`` unless it is exactly one header with this probe's token and what it counts."""
    match = _HEADER.match(data)
    if match is None:
        raise BadAnswer("it does not start with the probe's header")
    if not secrets.compare_digest(match[1], token.encode()):
        raise BadAnswer("its header does not carry this probe's token")
    if match[3] == b"1":
        raise BadAnswer(f"the findings passed {ANSWER_LIMIT >> 20} MiB")
    body = data[match.end() :]
    if len(body) != int(match[4]):
        raise BadAnswer(f"{len(body)} bytes follow a header that counts {int(match[4])}")
    return int(match[2]), body


def read_answer(body: bytes) -> dict[str, Any]:
    """The runner's findings, checked: ``{"ok": False, "kind": "syntax" | "run", "message",
    "traceback"}`` or ``{"ok": True, "found": [names], "kernel": None | {"name", "cache_key",
    "arg_names", "params"}}`` with each parameter ``(name, is_constexpr, has_default,
    default)``. Raises ``BadAnswer`` for anything else."""
    try:
        answer = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise BadAnswer(f"its findings are not JSON: {type(exc).__name__}") from None
    if not isinstance(answer, dict):
        raise BadAnswer("it is not a JSON object")
    if answer.get("ok") is False:
        kind, message, trace = answer.get("kind"), answer.get("message"), answer.get("traceback", "")
        if kind not in ("syntax", "run") or not isinstance(message, str) or not isinstance(trace, str):
            raise BadAnswer("a failure without its kind and message")
        return {
            "ok": False,
            "kind": kind,
            "message": bounded(message, 4000),
            "traceback": bounded(trace, 16000),
        }
    if answer.get("ok") is not True:
        raise BadAnswer("no 'ok'")
    found = answer.get("found")
    if not isinstance(found, list) or not all(_is_name(name) for name in found):
        raise BadAnswer("'found' is not a list of names")
    kernel = answer.get("kernel")
    if kernel is None:
        return {"ok": True, "found": found, "kernel": None}
    if not isinstance(kernel, dict):
        raise BadAnswer("'kernel' is not an object")
    name, cache_key = kernel.get("name"), kernel.get("cache_key")
    arg_names, params = kernel.get("arg_names"), kernel.get("params")
    if not _is_name(name):
        raise BadAnswer("the kernel's name is not a Python identifier")
    if not isinstance(cache_key, str) or not _KEY.fullmatch(cache_key):
        raise BadAnswer("the kernel's cache key is not one Triton makes")
    if not isinstance(arg_names, list) or not all(_is_name(arg) for arg in arg_names):
        raise BadAnswer("the kernel's argument names are not a list of names")
    if not isinstance(params, list) or len(params) != len(arg_names):
        raise BadAnswer("the kernel's parameters are not one per argument")
    checked = []
    for param, arg in zip(params, arg_names, strict=True):
        if not isinstance(param, list) or len(param) != 4:
            raise BadAnswer(f"parameter {arg!r} is not [name, is_constexpr, has_default, default]")
        p_name, is_constexpr, has_default, default = param
        if p_name != arg or not isinstance(is_constexpr, bool) or not isinstance(has_default, bool):
            raise BadAnswer(f"parameter {arg!r} is not [name, is_constexpr, has_default, default]")
        checked.append((p_name, is_constexpr, has_default, decode_value(default) if has_default else None))
    return {
        "ok": True,
        "found": found,
        "kernel": {"name": name, "cache_key": cache_key, "arg_names": arg_names, "params": checked},
    }


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and len(value) <= _NAME_LIMIT and value.isidentifier()


def decode_value(value: Any, depth: int = 0) -> Any:
    """A parameter's default from its JSON form (see ``encode_value``)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if depth < _DEPTH_LIMIT and isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
        tag, inner = value
        if tag == "float" and isinstance(inner, str):
            try:
                return float(inner)
            except ValueError:
                pass
        elif tag in ("tuple", "list") and isinstance(inner, list):
            items = [decode_value(item, depth + 1) for item in inner]
            return tuple(items) if tag == "tuple" else items
        elif tag == "constexpr":
            import triton.language as tl

            return tl.constexpr(decode_value(inner, depth + 1))
        elif tag == "dtype" and isinstance(inner, str):
            import triton.language as tl

            if inner in (
                *tl.dtype.SINT_TYPES,
                *tl.dtype.UINT_TYPES,
                *tl.dtype.FP_TYPES,
                *tl.dtype.OTHER_TYPES,
            ):
                return tl.dtype(inner)
    raise BadAnswer(f"a parameter's default is not a value the probe sends: {bounded(repr(value), 200)}")


# --- the probe's half ---------------------------------------------------------------------------


class _NotSent(Exception):
    """A default that is none of the types ``encode_value`` sends."""


def encode_value(value: Any, depth: int = 0) -> Any:
    """A parameter's default in JSON: ``None``, bools, ints and strings as they are; floats,
    tuples, lists, ``tl.constexpr`` and Triton dtypes tagged ``[kind, value]``. Anything else
    raises ``_NotSent``: the caller passes that constexpr itself."""
    if value is None or isinstance(value, (bool, int, str)):
        if type(value) not in (type(None), bool, int, str):
            raise _NotSent(type(value).__name__)  # a subclass would arrive as its base
        return value
    if depth >= _DEPTH_LIMIT:
        raise _NotSent("nested too deep")
    if type(value) is float:
        return ["float", repr(value)]
    if type(value) in (tuple, list):
        return ["tuple" if type(value) is tuple else "list", [encode_value(v, depth + 1) for v in value]]
    import triton.language as tl

    if type(value) is tl.constexpr:
        return ["constexpr", encode_value(value.value, depth + 1)]
    if type(value) is tl.dtype:
        return ["dtype", value.name]
    raise _NotSent(type(value).__name__)


def probe(text: str, filename: str, kernel_name: str | None) -> dict[str, Any]:
    """Run the text; what it defines, as JSON-ready findings (see ``read_answer``)."""
    from acompile._backends._triton_source import run_source_text

    try:
        namespace = run_source_text(text, filename)
    except SyntaxError as exc:
        return {"ok": False, "kind": "syntax", "message": bounded(str(exc), 4000)}
    except BaseException as exc:
        return {
            "ok": False,
            "kind": "run",
            "message": bounded(f"{type(exc).__name__}: {exc}", 4000),
            "traceback": bounded("".join(traceback.format_exception(exc)), 16000),
        }
    from triton.runtime.jit import JITFunction

    found = sorted(k for k, v in namespace.items() if isinstance(v, JITFunction) and _is_name(k))
    if kernel_name is None and len(found) == 1:
        kernel_name = found[0]
    fn = namespace.get(kernel_name) if kernel_name is not None else None
    if not isinstance(fn, JITFunction):
        return {"ok": True, "found": found, "kernel": None}
    params: list[list[Any]] = []
    for p in fn.params:
        default: Any = None
        has_default = bool(p.has_default)
        if has_default:
            try:
                default = encode_value(p.default)
            except _NotSent:
                has_default = False  # the caller passes it
        params.append([p.name, bool(p.is_constexpr), has_default, default])
    try:
        cache_key = fn.cache_key
    except BaseException as exc:
        return {"ok": False, "kind": "run", "message": bounded(f"{type(exc).__name__}: {exc}", 4000)}
    kernel = {
        "name": fn.__name__,
        "cache_key": cache_key,
        "arg_names": list(fn.arg_names),
        "params": params,
    }
    return {"ok": True, "found": found, "kernel": kernel}


def _kill_own_group(*_: object) -> None:
    """The pool's process is gone (its death signal, SIGTERM): take the text's processes along."""
    if os.getpgid(0) == os.getpid():
        os.killpg(0, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    """The supervisor: fork the runner, pass it the request, answer the pool."""
    from acompile import _linux

    # Read by acompile._lazy as acompile was imported (this process needs few of its modules);
    # what the text starts is no worker.
    os.environ.pop("ACOMPILE_WORKER", None)
    # Go when the pool's process dies, even by SIGKILL: the kernel sends SIGTERM, and the handler
    # kills the whole group, so nothing the text started runs on as an orphan.
    signal.signal(signal.SIGTERM, _kill_own_group)
    _linux.signal_at_parent_death(signal.SIGTERM)
    parent_pid = int(os.environ.get("ACOMPILE_PARENT_PID", "0"))
    if parent_pid and os.getppid() != parent_pid:
        _kill_own_group()
    request_r, request_w = os.pipe()
    findings_r, findings_w = os.pipe()
    supervisor = os.getpid()
    runner = os.fork()
    if runner == 0:
        try:
            os.close(request_w)
            os.close(findings_r)
            _run(request_r, findings_w, supervisor)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(70)  # _run never returns: it raised, and fd 2 says what
    os.close(request_r)
    os.close(findings_w)
    with os.fdopen(0, "rb") as stdin:
        request = json.loads(stdin.read())
    token = request.pop("token")
    try:
        _write_all(request_w, json.dumps(request).encode())
    except BrokenPipeError:
        pass  # the runner is gone already: its status says how
    os.close(request_w)
    findings, status, cut = _collect(runner, findings_r)
    header = f"acompile-probe 1 {token} {status} {int(cut)} {len(findings)}\n".encode()
    _write_all(1, header + findings)
    # Not through the interpreter's shutdown: nothing here needs it.
    os._exit(0)


def _run(request_fd: int, answer_fd: int, supervisor: int) -> None:
    """The runner: read the request, run the text, write the findings, exit."""
    from acompile import _linux

    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the supervisor's handler is not the text's
    _linux.signal_at_parent_death(signal.SIGKILL)
    if os.getppid() != supervisor:
        os._exit(1)
    # Nothing that reaches the pool stays open here: input from /dev/null, and fd 1 points at
    # fd 2, so a print in the text goes to the log and never into an answer.
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    with os.fdopen(request_fd, "rb") as f:
        request = json.loads(f.read())
    sys.path[:] = request["sys_path"]
    answer = probe(request["text"], request["filename"], request["kernel_name"])
    try:
        data = json.dumps(answer, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        data = json.dumps({"ok": False, "kind": "run", "message": f"unsendable answer: {exc}"}).encode()
    _write_all(answer_fd, data)
    sys.stdout.flush()
    sys.stderr.flush()
    # Not through the interpreter's shutdown: the text may have registered atexit hooks or
    # started threads that would keep this process alive.
    os._exit(0)


def _collect(runner: int, fd: int) -> tuple[bytes, int, bool]:
    """The runner's findings, its exit status, and whether it wrote more than ``ANSWER_LIMIT``
    (then it is killed). Read until the runner exits, not until the pipe's end: a process the
    text forked holds that end open for as long as it lives."""
    os.set_blocking(fd, False)
    chunks: list[bytes] = []
    size = 0
    status: int | None = None
    eof = False
    while True:
        if status is None:
            pid, wait_status = os.waitpid(runner, os.WNOHANG)
            if pid:
                status = os.waitstatus_to_exitcode(wait_status)
        # After the runner's exit, this takes all it wrote: its writes ended before it did.
        while not eof:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                eof = True
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > ANSWER_LIMIT:
                if status is None:
                    os.kill(runner, signal.SIGKILL)
                    status = os.waitstatus_to_exitcode(os.waitpid(runner, 0)[1])
                return b"", status, True
        if status is not None:
            return b"".join(chunks), status, False
        select.select([] if eof else [fd], [], [], 0.05)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


if __name__ == "__main__":
    main()
