"""Jobs: what to ask which devices, and what to do with their answers.

A job is pure logic (no MQTT, no clock); ``aggregator.service.loop`` drives any job through the
round protocol. One module per kind of job; each wraps a strategy from ``aggregator.strategies``.
The contract every kind implements, and the config fields every kind shares, are in
``aggregator/jobs/base.py``; ``aggregator/jobs/registry.py`` names every kind once.
"""

from aggregator.jobs.base import AsynchronousJob, Job, JobConfig, SplitValidation

__all__ = ["AsynchronousJob", "Job", "JobConfig", "SplitValidation"]
