#!/usr/bin/env bash
# LLaVA-OneVision-2 stage 3, instruct: every module trains on instruction data, from the mid-training checkpoint;
# the flags of its examples/llava_onevision2/qwen3_30b_a3b/instruct_780k.sh for a dense model (the MoE ones,
# --num-experts 128 --moe-router-topk 8 --moe-aux-loss-coeff 0.01 --expert-model-parallel-size 8
# --moe-token-dispatcher-type alltoall --moe-per-layer-logging, pass through as extra flags for a Qwen3-MoE
# model). --length-sort-pool-size 1000 turns on --balance compute (bins are packed to even lengths offline).
#   bash trainer/examples/llava_onevision2_instruct.sh INIT_CKPT DATA_DIR [CKPT_DIR] [extra flags]
# TP, PP, SEQ_LEN, MBS, GBS, NSTEP, CUSTOM_PIPELINE_LAYERS, NPROC, TORCHRUN and MODEL_TYPE as in
# llava_onevision2_align.sh (SEQ_LEN 16000 and GBS 96 here, as in the script).
set -euo pipefail

init=${1:?usage: llava_onevision2_instruct.sh INIT_CKPT DATA_DIR [CKPT_DIR] [extra flags]}
data=${2:?packed dataset path or URL}
shift 2
ckpt=${1:-checkpoints/llava_onevision2-instruct}
[ $# -gt 0 ] && shift
TP=${TP:-2} PP=${PP:-4} SEQ_LEN=${SEQ_LEN:-16000} MBS=${MBS:-1} GBS=${GBS:-96} NSTEP=${NSTEP:-7709}
CUSTOM_PIPELINE_LAYERS=${CUSTOM_PIPELINE_LAYERS:-0,12,12,12}
pipeline=()
if [ "$PP" -gt 1 ] && [ -n "$CUSTOM_PIPELINE_LAYERS" ]; then pipeline=(--custom-pipeline-layers "$CUSTOM_PIPELINE_LAYERS"); fi
export CUDA_DEVICE_MAX_CONNECTIONS=1
# shellcheck disable=SC2086  # TORCHRUN may be a command with arguments
exec ${TORCHRUN:-torchrun} --nproc_per_node "${NPROC:-8}" -m mmpack.trainer.pretrain_vlm \
    --load "$init" --finetune --model-type "${MODEL_TYPE:-llava_onevision2}" --model-name llava-onevision2-4b \
    --tokenizer-type HFTokenizer --data-path "$data" --dataloader-type external \
    --split 100,0,0 --num-workers 2 --chat-template qwen2-vl --enable-discard-sample --length-sort-pool-size 1000 \
    --training-phase sft --trainable-modules language_model adapter vision_model --seq-length "$SEQ_LEN" \
    --max-position-embeddings "$SEQ_LEN" --init-method-std 0.02 --micro-batch-size "$MBS" --global-batch-size "$GBS" \
    --lr 1.0e-5 --min-lr 1.0e-6 --clip-grad 1.0 --weight-decay 0 --optimizer adam \
    --adam-beta1 0.9 --adam-beta2 0.99 --adam-eps 1e-05 --norm-epsilon 1e-6 \
    --train-iters "$NSTEP" --lr-decay-iters "$NSTEP" --lr-decay-style cosine --lr-warmup-fraction 0.002 \
    --initial-loss-scale 65536 --bf16 --save "$ckpt" --save-interval 1000 --ckpt-fully-parallel-load \
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
    --attention-backend flash --pipeline-model-parallel-size "$PP" --tensor-model-parallel-size "$TP" \
    --use-distributed-optimizer --distributed-backend nccl "${pipeline[@]}" \
    --log-interval 1 --tensorboard-dir "$ckpt/tensorboard" --log-timers-to-tensorboard \
    "$@"
