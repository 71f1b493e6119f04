"""vLLM's start-up logs read back: the log grammar by release (``logparse``) and the release a log
proves (``release_infer``).

May import :mod:`tuner.memory`, :mod:`tuner.releases`, :mod:`tuner.errors`. No torch, no vLLM.
"""
