"""Worker subprocess entry point: ``python -m tuner.worker_main`` (imports torch).

Reads one JSON request on stdin, runs :func:`tuner.job.run_job` (or, for ``"kind": "validate"``,
:func:`tuner.validate.run_validate_request`), writes
``{"ok": true, "result": …}`` or ``{"ok": false, "error_type": …, "error": …}`` on stdout.
Typed errors are replies; anything else is a crash with a traceback on stderr.
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    request = json.loads(sys.stdin.read())
    from tuner.errors import TunerError

    try:
        if request.get("kind") == "validate":
            from tuner.validate import run_validate_request

            result = run_validate_request(request)
        else:
            from tuner.job import run_job

            result = run_job(request)
    except TunerError as exc:
        json.dump({"ok": False, "error_type": type(exc).__name__, "error": str(exc)}, sys.stdout)
        return 0
    json.dump({"ok": True, "result": result}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
