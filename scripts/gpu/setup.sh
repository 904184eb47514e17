# Sourced on the device machine (by scripts/gpu/tier.sh; before scripts/bench.py): install the carried wheel
# bundle (.whl, made by `MINIMAL=1 BENCH=1 bash scripts/offline_wheels.sh .whl`) beside the
# machine's torch, set the environment every run needs, and create $OUT. Exits the caller
# when the install fails. The install runs once per machine (later batches of the same call
# find /tmp/site/.installed); .whl is looked up in the repository root.
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
if [[ ! -f /tmp/site/.installed ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$_root"/.whl/*.whl && touch /tmp/site/.installed || exit 1
fi
export PYTHONPATH=/tmp/site
# NVLink multicast off on multi-GPU hosts (device README); harmless on one GPU
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT"
