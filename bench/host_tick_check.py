"""What a device host pays to ask each device whether a tick may change it (``DeviceAgent.wants_tick``,
``fedfleet/emulation/host.py`` asks every device every ``tick_s``): an idle device of a plain fleet
against an idle device of a secure fleet, whose SecAgg sessions may end on the clock (the check the
session expiry added), timed in one run. Prints each call's cost, the ratio, and what one tick of a
host of --devices such devices spends on the question.

    .venv/bin/python bench/host_tick_check.py [--devices 100000] [--calls 200000]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import timeit

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from edge_client.agent import AgentHooks, DeviceAgent  # noqa: E402
from edge_client.tasks.secure_update import SecAggSessions  # noqa: E402
from protocols.mqtt_link import BrokerConfig  # noqa: E402
from protocols.payloads.secagg import SECAGG_TYPE  # noqa: E402


class NoLink:
    """The agent's link, never started: the question needs none."""

    def __init__(self, **kwargs):
        pass


def idle_agent(protocol_handlers: dict) -> DeviceAgent:
    agent = DeviceAgent("dev", BrokerConfig(), {}, link_factory=NoLink, hooks=AgentHooks(always_available=True),
                        protocol_handlers=protocol_handlers)
    agent.online = True
    assert not agent.wants_tick
    return agent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=100_000)
    ap.add_argument("--calls", type=int, default=200_000)
    args = ap.parse_args()
    agents = {"plain": idle_agent({}), "secure": idle_agent({SECAGG_TYPE: SecAggSessions("dev")})}
    cost = {name: [] for name in agents}
    for _ in range(3):                              # alternated: the machine is shared and noisy
        for name, agent in agents.items():
            cost[name].append(timeit.timeit(lambda: agent.wants_tick, number=args.calls) / args.calls)
    best = {name: min(runs) for name, runs in cost.items()}
    for name, seconds in best.items():
        print(f"{name:>6} idle device: {seconds * 1e6:.3f} us per wants_tick; a host of {args.devices:,}: "
              f"{seconds * args.devices * 1e3:.1f} ms per tick")
    print(f"ratio secure / plain: {best['secure'] / best['plain']:.2f}")


if __name__ == "__main__":
    main()
