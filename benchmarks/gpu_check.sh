#!/usr/bin/env bash
# GPU check of the trainer on one CUDA machine, under 8 minutes: THD vs block-mask equality, bf16 throughput
# of a ~0.5B random qwen2_5_vl at seq 8192 (tokens/s, TFLOPs, MFU), save/load/resume, CP 2 (TE THD, 2 GPUs) vs CP 1.
#   bash benchmarks/gpu_check.sh            # on a CUDA machine
#   bash benchmarks/gpu_check.sh --dry-run  # everything but CUDA, on CPU (what CI runs)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
exec python benchmarks/gpu_check.py "$@"
