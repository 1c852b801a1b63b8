"""One "machine" of the JIT tests: a fresh process that builds a torch C++ extension with
``torch.utils.cpp_extension.load`` while acompile serves it, calls the library, and prints a JSON
report (the answer, what was served) on its last line of stdout.

argv: the serve() options as JSON (``{}``: not served), then the source file, then -D flags'
value of ANSWER, then the include folder ("" for none). Everything else a machine has of its own
(``TORCH_EXTENSIONS_DIR``, ``ACOMPILE_CACHE_DIR``, ``HOME``) comes from its environment.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time

import served_options


def main() -> None:
    options = served_options.decode(sys.argv[1])
    source, answer, include = sys.argv[2], sys.argv[3], sys.argv[4]
    from acompile import inductor

    serving = inductor.serve(**options) if options else None
    report: dict[str, object] = {}
    try:
        if serving is not None:
            serving.__enter__()
            serving.wait_ready(120)
        from torch.utils import cpp_extension

        started = time.perf_counter()
        path = cpp_extension.load(
            "answer_ext",
            [source],
            extra_cflags=[f"-DANSWER={answer}"],
            extra_include_paths=[include] if include else None,
            is_python_module=False,
        )
        report["seconds"] = time.perf_counter() - started
        library = os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "answer_ext", "answer_ext.so")
        report["answer"] = ctypes.CDLL(library).answer()
        report["path"] = str(path)
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        served_options.leave(serving, report, "cpp_extension")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
