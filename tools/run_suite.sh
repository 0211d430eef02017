#!/usr/bin/env bash
# The project's GPU suite in one slot: a time plan for --budget seconds (default: the deadline), a
# hard --deadline (default 500 s), and at most 4 files at the top of --out whatever happens.
#
#   bash run_suite.sh [--out DIR] [--deadline SECONDS|Nm] [--budget SECONDS] [--skip S1,S2]
#                     [--cpu-smoke] [--work DIR] [-- suite options]
#
# In a bundle (`bash run.sh gpu-bundle DIR`): installs the bundle's wheels with `pip --target`
# into a scratch folder (no index, no network; wheels-if-missing/M only where `import M` fails),
# puts it first on PYTHONPATH (and its bin/, the ninja wheel's, on PATH), then runs
# project/tools/gpu_suite.py.  In a checkout (tools/run_suite.sh): installs nothing; the
# environment must have torch, DeepSpeed and the six packages, and runs tools/gpu_suite.py.
#
# --out (default: $OUT, else ./suite-results) gets results.json, results.md, logs.tgz (every log
# and per-section JSON, install log included, refreshed after each section) and console.log.
# The deadline counts from this script's start, install included; SIGTERM from outside stops the
# running section's processes and still writes the results.  --skip: sections an earlier run did
# (its results.json says `continue_skip`).  TORCH_CUDA_ARCH_LIST defaults to the device's compute
# capability (nvidia-smi, else torch, each under a timeout); CUDA_HOME to the real nvcc's folder
# (tools/suite_env.py); TORCH_EXTENSIONS_DIR to a folder in the scratch folder (--work, default a
# new temporary folder; it holds the nvme section's swap files, written with O_DIRECT: give a
# folder on a disk where TMPDIR is a tmpfs); MAX_JOBS to nproc.
# --cpu-smoke: a tiny model and few steps on CPU (the check that the suite itself works).
# Environment: PYTHON (default python3).
set -uo pipefail

T0=$(date +%s)
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-$PWD/suite-results}
DEADLINE=500
WORK=""
BUDGET=""
SKIP=""
SUITE_ARGS=()
while (($#)); do
    case "$1" in
    --out) OUT_DIR=$2; shift 2 ;;
    --deadline) DEADLINE=$2; shift 2 ;;
    --work) WORK=$2; shift 2 ;;
    --budget) BUDGET=$2; shift 2 ;;
    --skip) SKIP=$2; shift 2 ;;
    --cpu-smoke) SUITE_ARGS+=(--cpu-smoke); shift ;;
    --) shift; SUITE_ARGS+=("$@"); break ;;
    -h | --help) sed -n '2,25p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "run_suite.sh: unknown option $1 (accepted: --out DIR, --deadline SECONDS|Nm, --budget SECONDS, --skip S1,S2, --cpu-smoke, --work DIR, -- suite options)" >&2; exit 2 ;;
    esac
done
[[ -n $BUDGET ]] && SUITE_ARGS=(--budget "$BUDGET" "${SUITE_ARGS[@]}")
[[ -n $SKIP ]] && SUITE_ARGS=(--skip "$SKIP" "${SUITE_ARGS[@]}")
case "$DEADLINE" in
*m) DEADLINE=$((${DEADLINE%m} * 60)) ;;
esac
if ! [[ $DEADLINE =~ ^[0-9]+$ ]] || ((DEADLINE < 10)); then
    echo "run_suite.sh: --deadline must be a number of seconds (at least 10) or Nm, got '$DEADLINE'" >&2
    exit 2
fi
DEADLINE_AT=$((T0 + DEADLINE))
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
# the console, also into OUT/console.log (tee ignores TERM/INT: the suite's last words reach it)
exec > >(trap '' TERM INT; exec tee -a "$OUT_DIR/console.log") 2>&1
WORK=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/zerohooks-suite.XXXXXX")}
mkdir -p "$WORK/logs"
WORK=$(cd "$WORK" && pwd)
LOG=$WORK/logs/install.log
: >"$LOG"

# results even when the install fails: results.json, results.md and logs.tgz naming the failure
fail() {
    local why=$1
    "$PY" - "$OUT_DIR" "$why" "$LOG" "$WORK/logs" <<'EOF' || printf '# GPU suite\n\nFAILED before the suite: %s\n' "$why" >"$OUT_DIR/results.md"
import json, sys, pathlib, tarfile
out, why, log, logs = pathlib.Path(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3]), sys.argv[4]
tail = log.read_text(errors="replace")[-3000:] if log.is_file() else ""
out.joinpath("results.json").write_text(json.dumps({"status": "failed", "error": why, "log_tail": tail}, indent=1))
out.joinpath("results.md").write_text(f"# GPU suite\n\nFAILED before the suite: {why}\n\n```\n{tail}\n```\n")
with tarfile.open(out / "logs.tgz", "w:gz") as t:
    t.add(logs, arcname="logs")
EOF
    echo "run_suite.sh: $why (see $OUT_DIR/results.md)" >&2
    exit 1
}

# SIGTERM/SIGINT during the install: stop the running child, write the results
CHILD=""
bg() { "$@" & CHILD=$!; wait "$CHILD"; local rc=$?; CHILD=""; return $rc; }
on_signal() {
    [[ -n $CHILD ]] && kill -TERM "$CHILD" 2>/dev/null
    fail "stopped by $1 from outside during the install, $(($(date +%s) - T0)) s after the start"
}
# pip install for $PY, also where $PY has no pip (a venv made by uv): python3's pip with --python
pip_install() {
    local flags=(-q --no-index --no-deps --no-compile --disable-pip-version-check)
    if "$PY" -m pip --version >/dev/null 2>&1; then
        bg "$PY" -m pip install "${flags[@]}" "$@"
    elif python3 -m pip --version >/dev/null 2>&1; then
        echo "$PY has no pip: python3 -m pip --python $PY"
        bg python3 -m pip --python "$PY" install "${flags[@]}" "$@"
    elif command -v uv >/dev/null 2>&1; then
        echo "$PY has no pip: uv pip --python $PY"
        bg uv pip install -q --python "$PY" --no-index --no-deps "$@"
    else
        echo "no pip for $PY: neither $PY -m pip, python3 -m pip nor uv"
        return 1
    fi
}
trap 'on_signal SIGTERM' TERM
trap 'on_signal SIGINT' INT

