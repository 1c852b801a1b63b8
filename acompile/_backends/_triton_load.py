"""Loading a Triton kernel from a cache entry: its metadata checked, Triton's objects rebuilt.

``kernel_metadata`` reads an entry's metadata as ``CompiledKernel.__init__`` reads Triton's JSON
file, and refuses (``CorruptEntry``) whatever would fail later, at first use or at the first
launch. ``TritonObjects`` holds what Triton itself would build from the entry (the decoded stages,
the ``CompiledKernel``), each built the first time it is asked for; ``TritonKernel``
(``_triton_kernel``) is what the user gets around them.
"""

from __future__ import annotations

import json
import threading
from collections import namedtuple
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from acompile._backends._memos import remembered
from acompile._cache import Blobs, CorruptEntry, Entry, blob_isascii, blob_view
from acompile._errors import StageUnavailableError, show

if TYPE_CHECKING:
    from acompile._backends._triton_spec import TritonRequest
    from acompile._targets import Target


# The metadata's named-tuple class, by its list of fields (see kernel_metadata).
_metadata_types: dict[tuple[str, ...], Any] = remembered({})
# Triton's compiler backend, by GPUTarget (see backend_for).
_backends: dict[Any, Any] = remembered({})


class _Absent:
    """What a metadata field that is not there reads as."""


_ABSENT = _Absent()
_INT: frozenset[type] = frozenset({int})
_FLAG: frozenset[type] = frozenset({bool, int})
_TEXT: frozenset[type] = frozenset({str})
_OPTIONAL: frozenset[type] = frozenset({_Absent, type(None)})
# The metadata fields that something after loading reads, with the types (exact: JSON's true is
# no count of warps) it needs: ``CompiledKernel`` (hash, name), the backend's ``pack_metadata``
# (num_warps, num_ctas, shared), ``CompiledKernel._init_handles`` (shared, tmem_size, num_warps,
# warp_size) and the CUDA launcher (the scratch sizes and alignments, the launch flags,
# tensordesc_meta). Triton 3.6 to 3.9 write each of them for CUDA; the last two are read only
# where present. AMD's metadata has fewer (Triton 3.6's no global scratch, no launch_pdl in any):
# for other backends than CUDA, the launcher's fields are checked where present.
# Checked at every load, with the text stages' UTF-8 (see below): ~7 us a kernel,
# measured (0.5 ms for a warm start of 68 kernels that takes ~50 ms), where building the
# CompiledKernel costs ~0.1 ms (which is why that waits for first use).
_FIELD_TYPES: dict[str, frozenset[type]] = {
    "hash": _TEXT,
    "name": _TEXT,
    "num_warps": _INT,
    "num_ctas": _INT,
    "shared": _INT,
    "warp_size": _INT,
    "tmem_size": _OPTIONAL | _INT,
    "tensordesc_meta": _OPTIONAL | frozenset({list}),
}
_CUDA_FIELD_TYPES: dict[str, frozenset[type]] = {
    "global_scratch_size": _INT,
    "global_scratch_align": _INT,
    "profile_scratch_size": _INT,
    "profile_scratch_align": _INT,
    "launch_cooperative_grid": _FLAG,
    "launch_pdl": _FLAG,
}
# A launch of no warps or a negative size fails only on the GPU, as a CUDA error at launch, and
# an alignment under 1 only in the allocator the launcher hands it to. No upper bound on
# num_warps (nor a power of two): with warp specialization it is the total of every partition's.
_FIELD_LEAST = {
    "num_warps": 1,
    "num_ctas": 1,
    "shared": 0,
    "global_scratch_size": 0,
    "global_scratch_align": 1,
    "profile_scratch_size": 0,
    "tmem_size": 0,  # where present
}


