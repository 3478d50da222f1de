"""benchmarks/render_results.py on a small data file: the newest row per configuration and device wins, the ratio
is computed from the two figures, predictions get a table of their own, and --check names the files that differ."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))  # the scripts import as they run
import render_results  # noqa: E402


def _row(
    benchmark: str,
    date: str,
    config: dict,
    plugin: float | None,
    stock: float | None,
    unit: str = "µs",
    kind: str = "measured",
    device: str = "nvidia-h100-x1",
) -> dict:
    return dict(
        benchmark=benchmark,
        date=date,
        device=device,
        commit="abc1234",
        command="python3 x.py",
        configuration=config,
        plugin=plugin,
        stock=stock,
        unit=unit,
        kind=kind,
    )


ROWS = [
    _row("bench_permute", "2026-12-01", {"op": "permute"}, 300.0, 600.0),  # older: replaced by the next row
    _row("bench_permute", "2026-12-03", {"op": "permute"}, 150.0, 600.0),
    _row("bench_permute", "2026-12-02", {"op": "unpermute"}, 10.0, 400.0),
    _row("bench_permute", "2026-12-02", {"op": "permute"}, 99.0, 100.0, device="nvidia-h200"),  # another device
    _row("trainer_ab", "2026-12-02", {"ranks": 1}, 200_000.0, 50_000.0, unit="tokens/s"),
    _row("multinode_traffic", "2026-12-01", {"ep": 16}, 3.0, 4.0, unit="ms", kind="predicted"),
]


def _write(tmp_path: Path, rows: list[dict]) -> tuple[Path, Path, Path]:
    data, results, readme = tmp_path / "results.jsonl", tmp_path / "RESULTS.md", tmp_path / "README.md"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    readme.write_text(f"# x\n\n{render_results.BEGIN}\nold\n{render_results.END}\n\nafter\n", encoding="utf-8")
    return data, results, readme


def test_render_newest_rows_computed_ratios_and_predictions_apart(tmp_path: Path) -> None:
    data, results, readme = _write(tmp_path, ROWS)
    argv = ["--data", str(data), "--results", str(results), "--readme", str(readme)]
    assert render_results.main(argv + ["--check"]) == 1  # nothing rendered yet
    assert render_results.main(argv) == 0
    assert render_results.main(argv + ["--check"]) == 0
    text = results.read_text(encoding="utf-8")
    assert "| 2026-12-03 | nvidia-h100-x1 | `abc1234` | permute | 150 | 600 | 0.25 |" in text
    assert "| 2026-12-02 | nvidia-h100-x1 | `abc1234` | unpermute | 10 | 400 | 0.025 |" in text
    assert "| 2026-12-02 | nvidia-h200 | `abc1234` | permute | 99 | 100 | 0.99 |" in text
    assert "| 300 |" not in text  # the older row of the same configuration and device
    assert "| 2026-12-02 | nvidia-h100-x1 | `abc1234` | 1 | 200,000 | 50,000 | 0.25 |" in text  # time ratio
    measured, predicted = text.split("Predictions (a model, not a measurement):")
    assert "| 16 | 3 | 4 | 0.75 |" in predicted and "| 16 |" not in measured
    table = readme.read_text(encoding="utf-8")
    assert table.startswith(f"# x\n\n{render_results.BEGIN}\n| benchmark |") and table.endswith(
        f"{render_results.END}\n\nafter\n"
    )
    assert (
        "| `trainer_ab` | ranks 1 | 2026-12-02, nvidia-h100-x1 | `abc1234` | 200,000 | 50,000 | tokens/s | 0.25 |"
        in table
        and "old" not in table
    )


def test_check_names_the_files_that_differ(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data, results, readme = _write(tmp_path, ROWS)
    argv = ["--data", str(data), "--results", str(results), "--readme", str(readme)]
    render_results.main(argv)
    results.write_text(results.read_text(encoding="utf-8").replace("0.25", "0.24"), encoding="utf-8")
    assert render_results.main(argv + ["--check"]) == 1
    err = capsys.readouterr().err
    assert str(results) in err and str(readme) not in err


def test_rows_are_checked(tmp_path: Path) -> None:
    bad = dict(ROWS[0])
    bad["kind"] = "guessed"
    data, results, readme = _write(tmp_path, [bad])
    with pytest.raises(ValueError, match="kind"):
        render_results.main(["--data", str(data), "--results", str(results), "--readme", str(readme)])
    data, results, readme = _write(tmp_path, [_row("no_such_benchmark", "2026-12-01", {}, 1.0, 2.0)])
    with pytest.raises(ValueError, match="no_such_benchmark"):
        render_results.main(["--data", str(data), "--results", str(results), "--readme", str(readme)])
