"""A rollout on the TLS + ACL broker fedfleet generates: the aggregator's service and deployment
controller, a device's agent, deployment follower and bundle fetch each connect under an identity
of their own, and the broker closes none of them (FEDFLEET_ACL_SOAK_S holds them for a soak run)."""

import threading
import time

from edge_client.deployment import DeploymentFollower, ModelSlot
from ops_fleet import wait_for
from deployment_fleet import D_sha, store_state
from deployment_fleet import world  # noqa: F401 (fixture)
from test_broker_security import secured  # noqa: F401 (fixture)


def test_on_the_generated_acl_broker_no_two_connections_share_an_identity(secured, tmp_path, world):
    """The aggregator's service and deployment controller, a device's agent connection, its
    deployment follower and its on-demand bundle fetch, all on the TLS + ACL broker fedfleet generates (the user name is the
    client id), through a whole rollout and 5 s more with a 1 s keepalive: the broker closes none
    of the connections (with one account for service and controller, and one for agent and
    follower, each pair closed the other in turn about once a second, and this rollout did not
    complete in 15 s). 5 s: several keepalive periods and reconnect delays, enough to show that
    churn. FEDFLEET_ACL_SOAK_S=180 holds the connections for minutes (a soak run outside make test)."""
    import os
    import threading

    from aggregator.deployments.controller import DeploymentController
    from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
    from aggregator.service.loop import AggregatorService
    from aggregator.service.settings import ServiceSettings
    from aggregator.storage.store import Store
    from ops_fleet import job_config
    from protocols.mqtt_link import BrokerConfig, MqttLink
    from protocols.topics import AGGREGATOR_ID, FETCH_ROLE, Topics

    sec, port = secured
    store = Store(tmp_path / "state.db")
    broker = BrokerConfig("127.0.0.1", port, AGGREGATOR_ID, sec.aggregator_password, tls_ca=str(sec.ca_cert),
                          keepalive=1)
    svc = AggregatorService(Fed3RJob(Fed3RConfig(**job_config(["dev01"], start_timeout_s=60))), broker,
                            tmp_path / "out", ServiceSettings(tick_s=0.05), store=store, security=sec)
    creds = svc.enroll("dev01", None)
    device = BrokerConfig("127.0.0.1", port, "dev01", creds.mqtt_password, tls_ca=str(sec.ca_cert), keepalive=1)
    W, b = world["good"]
    store.create_job("heads", "fed3r", {})
    model = store.finish_job("heads", "done", {}, {}, {"coef": W, "intercept": b}, {}, 1)
    hold_s = float(os.environ.get("FEDFLEET_ACL_SOAK_S", "5"))
    thread = threading.Thread(target=svc.run, kwargs={"timeout_s": 60 + hold_s}, daemon=True)
    thread.start()
    ctl = DeploymentController(store, broker, Topics(), tick_s=0.05).start()
    agent = MqttLink("dev01", device, on_message=lambda t, p: None, subscriptions=[(Topics().inbox("dev01"), 1)])
    agent.start()                                # the agent's connection, as edge_client/agent.py opens it
    follower = DeploymentFollower("dev01", device, ModelSlot(tmp_path / "slot"), lambda bundle: world["holdout"]["cam-0"],
                                  retry_s=0.5).start()
    fetch_broker = device.for_role(FETCH_ROLE)     # a bundle fetched on demand, as fedfleet/device.py does
    fetch = MqttLink(fetch_broker.username, fetch_broker, on_message=lambda t, p: None,
                     subscriptions=[(Topics().inbox("dev01"), 1)], clean_start=True)
    fetch.start()
    links = {"service": svc.link, "controller": ctl.link, "agent": agent, "follower": follower.link, "fetch": fetch}
    closed = {name: 0 for name in links}
    for name, link in links.items():            # count every connection the broker closes
        handler = link.client.on_disconnect
        link.client.on_disconnect = (lambda h, n: lambda *a: (closed.__setitem__(n, closed[n] + 1), h(*a)))(handler, name)
    try:
        assert all(link.connected.wait(10) for link in links.values())
        ctl.call(lambda: ctl.deploy(model, cohort="devices:dev01", stages="100%", bake_s=0, min_reports=1,
                                    deployment_id="acl-1"))
        wait_for(lambda: store_state(store, "acl-1") == "complete", 15, "the rollout on the ACL broker")
        assert follower.slot.current.sha256 == D_sha((W, b))
        time.sleep(hold_s)
        # Two connections of one identity close each other about once a second each (ten or more in
        # the 5 s). One closure in all is a keepalive missed, not that: a thread of this process held
        # up past 1.5 s under the suite's load (seen once: the service's link), which reconnects
        assert sum(closed.values()) <= 1, closed
        wait_for(lambda: all(link.connected.is_set() for link in links.values()), 10, "every connection up")
        assert {link.client._client_id.decode() for link in links.values()} == \
            {"aggregator", "aggregator/deployments", "dev01", "dev01/deploy", "dev01/fetch"}
    finally:
        fetch.stop()
        follower.stop()
        agent.stop()
        ctl.stop()
        svc.stop()
        thread.join(10)
