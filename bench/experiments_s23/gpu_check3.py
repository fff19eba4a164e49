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
import var_da_sum, var_da_lat, var_da_latsum, var_rms_norm_sum, var_da_fix, var_rms_norm_fix, var_da_noret  # noqa: E402
MODS = {"cur": da, "sum": var_da_sum, "fix": var_da_fix, "noret": var_da_noret}

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



# correctness of the variants (poisoned partials, vs the reference), and bits of the tl.sum norm
for vname, mod in (("fix", var_da_fix), ("noret", var_da_noret)):
    for splits in (8, 32):
        for window in (0, 257):
            spec = LayerAttention(sliding_window=window or None)
            LENS = [1, 17, 255, 256, 257, 700, 2048, 4096]
            qkv, pos, kc, vc, slots, table, lens = step(LENS, 32, 4, 128, 16, torch.bfloat16, splits + window)
            q, k, v = qkv[:, :32], qkv[:, 32:36], qkv[:, 36:]
            f = inv_freq(128)
            rq, rk = rope_ref(q, k, pos, f)
            kref, vref = kc.clone(), vc.clone()
            empty = mod.partials
            mod.partials = lambda *a: tuple(t.fill_(float("nan")) for t in empty(*a))
            out = torch.full_like(q, float("nan"))
            mod.decode_attention_rope(q, k, v, pos, f, kc, vc, slots, table, lens, splits, out=out, spec=spec,
                                      min_split_keys=64)
            mod.partials = empty
            kv_write_ref(rk, v, kref, vref, slots.long())
            err = rel_err(out, da.decode_attention_ref(rq, kref.float(), vref.float(), table, lens, spec))
            check(f"{vname}_s{splits}_w{window}", err < 1e-2, f"rel_err {err:.2e}")
for vname, mod, norm in (("fix", var_da_fix, var_rms_norm_fix),):
    diffs = []
    for seed in range(6):
        for dtype in (torch.bfloat16, torch.float32):
            qkv, pos, kc, vc, slots, table, lens = step([1, 33, 700, 2048], 32, 4, 128, 16, dtype, seed)
            gen = torch.Generator().manual_seed(seed)
            qw = torch.randn(128, generator=gen).to(DEV, dtype)
            kw = torch.randn(128, generator=gen).to(DEV, dtype)
            f = inv_freq(128)
            normed = qkv.clone()
            norm.rms_norm_heads_(normed[:, :36], qw, kw, 32, 1e-6)
            kc2, vc2 = kc.clone(), vc.clone()
            ref = mod.decode_attention_rope(normed[:, :32], normed[:, 32:36], normed[:, 36:], pos, f, kc2, vc2, slots,
                                            table, lens, 32)
            out = mod.decode_attention_rope(qkv[:, :32], qkv[:, 32:36], qkv[:, 36:], pos, f, kc, vc, slots, table,
                                            lens, 32, head_norm=(qw, kw, 1e-6))
            diffs.append((str(dtype)[6:], int((out != ref).sum()), int((kc != kc2).sum())))
    check(f"bits_{vname}", all(d[1] == 0 and d[2] == 0 for d in diffs), f"(dtype, out diffs, k cache diffs): {diffs}")

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
    if "." in name:  # module.kind_mkN
        vname, rest = name.split(".")
        mod = MODS[vname]
        kind, mk = rest.split("_mk")
        q, k, v = x["qkv"][:, :H], x["qkv"][:, H:H + KVH], x["qkv"][:, H + KVH:]
        common = (x["pos"], x["f"], x["kc"], x["vc"], x["slots"], x["table"], x["lens"], splits)
        hn = (x["qw"], x["kw"], 1e-6) if kind == "fused" else None
        return lambda: mod.decode_attention_rope(q, k, v, *common, out=x["out"], min_split_keys=int(mk), head_norm=hn)
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



names = ["old_attn", "old_norm+attn", "cur.attn_mk64", "noret.attn_mk64", "cur.fused_mk64", "sum.fused_mk64",
         "fix.fused_mk64"]
for batch, ctx in ((1, 64), (1, 640), (1, 4096), (8, 640)):
    splits = da.num_splits_for(batch, KVH, torch.cuda.get_device_properties(0).multi_processor_count)
    t0 = time.time()
    row = timed(names, batch, ctx, splits)
    results["times"][f"B{batch}_L{ctx}_S{splits}"] = row
    print(f"B{batch} L{ctx} S{splits} ({time.time() - t0:.0f}s): " + ", ".join(f"{k} {v}" for k, v in row.items()),
          flush=True)
for tokens in (1, 64, 2048):
    qkvs = [torch.randn((tokens, H + 2 * KVH, D), device=DEV).to(torch.bfloat16) for _ in range(8)]
    w = torch.randn(D, device=DEV).to(torch.bfloat16)
    row = {}
    for label, mod in (("old", old_rn), ("tree", rn), ("fix", var_rms_norm_fix), ("sum", var_rms_norm_sum)):
        graph = graph_of(lambda: [mod.rms_norm_heads_(x[:, :H + KVH], w, w, H, 1e-6) for x in qkvs])
        row[label] = [round(time_gpu(graph.replay, warmup=10, rep=100) / 8 * 1e6, 2) for _ in range(2)]
    results["times"][f"rms_norm_heads_T{tokens}"] = row
    print(f"rms_norm_heads T{tokens}: {row}", flush=True)
with open(os.path.join(OUT, "gpu_check3.json"), "w") as fh:
    json.dump(results, fh, indent=1)
print("FAILED:", fails if fails else "none")
