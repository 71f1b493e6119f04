"""Small failures found by a fresh-user test (issue 17 follow-up), one regression test each."""

from __future__ import annotations

import pytest

from tests.test_daemon import Harness


@pytest.fixture
def h(tmp_path, tiny_config):
    harness = Harness(tmp_path, tiny_config)
    yield harness
    harness.close()


def test_invalid_drop_job_stored_with_null_name(h):
    d = h.start()
    (h.conf / "bad.yaml").write_text("name: bad-name\nmodel: [1, 2]\n")  # YAML mapping, invalid drop
    (h.conf / "garbage.yaml").write_text("name: [unclosed\n")  # not YAML at all
    (h.conf / "listy.yaml").write_text("- name: x\n")  # YAML, not a mapping
    h.until(d, lambda: h.rows("SELECT count(*) FROM jobs WHERE status = 'failed'") == [(3,)], what="3 failed")
    rows = dict(h.rows("SELECT path, name FROM jobs"))
    assert rows == {str(h.conf / "bad.yaml"): "bad-name", str(h.conf / "garbage.yaml"): "garbage",
                    str(h.conf / "listy.yaml"): "listy"}
