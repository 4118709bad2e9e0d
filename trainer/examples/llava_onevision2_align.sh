#!/usr/bin/env bash
# LLaVA-OneVision-2 stage 1, alignment: only the adapter (the patch merger) trains; the flags of its
# examples/llava_onevision2/qwen3_4b/alignment.sh (Qwen3-4B: 36 language layers; the vision tower and 0 of them on
# pipeline stage 0, 12 on each of stages 1-3).
#   bash trainer/examples/llava_onevision2_align.sh HF_DIR DATA_DIR [CKPT_DIR] [extra flags]
# HF_DIR: a LLaVA-OneVision-2 HuggingFace folder; DATA_DIR: packed from it (`mmpack pack --model HF_DIR ...`), whose
# tokenizer --hf-tokenizer-path checks. TP, PP, SEQ_LEN, MBS, GBS, NSTEP and CUSTOM_PIPELINE_LAYERS as in the
# script (TP 1 x PP 4 on 4 GPUs, TP 2 x PP 4 on 8, TP 8 x PP 1 without --custom-pipeline-layers). NPROC (default 8)
# processes; TORCHRUN overrides the launcher; MODEL_TYPE the family of a model without --hf-model.
# Without Transformer Engine or Apex, drop --use-distributed-optimizer at PP > 1 (a stage with nothing to
# train cannot checkpoint its empty optimizer shard; the trainer says so). Next: llava_onevision2_midtrain.sh.
set -euo pipefail

hf=${1:?usage: llava_onevision2_align.sh HF_DIR DATA_DIR [CKPT_DIR] [extra flags]}
data=${2:?packed dataset path or URL}
shift 2
ckpt=${1:-checkpoints/llava_onevision2-align}
[ $# -gt 0 ] && shift
TP=${TP:-2} PP=${PP:-4} SEQ_LEN=${SEQ_LEN:-32768} MBS=${MBS:-1} GBS=${GBS:-8} NSTEP=${NSTEP:-2500}
CUSTOM_PIPELINE_LAYERS=${CUSTOM_PIPELINE_LAYERS:-0,12,12,12}
pipeline=()
if [ "$PP" -gt 1 ] && [ -n "$CUSTOM_PIPELINE_LAYERS" ]; then pipeline=(--custom-pipeline-layers "$CUSTOM_PIPELINE_LAYERS"); fi
export CUDA_DEVICE_MAX_CONNECTIONS=1
# shellcheck disable=SC2086  # TORCHRUN may be a command with arguments
exec ${TORCHRUN:-torchrun} --nproc_per_node "${NPROC:-8}" -m mmpack.trainer.pretrain_vlm \
    --hf-model "$hf" --model-type "${MODEL_TYPE:-llava_onevision2}" --model-name llava-onevision2-4b \
    --tokenizer-type HFTokenizer --hf-tokenizer-path "$hf" --data-path "$data" --dataloader-type external \
    --split 100,0,0 --num-workers 16 --chat-template qwen2-vl \
    --training-phase sft --trainable-modules adapter --seq-length "$SEQ_LEN" --max-position-embeddings 32768 \
    --init-method-std 0.02 --micro-batch-size "$MBS" --global-batch-size "$GBS" \
    --lr 1.0e-4 --min-lr 1.0e-6 --clip-grad 1.0 --weight-decay 0 --optimizer adam \
    --adam-beta1 0.9 --adam-beta2 0.99 --adam-eps 1e-05 --norm-epsilon 1e-6 \
    --train-iters "$NSTEP" --lr-decay-iters "$NSTEP" --lr-decay-style cosine --lr-warmup-fraction 0.002 \
    --initial-loss-scale 65536 --bf16 --save "$ckpt" --save-interval 2000 \
    --attention-backend flash --pipeline-model-parallel-size "$PP" --tensor-model-parallel-size "$TP" \
    --use-distributed-optimizer --distributed-backend nccl "${pipeline[@]}" \
    --log-interval 1 --tensorboard-dir "$ckpt/tensorboard" --log-timers-to-tensorboard \
    "$@"
