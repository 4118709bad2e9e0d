#!/usr/bin/env bash
# Sets up the environment and runs every check: ruff (lint + format), mypy, pytest.
# Usage: bash test.sh [extra pytest args]
set -uo pipefail
cd "$(dirname "$0")"
. ./env.sh || exit 1
set -uo pipefail
status=0
echo "== ruff check";  ruff check . || status=1
echo "== ruff format --check"; ruff format --check . || status=1
echo "== mypy"; mypy || status=1
echo "== pytest"
python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests"; rc=1; fi
[ "$rc" -ne 0 ] && status=1
exit $status
