"""Daemon settings: one table of (name, default, help), a YAML file, typed errors.

:data:`SETTINGS` declares every key once; it drives validation (:func:`load_settings`), the
:class:`Settings` defaults and the reference table of docs/daemon.md (:func:`settings_markdown`, kept
complete by a test). A settings file is ``yaml.safe_load``-ed; unknown keys, wrong types and
out-of-range values raise :class:`~tuner.errors.SettingsError` naming the file and the key.

Relative paths in a settings file are relative to the file's directory. ``database_url`` and
``snapshot_path`` default to files inside ``state_dir``.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable

import yaml

from tuner.errors import SettingsError

#: Where ``ctx-tuner daemon`` looks when ``--settings`` is not given.
DEFAULT_SETTINGS_PATH = "/etc/ctx-tuner/tuner.yaml"
#: Largest settings file accepted, bytes.
MAX_SETTINGS_BYTES = 64 * 1024
METHODS = ("simulate", "cuda", "vllm", "auto")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class _Bad(Exception):
    pass


def _path(v: Any) -> str:
    if not isinstance(v, str) or not v.strip() or "\x00" in v:
        raise _Bad(f"must be a non-empty path string, not {v!r}")
    return v


def _opt_path(v: Any) -> str | None:
    return None if v is None else _path(v)


def _opt_name(v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not v.strip() or len(v) > 253 or any(c.isspace() or not c.isprintable() for c in v):
        raise _Bad(f"must be a host name (printable, no spaces, at most 253 characters), not {v!r}")
    return v


def _number(lo: float, hi: float) -> Callable[[Any], float]:
    def check(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise _Bad(f"must be a number of seconds, not {type(v).__name__} {v!r}")
        if not lo <= v <= hi:
            raise _Bad(f"must be between {lo:g} and {hi:g}, not {v}")
        return float(v)
    return check


def _int(lo: int, hi: int) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise _Bad(f"must be an integer, not {type(v).__name__} {v!r}")
        if not lo <= v <= hi:
            raise _Bad(f"must be between {lo} and {hi}, not {v}")
        return v
    return check


def _opt_bytes(v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _Bad(f"must be an integer number of bytes or null, not {type(v).__name__} {v!r}")
    if v != 0 and not (1 << 27) <= v <= (1 << 50):
        raise _Bad(f"must be 0 (no limit) or between {1 << 27} (128 MiB) and {1 << 50} bytes, not {v}")
    return v


def _roots(v: Any) -> tuple[str, ...] | None:
    if v is None:
        return None
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not v:
        raise _Bad(f"must be a list of directories or null (any readable path), not {type(v).__name__}")
    return tuple(_path(p) for p in v)


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise _Bad(f"must be true or false, not {type(v).__name__} {v!r}")
    return v


def _listen(v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str):
        raise _Bad(f"must be HOST:PORT (loopback), unix:/PATH or null, not {type(v).__name__} {v!r}")
    from tuner.daemon.metrics import parse_listen

    try:
        parse_listen(v)
    except ValueError as exc:
        raise _Bad(str(exc)) from None
    return v


def _choice(options: tuple[str, ...], upper: bool = False) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if isinstance(v, str):
            norm = v.strip().upper() if upper else v.strip().lower()
            if norm in options:
                return norm
        raise _Bad(f"must be one of {', '.join(options)}, not {v!r}")
    return check


def _release_pythons(v: Any) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise _Bad(f"must be a mapping of vLLM release to Python path, not {type(v).__name__} {v!r}")
    from tuner.memory.eras import EraError, parse_version

    out = {}
    for k, p in v.items():
        try:
            key = ".".join(map(str, parse_version(str(k)).key))
        except EraError as exc:
            raise _Bad(f"{k!r}: {exc.message}") from None
        out[key] = _path(p)
    return out


@dataclass(frozen=True)
class Setting:
    """One settings key: its ``name``, ``default`` (None = derived, see help), ``help`` and check."""

    name: str
    default: Any
    help: str
    check: Callable[[Any], Any]


#: Every daemon settings key, declared once. Order = the order of docs/daemon.md.
SETTINGS: tuple[Setting, ...] = (
    Setting("watch_dir", "/etc/ctx-tuner/conf.d",
            "Directory of drops: every `*.yaml` / `*.yml` (any case) below it (subdirectories included; hidden "
            "files, editor swap/backup files and symlinked directories are ignored).", _path),
    Setting("state_dir", "/var/lib/ctx-tuner",
            "Writable state: the database (by default), `proposals/NAME.yaml` and the read-only snapshot.",
            _path),
    Setting("database_url", None,
            "SQLAlchemy URL or SQLite file path of the results store; null = `STATE_DIR/ctx-tuner.sqlite`. "
            "Overridden by `$CTX_TUNER_DATABASE_URL`, then by the systemd credential `database_url`; a "
            "`database_password` credential fills in the password of a URL without one (see Fleet).",
            _opt_path),
    Setting("snapshot_path", None,
            "Read-only SQLite copy for readers that cannot write the state directory (rewritten atomically "
            "after jobs finish); null = `STATE_DIR/ctx-tuner-snapshot.sqlite`. SQLite stores only.", _opt_path),
    Setting("job_timeout_s", 600.0,
            "Wall-clock limit of one profile job in seconds; the worker's whole process group is killed "
            "when it expires.", _number(1, 86400)),
    Setting("rescan_interval_s", 60.0,
            "Seconds between full rescans of `watch_dir` (the safety net for missed filesystem events).",
            _number(0.1, 86400)),
    Setting("debounce_s", 0.5,
            "Quiet time in seconds after a filesystem event before the directory is reconciled; files "
            "modified more recently than this are left for the next pass.", _number(0, 60)),
    Setting("max_attempts", 3,
            "Runs of one job that may fail (worker crash, OOM or signal kill, timeout) before it is marked failed; "
            "each failed run is retried after a backoff. Attempts lost to daemon crashes are not counted, and an "
            "invalid drop is failed at once (final until the file changes or `ctx-tuner retry`).", _int(1, 100)),
    Setting("retry_backoff_s", 30.0,
            "Delay before the first retry of a failed run (and of a job interrupted by a daemon crash), in "
            "seconds; doubled for each further retry.", _number(0, 86400)),
    Setting("retry_backoff_max_s", 3600.0,
            "Longest delay between retries, in seconds.", _number(0, 604800)),
    Setting("worker_memory_max_bytes", None,
            "Memory limit of each simulate worker subprocess in bytes (`RLIMIT_DATA`: heap and private maps); a "
            "pass that needs more fails as a run failure instead of waking the host's OOM killer (cuda/vllm "
            "workers are bounded by the unit's `MemoryMax=`). null = half of the host's physical memory; 0 = "
            "no limit.", _opt_bytes),
    Setting("worker_max_jobs", 50,
            'Jobs one warm worker runs before it is replaced: the daemon keeps one worker process (`-m tuner.commands.worker_main --serve`, own process group, killed and replaced on a timeout, a crash fails its job as before) for successive simulate jobs, so torch and transformers are imported once; 1 = a fresh worker for every job (the behaviour before the warm worker).', _int(1, 100000)),
    Setting("worker_max_rss_bytes", 2147483648,
            'Resident memory of the warm worker after a job above which it is replaced (bytes); 0 = no check (`worker_max_jobs` still applies).', _opt_bytes),
    Setting("log_level", "INFO", "Logging level of the daemon's stderr log.", _choice(LOG_LEVELS, upper=True)),
    Setting("allow_trust_remote_code", False,
            "Allow model code from the model directory (HF `trust_remote_code`). Drops can never set it.",
            _bool),
    Setting("default_method", "simulate",
            "Profile method for drops that do not set `method` (simulate, cuda, vllm, auto).", _choice(METHODS)),
    Setting("worker_python", None,
            "Python interpreter that runs worker subprocesses (`-m tuner.commands.worker_main`, needs torch); "
            "null = the daemon's own interpreter.", _opt_path),
    Setting("host_id", None,
            "This daemon's name in a fleet (`hosts.host_id`; with `watch_dir` it owns jobs and drops); "
            "null = the host name.", _opt_name),
    Setting("lease_s", 60.0,
            "Seconds a daemon's lease on its jobs lasts without a heartbeat (renewed every third of it); "
            "after that another daemon may return its running jobs to the queue for its successor.",
            _number(3, 86400)),
    Setting("engine_pythons", {},
            "vLLM release → Python interpreter of a venv with that vLLM build installed (`{\"0.32.0\": "
            "/opt/vllm-0.32/bin/python}`): a drop whose `engine_version` is that release runs its worker there "
            "(the engine adapter then uses the drop's own release); other drops use `worker_python`.",
            _release_pythons),
    Setting("metrics_listen", None,
            "Prometheus metrics endpoint: `127.0.0.1:PORT` (a loopback address) or `unix:/run/ctx-tuner/metrics.sock` "
            "(what the shipped unit allows); null = no metrics. `ctx-tuner status` probes it.", _listen),
    Setting("pass_memo", True,
            "Answer a drop whose model spec and profile passes are already in the store's pass memo (any drop, "
            "any host of a fleet; keyed by content hash) in the daemon's own process, without a worker; false = "
            "always run a worker (the memo is still filled).", _bool),
    Setting("model_roots", None,
            "Directories a drop's local `model` (and speculative draft model) must lie in, after following "
            "symbolic links; a drop naming a path outside them fails as an invalid drop, and nothing of that "
            "file is read. HF ids resolved from the HF cache are always allowed. null = any readable path (the "
            "default; the shipped settings file restricts it). See docs/model-roots.md.", _roots),
    Setting("allow_hub_download", False,
            "Fetch `config.json` (and the small quantization / processor JSON files, never weights) of an HF id "
            "that is not in the local HF cache through `huggingface_hub` (honours HF_ENDPOINT, HF_TOKEN, "
            "HF_HUB_OFFLINE); the unit must then allow network access.", _bool),
)

_BY_NAME = {s.name: s for s in SETTINGS}


@dataclass(frozen=True)
class Settings:
    """Validated daemon settings (see :data:`SETTINGS` for each key's meaning). Times in seconds."""

    watch_dir: str = "/etc/ctx-tuner/conf.d"
    state_dir: str = "/var/lib/ctx-tuner"
    database_url: str | None = None
    snapshot_path: str | None = None
    job_timeout_s: float = 600.0
    rescan_interval_s: float = 60.0
    debounce_s: float = 0.5
    max_attempts: int = 3
    retry_backoff_s: float = 30.0
    retry_backoff_max_s: float = 3600.0
    worker_memory_max_bytes: int | None = None
    worker_max_jobs: int = 50
    worker_max_rss_bytes: int | None = 2147483648
    log_level: str = "INFO"
    allow_trust_remote_code: bool = False
    default_method: str = "simulate"
    worker_python: str | None = None
    host_id: str | None = None
    lease_s: float = 60.0
    engine_pythons: dict = field(default_factory=dict)
    metrics_listen: str | None = None
    pass_memo: bool = True
    model_roots: tuple[str, ...] | None = None
    allow_hub_download: bool = False
    #: the file these settings came from (None = defaults).
    source: str | None = None

    def python_for(self, engine_version: str | None) -> str | None:
        """The worker interpreter for a drop of ``engine_version``: its ``engine_pythons`` entry
        (same major.minor.patch), else ``worker_python``."""
        from tuner.memory.eras import EraError, parse_version

        try:
            key = ".".join(map(str, parse_version(str(engine_version)).key))
        except EraError:
            return self.worker_python
        return self.engine_pythons.get(key) or self.worker_python

    @property
    def db_url(self) -> str:
        """The store URL: ``database_url`` or the SQLite file ``STATE_DIR/ctx-tuner.sqlite``."""
        return self.database_url or str(Path(self.state_dir) / "ctx-tuner.sqlite")

    @property
    def host(self) -> str:
        """``host_id`` or the host name."""
        from tuner.store.fleet import default_host_id

        return self.host_id or default_host_id()

    @property
    def snapshot_file(self) -> Path:
        """``snapshot_path`` or ``STATE_DIR/ctx-tuner-snapshot.sqlite``."""
        return Path(self.snapshot_path) if self.snapshot_path else Path(self.state_dir) / "ctx-tuner-snapshot.sqlite"

    @property
    def proposals_dir(self) -> Path:
        """Directory of the per-drop proposal files: ``STATE_DIR/proposals``."""
        return Path(self.state_dir) / "proposals"

    @property
    def worker_memory_limit(self) -> int | None:
        """``worker_memory_max_bytes`` in force: the setting, half the physical memory when
        null, None (no limit) when 0."""
        v = self.worker_memory_max_bytes
        if v == 0:
            return None
        if v is None:
            try:
                return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
            except (ValueError, OSError):
                return None
        return v

    @property
    def log_level_no(self) -> int:
        """``log_level`` as a :mod:`logging` number."""
        return int(getattr(logging, self.log_level))


def settings_from_mapping(data: Any, *, source: str | None = None, base_dir: str | os.PathLike | None = None) -> Settings:
    """Validate a mapping of settings (absent keys take their defaults).

    Relative paths are resolved against ``base_dir`` (a settings file's directory).

    Raises:
        SettingsError: not a mapping, an unknown key, or a bad value (``path`` = ``source``,
            ``field`` = the key).
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SettingsError(f"top level must be a mapping of settings, not {type(data).__name__}", path=source)
    values: dict[str, Any] = {}
    for key, value in data.items():
        spec = _BY_NAME.get(key) if isinstance(key, str) else None
        if spec is None:
            raise SettingsError(f"unknown setting {key!r}; known: {', '.join(_BY_NAME)}", path=source, field=str(key))
        try:
            values[key] = spec.check(value)
        except _Bad as exc:
            raise SettingsError(str(exc), path=source, field=key) from None
    base = Path(base_dir) if base_dir is not None else None
    for key in ("watch_dir", "state_dir", "snapshot_path", "worker_python"):
        v = values.get(key)
        if v is not None and base is not None and not os.path.isabs(os.path.expanduser(v)):
            values[key] = str(base / v)
    if values.get("model_roots") and base is not None:
        values["model_roots"] = tuple(r if os.path.isabs(os.path.expanduser(r)) else str(base / r)
                                      for r in values["model_roots"])
    if values.get("engine_pythons") and base is not None:
        values["engine_pythons"] = {k: v if os.path.isabs(os.path.expanduser(v)) else str(base / v)
                                    for k, v in values["engine_pythons"].items()}
    db = values.get("database_url")
    if db and "://" not in db and base is not None and not os.path.isabs(db):
        values["database_url"] = str(base / db)
    return replace(Settings(), source=source, **values)


#: Environment variable that sets the store URL (wins over ``database_url`` in the file).
DATABASE_URL_ENV = "CTX_TUNER_DATABASE_URL"
#: systemd credentials read from ``$CREDENTIALS_DIRECTORY`` (``LoadCredential=NAME:FILE``).
URL_CREDENTIAL, PASSWORD_CREDENTIAL = "database_url", "database_password"


def _read_credential(directory: str, name: str) -> str | None:
    path = Path(directory) / name
    try:
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"cannot read credential: {getattr(exc, 'strerror', None) or exc}", path=str(path)) from None
    if not text:
        raise SettingsError("credential is empty", path=str(path))
    return text


def apply_environment(settings: Settings, environ: dict[str, str] | os._Environ | None = None) -> Settings:
    """The store URL from outside the settings file, so no secret needs to be in ``tuner.yaml``:
    ``$CTX_TUNER_DATABASE_URL``, else the systemd credential ``database_url``
    (``$CREDENTIALS_DIRECTORY/database_url``), else ``database_url`` from the file; then a
    ``database_password`` credential is put into a server URL that has no password.

    Raises:
        SettingsError: a credential file that cannot be read or is empty, or a bad URL (naming the
            variable or file).
    """
    env = os.environ if environ is None else environ
    url, source = settings.database_url, "database_url"
    creds = env.get("CREDENTIALS_DIRECTORY") or ""
    if creds:
        cred = _read_credential(creds, URL_CREDENTIAL)
        if cred is not None:
            url, source = cred, str(Path(creds) / URL_CREDENTIAL)
    if env.get(DATABASE_URL_ENV):
        url, source = env[DATABASE_URL_ENV].strip(), f"${DATABASE_URL_ENV}"
    if url and "://" in url and creds:
        password = _read_credential(creds, PASSWORD_CREDENTIAL)
        if password is not None:
            from sqlalchemy.engine import make_url

            try:
                u = make_url(url)
            except Exception as exc:
                raise SettingsError(f"not a SQLAlchemy URL: {exc}", path=source) from None
            if u.password is None:
                url = u.set(password=password).render_as_string(hide_password=False)
    if url == settings.database_url:
        return settings
    return replace(settings, database_url=url)


def load_settings(path: str | os.PathLike | None, environ: dict[str, str] | None = None) -> Settings:
    """Read and validate a settings file; ``None`` gives the defaults. The store URL may then come
    from the environment or a systemd credential (:func:`apply_environment`).

    Raises:
        SettingsError: the file cannot be read, exceeds 64 KiB, is not YAML, or holds a bad key or
            value (the error names the file and the key); a bad credential.
    """
    return apply_environment(_load_file(path), environ)


def _load_file(path: str | os.PathLike | None) -> Settings:
    if path is None:
        return Settings()
    p = str(path)
    try:
        with open(p, "rb") as fh:
            raw = fh.read(MAX_SETTINGS_BYTES + 1)
    except OSError as exc:
        raise SettingsError(f"cannot read settings: {exc.strerror or exc}", path=p) from None
    if len(raw) > MAX_SETTINGS_BYTES:
        raise SettingsError(f"settings file is larger than {MAX_SETTINGS_BYTES // 1024} KiB", path=p)
    try:
        data = yaml.safe_load(raw.decode("utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise SettingsError(f"not valid YAML: {exc}", path=p) from None
    return settings_from_mapping(data, source=p, base_dir=Path(p).resolve().parent)


def check_worker_python(settings: Settings) -> None:
    """``worker_python`` (when set) must be an executable file, or a command name found on ``PATH``.

    Raises:
        SettingsError: naming the settings file and ``worker_python``.
    """
    _check_python(settings, settings.worker_python, "worker_python")
    for release, wp in settings.engine_pythons.items():
        _check_python(settings, wp, f"engine_pythons.{release}")


def _check_python(settings: Settings, wp: str | None, name: str) -> None:
    if wp is None:
        return
    path = os.path.expanduser(wp)
    if os.sep not in path:
        if shutil.which(path) is None:
            raise SettingsError(f"{name} {wp!r} is not a command on PATH", path=settings.source,
                                field=name)
        return
    if not os.path.exists(path):
        raise SettingsError(f"{name} {wp} does not exist", path=settings.source, field=name)
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        raise SettingsError(f"{name} {wp} is not an executable file", path=settings.source,
                            field=name)


def settings_markdown() -> str:
    """The settings reference as a Markdown table (for docs/daemon.md)."""
    rows = ["| setting | default | description |", "| --- | --- | --- |"]
    for s in SETTINGS:
        if s.default is None:
            default = "`null`"
        elif isinstance(s.default, bool):
            default = f"`{str(s.default).lower()}`"
        else:
            default = f"`{s.default}`"
        rows.append(f"| `{s.name}` | {default} | {s.help} |")
    return "\n".join(rows)


def _check_table_matches_dataclass() -> None:  # import-time guard: the table and the dataclass agree
    names = [f.name for f in fields(Settings) if f.name != "source"]
    assert names == [s.name for s in SETTINGS], "SETTINGS and Settings disagree"
    for s in SETTINGS:
        assert getattr(Settings(), s.name) == s.default, s.name


_check_table_matches_dataclass()
