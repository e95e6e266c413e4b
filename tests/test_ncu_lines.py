"""benchmarks/ncu_lines.py: per-source-line sums of an Nsight Compute source page (ncu's CSV layout)."""

import csv
import io
import runpy
from pathlib import Path

import pytest

NL = runpy.run_path(str(Path(__file__).resolve().parents[1] / "benchmarks" / "ncu_lines.py"))

HEADER = ["Line No", "Source", "Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
          "L2 Theoretical Sectors Global Excessive", "L2 Theoretical Sectors Global",
          "L2 Theoretical Sectors Global Ideal"]


def _csv():
    """Kernel k1 in file a.py: line 10 (two LDG rows, one excessive), line 12 (a spill and an FFMA); kernel k2:
    line 10 of a.py again (kept apart from k1's). Summary rows carry totals the parser must not add twice."""
    rows = [["File Path", "/x/a.py"], ["Function Name", "k1"], HEADER,
            ["10", "y = tl.load(p)", "-", "-", "999", "999", "999", "999", "999"],
            ["", "", "0x10", "@P0   LDG.E.128 R1, desc[UR4][R2.64]", "5", "32", "16", "64", "48"],
            ["", "", "0x20", "LDG.E.128 R5, desc[UR4][R6.64]", "3", "32", "0", "32", "32"],
            ["12", "acc = tl.dot(a, b)", "-", "-", "999", "999", "0", "0", "0"],
            ["", "", "0x30", "STL [R1], R2", "1", "7", "-", "-", "-"],
            ["", "", "0x40", "FFMA R1, R2, R3, R4", "11", "64", "0", "0", "0"],
            ["File Path", "/x/a.py"], ["Function Name", "k2"], HEADER,
            ["10", "y = tl.load(p)", "-", "-", "1", "1", "1", "1", "1"],
            ["", "", "0x10", "STG.E R1, desc[UR4][R2.64]", "2", "8", "0", "8", "8"]]
    buf = io.StringIO()
    csv.writer(buf).writerows(rows)
    return buf.getvalue()


def test_sass_rows_are_summed_per_kernel_and_line_and_summary_rows_are_not_counted():
    lines = NL["parse"](csv.reader(io.StringIO(_csv())))
    by = {(ln.kernel, ln.line): ln for ln in lines}
    assert sorted(by) == [("k1", 10), ("k1", 12), ("k2", 10)]
    load = by["k1", 10]
    assert (load.stall, load.sectors, load.ideal, load.excess, load.spill) == (8, 96, 80, 16, 0)
    assert load.ops == {"LDG"} and load.source == "y = tl.load(p)"
    dot = by["k1", 12]
    assert (dot.stall, dot.spill, dot.sectors) == (12, 7, 0)
    assert by["k2", 10].ops == {"STG"} and by["k2", 10].stall == 2


def test_report_ranks_lines_and_gives_each_kernel_its_totals():
    text = NL["report"](NL["parse"](csv.reader(io.StringIO(_csv()))), top=5)
    k1 = text.split("## k2")[0]
    assert "stall samples 20;" in k1 and "excessive 16 (16.7 %)" in k1 and "spill instructions executed 7" in k1
    stall_table = k1.split("Lines by stall samples:")[1].split("Lines by")[0]
    assert stall_table.index("a.py:12") < stall_table.index("a.py:10")  # 12 samples before 8
    assert "| a.py:10 | `y = tl.load(p)` | 40.0 | 96 | 16 | 0 | LDG |" in k1
    assert "Lines by excessive L2 sectors" not in text.split("## k2")[1]  # k2 has none
    sector_table = k1.split("Lines by L2 sectors:")[1].split("Lines by")[0]
    assert "a.py:10" in sector_table and "a.py:12" not in sector_table  # line 12 moves no sectors


def test_a_csv_without_source_rows_says_how_to_export_one(tmp_path):
    empty = tmp_path / "e.csv"
    empty.write_text('"==PROF== nothing"\n')
    with pytest.raises(SystemExit, match="--print-source cuda,sass"):
        NL["main"]([str(empty)])
    with pytest.raises(SystemExit, match="cannot read"):
        NL["main"]([str(tmp_path / "missing.csv")])
