"""`acompile warmup --shared-cache`: it says what reached the shared tier, and fails when the
tier it was asked to fill did not get every kernel."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, RedisServer, subprocess_env

KERNELS = """
import triton, triton.language as tl

@triton.jit
def fill_one(x_ptr, BLOCK: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, BLOCK), 1.0)
"""

MANIFEST = """
[[kernel]]
kernel = "kernels_shared_cli.py:fill_one"
signature = { x_ptr = "*fp32" }
constexprs = [{ BLOCK = 64 }, { BLOCK = 128 }]
targets = ["cuda:90"]
"""


def warmup(
    manifest: Path, cache: Path, *args: str, key: str | None = "a-test-key-of-enough-bytes"
) -> tuple[subprocess.CompletedProcess[str], dict[str, int]]:
    report = cache.parent / f"{cache.name}.json"
    command = ["warmup", str(manifest), "--cache-dir", str(cache), "--workers", "1", "--json", str(report)]
    out = subprocess.run(
        [sys.executable, "-m", "acompile", *command, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=subprocess_env(**({"ACOMPILE_SIGNING_KEY": key} if key is not None else {})),
    )
    shared = json.loads(report.read_text()).get("shared", {}) if report.exists() else {}
    return out, shared


def make_manifest(tmp_path: Path) -> Path:
    (tmp_path / "kernels_shared_cli.py").write_text(KERNELS)
    manifest = tmp_path / "m.toml"
    manifest.write_text(MANIFEST)
    return manifest


def test_warmup_reports_what_it_published_found_and_confirmed(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    manifest = make_manifest(tmp_path)
    url = redis_server.url

    first, shared = warmup(manifest, tmp_path / "a", "--shared-cache", url)
    assert first.returncode == 0, first.stdout + first.stderr
    assert (shared["kernels"], shared["published"], shared["found"], shared["missing"]) == (2, 2, 0, 0)
    assert f"shared tier {url}: 2 of 2 kernels there (0 found, 2 published)" in first.stdout
    assert "signed: namespace k" in first.stdout  # which key's namespace the fleet must read

    # Without a key the entries go where no replica with one looks: said, not hidden in a success.
    keyless, shared = warmup(manifest, tmp_path / "keyless", "--shared-cache", url, key=None)
    assert keyless.returncode == 0, keyless.stdout + keyless.stderr
    assert "unsigned namespace, which replicas with a key never read" in keyless.stderr

    # Another machine, an empty disk: both come from the shared tier.
    other, shared = warmup(manifest, tmp_path / "b", "--shared-cache", url)
    assert other.returncode == 0, other.stdout + other.stderr
    assert (shared["found"], shared["published"]) == (2, 0), shared
    assert "cached (shared)" in other.stdout

    # The first machine again: its disk answers, and the shared tier is checked all the same.
    again, shared = warmup(manifest, tmp_path / "a", "--shared-cache", url)
    assert again.returncode == 0, again.stdout + again.stderr
    assert (shared["found"], shared["published"]) == (2, 0), shared

    # The tier lost everything (a restart): the warm disk publishes it again.
    client = redis_server.client()
    client.flushall()  # type: ignore[attr-defined]
    refill, shared = warmup(manifest, tmp_path / "a", "--shared-cache", url)
    assert refill.returncode == 0, refill.stdout + refill.stderr
    assert (shared["found"], shared["published"], shared["missing"]) == (0, 2, 0), shared
    assert client.dbsize() >= 2  # type: ignore[attr-defined]


def test_warmup_fails_when_the_shared_tier_is_unreachable(tmp_path: Path) -> None:
    manifest = make_manifest(tmp_path)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"redis://:s3cret-password@127.0.0.1:{port}/0"  # a password, which is never printed

    out, shared = warmup(manifest, tmp_path / "c", "--shared-cache", url)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "2 kernels: 2 compiled, 0 cached, 0 failed" in out.stdout  # the local cache is filled
    assert shared["missing"] == 2 and shared["published"] == 0, shared
    shown = f"redis://:***@127.0.0.1:{port}/0"
    assert f"2 of 2 kernels did not reach the shared tier {shown}" in out.stderr
    assert "s3cret" not in out.stdout + out.stderr
    assert "Traceback" not in out.stderr

    lenient, shared = warmup(manifest, tmp_path / "c", "--shared-cache", url, "--no-require-shared")
    assert lenient.returncode == 0, lenient.stdout + lenient.stderr
    assert shared["missing"] == 2

    # Without a key: where the entries were to go, never that they went there.
    keyless, _ = warmup(manifest, tmp_path / "c", "--shared-cache", url, "--no-require-shared", key=None)
    assert "the entries were to go to the shared tier's unsigned namespace" in keyless.stderr
    assert "entries went" not in keyless.stderr


def test_warmup_names_why_a_shared_tier_that_cannot_work_was_not_filled(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    # A URL that parses but cannot work: database 21 of a server that has 16. The reason was in
    # one warning among the log lines; the command's own verdict did not say it.
    manifest = make_manifest(tmp_path)
    url = redis_server.url.rsplit("/", 1)[0] + "/21"
    out, shared = warmup(manifest, tmp_path / "a", "--shared-cache", url)
    assert out.returncode == 1, out.stdout + out.stderr
    verdict = [line for line in out.stderr.splitlines() if line.startswith("acompile warmup:")]
    assert verdict and re.search(r"it is off: \w+: ResponseError: DB index is out of range", verdict[-1]), (
        out.stderr
    )
    assert shared["missing"] == 2, shared
