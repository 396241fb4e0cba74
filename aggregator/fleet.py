"""Who the aggregator knows: enrolled, revoked and online devices, and their signing keys.

Open vs enrolled-only: with no enrolment at all (no store rows, no allow-list) every device may
contribute; once any device is enrolled (or an allow-list is given) only enrolled devices may.
Revocation takes effect at once here (the broker refuses the device after its next reload).
The service owns one :class:`Fleet` and is its only writer.
"""

from __future__ import annotations

import time

from protocols.envelope import EnvelopeError
from protocols.identity import IdentityRegistry, InvalidSignature, UnknownDevice

from .broker_security import BrokerSecurity
from .enrollment import DeviceCredentials, Enrollment
from .store import Store, StoreError


class Fleet:
    def __init__(self, store: Store | None, security: BrokerSecurity | None, enrolled: set[str] | None,
                 require_signatures: bool):
        self.store = store
        self.enrollment = Enrollment(store, security) if store is not None else None
        self.online: set[str] = set()
        self.seen: set[str] = set()
        self.last_seen: dict[str, float] = {}
        self.revoked: set[str] = set()
        self.offline_since: dict[str, float] = {}
        self.enrolled, self.registry = enrolled, (IdentityRegistry() if require_signatures else None)
        if store is not None:
            self._load(enrolled, require_signatures)
            store.mark_all_offline()

    def _load(self, enrolled: set[str] | None, require_signatures: bool) -> None:
        keys = self.store.enrolled_keys()
        for device in sorted(set(enrolled or ()) - set(keys)):    # a plain allow-list joins the store
            self.store.enroll_device(device, None, None)
        keys = self.store.enrolled_keys()
        self.revoked = {d["device_id"] for d in self.store.devices() if d["status"] == "revoked"}
        self.enrolled = set(keys) if keys or enrolled is not None else None
        self.registry = self.enrollment.registry() if require_signatures else None

    def allowed(self, device: str) -> bool:
        return device not in self.revoked and (self.enrolled is None or device in self.enrolled)

    def may_contribute(self, device: str) -> bool:
        """Enrolled (or the fleet is open) — what an outbox message's sender must be."""
        return self.enrolled is None or device in self.enrolled

    def verify(self, sender: str, signed: bytes, signature: bytes) -> None:
        try:
            self.registry.verify(sender, signed, signature)
        except (InvalidSignature, UnknownDevice) as exc:
            raise EnvelopeError(f"signature rejected for {sender!r}: {exc}") from None

    def heard_from(self, device: str) -> None:
        self.last_seen[device] = time.time()

    def presence(self, device: str, online: bool, info: dict | None) -> None:
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
        return ((self.online | back_soon) & self.seen) - self.revoked

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
        self.revoked.discard(device_id)
        self.enrolled = (self.enrolled or set()) | {device_id}
        if self.registry is not None:
            self.registry.revoke(device_id)
            self.registry.enroll(device_id, bytes.fromhex(creds.public_key))
        return creds

    def revoke(self, device_id: str) -> None:
        if self.enrollment is None:
            raise StoreError("revocation needs a store")
        self.enrollment.revoke(device_id)
        self.revoked.add(device_id)
        if self.enrolled is not None:
            self.enrolled.discard(device_id)
        if self.registry is not None:
            self.registry.revoke(device_id)
        self.online.discard(device_id)
        self.offline_since.setdefault(device_id, time.time())
