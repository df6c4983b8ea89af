#!/usr/bin/env bash
# One script for a GPU machine (device tool): install, check bit-exactness, time; ~5 minutes.
# Use: run with command "bash bench/gpu_check.sh", then give the machine back.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-deps -e . 2>/dev/null || true
python3 -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
unset TRITON_INTERPRET
PYTHONUNBUFFERED=1 PYTHONPATH=. python3 bench/gpu_check.py 2>&1 | tee "${OUT:-/tmp}/gpu_check.log"
