"""The parent half the backend registry names for ``preload=("inductor",)``: a pool whose
workers compile for torch.compile imports torch in its template (once, before workers fork),
not in each worker at its first job. Its jobs come from ``_served`` (Inductor's own compile
functions), never from a spec: there is nothing to key, load or cache here."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:
    from acompile._targets import Target
    from acompile._workers import BackendConfig

WORKER_MODULE = "acompile._torch._worker"


async def setup(memo_dir: Path, target: Target | None) -> None:
    """Import torch and Inductor's compile modules here too (in a thread): the served code
    needs them in this process, and not on the loop."""
    await anyio.to_thread.run_sync(_import)


def _import() -> None:
    import torch._inductor.async_compile
    import torch._inductor.codecache  # noqa: F401


async def worker_config(memo_dir: Path) -> BackendConfig:
    """Nothing: each job carries what the worker needs (``_served.Served.encode_job``)."""
    return {}
