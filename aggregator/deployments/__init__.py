"""Deployments: a model version rolled out to the fleet through a canary cohort and widening
stages, judged on the devices' own held-out data, promoted or rolled back (issue 29).

``machine`` is the sans-IO state machine (its transition table is its docstring), ``guard`` the
rule on the metrics devices report, ``cohort`` who is in which stage, ``controller`` the I/O
(retained assignments, head fetches, reports) beside the aggregator service.
"""
