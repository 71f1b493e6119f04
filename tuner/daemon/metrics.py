"""Prometheus metrics of the daemon (``prometheus-client``), built from the store at each scrape.

Every value is read from the SQL store when Prometheus scrapes (one read-only query per family),
so the metrics are rebuildable from the store and survive restarts:

- ``ctx_tuner_jobs{state}``: jobs per state (pending, running, done, failed, cancelled; a daemon on a
  fleet database counts its own jobs, and ``ctx_tuner_proposal_*`` are its own proposals);
- ``ctx_tuner_job_duration_seconds``: histogram of finished jobs' wall time (started → finished);
- ``ctx_tuner_proposal_max_model_len{drop,gpu_memory_utilization}``, ``…_kv_cache_tokens``,
  ``…_num_gpu_blocks``: the latest proposal per active drop and utilization (view
  ``latest_proposals``; a proposal where nothing starts has ``max_model_len`` 0);
- ``ctx_tuner_proposal_max_model_len_bound{drop,gpu_memory_utilization,bound}``: the latest
  proposal's two answers (revision 0010, :mod:`tuner.memory.uncertainty`): ``bound="safe"`` the largest
  max_model_len that starts at the interval's safe end, ``bound="expected"`` at the expected value
  (0: nothing starts there; absent for proposals stored without an interval);
- ``ctx_tuner_kv_residual_bytes{model,device,method}``: measured − predicted available KV bytes of
  the newest measured or imported run per model and device kind (view ``measured_vs_simulated``;
  negative = ctx-tuner promised more than the engine had);
- ``ctx_tuner_drop_failed{drop,kind,error_type}``: 1 per failed drop (its current job failed;
  ``kind`` ``drop`` = invalid input, ``run`` = given up after its attempts; :mod:`tuner.daemon.failures`);
  the reason itself is in ``ctx-tuner status --failed`` and ``proposals/failed/NAME.yaml``;
- ``ctx_tuner_up``: 1 while the daemon serves metrics; ``ctx_tuner_store_up``: the store answered.

Served on a loopback TCP address (``127.0.0.1:9464``) or a Unix socket (``unix:/run/ctx-tuner/
metrics.sock``; what the hardened unit allows), set by the ``metrics_listen`` setting (off by
default). No torch.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import socketserver
import threading
from datetime import datetime
from http.server import HTTPServer
from typing import Any, Callable, Iterable

from tuner.errors import TunerError

log = logging.getLogger(__name__)

#: Histogram buckets of job durations, seconds.
DURATION_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600)
JOB_STATES = ("pending", "running", "done", "failed", "cancelled")


class MetricsError(TunerError):
    """The metrics endpoint cannot be parsed or opened (``where`` = the listen address)."""


def parse_listen(text: str) -> tuple[str, Any]:
    """``HOST:PORT`` (a loopback address: 127.0.0.0/8, ::1, localhost) → ``("tcp", (host, port))``;
    ``unix:/PATH`` → ``("unix", path)``.

    Raises:
        ValueError: anything else (a non-loopback host included: metrics stay on this machine).
    """
    if text.startswith("unix:"):
        path = text[5:]
        if not path.startswith("/"):
            raise ValueError(f"a Unix socket path must be absolute, not {path!r}")
        return "unix", path
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"must be HOST:PORT (loopback) or unix:/PATH, not {text!r}")
    host = host.strip("[]")
    if host != "localhost":
        try:
            if not ipaddress.ip_address(host).is_loopback:
                raise ValueError(f"{host} is not a loopback address (metrics are served on this machine only)")
        except ValueError as exc:
            raise ValueError(str(exc) if "loopback" in str(exc) else f"not an IP address: {host!r}") from None
    return "tcp", (host, int(port))


def _seconds(start: Any, end: Any) -> float | None:
    try:
        a = datetime.fromisoformat(str(start).replace("Z", "+00:00"))
        b = datetime.fromisoformat(str(end).replace("Z", "+00:00"))
    except ValueError:
        return None
    return max(0.0, (b - a).total_seconds())


def _bounds(conn, mine: str, arg: dict) -> list:
    """(drop_name, gpu_memory_utilization, risk, max_model_len_safe, max_model_len_expected) of the
    latest proposals; [] on a view without the interval columns (a store before revision 0014)."""
    import sqlalchemy as sa

    cols = {c["name"] for c in sa.inspect(conn).get_columns("latest_proposals")}
    if "max_model_len_safe" not in cols:
        return []
    return conn.execute(sa.text("SELECT drop_name, gpu_memory_utilization, risk, max_model_len_safe, "
                                f"max_model_len_expected FROM latest_proposals WHERE {mine}"), arg).all()


class StoreCollector:
    """A ``prometheus_client`` collector whose families are queried from the store per scrape.
    ``connect`` returns a SQLAlchemy connection context (``store.engine.connect``). ``owner``
    (fleet, revision 0007) gives this daemon's ``hosts.id``: jobs and proposals are then this
    daemon's only (several daemons on one database each report their own; None: the whole store)."""

    def __init__(self, connect: Callable[[], Any], owner: Callable[[], int | None] | None = None) -> None:
        self._connect = connect
        self._owner = owner

    def describe(self) -> Iterable:
        return []

    def collect(self) -> Iterable:
        import sqlalchemy as sa
        from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

        up = GaugeMetricFamily("ctx_tuner_up", "1 while the ctx-tuner daemon serves metrics")
        up.add_metric([], 1)
        yield up
        store_up = GaugeMetricFamily("ctx_tuner_store_up", "1 when the results store answered this scrape")
        try:
            owner = self._owner() if self._owner is not None else None
            mine, arg = ("owner_id = :o", {"o": owner}) if owner is not None else ("1 = 1", {})
            with self._connect() as conn:
                states = dict(conn.execute(sa.text(f"SELECT status, COUNT(*) FROM jobs WHERE {mine} GROUP BY status"),
                                           arg).all())
                times = conn.execute(sa.text("SELECT started_at, finished_at FROM jobs WHERE status IN "
                                             "('done', 'failed') AND started_at IS NOT NULL AND finished_at IS NOT "
                                             f"NULL AND {mine}"), arg).all()
                props = conn.execute(sa.text("SELECT drop_name, gpu_memory_utilization, max_model_len, "
                                             f"kv_cache_tokens, num_gpu_blocks FROM latest_proposals WHERE {mine}"),
                                     arg).all()
                bounds = _bounds(conn, mine, arg)
                from tuner.daemon.failures import failed_drops

                failed = failed_drops(conn, owner)
                resid = conn.execute(sa.text(
                    "SELECT m.model, m.device_name, m.method, v.measured_available_kv_cache_bytes, "
                    "v.simulated_available_kv_cache_bytes FROM measured_vs_simulated v JOIN profile_runs m "
                    "ON m.id = v.measured_run_id ORDER BY v.measured_run_id")).all()
        except Exception as exc:  # a scrape never kills the daemon; the gauge says the store failed
            log.warning("metrics: store query failed: %s", exc)
            store_up.add_metric([], 0)
            yield store_up
            return
        store_up.add_metric([], 1)
        yield store_up
        jobs = GaugeMetricFamily("ctx_tuner_jobs", "Jobs in the store by state", labels=["state"])
        for st in JOB_STATES + tuple(sorted(set(states) - set(JOB_STATES))):
            jobs.add_metric([st], int(states.get(st, 0)))
        yield jobs
        durations = [d for d in (_seconds(a, b) for a, b in times) if d is not None]
        counts, acc = [], 0
        for le in DURATION_BUCKETS:
            acc = sum(1 for d in durations if d <= le)
            counts.append((str(float(le)), acc))
        counts.append(("+Inf", len(durations)))
        hist = HistogramMetricFamily("ctx_tuner_job_duration_seconds", "Wall time of finished jobs (started to "
                                     "finished)", buckets=counts, sum_value=sum(durations))
        yield hist
        fams = [GaugeMetricFamily(f"ctx_tuner_proposal_{k}", help_, labels=["drop", "gpu_memory_utilization"])
                for k, help_ in (("max_model_len", "Latest proposed max_model_len per drop (0: nothing starts)"),
                                 ("kv_cache_tokens", "KV cache tokens of the latest proposal"),
                                 ("num_gpu_blocks", "KV cache blocks of the latest proposal"))]
        for name, u, *values in props:  # max_model_len, kv_cache_tokens, num_gpu_blocks: the families' order
            labels = [str(name), f"{u:g}"]
            for fam, value in zip(fams, values):
                fam.add_metric(labels, int(value or 0))
        yield from fams
        bound = GaugeMetricFamily("ctx_tuner_proposal_max_model_len_bound", "Latest proposal's largest max_model_len "
                                  "that starts at the interval's safe end (bound=safe) or the expected value "
                                  "(bound=expected); 0: nothing starts there",
                                  labels=["drop", "gpu_memory_utilization", "bound"])
        for name, u, risk, safe, expected in bounds:
            if risk is None:  # stored before the interval (revision 0010): no bounds to report
                continue
            for label, value in (("safe", safe), ("expected", expected)):
                bound.add_metric([str(name), f"{u:g}", label], int(value or 0))
        yield bound
        bad = GaugeMetricFamily("ctx_tuner_drop_failed", "1 per failed drop (kind: drop = invalid input, run = given "
                                "up after its attempts); reasons: ctx-tuner status --failed",
                                labels=["drop", "kind", "error_type"])
        for f in failed:
            bad.add_metric([f.name, f.kind, f.error_type], 1)
        yield bad
        res = GaugeMetricFamily("ctx_tuner_kv_residual_bytes", "Measured minus predicted available KV cache bytes "
                                "(newest measured/imported run per model, device kind and method)",
                                labels=["model", "device", "method"])
        newest: dict[tuple, int] = {}
        for model, device, method, measured, simulated in resid:
            if measured is not None and simulated is not None:
                newest[(str(model), str(device), str(method))] = int(measured) - int(simulated)
        for labels, v in newest.items():
            res.add_metric(list(labels), v)
        yield res


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def get_request(self):  # BaseHTTPRequestHandler wants a (host, port) client address
        conn, _ = super().get_request()
        return conn, ("unix", 0)


