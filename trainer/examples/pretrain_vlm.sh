#!/usr/bin/env bash
# Recipes for mmpack.trainer.pretrain_vlm. Usage:
#   bash trainer/examples/pretrain_vlm.sh gpu8 DATA_DIR [CKPT_DIR]   # 8 GPUs: TP2 x PP2 x DP2, bf16 + fp32 islands
#   bash trainer/examples/pretrain_vlm.sh cpu  DATA_DIR               # CPU smoke run: 8 gloo processes, tiny model
#   bash trainer/examples/pretrain_vlm.sh hf8  DATA_DIR HF_DIR [CKPT] # 8 GPUs from a HuggingFace Qwen2.5-VL folder
# DATA_DIR is a packed dataset made by `mmpack pack` (a folder, s3://bucket/prefix or http(s):// URL); for
# hf8 pack it with the model's tokenizer and image rule (`mmpack pack --model HF_DIR ...`).
# The random-model recipes build a small Qwen2.5-VL (sizes from --model-size); hf8 starts from the HF weights
# (each rank reads its TP/PP slice); `mmpack convert mcore-to-hf --ckpt CKPT --out DIR` exports the result.
# Extra flags after the arguments are passed through, e.g. --train-iters 50.
set -euo pipefail

recipe=${1:?usage: pretrain_vlm.sh gpu8|hf8|cpu DATA_DIR [HF_DIR] [CKPT_DIR] [extra flags]}
data=${2:?packed dataset path or URL}
shift 2

case "$recipe" in
gpu8)
    ckpt=${1:-checkpoints/vlm-small}
    [ $# -gt 0 ] && shift
    export CUDA_DEVICE_MAX_CONNECTIONS=1  # keeps TP communication in issue order (Megatron requirement with SP)
    exec torchrun --nproc_per_node 8 -m mmpack.trainer.pretrain_vlm \
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
hf8)
    hf=${1:?HuggingFace model folder (config.json + safetensors)}
    shift
    ckpt=${1:-checkpoints/qwen2_5_vl}
    [ $# -gt 0 ] && shift
    export CUDA_DEVICE_MAX_CONNECTIONS=1
    exec torchrun --nproc_per_node 8 -m mmpack.trainer.pretrain_vlm \
        --hf-model "$hf" --data-path "$data" \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel \
        --use-distributed-optimizer \
        --bf16 --fp32-residual-connection --attention-softmax-in-fp32 --accumulate-allreduce-grads-in-fp32 \
        --micro-batch-size 1 --global-batch-size 64 \
        --lr 1e-5 --min-lr 1e-6 --lr-warmup-iters 50 --lr-decay-style cosine --clip-grad 1.0 \
        --weight-decay 0.1 --train-iters 1000 \
        --log-interval 10 --save "$ckpt" --save-interval 500 \
        "$@"
    ;;
cpu)
    # 8 CPU processes (gloo): TP2 x PP2 x DP2 on a tiny model; a minute or two on a laptop.
    exec python -m torch.distributed.run --nproc_per_node 8 -m mmpack.trainer.pretrain_vlm \
        --data-path "$data" \
        --model-size tiny \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
        --micro-batch-size 1 --global-batch-size 8 \
        --lr 3e-3 --lr-warmup-iters 2 --train-iters 20 --log-interval 1 --num-workers 1 \
        "$@"
    ;;
*)
    echo "unknown recipe '$recipe' (gpu8, hf8 or cpu)" >&2
    exit 2
    ;;
esac
