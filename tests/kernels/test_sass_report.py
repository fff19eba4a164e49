"""bench/sass_report.py compiles the decode split kernel for sm_90 without a GPU and reads its machine code: the
FP8 cache's fp16 dots widen e4m3 with the packed conversion (F2FP, two values an instruction), widening to bf16
goes through F2F, the 5-stage tile double-buffers the K/V copies, and V in key pairs is read without the byte-wide
shared-memory loads of 8-bit rows. (A subprocess: this suite's kernels run under TRITON_INTERPRET, which does not
compile.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm").exists():
    pytest.skip("this Triton wheel has no nvdisasm", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]


def test_fp16_dots_widen_fp8_in_packed_pairs_and_five_stages_double_buffer():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "bench.sass_report", "--cache", "fp8e4nv", "--json",
                          "--tiles", "64,4,5,1,0", "64,4,2,0,0", "64,4,2,1,0", "64,4,2,1,0,1"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = {(r["v_layout"], tuple(r["tile"])): r for r in map(json.loads, out.stdout.splitlines())}
    f16, bf16 = got["rows", (64, 4, 5, True, 0, False)], got["rows", (64, 4, 2, False, 0, False)]
    assert f16["loop_opcodes"].get("HMMA", 0) > 0 and f16["registers"] > 0
    assert f16["loop_opcodes"].get("F2FP", 0) > 0 and "F2F" not in f16["loop_opcodes"]
    assert bf16["loop_opcodes"].get("F2F", 0) > 0
    assert (f16["kv_copy_buffers"], bf16["kv_copy_buffers"]) == (2, 1)
    # V of 8-bit rows is read from shared memory a byte at a time; in key pairs, by 16-bit transposed reads
    rows, pairs, asm = (got[layout, (64, 4, 2, True, 0, a)] for layout, a in (("rows", False), ("pairs", False),
                                                                               ("pairs", True)))
    assert rows["loop_byte_shared_reads"] > 0
    for r in (pairs, asm):
        assert r["loop_byte_shared_reads"] == 0 and r["loop_opcodes"].get("LDSM", 0) > 0, r
    assert asm["loop_instructions"] < pairs["loop_instructions"]  # the assembly splits the words in fewer
    assert ("rows", (64, 4, 2, True, 0, True)) not in got  # it unpacks pairs only
