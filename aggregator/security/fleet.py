"""Who the aggregator knows: enrolled, revoked and online devices, and their signing keys.

The fleet mode is a setting the operator changes on purpose (admin API, ``fedfleet admin fleet
mode``), stored so it outlives the process, never a side effect of enrolling a device:

* ``enrolled``: only enrolled devices are given tasks and have their results accepted;
* ``open`` (development): any device may contribute — logged loudly at start.

With no stored setting the mode is ``enrolled`` when there is an allow-list or an enrolled device,
else ``open``; that choice is then stored. Revocation takes effect at once here (the broker refuses
the device after its next reload). The service owns one :class:`Fleet` and is its only writer.
"""

from __future__ import annotations

import logging
import time

from protocols.envelope import EnvelopeError
from protocols.identity import IdentityRegistry, InvalidSignature, UnknownDevice

from aggregator.security.broker import BrokerSecurity
from aggregator.security.enrollment import DeviceCredentials, Enrollment
from aggregator.storage.store import Store, StoreError

log = logging.getLogger("fedfleet.aggregator")
# ids that may not contribute (enrolled mode) but were heard from: the latest this many are kept
# to show the operator; an open broker let one client invent ~160 a second, each kept for ever
MAX_STRANGERS = 1000


def verify_enrolled(registry: IdentityRegistry, sender: str, signed: bytes, signature: bytes) -> None:
    """A message's signature checked against its sender's enrolled key (the verifier of an envelope
    decode, here and on the shards): refused with the reason, as a malformed message is."""
    try:
        registry.verify(sender, signed, signature)
    except (InvalidSignature, UnknownDevice) as exc:
        raise EnvelopeError(f"signature rejected for {sender!r}: {exc}") from None