def kernel_metadata(entry: Entry, target: Target) -> Any:
    """Triton's metadata of a kernel, as ``CompiledKernel.__init__`` reads it from its JSON
    file; raises ``CorruptEntry`` where the entry holds no kernel Triton could load for
    ``target`` (the request's), or holds anything that would fail later: a field of the wrong
    type (see ``_FIELD_TYPES``), a text stage that is not UTF-8."""
    from triton.backends.compiler import GPUTarget

    try:
        metadata = json.loads(entry.blobs["json"])
        if type(metadata) is not dict:
            raise TypeError(f"metadata is a JSON {type(metadata).__name__}, not an object")
        t = metadata["target"]
        backend, arch, warp_size = t["backend"], t["arch"], t["warp_size"]
        # The key names the target, so an entry for another one is damage: its binary is not
        # for this GPU, and Triton's backend for it may not even be made (AMD's asserts that
        # the arch is a name). Exact types: JSON's 90.0 or "90" is no CUDA arch.
        if backend != target.backend or type(arch) is not type(target.arch) or arch != target.arch:
            raise ValueError(f"target is {show(backend)}:{show(arch)}, not the request's {target}")
        if type(warp_size) is not int:
            raise TypeError(f"target warp_size is {show(warp_size)}")
        metadata["target"] = GPUTarget(backend, arch, warp_size)
        launcher_fields = _CUDA_FIELD_TYPES.items()
        if backend != "cuda":  # read where present
            launcher_fields = {n: t | _OPTIONAL for n, t in launcher_fields}.items()
        for name, types in [*_FIELD_TYPES.items(), *launcher_fields]:
            value = metadata.get(name, _ABSENT)
            if type(value) not in types:
                if value is _ABSENT:
                    raise KeyError(name)
                raise TypeError(f"{name} is {show(value)}")
        for name, least in _FIELD_LEAST.items():
            value = metadata.get(name)
            if value is not None and value < least:
                raise ValueError(f"{name} is {value}")
        fields = tuple(sorted(metadata))
        KernelMetadata: Any = _metadata_types.get(fields)
        if KernelMetadata is None:
            # Triton makes a class per kernel; one per field list reads the same and saves a
            # class creation per kernel loaded from the cache.
            KernelMetadata = _metadata_types[fields] = namedtuple("KernelMetadata", fields)
        # By position: a named tuple's keyword form costs more than the rest of this check.
        md: Any = KernelMetadata._make([metadata[name] for name in fields])
        binary = backend_for(md.target).binary_ext
        if binary not in entry.blobs:
            raise KeyError(binary)
        # The text stages are decoded at first use of .asm; whether they can be is known now.
        # They are ASCII but for a rare comment, and the ASCII scan reads them where the entry
        # was read, without copying them out: a full decode is paid for only by a stage that
        # is not.
        for ext in entry.blobs:
            if ext != binary and not blob_isascii(entry.blobs, ext):
                try:
                    str(blob_view(entry.blobs, ext), "utf-8")
                except UnicodeDecodeError as exc:
                    raise ValueError(
                        f"the {ext} stage is not UTF-8 text ({exc.reason} at byte {exc.start})"
                    ) from None
    except Exception as exc:
        # Whatever Triton raises making the backend or the metadata of what the entry says
        # (an AssertionError, say) is the entry's doing: a miss, and the kernel is compiled again.
        raise CorruptEntry(f"not a loadable Triton kernel ({type(exc).__name__}: {exc})") from exc
    return md


def backend_for(target: Any) -> Any:
    """Triton's compiler backend of a ``GPUTarget`` (its binary's extension, its metadata
    packing), made once per target."""
    backend = _backends.get(target)
    if backend is None:
        from triton.compiler.compiler import make_backend

        backend = _backends[target] = make_backend(target)
    return backend


