#!/usr/bin/env bash
# Recipes for trainer.pretrain_vlm. Usage:
#   bash trainer/examples/pretrain_vlm.sh gpu8 DATA_DIR [CKPT_DIR]   # 8 GPUs: TP2 x PP2 x DP2, bf16 + fp32 islands
#   bash trainer/examples/pretrain_vlm.sh cpu  DATA_DIR               # CPU smoke run: 8 gloo processes, tiny model
# DATA_DIR is a packed dataset made by `mmpack pack` (a folder, s3://bucket/prefix or http(s):// URL).
# Extra flags after the arguments are passed through, e.g. --train-iters 50.
set -euo pipefail

recipe=${1:?usage: pretrain_vlm.sh gpu8|cpu DATA_DIR [CKPT_DIR] [extra flags]}
data=${2:?packed dataset path or URL}
shift 2

case "$recipe" in
gpu8)
    ckpt=${1:-checkpoints/vlm-small}
    [ $# -gt 0 ] && shift
    export CUDA_DEVICE_MAX_CONNECTIONS=1  # keeps TP communication in issue order (Megatron requirement with SP)
    exec torchrun --nproc_per_node 8 -m trainer.pretrain_vlm \
        --data-path "$data" \
        --model-size small \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel \
        --use-distributed-optimizer \
        --bf16 --fp32-residual-connection --attention-softmax-in-fp32 --accumulate-allreduce-grads-in-fp32 \
        --recompute-activations \
        --micro-batch-size 2 --global-batch-size 64 \
        --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 100 --lr-decay-style cosine --clip-grad 1.0 \
        --weight-decay 0.1 --train-iters 2000 \
        --log-interval 10 --save "$ckpt" --load "$ckpt" --save-interval 500 \
        "$@"
    ;;
cpu)
    # 8 CPU processes (gloo): TP2 x PP2 x DP2 on a tiny model; a minute or two on a laptop.
    exec python -m torch.distributed.run --nproc_per_node 8 -m trainer.pretrain_vlm \
        --data-path "$data" \
        --model-size tiny \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
        --micro-batch-size 1 --global-batch-size 8 \
        --lr 3e-3 --lr-warmup-iters 2 --train-iters 20 --log-interval 1 --num-workers 1 \
        "$@"
    ;;
*)
    echo "unknown recipe '$recipe' (gpu8 or cpu)" >&2
    exit 2
    ;;
esac
