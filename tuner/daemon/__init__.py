"""The daemon: its service loop (``service``), the watched drop directory (``watch``), settings
(``settings``), notifications (``notify``), Prometheus metrics (``metrics``) and failed drops
(``failures``).

May import :mod:`tuner.reports`, :mod:`tuner.jobs` and below. Its modules never import torch or
vLLM (the daemon's main process stays lean; the worker does the work).
"""
