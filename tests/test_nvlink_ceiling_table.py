"""benchmarks/nvlink_ceiling.py reads the ceiling tool's table as the tool prints it (``%-18s %5s %10.0f %10.0f``)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks"))

import nvlink_ceiling  # noqa: E402


def test_parse_reads_every_way_and_direction() -> None:
    lines = ["57 MB per direction; GB/s per direction (median of 10)", f"{'way':<18} {'SMs':>5} {'one dir':>10}"]
    printed = [
        ("SM push (stores)", "16", 326.0, 323.0),
        ("SM pull (loads)", "132", 371.0, 364.0),
        ("CE, source GPU", "-", 394.0, 389.0),
        ("CE, target GPU", "-", 391.0, 388.0),
    ]
    lines += [f"{way:<18} {sms:>5} {one:10.0f} {both:10.0f}" for way, sms, one, both in printed]
    assert nvlink_ceiling.parse("\n".join(lines)) == [
        ("SM stores to peer memory", 16, 326.0, 323.0),
        ("SM loads from peer memory", 132, 371.0, 364.0),
        ("copy engine, issued on the source GPU", None, 394.0, 389.0),
        ("copy engine, issued on the target GPU", None, 391.0, 388.0),
    ]
