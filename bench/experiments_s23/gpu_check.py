"""Device check of the decode-attention changes: correctness (vs fp32 reference), bit-equality of the fused q/k norm,
poisoned partials; then timings in CUDA graphs against the HEAD kernels (old_*.py)."""
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from bench.timing import graph_of, time_gpu  # noqa: E402
from services.gpu_worker.attention.base import LayerAttention  # noqa: E402
from services.gpu_worker.kernels import decode_attention as da  # noqa: E402
from services.gpu_worker.kernels import rms_norm as rn  # noqa: E402
from services.gpu_worker.kernels.kv_write import kv_write_ref  # noqa: E402
from services.gpu_worker.kernels.rope import rope_ref  # noqa: E402
from services.gpu_worker.kv_cache import v_rows  # noqa: E402
from services.gpu_worker.model.llama import RMSNorm  # noqa: E402

sys.path.insert(0, os.path.join(os.getcwd(), ".devtmp"))
import old_decode_attention as old_da  # noqa: E402
import old_rms_norm as old_rn  # noqa: E402

DEV = "cuda"
FP8 = torch.float8_e4m3fn
OUT = os.environ.get("OUT", "/tmp")
results = {"device": torch.cuda.get_device_name(), "checks": {}, "times": {}}
fails = []


def check(name, ok, detail=""):
    results["checks"][name] = [bool(ok), str(detail)]
    if not ok:
        fails.append(name)
    print(("ok  " if ok else "FAIL") + " " + name + " " + str(detail), flush=True)


