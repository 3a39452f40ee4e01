#!/usr/bin/env bash
# For a GPU machine without network whose Python already has CUDA PyTorch, transformers and the
# usual scientific packages (numpy, pandas, pyarrow, safetensors, peft, tensorboard, pytest, ...):
# download here the wheels of what the GPU checks need beyond those, at the versions this
# checkout's .venv was tested with, for that machine's Python. Copy the folder there and run
# experiments/gpu_acceptance/device.sh, which installs them and runs the checks.
#
#   experiments/gpu_acceptance/wheels.sh [--ray] [FOLDER=.whl] [PYTHON_VERSION=3.12]
#
# Pure-Python wheels where they exist; SQLAlchemy, greenlet and xxhash are built per Python version
# (~7 MB in all). --ray adds Ray and what it needs beyond such an image (~85 MB): the run on mapped
# devices in tests/test_gpu.py and the memory plan's measured peaks start Ray actors. Not in it, by
# size: vLLM (hundreds of MB with its kernels); without it the acceptance script runs its arms with
# the HF engine.
set -euo pipefail
cd "$(dirname "$0")/../.."
ray=false
if [ "${1:-}" = --ray ]; then ray=true; shift; fi
dir=${1:-.whl}
py=${2:-3.12}
venv=.venv/bin/python
[ -x "$venv" ] || { echo "no .venv here: run 'make test' (or 'make run') once first" >&2; exit 1; }

# the packages rft imports on the checks' paths that such an image lacks, and their own needs
packages=(hydra-core omegaconf sqlalchemy greenlet datasets dill multiprocess submitit xxhash
          filelock math-verify latex2sympy2-extended)
$ray && packages+=(ray jsonschema jsonschema-specifications referencing rpds-py)
pins=()
for p in "${packages[@]}"; do
    pins+=("$p==$($venv -c "import importlib.metadata as m; print(m.version('$p'))")")
done
mkdir -p "$dir"
$venv -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir" "${pins[@]}"
# Hydra's parser runtime is published as a source package only: built into a wheel here
antlr=$($venv -c "import importlib.metadata as m; print(m.version('antlr4-python3-runtime'))")
$venv -m pip wheel -q --no-deps -w "$dir" "antlr4-python3-runtime==$antlr"
du -sh "$dir"
ls "$dir"
