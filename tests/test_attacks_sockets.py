"""Attacks on the pool's work folders and sockets, made by a second user (``nobody``, see
``attacker``) against real pools: their processes, their sockets, their files.

Each test makes one attack of the round that found them: a folder made first where an actor's
work folder was to be, a link in place of a worker's stderr file, a stranger's pickle on the
template's socket, a listener of another user where a forked worker connects. The pool must
refuse each, touch nothing of the attacker's, and go on working. A pickle sent by the attacker
makes a folder where only this user can (``tmp_path``) as it is unpickled: its absence is the
proof that nothing ran it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
from attacker import Background, as_nobody, nobody, shared_folder
from conftest import ROOT, TARGET
from fake_backend import local_executor
from processes import forked_and_fresh, until

import acompile
from acompile._workers import WorkerPool, WorkerSettings, encode_frame
from acompile._workers._protocol import HELLO, peer_uid
from acompile.testing import run_job

pytestmark = pytest.mark.anyio
FAKE = "fake_backend"
DEAD_PID = 99_999_999  # past any pid_max: no process has it
asyncio_only = pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])


def pool(cache_dir: Path, workers: int = 1, **kw: Any) -> acompile.CompilePool:
    return acompile.CompilePool(workers, target=TARGET, cache_dir=cache_dir, preload=(), **kw)


class Unpickled:
    """A pickle that makes the folder ``path`` as it is unpickled: whoever unpickles it runs
    what it was sent."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.path,))


