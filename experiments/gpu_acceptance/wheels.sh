#!/usr/bin/env bash
# For a GPU machine without network whose Python already has CUDA PyTorch, transformers and the
# usual scientific packages (numpy, pandas, pyarrow, safetensors, peft, tensorboard, pytest, ...):
# download here the wheels of what the GPU checks need beyond those, at the versions this
# checkout's .venv was tested with, for that machine's Python. Copy the folder there and run
# experiments/gpu_acceptance/device.sh, which installs them and runs the checks.
#
#   experiments/gpu_acceptance/wheels.sh [--ray] [FOLDER=.whl] [PYTHON_VERSION=3.12]
#
# FOLDER as named, relative to where the command is run; left out, the checkout's .whl/.
# Pure-Python wheels where they exist; SQLAlchemy, greenlet and xxhash are built per Python version
# (~7 MB in all). --ray adds Ray and what it needs beyond such an image (~85 MB): the run on mapped
# devices in tests/test_gpu.py and the memory plan's measured peaks start Ray actors. Not in it, by
# size: vLLM (hundreds of MB with its kernels); without it the acceptance script runs its arms with
# the HF engine.
set -euo pipefail
usage="wheels.sh [--ray] [FOLDER=.whl] [PYTHON_VERSION=3.12]"
ray=false
if [ "${1:-}" = --ray ]; then ray=true; shift; fi
case ${1:-} in -*) echo "wheels.sh: unknown option $1 ($usage)" >&2; exit 2 ;; esac
# `wheels.sh 3.11` downloaded 3.12's wheels into a folder named 3.11
if [[ ${1:-} =~ ^[0-9]+(\.[0-9]+)*$ ]]; then
    echo "wheels.sh: '$1' is a Python version, not a folder: give the folder first (wheels.sh [--ray] FOLDER PYTHON_VERSION, e.g. wheels.sh .whl $1)" >&2
    exit 2
fi
py=${2:-3.12}
[[ $py =~ ^3\.[0-9]+$ ]] || { echo "wheels.sh: PYTHON_VERSION '$py' is not a version like 3.12 ($usage)" >&2; exit 2; }
case ${1:-} in "") dir=.whl ;; /*) dir=$1 ;; *) dir=$PWD/$1 ;; esac
cd "$(dirname "$0")/../.."
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
