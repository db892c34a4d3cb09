#!/usr/bin/env bash
# The main job: sets up the environment if needed, then runs the default model under concurrent load.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/metrale demo "$@"
