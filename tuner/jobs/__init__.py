"""One job from drop to answer: its passes and stages (``job``, run inside the worker), the pass
memo (``passmemo``), answers served from the memo without a worker (``memoanswer``), calibration
from measured start-ups (``calibrate``) and the composition root that wires a job to the store,
the memo and a worker (``app``).

May import every layer below it (store, engine, measure, seam, model, logs, question, memory,
releases).
"""
