"""The store: the schema and its database (``database``, ``litestore``, ``storerules``), records
read and written (``records``), the job queue and the fleet of daemons (``jobqueue``, ``fleet``)
and the world-readable snapshot (``snapshot``).

May import the layers below it (:mod:`tuner.model`, :mod:`tuner.question`, :mod:`tuner.memory`,
...). Never torch or vLLM.
"""