command -v "$PY" >/dev/null 2>&1 || { echo "run_suite.sh: no $PY (set PYTHON)" >&2; exit 1; }

if [[ -d $HERE/wheels ]]; then
    PROJECT=$HERE/project
    want=$(tr -d '[:space:]' <"$HERE/PYTHON_VERSION")
    have=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    [[ $want == "$have" ]] || fail "this bundle carries wheels for CPython $want, but $PY is $have: make one with \`bash run.sh gpu-bundle DIR --python-version $have\`"
    "$PY" -c 'import torch' >>"$LOG" 2>&1 || fail "$PY cannot import torch: install a CUDA build of torch first (the bundle does not carry torch)"
    wheels=("$HERE"/wheels/*.whl)
    for d in "$HERE"/wheels-if-missing/*/; do
        m=$(basename "$d")
        if "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$m') is None)" 2>/dev/null; then
            echo "have $m: not installing the bundle's copy" >>"$LOG"
        else
            wheels+=("$d"*.whl)
        fi
    done
    echo "=== [$(($(date +%s) - T0))s] installing ${#wheels[@]} wheels into $WORK/site" | tee -a "$LOG" >&2
    pip_install --target "$WORK/site" "${wheels[@]}" >>"$LOG" 2>&1 || fail "pip install --target $WORK/site failed"
    export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
    # C libraries the machine lacks (libaio, for DeepSpeed's NVMe offload): unpacked into the
    # scratch folder and put on the compiler's and the loader's paths
    for d in "$HERE"/debs-if-missing/*/; do
        [[ -d $d ]] || continue
        lib=$(basename "$d")
        if [[ -z ${ZEROHOOKS_BUNDLE_UNPACK_DEBS:-} ]] &&
            "$PY" -c "import ctypes.util, sys; sys.exit(ctypes.util.find_library('$lib') is None)" 2>/dev/null; then
            echo "have lib$lib: not unpacking the bundle's copy" >>"$LOG"
            continue
        fi
        if ! command -v dpkg-deb >/dev/null 2>&1; then
            echo "=== no dpkg-deb: the bundle's lib$lib is not unpacked" | tee -a "$LOG" >&2
            continue
        fi
        for deb in "$d"*.deb; do dpkg-deb -x "$deb" "$WORK/sysroot" >>"$LOG" 2>&1; done
        so=$(find "$WORK/sysroot" -name "lib$lib.so" | head -1)
        if [[ -z $so ]]; then
            echo "=== the bundle's lib$lib packages hold no lib$lib.so" | tee -a "$LOG" >&2
            continue
        fi
        libdir=$(dirname "$so")
        inc=$WORK/sysroot/usr/include
        export CPATH="$inc${CPATH:+:$CPATH}" LIBRARY_PATH="$libdir${LIBRARY_PATH:+:$LIBRARY_PATH}"
        export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        export CFLAGS="-I$inc${CFLAGS:+ $CFLAGS}" LDFLAGS="-L$libdir${LDFLAGS:+ $LDFLAGS}"
        echo "=== [$(($(date +%s) - T0))s] unpacked lib$lib from the bundle into $WORK/sysroot" | tee -a "$LOG" >&2
    done
    # the ninja wheel's script: torch's extension builds need ninja on PATH
    if ! command -v ninja >/dev/null 2>&1 && [[ -x $WORK/site/bin/ninja ]]; then
        export PATH="$WORK/site/bin:$PATH"
    fi
else
    PROJECT=$(cd "$HERE/.." && pwd) # a checkout: tools/run_suite.sh
fi

export PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$WORK/ext}
export MAX_JOBS=${MAX_JOBS:-$(nproc 2>/dev/null || echo 4)}
if [[ -z ${TORCH_CUDA_ARCH_LIST:-} && " ${SUITE_ARGS[*]} " != *" --cpu-smoke "* ]]; then
    # one timed probe: nvidia-smi (fast), else torch; a hung driver costs at most 20 + 60 s
    arch=$(timeout 20 nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>>"$LOG" | head -n1 | tr -d '[:space:]')
    if ! [[ $arch =~ ^[0-9]+\.[0-9]+$ ]]; then
        arch=$(timeout 60 "$PY" -c 'import torch; c = torch.cuda.get_device_capability() if torch.cuda.is_available() else None; print(f"{c[0]}.{c[1]}" if c else "")' 2>>"$LOG")
    fi
    [[ $arch =~ ^[0-9]+\.[0-9]+$ ]] && export TORCH_CUDA_ARCH_LIST=$arch
fi
echo "=== [$(($(date +%s) - T0))s] suite: project $PROJECT, out $OUT_DIR, deadline in $((DEADLINE_AT - $(date +%s))) s, TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-none}" | tee -a "$LOG" >&2
cd "$PROJECT" || fail "no project folder $PROJECT"
trap - TERM INT
exec "$PY" tools/gpu_suite.py --t0 "$T0" --deadline-at "$DEADLINE_AT" --out "$OUT_DIR" --work "$WORK" "${SUITE_ARGS[@]}"
