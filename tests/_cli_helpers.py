"""Run the ``ctx-tuner`` CLI in-process for a test: ``run_cli(*argv) -> (rc, stdout, stderr)``.

argparse usage errors (``SystemExit``) come back as their exit code, like the console script."""

from __future__ import annotations

import contextlib
import io


def run_cli(*argv: str) -> tuple[int, str, str]:
    from tuner.cli import main  # at call time: importing this helper costs nothing

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as exc:
            rc = exc.code
    return rc, out.getvalue(), err.getvalue()
