"""What ``import hf_fixedpoint`` costs over ``import torch, transformers``, measured side by side in one run.

    python -m benchmarks.bench_import            # 7 rounds
    python -m benchmarks.bench_import --rounds 3

Each round starts one fresh interpreter per statement, in turn (so background load hits all of them alike), and times
the statement inside it. Statements: the baseline ``import torch, transformers``; ``import hf_fixedpoint`` (families
load on first use); and ``import hf_fixedpoint`` followed by loading every family
(``hf_fixedpoint.modeling.FAMILIES``), which is what ``import hf_fixedpoint`` cost when it imported every family.
Target: the lazy import at most 1.3x the baseline (minimum over rounds; the median ratio is printed beside it).
"""

import argparse
import statistics
import subprocess
import sys

TARGET = 1.3
STATEMENTS = {
    "import torch, transformers": "import torch, transformers",
    "import hf_fixedpoint": "import hf_fixedpoint",
    "import hf_fixedpoint + every family": "import hf_fixedpoint; hf_fixedpoint.modeling.FAMILIES",
}
CHILD = "import time; t0 = time.perf_counter(); {stmt}; print(time.perf_counter() - t0)"


def time_import(stmt: str) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD.format(stmt=stmt)], check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="fresh interpreters per statement (>= 1)")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        raise ValueError(f"--rounds={a.rounds} is out of range; allowed values: integers >= 1.")
    times = {name: [] for name in STATEMENTS}
    for _ in range(a.rounds):
        for name, stmt in STATEMENTS.items():
            times[name].append(time_import(stmt))
    base = times["import torch, transformers"]
    print(f"# bench_import: {a.rounds} rounds, python {sys.version.split()[0]}; seconds (min, median)")
    print(f"  {'statement':38s} {'min s':>7s} {'med s':>7s} {'ratio min':>9s} {'ratio med':>9s}")
    ratios = {}
    for name, ts in times.items():
        ratios[name] = (min(ts) / min(base), statistics.median(ts) / statistics.median(base))
        r_min, r_med = ratios[name]
        print(f"  {name:38s} {min(ts):7.3f} {statistics.median(ts):7.3f} {r_min:9.2f} {r_med:9.2f}")
    lazy = ratios["import hf_fixedpoint"][0]
    print(f"  [{'PASS' if lazy <= TARGET else 'FAIL'}] import hf_fixedpoint / import torch, transformers (min) = "
          f"{lazy:.2f}x (target <= {TARGET:g})")
    return ratios


if __name__ == "__main__":
    main()
