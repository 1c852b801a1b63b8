"""``WorkerConfig``: what a pool's worker processes are started with, one typed dict.

It crosses into the worker as data (the pool's framed protocol, a fork's message), so it is a
``TypedDict``: a plain dict at run time, every key named and typed for the type checker, in the
pool, the template, the worker's loop and each backend's worker half alike. Who fills what:

* the pool's owner (``CompilePool``, a farm's actor): ``sys_path``, ``cwd``, ``target``,
  ``preload``, ``nice``, ``bytecode_dir``, ``bytecode_helpers``;
* the backends' parent halves, once per machine (``ParentBackend.worker_config``, a
  ``BackendConfig``): ``triton_key``, ``torch_cache_root``;
* the pool: ``late_config`` and ``late_config_timeout`` (where a worker that started before the
  backends' part was ready finds it: ``_late``), ``env``;
* each slot: ``triton_cache_dir``, ``scratch_dir``, ``stderr_path``;
* the template, for a worker it forks: ``template_pid``, ``address``, ``token``.
"""

from __future__ import annotations

from typing import TypedDict


class BackendConfig(TypedDict, total=False):
    """What the backends' parent halves compute for their workers (once per machine)."""

    # Triton's key of its own binaries (a hash of hundreds of MB: computed once, not per worker).
    triton_key: str
    # Where torch.compile's served caches put what they fetch, in the worker.
    torch_cache_root: str


class WorkerConfig(BackendConfig, total=False):
    """Everything a worker (or the template) is started with; see the module's docstring."""

    sys_path: list[str]
    cwd: str
    target: str
    preload: list[str]
    nice: int | str
    bytecode_dir: str | None
    bytecode_helpers: str
    late_config: str
    late_config_timeout: float
    env: dict[str, str]
    triton_cache_dir: str
    scratch_dir: str
    stderr_path: str
    template_pid: int
    address: str
    token: str
