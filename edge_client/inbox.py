"""What a device takes from its inbox: the aggregator's messages, whole (the Java device's
``InboxReader``). With the aggregator's key (``verifier``) only what it signed; without it (a
development broker) anything it is sent, but chunks are held only when they claim the aggregator
as their sender: anyone else's are refused unheld, where they took the aggregator's partial-message
slots and bytes until their time-to-live (a differential review of the two devices' decisions)."""

from __future__ import annotations

from protocols.chunking import MessageAssembler
from protocols.topics import AGGREGATOR_ID


def aggregator_inbox(verifier=None, **limits) -> MessageAssembler:
    """The device's assembler for its aggregator's messages; ``limits``: MessageAssembler's."""
    return MessageAssembler(verifier=verifier, may_chunk=lambda sender: sender == AGGREGATOR_ID, **limits)
