"""Print the slowest tests of a test.sh run, across its lanes, from each lane's JUnit XML.

``scripts/test.sh`` runs each lane with ``--junitxml test-results/<lane>.xml``; this reads them all,
writes every test's duration to ``test-results/test-durations.txt`` (slowest first, one
``seconds lane node-id`` a line) and prints the slowest ones, so that CI's time is measured per test.

Usage: python scripts/slowest_tests.py [RESULTS_DIR] [COUNT]
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def durations(results: Path) -> list[tuple[float, str, str]]:
    """(seconds, lane, node id) of every test case in the lanes' XML files; setup and teardown are in pytest's time."""
    rows = []
    for xml in sorted(results.glob("*.xml")):
        lane = xml.stem
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = case.get("name") or ""
            module = case.get("classname", "").replace(".", "/")
            # classname is "tests.unit.x.test_mod" or "tests.unit.x.test_mod.TestClass": the node id pytest prints.
            parts = module.split("/")
            for cut in range(len(parts), 0, -1):
                if Path(*parts[:cut]).with_suffix(".py").exists():
                    node = "/".join(parts[:cut]) + ".py" + "".join(f"::{p}" for p in parts[cut:]) + f"::{name}"
                    break
            else:
                node = f"{case.get('classname')}::{name}"
            rows.append((float(case.get("time") or 0.0), lane, node))
    return sorted(rows, reverse=True)


def main() -> int:
    results = Path(sys.argv[1] if len(sys.argv) > 1 else "test-results")
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    rows = durations(results)
    if not rows:
        print(f"no test durations in {results}/*.xml")
        return 0
    (results / "test-durations.txt").write_text("".join(f"{seconds:9.2f} {lane:<12} {node}\n" for seconds, lane, node in rows))
    by_lane: dict[str, tuple[int, float]] = {}
    for seconds, lane, _ in rows:
        tests, total = by_lane.get(lane, (0, 0.0))
        by_lane[lane] = (tests + 1, total + seconds)
    print(f"================ slowest {min(count, len(rows))} of {len(rows)} tests (all: {results}/test-durations.txt) ================")
    for seconds, lane, node in rows[:count]:
        print(f"{seconds:8.1f} s  {lane:<12} {node}")
    # Test time summed per lane: above the lane's wall time when the lane runs its tests on several workers.
    print("  ".join(f"{lane}: {tests} tests, {total:.0f} s of test time" for lane, (tests, total) in sorted(by_lane.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
