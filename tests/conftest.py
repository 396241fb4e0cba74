import pytest


@pytest.fixture
def broker():
    """A real mosquitto on a free loopback port."""
    from fedfleet.emulation.broker import MosquittoBroker, find_mosquitto

    try:
        find_mosquitto()
    except FileNotFoundError as exc:  # make test installs it; say so loudly if it is missing
        pytest.fail(str(exc))
    with MosquittoBroker() as b:
        yield b
