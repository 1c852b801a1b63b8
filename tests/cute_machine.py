"""One "machine" of the CuTe DSL tests: a fresh process that builds and loads the tests' CuTe DSL
kernel (``served_cute_kernel.build()``, through FlashInfer's ``build_and_load_cute_dsl_kernel``)
while acompile serves FlashInfer, and prints a JSON report on its last line of stdout.

argv[1]: the serve() options as JSON (``{}``: not served); argv[2]: the folder this machine
imports ``served_cute_kernel`` from (``$KERNEL_MODULE``: the module's name, if another). Its home, FlashInfer workspace and acompile cache folder
come from its environment.
"""

from __future__ import annotations

import json
import sys
import time

import served_options


def main() -> None:
    options = served_options.decode(sys.argv[1])
    sys.path.insert(0, sys.argv[2])
    from acompile import inductor

    serving = inductor.serve(**options) if options else None
    report: dict[str, object] = {}
    try:
        if serving is not None:
            serving.__enter__()
        import importlib
        import os

        served_cute_kernel = importlib.import_module(os.environ.get("KERNEL_MODULE", "served_cute_kernel"))
        if os.environ.get("EDIT_AFTER_IMPORT") == "1":
            # The file is changed after the module was imported (a checkout pulled under a
            # running server): what this process compiles is the module as it was.
            later = time.time() + 30
            os.utime(served_cute_kernel.__file__, (later, later))

        started = time.perf_counter()
        kernel = served_cute_kernel.build()
        report["seconds"] = time.perf_counter() - started
        report["loaded"] = type(kernel).__name__
        report["compiles"] = len(served_cute_kernel.COMPILES)
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        served_options.leave(serving, report, "flashinfer")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
