#!/usr/bin/env bash
# Install the benchmark peer (DeePMD-kit 3.2.0, PyTorch backend, no TensorFlow) into a separate
# venv so that the main environment stays clean.
#
# Usage: bash benchmarks/setup_peer.sh [VENV_DIR]     (default: /work/venv-peer)
#
# Why each step:
#  * --system-site-packages: reuse the main torch / numpy / mdloader instead of downloading them again;
#  * constraints.txt pins torch==2.13.0, otherwise DeePMD-kit's wheel upgrades/downgrades torch;
#  * mpich is a run-time dependency of the PyTorch backend, e3nn is needed to import its trainer;
#  * the wheel's compiled op library libdeepmd_op_pt.so was built for another torch release, and
#    `import deepmd.pt` refuses to load while it is present. The data-loading code is pure Python and
#    never uses it, so this script moves that one file aside (inside the venv only; the package
#    itself is not modified anywhere else).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${1:-/work/venv-peer}"
PYTHON="${PYTHON:-python3}"

if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv --system-site-packages "$VENV"
fi
"$VENV/bin/pip" install -q -c "$HERE/constraints.txt" -r "$HERE/requirements-peer.txt"

LIBDIR="$("$VENV/bin/python" - <<'PY'
import importlib.util, os
spec = importlib.util.find_spec("deepmd")
print(os.path.join(os.path.dirname(spec.origin), "lib"))
PY
)"
if [[ -f "$LIBDIR/libdeepmd_op_pt.so" ]]; then
    mv "$LIBDIR/libdeepmd_op_pt.so" "$LIBDIR/libdeepmd_op_pt.so.disabled-by-mdloader-bench"
    echo "moved aside $LIBDIR/libdeepmd_op_pt.so (built for another torch release)"
fi

"$VENV/bin/python" - <<'PY'
import torch
from deepmd.pt.utils.dataloader import DpLoaderSet  # noqa: F401
import deepmd
print(f"peer ready: deepmd-kit {deepmd.__version__}, torch {torch.__version__}")
PY
