"""The stateful head tasks (pp.head, scaffold.head, fedgloss.head, ditto.head) decline training that leaves
the protocol's bound exactly as fedavg.head does (protocols.payloads.fedavg.MAX_ABS_TRAINED): a
finite head past 2^20 is diverged on every device, not uploaded for the aggregator to refuse."""

import numpy as np
import pytest

from edge_client.tasks.ditto_training import ditto_pass
from edge_client.tasks.fedgloss_training import fedgloss_pass
from edge_client.tasks.head_training import LocalTraining
from edge_client.tasks.partial_training import train_partial
from edge_client.tasks.scaffold_training import scaffold_pass
from protocols.payloads.fedavg import MAX_ABS_TRAINED, raise_if_diverged
from protocols.payloads.ditto import DittoRecipe
from protocols.payloads.partial import PartialRecipe

C, D = 3, 4
RNG = np.random.default_rng(0)
Z, Y = RNG.normal(size=(20, D)).astype(np.float32), RNG.integers(0, C, 20)
ZERO = {"weight": np.zeros((C, D), np.float32), "bias": np.zeros(C, np.float32)}


def far(value: float) -> np.ndarray:
    """A head whose one entry sits at `value` and is left there by a tiny-lr step."""
    w = np.zeros((C, D), np.float32)
    w[1, 2] = value
    return w


PASSES = {
    "scaffold": lambda w, lr: scaffold_pass(w, ZERO["bias"], ZERO, ZERO, Z, Y, LocalTraining(epochs=1, batch_size=10, lr=lr)),
    "pp": lambda w, lr: train_partial(w, ZERO["bias"], Z, Y, PartialRecipe(batch_size=10, lr=lr)),
    "fedgloss": lambda w, lr: fedgloss_pass(w, ZERO["bias"], ZERO, Z, Y, LocalTraining(epochs=1, batch_size=10, lr=lr), 10.0),
    "ditto": lambda w, lr: ditto_pass(w, ZERO["bias"], ZERO, Z, Y, LocalTraining(epochs=1, batch_size=10, lr=lr),
                                      DittoRecipe(0.1, 1, lr)),
}


@pytest.mark.parametrize("kind", sorted(PASSES))
def test_a_head_past_the_wire_bound_is_declined_as_diverged(kind):
    PASSES[kind](far(MAX_ABS_TRAINED / 2), 1e-9)          # inside the bound: trains
    with pytest.raises(FloatingPointError, match="diverged"):
        PASSES[kind](far(4 * MAX_ABS_TRAINED), 1e-9)       # finite, past it: declined (was uploaded)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1.5 * MAX_ABS_TRAINED])
def test_the_shared_rule_names_the_tensor(bad):
    with pytest.raises(FloatingPointError, match="'w'"):
        raise_if_diverged({"ok": np.ones(2), "w": np.array([0.0, bad])})
    raise_if_diverged({"w": np.array([MAX_ABS_TRAINED, -MAX_ABS_TRAINED])})   # the bound itself is allowed
