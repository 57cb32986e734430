"""`ds4-run --profile`: per-phase latency table on stderr, phases recorded where they happen."""

from __future__ import annotations

import pytest
import torch

from ds4trt.cli import run_main
from ds4trt.runtime.profile import PHASES, PhaseTimer

torch.set_num_threads(1)


def test_phase_timer_percentiles():
    t = PhaseTimer()
    t.enabled = True
    t.times["verify"] = [i / 1000 for i in range(1, 101)]        # 1..100 ms
    row = [line for line in t.report().splitlines() if line.startswith("verify")][0].split()
    assert row[1:4] == ["100", "51.000", "100.000"]               # calls, p50, p99 (nearest rank)


def test_disabled_timer_records_nothing():
    t = PhaseTimer()
    with t.phase("decode"):
        pass
    assert t.times == {}


def test_profile_flag_prints_phases(tiny_gguf, tiny_mtp_gguf, capsys):
    try:
        with pytest.raises(SystemExit) as e:
            run_main(["--gguf", str(tiny_gguf), "--mtp", str(tiny_mtp_gguf), "--glm-mtp", "--mtp-margin", "0",
                      "--mtp-draft", "2", "-p", "hello", "-n", "6", "--profile"])
        assert e.value.code == 0
        err = capsys.readouterr().err
        phases = {line.split()[0]: int(line.split()[1]) for line in err.splitlines()
                  if line.split() and line.split()[0] in ("prefill", "draft", "verify", "accept", "commit")}
        assert set(phases) == {"prefill", "draft", "verify", "accept", "commit"}
        assert phases["verify"] == phases["accept"] == phases["commit"] >= 1
    finally:
        PHASES.enabled = False
        PHASES.times.clear()


