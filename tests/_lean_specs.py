"""Subprocess helper for tests/test_transformers_lean.py (not a test module).

    python tests/_lean_specs.py plain|lean specs OUT.json CONFIG.json ...
    python tests/_lean_specs.py plain|lean structure OUT.json

``plain`` imports transformers the ordinary way first (its full models scan: the path before),
``lean`` leaves it to :func:`tuner.model.transformers_lean.import_transformers`. ``specs`` writes, per
config and with / without the plugin's defaults, the whole :class:`~tuner.model.modelspec.ModelSpec`
(``raw`` and ``top`` included) and the config class, or the error; ``structure`` forces the
deferred scan and writes the lazy modules' import tables.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def specs(paths: list[str]) -> dict:
    from tuner.model import transformers_lean
    from tuner.model.modelspec import load_model_spec, read_architectures, read_top, without_nulls
    from tuner.model.plugin import load_registry

    registry = load_registry()
    out = {}
    for p in paths:
        for with_defaults in (False, True):
            key = f"{p}|{'defaults' if with_defaults else 'file'}"
            try:
                defaults = None
                if with_defaults:
                    plugin, _ = registry.for_architectures(read_architectures(p))
                    defaults = plugin.config_defaults(without_nulls(read_top(p)))
                spec, hf = load_model_spec(p, defaults=defaults)
                out[key] = {"spec": dataclasses.asdict(spec), "config_class": type(hf).__name__}
            except Exception as exc:
                out[key] = {"error": f"{type(exc).__name__}: {exc}"}
    out["_state"] = {"installed": transformers_lean.STATE["installed"],
                     "completed": list(transformers_lean.STATE["completed"]),
                     "deferred": transformers_lean.scan_deferred()}
    return out


def structure() -> dict:
    import importlib

    from tuner.model import transformers_lean

    top = transformers_lean.import_transformers()
    models = importlib.import_module("transformers.models")
    top.LlamaConfig  # noqa: B018  (a model name: completes the deferred scan where there is one)
    hasattr(models, "NotAModelName")  # an unknown name: completes transformers.models too
    out = {"completed": list(transformers_lean.STATE["completed"])}
    for m in (top, models):
        out[m.__name__] = {
            "class_to_module": m._class_to_module,
            "modules": sorted(m._modules),
            "missing_backends": {k: sorted(map(str, v)) for k, v in m._object_missing_backend.items()},
            "import_structure": {k: sorted(v) for k, v in m._import_structure.items()},
            "all": sorted(m.__all__),
        }
    return out


def main() -> int:
    how, what, out = sys.argv[1], sys.argv[2], sys.argv[3]
    if how == "plain":
        import transformers  # noqa: F401  (the ordinary import, with the models scan)
    result = specs(sys.argv[4:]) if what == "specs" else structure()
    Path(out).write_text(json.dumps(result, sort_keys=True, default=repr))
    return 0


if __name__ == "__main__":
    sys.exit(main())
