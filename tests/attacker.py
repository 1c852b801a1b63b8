"""A second user on the same machine, for the tests of attacks: ``nobody``.

The tests run as root (CI does); an attack is made by a forked child that drops to ``nobody``
with ``setgid``/``setuid`` (no exec: the virtual environment may live in a folder only root can
read) and does plainly what a local attacker would: make a folder first, plant a file, listen on
a socket. Where the tests cannot drop to another user (not root, or no ``nobody``), they skip
and say why.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


def nobody() -> pwd.struct_passwd:
    """The second user, or a skip that says why there is none to be."""
    if os.geteuid() != 0:
        pytest.skip("an attack as a second user needs root to drop to nobody (these tests run as root in CI)")
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("this machine has no user nobody to attack as")


@contextlib.contextmanager
def shared_folder() -> Iterator[Path]:
    """A folder like ``/tmp`` (mode 1777: anyone may make things in it, only their owner may
    rename them), in ``/tmp`` itself: pytest's own folders are private to root, so ``nobody``
    could not reach one made there. Removed, with what was made in it, at the end."""
    nobody()
    folder = Path(tempfile.mkdtemp(prefix="acompile-attack-"))
    try:
        folder.chmod(0o1777)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _drop(user: pwd.struct_passwd) -> None:
    os.setgroups([])
    os.setgid(user.pw_gid)
    os.setuid(user.pw_uid)


def as_nobody(fn: Callable[..., Any], *args: Any, timeout: float = 60) -> Any:
    """``fn(*args)`` in a forked child that is ``nobody``; its result (JSON-able) comes back.

    An exception in the child is raised here as ``AssertionError`` with the child's traceback (an
    attack that could not even be set up is a broken test, not a pass)."""
    user = nobody()
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the attacker
        os.close(read_end)
        try:
            _drop(user)
            answer = {"ok": fn(*args)}
        except BaseException:
            answer = {"error": traceback.format_exc()}
        with os.fdopen(write_end, "w") as out:
            out.write(json.dumps(answer))
        os._exit(0)
    os.close(write_end)
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError("the attacker hung")))
    signal.alarm(int(timeout))
    try:
        with os.fdopen(read_end) as answer_file:
            text = answer_file.read()
    finally:
        signal.alarm(0)
        os.waitpid(pid, 0)
    answer = json.loads(text or '{"error": "the attacker died without an answer"}')
    if "error" in answer:
        raise AssertionError(f"the attack as nobody could not be made:\n{answer['error']}")
    return answer["ok"]


class Background:
    """An attacker that keeps running (a listener on a socket, a loop swapping a folder) while the
    test goes on; ``stop()`` (or leaving the ``with``) kills it."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        user = nobody()
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            code = 0
            try:
                _drop(user)
                fn(*args)
            except BaseException:
                traceback.print_exc()
                code = 1
            os._exit(code)

    def alive(self) -> bool:
        return os.waitpid(self.pid, os.WNOHANG) == (0, 0)

    def stop(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass

    def __enter__(self) -> Background:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
