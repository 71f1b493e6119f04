"""docs/deploy-files.md shows each format with the example the tests check: every fenced block after a
``<!-- fixture: PATH -->`` marker is that fixture file, byte for byte, and every fixture is shown; the
exit codes and their precedence are the code's."""

from __future__ import annotations

import re

from tests.conftest import REPO

DOC = REPO / "docs" / "deploy-files.md"


def test_each_documented_example_is_a_tested_fixture():
    text = DOC.read_text()
    shown = re.findall(r"<!-- fixture: (\S+) -->\n```\w*\n(.*?)```\n", text, re.S)
    assert len(shown) == 9
    for rel, body in shown:
        assert (REPO / rel).read_text() == body, rel
    fixtures = {str(p.relative_to(REPO)) for p in (REPO / "tests" / "fixtures" / "deploy").rglob("*") if p.is_file()}
    assert {rel for rel, _ in shown} == fixtures


def test_documented_exit_codes_are_the_codes():
    from tuner.reports.check import EXIT_DOES_NOT_START, EXIT_FAILED, EXIT_INVALID, EXIT_STARTS
    from tuner.deploy.verdicts import EXIT_PRECEDENCE

    text = DOC.read_text()
    assert (EXIT_STARTS, EXIT_DOES_NOT_START, EXIT_INVALID, EXIT_FAILED) == (0, 3, 2, 1)
    for code, words in ((0, "every workload starts"), (3, "does not start"), (4, "uncertain"), (2, "invalid input"),
                        (1, "the check itself failed")):
        assert re.search(rf"^\| {code} \| [^\n]*{words}", text, re.M), code
    assert EXIT_PRECEDENCE == (3, 4, 2, 1, 0) and "in the order **3, 4, 2, 1, 0**" in text
