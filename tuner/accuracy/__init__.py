"""How right the product is on real start-ups: ``validate`` (the shared cases, the interval
coverage), ``importlog`` (a real start-up log stored, then modelled) and ``uncertainty_fit``
(the bands fitted by leave-one-family-out cross-validation).

May import :mod:`tuner.jobs` and everything below it; not :mod:`tuner.reports`.
"""
