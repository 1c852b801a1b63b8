"""torch's extension entry point costs a process that acompile does not serve one small module.

torch imports every ``torch.backends`` entry point as it is imported, in every process of the
environment, served or not. acompile's is ``_acompile_autoload``, outside the package: importing
any module of ``acompile`` would import its public names, the pool and the cache tiers with them
(a third of a second, and 120 modules, at each ``import torch``). Counted in modules, not timed.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import subprocess_env

pytest.importorskip("torch")

_LIST = "import sys, torch; print('\\n'.join(sorted(sys.modules)))"


def _modules(**env: str) -> set[str]:
    done = subprocess.run(
        [sys.executable, "-c", _LIST], capture_output=True, text=True, env=subprocess_env(**env), check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return set(done.stdout.split())


def test_import_torch_imports_one_module_of_acompiles_where_nothing_is_served() -> None:
    from importlib.metadata import entry_points

    assert [e.value for e in entry_points(group="torch.backends") if e.name == "acompile"] == [
        "_acompile_autoload:autoload"
    ]
    with_entry_point = _modules()
    without = _modules(TORCH_DEVICE_BACKEND_AUTOLOAD="0")  # torch loads no extension at all
    assert with_entry_point - without == {"_acompile_autoload"}


def test_a_served_process_still_imports_what_serves_it() -> None:
    """Where ``acompile run`` asks (the variable set), the entry point hands over to acompile."""
    code = (
        "import sys, torch\n"
        "from acompile._torch import _autoload\n"
        "print(_autoload._serve_torch is not None, 'acompile.inductor' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=subprocess_env(ACOMPILE_SERVE_TORCH='{"workers": 1}'),
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True"], done.stdout + done.stderr
