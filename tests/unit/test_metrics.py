"""metrics.jsonl handling across fresh and resumed runs."""


def test_metrics_log_fresh_run_moves_old_file_aside_and_resume_appends(tmp_path):
    from megarl.metrics import MetricsLog

    first = MetricsLog(str(tmp_path), enabled=True)
    first.write({"step": 1})
    resumed = MetricsLog(str(tmp_path), enabled=True, resumed=True)
    resumed.write({"step": 2})
    assert [r["step"] for r in resumed.all_rows()] == [1, 2]
    fresh = MetricsLog(str(tmp_path), enabled=True)
    fresh.write({"step": 1})
    assert [r["step"] for r in fresh.all_rows()] == [1]
    kept = [p for p in tmp_path.glob("metrics.*.jsonl")]
    assert len(kept) == 1 and len(kept[0].read_text().splitlines()) == 2
