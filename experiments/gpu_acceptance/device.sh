#!/usr/bin/env bash
# The GPU checks in one go, on a machine with a GPU and without network, from this checkout's root:
# installs the wheels that wheels.sh downloaded (into a folder of its own, not the machine's
# Python), then runs tests/test_gpu.py and the acceptance script, and where Ray is installed the
# memory plan's estimate against the peaks measured on the GPU (the 0.5B shape): each with its log,
# the acceptance table as JSON, in RESULTS.
#
#   experiments/gpu_acceptance/device.sh [WHEELS=.whl] [RESULTS=gpu_results] [acceptance.py's options]
#
# WHEELS and RESULTS as named, relative to where the command is run; left out, .whl and gpu_results
# of the checkout (without .whl/: the machine's own packages, as with WHEELS ""). The first option
# (--arms ...) ends the folders. At most 10 minutes by its timeouts (the tests 2.5, the acceptance
# arms 5, the memory plan 2.5; models built here with random weights, nothing downloaded). Exit
# status: 2 for a folder or a Python (PYTHON, default python3: torch and transformers) it cannot
# use, before anything runs; else 1 for any part's failure.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
wheels=$root/.whl results=$root/gpu_results named=false
absolute() { case $1 in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
    [ -n "$1" ] && { wheels=$(absolute "$1"); named=true; }
    shift
    if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then results=$(absolute "$1"); shift; fi
fi
# a folder named but without wheels (a typo, wheels.sh not run) ran on the machine's own packages
if $named && ! compgen -G "$wheels/*.whl" >/dev/null; then
    echo "device.sh: no wheels (*.whl) in $wheels: give the folder wheels.sh downloaded into, or \"\" for this machine's own packages" >&2
    exit 2
fi
if ! mkdir -p "$results" 2>/dev/null || [ ! -w "$results" ]; then
    echo "device.sh: cannot write the results into $results (not a writable folder)" >&2
    exit 2
fi
python=${PYTHON:-python3}
case $python in /*) ;; */*) python=$PWD/$python ;; esac  # a relative path, from where the command is run
cd "$root"
if ! $python -c "import torch, transformers" 2>/dev/null; then
    echo "device.sh: PYTHON=$python cannot import torch and transformers: set PYTHON to the Python that has CUDA PyTorch (default python3)" >&2
    exit 2
fi
installed="no wheels in $wheels: the machine's own packages"
if compgen -G "$wheels/*.whl" >/dev/null; then
    site=$(mktemp -d)
    $python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl || exit 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    installed="installed $(compgen -G "$wheels/*.whl" | wc -l) wheels from $wheels into $site"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# the tiny and shaped models are built here, into a cache of this run's own
export RFT_CACHE_DIR=${RFT_CACHE_DIR:-$(mktemp -d)}
{ echo "$installed"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  $python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
} 2>&1 | tee "$results/device.txt"
status=0
timeout 150 $python -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py 2>&1 | tee "$results/test_gpu.log" || status=1
timeout 300 $python experiments/gpu_acceptance/acceptance.py --out "$results/gpu_acceptance.json" "$@" 2>&1 \
    | tee "$results/acceptance.log" || status=1
memory_arms=${MEMORY_ARMS-0.5b}  # the memory plan's arms (experiments/memory_plan); empty: none
if [ -z "$memory_arms" ]; then
    echo "MEMORY_ARMS is empty: the memory plan's measured peaks are left out" | tee "$results/memory_plan.log"
elif $python -c "import ray" 2>/dev/null; then
    gpu=$($python -c "import torch; print(int(torch.cuda.is_available()))")
    extra=(); [ "$gpu" = 1 ] && extra=(--extra cluster.gpu_per_node=1 cluster.colocate=true)
    # shellcheck disable=SC2086  # several arms, split on spaces
    timeout 150 $python experiments/memory_plan/benchmark.py --arms $memory_arms "${extra[@]}" 2>&1 \
        | tee "$results/memory_plan.log" || status=1
else
    echo "Ray is not installed here: the memory plan's measured peaks are left out (wheels.sh --ray)" \
        | tee "$results/memory_plan.log"
fi
exit $status
