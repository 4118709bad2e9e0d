#!/usr/bin/env bash
# LLaVA-OneVision-2 stage 2, mid-training: every module trains (adapter, vision_model, language_model), from the
# alignment checkpoint; the flags of its examples/llava_onevision2/quick_start_4b/quick_start.sh (full-parameter,
# full recompute of one layer per chunk).
#   bash trainer/examples/llava_onevision2_midtrain.sh INIT_CKPT DATA_DIR [CKPT_DIR] [extra flags]
# INIT_CKPT: llava_onevision2_align.sh's checkpoint folder (weights only: --load ... --finetune). TP, PP, SEQ_LEN,
# MBS, GBS, NSTEP, CUSTOM_PIPELINE_LAYERS, NPROC, TORCHRUN and MODEL_TYPE as in llava_onevision2_align.sh.
# Next: llava_onevision2_instruct.sh.
set -euo pipefail

init=${1:?usage: llava_onevision2_midtrain.sh INIT_CKPT DATA_DIR [CKPT_DIR] [extra flags]}
data=${2:?packed dataset path or URL}
shift 2
ckpt=${1:-checkpoints/llava_onevision2-mid}
[ $# -gt 0 ] && shift
TP=${TP:-2} PP=${PP:-4} SEQ_LEN=${SEQ_LEN:-32768} MBS=${MBS:-1} GBS=${GBS:-8} NSTEP=${NSTEP:-2500}
CUSTOM_PIPELINE_LAYERS=${CUSTOM_PIPELINE_LAYERS:-0,12,12,12}
pipeline=()
if [ "$PP" -gt 1 ] && [ -n "$CUSTOM_PIPELINE_LAYERS" ]; then pipeline=(--custom-pipeline-layers "$CUSTOM_PIPELINE_LAYERS"); fi
export CUDA_DEVICE_MAX_CONNECTIONS=1
# shellcheck disable=SC2086  # TORCHRUN may be a command with arguments
exec ${TORCHRUN:-torchrun} --nproc_per_node "${NPROC:-8}" -m mmpack.trainer.pretrain_vlm \
    --load "$init" --finetune --model-type "${MODEL_TYPE:-llava_onevision2}" --model-name llava-onevision2-4b-p14m2 \
    --tokenizer-type HFTokenizer --data-path "$data" --dataloader-type external \
    --split 100,0,0 --num-workers 16 --chat-template qwen2-vl \
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
    --training-phase sft --trainable-modules language_model adapter vision_model --seq-length "$SEQ_LEN" \
    --max-position-embeddings 32768 --init-method-std 0.02 --micro-batch-size "$MBS" --global-batch-size "$GBS" \
    --lr 1.0e-5 --min-lr 1.0e-6 --clip-grad 1.0 --weight-decay 0 --optimizer adam \
    --adam-beta1 0.9 --adam-beta2 0.99 --adam-eps 1e-05 --norm-epsilon 1e-6 \
    --train-iters "$NSTEP" --lr-decay-iters "$NSTEP" --lr-decay-style cosine --lr-warmup-fraction 0.002 \
    --initial-loss-scale 65536 --bf16 --save "$ckpt" --save-interval 2000 \
    --attention-backend flash --pipeline-model-parallel-size "$PP" --tensor-model-parallel-size "$TP" \
    --use-distributed-optimizer --distributed-backend nccl "${pipeline[@]}" \
    --log-interval 1 --tensorboard-dir "$ckpt/tensorboard" --log-timers-to-tensorboard \
    "$@"
