#!/usr/bin/env bash
# Create (when missing) the DeePMD-kit 3.2.0 environment that mdloader's integration tests and
# benchmarks compare against: a venv beside the repository's own Python.
#
# Usage: bash scripts/deepmd-env.sh [VENV_DIR]
#   VENV_DIR defaults to $MDLOADER_DEEPMD_ENV, else .venv-deepmd in the repository (git-ignored).
#
# Why each step:
#  * --system-site-packages (and, when this Python is itself a venv, a .pth line adding its
#    site-packages): reuse this Python's torch, numpy and mdloader instead of downloading them
#    again (install torch and mdloader first);
#  * deepmd-constraints.txt pins torch to the installed release, else DeePMD-kit's wheel would
#    pull another one;
#  * mpich is a run-time dependency of DeePMD-kit's PyTorch backend, e3nn is imported by its
#    trainer;
#  * the wheel's compiled op library (deepmd/lib/libdeepmd_op_pt.so) targets another torch
#    release and `import deepmd.pt` refuses to load while it is present. The data code never
#    uses it, so it is moved aside inside this venv only.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
VENV="${1:-${MDLOADER_DEEPMD_ENV:-$REPO/.venv-deepmd}}"
PYTHON="${PYTHON:-python3}"

if "$VENV/bin/python" -c "import deepmd.pt.utils.dataloader" >/dev/null 2>&1; then
    echo "DeePMD-kit environment ready: $VENV"
    exit 0
fi
if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv --system-site-packages "$VENV"
    # A venv made from a venv sees the base interpreter's packages, not its parent's: link them.
    PARENT="$("$PYTHON" -c 'import site, sys; print(site.getsitepackages()[0] if sys.prefix != sys.base_prefix else "")')"
    if [[ -n "$PARENT" ]]; then
        OWN="$("$VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')"
        # addsitedir, not a bare path: the parent's own .pth files (an editable install's)
        # are read too
        echo "import site; site.addsitedir('$PARENT')" > "$OWN/_mdloader_parent_env.pth"
    fi
fi
TORCH="$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')"
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
sed "s/^torch==.*/torch==$TORCH/" "$HERE/deepmd-constraints.txt" > "$CONSTRAINTS"
"$VENV/bin/pip" install -q --disable-pip-version-check -c "$CONSTRAINTS" \
    -r "$HERE/deepmd-requirements.txt"

LIBDIR="$("$VENV/bin/python" - <<'PY'
import importlib.util, os
spec = importlib.util.find_spec("deepmd")
print(os.path.join(os.path.dirname(spec.origin), "lib"))
PY
)"
if [[ -f "$LIBDIR/libdeepmd_op_pt.so" ]]; then
    mv "$LIBDIR/libdeepmd_op_pt.so" "$LIBDIR/libdeepmd_op_pt.so.disabled-by-mdloader"
fi
"$VENV/bin/python" -c "import deepmd.pt.utils.dataloader, deepmd, torch; \
print(f'DeePMD-kit environment ready: {deepmd.__version__} with torch {torch.__version__} in $VENV')"
