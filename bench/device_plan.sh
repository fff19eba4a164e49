#!/usr/bin/env bash
# On the device machine, after `R=$PWD; source bench/device_clean.sh && cd /tmp/clean`: the pending GPU runs of the
# open issues, grouped into calls of under 600 s, the group chosen by the card that came (the H200-only figures run
# only on an H200; the card-independent ones on either). Steps write under $OUT/steps (bundled as steps.tgz).
#   bash bench/device_plan.sh R PLAN      PLAN: first | second
# first:  on an H200, the served W1, W0, W6 (issue 24); otherwise the card-independent steps.
# second: on an H200, the served quantized runs (issue 25) and speculation's two ratios (issue 26); otherwise the
#         card-independent steps not yet run.
set -u
R=$1 plan=$2
S=$OUT/steps
mkdir -p "$S"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "device_plan: $plan on $gpu"
independent=(
    "tspec|130|python -m pytest -q -m gpu -p no:cacheprovider tests/e2e/test_spec_serve_gpu.py"
    "so|100|python -m bench.structured_output --device cuda --model random:llama3-8b --tokenizer $R/.tok --batches 1 64 --out $S/so.json"
    "overlap|80|python -m bench.overlap_probe --batch 368 256 --context 1500 --out $S/overlap.json"
    "moe|200|python -m bench.model_speed --presets qwen3-30b-a3b,qwen3-30b-a3b:torch_routing --out $S/ms_moe"
)
case "$plan:$gpu" in
    first:*H200*)
        SUITE_TIMEOUT_S=545 bash bench/served_gpu.sh r1 w1,w0,w6 --w6-duration-s 300 --w6-concurrency 512
        ;;
    second:*H200*)
        bash bench/device_steps.sh 570 \
            "q|400|SUITE_TIMEOUT_S=390 bash bench/served_gpu.sh q b1,w0,b1-fp8,w0-fp8,w1-fp8,b1-awq" \
            "spec|100|python -m bench.spec_decode --device cuda --model random:llama3-8b --proposer replay --alpha 0.8 0 --k 4 --batches 1 8 --rounds 2 --max-tokens 128 --out $S/spec.json" \
            "overlap|60|python -m bench.overlap_probe --batch 368 256 --context 1500 --out $S/overlap.json"
        ;;
    first:*)
        bash bench/device_steps.sh 570 "${independent[@]}"
        ;;
    second:*)
        bash bench/device_steps.sh 570 \
            "awq|110|python -m bench.model_speed --presets llama3-8b@awq --out $S/ms_awq" \
            "q|400|SUITE_TIMEOUT_S=390 bash bench/served_gpu.sh q b1,w0,b1-awq"
        ;;
esac
tar czf "$OUT/steps.tgz" -C "$OUT" steps && rm -rf "$S"
(cd ~/.triton && tar czf "$OUT/triton_cache.tgz" cache)
ls -la "$OUT"
