"""Device enrolment and revocation: credentials in, broker access files and identities out.

Enrolling a device gives it two credentials:

* an Ed25519 identity (``protocols.identity``): the aggregator keeps the public key and accepts a
  message from the device only if it is signed with the matching private key. A device that
  generated its own key pair sends only the public key (the private key never leaves it);
  otherwise one is generated here and returned once, as PKCS#8 PEM.
* an MQTT account (user name = device id, random password) that the broker checks at CONNECT;
  only the PBKDF2 hash is stored, the password is returned once.

Every change rewrites mosquitto's password file and ACL from the store and signals the broker
(:class:`aggregator.security.broker.BrokerSecurity`), so it takes effect without a restart.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

from protocols.identity import DeviceIdentity, IdentityRegistry, check_curve_point
from protocols.topics import AGGREGATOR_ID, check_device_id

from aggregator.security.broker import BrokerSecurity, hash_password, new_password
from aggregator.storage.store import Store, StoreError

log = logging.getLogger("fedfleet.aggregator")


@dataclass(frozen=True)
class DeviceCredentials:
    device_id: str
    mqtt_username: str
    mqtt_password: str
    public_key: str                      # hex, raw 32-byte Ed25519
    private_key_pem: str | None = None   # only when the aggregator generated the key pair
    ca_pem: str | None = None            # the broker's CA, for TLS
    aggregator_public_key: str | None = None   # hex: the device verifies every aggregator message with it
    warning: str | None = None           # enrolled, but the broker has not taken the account yet

    def to_dict(self) -> dict:
        return asdict(self)


class Enrollment:
    def __init__(self, store: Store, security: BrokerSecurity | None = None,
                 aggregator_public_key: bytes | None = None):
        self.store = store
        self.security = security
        self.aggregator_public_key = aggregator_public_key

    def enroll(self, device_id: str, public_key: bytes | None = None) -> DeviceCredentials:
        if device_id == AGGREGATOR_ID:
            raise StoreError(f"{AGGREGATOR_ID!r} is the aggregator's own account")
        check_device_id(device_id)
        private_pem = None
        if public_key is None:
            identity = DeviceIdentity.generate(device_id)
            public_key, private_pem = identity.public_key_bytes, identity.to_pem().decode()
        IdentityRegistry({device_id: public_key})          # validates the key (32-byte Ed25519)
        # a curve point only here, where a key is enrolled: one stored by an earlier version is
        # loaded at a restart as before (its device refused, the service up)
        check_curve_point(public_key)
        password = new_password()
        self.store.enroll_device(device_id, bytes(public_key), hash_password(password))
        warning = self._sync_broker()
        ca = self.security.ca_cert.read_text() if self.security and self.security.ca_cert.exists() else None
        aggregator_key = self.aggregator_public_key.hex() if self.aggregator_public_key else None
        return DeviceCredentials(device_id, device_id, password, bytes(public_key).hex(), private_pem, ca,
                                 aggregator_key, warning)

    def revoke(self, device_id: str) -> str | None:
        """Revoked in the store; a warning when the broker has not taken it yet (``_sync_broker``)."""
        self.store.revoke_device(device_id)
        return self._sync_broker()

    def sync_broker_if_stale(self) -> str | None:
        """At start: the broker's files rewritten from the store, and the broker reloaded, when they
        admit other devices (or hashes) than the store does. The store commits an enrolment or a
        revocation before the files are rewritten: a crash between the two, or a rewrite that failed
        (its warning said so), left a revoked device admitted by the broker until the next change."""
        if self.security is None or not self.security.passwd_file.exists():
            return None
        if self.security.access_files_match(self.store.password_hashes()):
            return None
        log.warning("the broker's password file and ACL differ from the store's devices: rewritten from the store")
        return self._sync_broker()

    def registry(self) -> IdentityRegistry:
        """Enrolled devices that have an identity key (devices on a bare allow-list have none)."""
        return IdentityRegistry({d: k for d, k in self.store.enrolled_keys().items() if k is not None})

    def _sync_broker(self) -> str | None:
        """Rewrite the broker's access files from the store and have it reload them. A reload that
        fails is the answer's warning, not an error: the change is committed by then, and raising
        would lose an enrolment's one-time password (its retry is refused: already enrolled) and
        keep the service from acting on a revocation (its messages would still be taken)."""
        if self.security is None:
            return None
        try:
            self.security.write_access_files(self.store.password_hashes())
        except OSError as exc:
            log.error("the broker's access files could not be written: %s", exc)
            return (f"committed, but the broker's access files could not be written ({exc}): the broker keeps "
                    "its previous accounts (a revoked device may still connect; its messages are refused) until "
                    "a later enrolment or revocation, or the aggregator's next start, writes them from the store")
        try:
            self.security.reload()
        except (OSError, RuntimeError) as exc:
            log.error("the broker did not reload its access files: %s", exc)
            return (f"committed and its access files written, but the broker did not reload them ({exc}): "
                    "it takes the change once it does (SIGHUP mosquitto, or restart it)")
        return None
