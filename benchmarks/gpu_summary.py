"""Every GPU check's number and target in one table: what `gpu_check.sh OUT_DIR` ran, read back.

    python benchmarks/gpu_summary.py OUT_DIR

Reads the JSON each part wrote (`bench_gpu_compiled.py`'s rows as they are, `bench_gpu_zero3.py`'s
ratio and peak against its targets) and the GPU test tier's last line, and prints one row per
check: what was measured, the target, and whether it was met. A part that wrote nothing is a
row that says so.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from harness import format_table


def rows(out: Path) -> list[list[str]]:
    found = []
    tests = out / "gpu_tests.log"
    last = tests.read_text().strip().splitlines()[-1] if tests.is_file() and tests.read_text().strip() else "no log"
    found.append(["pytest -m gpu", last, "all pass", "yes" if " passed" in last and "failed" not in last else "NO"])
    zero3 = out / "gpu_zero3.json"
    if zero3.is_file():
        result = json.loads(zero3.read_text())["results"][0]
        ratio, peak = result["ratio"]["fxpar"], result["memory"]["peak"]
        found.append(["124M eager zero=3 / eager step", f"{ratio:.3f}", "<= 1.10", _met(ratio <= 1.10)])
        error = peak["measured"] / peak["predicted"]
        found.append(["124M eager zero=3 allocator peak / estimate", f"{error:.3f}", "1 +- 0.05",
                      _met(abs(error - 1) <= 0.05)])
    else:
        found.append(["bench_gpu_zero3.py", "no result", "", "NO"])
    compiled = out / "gpu_compiled.json"
    if compiled.is_file():
        found += [[r["check"], r["measured"], r["target"], "" if r["met"] is None else _met(r["met"])]
                  for r in json.loads(compiled.read_text())["results"]]
    else:
        found.append(["bench_gpu_compiled.py", "no result", "", "NO"])
    return found


def _met(met: bool) -> str:
    return "yes" if met else "NO"


def main() -> int:
    table = rows(Path(sys.argv[1]))
    print(format_table(["GPU check", "measured", "target", "met"], table))
    return sum(row[3] == "NO" for row in table)


if __name__ == "__main__":
    sys.exit(main())
