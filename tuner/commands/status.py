"""``ctx-tuner status [--settings FILE] [--json]``: is the daemon healthy? For probes (Kubernetes
liveness, systemd, monitoring). Exit codes: 0 healthy; 1 unhealthy (the store cannot be read, or
``metrics_listen`` is set and the daemon's endpoint does not answer); 2 invalid settings."""

from __future__ import annotations

import argparse
import json
import sys

NAME = "status"


def add_parser(sub) -> argparse.ArgumentParser:
    from tuner.settings import DEFAULT_SETTINGS_PATH

    p = sub.add_parser("status", help="health of the daemon's store and metrics endpoint (exit 0 healthy)")
    p.add_argument("--settings", default=DEFAULT_SETTINGS_PATH, help=f"daemon settings (default {DEFAULT_SETTINGS_PATH})")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def check_health(settings) -> dict:
    """``{"healthy", "store", "jobs", "metrics", "problems"}`` for a daemon's settings (store opened
    read-only; the metrics endpoint scraped when configured)."""
    import sqlalchemy as sa

    from tuner.errors import TunerError
    from tuner.store import open_store, store_exists

    out: dict = {"store": settings.db_url, "jobs": None, "metrics": None, "problems": []}
    try:
        if not store_exists(settings.db_url):
            raise TunerError("the store does not exist yet (has the daemon started?)", where=settings.db_url)
        store = open_store(settings.db_url, readonly=True)
        try:
            with store.engine.connect() as conn:
                out["jobs"] = {k: int(v) for k, v in conn.execute(
                    sa.text("SELECT status, COUNT(*) FROM jobs GROUP BY status")).all()}
        finally:
            store.close()
    except Exception as exc:  # any failure to read the store is unhealthy
        out["problems"].append(f"store: {exc}")
    if settings.metrics_listen:
        from tuner.metrics import MetricsError, scrape

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
    from tuner.settings import load_settings

    try:
        settings = load_settings(args.settings)
    except SettingsError as exc:
        print(f"ctx-tuner status: invalid settings: {exc}", file=sys.stderr)
        return 2
    h = check_health(settings)
    if args.json:
        print(json.dumps(h, indent=2))
    else:
        print(f"{'healthy' if h['healthy'] else 'UNHEALTHY'}: store {h['store']}"
              + (f", jobs {h['jobs']}" if h["jobs"] is not None else "")
              + (f", metrics {h['metrics']['listen']}" if h["metrics"] else ""))
        for p in h["problems"]:
            print(f"  {p}")
    return 0 if h["healthy"] else 1
