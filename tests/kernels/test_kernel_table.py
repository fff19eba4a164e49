"""bench/kernel_table.py on small shapes: every row runs its kernel on inputs it built and matches the kernel's
reference, so a miswired row fails here and not inside a device call; and its bytes and call counts are the ones
the table's docstring defines."""
from __future__ import annotations

import torch

from bench import kernel_table as kt
from tests.kernels.helpers import DEVICE

SMALL = kt.Shapes(hidden=64, heads=4, kv_heads=2, head_dim=16, inter=96, vocab=300, page_size=4,
                  decode=((1, 37), (3, 20)), tokens=(1, 5), extend=((2, 9),), argmax_rows=(2,))


def test_every_row_matches_its_reference():
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # the interpreter's dots are fp32
    timer = kt.graph_timer if DEVICE == "cuda" else kt.eager_timer
    rows = kt.table(SMALL, timer=timer, max_calls=2, copy_tbs=4.0, device=DEVICE, dtype=dtype)
    plain = "bf16" if dtype == torch.bfloat16 else "fp32"
    expected = {"empty", "extend_2x9", "argmax_2x300"}
    expected |= {f"decode_{c}_B{b}_L{n}" for c in (plain, "fp8") for b, n in SMALL.decode}
    for t in SMALL.tokens:
        expected |= {f"rms_norm_T{t}", f"rope_kv_write_{plain}_T{t}", f"rope_kv_write_fp8_T{t}", f"silu_mul_T{t}",
                     f"embedding_T{t}", f"rms_norm_T{t}_4_partials"}
    assert set(rows) == expected
    for name, row in rows.items():
        # NOTE: FP8 rows are looser: on the CPU Triton's interpreter rounds a few values to FP8 one binade low
        # (tests/kernels/test_fp8_kv.py); a wrong slot, position or head would be off by far more
        tol = 0.1 if "fp8" in name else (2e-2 if dtype == torch.bfloat16 else 1e-5)
        assert row["rel_err"] <= tol, (name, row)
        assert row["us"] > 0 and row["calls"] == 2
        assert ("tb_s" in row and "of_copy" in row) == (name != "empty")
    assert rows["extend_2x9"]["tflops"] >= 0
    esize = dtype.itemsize
    # a decode call reads every cached key and value, q, k and v, and writes out (and the new k, v)
    assert rows["decode_fp8_B3_L20"]["bytes"] == 3 * 20 * 2 * 16 * 2 * 1 + 3 * (2 * 4 + 2 * 2) * 16 * esize
    assert rows["rms_norm_T5_4_partials"]["bytes"] == 4 * 5 * 64 * 4 + 3 * 5 * 64 * esize
    assert rows["silu_mul_T5"]["bytes"] == 3 * 5 * 96 * esize


