#!/usr/bin/env bash
# Creates (once) and activates the project's virtual environment in .venv.
# torch is installed first, pinned to the CPU build, so that no CUDA build is pulled in.
# Source it: `. ./env.sh`. MMPACK_VENV overrides the location.
set -euo pipefail
venv="${MMPACK_VENV:-.venv}"
stamp="$venv/.mmpack-installed"
if [ ! -x "$venv/bin/python" ]; then
  python3.11 -m venv "$venv" 2>/dev/null || python3 -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "[env] installing into $venv (torch CPU build first) ..."
  python -m pip install -q --upgrade pip
  # --no-compile: no bytecode for the thousands of modules never imported (a third of the install's CPU time);
  # Python compiles what it imports, once
  python -m pip install -q --no-compile torch==2.13.0
  python -m pip install -q --no-compile -e ".[test,bench,energon,ray]"
  touch "$stamp"
fi
set +euo pipefail
