#!/usr/bin/env bash
# The project's GPU suite, under one deadline, so that it always writes its results.
#
#   bash run_suite.sh [--out DIR] [--deadline SECONDS|Nm] [--cpu-smoke] [--work DIR] [-- suite options]
#
# In a bundle (`bash run.sh gpu-bundle DIR`): installs the bundle's wheels with `pip --target`
# into a scratch folder (no index, no network; wheels-if-missing/M only where `import M` fails),
# puts it first on PYTHONPATH, then runs project/tools/gpu_suite.py.  In a checkout
# (tools/run_suite.sh): installs nothing; the environment must have torch, DeepSpeed and the six
# packages (pip install -e packages/...), and runs tools/gpu_suite.py.
#
# Results: results.json and results.md (plus logs) in --out (default: $OUT, else ./suite-results).
# The deadline (default 480 s = 8 minutes) counts from this script's start, install included.
# TORCH_CUDA_ARCH_LIST defaults to the device's compute capability; TORCH_EXTENSIONS_DIR to a
# folder in the scratch folder (--work, default a new temporary folder; it holds the nvme section's
# swap files, written with O_DIRECT: give a folder on a disk where TMPDIR is a tmpfs); MAX_JOBS to nproc.
# --cpu-smoke: a tiny model and few steps on CPU (the check that the suite itself works).
# Environment: PYTHON (default python3).
set -uo pipefail

T0=$(date +%s)
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-$PWD/suite-results}
DEADLINE=480
WORK=""
SUITE_ARGS=()
while (($#)); do
    case "$1" in
    --out) OUT_DIR=$2; shift 2 ;;
    --deadline) DEADLINE=$2; shift 2 ;;
    --work) WORK=$2; shift 2 ;;
    --cpu-smoke) SUITE_ARGS+=(--cpu-smoke); shift ;;
    --) shift; SUITE_ARGS+=("$@"); break ;;
    -h | --help) sed -n '2,18p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "run_suite.sh: unknown option $1 (accepted: --out DIR, --deadline SECONDS|Nm, --cpu-smoke, --work DIR, -- suite options)" >&2; exit 2 ;;
    esac
done
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
WORK=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/zerohooks-suite.XXXXXX")}
mkdir -p "$WORK"
LOG=$OUT_DIR/install.log
: >"$LOG"

# results even when the install fails: a small JSON and markdown naming the failure
fail() {
    local why=$1
    "$PY" - "$OUT_DIR" "$why" "$LOG" <<'EOF' || printf '# GPU suite\n\nFAILED before the suite: %s\n' "$2" >"$OUT_DIR/results.md"
import json, sys, pathlib
out, why, log = pathlib.Path(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
tail = log.read_text(errors="replace")[-3000:] if log.is_file() else ""
out.joinpath("results.json").write_text(json.dumps({"status": "failed", "error": why, "log_tail": tail}, indent=1))
out.joinpath("results.md").write_text(f"# GPU suite\n\nFAILED before the suite: {why}\n\n```\n{tail}\n```\n")
EOF
    echo "run_suite.sh: $why (see $OUT_DIR/results.md)" >&2
    exit 1
}

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
    "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
        --target "$WORK/site" "${wheels[@]}" >>"$LOG" 2>&1 || fail "pip install --target $WORK/site failed"
    export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
else
    PROJECT=$(cd "$HERE/.." && pwd) # a checkout: tools/run_suite.sh
fi

export PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$WORK/ext}
export MAX_JOBS=${MAX_JOBS:-$(nproc 2>/dev/null || echo 4)}
if [[ -z ${TORCH_CUDA_ARCH_LIST:-} ]]; then
    arch=$("$PY" -c 'import torch; c = torch.cuda.get_device_capability() if torch.cuda.is_available() else None; print(f"{c[0]}.{c[1]}" if c else "")' 2>>"$LOG")
    [[ -n $arch ]] && export TORCH_CUDA_ARCH_LIST=$arch
fi
echo "=== [$(($(date +%s) - T0))s] suite: project $PROJECT, out $OUT_DIR, deadline in $((DEADLINE_AT - $(date +%s))) s, TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-none}" | tee -a "$LOG" >&2
cd "$PROJECT" || fail "no project folder $PROJECT"
exec "$PY" tools/gpu_suite.py --deadline-at "$DEADLINE_AT" --out "$OUT_DIR" --work "$WORK" "${SUITE_ARGS[@]}"
