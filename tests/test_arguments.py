"""Wrong arguments are refused before any worker starts, each with a message naming the argument."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import TARGET
from kernels_for_tests import ADD_SIG, add_kernel
from test_native import CPP, KERNELS

import acompile

pytestmark = pytest.mark.anyio

OK = {"signature": ADD_SIG, "constexprs": {"BLOCK": 64}}

TRITON_CASES: list[tuple[dict[str, Any], str]] = [
    ({"num_warps": 64}, r"num_warps must be a power of two from 1 to 32.*got 64"),
    ({"num_warps": 2**20}, r"num_warps must be a power of two from 1 to 32"),
    ({"num_warps": True}, r"num_warps must be .*got True"),
    ({"num_warps": 0}, r"num_warps must be"),
    ({"num_warps": 4.0}, r"num_warps must be"),
    ({"num_warps": "4"}, r"num_warps must be"),
    ({"num_stages": True}, r"num_stages must be an integer from 1 to 64, got True"),
    ({"num_stages": 0}, r"num_stages must be an integer from 1 to 64"),
    ({"num_stages": "3"}, r"num_stages must be an integer from 1 to 64"),
    ({"attrs": {5: [["tt.divisibility", 16]]}}, r"attrs index 5 is out of range: add_kernel has 5 param"),
    ({"attrs": {4: [["tt.divisibility", 16]]}}, r"'BLOCK' is a constexpr; attributes apply to runtime"),
    ({"attrs": {(9, 0): [["tt.divisibility", 16]]}}, r"attrs index \(9, 0\) is out of range"),
    ({"attrs": {-1: [["tt.divisibility", 16]]}}, r"attrs index -1 is out of range"),
    ({"attrs": {True: [["tt.divisibility", 16]]}}, r"attrs keys are parameter names or index tuples"),
    ({"attrs": {"y": [["tt.divisibility", 16]]}}, r"attrs names 'y', which is not a parameter"),
    ({"attrs": {"x_ptr": 16}}, r"attrs\['x_ptr'\] must be a list of \[name, value\] pairs"),
    (
        {"attrs": {"x_ptr": [["tt.divisibility"]]}},
        r"attrs\['x_ptr'\] must be a list of \[name, value\] pairs",
    ),
    ({"attrs": {"x_ptr": [["tt.divisibility", 1.5]]}}, r"the value of 'tt.divisibility' must be an int"),
    ({"attrs": [("x_ptr", 16)]}, r"attrs must map parameter names or indices"),
    ({"signature": [("x_ptr", "*fp32")]}, r"signature must map parameter names"),
    ({"signature": {**ADD_SIG, 0: "i32"}}, r"keyed by parameter names \(strings\), got 0"),
    ({"signature": {**ADD_SIG, "n": "i3\0" + "2"}}, r"type of 'n' must be a string such as '\*fp32'"),
    ({"signature": {**ADD_SIG, "n": 32}}, r"type of 'n' must be a string"),
    ({"constexprs": [("BLOCK", 64)]}, r"constexprs must map names to values"),
    ({"kernel_name": 5}, r"kernel_name must be a Python identifier, got 5"),
    ({"kernel_name": "add\0kernel"}, r"kernel_name must be a Python identifier"),
    ({"target": 90}, r"target must be a string such as 'cuda:90', got int"),
    ({"target": "cuda:9\0" + "0"}, r"unknown target"),
    ({"enable_fp_fusion": "\0"}, r"option enable_fp_fusion must be True or False"),
    ({"ptx_options": "-v\0"}, r"option ptx_options contains a NUL character"),
    ({"num_wraps": 4}, r"unknown Triton option\(s\) \['num_wraps'\]"),
]


def pool(cache_dir: Path) -> acompile.CompilePool:
    return acompile.CompilePool(1, target=TARGET, cache_dir=cache_dir, prestart=False, preload=())


async def test_triton_arguments_are_checked_before_any_worker(cache_dir: Path) -> None:
    async with pool(cache_dir) as p:
        for change, message in TRITON_CASES:
            with pytest.raises(acompile.InvalidSpecError, match=message):
                await p.triton(add_kernel, **{**OK, **change})
        with pytest.raises(acompile.InvalidSpecError, match=r"contains a NUL character"):
            await p.triton("import triton\0", kernel_name="k", signature={})
        assert p.stats()["workers"]["started"] == 0


async def test_num_warps_true_is_not_a_cache_key_of_its_own(cache_dir: Path) -> None:
    async with pool(cache_dir) as p:
        with pytest.raises(acompile.InvalidSpecError):
            await p.triton(add_kernel, **OK, num_warps=True)
        from acompile._backends import prepare_triton

        for warps in (1, 2, 4, 8, 16, 32):
            spec = acompile.TritonSpec(add_kernel, ADD_SIG, {"BLOCK": 64}, num_warps=warps)
            request = await prepare_triton(spec, p.target, p.cache_dir / "toolchain")
            assert request.key_parts["options"]["num_warps"] == warps
        assert p.stats()["workers"]["started"] == 0


NATIVE_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("cuda", {"source": KERNELS + "\0// rest"}, r"source contains a NUL character \(\\0\) at offset"),
    ("cuda", {"source": b"__global__ void k() {}"}, r"source must be a string, got bytes"),
    ("cuda", {"source": None}, r"source must be a string, got NoneType"),
    ("cuda", {"options": ["-DX=1\0-DY=2"]}, r"options\[0\] contains a NUL character"),
    ("cuda", {"options": [3]}, r"options\[0\] must be a string, got int"),
    ("cuda", {"options": 3}, r"options must be a list of strings, got 3"),
    ("cuda", {"name_expressions": ["scale<float>\0"]}, r"name_expressions\[0\] contains a NUL character"),
    ("cuda", {"name": "sax\0py"}, r"name contains a NUL character"),
    ("cuda", {"name": 5}, r"name must be a string, got int"),
    ("cuda", {"arch": True}, r"arch must be a string such as 'sm_90' or an int"),
    ("cuda", {"arch": 9.0}, r"arch must be a string"),
    ("cuda", {"arch": "sm_\N{FULLWIDTH DIGIT NINE}0"}, r"unknown architecture"),
    ("cuda", {"output": ["cubin"]}, r"output must be one of cubin, ptx, so, o"),
    ("cpp", {"include_dirs": ["/usr/include\0"]}, r"include_dirs\[0\] contains a NUL character"),
    ("cpp", {"include_dirs": "/usr/include"}, r"include_dirs must be a list of strings"),
    ("cpp", {"options": ("-O2", None)}, r"options\[1\] must be a string, got NoneType"),
]


async def test_native_arguments_are_checked_before_any_worker(cache_dir: Path) -> None:
    async with pool(cache_dir) as p:
        for backend, change, message in NATIVE_CASES:
            kwargs = {"source": KERNELS if backend == "cuda" else CPP, **change}
            source = kwargs.pop("source")
            with pytest.raises(acompile.InvalidSpecError, match=message):
                await getattr(p, backend)(source, **kwargs)
        assert p.stats()["workers"]["started"] == 0


async def test_long_wrong_values_make_short_messages(cache_dir: Path) -> None:
    async with pool(cache_dir) as p:
        with pytest.raises(acompile.InvalidSpecError) as info:
            await p.cuda(KERNELS, options=["-O3", 7] + ["x" * 1000] * 10_000)
        assert len(str(info.value)) < 400
        with pytest.raises(acompile.InvalidSpecError) as info:
            await p.triton(add_kernel, **OK, num_warps=[4] * 1_000_000)
        assert len(str(info.value)) < 400


def test_more_workers_than_cpus_is_allowed_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A pool of more workers than this process's usable CPUs runs, and says that compiles,
    which keep a CPU busy each, will not go faster for it; one within them says nothing."""
    from acompile._sizing import usable_cpus

    cpus = usable_cpus()
    with caplog.at_level("WARNING", logger="acompile"):
        acompile.CompilePool(cpus, cache_dir=tmp_path)
    assert not [r for r in caplog.records if "usable CPU" in r.getMessage()]
    with caplog.at_level("WARNING", logger="acompile"):
        acompile.CompilePool(cpus + 1, cache_dir=tmp_path)
    warned = [r.getMessage() for r in caplog.records if "usable CPU" in r.getMessage()]
    assert len(warned) == 1 and f"workers={cpus + 1} on {cpus} usable CPU" in warned[0], warned
    # Two local halves of a split run together: their sum is what the machine gets.
    caplog.clear()
    with caplog.at_level("WARNING", logger="acompile"):
        acompile.CompilePool(acompile.Split(cpus, 1), cache_dir=tmp_path)
    warned = [r.getMessage() for r in caplog.records if "usable CPU" in r.getMessage()]
    assert len(warned) == 1 and f"local workers={cpus + 1} on {cpus} usable CPU" in warned[0], warned


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis:/bad", r"names no host"),
        ("redis://h:notaport/0", r"the port must be a number"),
        ("redis://h:70000/0", r"the port must be a number"),
        ("redis://h:6379/x", r"the database must be a number"),
        ("redis://h/0?max_connections=abc", r"max_connections .* must be a positive integer"),
        ("redis://h/0?max_value=lots", r"max_value in the shared cache URL"),
        ("http://h/0", r"unknown shared cache URL"),
        ("redis://:s3cret@h:notaport/0", r"redis://:\*\*\*@h:notaport/0"),
    ],
)
def test_a_shared_cache_url_that_cannot_work_is_refused_by_the_constructor(
    tmp_path: Path, url: str, says: str
) -> None:
    with pytest.raises(ValueError, match=says) as refused:
        acompile.CompilePool(1, target=TARGET, cache_dir=tmp_path, shared_cache=url)
    assert "s3cret" not in str(refused.value)