def test_trace_table_sums_kernels_per_trace(tmp_path):
    """scripts/trace_table.py: per-kernel totals and launch counts side by side, Inductor kernels as one row, the
    totals over every kernel; a malformed line is one clear error naming the file and line."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "trace_table.py"
    a, b = tmp_path / "a.tsv", tmp_path / "b.tsv"
    a.write_text("30.5\t_q8_rows\n2.0\ttriton_poi_fused_add_0\n3.0\ttriton_red_fused_mean_1\n10.0\t_q8_rows\n")
    b.write_text("25.0\t_q8_rows\n21.0\tvoid at::native::radixSortKVInPlace<-2, -1, 64>(x)\n")
    run = lambda *p: subprocess.run([sys.executable, script, *map(str, p), "--min-us", "4"],
                                    capture_output=True, text=True)
    out = run(a, b)
    assert out.returncode == 0, out.stderr
    rows = {line[:52].strip(): line[52:].split() for line in out.stdout.splitlines()[1:]}
    assert rows["_q8_rows"] == ["40.5", "/", "2", "25.0", "/", "1"]
    assert rows["triton_* (Inductor)"] == ["5.0", "/", "2", "0.0", "/", "0"]
    assert rows["total"] == ["45.5", "/", "4", "46.0", "/", "2"]
    (tmp_path / "bad.tsv").write_text("_q8_rows 3.0\n")
    out = run(tmp_path / "bad.tsv")
    assert out.returncode != 0 and out.stderr.strip().count("\n") == 0 and "bad.tsv line 1" in out.stderr


def test_ncu_sass_table_counts_per_hgmma_and_stall_shares(tmp_path):
    """scripts/ncu_sass_table.py on an ncu per-instruction export of one kernel: executed instructions by opcode
    (predicates and modifiers dropped) per HGMMA, stall samples by reason (the Not Issued columns left out) as shares
    of all samples; a file without the table is one clear error."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "ncu_sass_table.py"
    csv = tmp_path / "k.csv"
    hdr = '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_long_sb",' \
          '"stall_long_sb (Not Issued)","stall_wait"'
    csv.write_text("\n".join([
        '"Kernel Name","moe_gateup_iq2_wg"', hdr,
        '"0x10","@P2   PRMT R17, R17, 0x5432, R10","60","2,000","50","40","10"',
        '"0x20","PRMT R1, R2, 0x4140, R3","10","1000","0","0","10"',
        '"0x30","IMAD.WIDE R4, R11, 0x4, R4","10","500","5","5","5"',
        '"0x40","HGMMA.64x64x16.F32 R24, R104, gdesc[UR4], R24","20","500","0","0","20"']) + "\n")
    out = subprocess.run([sys.executable, script, csv, "--top", "1"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "4 instructions, 0.0 M warp instructions executed, 8.0 per HGMMA" in lines[0]
    assert "PRMT 6.0 (75.0), IMAD 1.0 (12.5), HGMMA 1.0 (12.5)" in lines[1]
    assert "long_sb 55.0, wait 45.0" in lines[2]
    assert "PRMT R17" in lines[3] and lines[3].strip().startswith("60.0 %")
    (tmp_path / "other.csv").write_text('"a","b"\n"1","2"\n')
    out = subprocess.run([sys.executable, script, tmp_path / "other.csv"], capture_output=True, text=True)
    assert out.returncode != 0 and out.stderr.strip().count("\n") == 0 and "other.csv" in out.stderr


def test_trace_table_ends_gives_each_kernel_its_share_of_the_span(tmp_path):
    """scripts/trace_table.py --ends on a timeline: a kernel that starts before the previous one ends (programmatic
    dependent launch) counts only past that end, one inside another counts nothing, idle gaps are their own row,
    and the shares add up to the span; a line without three fields is one clear error; --launches lists each launch's
    share in launch order."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "trace_table.py"
    t = tmp_path / "step.tsv.timeline"
    # unsorted on purpose: the shares follow the starts
    t.write_text("5.0\t10.0\t_attend_join\n0.0\t10.0\t_attend_part\n21.0\t0.5\ttriton_poi_fused_1\n"
                 "20.0\t2.0\t_kv_row\n")
    out = subprocess.run([sys.executable, script, "--ends", str(t), "--min-us", "0"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    rows = {line[:52].strip(): line[52:].split() for line in out.stdout.splitlines()[1:]}
    assert rows["_attend_part"] == ["10.0", "/", "1"] and rows["_attend_join"] == ["5.0", "/", "1"]
    assert rows["(idle)"] == ["5.0", "/", "1"] and rows["_kv_row"] == ["2.0", "/", "1"]
    assert rows["triton_* (Inductor)"] == ["0.0", "/", "1"]
    assert rows["total"] == ["22.0", "/", "5"]
    (tmp_path / "bad.timeline").write_text("0.0\t_q8_rows\n")
    out = subprocess.run([sys.executable, script, "--ends", str(tmp_path / "bad.timeline")], capture_output=True,
                         text=True)
    assert out.returncode != 0 and out.stderr.strip().count("\n") == 0 and "bad.timeline line 1" in out.stderr
    out = subprocess.run([sys.executable, script, "--ends", "--launches", str(t)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert [line.split() for line in out.stdout.splitlines()] == [
        ["10.0", "_attend_part"], ["5.0", "_attend_join"], ["5.0", "(idle)"], ["2.0", "_kv_row"],
        ["0.0", "triton_poi_fused_1"]]                  # launch order, each Inductor kernel by its own name
    out = subprocess.run([sys.executable, script, "--launches", str(t)], capture_output=True, text=True)
    assert out.returncode != 0 and "--launches takes --ends" in out.stderr


SASS_TWO_LOOPS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   FFMA R2, R3, R4, R5 ;
        /*0020*/                   LDG.E R6, desc[UR4][R8.64] ;
        /*0030*/                   FADD R2, R2, R6 ;
        /*0040*/              @P0 BRA 0x10 ;
        /*0050*/                   IADD3 R7, R7, 0x1, RZ ;
        /*0060*/             @!P1 BRA 0x50 ;
        /*0070*/                   BRA 0x90 ;
        /*0080*/                   NOP;
        /*0090*/                   EXIT ;
        /*00a0*/                   BRA 0xa0;
"""


def test_loop_instructions_counts_the_longest_backward_branch_body():
    """sm90.loop_instructions (scripts/sass_report.py's loop column): the loop at 0x10..0x40 (4 instructions) is
    longer than the one at 0x50..0x60 (2); neither a forward branch nor the closing branch to itself is a loop."""
    from ds4trt.testing.sm90 import loop_instructions
    assert loop_instructions(SASS_TWO_LOOPS) == 4
    assert loop_instructions(SASS_TWO_LOOPS.replace("@P0 BRA 0x10", "@P0 BRA 0x80")) == 2
    assert loop_instructions("        /*0000*/                   EXIT ;\n") == 0
