#!/usr/bin/env bash
# auto_pipe.sh: LLaVA-OneVision-2's offline packing command line (its offline_packing/auto_pipe.sh), run by
# `mmpack pack`. Its command lines work unchanged; the output is a WebDataset dataset with Megatron-Energon metadata.
#
# Usage: auto_pipe.sh -i INPUT -r IMAGE_ROOT -o OUTPUT -L MAX_TOKEN_LEN [OPTIONS] [mmpack pack flags]
#
# LLaVA-OneVision-2's options, with its meaning:
#   -i, --input PATH            raw records: .json/.jsonl (or .gz), .parquet, .tar, folder, glob or URL (repeatable)
#   -r, --image-root DIR        folder (or URL) image paths are relative to (default: each input file's folder)
#   -o, --output DIR            the packed dataset: shards/*.tar, .nv-meta/, manifest.json (work files in DIR/_work)
#   -L, --max-token-len N       bin capacity in tokens (the training sequence length)
#   -m, --model-path DIR        model folder: tokenizer.json, chat template (the text of every sample) and
#                               preprocessor_config.json (default Qwen/Qwen2.5-VL-3B-Instruct: a local folder)
#       --max-pixels N          image max pixels (must agree with the model folder's preprocessor_config.json,
#                               which the trainer checks the dataset against)
#   -S, --from-step N           rerun from stage N (1-4); the stages before it must be complete
#   -M, --max-samples N         max samples per bin (default 200)
#   -w, --max-workers N         worker processes, every stage (default: the CPUs, at most 32)
#       --chunk-size N          samples per unit of parallel work (default 2048)
#       --shard-prefix NAME     shard name prefix (default pretrain)
#       --max-samples-per-shard N  max bins (packed samples) per shard (default 10000)
#       --max-shard-size BYTES  max shard size (default 3000000000)
#       --resume-direct         with -S 4: keep the shards a stopped stage 4 finished (without -S, always so)
#   -f, --force                 rerun every stage
#   -s, --status                print each stage's status and exit
#   -h, --help                  this text
# Accepted, with one line on stderr saying what mmpack does instead:
#       --direct-workers N      stage 4 runs with the -w workers
#       --s1-num-processes N    stage 1 runs with the -w workers
#       --s2-num-processes N    stage 2 runs with the -w workers
#       --s2-min-workers N      stage 2 has no thread pool to size
#       --sample-class NAME     the shards hold token ids; Energon reads them with mmpack's own sample type
#       --no-npy                image tokens always come from each image's size; no .npy is read
# Every other argument goes to `mmpack pack` as it is, one word each, spaces kept (`mmpack pack --help`):
#   --default-system "You are a helpful assistant."   --no-default-system   --chat-template FILE|builtin
#   -t TOKENIZER   --format arrow|wds|both   --engine ray   --seed N   --overlength truncate   --strict ...
#
# <OUT> and the work folder must be new, empty or mmpack's own (they carry .mmpack-owner.json); a non-empty
# folder of yours is refused (-x --overwrite adopts it; nothing but mmpack's own files is touched). One job at a
# time per output: a second one stops at once, naming the first.
#
# Stages (each resumable; outputs under <OUT>/_work unless --work-dir, markers <stage>.done.json). A rerun
# skips a stage only if its options, the stages before it and every file it reads are unchanged; otherwise it
# redoes that stage and the later ones, and stage 4 removes the shards it wrote before that are now unlisted.
#   1 scan     reads  the input records and image headers (Pillow, no full decode)
#              writes _work/scan/chunk-N.samples.jsonl (+ .rejects.jsonl, .images.json: identity of each image)
#              takes  roughly image-header I/O: ~1-3k samples/s per worker on local disk
#   2 lengths  reads  scan chunks, the tokenizer, the chat template, the image-token rule
#              writes _work/lengths/chunk-N.{ids,mask,offsets,nimg,ibytes}.npy, samples.jsonl, rejects.jsonl
#              takes  tokenizer speed: ~1-5k samples/s per worker
#   3 binpack  reads  the lengths (one int per sample)
#              writes _work/binpack/{order,bin_offsets,shard_first_bin,bin_ids}.npy
#              takes  well under a second per million samples (numba kernels)
#   4 write    reads  the token arrays and image files (copied as read, never re-encoded)
#              writes <OUT>/shards/*.tar, .nv-meta/, rejects.jsonl, stats.json, manifest.json last
#              takes  disk bandwidth: about the speed of copying the image bytes
# See benchmarks/bench_offline.py for measured numbers.
set -euo pipefail

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
note() { echo "auto_pipe.sh: $1" >&2; }
need() { [ "$2" -ge 2 ] || { note "error: $1 needs a value"; exit 2; }; }