# Every argument of CompilePool with a value that cannot work, and what the error must say: the
# constructor refuses each (a server learns at start-up, not at its first request or at entry),
# naming the argument.
CONSTRUCTOR_CASES: list[tuple[dict[str, Any], str]] = [
    ({"workers": 0}, r"workers must be a positive integer or None, got 0"),
    ({"workers": True}, r"workers must be a positive integer"),
    ({"workers": 2.0}, r"workers must be a positive integer"),
    ({"workers": "cuda:90"}, r"got 'cuda:90' \(a target is given by name: CompilePool\(target='cuda:90'\)\)"),
    ({"workers": 10**9}, r"workers=1000000000 is more than this machine can run"),
    ({"workers": [4]}, r"workers must be a count of workers, None, or an executor spec .* got \[4\]"),
    ({"workers": "4"}, r"got '4' \(a count is a number: workers=4\)"),
    (
        {"workers": acompile.LocalWorkers},
        r"executor spec .* \(a class: give one of its instances, LocalWorkers",
    ),
    (
        {"workers": Path("/tmp")},
        r"executor spec .* \(a folder is given by name: CompilePool\(cache_dir=\.\.\.\)\)",
    ),
    ({"target": 90}, r"target must be a string such as 'cuda:90', got int"),
    ({"target": "cuda:nine"}, r"unknown CUDA architecture in 'cuda:nine'; known: cuda:75"),
    ({"cache_dir": 5}, r"cache_dir must be a path"),
    ({"cache_dir": ""}, r"cache_dir is empty"),
    ({"memory_cache_size": -1}, r"memory_cache_size must be an integer >= 0, got -1"),
    ({"memory_cache_size": "big"}, r"memory_cache_size must be an integer >= 0, got 'big'"),
    ({"memory_cache_size": True}, r"memory_cache_size must be an integer >= 0"),
    ({"prestart": "yes"}, r"prestart must be True or False, got 'yes'"),
    ({"preload": "triton"}, r"preload must be a tuple of backend names"),
    ({"preload": ("fortran",)}, r"unknown backend\(s\) to preload: \['fortran'\]"),
    ({"worker_nice": 20}, r'worker_nice must be "idle" or an integer from 0 to 19, got 20'),
    ({"worker_nice": "low"}, r"worker_nice must be"),
    ({"idle_timeout": 0}, r"idle_timeout must be a positive number of seconds or None, got 0"),
    ({"idle_timeout": "5"}, r"idle_timeout must be a positive number of seconds or None"),
    ({"memory_limit": "lots"}, r"memory_limit: cannot read the size 'lots'"),
    ({"memory_limit": 0}, r"memory_limit: a size must be positive"),
    ({"max_compile_seconds": 0}, r"max_compile_seconds must be positive or None, got 0"),
    ({"max_compile_seconds": "600"}, r"max_compile_seconds must be positive or None"),
    ({"preload_timeout": -1}, r"preload_timeout must be a positive number of seconds, got -1"),
    ({"fork_workers": 1}, r"fork_workers must be True or False, got 1"),
    (
        {"shared_cache": 42},
        r"shared_cache must be an acompile.SharedCache, a URL or an aiocache cache, got int",
    ),
    ({"shared_cache": "redis:/bad"}, r"names no host"),
    ({"signing_key": ""}, r"signing_key.*empty"),
    ({"signing_key": 5}, r"signing_key must be a string or bytes"),
    ({"unsafe_unsigned_host_code": "no"}, r"unsafe_unsigned_host_code must be True or False, got 'no'"),
    ({"fleet_wait": 0}, r"fleet_wait must be a positive number of seconds, got 0"),
    ({"fleet_wait": "60"}, r"fleet_wait must be a positive number of seconds"),
    (
        {
            "shared_cache": acompile.SharedCache("redis://h:6379/0", signing_key="k" * 16),
            "signing_key": "k" * 16,
        },
        r"give signing_key to the SharedCache",
    ),
    ({"record": 5}, r"record must be a path"),
    ({"trace": 5}, r"trace must be a path"),
    ({"farm": "ray://head:10001"}, r"farm must be an acompile.RayFarm or None, got 'ray://head:10001'"),
]


