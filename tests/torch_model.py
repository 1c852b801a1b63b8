"""A small model compiled with torch.compile in a process of its own, served by acompile as the
environment says; prints one JSON line: whether the outputs equal eager's, Inductor's own cache
counters, what was served, and the pool's cache stats.

    python tests/torch_model.py            # served: ACOMPILE_TEST_SERVE holds serve()'s options (JSON)
    python tests/torch_model.py --plain    # not served (a program that knows nothing of acompile)

Inductor's caches are where ``TORCHINDUCTOR_CACHE_DIR`` (and ``TMPDIR``, its precompiled
headers) say: tests give each process fresh ones to stand for a fresh machine.
"""

from __future__ import annotations

import json
import os
import sys
import time

T0 = time.perf_counter()

import served_options  # noqa: E402
import torch  # noqa: E402
import torch._dynamo.utils  # noqa: E402


class Small(torch.nn.Module):
    """Three C++ kernels (a fused pointwise, a reduction, the softmax) around one matmul;
    ``width`` makes another graph (tests that compile in one process use a new one each time:
    torch keeps what it compiled in memory)."""

    def __init__(self, width: int = 48) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(32, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.gelu(x @ self.w) * 1.5
        return torch.softmax(y - y.mean(-1, keepdim=True), -1)


def run(width: int = 48, device: str | None = None) -> dict[str, object]:
    """Compile and run the model (on ``device``: ``$ACOMPILE_TEST_DEVICE``, else the CPU; on a
    GPU, Inductor writes Triton kernels instead of C++)."""
    device = device or os.environ.get("ACOMPILE_TEST_DEVICE", "cpu")
    torch.manual_seed(0)
    model = Small(width).to(device)
    x = torch.randn(8, 32, device=device)
    with torch.no_grad():
        expected = model(x)
        start = time.perf_counter()
        got = torch.compile(model)(x)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    counters = torch._dynamo.utils.counters
    return {
        "ok": bool(torch.allclose(got, expected, atol=1e-5, rtol=1e-4)),
        "compile_seconds": round(seconds, 3),
        "inductor": dict(counters["inductor"]),
        "aot_autograd": dict(counters["aot_autograd"]),
    }


def main() -> None:
    if "--plain" in sys.argv:
        report = run()
    else:
        from acompile import inductor

        options = served_options.decode(os.environ.get("ACOMPILE_TEST_SERVE", "{}"))
        with inductor.serve(**options) as serving:
            # Its workers ready first: until then Inductor compiles in this process (as with its
            # own pool), and a test that counts what ran on the pool must not depend on a race.
            # ACOMPILE_TEST_WAIT=0: a program that does not ask for them.
            if os.environ.get("ACOMPILE_TEST_WAIT") != "0":
                serving.wait_ready(120)
            report = run()
            report["active"] = serving.active
        report["served"] = serving.stats()
    report["process_seconds"] = round(time.perf_counter() - T0, 3)
    print(json.dumps(report, default=str))


if __name__ == "__main__":
    main()
