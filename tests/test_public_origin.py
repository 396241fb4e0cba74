"""The dashboard's origin check behind a reverse proxy that rewrites Host.

nginx's ``proxy_pass http://127.0.0.1:8080`` sends ``Host: 127.0.0.1:8080``, so a browser at
``https://fleet.example.com`` whose change says ``Origin: https://fleet.example.com`` (and no
``Sec-Fetch-Site``: browsers send it only to HTTPS or localhost, and older ones never) was refused
as cross-origin. ``--public-origin`` names the addresses browsers reach the dashboard at; a request
through a real uvicorn server with a real HTTP client (urllib, as ``fedfleet admin``) arrives with
the Host of the connection, which is what the proxy's request carries.
"""

import http.client
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from aggregator.api.app import create_app
from aggregator.api.guard import COOKIE, new_session
from aggregator.api.server import ApiServer
from aggregator.storage.store import Store

TOKEN = "test-token-0123456789abcdef"
PUBLIC = "https://fleet.example.com"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def served(tmp_path):
    """start(public_origins) → the URL of a read-only API on a store, served by uvicorn."""
    servers = []

    def start(public_origins=()):
        api = ApiServer(create_app(Store(tmp_path / f"s{len(servers)}.db"), TOKEN, public_origins=public_origins)).start()
        servers.append(api)
        return api.url
    yield start
    for api in servers:
        api.stop()


def dashboard_change(url: str, **headers) -> tuple[int, str]:
    """A job's cancel POSTed with the dashboard's session cookie, as app.js does: (status, body)."""
    request = urllib.request.Request(f"{url}/api/jobs/nope/cancel", data=b"", method="POST",
                                     headers={"Cookie": f"{COOKIE}={new_session(TOKEN)}", **headers})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def refused_as_cross_origin(answer: tuple[int, str]) -> bool:
    return answer[0] == 403 and "origin" in answer[1]


def test_a_proxied_browser_change_is_refused_unless_its_public_origin_is_named(served):
    url = served()
    # what the proxy forwards: Host is the upstream's (the connection's); X-Forwarded-Host is a
    # header anyone can send, and is not trusted
    assert refused_as_cross_origin(dashboard_change(url, Origin=PUBLIC))
    assert refused_as_cross_origin(dashboard_change(url, Origin=PUBLIC, **{"X-Forwarded-Host": "fleet.example.com"}))
    assert not refused_as_cross_origin(dashboard_change(url, Origin=url))          # the Host-derived origin, as before


def test_a_named_public_origin_passes_and_every_other_origin_is_still_refused(served):
    url = served([PUBLIC, "http://fleet.lan:8081/"])
    for origin in (PUBLIC, "HTTPS://Fleet.Example.com:443", "http://fleet.lan:8081", url):
        status, body = dashboard_change(url, Origin=origin)
        assert status == 404 and "no job" in body, (origin, status, body)      # past the guard: no such job
    for origin in ("https://evil.example", "http://fleet.example.com", "https://fleet.example.com:8443",
                   "https://sub.fleet.example.com", "http://fleet.lan", "null", "https://fleet.example.com.evil"):
        assert refused_as_cross_origin(dashboard_change(url, Origin=origin)), origin
    # the browser's own word wins over Origin: another site is refused whatever Origin it names
    assert refused_as_cross_origin(dashboard_change(url, Origin=PUBLIC, **{"Sec-Fetch-Site": "cross-site"}))
    assert dashboard_change(url, **{"Sec-Fetch-Site": "same-origin"})[0] == 404


