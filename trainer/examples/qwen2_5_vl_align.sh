#!/usr/bin/env bash
# Stage 1, alignment: only the adapter (the vision merger / projector) trains, from a HuggingFace Qwen2.5-VL
# folder; vision encoder and language model stay frozen.
#   bash trainer/examples/qwen2_5_vl_align.sh HF_DIR DATA_DIR [CKPT_DIR] [extra flags]
# DATA_DIR: packed with the model's tokenizer and image rule (`mmpack pack --model HF_DIR ...`); the trainer
# refuses a dataset packed for another model. Next stage: qwen2_5_vl_midtrain.sh CKPT_DIR ...
# NPROC (default 8) processes; TORCHRUN overrides the launcher (default: torchrun).
set -euo pipefail

hf=${1:?usage: qwen2_5_vl_align.sh HF_DIR DATA_DIR [CKPT_DIR] [extra flags]}
data=${2:?packed dataset path or URL}
shift 2
ckpt=${1:-checkpoints/qwen2_5_vl-align}
[ $# -gt 0 ] && shift
export CUDA_DEVICE_MAX_CONNECTIONS=1  # keeps TP communication in issue order (Megatron requirement with SP)
# shellcheck disable=SC2086  # TORCHRUN may be a command with arguments
exec ${TORCHRUN:-torchrun} --nproc_per_node "${NPROC:-8}" -m mmpack.trainer.pretrain_vlm \
    --hf-model "$hf" --data-path "$data" \
    --trainable-modules adapter \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel \
    --bf16 --attention-softmax-in-fp32 --accumulate-allreduce-grads-in-fp32 \
    --micro-batch-size 1 --global-batch-size 256 \
    --lr 1e-3 --min-lr 1e-5 --lr-warmup-iters 30 --lr-decay-style cosine --clip-grad 1.0 \
    --weight-decay 0.0 --train-iters 1000 \
    --log-interval 10 --save "$ckpt" --save-interval 250 \
    "$@"
