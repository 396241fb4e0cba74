"""``fedfleet device --credentials FILE``: the enrolment file (``fedfleet admin device enroll ID --out
FILE``) filled into the device's arguments, its private key and the broker's CA written beside it."""

from __future__ import annotations

# imported where used: `fedfleet`'s parser imports fedfleet/device.py, which imports this module


def apply_credentials(args) -> None:
    """Fill what the enrolment file holds into the arguments: --id, the broker account, --identity,
    --tls-ca and --aggregator-key (what was given explicitly must agree with it)."""
    from urllib.parse import quote, urlsplit, urlunsplit

    from protocols.files import write_atomic
    from protocols.mqtt_link import BrokerConfig
    from protocols.topics import DEVICE_ID_RE

    from .errors import UserError, load_json_file

    creds = load_json_file(args.credentials, "--credentials")
    missing = {"device_id", "mqtt_username", "mqtt_password"} - set(creds if isinstance(creds, dict) else ())
    if missing:
        raise UserError(f"--credentials {args.credentials}: not an enrolment file (missing {sorted(missing)[0]!r})")
    # everything checked before anything is written: the device id names the files written beside
    # the credentials ("../escaped" wrote a private key one folder up before it was refused)
    if not isinstance(creds["device_id"], str) or not DEVICE_ID_RE.fullmatch(creds["device_id"]):
        raise UserError(f"--credentials {args.credentials}: invalid device id {str(creds['device_id'])[:80]!r}")
    for key in ("mqtt_username", "mqtt_password", "private_key_pem", "ca_pem", "aggregator_public_key"):
        if creds.get(key) is not None and not isinstance(creds[key], str):
            raise UserError(f"--credentials {args.credentials}: {key} must be a string")
    BrokerConfig.from_url(args.broker)             # a bad --broker refused before the files are written
    if args.id not in (None, creds["device_id"]):
        raise UserError(f"--id {args.id} differs from the credentials' device {creds['device_id']!r}")
    args.id = creds["device_id"]
    url = urlsplit(args.broker)
    host = url.netloc.rpartition("@")[2]
    user = f"{quote(creds['mqtt_username'], safe='')}:{quote(creds['mqtt_password'], safe='')}@"
    args.broker = urlunsplit(("mqtts" if creds.get("ca_pem") else url.scheme, user + host, url.path, url.query, ""))
    folder = args.credentials.parent
    # written atomically: the rename replaces a file or a symlink planted at the name, never
    # writes through it (a symlink to another file had that file overwritten with the private key)
    if creds.get("private_key_pem") and args.identity is None:
        args.identity = folder / f"{args.id}.key.pem"
        write_atomic(args.identity, creds["private_key_pem"].encode(), mode=0o600)
    if creds.get("ca_pem") and args.tls_ca is None:
        ca = folder / f"{args.id}.broker-ca.pem"
        write_atomic(ca, creds["ca_pem"].encode(), mode=0o644)
        args.tls_ca = str(ca)
    if creds.get("aggregator_public_key") and args.aggregator_key is None:
        args.aggregator_key = creds["aggregator_public_key"]
