#!/usr/bin/env bash
# The project's commands, each working on a fresh machine (Python 3.10+ with pip):
#   bash run.sh demo [demo options]   the training demo (examples/train_gpt.py) in a nox-made venv
#   bash run.sh examples [options]    the Trainer and accelerate examples under torchrun (`nox -s examples`)
#   bash run.sh test [nox options]    the test suite: `nox` (every package, integration, frameworks, lint, typecheck)
#   bash run.sh gpu-bundle DIR [opts] a folder that runs the GPU suite on a machine without network
#                                     (tools/gpu_bundle.py; then on that machine: bash DIR/run_suite.sh)
#   bash run.sh --help                these lines' usage; installs nothing
# It checks the command first (an unknown one is named, with the commands), then installs what is
# missing (nox, uv into $PYTHON with pip; g++ / libaio-dev through apt when needed), then runs nox,
# which builds its own virtual environments with torch pinned by constraints.txt. `demo` reuses its
# venv without installing when packages/*/pyproject.toml, constraints.txt and examples/requirements.txt
# are unchanged (ZEROHOOKS_REINSTALL=1 forces the install), and builds the plugins' C++ kernels before
# it starts the ranks (python -m zerohooks.build), saying so.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")"

PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PIP_DISABLE_PIP_VERSION_CHECK=1

log() { printf 'run.sh: %s\n' "$*" >&2; }

COMMANDS="demo, examples, test, gpu-bundle"
usage() {
    cat <<'USAGE'
usage: bash run.sh COMMAND [options]
  demo [demo options]      the training demo (examples/train_gpt.py; bash run.sh demo --help for its options)
  examples [options]       the Trainer and accelerate examples under torchrun
  test [nox options]       the test suite (nox: every package, integration, frameworks, lint, typecheck)
  gpu-bundle DIR [opts]    a folder that runs the GPU suite on a machine without network
  --help                   this text (installs nothing)
USAGE
}

# --- the command first: a misspelt command or --help installs nothing --------------------------
case "${1:-}" in
-h | --help | help)
    usage
    exit 0
    ;;
demo | examples | test | gpu-bundle) ;;
"")
    log "no command given; commands: $COMMANDS"
    usage >&2
    exit 2
    ;;
*)
    log "unknown command '$1'; commands: $COMMANDS (bash run.sh --help)"
    exit 2
    ;;
esac

# --- system packages, only when really needed ------------------------------------------------
apt_packages=()
command -v c++ >/dev/null 2>&1 || apt_packages+=(g++) # torch/DeepSpeed JIT-build C++ ops
if [[ -d packages/nvmeswap ]] && ! dpkg -s libaio-dev >/dev/null 2>&1; then
    apt_packages+=(libaio-dev) # DeepSpeed's own async_io op: the NVMe swap tests' oracle, the demo's ds-nvme run (nvmeswap does not need it)
fi
if [[ $(id -u) == 0 ]] && ! { command -v ip && command -v tc; } >/dev/null 2>&1; then
    apt_packages+=(iproute2) # ip netns, veth, tc: the emulated nodes of the two-node tests (skipped without)
fi
if ((${#apt_packages[@]})); then
    as_root=()
    [[ $(id -u) == 0 ]] || as_root=(sudo -n) # apt needs root: sudo without a password prompt, else say what is missing
    if [[ $(id -u) == 0 ]] || sudo -n true 2>/dev/null; then
        log "apt-get install ${apt_packages[*]}"
        export DEBIAN_FRONTEND=noninteractive
        "${as_root[@]}" apt-get update -qq
        "${as_root[@]}" apt-get install -y -qq --no-install-recommends "${apt_packages[@]}"
    else
        log "not root: not installing ${apt_packages[*]} (apt-get needs root); without g++ nothing builds, without libaio-dev DeepSpeed's NVMe offload is skipped"
    fi
fi

# --- Python tools -----------------------------------------------------------------------------
if ! "$PYTHON" -m nox --version >/dev/null 2>&1; then
    log "installing nox"
    "$PYTHON" -m pip install --quiet "nox>=2024.10.9"
fi
# uv makes venv creation and installs several times faster; nox falls back to virtualenv + pip.
if ! command -v uv >/dev/null 2>&1 && ! "$PYTHON" -m uv --version >/dev/null 2>&1; then
    log "installing uv"
    "$PYTHON" -m pip install --quiet uv || log "could not install uv; nox will use virtualenv + pip"
fi
if command -v pyenv >/dev/null 2>&1; then
    pyenv rehash || true # new console scripts (nox, uv) get their pyenv shims
fi
if command -v nox >/dev/null 2>&1; then
    nox_cmd=(nox)
else
    nox_cmd=("$PYTHON" -m nox)
fi
log "$("$PYTHON" --version 2>&1), nox $("${nox_cmd[@]}" --version 2>&1), $(uv --version 2>/dev/null || echo 'no uv')"

case "${1:-}" in
demo)
    shift
    exec "${nox_cmd[@]}" -s demo -- "$@"
    ;;
examples)
    shift
    exec "${nox_cmd[@]}" -s examples -- "$@"
    ;;
test)
    shift
    "$PYTHON" tools/test_plan.py "$@" || true # the sessions and the minutes they took here, before they start
    # the default sessions in lanes side by side (ZEROHOOKS_TEST_LANES; default two lanes on 2-5 CPUs,
    # one per 2 CPUs beyond, at most 3; one lane, plain nox, on 1 CPU); named sessions: plain nox
    exec "$PYTHON" tools/test_lanes.py "$@"
    ;;
gpu-bundle)
    shift
    here=$PWD
    cd "${OLDPWD:-$PWD}" # DIR is relative to where run.sh was started (the cd above set OLDPWD)
    exec "$PYTHON" "$here/tools/gpu_bundle.py" "$@"
    ;;
*) # not reached: the command was checked above
    usage >&2
    exit 2
    ;;
esac
