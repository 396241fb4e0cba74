"""MQTT topic layout (one place, so the broker ACL and both sides agree).

    {root}/v1/dev/{device}/in        aggregator -> one device (its inbox; only it may subscribe)
    {root}/v1/dev/{device}/out       one device -> aggregator (its outbox; only it may publish)
    {root}/v1/broadcast              aggregator -> every device (job announcements)
    {root}/v1/presence/{device}      retained "online"/"offline"; the offline one is the last will
    {root}/v1/status                 retained aggregator status (job, round, progress) for dashboards
    {root}/v1/jobs/ended             retained: the jobs that ended lately (devices drop their state)
    {root}/v1/deploy/{device}        retained: the model version the device should run (rollout)
    {root}/v1/deploy/{device}/out    device -> aggregator: head fetches and reports of a rollout
    {root}/v1/deploy/{device}/in     aggregator -> device: the head it fetched

The version segment lets a v2 fleet share a broker with v1 devices during a migration. Device
ids are restricted to ``[A-Za-z0-9_.-]`` so they can never inject the MQTT wildcards ``+``/``#``
or an extra level ``/`` into a topic.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEVICE_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# The first level(s) of every fedfleet topic: no MQTT wildcard, no leading "/", no control
# character, at most 128 characters. One rule for every side that takes a root (the device, the
# broker's ACL generator, the aggregator's settings).
TOPIC_ROOT_PATTERN = r"^[^/+#\x00-\x1f][^+#\x00-\x1f]{0,127}$"
TOPIC_ROOT_RE = re.compile(TOPIC_ROOT_PATTERN)
AGGREGATOR_ID = "aggregator"
# A second MQTT connection of one party logs in as ``{account}/{role}`` (BrokerConfig.for_role):
# on a broker that takes the user name as client id, two connections of one account would close
# each other in turn. ``/`` is in no device id, so no device can be named like another's role.
DEPLOY_ROLE, CONTROLLER_ROLE, FETCH_ROLE = "deploy", "deployments", "fetch"


def role_account(account: str, role: str) -> str:
    return f"{account}/{role}"


def check_device_id(device_id: str) -> str:
    if not isinstance(device_id, str) or not DEVICE_ID_RE.fullmatch(device_id) or device_id == AGGREGATOR_ID:
        raise ValueError(f"invalid device id {device_id!r}: use 1-64 of [A-Za-z0-9_.-], not {AGGREGATOR_ID!r}")
    return device_id


@dataclass(frozen=True)
class Topics:
    root: str = "fedfleet"

    def __post_init__(self):
        if not isinstance(self.root, str) or not TOPIC_ROOT_RE.fullmatch(self.root):
            raise ValueError(f"invalid topic root {self.root!r}")

    @property
    def base(self) -> str:
        return f"{self.root}/v1"

    def inbox(self, device_id: str) -> str:
        return f"{self.base}/dev/{check_device_id(device_id)}/in"

    def outbox(self, device_id: str) -> str:
        return f"{self.base}/dev/{check_device_id(device_id)}/out"

    def presence(self, device_id: str) -> str:
        return f"{self.base}/presence/{check_device_id(device_id)}"

    def deploy(self, device_id: str) -> str:
        return f"{self.base}/deploy/{check_device_id(device_id)}"

    def deploy_out(self, device_id: str) -> str:
        return self.deploy(device_id) + "/out"

    def deploy_in(self, device_id: str) -> str:
        return self.deploy(device_id) + "/in"

    @property
    def all_deploy_outs(self) -> str:
        return f"{self.base}/deploy/+/out"

    def deploy_device_of(self, topic: str) -> str | None:
        """The device id in a deploy outbox topic, else None."""
        head, _, rest = topic.partition(f"{self.base}/deploy/")
        parts = rest.split("/")
        if head or len(parts) != 2 or parts[1] != "out" or not DEVICE_ID_RE.fullmatch(parts[0]):
            return None
        return parts[0]

    @property
    def broadcast(self) -> str:
        return f"{self.base}/broadcast"

    @property
    def status(self) -> str:
        return f"{self.base}/status"

    @property
    def job_ends(self) -> str:
        """Retained ``job.ended`` (protocols/payloads/job_end.py): every device reads it."""
        return f"{self.base}/jobs/ended"

    @property
    def all_outboxes(self) -> str:
        return f"{self.base}/dev/+/out"

    @property
    def all_presence(self) -> str:
        return f"{self.base}/presence/+"

    @property
    def uplinks(self) -> tuple[str, ...]:
        """Filters of every topic a device publishes on (a broker bridge carries these towards the
        aggregator's broker, and only these: a device's upload reaches no other device's broker)."""
        return (self.all_outboxes, self.all_presence, self.all_deploy_outs)

    @property
    def downlinks(self) -> tuple[str, ...]:
        """Filters of every topic the aggregator publishes on for devices (bridged the other way)."""
        return (f"{self.base}/dev/+/in", f"{self.base}/deploy/+", f"{self.base}/deploy/+/in", self.broadcast,
                self.status, self.job_ends)

    def device_of(self, topic: str) -> str | None:
        """The device id in an outbox or presence topic, else None."""
        parts = topic.split("/")
        base = self.base.split("/")
        if parts[:len(base)] != base:
            return None
        rest = parts[len(base):]
        if len(rest) == 3 and rest[0] == "dev" and rest[2] in ("in", "out") and DEVICE_ID_RE.fullmatch(rest[1]):
            return rest[1]
        if len(rest) == 2 and rest[0] == "presence" and DEVICE_ID_RE.fullmatch(rest[1]):
            return rest[1]
        return None