class TritonObjects:
    """Triton's objects of one cached kernel, each built the first time it is asked for.

    Decoding every text stage (a matmul's LLVM IR alone is most of a megabyte) and building the
    ``CompiledKernel`` cost more than everything else a warm start does per kernel; a process
    that only launches a kernel needs the ``CompiledKernel`` once, and its text stages never.
    The ``CompiledKernel`` is built with the binary alone in its ``asm``: the text stages join
    it (the same dict) when ``asm`` is first asked for, here or by a key missing from Triton's
    dict. An entry read from the disk reads them from its file then (``Blobs``), so that a warm
    start reads a fifth of each entry; one whose file no longer holds them raises
    ``StageUnavailableError``, and the kernel still launches.
    Built once even when threads ask at the same moment: a second ``CompiledKernel`` would load
    the binary again. Nothing in the entry can make building fail: ``kernel_metadata`` checked,
    at load, every field and stage it reads (a stage the entry's header lists as ASCII is taken
    at its word there; bytes of one that are not text read as U+FFFD).
    """

    _building = threading.Lock()  # taken only while something is built, the first time

    def __init__(self, request: TritonRequest, entry: Entry, metadata: Any) -> None:
        self._request = request
        self.signature = request.signature
        self._blobs: Mapping[str, bytes] = entry.blobs
        self._metadata = metadata
        self._stages: dict[str, Any] | None = None  # Triton's AsmDict: the binary, then every stage
        self._complete = False
        self._compiled: Any = None

    @property
    def asm(self) -> dict[str, Any]:
        """Every stage, by extension (the text stages decoded; the binary as bytes)."""
        if not self._complete:
            self._complete_stages()
        assert self._stages is not None
        return self._stages

    @property
    def compiled(self) -> Any:
        compiled = self._compiled
        if compiled is None:
            with self._building:
                if self._compiled is None:
                    self._compiled = build_compiled_kernel(self._request, self._metadata, self._stage_dict())
                compiled = self._compiled
        return compiled

    def _stage_dict(self) -> dict[str, Any]:
        """The stages' dict, made with the binary alone (under ``_building``)."""
        if self._stages is None:
            binary = backend_for(self._metadata.target).binary_ext
            self._stages = _stages_type()(self)
            self._stages[binary] = self._blobs[binary]
        return self._stages

    def _complete_stages(self) -> None:
        """Put every text stage in the stages' dict, in the entry's order. An entry read in part
        reads the rest from its file first, outside the lock that every kernel's first build
        takes (a slow filesystem holds up this kernel's stages alone)."""
        blobs = self._blobs
        if isinstance(blobs, Blobs):
            try:
                blobs.read_pending()
            except CorruptEntry as exc:
                raise self._unavailable(exc) from None
        with self._building:
            if self._complete:
                return
            stages = self._stage_dict()
            binary = backend_for(self._metadata.target).binary_ext
            try:
                # Text stages decoded from where the entry was read (no copy of the bytes first);
                # the metadata is not a stage. "replace": only a stage the header calls ASCII can
                # fail to decode, and the kernel must load all the same.
                ordered = {
                    ext: stages[binary] if ext == binary else str(blob_view(blobs, ext), "utf-8", "replace")
                    for ext in blobs
                    if ext != "json"
                }
            except CorruptEntry as exc:
                raise self._unavailable(exc) from None
            extra = {ext: value for ext, value in stages.items() if ext not in ordered}  # SASS, say
            stages.clear()
            stages.update(ordered)
            stages.update(extra)
            stages._owner = None  # type: ignore[attr-defined]
            self._blobs = {}  # the decoded stages replace the entry's bytes
            self._complete = True

    def _unavailable(self, exc: CorruptEntry) -> StageUnavailableError:
        return StageUnavailableError(
            f"{self._request.fn.__name__}: the text stages of this kernel (its IRs and PTX) cannot "
            f"be read from the disk cache entry it was loaded from: {exc}. The kernel itself was "
            "checked and launches; a pool that is asked for it later (this one keeps the kernel "
            "loaded) reads or compiles it again"
        )


_stages_class: Any = None


def _stages_type() -> Any:
    """Triton's ``AsmDict``, whose missing keys complete its ``TritonObjects``' stages first:
    code holding the ``CompiledKernel`` (a profiler reading ``compiled.asm["ptx"]``) finds every
    stage as Triton's own would have it."""
    global _stages_class
    if _stages_class is None:
        from triton.compiler.compiler import AsmDict

        class Stages(AsmDict):  # type: ignore[misc]
            def __init__(self, owner: TritonObjects) -> None:
                super().__init__()
                self._owner: TritonObjects | None = owner

            def __reduce__(self) -> Any:
                # Pickled as Triton's own dict, every stage in it.
                if self._owner is not None:
                    self._owner._complete_stages()
                return (AsmDict, (dict(self),))

            def __missing__(self, key: str) -> Any:
                owner = self._owner
                if owner is not None:
                    owner._complete_stages()
                    if key in self:
                        return self[key]
                return super().__missing__(key)

        _stages_class = Stages
    return _stages_class


def build_compiled_kernel(request: TritonRequest, metadata: Any, asm: dict[str, Any]) -> Any:
    """Triton's ``CompiledKernel`` from an entry's metadata and stages, attribute for attribute
    as ``CompiledKernel.__init__`` builds it from files (3.6 to 3.9), with no file involved."""
    from triton.compiler import ASTSource, CompiledKernel

    backend = backend_for(metadata.target)
    ck = CompiledKernel.__new__(CompiledKernel)
    # 3.9's __del__ reads these: set them before anything can fail.
    ck.module = None
    ck._module_pid = None
    ck.function = None
    ck._run = None
    ck.src = ASTSource(request.fn, request.signature, request.constants, request.attrs or None)
    ck.metadata = metadata
    ck.packed_metadata = backend.pack_metadata(metadata)
    ck.hash = metadata.hash
    ck.name = metadata.name
    ck.asm = asm
    ck.metadata_group = {}
    ck.kernel = asm[backend.binary_ext]
    if "_module_pid" not in CompiledKernel.__init__.__code__.co_names:
        del ck._module_pid  # Triton before 3.9 has no such attribute
    return ck
