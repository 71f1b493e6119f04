"""``ctx-tuner plot``: the PNG opens and the series drawn hold the expected points."""

from __future__ import annotations

import json
import sys

import pytest

from tests._results_db import H100_DROP, profiled_db, using_cached_worker
from tests._cli_helpers import run_cli as _cli

pytest.importorskip("matplotlib")




def _image(path):
    import matplotlib.image

    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 300 and img.shape[1] > 500
    assert img.std() > 0.01  # not a blank canvas
    return img


def test_plot_from_store_shows_the_non_monotone_surface_and_the_measured_refusal(tmp_path):
    out = tmp_path / "v0.png"
    rc, text, err = _cli("plot", "--model", "llama-3.1-8b", "--device", "3090", "--db", str(profiled_db()),
                         "-o", str(out), "--json")
    assert rc == 0, err
    _image(out)
    series = json.loads((tmp_path / "v0.json").read_text())["series"]
    assert json.loads(text)["series"] == series
    assert sorted(series["simulated grid point: starts"]) == [[0.9, 20000.0], [0.9, 35000.0]]
    assert series["simulated grid point: does not start"] == [[0.9, 29000.0]]
    assert series["measured: refused"] == [[0.9, 29000.0]]  # the imported start-up, marked apart
    [(label, pts)] = [(k, v) for k, v in series.items() if "proposals" in k]
    assert pts[0][0] == 0.9 and pts[0][1] > 35000  # the largest length that starts lies above the gap
    assert json.loads(text)["data"]["non_monotone_at"] == [0.9]


def test_plot_from_drop_sweeps_u_with_concurrency_lines(tmp_path):
    profiled_db()  # the concurrency-1 job is the profile job: reuse it
    out = tmp_path / "h100.png"
    with using_cached_worker():
        rc, text, err = _cli("plot", str(H100_DROP), "--concurrency", "4", "--db", str(profiled_db()), "-o", str(out),
                             "--progress")
    assert rc == 0, err
    assert "[2/2]" in err  # progress: jobs, and the worker's line per u relayed from the running job
    assert "concurrency 4: gpu_memory_utilization 0.95 done (3/3)" in err
    _image(out)
    series = json.loads((tmp_path / "h100.json").read_text())["series"]
    one = series["largest max_model_len, >= 1 full-length request"]
    four = series["largest max_model_len, >= 4 full-length requests"]
    assert [u for u, _ in one] == [0.8, 0.9, 0.95] and all(m == 131072 for _, m in one)
    # at 0.95: 4 requests of M tokens need 4 x cdiv(M, 16) <= num_gpu_blocks (vLLM 0.19 concurrency)
    import sqlite3

    con = sqlite3.connect(profiled_db())
    blocks = dict(con.execute("SELECT p.gpu_memory_utilization, p.num_gpu_blocks FROM proposals p JOIN drops d "
                              "ON d.id = p.drop_id WHERE d.name = 'llama-3.1-8b-h100'").fetchall())
    con.close()
    for u, m in four:  # drawn at the interval's safe end (risk safe): at most the expected value's length
        assert m % 16 == 0 and m < 131072
        assert m <= (blocks[u] // 4) * 16 and abs(m - (blocks[u] // 4) * 16) <= 0.03 * m
    assert len(series["simulated grid point: starts"]) == 3 * 16


def test_missing_matplotlib_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc, _, err = _cli("plot", "--model", "llama", "--db", str(profiled_db()), "-o", str(tmp_path / "x.png"))
    assert rc == 1 and "ctx-tuner[plot]" in err
    assert not (tmp_path / "x.png").exists()


def test_usage(tmp_path):
    assert _cli("plot", "-o", str(tmp_path / "x.png"))[0] == 2  # neither drop nor --model
    rc, _, err = _cli("plot", "--model", "nothing-like-this", "--db", str(profiled_db()), "-o", str(tmp_path / "x.png"))
    assert rc == 1 and "no stored drop" in err


def test_plot_wrote_pass_memo_rows_without_saying_so(tmp_path):
    """``plot DROP`` stores its jobs' passes in the store's pass memo; it now says so (as ``explain``):
    the store line names the file and the number of entries written, and the JSON carries it."""
    import shutil
    import sqlite3

    db = tmp_path / "results.sqlite"
    shutil.copy(profiled_db(), db)

    def memo_rows():
        con = sqlite3.connect(db)
        try:
            return con.execute("SELECT COUNT(*) FROM pass_memo").fetchone()[0]
        finally:
            con.close()

    drop = tmp_path / "h100.yaml"  # passes the store's memo does not hold yet (another batch)
    drop.write_text(H100_DROP.read_text().replace("model: ../models/", f"model: {H100_DROP.parent.parent}/models/")
                    .replace("max_num_batched_tokens: 8192", "max_num_batched_tokens: 4096"))
    before = memo_rows()
    with using_cached_worker():
        rc, text, err = _cli("plot", str(drop), "--db", str(db), "-o", str(tmp_path / "a.png"))
    assert rc == 0, err
    written = memo_rows() - before
    assert written > 0
    noun = "entry" if written == 1 else "entries"
    assert f"  store: {db} (its pass memo read; {written} pass-memo {noun} written)\n" in text
    with using_cached_worker():
        rc, text, err = _cli("plot", str(drop), "--db", str(db), "-o", str(tmp_path / "b.png"), "--json")
    assert rc == 0, err
    store = json.loads(text)["store"]
    assert store["path"] == str(db) and store["pass_memo_entries_written"] == 0
    assert memo_rows() - before == written
