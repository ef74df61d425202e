#!/usr/bin/env bash
# Every GPU measurement and GPU test of the project in one go, for one CUDA machine (H100/H200 class), in
# the order docs/benchmarks.md reports them: the product first (scripts/bench_product.py: `embed`, the
# locked tower, `train` and `pretrain` as users run them, default flags, against the peers; `pretrain` last,
# within what PRODUCT_BUDGET leaves), then tests/test_cuda.py,
# then the expert-parallel layer at E = 1 against the plain one (scripts/bench_expert_parallel.py),
# then the kernels (scripts/bench_gpu.py: the layer, the tower and the LiT step on device tensors). Each
# step has a timeout so that the whole fits one 10-minute call of a lent GPU machine (about 9 minutes;
# PRODUCT_BUDGET=S, BENCH_GPU_BUDGET=layer=S,tower=S,lit=S and KERNELS=parts trade one for another).
#
#   bash scripts/gpu_check.sh                     # results in ./gpu-results/
#   OUT=/some/dir WHEELS=.whl bash scripts/gpu_check.sh
#   BASELINE=.baseline KERNELS=layer LAYER_SHAPES=B/16 bash scripts/gpu_check.sh   # + an older embed; fewer kernels
#   PRODUCT_ARGS="--only embed,tower --skip compile" KERNELS= bash scripts/gpu_check.sh  # some product rows only
#   PRODUCT_ARGS="--only pretrain" KERNELS= bash scripts/gpu_check.sh   # the S/16 recipe's pretrain rows alone
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
export PYTHONUNBUFFERED=1

# ---- product: the commands as users run them, default flags, against the peers (docs/benchmarks.md first)
# BASELINE: a folder holding an older lit_softmoe/ (`git archive REV lit_softmoe | tar -x -C DIR`): its embed too.
timeout $(( ${PRODUCT_BUDGET:-330} + 60 )) $PY scripts/bench_product.py --budget "${PRODUCT_BUDGET:-330}" \
    ${BASELINE:+--baseline "$BASELINE"} ${PRODUCT_ARGS:-} --json "$OUT/product.json" --md "$OUT/product.md" > "$OUT/product.log" 2>&1
echo "bench_product exit $? after $(( $(date +%s) - t0 )) s"
grep -E "^\s+\[|^embed:|ready in|Error" "$OUT/product.log" | tail -40

# ---- the GPU tests (CUDA_TESTS: a pytest -k expression to run some of them)
timeout ${CUDA_TESTS_TIMEOUT:-240} $PY -m pytest -q -s -p no:cacheprovider tests/test_cuda.py ${CUDA_TESTS:+-k "$CUDA_TESTS"} \
    > "$OUT/test_cuda.log" 2>&1
echo "test_cuda exit $? after $(( $(date +%s) - t0 )) s"
grep -E "passed|failed|resumed from|FAILED|Error" "$OUT/test_cuda.log" | tail -20

# ---- the memory plan against what CUDA holds (pretrain and LiT, two batch sizes: counted activations and the
#      plan's total within 15% of what CUDA holds)
timeout ${PLAN_TESTS_TIMEOUT:-90} $PY -m pytest -q -s -p no:cacheprovider tests/train/test_memory_plan.py -k cuda \
    > "$OUT/test_memory_plan.log" 2>&1
echo "memory plan vs CUDA exit $? after $(( $(date +%s) - t0 )) s"
grep -E "activations counted|passed|failed|Error" "$OUT/test_memory_plan.log" | tail -12

# ---- expert parallel: the layer's expert-parallel path at E = 1 against the plain layer, B/16 in bf16
#      (the same work: it must cost the same; EP_TIMEOUT=0 skips it)
if [ "${EP_TIMEOUT:-60}" != 0 ]; then
  timeout ${EP_TIMEOUT:-60} $PY scripts/bench_expert_parallel.py > "$OUT/bench_expert_parallel.log" 2>&1
  echo "bench_expert_parallel exit $? after $(( $(date +%s) - t0 )) s"
  tail -4 "$OUT/bench_expert_parallel.log"
fi

# ---- kernels: the layer, the tower and the LiT step on device tensors (KERNELS= skips them)
if [ -n "${KERNELS-layer,tower,lit}" ]; then
  timeout ${BENCH_GPU_TIMEOUT:-240} $PY scripts/bench_gpu.py --only "${KERNELS-layer,tower,lit}" --json "$OUT/bench_gpu.json" \
      --md "$OUT/bench_gpu.md" --budget "${BENCH_GPU_BUDGET:-layer=90,tower=60,lit=50}" ${LAYER_SHAPES:+--layer-shapes "$LAYER_SHAPES"} \
      > "$OUT/bench_gpu.log" 2>&1
  echo "bench_gpu.py exit $? after $(( $(date +%s) - t0 )) s"
  grep -v "^$" "$OUT/bench_gpu.md" 2>/dev/null | tail -60
fi

echo; echo "==== product.md"; cat "$OUT/product.md" 2>/dev/null
echo "total $(( $(date +%s) - t0 )) s"
