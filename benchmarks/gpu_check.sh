#!/usr/bin/env bash
# The GPU checks of docs/gpu.md, in one run on a machine with a CUDA device:
#
#     OUT=some/folder bash benchmarks/gpu_check.sh      # from the repository root
#
# pskv runs from source (PYTHONPATH=src, no pip install of pskv, no network); a pyzmq wheel
# in .whl/ is installed into /tmp/site first if there is one. Writes at most 5 files to
# $OUT: gpu_env.log, gpu_tests.log, bench_gpu.log, bench_gpu.json, bench_gpu.md. Every step
# is bounded by `timeout`, the whole script by about 8 minutes. Exit status: 0 when the
# tests and the benchmark passed. Without CUDA the tests skip, saying why.
set -u -o pipefail
OUT=${OUT:-benchmarks/results/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false    # JAX must leave the GPU's memory to torch
status=0

if compgen -G ".whl/*.whl" > /dev/null; then
    timeout 60 python3 -m pip install -q --no-index --no-deps --no-compile --upgrade \
        --target /tmp/site .whl/*.whl || { echo "pip install of .whl/*.whl failed"; status=1; }
else
    echo "no .whl/*.whl here: pyzmq must be importable already"
fi
export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}

{
    timeout 20 nvidia-smi -L || echo "nvidia-smi: not available"
    timeout 60 python3 - <<'PY'
import sys
print("python", sys.version.split()[0])
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda,
          "available", torch.cuda.is_available(), "devices", torch.cuda.device_count(),
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
except ImportError as err:
    print("torch: not importable:", err)
for name in ("zmq", "cupy", "jax", "numpy", "pytest"):
    try:
        print(name, __import__(name).__version__)
    except Exception as err:  # noqa: BLE001 - a report line, not a check
        print(name, "not importable:", type(err).__name__, err)
PY
} 2>&1 | tee "$OUT/gpu_env.log"

timeout 210 python3 -m pytest -q -p no:cacheprovider -rs --timeout 150 \
    tests/gpu tests/unit/test_device_io.py tests/unit/test_device_io_simulated.py \
    tests/unit/test_torch.py tests/unit/test_torch_buckets.py tests/unit/test_local_store.py \
    2>&1 | tee "$OUT/gpu_tests.log" || status=1

timeout 180 python3 benchmarks/bench_gpu.py --out "$OUT" --timeout 60 \
    2>&1 | tee "$OUT/bench_gpu.log" || status=1

echo "gpu_check: exit status $status (files in $OUT)"
exit $status
