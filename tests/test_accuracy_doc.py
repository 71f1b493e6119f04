"""docs/accuracy.md's figures are those of the validate run it names (fresh-user finding F12: the
page still said 126 cases, p90 18.4 %, "1 unsafe at the safe end" after the bands' refit had
changed them), and its summary keys are documented — ``with_error_pct`` is a count."""

from __future__ import annotations

import json

from tests._docs import DOCS, page
from tuner.accuracy.validate import interval_summary, summarize

SNAPSHOT = DOCS / "accuracy" / "validate-2026-12-06-session3.json"


def _row(label: str, rows: list[dict], total: int) -> str:
    """One row of the page's figure table, from the predicted ``rows`` of a set of ``total`` records."""
    iv = interval_summary(rows)
    errs = [abs(r["error_pct"]) for r in rows if r["error_pct"] is not None]
    return (f"| {label} | {total} | {len(rows)} | {iv['median_abs_error_pct']} % | {iv['p90_abs_error_pct']} % | "
            f"{max(errs):.2f} % | {sum(1 for r in rows if r['unsafe'])} | {iv['coverage_pct']} % | "
            f"{iv['median_half_width_pct']} % | {iv['unsafe_at_safe_end']} ({iv['unsafe_at_safe_end_pct']} %) |")


def test_accuracy_page_figures_were_stale():
    snap = json.loads(SNAPSHOT.read_text())
    text = page("accuracy.md")
    assert snap["command"] in text and "2026-12-06, main after round 3 session 3" in text and SNAPSHOT.name in text
    cases = snap["cases"]
    ok = [r for r in cases if r["status"] == "ok"]
    low = {r["id"] for r in cases if r["confidence"] == "low"}
    hi_rows = [r for r in ok if r["id"] not in low]
    low_rows = [r for r in ok if r["id"] in low]
    s = snap["summary"]
    assert (s["cases"], s["predicted"], len(hi_rows), len(low_rows), len(low)) == (126, 125, 115, 10, 11)
    assert interval_summary(hi_rows) == s["interval_high_confidence"]  # the snapshot's rows are its summary's
    assert interval_summary(ok) == s["interval"]
    table = [ln for ln in text.splitlines() if ln.startswith("| ")]
    assert _row("all", ok, 126) in table
    assert _row("high confidence", hi_rows, 115) in table
    assert _row("low confidence", low_rows, 11) in table
    assert "| all | 126 | 125 | 0.147 % | 7.289 % | 209.12 % | 40 | 89.6 % | 1.389 % | 8 (6.4 %) |" in table
    assert "| high confidence | 115 | 115 | 0.112 % | 3.741 % | 56.44 % | 31 | 94.78 % | 0.991 % | 2 (1.74 %) |" in table
    assert f"agrees on {s['fit_verdict_agrees']} of 125" in text
    assert set(s["interval_high_confidence"]["unsafe_at_safe_end_cases"]) == {
        "spark-396-2xgb10-minimax-m27-awq-util080-fail", "spark-396-2xgb10-minimax-m27-awq-util085"}


def test_with_error_pct_read_as_a_percentage():
    """``with_error_pct`` is the number of predicted records with an error % (what the median and
    p90 run over), and the page says so, beside every other summary key."""
    rows = [{"status": "ok", "error_pct": e, "unsafe": False, "predicted_fits": True, "observed_fits": True,
             "id": f"c{i}"} for i, e in enumerate((1.0, -3.0, None))]
    rows.append({"status": "error", "id": "x", "reason": "r"})
    s = summarize(rows)
    assert (s["cases"], s["predicted"], s["with_error_pct"], s["median_abs_error_pct"]) == (4, 3, 2, 2.0)
    text = " ".join(page("accuracy.md").split())
    assert "`with_error_pct` (a **count**:" in text
    for key in s:
        assert f"`{key}`" in text, key
    for key in s["interval"]:
        assert f"`{key}`" in text, key