def rel_err(out, ref):
    if torch.isnan(out).any():
        return float("nan")
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def paged(seq_lens, page, kvh, d, dtype, gen):
    pages = [-(-n // page) for n in seq_lens]
    num = 1 + sum(pages) + 3
    perm = (torch.randperm(num - 1, generator=gen) + 1).tolist()
    kc = torch.randn((num, page, kvh, d), generator=gen).to(DEV, dtype)
    vc = torch.randn((num, page, kvh, d), generator=gen).to(DEV, dtype)
    table = torch.zeros((len(seq_lens), max(pages)), dtype=torch.int32)
    for i, n in enumerate(pages):
        table[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    return kc, vc, table.to(DEV), torch.tensor(seq_lens, dtype=torch.int32, device=DEV)


def inv_freq(d):
    return 1.0 / (1000000.0 ** (torch.arange(0, d, 2, dtype=torch.float32, device=DEV) / d))


def step(seq_lens, h, kvh, d, page, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    kc, vc, table, lens = paged(seq_lens, page, kvh, d, dtype, gen)
    qkv = torch.randn((len(seq_lens), h + 2 * kvh, d), generator=gen).to(DEV, dtype)
    pos = lens.long() - 1
    slots = (table.long().gather(1, (pos // page)[:, None])[:, 0] * page + pos % page).to(torch.int32)
    return qkv, pos.to(torch.int32), kc, vc, slots, table, lens


# --- correctness -------------------------------------------------------------------------------------------------
LENS = [1, 17, 255, 256, 257, 511, 512, 513, 700, 1000, 2048, 4095, 4096]
for cache_dtype in (torch.bfloat16, FP8):
    for window in (0, 1000, 257):
        spec = LayerAttention(sliding_window=window or None)
        for splits in (1, 8, 32):
            for min_keys in (None, 64):
                qkv, pos, kc, vc, slots, table, lens = step(LENS, 32, 4, 128, 16, torch.bfloat16, splits + window)
                if cache_dtype == FP8:
                    kc, vc = kc.to(FP8), vc.to(FP8)
                h, kvh = 32, 4
                q, k, v = qkv[:, :h], qkv[:, h:h + kvh], qkv[:, h + kvh:]
                f = inv_freq(128)
                rq, rk = rope_ref(q, k, pos, f)
                kref, vref = kc.clone(), vc.clone()
                made = []
                empty = da.partials

                def poisoned(*args):
                    part, lse = (t.fill_(float("nan")) for t in empty(*args))
                    made.append(part)
                    return part, lse

                da.partials = poisoned
                out = torch.full_like(q, float("nan"))
                da.decode_attention_rope(q, k, v, pos, f, kc, vc, slots, table, lens, splits, out=out, spec=spec,
                                         min_split_keys=min_keys)
                da.partials = empty
                if cache_dtype == FP8:
                    kw = kref.float()
                    vw = v_rows(vref).float()
                    flat_k = kw.view(-1, kvh, 128)
                    flat_v = vw.view(-1, kvh, 128)
                    flat_k[slots.long()] = rk.to(FP8).float()
                    flat_v[slots.long()] = v.to(FP8).float()
                    ref = da.decode_attention_ref(rq, kw, vw, table, lens, spec)
                    tol = 2e-2
                else:
                    kv_write_ref(rk, v, kref, vref, slots.long())
                    ref = da.decode_attention_ref(rq, kref.float(), vref.float(), table, lens, spec)
                    tol = 1e-2
                err = rel_err(out, ref)
                check(f"rope_{'fp8' if cache_dtype == FP8 else 'bf16'}_w{window}_s{splits}_mk{min_keys}", err < tol,
                      f"rel_err {err:.2e}")

# plain decode, poisoned out, default min keys
for splits in (4, 32):
    gen = torch.Generator().manual_seed(7)
    kc, vc, table, lens = paged(LENS, 16, 8, 128, torch.bfloat16, gen)
    q = torch.randn((len(LENS), 32, 128), generator=gen).to(DEV, torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    da.decode_attention(q, kc, vc, table, lens, splits, out=out)
    err = rel_err(out, da.decode_attention_ref(q, kc, vc, table, lens))
    check(f"plain_llama_s{splits}", err < 1e-2, f"rel_err {err:.2e}")

# fused head norm: bits of rms_norm_heads_ then the un-normed kernel
for dtype in (torch.bfloat16, torch.float32):
    for splits in (1, 8, 32):
        for cache in (dtype, FP8):
            lens_hn = [1, 33, 256, 257, 700, 2048]
            qkv, pos, kc, vc, slots, table, lens = step(lens_hn, 32, 4, 128, 16, dtype, splits)
            if cache == FP8:
                kc, vc = kc.to(FP8), vc.to(FP8)
            gen = torch.Generator().manual_seed(99)
            qw = torch.randn(128, generator=gen).to(DEV, dtype)
            kw = torch.randn(128, generator=gen).to(DEV, dtype)
            f = inv_freq(128)
            normed = qkv.clone()
            rn.rms_norm_heads_(normed[:, :36], qw, kw, 32, 1e-6)
            kc2, vc2 = kc.clone(), vc.clone()
            ref = da.decode_attention_rope(normed[:, :32], normed[:, 32:36], normed[:, 36:], pos, f, kc2, vc2, slots,
                                           table, lens, splits)
            out = da.decode_attention_rope(qkv[:, :32], qkv[:, 32:36], qkv[:, 36:], pos, f, kc, vc, slots, table,
                                           lens, splits, head_norm=(qw, kw, 1e-6))
            same = (torch.equal(out, ref) and torch.equal(kc.view(torch.uint8), kc2.view(torch.uint8))
                    and torch.equal(vc.view(torch.uint8), vc2.view(torch.uint8)))
            ndiff = int((out != ref).sum())
            check(f"head_norm_bits_{dtype}_{cache}_s{splits}", same, f"out elements differing: {ndiff}")

# rms_norm_heads_ (new tree) vs the model's torch norm, and vs the HEAD kernel
for dtype in (torch.bfloat16, torch.float32):
    gen = torch.Generator().manual_seed(5)
    qkv = (torch.randn((64, 40, 128), generator=gen) * 2).to(DEV, dtype)
    qn, kn = RMSNorm(128, 1e-6).to(DEV, dtype), RMSNorm(128, 1e-6).to(DEV, dtype)
    qn.weight.data = torch.randn(128, generator=gen).to(DEV, dtype)
    kn.weight.data = torch.randn(128, generator=gen).to(DEV, dtype)
    with torch.no_grad():
        want = torch.cat([qn(qkv[:, :32]), kn(qkv[:, 32:36])], 1)
    new, old = qkv.clone(), qkv.clone()
    rn.rms_norm_heads_(new[:, :36], qn.weight, kn.weight, 32, 1e-6)
    old_rn.rms_norm_heads_(old[:, :36], qn.weight, kn.weight, 32, 1e-6)
    e_new, e_old = rel_err(new[:, :36], want), rel_err(old[:, :36], want)
    check(f"rms_norm_heads_{dtype}", e_new < (1e-5 if dtype == torch.float32 else 1e-2),
          f"new {e_new:.2e} old {e_old:.2e} differing from old: {int((new != old).sum())} of {new[:, :36].numel()}")

# --- timings (µs per layer, graphs of LAYERS layers each over its own inputs) ----------------------------------
LAYERS = 48
H, KVH, D, PAGE = 32, 4, 128, 16
SPLITS = da.num_splits_for(1, KVH, torch.cuda.get_device_properties(0).multi_processor_count)
results["splits"] = SPLITS


def layer_inputs(batch, ctx, seed):
    lens_l = [ctx] * batch
    qkv, pos, kc, vc, slots, table, lens = step(lens_l, H, KVH, D, PAGE, torch.bfloat16, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    qw = torch.randn(D, generator=gen).to(DEV, torch.bfloat16)
    kw = torch.randn(D, generator=gen).to(DEV, torch.bfloat16)
    return dict(qkv=qkv, pos=pos, kc=kc, vc=vc, slots=slots, table=table, lens=lens, qw=qw, kw=kw,
                out=torch.empty((batch, H, D), dtype=torch.bfloat16, device=DEV), f=inv_freq(D))


def variant(name, x, splits):
    q, k, v = x["qkv"][:, :H], x["qkv"][:, H:H + KVH], x["qkv"][:, H + KVH:]
    common = (x["pos"], x["f"], x["kc"], x["vc"], x["slots"], x["table"], x["lens"], splits)
    if name == "old_attn":
        return lambda: old_da.decode_attention_rope(q, k, v, *common, out=x["out"])
    if name == "old_norm+attn":
        return lambda: (old_rn.rms_norm_heads_(x["qkv"][:, :H + KVH], x["qw"], x["kw"], H, 1e-6),
                        old_da.decode_attention_rope(q, k, v, *common, out=x["out"]))
    if name == "old_norm":
        return lambda: old_rn.rms_norm_heads_(x["qkv"][:, :H + KVH], x["qw"], x["kw"], H, 1e-6)
    if name == "new_norm":
        return lambda: rn.rms_norm_heads_(x["qkv"][:, :H + KVH], x["qw"], x["kw"], H, 1e-6)
    if name.startswith("new_attn_mk"):
        mk = int(name[len("new_attn_mk"):])
        return lambda: da.decode_attention_rope(q, k, v, *common, out=x["out"], min_split_keys=mk)
    if name.startswith("new_fusednorm_mk"):
        mk = int(name[len("new_fusednorm_mk"):])
        return lambda: da.decode_attention_rope(q, k, v, *common, out=x["out"], min_split_keys=mk,
                                                head_norm=(x["qw"], x["kw"], 1e-6))
    raise ValueError(name)


def timed(names, batch, ctx, splits, reps=2):
    layers = [layer_inputs(batch, ctx, 1000 + i) for i in range(LAYERS)]
    row = {}
    for name in names:
        calls = [variant(name, x, splits) for x in layers]
        graph = graph_of(lambda: [c() for c in calls])
        ts = [time_gpu(graph.replay, warmup=10, rep=100) / LAYERS * 1e6 for _ in range(reps)]
        row[name] = [round(t, 2) for t in ts]
        del graph
    del layers
    torch.cuda.empty_cache()
    return row


names = ["old_attn", "old_norm+attn", "old_norm", "new_norm", "new_attn_mk256", "new_fusednorm_mk1",
         "new_fusednorm_mk64", "new_fusednorm_mk128", "new_fusednorm_mk256", "new_fusednorm_mk512",
         "new_fusednorm_mk1024"]
for batch, ctx in ((1, 64), (1, 256), (1, 640), (1, 1024), (1, 2048), (1, 4096), (1, 16384), (8, 640), (8, 4096)):
    splits = da.num_splits_for(batch, KVH, torch.cuda.get_device_properties(0).multi_processor_count)
    t0 = time.time()
    row = timed(names, batch, ctx, splits)
    results["times"][f"B{batch}_L{ctx}_S{splits}"] = row
    print(f"B{batch} L{ctx} S{splits} ({time.time() - t0:.0f}s): " + ", ".join(f"{k} {v}" for k, v in row.items()),
          flush=True)
    with open(os.path.join(OUT, "gpu_check.json"), "w") as fh:
        json.dump(results, fh, indent=1)

# rms_norm_heads_ at prefill sizes: old kernel vs new (the sum_squares tree)
for tokens in (1, 64, 2048):
    qkvs = [torch.randn((tokens, H + 2 * KVH, D), device=DEV).to(torch.bfloat16) for _ in range(8)]
    w = torch.randn(D, device=DEV).to(torch.bfloat16)
    row = {}
    for label, mod in (("old", old_rn), ("new", rn)):
        graph = graph_of(lambda: [mod.rms_norm_heads_(x[:, :H + KVH], w, w, H, 1e-6) for x in qkvs])
        row[label] = [round(time_gpu(graph.replay, warmup=10, rep=100) / 8 * 1e6, 2) for _ in range(2)]
    results["times"][f"rms_norm_heads_T{tokens}"] = row
    print(f"rms_norm_heads T{tokens}: {row}", flush=True)

with open(os.path.join(OUT, "gpu_check.json"), "w") as fh:
    json.dump(results, fh, indent=1)
print("FAILED:", fails if fails else "none")