PYTHON="${PYTHON:-python}"
MODEL_PATH="" OUTPUT="" WORK_DIR="" FROM_STEP="" FORCE=false STATUS=false RESUME_DIRECT=false
MAX_SAMPLES=200 WORKERS="" SHARD_PREFIX=pretrain MAX_BINS_PER_SHARD=10000 MAX_SHARD_BYTES=3000000000
args=() passthrough=()
while [ "$#" -gt 0 ]; do
  case "$1" in
    -i|--input)             need "$1" "$#"; args+=(--input "$2"); shift 2 ;;
    -r|--image-root)        need "$1" "$#"; args+=(--image-root "$2"); shift 2 ;;
    -o|--output)            need "$1" "$#"; OUTPUT="$2"; shift 2 ;;
    -L|--max-token-len)     need "$1" "$#"; args+=(--seq-len "$2"); shift 2 ;;
    -m|--model-path)        need "$1" "$#"; MODEL_PATH="$2"; shift 2 ;;
    --max-pixels)           need "$1" "$#"; args+=(--max-pixels "$2"); shift 2 ;;
    -S|--from-step)         need "$1" "$#"; FROM_STEP="$2"; shift 2 ;;
    -M|--max-samples)       need "$1" "$#"; MAX_SAMPLES="$2"; shift 2 ;;
    -w|--max-workers)       need "$1" "$#"; WORKERS="$2"; shift 2 ;;
    --chunk-size)           need "$1" "$#"; args+=(--chunk-size "$2"); shift 2 ;;
    --shard-prefix)         need "$1" "$#"; SHARD_PREFIX="$2"; shift 2 ;;
    --max-samples-per-shard) need "$1" "$#"; MAX_BINS_PER_SHARD="$2"; shift 2 ;;
    --max-shard-size)       need "$1" "$#"; MAX_SHARD_BYTES="$2"; shift 2 ;;
    --resume-direct)        RESUME_DIRECT=true; shift ;;
    -f|--force)             FORCE=true; shift ;;
    -s|--status)            STATUS=true; shift ;;
    -h|--help)              usage 0 ;;
    --direct-workers)       need "$1" "$#"; note "--direct-workers $2: stage 4 runs with the -w workers"; shift 2 ;;
    --s1-num-processes)     need "$1" "$#"; note "--s1-num-processes $2: stage 1 runs with the -w workers"; shift 2 ;;
    --s2-num-processes)     need "$1" "$#"; note "--s2-num-processes $2: stage 2 runs with the -w workers"; shift 2 ;;
    --s2-min-workers)       need "$1" "$#"; note "--s2-min-workers $2: stage 2 has no thread pool; ignored"; shift 2 ;;
    --sample-class)         need "$1" "$#"
                            note "--sample-class $2: the shards hold token ids; Energon reads them with mmpack's own sample type"
                            shift 2 ;;
    --no-npy)               note "--no-npy: image tokens always come from each image's size with the model's rule"; shift ;;
    --work-dir)             need "$1" "$#"; WORK_DIR="$2"; passthrough+=("$1" "$2"); shift 2 ;;
    *)                      passthrough+=("$1"); shift ;;
  esac
done

if "$STATUS"; then
  [ -n "$OUTPUT" ] || { note "error: -s needs -o OUTPUT"; exit 2; }
  exec "$PYTHON" -m mmpack.offline_packing.status -o "$OUTPUT" ${WORK_DIR:+--work-dir "$WORK_DIR"}
fi
[ -z "$OUTPUT" ] || args+=(--output "$OUTPUT")

# The model: -m, else LLaVA-OneVision-2's default folder, unless a tokenizer or model is named among the
# mmpack flags. Like LLaVA-OneVision-2, a model is read from a local folder only.
named_model=false format=""
for ((k = 0; k < ${#passthrough[@]}; k++)); do
  case "${passthrough[k]}" in
    -t|--tokenizer|--model|--tokenizer=*|--model=*) named_model=true ;;
    --format) format="${passthrough[k + 1]:-}" ;;
    --format=*) format="${passthrough[k]#--format=}" ;;
  esac
done
if [ -z "$MODEL_PATH" ] && ! "$named_model"; then
  MODEL_PATH="Qwen/Qwen2.5-VL-3B-Instruct"
  [ -d "$MODEL_PATH" ] || {
    note "error: no model folder: the default -m $MODEL_PATH is not a folder here; pass -m MODEL_DIR (tokenizer.json, chat template, preprocessor_config.json)"
    exit 1
  }
fi
[ -z "$MODEL_PATH" ] || args+=(--model "$MODEL_PATH")

if "$FORCE"; then
  args+=(--stage 1)
elif [ -n "$FROM_STEP" ]; then
  if "$RESUME_DIRECT" && [ "$FROM_STEP" = 4 ]; then
    note "--resume-direct: stage 4 resumes, keeping the shards it finished"
  else
    args+=(--stage "$FROM_STEP")
  fi
fi
if "$RESUME_DIRECT" && [ "${FROM_STEP:-4}" != 4 ]; then
  note "--resume-direct: after -S $FROM_STEP stage 4 is rerun in full"
fi

if [ -z "$WORKERS" ]; then
  WORKERS="$(nproc 2>/dev/null || echo 1)"
  [ "$WORKERS" -le 32 ] || WORKERS=32
fi
args+=(--max-samples-per-bin "$MAX_SAMPLES" --workers "$WORKERS" --shard-prefix "$SHARD_PREFIX")
args+=(--max-bins-per-shard "$MAX_BINS_PER_SHARD" --max-shard-bytes "$MAX_SHARD_BYTES")
[ -n "$format" ] || args+=(--format wds)  # what LLaVA-OneVision-2 writes, with Energon metadata
if [ "$format" != arrow ]; then
  case "$OUTPUT" in
    *://*) note "no Energon metadata for a URL output (energon prepare indexes local tars)" ;;
    *) args+=(--energon) ;;
  esac
fi

start=$(date +%s)
"$PYTHON" -m mmpack.offline_packing "${args[@]}" "${passthrough[@]}"
echo "auto_pipe.sh: done in $(( $(date +%s) - start )) s" >&2