@pytest.mark.parametrize(("arguments", "says"), CONSTRUCTOR_CASES, ids=[str(a) for a, _ in CONSTRUCTOR_CASES])
def test_every_argument_error_of_the_pool_is_raised_by_its_constructor(
    tmp_path: Path, arguments: dict[str, Any], says: str
) -> None:
    kw: dict[str, Any] = {"target": TARGET, "cache_dir": tmp_path, **arguments}
    with pytest.raises((ValueError, TypeError, acompile.AcompileError), match=says):
        acompile.CompilePool(**kw)


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        ({"count": 0}, r"workers must be a positive integer or None, got 0"),
        ({"count": True}, r"workers must be a positive integer"),
        ({"count": "4"}, r"workers must be a positive integer or None, got '4'"),
        ({"count": 10**9}, r"workers=1000000000 is more than this machine can run"),
    ],
)
def test_local_workers_refuse_a_count_that_is_not_one_as_a_pool_does(
    arguments: dict[str, Any], says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        acompile.LocalWorkers(**arguments)


def test_a_split_takes_specs_or_counts_and_nothing_else() -> None:
    farm = acompile.RayFarm("local")
    split = acompile.Split(2, farm)
    assert repr(split) == "Split(LocalWorkers(2), RayFarm(address='local', workers=None))"
    with pytest.raises(TypeError, match=r"background must be a count of workers, None, or an executor spec"):
        acompile.Split(2, "ray://head:10001")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("arguments", "new_form"),
    [({}, r"pass workers=farm"), ({"workers": 3}, r"pass workers=acompile.Split\(3, farm\)")],
)
def test_a_farm_beside_the_workers_is_deprecated_and_the_warning_names_the_new_form(
    tmp_path: Path, arguments: dict[str, Any], new_form: str
) -> None:
    farm = acompile.RayFarm("local")
    with pytest.warns(DeprecationWarning, match=r"CompilePool's farm= is deprecated .* " + new_form):
        pool = acompile.CompilePool(target=TARGET, cache_dir=tmp_path, farm=farm, **arguments)
    # The same pool as the new form makes: the farm alone, or the split with N local workers.
    spec = pool.workers
    if arguments:
        assert isinstance(spec, acompile.Split) and spec.background is farm and spec.urgent.count == 3
    else:
        assert spec is farm
    with pytest.warns(DeprecationWarning, match=r"pass workers=acompile.Split\(LocalWorkers\(2\), farm\)"):
        acompile.CompilePool(target=TARGET, cache_dir=tmp_path, farm=farm, workers=acompile.LocalWorkers(2))
    with pytest.raises(TypeError, match=r"a farm beside an executor spec"):
        acompile.CompilePool(target=TARGET, cache_dir=tmp_path, farm=farm, workers=acompile.Split(1, 1))