@pytest.fixture
def theirs() -> Iterator[Path]:
    """A folder of nobody's in /tmp (mode 755), for what the attacker makes and reports."""
    user = nobody()
    folder = Path(tempfile.mkdtemp(prefix="acompile-attacker-"))
    os.chown(folder, user.pw_uid, user.pw_gid)
    os.chmod(folder, 0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A temporary folder for all, as /tmp is (root's, mode 1777), that nobody else uses: where
    a farm actor makes its work folder in these tests."""
    nobody()
    folder = Path(tempfile.mkdtemp(prefix="acompile-shared-tmp-"))
    os.chmod(folder, 0o1777)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _listing(folder: Path) -> dict[str, tuple[int, int, str]]:
    """What is in ``folder`` (recursively): each entry's owner, mode, and link target or
    content, to see that nothing of it was touched."""
    found = {}
    for path in sorted(folder.rglob("*")):
        info = path.lstat()
        if path.is_symlink():
            what = "-> " + os.readlink(path)
        elif path.is_file():
            what = path.read_text()
        else:
            what = "folder"
        found[str(path.relative_to(folder))] = (info.st_uid, stat.S_IMODE(info.st_mode), what)
    return found


# --- the attacker's side (run as nobody) ----------------------------------------------------------


def _send_first(address: str, frame: bytes, report: str) -> None:
    """Connect to ``address``, send ``frame`` first, and say how the other end answered."""
    said = "connected"
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(20)
        sock.connect(address)
        sock.sendall(frame)
        said = "closed" if sock.recv(4096) == b"" else "answered"
    except (BrokenPipeError, ConnectionResetError):
        said = "closed"  # before it read all of it
    except OSError as exc:
        said = f"{type(exc).__name__}: {exc}"
    with open(report, "w") as out:
        out.write(said)


def _listen(address: str, frame: bytes, report: str) -> None:
    """Listen at ``address``; record what each connector sends first (in hex, a line each: empty
    where it sent nothing), then send it ``frame``."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(address)
    os.chmod(address, 0o777)
    server.listen(8)
    while True:
        connection, _ = server.accept()
        connection.settimeout(2)
        try:
            got = connection.recv(65536)
        except OSError:
            got = b""
        with open(report, "a") as out:
            out.write(got.hex() + "\n")
        try:
            connection.sendall(frame)
            while connection.recv(65536):  # until the connector leaves: it has all of the frame
                pass
        except OSError:
            pass
        connection.close()


def _plant_links(folder: str, target: str) -> None:
    """A folder open to all in /tmp whose stderr files are links to ``target``."""
    os.chmod(folder, 0o777)
    for name in ("worker-0.stderr", "template.stderr"):
        os.symlink(target, os.path.join(folder, name))


def _make_old_farm_folder(shared: str, uid: int) -> str:
    """The folder farm actors of user ``uid`` shared, by its old predictable name, made first
    (mode 777)."""
    parent = os.path.join(shared, f"acompile-farm-{uid}")
    os.mkdir(parent)
    os.chmod(parent, 0o777)
    return parent


def _make_folder(path: str, content: str) -> None:
    os.mkdir(path)
    with open(os.path.join(path, "file"), "w") as out:
        out.write(content)


# --- the template's socket ------------------------------------------------------------------------


async def test_a_stranger_on_the_template_socket_is_never_unpickled(
    cache_dir: Path, tmp_path: Path, theirs: Path
) -> None:
    """A connector's first bytes are not unpickled: the pool accepts only a process of this user,
    and reads its hello (no pickle) and token first. Here the socket is made reachable, as it
    was where its folder was another user's: nobody connects and sends a pickle, and so does a
    process of this user; neither is unpickled, and the pool goes on forking workers."""
    marker = tmp_path / "unpickled"
    frame = encode_frame(Unpickled(marker))
    report = theirs / "report"
    async with pool(cache_dir) as p:
        await p.wait_ready()
        workers = local_executor(p)
        template = workers.runners.template
        assert template is not None
        os.chmod(workers.workdir, 0o711)
        os.chmod(template.address, 0o777)
        with Background(_send_first, template.address, frame, str(report)) as attacker:
            await until(lambda: not attacker.alive(), 30)
        said = report.read_text()
        assert not marker.exists(), "the pool unpickled a stranger's first frame"
        assert said == "closed", said

        # A process of this user that does not say hello is not unpickled either.
        def send_as_this_user() -> bytes:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(20)
                sock.connect(template.address)
                sock.sendall(frame)
                try:
                    return sock.recv(4096)
                except ConnectionResetError:
                    return b""

        assert await anyio.to_thread.run_sync(send_as_this_user) == b""
        assert not marker.exists(), "the pool unpickled a first frame that was not a hello"

        # The listener still serves the workers it forks.
        first = await run_job(p, FAKE, {"name": "a", "action": "pid"}, "a")
        os.kill(first, signal.SIGKILL)
        second = first
        with anyio.fail_after(30):
            while second == first:
                second = await run_job(p, FAKE, {"name": "b", "action": "pid"}, "b")
        assert p.stats()["workers"]["forked"] >= 2


async def test_the_workers_socket_closes_another_users_connection_unread(
    theirs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The workers' socket takes a connection of this user only (``SO_PEERCRED``), before a byte
    of it is read: here its folder lets anyone reach it, and nobody connects first with what a
    forked worker would send. The pool never sees that connection (the token check behind it
    never runs); it sees this user's, which came after."""
    from acompile._workers._template import UnixListener

    with shared_folder() as folder:
        address = folder / "workers.sock"
        listener = UnixListener(str(address))
        os.chmod(address, 0o777)
        report = theirs / "report"
        accepted: list[Any] = []
        try:
            async with anyio.create_task_group() as tg:

                async def accept() -> None:
                    accepted.append(await listener.accept())

                tg.start_soon(accept)
                with Background(_send_first, str(address), b"\0" * HELLO.size, str(report)) as attacker:
                    await until(lambda: not attacker.alive(), 30)
                assert report.read_text() == "closed" and not accepted
                mine = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                mine.connect(str(address))
                try:
                    await until(lambda: bool(accepted), 10)
                finally:
                    mine.close()
        finally:
            await listener.aclose()
    (incoming,) = accepted
    assert peer_uid(incoming.socket) == os.getuid()
    incoming.socket.close()
    assert "from a process of uid" in caplog.text


async def test_the_host_pools_socket_closes_another_users_connection_unread(
    tmp_path: Path, theirs: Path
) -> None:
    """The host pool's server (``inductor.serve(host_pool=True)``) runs the jobs its clients
    send, pickles and all: it serves a process of this user only (``SO_PEERCRED``), before a
    byte is read or sent. Here its socket is made reachable: nobody connects and is closed on,
    never greeted; a process of this user is greeted."""
    from acompile._torch import _hostpool

    def open_pool(workers: int | None, **kw: Any) -> acompile.CompilePool:
        return acompile.CompilePool(1, target=TARGET, cache_dir=kw["cache_dir"], preload=())

    report = theirs / "report"
    with shared_folder() as folder:
        path = folder / "pool.sock"
        async with anyio.create_task_group() as tg:
            tg.start_soon(_hostpool.serve, open_pool, tmp_path / "c", path, 1, 600.0)
            await until(lambda: path.exists() and stat.S_IMODE(path.stat().st_mode) == 0o600, 60)
            os.chmod(path, 0o777)
            with Background(_send_first, str(path), b"\0" * 64, str(report)) as attacker:
                await until(lambda: not attacker.alive(), 30)
            assert report.read_text() == "closed"

            def greeted() -> bytes:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                    sock.settimeout(20)
                    sock.connect(str(path))
                    return sock.recv(4096)

            assert b"hello" in await anyio.to_thread.run_sync(greeted)
            tg.cancel_scope.cancel()


@pytest.mark.parametrize("where", ["their folder", "moved into ours"])
async def test_a_worker_refuses_a_listener_of_another_user(
    cache_dir: Path, tmp_path: Path, theirs: Path, where: str
) -> None:
    """A forked worker sends its token to, and unpickles from, only a listener of this user in
    its own private folder. Here its pool's address is nobody's listener: in nobody's folder
    (the folder is refused), or moved into a private folder of ours (the listener's user is
    refused). The worker exits without a hello, saying why; nothing nobody sent is unpickled."""
    marker = tmp_path / "unpickled"
    report = theirs / "report"
    address = theirs / "workers-1.sock"
    with Background(_listen, str(address), encode_frame(Unpickled(marker)), str(report)):
        await until(address.exists)
        if where == "moved into ours":
            private = tmp_path / "private"
            private.mkdir(mode=0o700)
            address.rename(private / "workers-1.sock")  # still nobody's listener
            address = private / "workers-1.sock"
        async with pool(cache_dir) as p:
            await p.wait_ready()
            workers = local_executor(p)
            template = workers.runners.template
            assert template is not None
            # The forked worker's stderr file, made where the pool makes its workers' own.
            stderr_path = os.path.join(workers.workdir, "worker-7.stderr")
            os.close(os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            error: Exception | None = None
            ours, template.address = template.address, str(address)
            try:
                with anyio.move_on_after(15):
                    await template.fork(7, {"stderr_path": stderr_path})
            except acompile.WorkerStartError as exc:
                error = exc
            finally:
                template.address = ours
            assert not marker.exists(), "a forked worker unpickled what another user's listener sent"
            # Connected (to learn whose the listener is), the worker sent nothing: no hello, no token.
            sent = report.read_text().split() if report.exists() else []
            assert sent == [], "the worker said hello to another user"
            why = "belongs to nobody" if where == "their folder" else "is served by nobody"
            assert error is not None and why in str(error), error
            # Its pool goes on.
            assert await run_job(p, FAKE, {"name": "a", "action": "echo", "value": 1}, "a") == 1


# --- work folders and their files -----------------------------------------------------------------


@asyncio_only
async def test_a_work_folder_of_another_user_is_refused_and_nothing_in_it_followed(
    tmp_path: Path,
) -> None:
    """A pool whose work folder is nobody's (open to all, its stderr files links to a file of
    ours) starts no worker: it says whose the folder is, truncates nothing through the links,
    and leaves the folder as nobody made it (no chmod)."""
    precious = tmp_path / "precious"
    precious.write_text("precious")
    folder = Path(tempfile.mkdtemp(prefix="acompile-theirs-"))
    user = nobody()
    os.chown(folder, user.pw_uid, user.pw_gid)
    try:
        as_nobody(_plant_links, str(folder), str(precious))
        before = _listing(folder)
        workers = WorkerPool(1, WorkerSettings(nice=0), str(folder))
        async with anyio.create_task_group() as tg:
            tg.start_soon(workers.serve)
            with anyio.fail_after(30), pytest.raises(acompile.WorkerStartError) as caught:
                await workers.wait_ready()
            tg.cancel_scope.cancel()
        assert precious.read_text() == "precious"
        assert str(folder) in str(caught.value) and "nobody" in str(caught.value), caught.value
        assert _listing(folder) == before
        info = os.lstat(folder)
        assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (user.pw_uid, 0o777)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@asyncio_only
@forked_and_fresh
async def test_a_link_in_place_of_a_stderr_file_is_replaced_not_followed(
    cache_dir: Path, tmp_path: Path, fork_workers: bool
) -> None:
    """The pool makes a replaced worker's stderr file anew and opens nothing through a link:
    a link found in its place (as the attack left in a swapped folder) is not followed, and the
    file it points to keeps its content."""
    precious = tmp_path / "precious"
    precious.write_text("precious")
    async with pool(cache_dir, fork_workers=fork_workers) as p:
        first = await run_job(p, FAKE, {"name": "a", "action": "pid"}, "a")
        stderr = Path(local_executor(p).workdir) / "worker-0.stderr"
        stderr.unlink()
        stderr.symlink_to(precious)
        os.kill(first, signal.SIGKILL)
        second = first
        with anyio.fail_after(60):
            while second == first:
                second = await run_job(p, FAKE, {"name": "b", "action": "pid"}, "b")
        assert precious.read_text() == "precious"
        assert stat.S_ISREG(stderr.lstat().st_mode)


def test_a_farm_actor_makes_a_private_folder_of_its_own_and_cleans_only_its_own(
    shared_tmp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folder farm actors shared had a name anyone could guess: nobody made it first and
    could swap an actor's folder in it. An actor now makes a private folder of its own in the
    temporary folder, with a name nobody can guess; the folders of dead actors it removes are
    this user's folders only, never another's nor a link."""
    from acompile._farm._actor import _make_workdir

    monkeypatch.setattr(tempfile, "tempdir", str(shared_tmp))
    old = Path(as_nobody(_make_old_farm_folder, str(shared_tmp), os.getuid()))
    as_nobody(_make_folder, str(old / f"{DEAD_PID}-x"), "theirs")
    as_nobody(_make_folder, str(shared_tmp / f"acompile-farm-{os.getuid()}-{DEAD_PID}-theirs"), "theirs")
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "file").write_text("ours")
    (shared_tmp / f"acompile-farm-{os.getuid()}-{DEAD_PID}-link").symlink_to(keep)
    dead = shared_tmp / f"acompile-farm-{os.getuid()}-{DEAD_PID}-ours"
    dead.mkdir(mode=0o700)
    before = _listing(shared_tmp)
    made = Path(_make_workdir())
    try:
        assert made.parent == shared_tmp, made
        info = made.lstat()
        assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
        assert stat.S_IMODE(info.st_mode) == 0o700
        # Nobody's folders, theirs by the old name and theirs by the new, and the link: untouched.
        after = _listing(shared_tmp)
        del before[dead.name]
        assert {k: v for k, v in after.items() if not k.startswith(made.name)} == before
        assert (keep / "file").read_text() == "ours"
        assert not dead.exists()  # a dead actor's folder of ours is removed
    finally:
        shutil.rmtree(made, ignore_errors=True)


def test_a_dead_pool_s_work_folder_is_removed_only_if_it_is_this_user_s(
    theirs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A template or spawned worker whose pool was killed removes the pool's work folder: only
    where that folder is this user's (not another user's folder in its place, not a link)."""
    from acompile._workers._main import _remove_work_folder_of_a_dead_pool

    as_nobody(_make_folder, str(theirs / "work"), "theirs")
    monkeypatch.setenv("ACOMPILE_PARENT_PID", str(DEAD_PID))  # not our parent: the pool is gone
    monkeypatch.setenv("ACOMPILE_WORKDIR", str(theirs / "work"))
    _remove_work_folder_of_a_dead_pool()
    assert (theirs / "work" / "file").read_text() == "theirs"
    ours = tmp_path / "work"
    ours.mkdir(mode=0o700)
    monkeypatch.setenv("ACOMPILE_WORKDIR", str(ours))
    _remove_work_folder_of_a_dead_pool()
    assert not ours.exists()


# --- the farm -------------------------------------------------------------------------------------


@pytest.fixture
def one_node() -> Iterator[Any]:
    pytest.importorskip("ray")
    from test_farm import _cluster

    for made, _ in _cluster({"num_cpus": 1}):
        yield made


@asyncio_only
async def test_a_farm_actor_s_work_folder_is_its_own_though_another_user_made_the_old_one(
    one_node: Any, shared_tmp: Path, tmp_path: Path
) -> None:
    """The attack on a real farm: nobody makes the folder farm actors used to share, before
    any actor starts. The actor's pool works in a private folder of its own, not in nobody's,
    which stays empty."""
    old = Path(as_nobody(_make_old_farm_folder, str(shared_tmp), os.getuid()))
    env = {"PYTHONPATH": str(ROOT / "tests"), "TMPDIR": str(shared_tmp)}
    farm = acompile.RayFarm(one_node.address, workers=1, runtime_env={"env_vars": env})
    async with acompile.CompilePool(target=TARGET, workers=farm, cache_dir=tmp_path, preload=()) as p:
        with anyio.fail_after(120):
            assert await run_job(p, FAKE, {"name": "k", "action": "echo", "value": 3}, "k") == 3
        workdirs = set()
        for proc in psutil.Process().children(recursive=True):
            try:
                if "--template" in proc.cmdline():
                    workdirs.add(proc.environ()["ACOMPILE_WORKDIR"])
            except (psutil.Error, KeyError):
                continue
        assert len(workdirs) == 1, workdirs
        workdir = Path(workdirs.pop())
        assert workdir.parent == shared_tmp, workdir
        info = os.lstat(workdir)
        assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
        assert stat.S_IMODE(info.st_mode) == 0o700
    assert os.listdir(old) == []  # nobody's folder: nothing of ours in it
