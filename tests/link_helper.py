"""A helper process for tests of ``acompile._workers.LinkedExecutor``: jobs over its pipes.

It reads one JSON request a line on stdin and writes one JSON reply a line on stdout: a hello
first (``{"kind": "hello", "pid", "size": 1}``), a beat every 0.2 s, and for each
``{"op": "submit", "id", "value", "seconds"}`` a ``done`` reply with the value after that many
seconds (``cancel`` drops a job). Real pipes, a real process to kill or stop: only what it
computes is trivial.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

lock = threading.Lock()
cancelled: set[int] = set()


def say(message: dict[str, object]) -> None:
    with lock:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()


def run(job: dict[str, object]) -> None:
    time.sleep(float(job.get("seconds", 0)))  # type: ignore[arg-type]
    if job["id"] not in cancelled:
        say({"kind": "done", "id": job["id"], "value": job["value"], "pid": os.getpid()})


def beat() -> None:
    while True:
        time.sleep(0.2)
        say({"kind": "beat"})


def main() -> None:
    say({"kind": "hello", "pid": os.getpid(), "size": 1})
    threading.Thread(target=beat, daemon=True).start()
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "submit":
            threading.Thread(target=run, args=(request,), daemon=True).start()
        elif request["op"] == "cancel":
            cancelled.add(request["id"])


if __name__ == "__main__":
    main()
