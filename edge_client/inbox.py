"""What a device takes from its inbox: the aggregator's messages, whole (the Java device's
``InboxReader``). With the aggregator's key (``verifier``) only what it signed; without it (a
development broker) anything it is sent, but chunks are held only when they claim the aggregator
as their sender: anyone else's are refused unheld, where they took the aggregator's partial-message
slots and bytes until their time-to-live (a differential review of the two devices' decisions).

How much it holds is the devices' one rule, the Java agent's too (``MqttAgent.reader``), declared
once in ``protocols/device_inbox.py``: no message, and no sender's partial messages together,
larger than what the agent's inbox queue holds of one topic (``DEVICE_INBOX_BOUND``'s 128 MiB). A
review found one sender's chunks could pin 512 MiB of the Python device (256 MiB of the Java one)
while its queue held 128. The largest message an agent is legitimately sent is a task, and the
aggregator refuses a job whose task would be larger than the bound when it is created
(``aggregator/jobs/task_size.py``): a LADD training task at the segmentation spec's largest network
carries 3 float32 vectors of 9,331,569 values, 107 MiB with its header. A bundle file (up to the
aggregator's 256 MiB) is not: the fetch takes it on its own connection, through its own
assembler sized to that file (``edge_client/artifacts.py``)."""

from __future__ import annotations

from protocols.chunking import MessageAssembler
from protocols.device_inbox import DEVICE_INBOX_BOUND
from protocols.topics import AGGREGATOR_ID


def aggregator_inbox(verifier=None, **limits) -> MessageAssembler:
    """The device's assembler for its aggregator's messages; ``limits``: MessageAssembler's, by
    default the agent's (the module's rule)."""
    if not limits:
        limits = {"max_message_bytes": DEVICE_INBOX_BOUND.source_bytes,
                  "max_pending_bytes_per_sender": DEVICE_INBOX_BOUND.source_bytes}
    return MessageAssembler(verifier=verifier, may_chunk=lambda sender: sender == AGGREGATOR_ID, **limits)
