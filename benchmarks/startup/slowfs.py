"""The slow-file-system case: build ``slowfs.c`` and the environment that preloads it.

``slowfs.c`` (in this folder) makes every metadata call on a path under the data tree wait a
fixed time, a stand-in for the round trip to a parallel file system's metadata server; calls
elsewhere (Python's imports, the libraries) keep their speed. The library is compiled once per
version of its source with the system's C compiler, into the benchmark's cache folder.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slowfs.c")


def build_shim(cache: str) -> str:
    """The path of the compiled shim (compiled now if this source was never compiled)."""
    with open(SOURCE, "rb") as fh:
        tag = hashlib.sha256(fh.read()).hexdigest()[:12]
    target = os.path.join(cache, f"slowfs-{tag}.so")
    if os.path.isfile(target):
        return target
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("the slow-file-system case needs a C compiler (cc or gcc)")
    os.makedirs(cache, exist_ok=True)
    partial = f"{target}.{os.getpid()}.tmp"
    subprocess.run([compiler, "-O2", "-U_FORTIFY_SOURCE", "-shared", "-fPIC", "-o", partial,
                    SOURCE, "-ldl"],
                   check=True, capture_output=True, text=True)
    os.replace(partial, target)
    return target


def shim_env(shim: str, root: str, latency_us: int) -> dict[str, str]:
    """Environment variables that slow ``root`` down by ``latency_us`` per metadata call."""
    preload = " ".join(p for p in (shim, os.environ.get("LD_PRELOAD", "")) if p)
    return {"LD_PRELOAD": preload, "MDL_SLOWFS_ROOT": os.path.abspath(root),
            "MDL_SLOWFS_US": str(int(latency_us))}
