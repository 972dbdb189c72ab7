"""Three costs of starting a rank, cut without changing what DeepSpeed, peft or bitsandbytes run.

**Kernels compiled at import.** ZeRO's optimizer check (``is_zero_supported_optimizer``), stage 3
and the bf16 optimizer import DeepSpeed's Muon module to ask whether the optimizer is Muon, and peft
imports bitsandbytes whenever it is installed (every LoRA run; every diffusion run, whose entries build
a diffusers guider); both modules decorate functions with ``torch.compile`` at import, which imports
``torch._dynamo`` and inductor on the spot: 1.5-3.5 s per rank on 2 shared cores, whether or not
Muon or a bitsandbytes kernel ever runs. ``defer_compiles_at_import`` (an import hook, installed
first thing in a rank and the node's setup process) runs those two modules with ``torch.compile``
applied on each decorated function's first call, with the same arguments: what runs is compiled as
before, and what never runs never imports the compiler.

**The CPU described three times.** DeepSpeed's CPU Adam (an offloaded optimizer) asks py-cpuinfo for
the CPU when it is built and twice more for its compiler flags (``cpu_arch``, ``simd_width``); each
``cpuinfo.get_cpu_info()`` starts a new Python process that queries the CPU (1.2-1.4 s on 2 shared
cores). ``fast_op_loads`` answers the later calls of a rank from the first one's answer (a copy each
time): the CPU does not change while a rank starts.

**DeepSpeed's JIT-built ops**, imported straight from their build folder when it is up to date.

A CPU rank loads two or three C++ ops that DeepSpeed compiles on first use: the shared-memory
collective (every CPU run, in ``deepspeed.init_distributed``), CPU Adam (an offloaded optimizer)
and CPU FusedAdam. Each goes through ``torch.utils.cpp_extension.load``, which, even when the
library is built and nothing changed, takes the op folder's file lock, rewrites ``build.ninja``,
asks the compiler for its version and runs ninja; the ranks of a run take that lock one after the
other and each waits for the others in 0.1 s sleeps. Measured on 2 shared cores: 0.5-1.5 s per op
per rank, paid by every rank of every run (see BENCHMARKS.md, "Rank start-up").

``fast_op_loads`` leaves DeepSpeed's own builder in charge (it still decides which op, its sources
and flags, and caches the module) and replaces only torch's ``load`` while it is active: when the
op folder holds no lock, its ``build.ninja`` is the file torch would write for these arguments
(paths compared through their symlinks, see ``same_files``), and ninja itself finds nothing to do (``ninja -n``: sources, headers and commands as
built), the library is imported the way torch imports it. In every other case (first build,
changed flags or sources, a build under way, a torch whose private helpers differ) torch's
``load`` runs unchanged.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import importlib.abc
import os
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Iterator

# One lock per patched attribute: a thread importing bitsandbytes never waits for a DeepSpeed start on another.
_patching_compile = threading.RLock()
_patching_load = threading.Lock()

# Modules that decorate functions with torch.compile at import; the decoration imports torch._dynamo and inductor.
COMPILE_AT_IMPORT = (
    "deepspeed.runtime.zero.muon.original_muon",  # Muon's Newton-Schulz steps (DeepSpeed's compiler.compile() is torch.compile)
    "bitsandbytes.backends.default.ops",  # bitsandbytes' CPU kernels, imported by peft whenever bitsandbytes is installed
)


def compile_on_first_call(compile_now):
    """``torch.compile`` with the same arguments, applied when the decorated function is first called."""

    def deferred(model=None, **options):
        if model is None:  # @torch.compile(**options)
            return lambda function: deferred(function, **options)
        if not callable(model) or isinstance(model, type) or hasattr(model, "forward"):
            return compile_now(model, **options)  # modules and classes: compiled as before
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_now(model, **options)
            return compiled(*args, **kwargs)

        return call

    return deferred


class _CompileOnFirstCall(importlib.abc.MetaPathFinder):
    """Finds the COMPILE_AT_IMPORT modules as the other finders do, and runs them with ``torch.compile`` deferred."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in COMPILE_AT_IMPORT:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_with_compile_deferred(module):
            import torch

            with _patching_compile:
                compile_now = torch.compile
                torch.compile = compile_on_first_call(compile_now)
                try:
                    exec_module(module)
                finally:
                    torch.compile = compile_now

        spec.loader.exec_module = exec_with_compile_deferred
        return spec


def defer_compiles_at_import() -> None:
    """From now on in this process, COMPILE_AT_IMPORT modules compile their functions on first call (idempotent)."""
    if not any(isinstance(finder, _CompileOnFirstCall) for finder in sys.meta_path):
        sys.meta_path.insert(0, _CompileOnFirstCall())


