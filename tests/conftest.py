from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # fake_backend, kernels for workers

# Tests compile for an explicit target: no GPU is needed (or assumed) for anything but `gpu` tests.
TARGET = "cuda:90"


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, object]]:
    return request.param


# For a test that takes seconds and is about something other than the event loop (a lease's
# life, a time limit's arithmetic, an entry's checks, CPU priorities): it runs on asyncio only.
# The pool's own traffic on uvloop (its workers' pipes and sockets, their deaths, cancellation)
# is shown by the tests that keep both loops. Each test that uses it says why it may.
asyncio_only = pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture(autouse=True)
def no_worker_left_behind() -> object:
    """Every test ends with no worker process of ours alive: leaving `async with` reaps them.

    A worker killed by the pool's exit may take a moment to be reaped by its template: look
    again for up to 2 s before reporting what is still there."""
    from processes import pool_processes

    yield
    deadline = time.monotonic() + 2
    while (left := pool_processes()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not left, f"worker processes left alive: {[p.pid for p in left]}"


def gpu_available() -> bool:
    try:
        from cuda.bindings import driver

        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return False
        err, count = driver.cuDeviceGetCount()
        return err == driver.CUresult.CUDA_SUCCESS and count > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any(item.get_closest_marker("gpu") for item in items) and not gpu_available():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU and driver (none here)")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a child Python that imports acompile and the tests' kernels."""
    env = dict(os.environ)
    paths = [str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    env.update(extra)
    return env


# A test's shorthand for a pool's shared tier: these keywords are SharedCache's (the names they
# had beside shared_cache before SharedCache, read as its own).
_SHARED_FIELDS = {
    "signing_key": "signing_key",
    "fleet_wait": "fleet_wait",
    "unsafe_trust_unsigned": "unsafe_trust_unsigned",
    "unsafe_unsigned_host_code": "unsafe_trust_unsigned",
}


def with_shared(where: Any, **kw: Any) -> dict[str, Any]:
    """A pool's keyword arguments: ``shared_cache=SharedCache(where, ...)`` made of the keywords
    that are SharedCache's, and the others as they are (``where`` None: no shared tier)."""
    import acompile

    if where is None:
        return kw  # (a key given without a tier: CompilePool checks it, and says it is deprecated)
    fields = {new: kw.pop(old) for old, new in _SHARED_FIELDS.items() if old in kw}
    return {"shared_cache": acompile.SharedCache(where, **fields), **kw}


def json_shared(**options: Any) -> dict[str, Any]:
    """``serve()``'s options for a machine process (JSON: ``tests/served_options.py`` reads them):
    ``shared_cache`` and the keywords that are SharedCache's folded into one table."""
    fields = {new: options.pop(old) for old, new in _SHARED_FIELDS.items() if old in options}
    if options.get("shared_cache") is not None:
        options["shared_cache"] = {"where": options["shared_cache"], **fields}
    return options  # (no tier: the fields are a test's defaults, of no use here)


def run_python(code: str, timeout: float = 180, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run Python code in a fresh interpreter (blocking: from async tests, use a thread)."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=subprocess_env(),
        cwd=cwd,
    )


class RedisServer:
    """A real redis-server on loopback, owned by the test that uses it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary is not None
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import redis

        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        client.close()

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None

    def client(self) -> object:
        import redis

        return redis.Redis(port=self.port)


@pytest.fixture
def redis_server() -> object:
    if shutil.which("redis-server") is None:
        if os.environ.get("ACOMPILE_REQUIRE_REDIS"):
            pytest.fail("redis-server is required here (ACOMPILE_REQUIRE_REDIS is set) but not installed")
        pytest.skip("redis-server is not installed (CI installs it)")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = RedisServer(port)
    server.start()
    yield server
    server.stop()


# --- faults of the disk, made for real (root: mounts) ---------------------------------------------


class Mounts:
    """Mounts a test makes, all undone at its end (a busy one lazily, so none outlives it)."""

    def __init__(self) -> None:
        self.points: list[Path] = []

    def _run(self, *args: str) -> None:
        out = subprocess.run(args, capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            pytest.skip(f"cannot mount here ({' '.join(args)}: {out.stderr.strip()})")

    def tmpfs(self, where: Path, size: str) -> None:
        where.mkdir(parents=True, exist_ok=True)
        self._run("mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where))
        self.points.append(where)

    def read_only(self, source: Path, where: Path) -> None:
        where.mkdir(parents=True, exist_ok=True)
        self._run("mount", "--bind", str(source), str(where))
        self.points.append(where)
        self._run("mount", "-o", "remount,bind,ro", str(where))

    def undo(self) -> None:
        for point in reversed(self.points):
            if subprocess.run(["umount", str(point)], capture_output=True, timeout=30).returncode != 0:
                subprocess.run(["umount", "-l", str(point)], capture_output=True, timeout=30)
        mounted = Path("/proc/self/mounts").read_text()
        assert not [p for p in self.points if f" {p} " in mounted], "a mount outlived its test"


@pytest.fixture
def mounts() -> Iterator[Mounts]:
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only folder or a small tmpfs needs root")
    made = Mounts()
    try:
        yield made
    finally:
        made.undo()


def fill(folder: Path, leave: int) -> None:
    """Fill the filesystem of folder, then give back `leave` bytes of room."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        chunk = b"\0" * 65536
        size = 0
        while True:
            try:
                size += os.write(fd, chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                break
        os.ftruncate(fd, max(0, size - leave))
    finally:
        os.close(fd)


# --- an S3-compatible server on loopback (moto's server mode), started by the tests --------------

S3_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "test-access-key",
    "AWS_SECRET_ACCESS_KEY": "test-secret-key-never-printed",
    "AWS_EC2_METADATA_DISABLED": "true",
}


class S3Server:
    """A real S3-compatible server process on loopback (moto's server mode: HTTP, conditional
    writes), owned by the test or module that uses it."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None
        self._buckets = 0

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **S3_CREDENTIALS},
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=1).read()
                return
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait(timeout=10)
            self.process = None

    def bucket(self) -> str:
        """A new, empty bucket's name."""
        self._buckets += 1
        name = f"fleet-{self._buckets}-{os.getpid()}"
        urllib.request.urlopen(
            urllib.request.Request(f"{self.endpoint}/{name}", method="PUT"), timeout=10
        ).read()
        return name

    def url(self, bucket: str, prefix: str = "acompile", **options: str) -> str:
        query = "&".join(
            f"{k}={v}"
            for k, v in {
                "endpoint": self.endpoint,
                "allow_http": "true",
                "region": "us-east-1",
                **options,
            }.items()
        )
        return f"s3://{bucket}/{prefix}?{query}"

    def client(self, bucket: str) -> Any:
        """A client of the bucket of the test's own (obstore's, synchronous), beside acompile's."""
        from obstore.store import S3Store

        return S3Store(
            bucket,
            endpoint=self.endpoint,
            region="us-east-1",
            access_key_id=S3_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            secret_access_key=S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            client_options={"allow_http": True},
        )

    def keys(self, bucket: str) -> list[str]:
        """Every object's key in ``bucket``."""
        import obstore

        return sorted(item["path"] for chunk in obstore.list(self.client(bucket)) for item in chunk)

    def put(self, bucket: str, key: str, data: bytes) -> None:
        import obstore

        obstore.put(self.client(bucket), key, data)

    def get(self, bucket: str, key: str) -> bytes:
        import obstore

        return bytes(obstore.get(self.client(bucket), key).bytes())


def _s3_or_skip() -> None:
    import importlib.util

    if importlib.util.find_spec("moto") is None or importlib.util.find_spec("obstore") is None:
        if os.environ.get("ACOMPILE_REQUIRE_REDIS"):  # CI: every service the tests need is there
            pytest.fail("moto[server] and obstore are required here (the dev extra) but not installed")
        pytest.skip("moto[server] or obstore is not installed (the dev extra installs them)")


@pytest.fixture
def s3_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    """A server of the test's own (one it may kill or stop), and the credentials in the
    environment as the AWS SDKs read them."""
    _s3_or_skip()
    for name, value in S3_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    server = S3Server()
    server.start()
    yield server
    server.stop()
