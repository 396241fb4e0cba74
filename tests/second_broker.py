"""A second, independently written MQTT broker for the suite: amqtt (asyncio, MQTT 3.1.1), run as
its own process on a free loopback port, so "any MQTT broker" is tested against more than
mosquitto.

``AmqttBroker()`` is an open broker (anonymous clients allowed). ``AmqttBroker(accounts=...)`` is
one with accounts, as fedfleet runs in production: amqtt's FileAuthPlugin checks every CONNECT
against a password file written here (argon2 hashes, the format amqtt 0.12 recommends: its
sha512-crypt support is deprecated and needs the ``crypt`` module Python 3.13 dropped), and no
anonymous client is let in (no plugin answers for a CONNECT without a user name, so amqtt refuses
it). ``acl=`` (the text of a mosquitto ACL file, e.g. what ``aggregator.security.broker.acl_text``
generates) adds amqtt's TopicAccessControlListPlugin with the same rules, so the product's one
source of the ACL is what both brokers enforce."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from fedfleet.emulation.broker import free_port, wait_until_listening
from fedfleet.emulation.processes import stop_all


def amqtt_password_file(accounts: dict[str, str]) -> str:
    """``user:hash`` lines amqtt's FileAuthPlugin reads. The argon2 cost is the minimum: each
    CONNECT is verified on the broker's one event loop, and these are throwaway test passwords."""
    from pwdlib.hashers.argon2 import Argon2Hasher

    hasher = Argon2Hasher(time_cost=1, memory_cost=1024, parallelism=1)
    return "".join(f"{user}:{hasher.hash(password)}\n" for user, password in sorted(accounts.items()))


def amqtt_topic_acl(mosquitto_acl: str) -> dict[str, dict[str, list[str]]]:
    """A mosquitto ACL file's ``user`` / ``topic read|write|readwrite`` rules as amqtt's
    TopicAccessControlListPlugin config: ``publish_acl`` holds what each user may write, ``acl``
    (amqtt 0.12's subscribe ACL; its receive ACL cannot be configured) what it may read."""
    publish: dict[str, list[str]] = {}
    subscribe: dict[str, list[str]] = {}
    user = None
    for line in mosquitto_acl.splitlines():
        words = line.split()
        if words[:1] == ["user"]:
            user = words[1]
            publish.setdefault(user, [])
            subscribe.setdefault(user, [])
        elif words[:1] == ["topic"]:
            access, topic = (words[1], words[2]) if len(words) == 3 else ("readwrite", words[1])
            if access in ("write", "readwrite"):
                publish[user].append(topic)
            if access in ("read", "readwrite"):
                subscribe[user].append(topic)
    return {"publish_acl": publish, "acl": subscribe}


class AmqttBroker:
    def __init__(self, accounts: dict[str, str] | None = None, acl: str | None = None):
        if acl is not None and accounts is None:
            raise ValueError("a topic ACL is per account: give accounts too")
        self.port = free_port()
        self._tmp = tempfile.TemporaryDirectory(prefix="fedfleet-amqtt-")
        folder = Path(self._tmp.name)
        plugins: dict[str, dict] = {}
        if accounts is None:
            plugins["amqtt.plugins.authentication.AnonymousAuthPlugin"] = {"allow_anonymous": True}
        else:
            passwd = folder / "passwd"
            passwd.write_text(amqtt_password_file(accounts))
            plugins["amqtt.plugins.authentication.FileAuthPlugin"] = {"password_file": str(passwd)}
        if acl is not None:
            plugins["amqtt.plugins.topic_checking.TopicAccessControlListPlugin"] = amqtt_topic_acl(acl)
        self.conf = folder / "amqtt.yaml"
        self.conf.write_text(yaml.safe_dump({"listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{self.port}"}},
                                             "plugins": plugins}))
        self.proc = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}?version=3.1.1"

    def login_url(self, user: str, password: str) -> str:
        """The broker's address with an account's credentials in it (how fedfleet takes them)."""
        from urllib.parse import quote

        return f"mqtt://{quote(user, safe='')}:{quote(password, safe='')}@127.0.0.1:{self.port}?version=3.1.1"

    def __enter__(self) -> "AmqttBroker":
        amqtt = Path(sys.executable).with_name("amqtt")
        self.log = open(Path(self._tmp.name) / "amqtt.log", "wb")
        self.proc = subprocess.Popen([str(amqtt), "-c", str(self.conf)], stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_until_listening(self.proc, self.port, Path(self._tmp.name) / "amqtt.log", 20)
        except TimeoutError:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        if self.proc:
            stop_all([self.proc], first_is_done=False, grace_s=5)
        self._tmp.cleanup()
