"""Ed25519 identities for a secure emulated run, made once per run and written next to it."""

from __future__ import annotations

import json
from pathlib import Path


def make_identities(out: Path, device_ids: list[str]) -> tuple[dict, dict]:
    """(job fields, worker keys): the job fields name the aggregator's private key file and the
    enrolled devices' public keys (``identity_file``, ``device_keys_file``); the workers get each
    device's private key and the aggregator's public key (``aggregator_public_key``, ``device_keys``)."""
    from protocols.files import write_private_file
    from protocols.identity import DeviceIdentity

    agg = DeviceIdentity.generate("aggregator")
    write_private_file(out / "aggregator.pem", agg.to_pem())
    identities = {d: DeviceIdentity.generate(d) for d in device_ids}
    (out / "device_keys.json").write_text(json.dumps({d: i.public_key_bytes.hex() for d, i in identities.items()}))
    job_fields = {"identity_file": str(out / "aggregator.pem"), "device_keys_file": str(out / "device_keys.json")}
    for_workers = {"aggregator_public_key": agg.public_key_bytes.hex(),
                   "device_keys": {d: i.private_bytes().hex() for d, i in identities.items()}}
    return job_fields, for_workers
