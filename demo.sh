#!/usr/bin/env bash
# Sets up the environment and runs the main job on the embedded default:
# build a small multimodal dataset, pack it, print its stats, stream it into a few
# training steps of a tiny model with TP x PP x DP on CPU processes.
# Usage: bash demo.sh [mmpack demo flags]
set -uo pipefail
cd "$(dirname "$0")"
. ./env.sh || exit 1
exec mmpack demo "$@"
