"""One module per ``ctx-tuner`` sub-command: each defines ``NAME``, ``add_parser(subparsers)``
and ``run(args) -> int`` (the exit code). :mod:`tuner.cli` lists them in ``COMMANDS``."""
