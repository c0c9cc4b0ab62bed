#!/usr/bin/env bash
# The GPU check: the gpu-marked tests, then `relax train` on a Qwen2.5-0.5B-shaped checkpoint (random weights, nothing
# downloaded) in each GPU layout the machine allows; results in DIR/gpu_check.json, a summary on the terminal.
# The steps and what each records: relax_services/bench/gpu_check.py.
#
# Usage: bash packages/relax-services/scripts/gpu_check.sh --out DIR [--device cuda|cpu]
#   --device cuda (default): needs CUDA and vLLM (relax-services[vllm]); about 5 minutes on one GPU.
#   --device cpu: the tiny model, 2 updates, no tests (the default test suite runs it).
# The interpreter is $PYTHON, else the repository's .venv, else python3; this checkout's packages come first on
# PYTHONPATH, so the check runs the code beside this script.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
SRC=""
for pkg in "$ROOT"/packages/*/src; do SRC="$SRC${SRC:+:}$pkg"; done
export PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m relax_services.bench.gpu_check --repo "$ROOT" "$@"
