"""What an operator reads: ``explain`` (one point's budget step by step), ``check`` (a `vllm serve`
line or drop answered), ``plot``, ``results`` (stored answers) and the proposal files
(``proposals``).

May import :mod:`tuner.jobs` and everything below it.
"""
