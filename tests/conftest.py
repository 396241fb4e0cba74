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


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Intra-op threads oversubscribe a shared 2-core CI box (2 threads can be 10x slower than 1
    under load); tests measure correctness, not speed."""
    try:
        import torch
    except ImportError:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
