"""The NVLink ceiling tool (``benchmarks/nvlink_ceiling.cu``) built, run and its table recorded: what the link
between GPU 0 and GPU 1 carries by SM stores, SM loads and the copy engines, one direction and both at once.

    python3 benchmarks/nvlink_ceiling.py [--mb 57] [--record]

Needs nvcc and two GPUs with peer access. Prints the tool's table; ``--record`` appends one row per way, SM count
and direction (benchmarks/records.py; no stock path).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

import records

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nvlink_ceiling.cu")
# the tool's way names → the names results.jsonl keeps
WAYS = {
    "SM push (stores)": "SM stores to peer memory",
    "SM pull (loads)": "SM loads from peer memory",
    "CE, source GPU": "copy engine, issued on the source GPU",
    "CE, target GPU": "copy engine, issued on the target GPU",
}


def parse(output: str) -> list[tuple[str, int | None, float, float]]:
    """``(way, SMs or None, GB/s one direction, GB/s each way with both busy)`` per line of the tool's table."""
    rows = []
    for line in output.splitlines():
        way = next((w for w in WAYS if line.startswith(w)), None)
        if way is None:
            continue
        sms, one, both = line[len(way) :].split()
        rows.append((WAYS[way], None if sms == "-" else int(sms), float(one), float(both)))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=57, help="MB per direction")
    records.add_argument(p)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        binary = os.path.join(tmp, "nvlink_ceiling")
        subprocess.run(["nvcc", "-O3", "-arch=sm_90", SOURCE, "-o", binary], check=True)
        output = subprocess.run([binary, str(args.mb)], check=True, capture_output=True, text=True).stdout
    print(output, end="")
    for way, sms, one, both in parse(output):
        for direction, gbs in (("one direction", one), ("each way, both busy", both)):
            config = dict(way=way, sms=sms, direction=direction)
            records.record(args, "nvlink_ceiling", config, gbs, None, "GB/s", device=records.machine(2))


if __name__ == "__main__":
    main()
