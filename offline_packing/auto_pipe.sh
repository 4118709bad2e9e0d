#!/usr/bin/env bash
# auto_pipe.sh: the offline packing job with the familiar short flags; a thin front of `mmpack pack`.
#
# Usage:
#   auto_pipe.sh -i INPUT -o OUT -L MAX_TOKENS [-r IMAGE_ROOT] [-t TOKENIZER] [-M MAX_SAMPLES_PER_BIN]
#                [-I MAX_IMAGES_PER_BIN] [-w WORKERS] [-E local|ray] [-S STAGE] [-f arrow|wds|both] [-e] [-a ALGORITHM]
#                [-s SEED] [-B MAX_BINS_PER_SHARD] [-b MAX_SHARD_BYTES] [-p overlength policy] [-x "more flags"]
#
#   -i  raw records: .json/.jsonl (or .gz of either), .parquet, .tar file, folder or glob (repeatable)
#   -r  folder image paths are relative to (default: each input file's folder)
#   -o  output folder or fsspec URL (s3://bucket/prefix)
#   -L  bin capacity in tokens (the training sequence length)
#   -t  tokenizer.json or its folder; a model folder (with preprocessor_config.json) also gives the image
#       rule, as --model does (default: byte-level demo fallback, marked in the manifest)
#   -M  max samples per bin            -I  max images per bin
#   -w  worker processes for scan, lengths and write (results identical for any value)
#   -E  engine: local (forked workers, default) or ray (tasks on the Ray cluster of this machine, else a
#       new local one; --ray-address ADDR via -x); same output either way
#   -S  rerun from stage N (1 scan, 2 lengths, 3 binpack, 4 write); default: resume, skip finished stages
#   -f  shard format (default arrow)   -e  also write Megatron-Energon metadata (.nv-meta; needs wds/both)
#   -a  bin-packing algorithm          -s  seed (bin order)
#   -B  max bins per shard             -b  max shard bytes (e.g. 512M)
#   -p  over-length policy: drop (default), truncate, error
#   -x  extra `mmpack pack` flags, quoted (e.g. -x "--strict --max-image-pixels 20000000 --verify-inputs sha256")
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
#   2 lengths  reads  scan chunks, the tokenizer, the image-token rule flags
#              writes _work/lengths/chunk-N.{ids,mask,offsets,nimg,ibytes}.npy, samples.jsonl, rejects.jsonl
#              takes  tokenizer speed: ~1-5k samples/s per worker
#   3 binpack  reads  the lengths (one int per sample)
#              writes _work/binpack/{order,bin_offsets,shard_first_bin,bin_ids}.npy
#              takes  well under a second per million samples (numba kernels)
#   4 write    reads  the token arrays and image files (copied as read, never re-encoded)
#              writes <OUT>/shards/*.arrow|*.tar, rejects.jsonl, stats.json, .nv-meta/ (-e), manifest.json last
#              takes  disk bandwidth: about the speed of copying the image bytes
# See benchmarks/bench_offline.py for measured numbers.
set -euo pipefail

usage() { sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }

args=()
while getopts "i:r:o:L:t:M:I:w:E:S:f:ea:s:B:b:p:x:h" opt; do
  case "$opt" in
    i) args+=(--input "$OPTARG") ;;
    r) args+=(--image-root "$OPTARG") ;;
    o) args+=(--output "$OPTARG") ;;
    L) args+=(--seq-len "$OPTARG") ;;
    t) args+=(--tokenizer "$OPTARG") ;;
    M) args+=(--max-samples-per-bin "$OPTARG") ;;
    I) args+=(--max-images-per-bin "$OPTARG") ;;
    w) args+=(--workers "$OPTARG") ;;
    E) args+=(--engine "$OPTARG") ;;
    S) args+=(--stage "$OPTARG") ;;
    f) args+=(--format "$OPTARG") ;;
    e) args+=(--energon) ;;
    a) args+=(--algorithm "$OPTARG") ;;
    s) args+=(--seed "$OPTARG") ;;
    B) args+=(--max-bins-per-shard "$OPTARG") ;;
    b) args+=(--max-shard-bytes "$OPTARG") ;;
    p) args+=(--overlength "$OPTARG") ;;
    x) read -r -a extra <<< "$OPTARG"; args+=("${extra[@]}") ;;
    h) usage 0 ;;
    *) usage 2 ;;
  esac
done
shift $((OPTIND - 1))
[ "$#" -eq 0 ] || { echo "auto_pipe.sh: unexpected argument: $1" >&2; usage 2; }

PYTHON="${PYTHON:-python}"
start=$(date +%s)
"$PYTHON" -m mmpack.offline_packing.cli pack "${args[@]}"
echo "auto_pipe.sh: done in $(( $(date +%s) - start )) s" >&2
