#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, in one short run. CI has no GPU and the suite passes
# without one; this is for a machine with CUDA and a torch that sees it.
#
#   scripts/gpu_check.sh [OUT_DIR]        (default OUT_DIR: ./gpu-check)
#
# It runs, with PYTHON (default: python3) and the project importable from this checkout, each
# step bounded in time, and writes into OUT_DIR:
#   device.txt           the GPU, driver, torch, CUDA and cupy it ran with;
#   tests.txt            the tests whose CUDA paths skip without a GPU: the codecs on CUDA against
#                        CPU, the reference model's replay on CUDA against CPU, every tier test with
#                        the device tier's pool on the GPU, chunk rows moved between the GPU, pinned
#                        and plain host memory, the vLLM connector's block copies with the engine's
#                        cache on the GPU, the device tier shared by CUDA IPC with a client process,
#                        and the same-host suites with a GPU present;
#   bench_store.json     `kvstore bench store --sections device`: device-tier put/get against a
#                        device-to-device copy, pinned DRAM <-> device against torch's pinned copy,
#                        the codecs on CUDA against CPU;
#   bench_replay.json    `kvstore bench replay --device cuda` at 4K, 32K and 128K tokens;
#   replay_quality.json  `kvstore replay-quality --device cuda`;
#   bench_dataplane.json `kvstore bench dataplane --sections gpu`: loads into a GPU tensor through
#                        CUDA IPC and through host memory, against a device-to-device copy;
#   gpu_check.log        every step's progress and errors.
# STEPS (default: tests,store,replay,quality,dataplane) picks some of the steps. The exit status is non-zero
# if any step failed.
# On a machine without network, the project's dependencies that its Python lacks must be
# installed from wheels first (typically lmdb, zstandard, redis, h2 with hpack and hyperframe,
# grpcio-health-checking and grpcio-reflection, and a grpcio and protobuf as new as the project's).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
out="${1:-gpu-check}"
mkdir -p "$out"
log="$out/gpu_check.log"
: >"$log"
export PYTHONPATH="${PWD}${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

"$PY" - <<'EOF' >"$out/device.txt" 2>>"$log" || { cat "$log" >&2; exit 2; }
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device visible to torch: nothing to check here")
p = torch.cuda.get_device_properties(0)
try:
    import cupy
    cupy_version = cupy.__version__
except Exception as e:  # the pitched copies fall back to torch without it
    cupy_version = f"not importable ({e})"
print(f"gpu: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cupy {cupy_version}, python {sys.version.split()[0]}")
EOF
cat "$out/device.txt"

status=0
STEPS="${STEPS:-tests,store,replay,quality,dataplane}"
step() {  # step KEY NAME SECONDS OUTFILE COMMAND...: run one check, keep its output, note a failure
  local key=$1 name=$2 limit=$3 file=$4
  shift 4
  [[ ",$STEPS," == *",$key,"* ]] || return 0
  echo "gpu_check: $name" | tee -a "$log" >&2
  local t0=$SECONDS
  if ! timeout "$limit" "$@" >"$out/$file" 2> >(tee -a "$log" >&2); then
    echo "gpu_check: $name FAILED after $((SECONDS - t0)) s (see $log)" | tee -a "$log" >&2
    status=1
  else
    echo "gpu_check: $name done in $((SECONDS - t0)) s" | tee -a "$log" >&2
  fi
}
step tests "CUDA tests" 150 tests.txt "$PY" -m pytest -q -p no:cacheprovider -rs \
  tests/test_codecs.py tests/test_reference_model.py tests/test_tiers.py tests/test_tier_rows.py \
  tests/test_cache_layout.py tests/test_cuda_ipc.py tests/test_service_shm.py tests/test_shared_arena.py
[ -f "$out/tests.txt" ] && tail -n 15 "$out/tests.txt" >&2
step store "bench store, device section" 120 bench_store.json "$PY" -m kvstore bench store --sections device --json
step replay "bench replay on CUDA" 210 bench_replay.json \
  "$PY" -m kvstore bench replay --device cuda --prefixes 4096,32768,131072 --repeats 3 --json
step quality "replay quality on CUDA" 90 replay_quality.json "$PY" -m kvstore replay-quality --device cuda --json
step dataplane "bench dataplane, gpu section" 120 bench_dataplane.json \
  "$PY" -m kvstore bench dataplane --sections gpu --json
exit $status
