#!/usr/bin/env bash
# Sets up the environment and runs every check: ruff (lint + format), mypy, pytest.
# Usage: bash test.sh [--fast] [extra pytest args]
#   --fast: the development loop, every test but those that start torch.distributed ranks, compare a model
#           family with transformers / reference code, or are slow (pytest -m "not ranks and not family and not
#           slow"); CI runs everything.
#   e.g. bash test.sh tests/test_binpack.py, bash test.sh -m "not ranks", bash test.sh --fast -k loader
set -uo pipefail
cd "$(dirname "$0")"
pytest_args=("$@")
if [ "${1:-}" = "--fast" ]; then
  pytest_args=(-m "not ranks and not family and not slow" "${@:2}")
fi
. ./env.sh || exit 1
set -uo pipefail
status=0
echo "== ruff check";  ruff check . || status=1
echo "== ruff format --check"; ruff format --check . || status=1
# mypy (about 90 s of CPU on a fresh clone: it reads torch's and transformers' stubs) runs beside pytest, whose
# single-process tests leave a core free; its output comes after pytest's
mypy_log="$(mktemp "${TMPDIR:-/tmp}/mmpack-mypy.XXXXXX")"
mypy >"$mypy_log" 2>&1 &
mypy_pid=$!
echo "== pytest (mypy runs beside it)"
python -m pytest "${pytest_args[@]}"
rc=$?
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests"; rc=1; fi
[ "$rc" -ne 0 ] && status=1
echo "== mypy"
wait "$mypy_pid" || status=1
cat "$mypy_log"
rm -f "$mypy_log"
exit $status
