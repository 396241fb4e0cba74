"""What the device's agent takes from its inbox (edge_client/inbox.py) against the largest message
the aggregator legitimately sends it: no message, and no sender's partial messages together,
larger than what its inbox queue holds of one topic (128 MiB), and the largest task still fits.
The Java agent decides alike (tests/test_java_wire_edges.py)."""

from __future__ import annotations

import pytest

from edge_client.inbox import aggregator_inbox
from protocols.device_inbox import DEVICE_INBOX_BOUND, message_bytes_at_most
from protocols.envelope import MAX_HEADER_BYTES

torch = pytest.importorskip("torch")


def test_the_largest_ladd_task_fits_the_agents_inbox():
    """A LADD training task carries the network three times (model, teacher, KD model: float32
    vectors of its every value); the largest network a segmentation spec allows (output stride
    16, 512 head channels, 8 ASPP rates, 254 classes) has 9,331,569 values."""
    from edge_client.models import segmentation as S
    spec = S.SegmentationSpec(num_classes=254, image_size=16, output_stride=16, head_channels=512,
                              aspp_rates=tuple(range(1, S.MAX_ASPP_RATES + 1)))
    values = sum(v.numel() for v in S.SegmentationModel(spec, pretrained_encoder=False).state_dict().values())
    assert values == 9_331_569           # tests/test_java_wire_edges.py's LARGEST_TASK_BYTES
    largest_task = message_bytes_at_most({name: ("float32", (values,)) for name in ("model", "teacher", "kd")})
    assert largest_task == 3 * 4 * values + MAX_HEADER_BYTES + 8        # the prefix, a header at its limit
    reassembler = aggregator_inbox().reassembler
    assert largest_task <= reassembler.max_message_bytes == DEVICE_INBOX_BOUND.source_bytes
    assert reassembler.max_pending_bytes_per_sender == DEVICE_INBOX_BOUND.source_bytes
