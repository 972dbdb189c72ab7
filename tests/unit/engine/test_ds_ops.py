"""What a rank saves starting (engine/ds_ops.py), and that DeepSpeed gets what it got before.

One new interpreter runs every check (each needs a process that has not imported the compiler or
loaded the op yet): DeepSpeed's own shared-memory op (built before the lanes by
scripts/build_ds_ops.py; built here otherwise) in a copy of its build folder, so the lock and the
changed flags below touch no folder another process uses; the script reaches torch and DeepSpeed
through a symlinked site-packages, as a checkout with a linked .venv does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from zeropipe.engine.ds_ops import same_files

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = r"""
import json, os, sys
from pathlib import Path
import torch
import deepspeed
from deepspeed.accelerator import get_accelerator
from torch.utils import cpp_extension
import cpuinfo
from zeropipe.engine import ds_ops

out = {"deepspeed_seen_at": deepspeed.__file__}

# Muon and bitsandbytes: importing them no longer imports the compiler; a decorated function's first call compiles it.
ds_ops.defer_compiles_at_import()
import deepspeed.runtime.zero.muon.muon_optimizer
out["compiler_after_import"] = [m for m in ("torch._dynamo", "torch._inductor.compile_fx") if m in sys.modules]
import peft  # imports bitsandbytes (installed with the test dependencies), and transformers, which imports torch._dynamo
out["bitsandbytes_imported"] = "bitsandbytes.backends.default.ops" in sys.modules
out["inductor_after_peft"] = "torch._inductor.compile_fx" in sys.modules
from deepspeed.runtime.zero.muon import original_muon
G = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
first = original_muon.zeropower_via_newtonschulz5(G, 5)
out["compiler_after_first_call"] = "torch._dynamo" in sys.modules
out["same_as_eager"] = bool(torch.equal(first, original_muon.zeropower_via_newtonschulz5.__wrapped__(G, 5)))

# py-cpuinfo: asked once however often DeepSpeed's builders ask.
asked = []
real = cpuinfo.get_cpu_info
cpuinfo.get_cpu_info = lambda: asked.append(1) or real()
builder = get_accelerator().create_op_builder("CPUAdamBuilder")
with ds_ops.cpu_described_once():
    flags = [builder.cpu_arch(), builder.simd_width(), builder.cpu_arch()]
    a, b = cpuinfo.get_cpu_info(), cpuinfo.get_cpu_info()
out["cpuinfo_asked"] = len(asked)
out["cpuinfo_copies"] = a == b and a is not b
cpuinfo.get_cpu_info = real

# The op: imported from its up-to-date folder without torch's build step.
builds = []
jit_compile = cpp_extension._jit_compile
cpp_extension._jit_compile = lambda *args, **kwargs: builds.append(args[0]) or jit_compile(*args, **kwargs)
shm = get_accelerator().create_op_builder("ShareMemCommBuilder")
with ds_ops.fast_op_loads():
    module = shm.load(verbose=False)
out["op_file"] = module.__file__
out["torch_builds"] = builds
out["op_works"] = hasattr(module, "initialize")

# What the fast path refuses: other flags than the folder was built with, a lock (a build under way).
name, folder = "deepspeed_shm_comm", Path(module.__file__).parent
sources = [shm.deepspeed_src_path(path) for path in shm.sources()]
includes = [shm.deepspeed_src_path(path) for path in shm.include_paths()]
cxx = shm.strip_empty_entries(shm.cxx_args()) + ["-UC10_USE_GLOG"]
cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(name, None)
out["refused_other_flags"] = ds_ops.built_module(name, sources, extra_cflags=cxx + ["-DOTHER"], extra_include_paths=includes) is None
out["accepted_same_flags"] = ds_ops.built_module(name, sources, extra_cflags=cxx, extra_include_paths=includes) is not None
cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(name, None)
(folder / "lock").touch()
out["refused_while_locked"] = ds_ops.built_module(name, sources, extra_cflags=cxx, extra_include_paths=includes) is None
print("RESULT" + json.dumps(out))
"""


def op_build_folder() -> Path:
    """Where this machine's torch keeps DeepSpeed's shared-memory op, as ``cpp_extension._get_build_directory`` puts it (without creating it)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if os.environ.get("TORCH_EXTENSIONS_DIR"):  # torch then uses the folder as it is, without the python/accelerator level
        return Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "deepspeed_shm_comm"
    accelerator = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}" / "deepspeed_shm_comm"


def test_muon_compiles_on_first_call_cpuinfo_is_asked_once_and_a_built_op_skips_torchs_build_step(tmp_path):
    built = op_build_folder()
    copy = tmp_path / "extensions" / "deepspeed_shm_comm"
    if (built / "deepspeed_shm_comm.so").is_file() and not (built / "lock").exists():
        shutil.copytree(built, copy)  # copy2: the objects keep their times, so ninja finds them as up to date as the original
    # The script sees torch and DeepSpeed through a symlink, as a checkout whose .venv links to a shared one does: the op
    # built under the real spelling is still the op it needs.
    import deepspeed

    site_packages = Path(deepspeed.__file__).resolve().parents[1]
    (tmp_path / "site").symlink_to(site_packages, target_is_directory=True)
    path = os.pathsep.join([str(tmp_path / "site"), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, DS_ACCELERATOR="cpu", TORCHDYNAMO_DISABLE="1", TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"), PYTHONPATH=path)
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT", 1)[1])
    assert result["compiler_after_import"] == []
    assert result["bitsandbytes_imported"] and not result["inductor_after_peft"]
    assert result["compiler_after_first_call"] and result["same_as_eager"]
    assert result["cpuinfo_asked"] == 1 and result["cpuinfo_copies"]
    assert Path(result["op_file"]).parent == copy and result["op_works"]
    assert result["deepspeed_seen_at"].startswith(str(tmp_path / "site"))
    if (built / "deepspeed_shm_comm.so").is_file() and str(site_packages) in same_files((built / "build.ninja").read_text()):
        assert result["torch_builds"] == []  # built already: imported, no build.ninja, no compiler check, no ninja
    assert result["refused_other_flags"] and result["accepted_same_flags"] and result["refused_while_locked"]
