"""Run a kernel source string in a short-lived process and report what the pool needs to key it.

A source string's top-level code is arbitrary user code: it may sleep, loop forever, import
torch or fill memory. Run in the pool's own process it would hold a thread (and the GIL) that
no deadline can take back, and every other request would wait behind it. Run here, it is a
process that the caller's cancellation kills.

``python -m acompile._backends._triton_probe``: reads one pickled request on stdin (the text, its
file name, the kernel's name, the parent's ``sys.path``), writes one pickled answer on stdout: the
JIT functions the text defines and, for the kernel asked for, its name, Triton's cache key and its
parameters (defaults included). fd 1 points at fd 2 while the text runs, so a print in it cannot
corrupt the answer.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from typing import Any

from acompile._errors import bounded


def probe(text: str, filename: str, kernel_name: str | None) -> dict[str, Any]:
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

    found = sorted(k for k, v in namespace.items() if isinstance(v, JITFunction))
    if kernel_name is None and len(found) == 1:
        kernel_name = found[0]
    fn = namespace.get(kernel_name) if kernel_name is not None else None
    if not isinstance(fn, JITFunction):
        return {"ok": True, "found": found, "kernel": None}
    params = []
    for p in fn.params:
        default: Any = None
        shippable = True
        if p.has_default:
            try:
                default = pickle.loads(pickle.dumps(p.default))
            except Exception:
                shippable = False
        params.append((p.name, bool(p.is_constexpr), bool(p.has_default) and shippable, default))
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


def _die_with_parent(parent_pid: int) -> None:
    """Go when the pool's process dies, even by SIGKILL: no text runs on as an orphan."""
    import signal

    from acompile._workers import _linux

    _linux.signal_at_parent_death(signal.SIGKILL)
    if parent_pid and os.getppid() != parent_pid:
        os._exit(1)


def main() -> None:
    _die_with_parent(int(os.environ.get("ACOMPILE_PARENT_PID", "0")))
    answer_fd = os.dup(1)
    os.dup2(2, 1)
    with os.fdopen(0, "rb") as stdin:
        request = pickle.load(stdin)
    sys.path[:] = request["sys_path"]
    answer = probe(request["text"], request["filename"], request["kernel_name"])
    try:
        data = pickle.dumps(answer)
    except Exception as exc:
        data = pickle.dumps({"ok": False, "kind": "run", "message": f"unpicklable answer: {exc}"})
    with os.fdopen(answer_fd, "wb") as out:
        out.write(data)
    sys.stdout.flush()
    sys.stderr.flush()
    # Not through the interpreter's shutdown: the text may have registered atexit hooks or
    # started threads that would keep this process alive.
    os._exit(0)


if __name__ == "__main__":
    main()
