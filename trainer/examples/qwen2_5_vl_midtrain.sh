#!/usr/bin/env bash
# Stage 2, mid-training: every module trains (vision encoder, adapter, language model), starting from the
# alignment checkpoint's weights (--finetune: iteration, optimizer, scheduler and data start fresh; the model's
# config.json comes from the checkpoint folder).
#   bash trainer/examples/qwen2_5_vl_midtrain.sh ALIGN_CKPT DATA_DIR [CKPT_DIR] [extra flags]
# Next stage: qwen2_5_vl_sft.sh CKPT_DIR ...
# NPROC (default 8) processes; TORCHRUN overrides the launcher (default: torchrun).
set -euo pipefail

init=${1:?usage: qwen2_5_vl_midtrain.sh ALIGN_CKPT DATA_DIR [CKPT_DIR] [extra flags]}
data=${2:?packed dataset path or URL}
shift 2
ckpt=${1:-checkpoints/qwen2_5_vl-mid}
[ $# -gt 0 ] && shift
export CUDA_DEVICE_MAX_CONNECTIONS=1
# shellcheck disable=SC2086  # TORCHRUN may be a command with arguments
exec ${TORCHRUN:-torchrun} --nproc_per_node "${NPROC:-8}" -m mmpack.trainer.pretrain_vlm \
    --load "$init" --finetune --data-path "$data" \
    --trainable-modules adapter,vision_model,language_model \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel \
    --use-distributed-optimizer \
    --bf16 --attention-softmax-in-fp32 --accumulate-allreduce-grads-in-fp32 \
    --recompute-activations \
    --micro-batch-size 1 --global-batch-size 256 \
    --lr 2e-5 --min-lr 2e-6 --lr-warmup-iters 100 --lr-decay-style cosine --clip-grad 1.0 \
    --weight-decay 0.0 --train-iters 5000 \
    --log-interval 10 --save "$ckpt" --save-interval 500 \
    "$@"
