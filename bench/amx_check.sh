#!/usr/bin/env bash
# Issue 39's checks on an Intel Xeon with AMX-INT8, in one run: the kernels' first runs and
# verdicts, the AMX table against both VNNI kernels and bf16 (2 threads, as the 2-core
# figures), the test suite and make verify's ci profile. The GPU is hidden: the machine is
# checked as a CPU machine with AMX. Logs go to $OUT (default reports/amx).
#
# The device machine (Python 3.12, torch 2.11, Triton 3.6, no network) lacks z3-solver,
# compressed-tensors and its needs; carry their wheels in .whl/ (docs/PERFORMANCE.md says which),
# and numpy 2.3: Triton 3.6's interpreter fails on numpy 2.4 and later.
set -u
OUT=${OUT:-reports/amx}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1 HYPOTHESIS_PROFILE=ci
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/exactness-cache}
PY=${PY:-python3}
export PYTHONPATH=$PWD
if [ -d "${WHEELS:-.whl}" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "${WHEELS:-.whl}"/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
{
    date -u; lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-200
    grep -o -w -E "amx_[a-z0-9]+|avx512_vnni" /proc/cpuinfo | sort | uniq -c
    cc --version | head -1
    $PY -c "import torch, numpy, triton; print('torch', torch.__version__, 'numpy',
                numpy.__version__, 'triton', triton.__version__)"
    # each C build's first run, in a child process: its verdict, or the signal that killed it
    time timeout 300 $PY -c "from exactness.kernels.cpu import amx_library, vnni_library
print("vnni:", vnni_library.status()[1].why); print("amx:", amx_library.status()[1].why)"
} > "$OUT/env.txt" 2>&1
pin=""
if taskset -c 0,1 true 2>/dev/null; then pin="taskset -c 0,1"; fi
{
    OMP_NUM_THREADS=2 timeout 150 $pin $PY bench/bench_forward.py --amx
    echo "bench exit $?"
    # wider scale spreads: shorter spans (default 2 binades: one span a row of blocks)
    OMP_NUM_THREADS=2 timeout 60 $pin $PY bench/bench_forward.py --amx --binades 6 --m 128 \
        --act-bits 16
} > "$OUT/bench.txt" 2>&1
timeout "${PYTEST_SECONDS:-300}" $PY -m pytest -n "${WORKERS:-14}" -q -p no:cacheprovider \
    > "$OUT/pytest.txt" 2>&1
echo "pytest exit $?" >> "$OUT/pytest.txt"
EXACTNESS_WORKERS=${WORKERS:-14} timeout "${VERIFY_SECONDS:-400}" $PY -m exactness verify \
    > "$OUT/verify.txt" 2>&1
echo "verify exit $?" >> "$OUT/verify.txt"