class _TCPServer(socketserver.ThreadingMixIn, HTTPServer):
    daemon_threads = True


class MetricsServer:
    """The endpoint: ``start()`` binds and serves in a daemon thread, ``stop()`` closes it (and
    removes a Unix socket it created). ``address`` is the bound ``(host, port)`` or socket path."""

    def __init__(self, listen: str, connect: Callable[[], Any], owner: Callable[[], int | None] | None = None) -> None:
        self.kind, self.target = parse_listen(listen)
        self.listen = listen
        self._connect = connect
        self._owner = owner
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.address: Any = None

    def start(self) -> None:
        from prometheus_client import CollectorRegistry
        from prometheus_client.exposition import MetricsHandler

        registry = CollectorRegistry(auto_describe=False)
        registry.register(StoreCollector(self._connect, self._owner))
        handler = MetricsHandler.factory(registry)
        try:
            if self.kind == "unix":
                path = self.target
                if os.path.exists(path) and _is_socket(path):
                    os.unlink(path)  # left by a daemon that was killed
                self._server = _UnixHTTPServer(path, handler)
                os.chmod(path, 0o666)
                self.address = path
            else:
                host, port = self.target
                _TCPServer.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
                self._server = _TCPServer((host, port), handler)
                self.address = self._server.server_address[:2]
        except OSError as exc:
            raise MetricsError(f"cannot serve metrics: {exc.strerror or exc}", where=self.listen) from None
        self._thread = threading.Thread(target=self._server.serve_forever, name="ctx-tuner-metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.kind == "unix" and os.path.exists(self.target):
            os.unlink(self.target)
        self._server = None


def _is_socket(path: str) -> bool:
    import stat

    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


def scrape(listen: str, *, timeout_s: float = 5.0) -> str:
    """GET ``/metrics`` from a ``metrics_listen`` address (TCP or Unix socket); the text.

    Raises:
        MetricsError: nothing answers, or not HTTP 200.
    """
    import http.client

    kind, target = parse_listen(listen)
    try:
        if kind == "unix":
            conn = http.client.HTTPConnection("localhost", timeout=timeout_s)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout_s)
            sock.connect(target)
            conn.sock = sock
        else:
            conn = http.client.HTTPConnection(target[0], target[1], timeout=timeout_s)
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        body = resp.read().decode("utf-8", "replace")
        conn.close()
    except OSError as exc:
        raise MetricsError(f"no metrics endpoint answers: {exc.strerror or exc}", where=listen) from None
    if resp.status != 200:
        raise MetricsError(f"metrics endpoint answered HTTP {resp.status}", where=listen)
    return body