class Fleet:
    def __init__(self, store: Store | None, security: BrokerSecurity | None, enrolled: set[str] | None,
                 require_signatures: bool, aggregator_public_key: bytes | None = None):
        self.store = store
        self.enrollment = Enrollment(store, security, aggregator_public_key) if store is not None else None
        self.online: set[str] = set()
        self.seen: set[str] = set()
        self.last_seen: dict[str, float] = {}
        self.revoked: set[str] = set()
        self.offline_since: dict[str, float] = {}
        self._strangers: dict[str, None] = {}      # heard from, may not contribute: oldest first
        self.enrolled, self.registry = enrolled, (IdentityRegistry() if require_signatures else None)
        self.mode = "open" if enrolled is None else "enrolled"
        if store is not None:
            self._load(enrolled, require_signatures)
            store.mark_all_offline()
            self.enrollment.sync_broker_if_stale()       # its failure is logged; the broker keeps its files
        if self.mode == "open":
            log.warning("fleet mode OPEN: any device that connects may contribute (development only; "
                        "`fedfleet admin fleet mode enrolled` restricts the fleet to enrolled devices)")

    def _load(self, enrolled: set[str] | None, require_signatures: bool) -> None:
        keys = self.store.enrolled_keys()
        for device in sorted(set(enrolled or ()) - set(keys)):    # a plain allow-list joins the store
            self.store.enroll_device(device, None, None)
        keys = self.store.enrolled_keys()
        self.revoked = {d["device_id"] for d in self.store.devices() if d["status"] == "revoked"}
        self.enrolled = set(keys)
        self.mode = self.store.setting("fleet_mode") or ("enrolled" if keys or enrolled is not None else "open")
        self.store.set_setting("fleet_mode", self.mode)
        self.registry = self.enrollment.registry() if require_signatures else None

    def set_mode(self, mode: str) -> None:
        if mode not in ("open", "enrolled"):
            raise ValueError(f"fleet mode must be 'open' or 'enrolled', not {mode!r}")
        if self.store is not None:
            self.store.set_setting("fleet_mode", mode)
        self.mode = mode
        log.warning("fleet mode set to %s", mode.upper())

    def allowed(self, device: str) -> bool:
        return device not in self.revoked and self.may_contribute(device)

    def may_contribute(self, device: str) -> bool:
        """Enrolled (or the fleet is open) — what an outbox message's sender must be."""
        return self.mode == "open" or device in (self.enrolled or ())

    def admitted(self) -> set[str] | None:
        """Who may contribute: the enrolled devices, or None while the fleet is open."""
        return None if self.mode == "open" else set(self.enrolled or ())

    def online_not_enrolled(self) -> set[str]:
        """Online devices whose results would be refused as not enrolled (none in open mode)."""
        return set() if self.mode == "open" else self.online - (self.enrolled or set())

    def eligible_online(self) -> set[str]:
        """Online devices whose results would be accepted: the only ones given tasks."""
        return {d for d in self.online if self.allowed(d)}

    def verify(self, sender: str, signed: bytes, signature: bytes) -> None:
        verify_enrolled(self.registry, sender, signed, signature)

    def enrolled_keys(self) -> dict[str, bytes]:
        """device -> its enrolled public key (signatures required; else none)."""
        return {d: self.registry.public_key(d) for d in self.registry} if self.registry is not None else {}

    def heard_from(self, device: str) -> None:
        self.last_seen[device] = time.time()
        self._keep_if_stranger(device)

    def _keep_if_stranger(self, device: str) -> None:
        """A device that may not contribute joins the strangers; beyond MAX_STRANGERS the one
        heard from least lately is forgotten (it is no one's participant, only an operator's line)."""
        if self.may_contribute(device):
            return
        self._strangers.pop(device, None)
        self._strangers[device] = None
        while len(self._strangers) > MAX_STRANGERS:
            old = next(iter(self._strangers))
            del self._strangers[old]
            self.online.discard(old)
            self.seen.discard(old)
            self.last_seen.pop(old, None)
            self.offline_since.pop(old, None)

    def presence(self, device: str, online: bool, info: dict | None) -> None:
        self._keep_if_stranger(device)
        if self.store is not None:
            self.store.device_seen(device, online, info if online else None)
        if online:
            self.online.add(device)
            self.seen.add(device)
            self.offline_since.pop(device, None)
        else:
            self.online.discard(device)
            self.offline_since.setdefault(device, time.time())

    def reachable(self, grace_s: float, now: float | None = None) -> set[str]:
        """Devices a job may still wait for: online, or offline for less than ``grace_s``; never revoked.
        A device gone for longer (or revoked) no longer keeps a job from finishing."""
        now = time.time() if now is None else now
        back_soon = {d for d, since in self.offline_since.items() if now - since < grace_s}
        return {d for d in (self.online | back_soon) & self.seen if self.allowed(d)}

    def why_missing(self, device: str, grace_s: float) -> str:
        """Why a device the aggregator heard from is not contributing (for the job's summary)."""
        if device in self.revoked:
            return "revoked"
        if device in self.online:
            return "online"
        since = self.offline_since.get(device)
        return f"offline for {time.time() - since:.0f} s" if since is not None else "never online"

    def enroll(self, device_id: str, public_key: bytes | None = None) -> DeviceCredentials:
        if self.enrollment is None:
            raise StoreError("enrolment needs a store")
        creds = self.enrollment.enroll(device_id, public_key)
        self._strangers.pop(device_id, None)
        self.revoked.discard(device_id)
        self.enrolled = (self.enrolled or set()) | {device_id}       # the mode stays what it was
        if self.registry is not None:
            self.registry.revoke(device_id)
            self.registry.enroll(device_id, bytes.fromhex(creds.public_key))
        return creds

    def revoke(self, device_id: str) -> str | None:
        """Refused here at once; a warning when the broker has not taken it yet (it may still connect)."""
        if self.enrollment is None:
            raise StoreError("revocation needs a store")
        warning = self.enrollment.revoke(device_id)
        self.revoked.add(device_id)
        if self.enrolled is not None:
            self.enrolled.discard(device_id)
        if self.registry is not None:
            self.registry.revoke(device_id)
        self.online.discard(device_id)
        self.offline_since.setdefault(device_id, time.time())
        return warning
