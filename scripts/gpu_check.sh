#!/usr/bin/env bash
# Every GPU measurement and GPU test of the project in one go, for one CUDA machine (H100/H200 class):
# scripts/bench_gpu.py (the layer, the locked tower and the LiT step against the peers), `embed` on
# JPEG shards against the tower alone (scripts/bench_embed.py), the patch embedding A/B
# (scripts/bench_patches.py) and tests/test_cuda.py. Each step has a timeout so that the whole fits one
# 10-minute call of a lent GPU machine (at most about 9 minutes; BENCH_GPU_BUDGET=layer=S,tower=S,lit=S
# gives bench_gpu.py's parts more time where there is more).
#
#   bash scripts/gpu_check.sh                     # results in ./gpu-results/
#   OUT=/some/dir WHEELS=.whl bash scripts/gpu_check.sh
#
# WHEELS: a folder of wheels to add first, for machines without network that lack some of the
# peers (open_clip_torch, ftfy, wcwidth, soft-moe-pytorch), our own dependencies (webdataset,
# braceexpand, omegaconf) or bench_embed.py's photos (foolbox). Fill it on a machine with network:
#   pip download --no-deps -d .whl open_clip_torch ftfy wcwidth soft-moe-pytorch webdataset braceexpand omegaconf foolbox
# They are installed with --no-deps into a private folder; their other dependencies (einops, timm,
# ...) must already be there.
set -u
OUT=${OUT:-gpu-results}; mkdir -p "$OUT"
PY=${PY:-python3}
t0=$(date +%s)
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, torch.cuda.get_device_name())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [ -n "${WHEELS:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/gpu_check_site "$WHEELS"/*.whl > "$OUT/pip.txt" 2>&1 \
    || cat "$OUT/pip.txt"
  export PYTHONPATH=/tmp/gpu_check_site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
$PY -c "import open_clip, soft_moe_pytorch, timm, webdataset, omegaconf, ftfy, lit_softmoe; \
print('imports ok; timm', timm.__version__, 'open_clip', open_clip.__version__)" 2>&1 | tee "$OUT/imports.txt"

export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor_cache}
timeout ${BENCH_GPU_TIMEOUT:-300} $PY scripts/bench_gpu.py --json "$OUT/bench_gpu.json" --md "$OUT/bench_gpu.md" \
    --budget "${BENCH_GPU_BUDGET:-layer=120,tower=90,lit=50}" --profile-dir "$OUT" > "$OUT/bench_gpu.log" 2>&1
echo "bench_gpu.py exit $? after $(( $(date +%s) - t0 )) s"
grep -E "^\s+\[|^\[|TFLOP/s|Error|error" "$OUT/bench_gpu.log" | tail -60

timeout 110 $PY scripts/bench_embed.py --images 4096 --json "$OUT/bench_embed.json" > "$OUT/bench_embed.md" 2>&1
echo "bench_embed exit $? after $(( $(date +%s) - t0 )) s"; cat "$OUT/bench_embed.md"

timeout 30 $PY scripts/bench_patches.py --device cuda --batch 256 > "$OUT/bench_patches.md" 2>&1
echo "bench_patches exit $?"; cat "$OUT/bench_patches.md"

timeout 90 $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py > "$OUT/test_cuda.log" 2>&1
echo "test_cuda exit $? after $(( $(date +%s) - t0 )) s"
tail -15 "$OUT/test_cuda.log"

echo; echo "==== bench_gpu.md"; grep -v "^$" "$OUT/bench_gpu.md" 2>/dev/null | tail -80
echo "total $(( $(date +%s) - t0 )) s"
