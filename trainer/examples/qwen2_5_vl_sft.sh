#!/usr/bin/env bash
# Stage 3, supervised fine-tuning on instruction data (loss on the assistant turns, as packed): adapter and
# language model train, the vision encoder stays frozen (drop --freeze-vision to train it too), from the
# mid-training checkpoint's weights (--finetune).
#   bash trainer/examples/qwen2_5_vl_sft.sh MID_CKPT DATA_DIR [CKPT_DIR] [extra flags]
# Export the result: mmpack convert mcore-to-hf --ckpt CKPT_DIR --out HF_OUT
# NPROC (default 8) processes; TORCHRUN overrides the launcher (default: torchrun).
set -euo pipefail

init=${1:?usage: qwen2_5_vl_sft.sh MID_CKPT DATA_DIR [CKPT_DIR] [extra flags]}
data=${2:?packed dataset path or URL}
shift 2
ckpt=${1:-checkpoints/qwen2_5_vl-sft}
[ $# -gt 0 ] && shift
export CUDA_DEVICE_MAX_CONNECTIONS=1
# shellcheck disable=SC2086  # TORCHRUN may be a command with arguments
exec ${TORCHRUN:-torchrun} --nproc_per_node "${NPROC:-8}" -m mmpack.trainer.pretrain_vlm \
    --load "$init" --finetune --data-path "$data" \
    --freeze-vision \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel \
    --use-distributed-optimizer \
    --bf16 --attention-softmax-in-fp32 --accumulate-allreduce-grads-in-fp32 \
    --recompute-activations \
    --micro-batch-size 1 --global-batch-size 128 \
    --lr 1e-5 --min-lr 1e-6 --lr-warmup-iters 50 --lr-decay-style cosine --clip-grad 1.0 \
    --weight-decay 0.0 --train-iters 3000 \
    --log-interval 10 --save "$ckpt" --save-interval 500 \
    "$@"
