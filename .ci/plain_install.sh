#!/usr/bin/env bash
# The plain install, checked as a new user meets it: README's by-hand install lines, run as they are in a
# fresh copy of the repository (a new .venv with the runtime dependencies only), then the user's path on a small
# generated dataset: pack -> train 2 iterations with --save -> resume -> convert both ways -> stats.
# Then each extra alone: README's line for it on top of the plain install, its own feature on the path (pack
# --energon, pack --engine ray, training with --tensorboard-dir; bench: pack and stats), and the extra's
# packages removed again before the next one.
# Last the wheel: `pip wheel . --no-deps` installed in place of the editable install (on the runtime dependencies
# the plain install put there), then `mmpack --help` and an import of every module (.ci/wheel_check.py) from it, in a
# folder outside the repository.
# Usage: bash .ci/plain_install.sh [extra ...]   (default: every extra README lists but test, which test.sh
# runs; "none" for the plain one only)
# MMPACK_PLAIN_DIR keeps the work folder (default: a temporary one, removed at the end).
set -euo pipefail
TIMEFORMAT='%R %U %S'
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="${MMPACK_PLAIN_DIR:-$(mktemp -d "${TMPDIR:-/var/tmp}/mmpack-plain.XXXXXX")}"
[ -n "${MMPACK_PLAIN_DIR:-}" ] || trap 'rm -rf "$work"' EXIT
mkdir -p "$work"
log="$work/log"
: >"$work/cpu"  # CPU seconds of each step, summed at the end
t_start=$SECONDS

# The fenced bash block after README's marker line "<!-- $1 ..." (one command per line).
readme_block() {
  awk -v marker="<!-- $1" 'index($0, marker) == 1 {on = 1; next}
    on && /^```bash/ {inside = 1; next} inside && /^```/ {exit} inside {print}' "$repo/README.md"
}

# Runs one command, its output to $log; on failure (or past $limit seconds: a hang) shows the log's end.
# Prints its wall time and the CPU time it and its processes used (what a busy machine does not inflate).
step() {
  local what=$1 status=0
  shift
  { time timeout "${limit:-300}" "$@" >"$log" 2>&1; } 2>"$work/time" || status=$?
  if [ $status -ne 0 ]; then
    echo "plain install: FAILED: $what (exit $status, ${limit:-300} s limit): $*" >&2
    tail -n 40 "$log" >&2
    exit 1
  fi
  report "$what"
}

report() {  # the line of one step, from the times `time` wrote to $work/time
  awk -v what="$1" '{printf "  %-50s %5.0f s  (cpu %4.0f s)\n", what, $1, $2 + $3}' \
    "$work/time"
  awk '{print $2 + $3}' "$work/time" >>"$work/cpu"
}

expect() {  # expect WHAT FILE-OR-STRING PATTERN
  if ! grep -q -- "$3" <<<"$2"; then
    echo "plain install: FAILED: $1 (expected '$3')" >&2
    exit 1
  fi
}

train=(torchrun --standalone --nproc_per_node 1 -m mmpack.trainer.pretrain_vlm --model-size tiny
  --micro-batch-size 1 --global-batch-size 1 --num-workers 1)

# pack -> train 2 iterations with --save, in $work/run-$1; $2: extra pack flags, $3: extra train flags.
pack_and_train() {
  local d="$work/run-$1"
  # shellcheck disable=SC2086
  step "pack" mmpack pack -i "$raw/data.jsonl" -r "$raw" -o "$d/ds" -L 1024 -t "$raw/tokenizer/tokenizer.json" $2
  # shellcheck disable=SC2086
  step "train 2 iterations, --save" "${train[@]}" --data-path "$d/ds" --train-iters 2 --save "$d/ck" \
    --save-interval 2 $3
  expect "checkpoint of iteration 2" "$(cat "$d/ck/latest_checkpointed_iteration.txt")" "^2$"
}

# The whole path: pack -> train --save -> resume -> convert both ways -> stats.
user_path() {
  local d="$work/run-plain"
  pack_and_train plain "" ""
  step "resume to iteration 3 (--load, --async-save)" "${train[@]}" --data-path "$d/ds" --train-iters 3 \
    --load "$d/ck" --save "$d/ck" --async-save
  expect "resume" "$(cat "$log")" "resumed from $d/ck at iteration 2"
  expect "checkpoint of iteration 3" "$(cat "$d/ck/latest_checkpointed_iteration.txt")" "^3$"
  step "convert mcore-to-hf" mmpack convert mcore-to-hf --ckpt "$d/ck" --out "$d/hf"
  step "convert hf-to-mcore --tp 2 --pp 2" mmpack convert hf-to-mcore --hf "$d/hf" --out "$d/mcore" --tp 2 --pp 2
  step "stats" mmpack stats "$d/ds"
  expect "stats" "$(cat "$log")" "fill"
}

# An extra's own feature on the path: pack (with its flags) -> stats, and training where the extra serves it
# (test: --tensorboard-dir). Training, resume and convert with every extra installed at once are test.sh's (its
# environment holds them all); an extra changes no package of the plain install (extra_adds_only checks it).
extra_path() {
  local d="$work/run-$1"
  case $1 in
    energon) step "pack --format both --energon" mmpack pack -i "$raw/data.jsonl" -r "$raw" -o "$d/ds" -L 1024 \
        -t "$raw/tokenizer/tokenizer.json" --format both --energon
      expect "energon metadata" "$(ls "$d/ds/.nv-meta")" "dataset.yaml" ;;
    ray) step "pack --engine ray" mmpack pack -i "$raw/data.jsonl" -r "$raw" -o "$d/ds" -L 1024 \
        -t "$raw/tokenizer/tokenizer.json" --engine ray
      expect "ray engine" "$(cat "$log")" "(ray)" ;;
    test) pack_and_train "$1" "" "--tensorboard-dir $d/tb"
      expect "tensorboard events" "$(ls "$d/tb")" "events.out.tfevents" ;;
    *) step "pack" mmpack pack -i "$raw/data.jsonl" -r "$raw" -o "$d/ds" -L 1024 \
        -t "$raw/tokenizer/tokenizer.json" ;;
  esac
  step "stats" mmpack stats "$d/ds"
}