def test_small_rows_take_many_calls_so_the_graph_outgrows_l2():
    """Each call has inputs of its own; a row's calls together touch ≥ BYTES_PER_GRAPH, up to MAX_CALLS."""
    seen = []

    def timer(calls):
        seen.append(len(calls))
        return 1e-6

    t = kt.Table(SMALL, timer, kt.MAX_CALLS, None, DEVICE, torch.float32)
    t.measure("small", 1 << 10, lambda i: ((lambda: None), (lambda: 0.0)))
    t.measure("large", kt.BYTES_PER_GRAPH // 4, lambda i: ((lambda: None), (lambda: 0.0)))
    t.measure("huge", kt.BYTES_PER_GRAPH * 4, lambda i: ((lambda: None), (lambda: 0.0)))
    assert seen == [kt.MAX_CALLS, 4, 2]
    assert t.rows["large"]["tb_s"] == round(kt.BYTES_PER_GRAPH // 4 / 1e-6 / 1e12, 3)
    assert "of_copy" not in t.rows["large"]  # no copy ceiling measured


def test_the_tile_sweep_names_each_tile_and_checks_it():
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    plain = (16, 2, 2, False, 0, False)
    fp8 = (32, 4, 2, True, 0, True)  # the unpacking assembly falls back to Triton's conversion on the CPU
    rows = kt.tile_sweep(SMALL, timer=kt.graph_timer if DEVICE == "cuda" else kt.eager_timer, max_calls=2,
                         device=DEVICE, sweep_shapes=((1, 37),), tiles={dtype: (plain,), kt.FP8: (fp8,)}, dtype=dtype)
    name = "bf16" if dtype == torch.bfloat16 else "fp32"
    assert set(rows) == {f"decode_{name}_B1_L37_16x2w2s", "decode_fp8_B1_L37_32x4w2s_f16dot_asm"}
    assert all(row["rel_err"] < 0.02 for row in rows.values()), rows


def test_the_split_sweep_names_each_count_and_checks_it():
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    rows = kt.split_sweep(SMALL, timer=kt.graph_timer if DEVICE == "cuda" else kt.eager_timer, max_calls=2,
                          device=DEVICE, sweep_shapes=((2, 20),), counts=(1, 4), dtype=dtype)
    name = "bf16" if dtype == torch.bfloat16 else "fp32"
    assert set(rows) == {f"decode_{c}_B2_L20_{n}splits" for c in (name, "fp8") for n in (1, 4)}
    for key, row in rows.items():  # FP8: the first test's NOTE
        assert row["rel_err"] < (0.1 if "fp8" in key else 0.02) and row["splits"] == int(key[-7]), (key, row)


def test_the_gemv_sweep_checks_each_tile_and_tunes_from_the_fastest():
    """Every projection at 1 and 8 tokens, on cuBLAS and each tile that fits a part, matches the GEMV's reference;
    "best" names the fastest tile; gemv_tuning turns it into kernels/gemv.TUNED entries and a row split count."""
    from services.gpu_worker.kernels import gemv as g

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    timer = kt.graph_timer if DEVICE == "cuda" else kt.eager_timer
    tiles = {1: ((8, 16, 2, 1), (16, 32, 4, 1)), 8: ((16, 16, 4, 1),)}
    res = kt.gemv_sweep(SMALL, timer=timer, max_calls=2, device=DEVICE, dtype=dtype, tiles=tiles.get)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for name, row in res["rows"].items():
        assert row["rel_err"] <= tol, (name, row)
    # o and down have K = 64 and 96: 8 parts leave 8 or 12 columns a part, narrower than every tile's 16 or 32, so
    # those entries are skipped, not guessed
    assert "o_M1_p8" not in res["best"] and "o_M1_p4" in res["best"] and "down_M8_p8" not in res["best"]
    for key, b in res["best"].items():
        fastest = min((r["us"], n) for n, r in res["rows"].items()
                      if n.startswith(f"gemv_{key}_") and not n.endswith("cublas"))
        assert b["us"] == fastest[0] and fastest[1].endswith("{}x{}w{}s{}".format(*b["config"]))
    tuned, row_parts = kt.gemv_tuning(res["best"])
    assert row_parts in (1, 2, 4)
    down = res["best"][f"down_M1_p{row_parts}"]
    assert tuned[(SMALL.hidden, SMALL.inter, row_parts, 1)] == g.GemvConfig(*down["config"])
    assert {key[3] for key in tuned} == {1} and len(tuned) == sum(1 for k in res["best"] if "_M1_" in k)


def test_a_model_without_a_dense_mlp_sweeps_its_attention_projections_and_lm_head():
    """--gemv-model qwen3-30b-a3b: q/k/v, o and the LM head only (its MLPs are experts), each tile of
    gemv_tiles_narrow that fits K checked against the reference; gemv_tuning makes entries for those shapes only."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    timer = kt.graph_timer if DEVICE == "cuda" else kt.eager_timer
    small = kt.Shapes(hidden=512, heads=2, kv_heads=1, head_dim=256, inter=0, vocab=96, page_size=16, decode=(),
                      tokens=(), extend=(), argmax_rows=())  # K of 512: the narrowest tiles fit
    assert [name for name, *_ in kt.gemv_shapes(small)] == ["qkv", "o", "lm_head"]
    assert [name for name, *_ in kt.gemv_shapes(kt.QWEN3_30B_A3B_DENSE)] == ["qkv", "o", "lm_head"]
    tiles = {1: tuple(t for t in kt.gemv_tiles_narrow(1) if t[0] >= 4 and t[1] == 512)}
    res = kt.gemv_sweep(small, timer=timer, max_calls=2, device=DEVICE, dtype=dtype, tokens=(1,), tiles=tiles.get,
                        max_parts=1)
    assert set(res["best"]) == {"qkv_M1_p1", "o_M1_p1", "lm_head_M1_p1"}
    for name, row in res["rows"].items():
        assert row["rel_err"] <= (2e-2 if dtype == torch.bfloat16 else 1e-5), (name, row)
    tuned, _ = kt.gemv_tuning(res["best"])
    assert set(tuned) == {(1024, 512, 1, 1), (512, 512, 1, 1), (96, 512, 1, 1)}


def test_the_moe_rows_check_the_fused_layer_and_count_the_experts_hit():
    """Each token count and tile runs the fused MoE against its reference; the bytes are x, the output and the
    expected weights of the experts hit (all of them once every token picks all, here at k = E)."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    timer = kt.graph_timer if DEVICE == "cuda" else kt.eager_timer
    shapes = kt.MoeShapes(hidden=32, inter=24, num_experts=4, top_k=2, tokens=(1, 9))
    rows = kt.moe_rows(shapes, timer=timer, max_calls=2, device=DEVICE, dtype=dtype,
                       tiles=(None, (16, 16, 16, 4, 1)))
    assert set(rows) == {f"moe_E4_k2_T{t}{tile}" for t in (1, 9) for tile in ("", "_16x16x16w4s1")}
    # --moe-torch-align: the torch sort beside the kernels' where the pairs outgrow align_small (130 · 2 > 256)
    sorts = kt.moe_rows(kt.MoeShapes(32, 24, 4, 2, (9, 130)), timer=timer, max_calls=2, device=DEVICE, dtype=dtype,
                        tiles=((16, 16, 16, 4, 1),), torch_align=True)
    assert set(sorts) == {"moe_E4_k2_T9_16x16x16w4s1", "moe_E4_k2_T130_16x16x16w4s1",
                          "moe_E4_k2_T130_16x16x16w4s1_torchsort"}
    assert all(row["rel_err"] <= (2e-2 if dtype == torch.bfloat16 else 1e-5) for row in sorts.values())
    for name, row in rows.items():
        assert row["rel_err"] <= (2e-2 if dtype == torch.bfloat16 else 1e-5), (name, row)
        assert row["calls"] == 2 and row["tflops"] >= 0
    esize, expert_bytes = dtype.itemsize, 3 * 32 * 24 * dtype.itemsize
    assert rows["moe_E4_k2_T1"]["bytes"] == 2 * expert_bytes + 2 * 32 * esize  # one token: its 2 experts
    everyone = kt.moe_rows(kt.MoeShapes(32, 24, 4, 4, (3,)), timer=timer, max_calls=2, device=DEVICE, dtype=dtype)
    assert everyone["moe_E4_k4_T3"]["bytes"] == 4 * expert_bytes + 2 * 3 * 32 * esize


def test_the_moe_gemv_sweep_checks_each_decode_tile_and_the_router():
    """--moe-gemv-sweep: at a token count up to its limit, kernels/moe_gemv.py with each gate_up tile (down at its
    default) and each other down tile, every one against the reference; none past the limit; the router's logits at
    one token on cuBLAS and on the Triton GEMV; its top-k on 1, 2 and 4 warps."""
    from services.gpu_worker.kernels.moe_gemv import default_config

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    timer = kt.graph_timer if DEVICE == "cuda" else kt.eager_timer
    shapes = kt.MoeShapes(hidden=32, inter=24, num_experts=8, top_k=2, tokens=(1, 3))
    rows = kt.moe_rows(shapes, timer=timer, max_calls=2, device=DEVICE, dtype=dtype, tiles=((16, 16, 16, 4, 1),),
                       gemv_sweep=True, gemv_max_tokens=2)
    gemv_rows = [name for name in rows if "_gemv_" in name]
    assert gemv_rows and all(name.startswith("moe_E8_k2_T1_gemv_") for name in gemv_rows)
    base_down = tuple(default_config(32, 24).down)  # not among MOE_GEMV_DOWN at these shapes: 8 + 8 rows
    assert len(gemv_rows) == len(kt.MOE_GEMV_GATE_UP) + len([d for d in kt.MOE_GEMV_DOWN if d != base_down]) == 16
    assert {"moe_E8_k2_T1_16x16x16w4s1", "moe_E8_k2_T3_16x16x16w4s1", "gemv_router_M1_p1_cublas",
            "gemv_router_M1_p1_2x2048w4s1"} <= set(rows)
    assert {f"route_topk_T{t}_w{w}" for t in (1, 64, 256) for w in (1, 2, 4)} <= set(rows)
    for name, row in rows.items():
        assert row["rel_err"] <= (2e-2 if dtype == torch.bfloat16 else 1e-5), (name, row)
    assert rows[gemv_rows[0]]["bytes"] == rows["moe_E8_k2_T1_16x16x16w4s1"]["bytes"]


def test_the_w4a16_sweep_checks_each_tile_against_the_dequantized_weight():
    """Each projection but the LM head at one token: the INT4 kernel at its default tile and each tile that fits K
    matches the dequantized matmul; "best" names the fastest of the tiles tried, beside the default and bf16 rows."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    timer = kt.graph_timer if DEVICE == "cuda" else kt.eager_timer
    tiles = ((1, 2, 32, 4, 1), (1, 4, 64, 4, 1), (1, 2, 128, 4, 1))  # 128 is wider than every K here (64, 96)
    res = kt.w4a16_sweep(SMALL, timer=timer, max_calls=2, device=DEVICE, dtype=dtype, tiles=tiles, group_size=32,
                         tokens=(5,))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for name, row in res["rows"].items():
        assert row["rel_err"] <= tol, (name, row)
    assert set(res["best"]) == {"qkv", "o", "gate_up", "down"}
    assert not any(key.endswith("1x2x128w4s1") for key in res["rows"]) and "w4a16_down_M1_1x4x64w4s1" in res["rows"]
    for name, b in res["best"].items():
        fastest = min((r["us"], key) for key, r in res["rows"].items()
                      if key.startswith(f"w4a16_{name}_M1_") and not key.endswith("default"))
        assert b["us"] == fastest[0] and fastest[1].endswith("{}x{}x{}w{}s{}".format(*b["config"]))
        assert b["default_us"] == res["rows"][f"w4a16_{name}_M1_default"]["us"]
        several = res["tokens"][f"{name}_M5"]  # five tokens: as served, the dequantizing tile, bf16
        assert several["default_us"] == res["rows"][f"w4a16_{name}_M5_default"]["us"] and several["bf16_cublas_us"] > 0
        assert several["dequant_cublas_us"] == res["rows"][f"w4a16_{name}_M5_dequant"]["us"]


def test_the_fp8_gemv_sweep_checks_each_tile_against_the_scaled_weight():
    """Each projection but the LM head at one token with e4m3 weights: the GEMV at its default tile and at each tile
    that fits K matches x @ (weight · scale)ᵀ; "best" names the fastest tile tried, beside the default."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    timer = kt.graph_timer if DEVICE == "cuda" else kt.eager_timer
    tiles = ((1, 32, 4, 1), (2, 64, 4, 1), (4, 128, 4, 1))  # 128 is wider than every K here (64, 96)
    res = kt.fp8_gemv_sweep(SMALL, timer=timer, max_calls=2, device=DEVICE, dtype=dtype, tiles=tiles)
    for name, row in res["rows"].items():
        assert row["rel_err"] <= 2e-2, (name, row)
    assert set(res["best"]) == {"qkv", "o", "gate_up", "down"}
    assert "gemv8_o_M1_2x64w4s1" in res["rows"] and not any(key.endswith("4x128w4s1") for key in res["rows"])
    for name, b in res["best"].items():
        fastest = min((r["us"], key) for key, r in res["rows"].items()
                      if key.startswith(f"gemv8_{name}_M1_") and not key.endswith("default"))
        assert b["us"] == fastest[0] and fastest[1].endswith("{}x{}w{}s{}".format(*b["config"]))
