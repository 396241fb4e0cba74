"""The devices' one rule on what they take from their inbox, and the largest message it lets a
sender publish to them.

A device's agent queues what arrives on its topics while it works, and holds no message, and no
sender's partial messages together, larger than what that queue holds of one topic
(``DEVICE_INBOX_BOUND``'s 128 MiB): the Python agent (``edge_client/inbox.py``) and the Java one
(``MqttAgent.Options``: ``maxQueuedTopicBytes``, ``maxQueuedBytes``, ``maxMessageBytes``; held to
this constant by ``tests/test_java_inbox_bound.py``) by the same numbers. A larger message is
refused by every device, so the aggregator refuses, when a job is created, a job whose task would
be one (``aggregator/jobs/task_size.py``): before, such a job was stored, started, and then
declined by every device it asked (a review's finding: a Scaffold task of 20,000 classes of 1,280
features, its head and its control variate, is 195 MiB).

What a task weighs is counted as the reassembled envelope (``protocols/envelope.py``), what the
device's assembler bounds: the 8-byte prefix, the header, and each tensor's raw bytes. Chunking
adds nothing to that count (each chunk is reassembled into those bytes; the chunks' own envelopes
are transport), and there is no text encoding of the tensors (no base64). The header is counted at
its limit, ``MAX_HEADER_BYTES``: it holds the task's params and signature, at most 64 KiB, so the
count is the message's size to within that and never below it.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

from protocols.envelope import MAX_HEADER_BYTES, PREFIX_LEN, WIRE_DTYPES
from protocols.message_loop import QueueBound

MIB = 2 ** 20

# What a device's topics may hold unread while it works, per topic (one sender) and in all:
# several times the largest task a job sends, never the flood anyone can publish to an open inbox
# (protocols/message_loop.py); the per-topic bytes are also the largest message a device takes
DEVICE_INBOX_BOUND = QueueBound(128 * MIB, 160 * MIB)
LARGEST_DEVICE_MESSAGE_BYTES = DEVICE_INBOX_BOUND.source_bytes

# a tensor as a task declares it before it exists: its wire dtype name and its shape
TensorShape = tuple[str, Sequence[int]]


def tensor_bytes(dtype: str, shape: Sequence[int]) -> int:
    """The raw bytes of one tensor on the wire (``WIRE_DTYPES``' item size times its values)."""
    return WIRE_DTYPES[dtype].itemsize * math.prod(shape)


def shapes_of(tensors: Mapping[str, np.ndarray]) -> dict[str, TensorShape]:
    """The declaration of tensors that exist (what a built job's task carries)."""
    return {name: (np.asarray(t).dtype.name, np.shape(t)) for name, t in tensors.items()}


def message_bytes_at_most(tensors: Mapping[str, TensorShape]) -> int:
    """The most an envelope carrying ``tensors`` weighs reassembled: its prefix, a header at its
    limit, and the tensors' raw bytes (exact, but for the header's unused room)."""
    return PREFIX_LEN + MAX_HEADER_BYTES + sum(tensor_bytes(dtype, shape) for dtype, shape in tensors.values())


def check_fits_device_inbox(what: str, tensors: Mapping[str, TensorShape], remedy: str = "") -> None:
    """``ValueError`` naming the size and the bound when a message carrying ``tensors`` may be
    larger than a device takes (``remedy``: what makes it smaller, said with it)."""
    size = message_bytes_at_most(tensors)
    if size > LARGEST_DEVICE_MESSAGE_BYTES:
        largest = max(tensors, key=lambda name: tensor_bytes(*tensors[name]))
        raise ValueError(
            f"{what} would be up to {size:,} bytes on the wire, more than the {LARGEST_DEVICE_MESSAGE_BYTES:,} "
            f"bytes ({LARGEST_DEVICE_MESSAGE_BYTES // MIB} MiB) a device takes in one message, so every device "
            f"would decline it (its largest tensor, {largest!r}, is {tensor_bytes(*tensors[largest]):,} bytes)"
            + (f": {remedy}" if remedy else ""))