def test_every_argument_of_the_pool_is_tried_with_a_wrong_value() -> None:
    # A new argument gets a case above: this fails until it does.
    import inspect

    tried = {name for arguments, _ in CONSTRUCTOR_CASES for name in arguments}
    assert set(inspect.signature(acompile.CompilePool).parameters) == tried


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        (
            {"address": None},
            r"address must be a Ray address such as 'host:6379', 'auto' or 'local', got None",
        ),
        ({"address": 6379}, r"address must be a Ray address"),
        ({"address": " "}, r"address must be a Ray address"),
        ({"resources": "compile"}, r"resources must map resource names to amounts"),
        ({"resources": {"compile": "1"}}, r"resources must map resource names to amounts"),
        ({"local_fallback": "yes"}, r"local_fallback must be True or False, got 'yes'"),
        ({"workers": 0}, r"workers must be a positive integer or None, got 0"),
        ({"num_cpus": -1}, r"num_cpus must be a number of CPUs"),
        ({"connect_timeout": 0}, r"connect_timeout must be within \(0, 30\] seconds"),
    ],
)
def test_a_farm_s_argument_errors_are_raised_by_its_constructor(arguments: dict[str, Any], says: str) -> None:
    # RayFarm imports no Ray: these need none installed.
    with pytest.raises((ValueError, TypeError), match=says):
        acompile.RayFarm(**{"address": "auto", **arguments})


