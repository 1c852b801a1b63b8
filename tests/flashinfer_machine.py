"""One "machine" of the FlashInfer tests: a fresh process that builds and loads FlashInfer's
``silu_and_mul`` module (``gen_act_and_mul_module("silu").build_and_load()``, as FlashInfer does at
first use) while acompile serves it, and prints a JSON report on its last line of stdout.

argv[1]: the serve() options as JSON (``{}``: not served). Everything else a machine has of its own
(``FLASHINFER_WORKSPACE_BASE``, ``HOME``, ``ACOMPILE_CACHE_DIR``, the nvcc launcher that counts
compiles) comes from its environment.
"""

from __future__ import annotations

import json
import sys
import time

import served_options


def main() -> None:
    options = served_options.decode(sys.argv[1])
    from acompile import inductor

    serving = inductor.serve(**options) if options else None
    report: dict[str, object] = {}
    try:
        if serving is not None:
            serving.__enter__()
        from flashinfer.jit.activation import gen_act_and_mul_module

        spec = gen_act_and_mul_module("silu")
        started = time.perf_counter()
        module = spec.build_and_load()
        report["seconds"] = time.perf_counter() - started
        report["loaded"] = module is not None
        report["library"] = str(spec.jit_library_path)
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        served_options.leave(serving, report, "flashinfer")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
