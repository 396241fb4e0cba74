"""A job whose task no device would take is refused before it is stored, built or published.

Devices take no message larger than their inbox holds of one topic (``protocols/device_inbox.py``,
128 MiB, the Python and the Java agent alike). A job's config says how large its task will be: the
classifier head every FedAvg-family task carries (``C x d`` float32 and the bias), Scaffold's
server control beside it, a centred Fed3R round's feature center (``JobConfig.task_tensors``, each
kind's declaration). Before this check a Scaffold config of 20,000 classes of 1,280 features was
accepted (its head is within ``MAX_HEAD_ENTRIES``), started, and declined by every device it
asked: its task, the head and its control, is 195 MiB (a review's finding). A FedAvg head at
``MAX_HEAD_ENTRIES`` is 128 MiB alone: its header no longer fits. Now the admin API answers 422 with the size and
the bound, the admin command prints that line, ``aggregator serve`` stops before the broker, and a
stored job that breaks the rule is stopped at its start with the same reason.
"""

from __future__ import annotations

from protocols.device_inbox import check_fits_device_inbox

from aggregator.jobs.base import JobConfig


def check_task_fits(kind: str, config: JobConfig) -> None:
    """``ValueError`` naming the size and the bound when the job's largest task may be larger than
    a device takes in one message."""
    check_fits_device_inbox(f"a {kind} job's task", config.task_tensors(), config.task_size_remedy())
