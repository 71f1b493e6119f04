"""Shared test set-up: offline hub, the repo root, and the shared cases/models directory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from tests._paths import REPO, SHARED  # noqa: F401  (REPO: imported by tests through conftest)


# -- the checkout is never written to --------------------------------------------------------------
# ctx-tuner's default store is var/ctx-tuner.sqlite under the *current directory* (profile creates
# it; explain, plot and check --cross-check add pass-memo rows to it where it exists). Tests ran in
# the checkout (pytest's directory), so a user's README store gained the suite's rows. Every module
# and every test now runs in a directory of its own under pytest's tmp (a test that needs the
# checkout's relative paths chdirs there itself and gives --db), and the session fails where the
# checkout's var/ or its git status changed all the same.


def _in_dir(path: Path):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield path
    finally:
        os.chdir(old)


@pytest.fixture(scope="module", autouse=True)
def _module_runs_outside_the_checkout(tmp_path_factory):
    """Module-scoped fixtures (shared explain / check runs) run in a directory of the module's own."""
    yield from _in_dir(tmp_path_factory.mktemp("cwd-module"))


@pytest.fixture(autouse=True)
def _test_runs_outside_the_checkout(tmp_path_factory):
    """Each test starts in an empty directory of its own (not ``tmp_path``, which tests list)."""
    yield from _in_dir(tmp_path_factory.mktemp("cwd"))


def checkout_view(at: Path) -> Path:
    """A directory ``at`` whose entries link to the checkout's (``configs``, ``docs``, …) but for its
    ``var/`` and ``.git``: a test that runs the README's commands, whose paths are relative to the
    checkout, chdirs here and gets a default store of its own (``at/var``), as a fresh clone has."""
    at.mkdir(parents=True)
    for entry in REPO.iterdir():
        if entry.name not in ("var", ".git"):
            (at / entry.name).symlink_to(entry)
    return at


def as_in_the_docs(text: str, *dirs: Path) -> list[str]:
    """``text``'s lines as the docs print them: each of ``dirs`` (the checkout, a :func:`checkout_view`)
    written ``/src/ctx-tuner``, trailing blanks dropped."""
    for d in dirs:
        text = text.replace(str(d), "/src/ctx-tuner")
    return [ln.rstrip() for ln in text.splitlines()]


def checkout_state(repo: Path = REPO) -> dict:
    """What the suite must leave as it found it: every file under ``repo/var`` (ignored by git: the
    default store, its -wal/-shm) with its size and mtime, and ``git status --porcelain`` (files
    changed or added anywhere else; empty set where git or the repository is not there)."""
    import subprocess

    var = repo / "var"
    files = {str(f.relative_to(repo)): (f.stat().st_size, f.stat().st_mtime_ns)
             for f in sorted(var.rglob("*")) if f.is_file()} if var.is_dir() else {}
    try:
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=repo,
                                capture_output=True, text=True, timeout=60)
        changed = set(status.stdout.splitlines()) if status.returncode == 0 else set()
    except (OSError, subprocess.SubprocessError):
        changed = set()
    return {"var": files, "git": changed}


def checkout_writes(before: dict, after: dict) -> list[str]:
    """What changed in the checkout between two :func:`checkout_state`: var/ files added, removed or
    rewritten, and git status lines that are new (a file already changed before the run is the
    developer's, not the suite's)."""
    var = sorted(k for k in set(before["var"]) | set(after["var"]) if before["var"].get(k) != after["var"].get(k))
    return var + sorted(after["git"] - before["git"])


@pytest.fixture(scope="session", autouse=True)
def _checkout_left_as_found():
    """The whole run wrote nothing into the checkout (fails the session's last teardown otherwise)."""
    before = checkout_state()
    yield
    written = checkout_writes(before, checkout_state())
    if written:
        pytest.fail(f"the checkout {REPO} changed during the test run (a test wrote there, or it was edited "
                    f"meanwhile): {', '.join(written)}", pytrace=False)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not (SHARED / "cases").is_dir():
        pytest.skip(f"shared cases not found at {SHARED}")
    return SHARED


@pytest.fixture(scope="session")
def observed_cases(shared_dir) -> dict[str, dict]:
    cases = {}
    for line in (shared_dir / "cases" / "vllm-observed.jsonl").read_text().splitlines():
        if line.strip():
            c = json.loads(line)
            cases[c["id"]] = c
    return cases


@pytest.fixture
def tiny_config(tmp_path) -> Path:
    """A real Llama config with 2 layers and hidden size 64 (written, not downloaded)."""
    d = tmp_path / "tiny-llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 1000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "torch_dtype": "bfloat16", "tie_word_embeddings": False, "hidden_act": "silu",
    }))
    return d


# -- database backends -----------------------------------------------------------------------------
#: A PostgreSQL server URL (SQLAlchemy form, e.g. postgresql+psycopg://tuner@127.0.0.1:5432/tuner_test)
#: that tests may create and drop databases on. Unset: PostgreSQL tests are skipped (reported as
#: such); CTX_TUNER_REQUIRE_POSTGRESQL=1 (CI's PostgreSQL tier) turns the skip into a failure.
PG_ENV = "CTX_TUNER_TEST_DATABASE_URL"


def _pg_base() -> str:
    base = os.environ.get(PG_ENV)
    if not base:
        if os.environ.get("CTX_TUNER_REQUIRE_POSTGRESQL") == "1":
            pytest.fail(f"{PG_ENV} is not set but CTX_TUNER_REQUIRE_POSTGRESQL=1")
        pytest.skip(f"{PG_ENV} not set: no PostgreSQL server to test against")
    return base


def make_pg_database(prefix: str = "t") -> tuple[str, object]:
    """Create an empty database on the test server; returns (its URL, a function that drops it)."""
    import uuid

    import sqlalchemy as sa
    from sqlalchemy.engine import make_url

    base = make_url(_pg_base())
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = base.set(database=name).render_as_string(hide_password=False)

    def drop() -> None:
        with admin.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()

    return url, drop


@pytest.fixture
def pg_url():
    """A fresh, empty PostgreSQL database on the test server (dropped afterwards), or a skip."""
    url, drop = make_pg_database()
    yield url
    drop()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """The store URL of each backend: a new SQLite file, and a new PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'state' / 'tuner.sqlite'}"
    return request.getfixturevalue("pg_url")


def pytest_collection_modifyitems(config, items):
    """Mark every test that runs on PostgreSQL (``pg_url``, or ``db_url[postgresql]``) with
    ``postgresql``: CI's PostgreSQL tier selects them with ``-m postgresql``."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        names = getattr(item, "fixturenames", ())
        if params.get("db_url") == "postgresql" or (
                any(n == "pg_url" or n.startswith("pg_") for n in names) and "db_url" not in params):
            item.add_marker(pytest.mark.postgresql)
