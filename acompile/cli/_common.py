"""What the commands of ``acompile`` share: the options several take, the log lines and the
progress bar that share stderr, and the checks made before any work (a shared cache URL, the
signing key, a file a command writes)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

CACHE_DIR_HELP = "default: $ACOMPILE_CACHE_DIR, else $XDG_CACHE_HOME/acompile, else ~/.cache/acompile"


def positive_int(text: str) -> int:
    """An argparse type: a count of at least 1 (argparse's own message names the option)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_cache_dir(parser: argparse.ArgumentParser) -> None:
    """The ``--cache-dir`` option."""
    parser.add_argument("--cache-dir", type=Path, default=None, help=CACHE_DIR_HELP)


def add_workers(parser: argparse.ArgumentParser) -> None:
    """The ``--workers`` option."""
    parser.add_argument(
        "--workers", type=positive_int, default=None, help="worker processes (default: usable CPUs)"
    )


@contextlib.contextmanager
def whole_log_lines() -> Iterator[None]:
    """The ``acompile`` logger's records as whole lines on stderr, each after any progress bar
    line in progress (which would otherwise cut it, or be cut by it, mid-line)."""
    logger = logging.getLogger("acompile")
    if logger.handlers:  # configured by whoever called us: theirs to format
        yield
        return
    handler = _LineHandler()
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


class _LineHandler(logging.StreamHandler):  # type: ignore[type-arg]
    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("acompile: %(levelname)s: %(message)s"))
        self.setLevel(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        Progress.end_line()
        super().emit(record)


class Progress:
    """A one-line progress bar on a terminal; elsewhere (CI logs), a line per tenth of the work
    once the work has taken a second, and the last: a warm-up served from the cache in
    milliseconds writes one line, not eleven."""

    # The bar being drawn on the terminal, if any: a log line must first end it (_LineHandler).
    _open: Progress | None = None

    def __init__(self, total: int, out: TextIO) -> None:
        self.total, self.out = total, out
        self.counts: Counter[str] = Counter()
        self.tty = out.isatty()
        self.t0 = time.perf_counter()
        self._last_decile = -1

    def advance(self, result: str) -> None:
        self.counts[result] += 1
        done = sum(self.counts.values())
        width = 30
        filled = width * done // max(1, self.total)
        c = self.counts
        line = (
            f"[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total}  compiled {c['compiled']}"
            f"  cached {c['cached']}  failed {c['failed']}  {time.perf_counter() - self.t0:.1f}s"
        )
        if self.tty:
            self.out.write("\r" + line)
            Progress._open = self
        elif (decile := 10 * done // max(1, self.total)) != self._last_decile and (
            done == self.total or time.perf_counter() - self.t0 >= 1.0
        ):
            self._last_decile = decile
            self.out.write(line + "\n")
        self.out.flush()

    @classmethod
    def end_line(cls) -> None:
        """End the bar's line, so that what is written next starts a line of its own (the bar
        starts a new line at its next step)."""
        bar, cls._open = cls._open, None
        if bar is not None:
            bar.out.write("\n")
            bar.out.flush()

    def close(self) -> None:
        if Progress._open is self:
            Progress.end_line()


def shown(url: str) -> str:
    """A shared cache URL as it may be printed: its password, if any, never is."""
    from acompile._cache import redact_url

    return redact_url(url)


def signing_key_error() -> str | None:
    """What is wrong with ``$ACOMPILE_SIGNING_KEY`` (set but empty, too short), or None where it
    is a usable key or unset."""
    from acompile._cache import signing_key_from

    try:
        signing_key_from(None)
    except ValueError as exc:
        return str(exc)
    return None


def signing_key_problem() -> str | None:
    """Why there is no usable signing key in the environment, or None where there is one."""
    from acompile._cache import signing_key_from

    try:
        return None if signing_key_from(None) is not None else "not set"
    except ValueError as exc:
        return str(exc)


def output_path_problem(path: Path) -> str | None:
    """Why a file a command writes (a report, a bundle) cannot be written at path, as far as
    can be told before the work; None if nothing is wrong (the write can still fail: a full
    disk). A missing folder is not made: a mistyped path would make folders nobody asked for.
    A link another user placed there, or a file another user owns, is refused: nothing is
    written through the one or into the other."""
    from acompile._outputs import own_file_problem

    folder = path.parent
    if path.is_dir():
        return "it is a folder: name a file"
    if problem := own_file_problem(path):
        return problem
    if not folder.exists():
        return f"there is no folder {folder} (create it first)"
    if not folder.is_dir():
        return f"{folder} is not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"the folder {folder} cannot be written by this user"
    return None


_SHARED_URL_FORMS = (
    "redis://HOST:PORT/DB (e.g. redis://cache.internal:6379/0), rediss://..., memcached://HOST:PORT, "
    "s3://BUCKET/PREFIX (gs://, az://) or file:///SHARED/FOLDER; several, separated by spaces, are a "
    "chain, fastest first"
)


def shared_places(value: str) -> str | list[str]:
    """``--shared-cache``'s value as ``SharedCache`` takes it: one URL, or several separated by
    spaces (``"redis://cache:6379/0 s3://bucket/acompile"``: a chain, fastest first)."""
    urls = value.split()
    return urls if len(urls) > 1 else value.strip()


def shared_url_problem(url: str) -> str | None:
    """What is wrong with a shared-cache URL (or several, separated by spaces), before any client
    is imported; None if nothing. The pool's own check (its constructor makes it; its message
    names the URL, its secret hidden), with the forms a good URL takes where that message gives
    none."""
    from acompile._cache import SharedCache

    if not url.split():
        return f"no URL given; use {_SHARED_URL_FORMS}"
    try:
        SharedCache(shared_places(url), signing_key=b"\0" * 16)  # the URLs' check, not the key's
    except (ValueError, TypeError) as exc:
        text = str(exc)
        return text if ": use " in text or ": write " in text else f"{text}; use {_SHARED_URL_FORMS}"
    return None