SHARED_CACHE_CASES: list[tuple[tuple[Any, ...], dict[str, Any], str]] = [
    ((42,), {}, r"SharedCache needs a URL or an aiocache cache, got int"),
    ((None,), {}, r"SharedCache needs a URL or an aiocache cache, got NoneType"),
    (("http://cache:6379",), {}, r"unknown shared cache URL"),
    (("redis://h:6379/0?max_conections=4",), {}, r"unknown option\(s\) \['max_conections'\]; known:"),
    (("redis://h:6379/0",), {"signing_key": ""}, r"signing_key is set but empty"),
    (("redis://h:6379/0",), {"signing_key": "short"}, r"at least 16 bytes"),
    (("redis://h:6379/0",), {"signing_key": 5}, r"signing_key must be a string or bytes"),
    (("redis://h:6379/0",), {"unsafe_trust_unsigned": "no"}, r"unsafe_trust_unsigned must be True or False"),
    (("redis://h:6379/0",), {"fleet_wait": 0}, r"fleet_wait must be a positive number of seconds, got 0"),
    (("redis://h:6379/0",), {"fleet_wait": float("inf")}, r"fleet_wait must be a positive number"),
]


@pytest.mark.parametrize(
    ("args", "kwargs", "says"), SHARED_CACHE_CASES, ids=[c[2] for c in SHARED_CACHE_CASES]
)
def test_a_shared_cache_that_cannot_work_is_refused_as_it_is_made(
    args: tuple[Any, ...], kwargs: dict[str, Any], says: str
) -> None:
    with pytest.raises((ValueError, TypeError), match=says):
        acompile.SharedCache(*args, **kwargs)


def test_a_shared_cache_keeps_its_key_out_of_sight_and_does_not_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pickle

    secret = "s3cr3t-signing-key-0123456789"
    shared = acompile.SharedCache("redis://user:pw@cache:6379/0", signing_key=secret, fleet_wait=5)
    assert secret not in repr(shared) and "pw" not in repr(shared), repr(shared)
    assert shared.signed and shared.trusted and shared.fleet_wait == 5.0
    with pytest.raises(AttributeError):
        shared.fleet_wait = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        del shared.fleet_wait
    # A pickle of it would be the key in clear, wherever the bytes went.
    with pytest.raises(TypeError, match="not pickled"):
        pickle.dumps(shared)
    # The key from the environment, read as it is made; none there: unsigned, and untrusted
    # unless its owner says so.
    monkeypatch.setenv("ACOMPILE_SIGNING_KEY", secret)
    assert acompile.SharedCache("redis://cache:6379/0").signing_key == secret.encode()
    monkeypatch.delenv("ACOMPILE_SIGNING_KEY")
    plain = acompile.SharedCache("redis://cache:6379/0")
    assert not plain.signed and not plain.trusted
    assert acompile.SharedCache("redis://cache:6379/0", unsafe_trust_unsigned=True).trusted
