"""Failed drops, read-only: what ``ctx-tuner status --failed`` lists, what the daemon writes as
``proposals/failed/NAME.yaml`` beside the proposal files, and the labels of the
``ctx_tuner_drop_failed`` metric. A failed drop is the current job (newest per path, not retired;
:meth:`tuner.store.jobqueue.JobQueue.current`) whose status is ``failed``: nothing here re-queues it
(``ctx-tuner retry`` does). No torch.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

#: Sub-directory of the proposals directory holding one file per failed drop.
FAILED_DIR = "failed"


@dataclass(frozen=True)
class FailedDrop:
    """One failed drop: its name (the drop's ``name``, or the file name without ``.yaml`` where the
    file never parsed), the drop file, the job, ``kind`` (``drop``: invalid input, final until the
    file changes; ``run``: the run failed after its attempts), the error type and its full text."""

    name: str
    path: str
    job_id: int
    kind: str
    error_type: str
    reason: str
    attempts: int
    finished_at: str | None
    host: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def first_line(self) -> str:
        """The reason on one line (YAML errors span several)."""
        return " ".join(self.reason.split())


def short(text: str, limit: int = 200) -> str:
    """``text`` on one line, cut at a word boundary with ``…`` when longer than ``limit``
    characters (never mid-word: "…compressed (ratio )" lost the ratio)."""
    text = " ".join((text or "").split())
    if len(text) <= limit:
        return text
    cut = text[: limit - 1]
    space = cut.rfind(" ")
    if space > limit // 2:
        cut = cut[:space]
    return cut.rstrip(" ,;:(") + " …"


def failed_drops(conn: Any, owner_id: int | None = None) -> list[FailedDrop]:
    """The failed drops in the store behind ``conn`` (a SQLAlchemy connection), oldest job first:
    this owner's (``hosts.id``) or, with None, every owner's."""
    from tuner.store.database import hosts_table as H
    from tuner.store.database import jobs_table as J

    names = set(sa.inspect(conn).get_table_names())
    cond = [J.c.retired_at.is_(None)]
    if owner_id is not None:
        cond.append(J.c.owner_id == owner_id)
    group = (J.c.owner_id, J.c.path) if "owner_id" in J.c else (J.c.path,)
    newest = sa.select(sa.func.max(J.c.id)).where(*cond).group_by(*group)
    cols = [J.c.id, J.c.path, J.c.name, J.c.failure_kind, J.c.error_type, J.c.error, J.c.attempts, J.c.finished_at]
    stmt = sa.select(*cols).where(J.c.id.in_(newest), J.c.status == "failed").order_by(J.c.id)
    if "hosts" in names:
        stmt = sa.select(*cols, H.c.host_id).select_from(J.outerjoin(H, H.c.id == J.c.owner_id)) \
            .where(J.c.id.in_(newest), J.c.status == "failed").order_by(J.c.id)
    out = []
    for r in conn.execute(stmt).mappings():
        out.append(FailedDrop(name=r["name"] or Path(r["path"]).stem, path=r["path"], job_id=int(r["id"]),
                              kind=r["failure_kind"] or "drop", error_type=r["error_type"] or "error",
                              reason=r["error"] or "", attempts=int(r["attempts"] or 0),
                              finished_at=r["finished_at"], host=r.get("host_id")))
    return out


def failure_document(f: FailedDrop) -> dict[str, Any]:
    """The content of ``failed/NAME.yaml``: what failed and how to run it again."""
    what = ("invalid input: fails again until the drop file (or what it points at) changes"
            if f.kind == "drop" else f"the run failed {f.attempts} time(s) and was given up")
    return {"drop": f.name, "file": f.path, "status": "failed", "kind": f.kind, "meaning": what,
            "error_type": f.error_type, "reason": f.reason, "job": f.job_id, "attempts": f.attempts,
            "finished_at": f.finished_at, "run_again": f"ctx-tuner retry {f.name}"}


def failure_path(directory: str | os.PathLike, name: str) -> Path:
    """``directory/failed/NAME.yaml`` (``directory``: the proposals directory)."""
    return Path(directory) / FAILED_DIR / f"{name}.yaml"


def sync_failure_files(directory: str | os.PathLike, failures: list[FailedDrop]) -> tuple[list[Path], list[Path]]:
    """Make ``directory/failed/`` hold exactly one ``NAME.yaml`` per failed drop: write those whose
    text changed (atomically), remove the others. Returns ``(written, removed)``."""
    import yaml

    from tuner.reports.proposals import _atomic_write

    d = Path(directory) / FAILED_DIR
    written, removed, keep = [], [], set()
    if failures:
        d.mkdir(parents=True, exist_ok=True)
    for f in failures:
        dest = failure_path(directory, f.name)
        keep.add(dest.name)
        text = ("# ctx-tuner: this drop failed (written by the daemon; removed once it succeeds or is deleted)\n"
                + yaml.safe_dump(failure_document(f), sort_keys=False, allow_unicode=True, width=100))
        try:
            if dest.read_text(encoding="utf-8") == text:
                continue
        except OSError:
            pass
        _atomic_write(dest, text)
        written.append(dest)
    if d.is_dir():
        for e in os.scandir(d):
            if e.name.endswith(".yaml") and e.name not in keep and e.is_file(follow_symlinks=False):
                os.unlink(e.path)
                removed.append(Path(e.path))
    return written, removed


def failures_text(failures: list[FailedDrop], *, limit: int = 200) -> list[str]:
    """One line per failed drop: ``NAME (FILE): KIND failure, ERROR_TYPE: reason``."""
    lines = []
    for f in failures:
        kind = "invalid input" if f.kind == "drop" else f"run failed after {f.attempts} attempt(s)"
        host = f" on {f.host}" if f.host else ""
        lines.append(f"{f.name} ({f.path}{host}): {kind}, {f.error_type}: {short(f.reason, limit)}")
    return lines
