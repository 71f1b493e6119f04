"""The worker process boundary: spawning a worker and speaking the contract to it (``worker``),
the worker's resource guard (``worker_guard``) and the daemon's warm worker (``warmworker``).

May import :mod:`tuner.question`, :mod:`tuner.memory`, :mod:`tuner.releases`, :mod:`tuner.errors`.
Never torch or vLLM: this is the parent's side.
"""
