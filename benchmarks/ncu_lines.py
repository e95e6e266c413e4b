"""Per-source-line summary of an Nsight Compute report's source page: where a kernel's warps stall, which loads
fetch more L2 sectors than their bytes need, where registers spill.

On the device machine (the report stays there; this prints a few kilobytes):

    ncu --clock-control none --profile-from-start off -k regex:"_chunk_bwd_(dx_dcs|dbc)" --import-source yes \\
        --section SourceCounters --section MemoryWorkloadAnalysis_Tables -o /tmp/src \\
        python3 benchmarks/ssd_ncu.py --shapes 1.4b_2k
    ncu --import /tmp/src.ncu-rep --page source --csv --print-source cuda,sass > /tmp/src.csv
    python3 benchmarks/ncu_lines.py /tmp/src.csv --top 12 > $OUT/ncu_lines.md

The CSV holds, per kernel ("Function Name") and source file ("File Path"), one summary row per source line followed
by that line's SASS rows. Summed per line from the SASS rows: warp stall samples, L2 theoretical sectors of global
accesses (issued, ideal, excessive: more sectors than a perfectly coalesced access of the same bytes would fetch) and
the local-memory (spill) instructions executed.
"""
from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import dataclass, field

STALL = "Warp Stall Sampling (All Samples)"
SECTORS = "L2 Theoretical Sectors Global"
IDEAL = "L2 Theoretical Sectors Global Ideal"
EXCESS = "L2 Theoretical Sectors Global Excessive"
EXECUTED = "Instructions Executed"


@dataclass
class Line:
    kernel: str
    file: str
    line: int
    source: str
    stall: int = 0
    sectors: int = 0
    ideal: int = 0
    excess: int = 0
    spill: int = 0  # local loads and stores executed (LDL / STL)
    ops: set = field(default_factory=set)  # global-memory opcodes seen on the line (LDG, LDGSTS, STG)


def _int(v: str) -> int:
    try:
        return int(float(v.replace(",", "")))
    except (ValueError, AttributeError):
        return 0


def _opcode(sass: str) -> str:
    words = sass.split()
    if words and words[0].startswith("@"):  # predicate
        words = words[1:]
    return words[0] if words else ""


def parse(rows) -> list[Line]:
    """Lines (kernel, file, line number) in the order the CSV first names them, with their SASS rows' sums."""
    lines: dict[tuple, Line] = {}
    kernel = path = header = None
    cur = None
    for row in rows:
        if not row:
            continue
        if row[0] == "File Path":
            path = row[1]
            continue
        if row[0] == "Function Name":
            kernel = row[1]
            continue
        if row[0] == "Line No":
            header = row
            continue
        if header is None:
            continue
        if row[0] != "":  # a source line's summary row; its SASS rows follow
            key = (kernel, path, _int(row[0]))
            cur = lines.get(key)
            if cur is None:
                cur = lines[key] = Line(kernel or "?", path or "?", _int(row[0]), row[1].strip())
            continue
        if cur is None:
            continue
        d = dict(zip(header, row))
        # The header names "Source" twice (the line's text, then the instruction's): the instruction is the 4th
        # column of a SASS row.
        op = _opcode(row[3] if len(row) > 3 else "")
        cur.stall += _int(d.get(STALL, "0"))
        cur.sectors += _int(d.get(SECTORS, "0"))
        cur.ideal += _int(d.get(IDEAL, "0"))
        cur.excess += _int(d.get(EXCESS, "0"))
        if op.startswith(("LDL", "STL")):
            cur.spill += _int(d.get(EXECUTED, "0"))
        if op.startswith(("LDG", "STG")):
            cur.ops.add(op.split(".")[0])
    return list(lines.values())


def report(lines: list[Line], top: int) -> str:
    """Markdown: per kernel, totals, then the lines with the most stall samples, L2 sectors (what the kernel moves
    through L2, reused tiles included), excessive sectors and spills."""
    out = []
    for kernel in dict.fromkeys(ln.kernel for ln in lines):
        ks = [ln for ln in lines if ln.kernel == kernel]
        stall = sum(ln.stall for ln in ks) or 1
        sectors = sum(ln.sectors for ln in ks)
        excess = sum(ln.excess for ln in ks)
        out.append(f"## {kernel}\n\nstall samples {stall}; L2 sectors of global accesses {sectors}, excessive {excess}"
                   f" ({100 * excess / max(sectors, 1):.1f} %); spill instructions executed "
                   f"{sum(ln.spill for ln in ks)}\n")
        for title, key, shown in (("stall samples", lambda ln: ln.stall, True),
                                  ("L2 sectors", lambda ln: ln.sectors, any(ln.sectors for ln in ks)),
                                  ("excessive L2 sectors", lambda ln: ln.excess, any(ln.excess for ln in ks)),
                                  ("spill instructions", lambda ln: ln.spill, any(ln.spill for ln in ks))):
            if not shown:
                continue
            out.append(f"Lines by {title}:\n\n| file:line | source | stall % | sectors | excessive | spills | ops |\n"
                       "|---|---|---|---|---|---|---|")
            for ln in sorted(ks, key=key, reverse=True)[:top]:
                if key(ln) == 0:
                    break
                src = ln.source.replace("|", "\\|")[:80]
                out.append(f"| {ln.file.rsplit('/', 1)[-1]}:{ln.line} | `{src}` | {100 * ln.stall / stall:.1f} | "
                           f"{ln.sectors} | {ln.excess} | {ln.spill} | {' '.join(sorted(ln.ops))} |")
            out.append("")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="ncu --page source --csv --print-source cuda,sass output")
    ap.add_argument("--top", type=int, default=10, help="lines shown per table (default 10)")
    args = ap.parse_args(argv)
    try:
        with open(args.csv, newline="") as f:
            lines = parse(csv.reader(f))
    except OSError as e:
        raise SystemExit(f"ncu_lines: cannot read {args.csv}: {e.strerror}")
    if not lines:
        raise SystemExit(f"ncu_lines: {args.csv} has no source lines; export it with `ncu --import REPORT --page source "
                         "--csv --print-source cuda,sass` from a report collected with --import-source yes and "
                         "--section SourceCounters")
    sys.stdout.write(report(lines, args.top) + "\n")


if __name__ == "__main__":
    main()
