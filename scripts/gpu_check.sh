#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, in one short run. CI has no GPU and the suite passes
# without one; this is for a machine with CUDA and a torch that sees it.
#
#   scripts/gpu_check.sh [OUT_DIR]        (default OUT_DIR: ./gpu-check)
#
# It runs, with PYTHON (default: python3) and the project importable from this checkout:
#   1. the tests whose CUDA paths skip or fall back without a GPU: the codecs on CUDA against CPU,
#      the reference model's replay on CUDA against CPU, the device tier's CUDA pool and pinned
#      DRAM (tests/test_codecs.py, test_reference_model.py, test_tiers.py);
#   2. `kvstore bench replay --device cuda` (time to first token: cold, warm, expired);
#   3. `kvstore replay-quality --device cuda` (bounded against exact replay on CUDA).
# Each writes its output into OUT_DIR; the exit status is non-zero if any of them failed.
# On a machine without network, the project's dependencies that its Python lacks must be
# installed from wheels first (typically lmdb, zstandard, redis, grpcio-health-checking and
# grpcio-reflection, matching its grpcio and protobuf).
#
# Not yet run on a GPU: no session so far had one.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
out="${1:-gpu-check}"
mkdir -p "$out"
export PYTHONPATH="${PWD}${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

"$PY" - <<'EOF' | tee "$out/device.txt" || exit 2
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device visible to torch: nothing to check here")
p = torch.cuda.get_device_properties(0)
print(f"gpu_check: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}")
EOF

status=0
step() {  # step NAME OUTFILE COMMAND...: run one check, keep its output, note a failure
  local name=$1 file=$2
  shift 2
  echo "gpu_check: $name" >&2
  if ! "$@" >"$out/$file" 2>"$out/$file.err"; then
    echo "gpu_check: $name FAILED (see $out/$file.err)" >&2
    status=1
  fi
}
step "CUDA tests" tests.txt "$PY" -m pytest -q -p no:cacheprovider -rs \
  tests/test_codecs.py tests/test_reference_model.py tests/test_tiers.py
step "bench replay on CUDA" bench_replay.json "$PY" -m kvstore bench replay --device cuda --json
step "replay quality on CUDA" replay_quality.json "$PY" -m kvstore replay-quality --device cuda --json
grep -h "passed\|failed" "$out/tests.txt" >&2 || true
exit $status
