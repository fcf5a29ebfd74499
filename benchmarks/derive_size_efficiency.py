"""Derive src/hybridpar/cost/size_efficiency.yaml's points from DeepBench's V100 training results.

    git -C DeepBench show 30c51150869ee217f150ef5f31dc69241ed23b49:results/train/DeepBench_NV_V100.xlsx > v100.xlsx
    python benchmarks/derive_size_efficiency.py v100.xlsx

Per sheet (FP32; FP16 inputs with mixed math) and kind (dense GEMM rows: 2MNK FLOPs over the time;
convolution rows: 2 N K C R S P Q FLOPs, DeepBench's own TERAFLOPS formula, over each of the
forward, backward-data and backward-weight times that are given), the efficiency of every kernel
(achieved FLOP/s over the V100 peak of that precision) is binned by half decades of FLOPs and each
bin's best and median efficiency printed with its count; GEMMs also by tenths of a decade of their
smaller output dimension (thin GEMMs). The cost model caps the best at 1, makes it monotone and
relative to the largest sizes (hybridpar.cost.compute.size_factor). The xlsx is parsed with the
standard library (it is zipped XML), so no spreadsheet package is needed.
"""

from __future__ import annotations

import math
import statistics
import sys
import xml.etree.ElementTree as ET
import zipfile

NS = "{http://schemas.openxmlformats.org/spreadsheetml/2006/main}"
SHEETS = {"fp32": (1, 15.7e12), "fp16": (2, 125.0e12)}  # sheet number, V100 SXM2 peak (dgx1-v100 preset)


def rows(book: zipfile.ZipFile, sheet: int) -> dict[int, dict[str, str]]:
    shared = ["".join(t.text or "" for t in si.iter(f"{NS}t"))
              for si in ET.fromstring(book.read("xl/sharedStrings.xml"))]
    out: dict[int, dict[str, str]] = {}
    for r in ET.fromstring(book.read(f"xl/worksheets/sheet{sheet}.xml")).iter(f"{NS}row"):
        cells = {}
        for c in r.findall(f"{NS}c"):
            v = c.find(f"{NS}v")
            if v is not None:
                col = "".join(ch for ch in c.get("r") if ch.isalpha())
                cells[col] = shared[int(v.text)] if c.get("t") == "s" else v.text
        out[int(r.get("r"))] = cells
    return out


def _num(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None  # "N/A*": a pass DeepBench did not run (the first layer's input gradient)


def kernels(table: dict[int, dict[str, str]], peak: float) -> dict[str, list[tuple[float, float]]]:
    """(FLOPs, efficiency) of every GEMM and convolution kernel of one sheet, and (the smaller of a
    GEMM's output dimensions M and N, efficiency): "thin" GEMMs lose efficiency at any size."""
    out: dict[str, list[tuple[float, float]]] = {"gemm": [], "conv": [], "thin": []}
    section = None
    for _, r in sorted(table.items()):
        head = r.get("A", "")
        if head:
            section = "gemm" if head.startswith("Dense Matrix") else "conv" if head == "Convolution" else None
            continue
        if section == "gemm" and _num(r.get("C")) and _num(r.get("I")):
            flops = 2.0 * float(r["C"]) * float(r["D"]) * float(r["E"])
            eff = flops / (float(r["I"]) * 1e-3) / peak
            out["gemm"].append((flops, eff))
            out["thin"].append((min(float(r["C"]), float(r["D"])), eff))
        elif section == "conv" and _num(r.get("C")) and _num(r.get("R")):
            n, c, k, s, rr, p, q = (float(r[x]) for x in ("F", "E", "G", "H", "I", "R", "S"))
            flops = 2.0 * n * k * c * rr * s * p * q
            for col in ("N", "O", "P"):  # forward, backward-data, backward-weight
                t = _num(r.get(col))
                if t:
                    out["conv"].append((flops, flops / (t * 1e-3) / peak))
    return out


def binned(points: list[tuple[float, float]], per_decade: int = 2) -> list[tuple[float, float, float, int]]:
    """(log10 of the bin's centre, best efficiency, median efficiency, count) per 1/per_decade decade."""
    bins: dict[int, list[float]] = {}
    for x, eff in points:
        bins.setdefault(math.floor(math.log10(x) * per_decade), []).append(eff)
    return [((b + 0.5) / per_decade, max(v), statistics.median(v), len(v)) for b, v in sorted(bins.items())]


def main(path: str) -> None:
    with zipfile.ZipFile(path) as book:
        for precision, (sheet, peak) in SHEETS.items():
            for kind, pts in kernels(rows(book, sheet), peak).items():
                print(f"{precision} {kind} ({len(pts)} kernels):")
                # thin GEMMs by powers of two of their smaller output dimension (~0.3 decade)
                for x, best, med, n in binned(pts, 10 if kind == "thin" else 2):
                    print(f"      - [{x:.2f}, {best:.3f}, {med:.3f}, {n}]")


if __name__ == "__main__":
    main(sys.argv[1])
