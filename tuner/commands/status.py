"""``ctx-tuner status [--settings FILE] [--fleet] [--failed] [--json]``: is the daemon healthy, and
which drops failed? For probes (Kubernetes liveness, systemd, monitoring) and for people. Failed
drops do not make the daemon unhealthy (it keeps serving the others) but are named, each with its
reason; ``--failed`` lists only them (read-only: ``ctx-tuner retry`` re-queues). Exit codes: 0
healthy (``--failed``: no failed drop); 1 unhealthy (the store cannot be read, or ``metrics_listen``
is set and the daemon's endpoint does not answer; ``--failed``: at least one failed drop); 2
invalid settings."""

from __future__ import annotations

import argparse
import json
import sys

NAME = "status"


def add_parser(sub) -> argparse.ArgumentParser:
    from tuner.daemon.settings import DEFAULT_SETTINGS_PATH

    p = sub.add_parser("status", help="health of the daemon's store and metrics endpoint (exit 0 healthy)")
    p.add_argument("--settings", default=DEFAULT_SETTINGS_PATH, help=f"daemon settings (default {DEFAULT_SETTINGS_PATH})")
    p.add_argument("--fleet", action="store_true",
                   help="count the jobs of every host in a shared store (default: this daemon's, by host_id and "
                        "watch_dir)")
    p.add_argument("--failed", action="store_true",
                   help="list the failed drops with their reasons, nothing else (read-only; exit 1 when there "
                        "is one; `ctx-tuner retry NAME` runs one again)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _owner_id(conn, settings) -> tuple[int | None, bool]:
    """This daemon's ``hosts.id`` (host_id + watch_dir) and whether the store has owners at all
    (revision 0007); ``(None, True)``: a fleet store where this daemon has no row yet."""
    import sqlalchemy as sa

    if "hosts" not in sa.inspect(conn).get_table_names():
        return None, False
    row = conn.execute(sa.text("SELECT id FROM hosts WHERE host_id = :h AND watch_dir = :w"),
                       {"h": settings.host, "w": str(settings.watch_dir)}).first()
    return (int(row[0]) if row else None), True


def check_health(settings, *, fleet: bool = False) -> dict:
    """``{"healthy", "store", "jobs", "jobs_scope", "metrics", "problems"}`` for a daemon's settings
    (store opened read-only; the metrics endpoint scraped when configured). ``jobs`` counts this
    daemon's jobs (its ``hosts`` row: ``host_id`` + ``watch_dir``) in a fleet store, every job with
    ``fleet`` or in a store without owners; ``jobs_scope`` says which (``host HOST`` / ``fleet``)."""
    import sqlalchemy as sa

    from tuner.errors import TunerError
    from tuner.store.database import open_store, store_exists

    from tuner.daemon.failures import failed_drops

    out: dict = {"store": settings.db_url, "jobs": None, "jobs_scope": None, "failed": None, "metrics": None,
                 "problems": []}
    try:
        if not store_exists(settings.db_url):
            raise TunerError("the store does not exist yet (has the daemon started?)", where=settings.db_url)
        store = open_store(settings.db_url, readonly=True)
        try:
            with store.engine.connect() as conn:
                owner, owned = (None, False) if fleet else _owner_id(conn, settings)
                if owned:
                    out["jobs_scope"] = f"host {settings.host}"
                    out["jobs"] = {k: int(v) for k, v in conn.execute(
                        sa.text("SELECT status, COUNT(*) FROM jobs WHERE owner_id = :o GROUP BY status"),
                        {"o": owner}).all()} if owner is not None else {}
                else:
                    out["jobs_scope"] = "fleet"
                    out["jobs"] = {k: int(v) for k, v in conn.execute(
                        sa.text("SELECT status, COUNT(*) FROM jobs GROUP BY status")).all()}
                out["failed"] = [f.to_dict() for f in failed_drops(conn, owner)] \
                    if not (owned and owner is None) else []
        finally:
            store.close()
    except Exception as exc:  # any failure to read the store is unhealthy
        out["problems"].append(f"store: {exc}")
    if settings.metrics_listen:
        from tuner.daemon.metrics import MetricsError, scrape

        try:
            text = scrape(settings.metrics_listen)
            out["metrics"] = {"listen": settings.metrics_listen, "up": "ctx_tuner_up 1.0" in text,
                              "store_up": "ctx_tuner_store_up 1.0" in text}
            if not out["metrics"]["up"] or not out["metrics"]["store_up"]:
                out["problems"].append("metrics: the daemon reports its store down")
        except MetricsError as exc:
            out["problems"].append(f"metrics: {exc}")
    out["healthy"] = not out["problems"]
    return out


def run(args) -> int:
    from tuner.errors import SettingsError
    from tuner.daemon.settings import load_settings

    try:
        settings = load_settings(args.settings)
    except SettingsError as exc:
        print(f"ctx-tuner status: invalid settings: {exc}", file=sys.stderr)
        return 2
    h = check_health(settings, fleet=args.fleet)
    if args.failed:
        return _print_failed(h, args.json)
    if args.json:
        print(json.dumps(h, indent=2))
    else:
        for line in status_lines(h):
            print(line)
    return 0 if h["healthy"] else 1


#: Job states in the order ``status`` prints them.
_STATES = ("running", "pending", "done", "failed", "cancelled")


def jobs_text(jobs: dict) -> str:
    """``{"done": 3, "failed": 4}`` → ``3 done, 4 failed`` (``no jobs`` when empty)."""
    keys = [k for k in _STATES if jobs.get(k)] + sorted(k for k in jobs if k not in _STATES and jobs[k])
    return ", ".join(f"{jobs[k]} {k}" for k in keys) or "no jobs"


def status_lines(h: dict) -> list[str]:
    """The health report for people: the daemon's health, its jobs, each failed drop by name with
    its reason, the problems."""
    from tuner.daemon.failures import FailedDrop, failures_text

    lines = [f"{'healthy' if h['healthy'] else 'UNHEALTHY'}: store {h['store']}"
             + (" answers" if h["jobs"] is not None else "")
             + (f", metrics {h['metrics']['listen']} answer" if h["metrics"] else "")]
    if h["jobs"] is not None:
        lines.append(f"  jobs ({h['jobs_scope']}): {jobs_text(h['jobs'])}")
    failed = [FailedDrop(**f) for f in h.get("failed") or []]
    if failed:
        lines.append(f"  {len(failed)} drop{'s' if len(failed) != 1 else ''} failed (`ctx-tuner status --failed` "
                     "for the full reasons, `ctx-tuner retry NAME` to run one again):")
        lines += [f"    {t}" for t in failures_text(failed, limit=160)]
    for p in h["problems"]:
        lines.append(f"  problem: {p}")
    return lines


def _print_failed(h: dict, as_json: bool) -> int:
    from tuner.daemon.failures import FailedDrop, failures_text

    if h["failed"] is None:  # the store could not be read
        for p in h["problems"]:
            print(f"ctx-tuner status: {p}", file=sys.stderr)
        return 1
    failed = [FailedDrop(**f) for f in h["failed"]]
    if as_json:
        print(json.dumps({"store": h["store"], "jobs_scope": h["jobs_scope"], "failed": h["failed"]}, indent=2))
    elif not failed:
        print(f"no failed drop ({h['jobs_scope']}, store {h['store']})")
    else:
        for line in failures_text(failed, limit=10_000):
            print(line)
    return 1 if failed else 0
