"""Bench pictures (chunkstore/bench/plot.py): rows in the shape `bench quality` and `bench
workload` print them, drawn to PNGs that open at their size; what cannot be drawn is a
clear error (exit 2), not a traceback."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from chunkstore.bench.plot import plot
from chunkstore.cli import main
from chunkstore.testing.cli import chunkstore


def quality_rows() -> list[dict]:
    rows = []
    for tokens, accuracies in ((108.4, (0.88, 0.38, 0.88)), (199.1, (0.79, 0.46, 0.75))):
        for method, accuracy in zip(("full", "isolated", "router"), accuracies, strict=True):
            rows.append(
                {"bench": "quality", "method": method, "split": "heldout", "cases": 24,
                 "doc_tokens": tokens, "accuracy": accuracy,
                 "ci95": [accuracy - 0.2, min(1.0, accuracy + 0.1)]}
            )  # fmt: skip
    return rows


def workload_rows() -> list[dict]:
    rows = [
        {"bench": "workload", "way": "apc", "model": "smollm2", "requests": 300,
         "ttft_p50_s": 3.2, "ttft_p99_s": 4.8}
    ]  # fmt: skip
    for share in (0.25, 1.0):
        for way, ratio in (("worth", 1.1), ("worth router", 1.05)):
            name = way.replace("worth", f"worth@{share:g}")
            rows.append(
                {"bench": "workload", "way": name, "pool_share": share, "throughput_vs_apc": ratio,
                 "ttft_p50_s": 3.2 / ratio, "ttft_p99_s": 4.8 / ratio}
            )  # fmt: skip
        rows.append(
            {"bench": "workload", "way": "replay", "policy": "worth", "pool_share": share,
             "store_hit_rate": share / 1.2}
        )  # fmt: skip
    return rows


def drawn(path: Path) -> tuple[int, int, int]:
    with Image.open(path) as image:
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20) or []
        return image.width, image.height, len(colours)


def test_quality_and_workload_rows_are_drawn(tmp_path: Path) -> None:
    for name, rows, panels in (("q", quality_rows(), 1), ("w", workload_rows(), 3)):
        out = plot(rows, tmp_path / f"{name}.png")
        width, height, colours = drawn(out)
        assert width >= 550 * panels and height >= 400, (name, width, height)
        assert colours > 50, name  # lines, text and markers, not a blank canvas
    one_length = [r for r in quality_rows() if r["doc_tokens"] < 150]  # bars, not lines
    width, _, colours = drawn(plot(one_length, tmp_path / "bars.png"))
    assert width >= 600 and colours > 50


def test_chunkstore_plot_draws_saved_rows_and_refuses_others(tmp_path: Path, capsys) -> None:
    saved = tmp_path / "rows.jsonl"
    saved.write_text("bench: a progress line\n" + "\n".join(map(json.dumps, workload_rows())))
    assert main(["plot", str(saved), str(tmp_path / "w.png")]) == 0
    assert drawn(tmp_path / "w.png")[0] >= 1650  # three panels
    for text in ("", json.dumps({"bench": "store", "lookup_vs_mooncake": 0.7})):
        saved.write_text(text)
        assert main(["plot", str(saved), str(tmp_path / "x.png")]) == 2
        assert "chunkstore plot:" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
    assert main(["plot", str(tmp_path / "missing.jsonl"), str(tmp_path / "x.png")]) == 2


def test_a_row_with_a_wrong_typed_field_is_named_not_a_traceback(tmp_path: Path) -> None:
    """The command as a user runs it: the line and the field that cannot be drawn, exit 2."""
    saved = tmp_path / "rows.jsonl"
    for n, field, value in ((0, "accuracy", "high"), (1, "ci95", 0.5), (2, "bench", ["quality"])):
        rows = quality_rows()
        rows[n][field] = value
        saved.write_text("bench: a progress line\n" + "\n".join(map(json.dumps, rows)))
        run = chunkstore("plot", saved, tmp_path / "x.png")
        assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
        assert f"line {n + 2}: {field!r} is {json.dumps(value)}" in run.stderr, run.stderr
    rows = workload_rows()
    rows[-1]["store_hit_rate"] = None
    saved.write_text("\n".join(map(json.dumps, rows)))
    run = chunkstore("plot", saved, tmp_path / "x.png")
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert f"line {len(rows)}: 'store_hit_rate' is null, not a number" in run.stderr
    assert not (tmp_path / "x.png").exists()
