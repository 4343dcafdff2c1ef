"""harness.tools.ncu_table on ncu CSVs of both shapes (written here as ncu writes them): each case gets
the launches between its two markers, medians over its calls, the top stall reasons."""

from __future__ import annotations

import csv

import pytest

from harness.tools.ncu_table import read_launches, table

STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
# (kernel, time in ns, dram %, bytes read in MB, long-scoreboard stall, barrier stall)
LAUNCHES = [("scan_kernel", 2000, 1, 0, 0, 0),
            ("custom_kernel_lathe_gemv_v2_1(int)", 30000, 80, 29.4, 9.0, 1.0),
            ("custom_kernel_lathe_gemv_v2_1(int)", 31000, 82, 29.4, 8.0, 2.0),
            ("custom_kernel_lathe_gemv_v2_1(int)", 32000, 81, 29.4, 7.0, 3.0),
            ("scan_kernel", 2000, 1, 0, 0, 0),
            ("random_bits", 5000, 50, 1, 0, 0),  # the next case's inputs: outside its markers
            ("scan_kernel", 2000, 1, 0, 0, 0),
            ("custom_kernel_lathe_seam_plain(int)", 10000, 40, 4.0, 1.0, 5.0),
            ("scan_kernel", 2000, 1, 0, 0, 0)]


def _write_raw(path):
    names = ["ID", "Kernel Name", "gpu__time_duration.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
             "dram__bytes_read.sum", STALL.format("long_scoreboard"), STALL.format("barrier")]
    units = ["", "", "nsecond", "%", "Mbyte", "", ""]
    with open(path, "w", newline="") as f:
        f.write("==PROF== Connected to process 1\n")
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(names)
        w.writerow(units)
        for i, (k, t, d, b, ls, ba) in enumerate(LAUNCHES):
            w.writerow([i, k, f"{t:,}", d, b, ls, ba])


def _write_long(path):
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["ID", "Kernel Name", "Section Name", "Metric Name", "Metric Unit", "Metric Value"])
        for i, (k, t, d, b, ls, ba) in enumerate(LAUNCHES):
            w.writerow([i, k, "s", "gpu__time_duration.sum", "usecond", t / 1000])
            w.writerow([i, k, "s", "dram__throughput.avg.pct_of_peak_sustained_elapsed", "%", d])
            w.writerow([i, k, "s", "dram__bytes_read.sum", "Mbyte", b])
            w.writerow([i, k, "s", STALL.format("long_scoreboard"), "", ls])
            w.writerow([i, k, "s", STALL.format("barrier"), "", ba])


@pytest.mark.parametrize("write", [_write_raw, _write_long], ids=["raw", "long"])
def test_each_case_gets_its_own_launches(tmp_path, write):
    path = tmp_path / "ncu.csv"
    write(path)
    rows = table(read_launches(path), ["gemv case", "seam case"])
    assert [(r["case"], r["kernel"], r["launches"]) for r in rows] == [
        ("gemv case", "custom_kernel_lathe_gemv_v2_1", 3), ("seam case", "custom_kernel_lathe_seam_plain", 1)]
    gemv = rows[0]
    assert gemv["gpu_us"] == pytest.approx(31.0) and gemv["dram_pct"] == 81
    assert gemv["dram_gbs"] == pytest.approx(29.4e6 / 31.0 / 1e3)
    assert gemv["top_stalls"] == "long_scoreboard 8.00, barrier 2.00"
    assert rows[1]["top_stalls"] == "barrier 5.00, long_scoreboard 1.00"


def test_newer_metric_names(tmp_path):
    """ncu 2025's sections: DRAM % and issue slots under other names, DRAM bytes only as a rate."""
    names = ["ID", "Kernel Name", "gpu__time_duration.sum", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
             "dram__bytes.sum.per_second", "sm__issue_active.avg.pct_of_peak_sustained_elapsed",
             "launch__registers_per_thread"]
    path = tmp_path / "ncu.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(names)
        w.writerow(["", "", "nsecond", "%", "byte/s", "%", "register/thread"])
        for i, k in enumerate(["scan_kernel", "custom_kernel_lathe_gemv_v3", "scan_kernel"]):
            w.writerow([i, k, "8,288", 23.8, "1,142,486,486,486.49", 30.9, 77])
    (row,) = table(read_launches(path), ["case"])
    assert row["gpu_us"] == pytest.approx(8.288) and row["dram_pct"] == pytest.approx(23.8)
    assert row["dram_gbs"] == pytest.approx(1142.486, rel=1e-6)
    assert row["issue_pct"] == pytest.approx(30.9) and row["registers"] == 77
    assert row["l2_hit_pct"] is None and row["l2_read_hit_pct"] is None  # (not asked for)


def test_the_l2s_hit_rates(tmp_path):
    """The L2's hit rates, of all sectors and of the loads' reads, as ncu gives them (%)."""
    names = ["ID", "Kernel Name", "gpu__time_duration.sum", "lts__t_sector_hit_rate.pct",
             "lts__t_sector_op_read_hit_rate.pct"]
    path = tmp_path / "ncu.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(names)
        w.writerow(["", "", "usecond", "%", "%"])
        for i, (k, hit, read) in enumerate([("lathe_token_block_5", 31.5, 12.0), ("lathe_token_block_5", 33.5, 14.0)]):
            w.writerow([i, k, 1600, hit, read])
    (row,) = table(read_launches(path), None)
    assert row["launches"] == 2 and row["l2_hit_pct"] == pytest.approx(32.5) and row["l2_read_hit_pct"] == pytest.approx(13.0)


def test_markers_must_pair_with_the_labels(tmp_path):
    path = tmp_path / "ncu.csv"
    _write_raw(path)
    with pytest.raises(ValueError, match="4 marker launches for 3 cases"):
        table(read_launches(path), ["a", "b", "c"])


def test_by_kernel_without_markers(tmp_path):
    """A kernel filter that left the markers out: no cases, a row per kernel over all its launches;
    asked for cases, the error says why there are none."""
    path = tmp_path / "ncu.csv"
    _write_raw(path)
    kept = [launch for launch in read_launches(path) if "scan" not in launch[0]]
    with pytest.raises(ValueError, match="0 marker launches for 2 cases"):
        table(kept, ["gemv case", "seam case"])
    rows = table(kept, None)
    assert [(r["case"], r["kernel"], r["launches"]) for r in rows] == [
        ("", "custom_kernel_lathe_gemv_v2_1", 3), ("", "random_bits", 1), ("", "custom_kernel_lathe_seam_plain", 1)]
    assert rows[0]["gpu_us"] == pytest.approx(31.0)
