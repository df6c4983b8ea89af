#!/usr/bin/env bash
# The GPU machine's one call (the device tool), at most 8 minutes: the suite on CUDA, then the
# speed tables. Each step's log and a summary go under one folder ($OUT/gpu_check there).
#
#   here, once:  make gpu-wheels     (z3-solver and compressed-tensors, which that machine lacks)
#   device tool: command "bash bench/gpu_check.sh", carry [".whl"], timeout_s 540; give it back
#   on a CPU:    DEVICE=interpret PROFILE=smoke bash bench/gpu_check.sh   (tests/test_gpu_check.py)
#
# Steps: verify (make verify's stages on $DEVICE), pytest (the GPU subset), capture (CUDA
# graphs, sync mode, host overhead), memcheck (compute-sanitizer on a few shapes), tables
# (bench/gpu_check.py's timings). Each is passed, failed or unknown (could not run here, or
# timed out): never passed by skipping. Exit 1 if any failed, else 0.
set -uo pipefail
cd "$(dirname "$0")/.."

DEVICE=${DEVICE:-cuda}        # cuda | interpret
PROFILE=${PROFILE:-ci}        # ci | smoke (a few examples a property: this script's own test)
LOGS=${LOGS:-${OUT:-reports}/gpu_check}
STAGES=${STAGES:-}            # verify's stages to run, space-separated (default: every one)
SUBSET=${SUBSET:-tests/test_capture.py tests/test_devices.py tests/test_corpus.py tests/test_readme.py}
PYTHON=${PYTHON:-python3}
WORKERS=${WORKERS:-$(( $(nproc) > 8 ? 8 : $(nproc) ))}
mkdir -p "$LOGS"
: >"$LOGS/summary.txt"

if ls .whl/*.whl >/dev/null 2>&1; then  # carried wheels (make gpu-wheels), installed aside
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/exactness-site .whl/*.whl >"$LOGS/wheels.log" 2>&1 &&
        export PYTHONPATH=/tmp/exactness-site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export EXACTNESS_DEVICE=$DEVICE EXACTNESS_WORKERS=$WORKERS HYPOTHESIS_PROFILE=$PROFILE \
    EXACTNESS_REPORTS=$LOGS/reports EXACTNESS_COUNTEREXAMPLES=$LOGS/counterexamples
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # EXACTNESS_DEVICE decides it

{
    echo "gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null \
        | head -1 || true)"
    "$PYTHON" - <<'EOF'
import platform
from importlib import metadata
def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"
import torch
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {version('triton')}, "
      f"python {platform.python_version()}, z3-solver {version('z3-solver')}, "
      f"compressed-tensors {version('compressed-tensors')}")
EOF
    echo "device $DEVICE, profile $PROFILE, $WORKERS workers, commit $(git rev-parse --short HEAD \
        2>/dev/null || echo unknown), $(date -u +%FT%TZ)"
} 2>&1 | tee "$LOGS/header.txt"

FAILED=0
step() {  # step NAME SECONDS COMMAND...: the command's log in $LOGS/NAME.log, a verdict line
    local name=$1 seconds=$2 start=$SECONDS verdict rc
    shift 2
    timeout --kill-after=10 "$seconds" "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
    case $rc in
        0) verdict=passed
           # pytest's skips vouch for nothing
           if grep -Eq '[0-9]+ skipped' "$LOGS/$name.log"; then verdict="unknown (skips)"; fi ;;
        3) verdict="unknown (not here)" ;;
        124|137) verdict="unknown (timed out at ${seconds} s)" ;;
        *) verdict="failed (exit $rc)"; FAILED=1 ;;
    esac
    printf '%-9s %-30s %4d s  %s\n' "$name" "$verdict" $((SECONDS - start)) "$LOGS/$name.log" \
        | tee -a "$LOGS/summary.txt"
}

no_gpu() {  # exit 3 (unknown) where the step needs a GPU this device does not give
    [ "$DEVICE" = cuda ] || { echo "needs DEVICE=cuda"; exit 3; }
}

verify_args=(--device "$DEVICE")
[ "$PROFILE" = smoke ] && verify_args+=(--smoke)
for stage in $STAGES; do verify_args+=(--stage "$stage"); done
step verify 270 "$PYTHON" -m exactness verify "${verify_args[@]}"  # its reports: $LOGS/reports

# shellcheck disable=SC2086  # SUBSET is a list of paths
step pytest 60 "$PYTHON" -m pytest -q -p no:cacheprovider -rs -n "$WORKERS" $SUBSET

step capture 45 "$PYTHON" bench/gpu_check.py --parts capture

sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer \
    "$("$PYTHON" -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null)"/nvidia/*/bin/compute-sanitizer \
    2>/dev/null | head -1)
memcheck() {
    no_gpu
    [ -n "$sanitizer" ] || { echo "compute-sanitizer not found"; exit 3; }
    "$sanitizer" --tool memcheck --error-exitcode 1 "$PYTHON" bench/gpu_check.py --parts memcheck
}
export -f no_gpu memcheck
export DEVICE sanitizer PYTHON
step memcheck 45 bash -c memcheck

step tables 60 "$PYTHON" bench/gpu_check.py --parts exact,tables

echo "summary: $LOGS/summary.txt ($([ $FAILED = 0 ] && echo 'nothing failed' || echo 'a step FAILED'))"
exit $FAILED
