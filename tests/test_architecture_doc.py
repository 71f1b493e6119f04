"""docs/architecture.md "Where to find a rule" points to the rules a reader looks for (fresh-user
finding F17: the model-runner default and where drop fields are parsed and applied were missing),
and each pointer names a module that defines it."""

from __future__ import annotations

import re

from tests._docs import section
from tests.conftest import REPO

#: (module, name) the section points to.
POINTERS = [("tuner/memory/eras.py", "uses_model_runner_v2"), ("tuner/jobs/job.py", "_runner_asked_for"),
            ("tuner/jobs/job.py", "layout_for"), ("tuner/question/drop.py", "DROP_FIELDS"),
            ("tuner/question/drop.py", "fields_markdown"), ("tuner/question/drop.py", "parse_drop"),
            ("tuner/question/drop.py", "load_drop"), ("tuner/question/drop.py", "MODELLED_ENV"),
            ("tuner/jobs/job.py", "run_job"), ("tuner/jobs/job.py", "drop_era"), ("tuner/jobs/job.py", "era_with_env"),
            ("tuner/jobs/job.py", "rank_settings"), ("tuner/jobs/job.py", "kv_specs_for"),
            ("tuner/jobs/job.py", "search_points"), ("tuner/jobs/job.py", "drop_env")]


def test_where_to_find_a_rule_lacked_the_runner_default_and_the_drop_fields():
    text = section("architecture.md", "Where to find a rule")
    for module, name in POINTERS:
        assert f"`{module}`" in text and f"`{name}`" in text, (module, name)
        source = (REPO / module).read_text()
        assert re.search(rf"^(def|class) {name}\b|^{name}\b[^=\n]*=", source, re.M), (module, name)


def test_modelled_env_comment_listed_three_of_five_variables():
    """The comment above ``MODELLED_ENV`` listed 3 of its 5 names: it now points to the tuple and
    names none, so it cannot fall behind it."""
    from tuner.question.drop import MODELLED_ENV

    source = (REPO / "tuner" / "question" / "drop.py").read_text()
    before = source[:source.index("MODELLED_ENV = (")].rstrip().split("\n")
    comment = []
    for ln in reversed(before):
        if not ln.startswith("#:"):
            break
        comment.append(ln)
    assert comment and "this tuple is the list" in " ".join(comment)
    assert not any(name in " ".join(comment) for name in MODELLED_ENV)
