"""Where the tests find things: the repo root and the shared cases/models directory
(``$CTX_TUNER_SHARED`` if set, else ``<repo>/../shared``). Tests that read it skip when it is absent."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("CTX_TUNER_SHARED") or REPO.parent / "shared")
