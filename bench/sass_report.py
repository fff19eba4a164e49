"""What the decode split kernel compiles to on an H100/H200 (sm_90), on a machine without a GPU.

Triton compiles for a named target without a device; its wheel ships ptxas, cuobjdump and nvdisasm. For each tile
this prints the registers per thread, the stack (spills), the shared memory, the K/V copy buffers the pipeliner
made, and the instructions of the key loop by opcode: the figures that explained the FP8 cache's sweeps
(docs/PERFORMANCE.md, "Twenty-first to twenty-third runs"). The GPU's timings decide; this says why.

    python -m bench.sass_report                               # the default tiles, FP8 and bf16 caches
    python -m bench.sass_report --tiles 128,4,2,1,0 64,4,5,1,128,1 --cache fp8e4nv
    python -m bench.sass_report --v-layout rows               # an FP8 V cache of rows (before key pairs)

NOTE: run it with TRITON_INTERPRET unset: the interpreter's kernels do not compile. The integer arguments are
declared divisible by 16, as Triton's launcher specializes them at run time; without that the copies are not
vectorized and the pipeliner leaves them alone. The figures are this Triton's (the H200 image has 3.6).
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from services.gpu_worker.kernels import decode_attention

_POINTERS = {"q_ptr": "bf16", "table_ptr": "i32", "seq_lens_ptr": "i32", "out_ptr": "bf16", "part_ptr": "fp32",
             "lse_ptr": "fp32", "kn_ptr": "bf16", "vn_ptr": "bf16", "pos_ptr": "i64", "inv_freq_ptr": "fp32",
             "slot_ptr": "i64", "vw_ptr": "i16"}


def compile_tile(tile: tuple, cache: str = "fp8e4nv", new_token: bool = True, num_splits: int = 1,
                 pairs: bool | None = None):
    """The split kernel for Llama-3.1-8B's heads (4 query heads per KV head, head_dim 128, page 16); pairs: an FP8
    V cache in key pairs (None: as the engine stores it)."""
    block_n, warps, stages, f16_dot, max_regs, asm = decode_attention.full_tile(tile)
    pairs = cache == "fp8e4nv" if pairs is None else pairs
    kernel = decode_attention._decode_split_kernel
    names = kernel.arg_names
    const = {"GROUP": 4, "BLOCK_H": 16, "HEAD_DIM": 128, "PAGE_SIZE": 16, "BLOCK_N": block_n,
             "NUM_SPLITS": num_splits, "NEW_TOKEN": new_token, "F16_DOT": bool(f16_dot), "V_PAIRS": pairs,
             "V_ASM": bool(asm and pairs and f16_dot), "OFF64": False, "USE_PDL": False}
    pointers = {**_POINTERS, "k_ptr": cache, "v_ptr": cache}
    signature = {n: "constexpr" if n in const else "*" + pointers[n] if n in pointers
                 else "fp32" if n == "sm_scale" else "i32" for n in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in pointers or n.startswith("stride")}
    src = ASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=aligned)
    options = {"num_warps": warps, "num_stages": stages, **({"maxnreg": max_regs} if max_regs else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcodes of the longest backward-branching loop (the key loop), predicates and modifiers stripped."""
    return collections.Counter(t.split(".")[0] for t in loop_instructions(sass))


def loop_instructions(sass: str) -> list[str]:
    """The opcodes with modifiers (LDS.U8, LDSM.16.MT88.4, ...) of the longest backward-branching loop."""
    labels: dict[str, int] = {}
    seq: list[str] = []
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(seq)
            continue
        ins = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if ins:
            seq.append(ins.group(1))
    loops = [(labels[m.group(1)], i) for i, t in enumerate(seq)
             if (m := re.search(r"BRA.*?(\.L_x_\d+)", t)) and labels.get(m.group(1), len(seq)) < i]
    if not loops:
        return []
    start, end = max(loops, key=lambda ab: ab[1] - ab[0])
    return [re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in seq[start:end + 1]]


def report(tile: tuple, cache: str = "fp8e4nv", pairs: bool | None = None) -> dict:
    pairs = cache == "fp8e4nv" if pairs is None else pairs
    compiled = compile_tile(tile, cache, pairs=pairs)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([_tool("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    buffers = re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x\d+x\d+x", compiled.asm["ttgir"])
    ops = loop_opcodes(sass)
    byte_reads = sum(op.startswith("LDS.U8") for op in loop_instructions(sass))
    return {"tile": list(tile), "cache": cache, "v_layout": "pairs" if pairs else "rows",
            "registers": int(regs.group(1)) if regs else None,
            "stack_bytes": int(stack.group(1)) if stack else None, "shared_bytes": compiled.metadata.shared,
            "kv_copy_buffers": max((int(b) for b in buffers), default=0),
            "loop_instructions": sum(ops.values()), "loop_byte_shared_reads": byte_reads,
            "loop_opcodes": dict(ops.most_common())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiles", nargs="*", help="keys,warps,stages,fp16_dots,max_regs each; default: the sweep's")
    p.add_argument("--cache", default="", help="fp8e4nv or bf16; default: both")
    p.add_argument("--v-layout", choices=("pairs", "rows", "both"), default="both",
                   help="an FP8 cache's V: in key pairs (the engine's), rows, or both (default)")
    p.add_argument("--json", action="store_true", help="one JSON object a line")
    args = p.parse_args()
    plan = {"fp8e4nv": [decode_attention.TILE_FP8, decode_attention.TILE_FP8_FEW, (128, 4, 2, True, 0),
                        (64, 4, 2, True, 0), (64, 4, 2, True, 0, True), (128, 4, 2, True, 128)],
            "bf16": [decode_attention.TILE, (64, 4, 5, False, 0)]}
    if args.tiles:
        plan = {cache: [decode_attention.parse_tile(t) for t in args.tiles] for cache in plan}
    for cache, tiles in plan.items():
        if args.cache and cache != args.cache:
            continue
        layouts = [False] if cache != "fp8e4nv" else {"pairs": [True], "rows": [False]}.get(args.v_layout,
                                                                                               [False, True])
        for tile, pairs in ((t, p) for t in tiles for p in layouts):
            if not pairs and len(tile) > 5 and tile[5]:
                continue  # the assembly unpacks pairs only
            r = report(tile, cache, pairs)
            if args.json:
                print(json.dumps(r), flush=True)
                continue
            print(f"{cache:8} {r['v_layout']:5} {decode_attention.tile_name(tile):22} regs {r['registers']:>3}  "
                  f"stack {r['stack_bytes']:>3}  "
                  f"shared {r['shared_bytes']:>6}  buffers {r['kv_copy_buffers']}  loop {r['loop_instructions']:>5}  "
                  f"LDS.U8 {r['loop_byte_shared_reads']:>3}  "
                  + ", ".join(f"{k} {v}" for k, v in list(r["loop_opcodes"].items())[:12]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