# The wheel as a user installs it from an index: built from this copy and installed in place of the editable
# install into the plain install's venv (whose packages are exactly the runtime dependencies, installed from the
# index by README's lines above; pip installs whatever of the wheel's dependencies would be missing), then used from
# a folder outside the repository: `mmpack --help` and every part (every module but those of an extra) imported from
# site-packages. A venv of its own would install torch and every dependency a second time for the same check.
wheel_check() {
  local dist="$work/dist" away="$work/wheel-check"
  step "build the wheel: pip wheel . --no-deps" pip wheel . --no-deps -q -w "$dist"
  step "uninstall the editable install" pip uninstall -q -y mmpack
  limit=900 step "install the wheel (and any missing dependency)" pip install -q "$dist"/mmpack-*.whl
  mkdir -p "$away"
  cp "$repo/.ci/wheel_check.py" "$away/"
  step "mmpack --help from the wheel" bash -c 'cd "$1" && mmpack --help' _ "$away"
  expect "mmpack --help from the wheel" "$(cat "$log")" "usage: mmpack"
  step "import every part from the wheel" bash -c 'cd "$1" && python wheel_check.py' _ "$away"
  expect "import every part from the wheel" "$(cat "$log")" "modules import from the wheel"
  tail -n 1 "$log" | sed 's/^/    /'
}

# Fails naming them when the extra just installed replaced a package of the plain install.
extra_adds_only() {
  local changed
  changed="$(comm -23 <(sort <<<"$plain") <(pip freeze --exclude-editable | sort))"
  if [ -n "$changed" ]; then
    echo "plain install: FAILED: extra $1 changes packages of the plain install: $changed" >&2
    exit 1
  fi
}

# Runs README lines in this shell (the first one activates the venv), each timed, output to $log.
readme_lines() {
  local line status
  while IFS= read -r line; do
    [ -n "$line" ] || continue
    status=0
    # in this shell: the venv it activates stays active
    { time eval "$line" >"$log" 2>&1; } 2>"$work/time" || status=$?
    if [ $status -ne 0 ]; then
      echo "plain install: FAILED: $line" >&2
      tail -n 40 "$log" >&2
      exit 1
    fi
    report "${line%%  *}"
  done <<<"$1"
}

# Removes what the last extra installed (and puts back a version it changed): the plain install again.
remove_extra() {
  local now
  now="$(pip freeze --exclude-editable)"
  comm -13 <(sort <<<"$plain") <(sort <<<"$now") | sed 's/[ =@].*//' | xargs -r pip uninstall -q -y
  comm -23 <(sort <<<"$plain") <(sort <<<"$now") | xargs -r pip install -q --no-deps
  if [ "$(pip freeze --exclude-editable)" != "$plain" ]; then
    echo "plain install: FAILED: removing an extra did not give back the plain install" >&2
    exit 1
  fi
}

extras=("$@")
if [ ${#extras[@]} -eq 0 ]; then
  # every extra README lists but "test": bash test.sh installs it and runs every check with it (alone here it
  # would add minutes of installing to CI for what test.sh already runs)
  mapfile -t extras < <(readme_block "extras:" | sed -n 's/^pip install -e "\.\[\([a-z]*\)\]".*/\1/p' |
    grep -vx test)
  if [ ${#extras[@]} -eq 0 ]; then
    echo "plain install: FAILED: README has no extras block (<!-- extras: ... --> and a bash block)" >&2
    exit 1
  fi
fi
[ "${extras[*]}" != none ] || extras=()

echo "== plain install in $work: README's lines as they are, in a fresh copy of the repository"
mkdir -p "$work/mmpack"
(cd "$repo" && git ls-files -z --cached --others --exclude-standard |
  tar --null --ignore-failed-read -T - -cf -) | tar -xf - -C "$work/mmpack"
cd "$work/mmpack"
install_lines="$(readme_block "plain install:")"
[ -n "$install_lines" ] || { echo "plain install: FAILED: README has no plain install block" >&2; exit 1; }
readme_lines "$install_lines"
plain="$(pip freeze --exclude-editable)"
raw="$work/raw"
step "a small raw dataset and tokenizer" python -m mmpack.demo.synthetic "$raw" \
  --samples 40 --max-size 96 --tokenizer
user_path

for extra in "${extras[@]}"; do
  echo "== extra $extra alone"
  readme_lines "$(readme_block "extras:" | grep -F "\".[$extra]\"")"
  extra_adds_only "$extra"
  extra_path "$extra"
  { time remove_extra >"$log" 2>&1; } 2>"$work/time"
  report "remove the extra again"
done
echo "== the wheel: built, installed in place of the editable install, used outside the repository"
wheel_check
cpu=$(awk '{s += $1} END {printf "%.0f", s}' "$work/cpu")
echo "== plain install and ${#extras[@]} extra(s): all passed in $((SECONDS - t_start)) s (cpu $cpu s)"