@contextlib.contextmanager
def fast_op_loads() -> Iterator[None]:
    """While active, ``torch.utils.cpp_extension.load`` imports an up-to-date op without its build step, and py-cpuinfo is asked once."""
    from torch.utils import cpp_extension

    with _patching_load, cpu_described_once():
        torch_load = cpp_extension.load

        def load(name, sources, *args, **kwargs):
            module = built_module(name, sources, *args, **kwargs)
            return module if module is not None else torch_load(name, sources, *args, **kwargs)

        cpp_extension.load = load
        try:
            yield
        finally:
            cpp_extension.load = torch_load


@contextlib.contextmanager
def cpu_described_once() -> Iterator[None]:
    """While active, ``cpuinfo.get_cpu_info()`` asks once and answers again with a copy of that answer."""
    try:
        import cpuinfo
    except ImportError:  # DeepSpeed then reads lscpu itself
        yield
        return
    ask = cpuinfo.get_cpu_info
    answers: list[dict] = []

    def get_cpu_info():
        if not answers:
            answers.append(ask())
        return copy.deepcopy(answers[0])

    cpuinfo.get_cpu_info = get_cpu_info
    try:
        yield
    finally:
        cpuinfo.get_cpu_info = ask


def same_files(build_text: str) -> str:
    """A build file with every absolute path resolved through its symlinks: one venv reached by two spellings builds the same library.

    Checkouts that share a virtual environment through a symlink (``.venv -> /elsewhere/.venv``) see DeepSpeed's sources
    and torch's headers under their own spelling; torch's ``load`` takes the other spelling's build file for a change
    and rebuilds the op (1-2 minutes on 2 cores), and the next checkout rebuilds it back.
    """
    return re.sub(r"/[^\s:$'\"]+", lambda path: os.path.realpath(path.group(0)), build_text)


def built_module(
    name, sources, extra_cflags=None, extra_cuda_cflags=None, extra_sycl_cflags=None, extra_ldflags=None, extra_include_paths=None,
    build_directory=None, verbose=False, with_cuda=None, with_sycl=None, is_python_module=True, is_standalone=False, keep_intermediates=True,
):
    """The op's module imported from its up-to-date build folder, or None where torch's ``load`` must run (signature: torch's ``load``)."""
    from torch.utils import cpp_extension as ext

    if not is_python_module or is_standalone:
        return None
    try:
        if ext.JIT_EXTENSION_VERSIONER.get_version(name) is not None:
            return None  # this process loaded the name already: torch versions it (name_v1...)
        sources = [sources] if isinstance(sources, str) else list(sources)
        if with_cuda is None:
            with_cuda = any(map(ext._is_cuda_file, sources))
        if with_sycl is None:
            with_sycl = any(map(ext._is_sycl_file, sources))
        folder = Path(build_directory or ext._get_build_directory(name, verbose=False))
        library, build_file, lock = folder / f"{name}{ext.LIB_EXT}", folder / "build.ninja", folder / "lock"
        if lock.exists() or not library.is_file() or not build_file.is_file():
            return None
        with tempfile.TemporaryDirectory() as scratch:
            wanted = Path(scratch) / "build.ninja"
            ext._write_ninja_file_to_build_library(
                path=str(wanted), name=name, sources=sources,
                extra_cflags=extra_cflags or [], extra_cuda_cflags=extra_cuda_cflags or [], extra_sycl_cflags=extra_sycl_cflags or [],
                extra_ldflags=ext._prepare_ldflags(extra_ldflags or [], with_cuda, with_sycl, False, is_standalone),
                extra_include_paths=extra_include_paths or [], with_cuda=with_cuda, with_sycl=with_sycl, is_standalone=is_standalone,
            )
            if same_files(wanted.read_text()) != same_files(build_file.read_text()):
                return None
        dry_run = subprocess.run(["ninja", "-n"], cwd=folder, capture_output=True, text=True, timeout=120, env=os.environ.copy())
        if dry_run.returncode != 0 or "no work to do" not in dry_run.stdout or lock.exists():
            return None
        module = ext._import_module_from_library(name, str(folder), True)
    except Exception:  # noqa: BLE001 - any doubt (a torch whose helpers differ, no ninja): torch's own load decides
        return None
    # Recorded as torch's load records it, so a second load of the name in this process is versioned the same way.
    with contextlib.suppress(Exception):
        ext.JIT_EXTENSION_VERSIONER.bump_version_if_changed(
            name, sources, build_arguments=[extra_cflags, extra_cuda_cflags, extra_ldflags, extra_include_paths], build_directory=str(folder),
            with_cuda=with_cuda, with_sycl=with_sycl, is_python_module=is_python_module, is_standalone=is_standalone,
        )
    return module
