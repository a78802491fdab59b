"""The model zoo benchmark (benchmarks/bench_zoo.py) checked on one tiny model: its harness runs
eager and ortwrap interleaved from the same weights, and the row it produces has the timing and ratio
fields, and the same loss on both paths after the same AdamW steps (no timing assertions)."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import bench_zoo
from model_zoo import BY_NAME

from ortwrap.engines import is_onnxruntime_available


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_zoo_row(exporter, dtype, monkeypatch, tmp_path):
    monkeypatch.setenv("ORTWRAP_CACHE_DIR", str(tmp_path))
    threads = torch.get_num_threads()
    try:
        row = bench_zoo.measure(
            BY_NAME["lstm_gru"], dtype=dtype, threads=1, paths=("eager", "ortwrap"), warmup=0, iters=2,
            exporter=exporter,
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert not any(k.endswith("error") for k in row), row
    assert "ortwrap_fallback" not in row, row  # the LSTM -> GRU stack trains on ORT
    assert (row["model"], row["dtype"], row["threads"], row["clock"]) == ("lstm_gru", dtype, 1, "cpu")
    for path in ("eager", "ortwrap"):
        assert row[f"{path}_ms"] > 0 and row[f"{path}_first_s"] > 0
        q1, q3 = row[f"{path}_iqr_ms"]
        assert q1 <= row[f"{path}_ms"] <= q3
    assert math.isclose(row["ortwrap_ratio"], row["ortwrap_ms"] / row["eager_ms"])
    assert "compile_ratio" not in row and "eager_ratio" not in row
    # the same weights and inputs: the same first loss; three AdamW steps later (1 + warmup + iters) the
    # loss has moved, by the same amount on both paths
    tol = 1e-5 if dtype == "fp32" else 3e-2
    scale = max(1.0, abs(row["eager_loss"]))
    assert abs(row["ortwrap_first_loss"] - row["eager_first_loss"]) <= tol * scale
    assert abs(row["eager_loss"] - row["eager_first_loss"]) > 5 * tol * scale
    assert abs(row["ortwrap_loss"] - row["eager_loss"]) <= tol * scale, row
    # the report's pieces take a row without compile: its columns are dashes, ortwrap's geometric mean alone
    table = bench_zoo.markdown([row], "test CPU", "")
    assert "| lstm_gru |" in table and "test CPU" in table
    line = bench_zoo.geomean_line([row], "x")
    assert "1 rows" in line and f"ortwrap/eager {row['ortwrap_ratio']:.3f}" in line and "compile not run" in line


def test_geomean():
    rows = [
        {"ortwrap_ratio": 0.5, "compile_ratio": 2.0},
        {"ortwrap_ratio": 2.0, "compile_ratio": 2.0},
        {"ortwrap_ratio": 3.0},
    ]
    line = bench_zoo.geomean_line(rows, "x")
    assert "2 rows" in line and "ortwrap/eager 1.000" in line and "compile/eager 2.000" in line
    # compile run on no row: ortwrap's over every row with its ratio
    line = bench_zoo.geomean_line([{"ortwrap_ratio": 0.5}, {"ortwrap_ratio": 2.0}, {"eager_ms": 1.0}], "x")
    assert "2 rows; 1 without a ratio left out" in line and "ortwrap/eager 1.000" in line and "compile not run" in line


def test_cold_child_reports_the_anonymous_part_of_its_rss():
    """The cold child's memory: the peak (VmHWM) and, after the steps, the heap (RssAnon) and the
    library pages (RssFile) apart; the table shows ``peak (anon)``."""
    threads = torch.get_num_threads()
    try:
        out = bench_zoo.cold(BY_NAME["lstm_gru"], "eager", dtype="fp32", threads=1, batch=2, steps=2)
    finally:
        torch.set_num_threads(threads)
    assert 0 < out["anon_rss_mib"] < out["peak_rss_mib"] and 0 < out["file_rss_mib"] < out["peak_rss_mib"]
    row = {"model": "lstm_gru", "dtype": "fp32", "threads": 1, "eager_peak_rss_mib": 400.4, "eager_anon_rss_mib": 280.6}
    assert "| 400 (281) |" in bench_zoo.markdown([row], "test CPU", "")


@pytest.mark.skipif(not is_onnxruntime_available(), reason="onnxruntime is not installed")
def test_zoo_row_on_the_onnxruntime_engine(monkeypatch, tmp_path):
    # --engine onnxruntime: the ortwrap path runs on that engine, the row and the table say so, and the
    # loss after the same steps equals eager's
    monkeypatch.setenv("ORTWRAP_CACHE_DIR", str(tmp_path))
    threads = torch.get_num_threads()
    try:
        row = bench_zoo.measure(
            BY_NAME["resnetish"], threads=1, paths=("eager", "ortwrap"), warmup=0, iters=2,
            options={"engine": "onnxruntime"},
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert not any(k.endswith("error") for k in row), row
    assert "ortwrap_fallback" not in row and row["ortwrap_engine"] == "onnxruntime", row
    assert abs(row["ortwrap_loss"] - row["eager_loss"]) <= 1e-5 * max(1.0, abs(row["eager_loss"])), row
    assert "| resnetish | onnxruntime |" in bench_zoo.markdown([row], "test CPU", "")
