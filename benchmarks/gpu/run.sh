#!/usr/bin/env bash
# mdloader on one GPU, prepared before a GPU is lent (docs/benchmarks.md, "On a GPU"): the NCCL
# broadcast of a packet and of a failure, then `mdloader train`, `mdloader dp --pt train` and
# DeePMD-kit's own `dp --pt train` on CUDA, with their steps per second and data-wait shares.
#
# Usage:
#   bash benchmarks/gpu/run.sh [--smoke] [--steps N] [--budget S] [--out DIR] [--no-deepmd] [--cpu]
#   bash benchmarks/gpu/run.sh --fetch-wheels   # where pip reaches an index: wheels into .whl/
#
# Without CUDA every CUDA part is skipped with one line each; --smoke then runs stand-ins on the
# CPU (the NCCL check on gloo, one short `mdloader train`), so the script is tested end to end on
# any machine. Everything after the set-up is `python -m benchmarks.gpu.run` (--help there).
#
# The set-up, and why: a GPU machine that reaches no package index has a python3 with torch,
# numpy, h5py, scipy and e3nn, but not what benchmarks/gpu/wheels.txt lists. When that python
# cannot find those packages, the wheels in .whl/ ($MDLOADER_GPU_WHEELS) are installed with
# --prefix into a temporary folder put on PYTHONPATH (--prefix, not --target: mpich installs its
# library outside site-packages, where DeePMD-kit loads it from at import, and --target drops it),
# and DeePMD-kit's compiled op library is moved aside as scripts/deepmd-env.sh does (built for
# one torch release; training never uses it).
# A piece still missing then ends the run at once with one line, before any GPU time is spent.
#
# Environment: MDLOADER_GPU_PYTHON (default python3), MDLOADER_DEEPMD_PYTHON (the interpreter
# with DeePMD-kit; default .venv-deepmd/bin/python when present, else the same python),
# MDLOADER_GPU_WHEELS (default .whl), MDLOADER_GPU_PYVER (the GPU's Python for --fetch-wheels,
# default 3.12).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PYTHON="${MDLOADER_GPU_PYTHON:-python3}"
WHEELS="${MDLOADER_GPU_WHEELS:-$REPO/.whl}"

fail() {
    echo "gpu check: cannot run: $*" >&2
    exit 1
}

fetch_wheels() {
    local tags=() n
    for n in 17 24 27 28 31 34 35; do
        tags+=(--platform "manylinux_2_${n}_x86_64")
    done
    mkdir -p "$WHEELS"
    "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version "${MDLOADER_GPU_PYVER:-3.12}" --implementation cp "${tags[@]}" \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        -d "$WHEELS" -r "$HERE/wheels.txt"
    echo "wheels in $WHEELS: $(du -ch "$WHEELS"/*.whl | tail -1 | cut -f1) (carry the folder)"
}

# The top-level packages of wheels.txt that an interpreter cannot find (no import: fast).
missing_packages() {
    "$1" - <<'PY'
import importlib.util
names = ["deepmd", "dargs", "wcmatch", "bracex", "array_api_compat", "typeguard", "lmdb", "vesin",
         "mendeleev", "sqlalchemy", "pint", "flexcache", "flexparser", "platformdirs"]
print(" ".join(n for n in names if importlib.util.find_spec(n) is None))
PY
}

install_wheels() {  # python site: the wheels into the prefix site; prints its site-packages
    local site="$2"
    PIP_ROOT_USER_ACTION=ignore "$1" -m pip install -q --disable-pip-version-check --no-index \
        --no-deps --no-compile --no-cache-dir --prefix "$site" "$WHEELS"/*.whl >&2 \
        || fail "pip could not install the wheels in $WHEELS into $site"
    local packages
    packages="$(find "$site" -type d \( -name site-packages -o -name dist-packages \) | head -1)"
    [[ -n "$packages" ]] || fail "the wheels in $WHEELS installed no site-packages under $site"
    if [[ -f "$packages/deepmd/lib/libdeepmd_op_pt.so" ]]; then
        mv "$packages/deepmd/lib/libdeepmd_op_pt.so" \
            "$packages/deepmd/lib/libdeepmd_op_pt.so.disabled-by-mdloader"
    fi
    echo "$packages"
}

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    fetch_wheels
    exit 0
fi

command -v "$PYTHON" >/dev/null || fail "no $PYTHON on PATH (set MDLOADER_GPU_PYTHON)"
"$PYTHON" -c "import torch" 2>/dev/null || fail "$PYTHON cannot import torch"
if [[ -z "${MDLOADER_DEEPMD_PYTHON:-}" ]]; then
    MDLOADER_DEEPMD_PYTHON="$PYTHON"
    if [[ -x "$REPO/.venv-deepmd/bin/python" ]]; then
        MDLOADER_DEEPMD_PYTHON="$REPO/.venv-deepmd/bin/python"
    fi
fi
command -v "$MDLOADER_DEEPMD_PYTHON" >/dev/null \
    || fail "no DeePMD-kit interpreter $MDLOADER_DEEPMD_PYTHON (set MDLOADER_DEEPMD_PYTHON)"
export MDLOADER_DEEPMD_PYTHON
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

lacking="$(missing_packages "$MDLOADER_DEEPMD_PYTHON")"
if [[ -n "$lacking" ]] && compgen -G "$WHEELS/*.whl" >/dev/null; then
    echo "gpu check: $MDLOADER_DEEPMD_PYTHON lacks $lacking: installing the wheels in $WHEELS" >&2
    SITE="$(mktemp -d "${TMPDIR:-/tmp}/mdloader-gpu-site.XXXXXX")"
    trap 'rm -rf "$SITE"' EXIT
    PYTHONPATH="$(install_wheels "$MDLOADER_DEEPMD_PYTHON" "$SITE"):$PYTHONPATH"
    export PYTHONPATH
fi
cd "$REPO"
"$PYTHON" -m benchmarks.gpu.run "$@"