def sign_in(url: str, **headers) -> set[str]:
    """The sign-in form's POST (http.client: no redirect followed): the session cookie's attribute
    names, lower case (``secure``, ``httponly``, ...)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request("POST", "/dashboard/login", body=f"token={TOKEN}",
                     headers={"Content-Type": "application/x-www-form-urlencoded", **headers})
        resp = conn.getresponse()
        resp.read()
    finally:
        conn.close()
    cookie = resp.getheader("set-cookie") or ""
    assert resp.status == 303 and cookie.startswith(f"{COOKIE}="), (resp.status, cookie)
    return {attribute.split("=")[0].strip().lower() for attribute in cookie.split(";")[1:]}


FORWARDED_HTTPS = {"X-Forwarded-Proto": "https"}


def test_the_session_cookie_is_secure_when_the_browser_signs_in_over_https(served):
    """Without ``Secure`` a browser that signed in at https://fleet.example.com sends the session
    to http://fleet.example.com as well (any page, or a network attacker, can make it ask there).
    The request's scheme as uvicorn sees it (TLS, or X-Forwarded-Proto from a trusted proxy), or
    Host naming a public origin given only as https, says the browser is on https."""
    url = served()
    assert "secure" not in sign_in(url) and "httponly" in sign_in(url)          # local use over http: as before
    assert "secure" in sign_in(url, **FORWARDED_HTTPS)                          # a TLS proxy on this host
    url = served([PUBLIC])
    assert "secure" in sign_in(url, Host="fleet.example.com")                   # a proxy that forwards Host only
    assert "secure" not in sign_in(url)                                         # the loopback address: not named
    url = served([PUBLIC, "http://fleet.example.com"])                           # named both ways: http may be in use
    assert "secure" not in sign_in(url, Host="fleet.example.com")


def test_x_forwarded_proto_counts_only_from_a_proxy_uvicorn_trusts(served, monkeypatch):
    monkeypatch.setenv("FORWARDED_ALLOW_IPS", "192.0.2.1")                      # not this test's loopback client
    url = served()
    assert "secure" not in sign_in(url, **FORWARDED_HTTPS)
    assert dashboard_change(url, Origin=url, **FORWARDED_HTTPS)[0] == 404       # still the http dashboard


def test_an_http_origin_is_not_the_dashboards_when_the_dashboard_is_https(served):
    """The Host rule compared host[:port] only, so ``Origin: http://fleet.example.com`` (a page on
    the plain-HTTP side of the dashboard's own name, which a network attacker can write) passed as
    the https dashboard. The Host-derived origin now has the request's scheme; an https page at the
    same Host still passes a request that came over http (a TLS proxy that does not say so)."""
    url = served([PUBLIC])
    host = urlsplit(url).netloc
    assert refused_as_cross_origin(dashboard_change(url, Origin=url, **FORWARDED_HTTPS))
    assert dashboard_change(url, Origin=f"https://{host}", **FORWARDED_HTTPS)[0] == 404
    assert dashboard_change(url, Origin=PUBLIC, **FORWARDED_HTTPS)[0] == 404
    # a proxy that forwards the browser's Host and not the scheme: the origin named says https
    assert refused_as_cross_origin(dashboard_change(url, Origin="http://fleet.example.com", Host="fleet.example.com"))
    assert dashboard_change(url, Origin=PUBLIC, Host="fleet.example.com")[0] == 404
    # local use over http, and a Host named by no public origin, as before
    assert dashboard_change(url, Origin=url)[0] == 404
    assert dashboard_change(url, Origin=f"https://{host}")[0] == 404
    assert dashboard_change(url, Origin="http://fleet.lan:8081", Host="fleet.lan:8081")[0] == 404
    assert refused_as_cross_origin(dashboard_change(url, Origin=f"ftp://{host}"))


@pytest.mark.parametrize("value", ["fleet.example.com", "*", "https://*.example.com", "ftp://fleet.example.com",
                                   "https://fleet.example.com/dashboard/", "https://user@fleet.example.com",
                                   "https://fleet.example.com:99999", "https://fleet.example.com:0", "https://",
                                   "https://fleet.example.com?x=1", " https://fleet.example.com", "https://fl eet.com",
                                   "https://[::1"])
def test_a_bad_public_origin_is_refused_with_what_is_expected(value):
    from aggregator.api.origins import public_origin

    with pytest.raises(ValueError, match=r"--public-origin .*expected scheme://host\[:port\]"):
        public_origin(value)


def test_public_origins_are_written_as_browsers_write_them():
    from aggregator.api.origins import public_origin

    assert public_origin("HTTPS://Fleet.Example.COM:443/") == "https://fleet.example.com"
    assert public_origin("http://10.0.0.5:80") == "http://10.0.0.5"
    assert public_origin("https://[2001:DB8::1]:8443") == "https://[2001:db8::1]:8443"


def aggregator(*args, **kwargs) -> subprocess.CompletedProcess:
    """``python -m aggregator`` (what ``fedfleet aggregator`` runs) from this checkout."""
    return subprocess.run([sys.executable, "-m", "aggregator", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120, **kwargs)


def test_a_bad_public_origin_is_one_error_line_before_anything_is_built(tmp_path):
    import os

    env = dict(os.environ, FEDFLEET_ADMIN_TOKEN="abcdefghijklmnopqrstuvwxyz")
    common = ["serve", "--state", str(tmp_path / "s.db"), "--out", str(tmp_path / "out"),
              "--broker", "mqtt://127.0.0.1:1", "--api", "127.0.0.1:0"]
    proc = aggregator(*common, "--public-origin", PUBLIC, "--public-origin", "fleet.example.com", env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "--public-origin 'fleet.example.com'" in lines[0], proc.stderr
    assert not (tmp_path / "s.db").exists()                 # refused before the store was made
    proc = aggregator(*common[:-2], "--public-origin", PUBLIC, env=env)              # nothing it would apply to
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "--public-origin" in lines[0] and "--api" in lines[0], proc.stderr
    assert not (tmp_path / "s.db").exists()


def test_the_option_is_in_serves_help():
    proc = aggregator("serve", "--help")
    assert proc.returncode == 0 and "--public-origin" in proc.stdout and "reverse proxy" in proc.stdout, proc.stdout
