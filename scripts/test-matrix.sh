#!/usr/bin/env bash
# The supported version range, tested at both ends: for each end, a throwaway venv with that
# Python, torch and numpy; mdloader installed in it; then the README's main job (20 steps) and
# every test that does not need DeePMD-kit (MDLOADER_TESTS_WITHOUT_DEEPMD=1). With
# MATRIX_DEEPMD=1, also DeePMD-kit 3.2.0 on that torch (scripts/deepmd-env.sh) and
# `mdloader dp --pt train` on the water example. CI keeps its one pinned run; this is for the
# developer and for a release. The ends below are what pyproject.toml declares: change both
# together.
#
# Usage: bash scripts/test-matrix.sh [lowest|newest]...      (default: both)
# Environment:
#   MATRIX_DIR    where the environments go (default: a temporary folder, removed at the end)
#   TORCH_INDEX   pip arguments for torch, e.g. "--index-url https://download.pytorch.org/whl/cpu"
#                 (the default, PyPI, brings the CUDA build and its libraries: a few GB)
#   MATRIX_DEEPMD 1 to add DeePMD-kit's trainer on mdloader
#   PYTHON_LOWEST, PYTHON_NEWEST  the interpreters (default python3.10, python3.13 on PATH)
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"

declare -A PYTHON=([lowest]="${PYTHON_LOWEST:-python3.10}" [newest]="${PYTHON_NEWEST:-python3.13}")
declare -A TORCH=([lowest]=2.3.1 [newest]=2.15.0)
declare -A NUMPY=([lowest]=1.24.4 [newest]=2.5.5)

#: The oldest torch DeePMD-kit 3.2's PyTorch backend imports with (the `deepmd` extra's floor).
DEEPMD_TORCH=2.6

version_at_least() {  # version_at_least 2.3.1 2.6: whether $1 >= $2
    [[ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n 1)" == "$2" ]]
}

ENDS=("$@")
[[ ${#ENDS[@]} -eq 0 ]] && ENDS=(lowest newest)
if [[ -n "${MATRIX_DIR:-}" ]]; then
    ROOT="$MATRIX_DIR"; mkdir -p "$ROOT"
else
    ROOT="$(mktemp -d)"; trap 'rm -rf "$ROOT"' EXIT
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
SUMMARY=()

run_end() {
    local end="$1" venv="$ROOT/$1" log="$ROOT/$1.log"
    local pins="$ROOT/$1-pins.txt"
    printf 'torch==%s\nnumpy==%s\n' "${TORCH[$end]}" "${NUMPY[$end]}" > "$pins"
    echo "== $end: ${PYTHON[$end]}, torch ${TORCH[$end]}, numpy ${NUMPY[$end]} (log: $log)"
    if [[ ! -x "$venv/bin/python" ]]; then
        "${PYTHON[$end]}" -m venv "$venv" \
            || { SUMMARY+=("$end: no ${PYTHON[$end]} (set PYTHON_${end^^})"); return; }
    fi
    # shellcheck disable=SC2086
    if ! { "$venv/bin/python" -m pip install -q ${TORCH_INDEX:-} "torch==${TORCH[$end]}" \
           && "$venv/bin/python" -m pip install -q -c "$pins" "numpy==${NUMPY[$end]}" \
           && "$venv/bin/python" -m pip install -q -c "$pins" -e "$REPO[test]"; } >> "$log" 2>&1; then
        SUMMARY+=("$end: install failed (see $log)"); return
    fi
    local versions
    versions="$("$venv/bin/python" -c 'import sys, torch, numpy
print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, numpy {numpy.__version__}")')"
    local job="failed"
    # a hang guard: the job takes under a minute
    if (cd "$REPO" && timeout 600 "$venv/bin/python" -m torch.distributed.run --standalone \
            --nproc_per_node=2 -m mdloader train examples/water/input.json --numb-steps 20 \
            --output "$ROOT/$end-run") >> "$log" 2>&1
    then job="passed"; fi
    local tests
    tests="$(cd "$REPO" && MDLOADER_TESTS_WITHOUT_DEEPMD=1 "$venv/bin/python" -m pytest -q \
             -p no:cacheprovider -o addopts="" 2>&1 | tee -a "$log" | tail -n 1)"
    local line="$end ($versions): main job $job; tests: $tests"
    if [[ "${MATRIX_DEEPMD:-0}" == "1" ]] && ! version_at_least "${TORCH[$end]}" "$DEEPMD_TORCH"
    then  # DeePMD-kit 3.2's PyTorch backend imports torch.library.triton_op (torch 2.6)
        line="$line; mdloader dp not run (DeePMD-kit 3.2 needs torch $DEEPMD_TORCH or newer)"
    elif [[ "${MATRIX_DEEPMD:-0}" == "1" ]]; then
        local dp="failed"
        local dp_python="$ROOT/$end-deepmd/bin/python" work="$ROOT/$end-dp"
        mkdir -p "$work"
        if PYTHON="$venv/bin/python" bash "$HERE/deepmd-env.sh" "$ROOT/$end-deepmd" >> "$log" 2>&1 \
           && "$dp_python" - "$REPO/examples/water" "$work" <<'PY' >> "$log" 2>&1 \
           && (cd "$work" && "$dp_python" -m torch.distributed.run --standalone \
                 --nproc_per_node=2 -m mdloader dp --pt train input.json) >> "$log" 2>&1
import json, os, sys
# the water example's input, 20 steps, its data reached from a scratch folder
source, work = sys.argv[1:]
config = json.load(open(os.path.join(source, "input.json")))
config["training"]["numb_steps"] = 20
if not os.path.exists(os.path.join(work, "data")):
    os.symlink(os.path.join(source, "data"), os.path.join(work, "data"))
json.dump(config, open(os.path.join(work, "input.json"), "w"))
PY
        then dp="passed"; fi
        line="$line; mdloader dp $dp"
    fi
    SUMMARY+=("$line")
}

for end in "${ENDS[@]}"; do
    [[ -v "TORCH[$end]" ]] || { echo "unknown end: $end (lowest or newest)"; exit 2; }
    run_end "$end"
done
echo "== summary"
printf '%s\n' "${SUMMARY[@]}"
status=0
for line in "${SUMMARY[@]}"; do
    [[ "$line" == *"main job passed; tests: "*" passed"* && "$line" != *failed* ]] || status=1
done
exit "$status"
