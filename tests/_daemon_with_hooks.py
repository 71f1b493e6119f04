"""``python tests/_daemon_with_hooks.py daemon --settings FILE``: ``ctx-tuner`` with test hooks set
from the environment, for real-process tests that aim a kill -9 at a precise moment.

``HOOK_KILL_AFTER_COMMIT=1``: the daemon SIGKILLs itself right after a job's results are
committed and before its proposal file is written (the commit window of issue 15, item 1).
"""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tuner.daemon.service  # noqa: E402

if os.environ.get("HOOK_KILL_AFTER_COMMIT"):
    def _die(job, drop_id):
        os.kill(os.getpid(), signal.SIGKILL)

    tuner.daemon.service._AFTER_COMMIT_HOOK = _die

from tuner.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
