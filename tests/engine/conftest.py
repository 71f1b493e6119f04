"""Engine tier (``.ci/run`` block ``# --- engine tier ---``): tests against the real vLLM.

Every test module here skips when ``vllm`` is not importable, so in the normal venv the directory
costs nothing. In the engine venv the differential tests
record their case and mismatch counts in :func:`engine_diff_stats`; the terminal summary prints
them, so the CI log shows the count without ``-s``.
"""

from __future__ import annotations

from collections import Counter

import pytest

_STATS = pytest.StashKey[dict]()


@pytest.fixture(scope="session")
def engine_diff_stats(request) -> dict:
    """``{"cases": int, "mismatches": Counter(field → n), "families": {family: (cases, mismatches)}}``."""
    stash = request.config.stash
    if _STATS not in stash:
        stash[_STATS] = {"cases": 0, "mismatches": Counter(), "families": {}, "version": None}
    return stash[_STATS]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    stats = config.stash.get(_STATS, None)
    if not stats or not stats["cases"]:
        return
    total = sum(bad for _, bad in stats["families"].values())
    terminalreporter.write_sep("=", "engine tier: tuner.memory.kvcache vs vLLM kv_cache_utils")
    for family, (n, bad) in sorted(stats["families"].items()):
        terminalreporter.write_line(f"  {family:<10} {n:>6} cases  {bad:>4} mismatching cases")
    fields = ", ".join(f"{k} {v}" for k, v in sorted(stats["mismatches"].items())) or "none"
    terminalreporter.write_line(f"KVCACHE DIFFERENTIAL vLLM {stats['version']}: {stats['cases']} cases, "
                                f"{total} mismatches (mismatching cases; by field: {fields})")
