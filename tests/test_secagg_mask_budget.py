"""The most mask work a round may ask of a member (``MAX_MASK_WORDS``): (pairwise masks + the self
mask) x vector_length words of AES-CTR keystream, worked out on the device outside any task's
deadline. A review found that nothing bounded it: a signed config of 9,999 neighbours and a
Fed3R-Sync vector asked hours of a phone. A device refuses such a RoundStart when it reads it,
before any key or mask; the aggregator refuses to build the config, and a secure job whose largest
round would ask it is refused when it is built (tests/test_java_secagg.py holds the Java device's
decision and words equal to Python's)."""

from __future__ import annotations

import numpy as np
import pytest

import protocols.secagg.config as secagg_config
from aggregator.jobs.fed3r_sync import Fed3RSyncConfig, Fed3RSyncJob
from aggregator.jobs.secure_ladd import SecureLaddConfig, SecureLaddJob
from protocols.envelope import EnvelopeError
from protocols.identity import DeviceIdentity, IdentityRegistry
from protocols.payloads.secagg import from_envelope, to_envelope
from protocols.secagg import ClientSecAgg, ClientState, RoundConfig
from protocols.secagg.config import MAX_MASK_WORDS
from protocols.secagg.errors import ConfigError
from protocols.secagg.messages import RoundStart

AGGREGATOR = DeviceIdentity.generate("aggregator")
# Fed3R-Sync's vector at the job defaults (feature_dim 1280 + the intercept, 10 classes): the packed
# upper triangle of A (1281·1282/2), B (10 x 1281) and the count
FED3R_SYNC_WORDS = 1281 * 1282 // 2 + 10 * 1281 + 1


def _config(n: int, vector_length: int, **over) -> RoundConfig:
    return RoundConfig.create(job_id="j", round_id=1, group_id="g", aggregator_id="aggregator",
                              members=[f"d{i:05d}" for i in range(n)], vector_length=vector_length, bound=1.0,
                              **over)


def _refusal(masks: int, vector_length: int) -> str:
    return (f"the round asks each member to expand {masks} masks of {vector_length} words "
            f"\\({masks * vector_length} words\\), more than a device expands \\({MAX_MASK_WORDS}\\)")


def test_the_budget_is_five_times_the_largest_round_an_aggregator_builds_by_default():
    # graph "auto" at 10 % dropouts: the complete graph up to 128 members, SecAgg+ (degree <= 40) above
    assert MAX_MASK_WORDS == 2 ** 29
    assert secagg_config.largest_mask_expansions("auto", secagg_config.MAX_GROUP_SIZE) == 128
    assert 5 * 128 * FED3R_SYNC_WORDS <= MAX_MASK_WORDS
    _config(128, FED3R_SYNC_WORDS)                                  # built: no error
    _config(1000, FED3R_SYNC_WORDS)                                 # SecAgg+: 35 masks


@pytest.mark.parametrize("n, graph, degree, at_budget", [
    (8, "complete", None, 2 ** 26),                         # 8 masks of 2^26 words: 2^29
    (1000, "regular", 34, MAX_MASK_WORDS // 35),           # 34 neighbours + the self mask
])
def test_the_aggregator_builds_a_config_at_the_budget_and_refuses_one_word_more(n, graph, degree, at_budget):
    masks = n if graph == "complete" else degree + 1
    assert _config(n, at_budget, graph=graph, degree=degree).vector_length == at_budget
    with pytest.raises(ConfigError, match=_refusal(masks, at_budget + 1)):
        _config(n, at_budget + 1, graph=graph, degree=degree)


def test_a_degree_past_the_group_counts_the_complete_graphs_masks():
    """A SecAgg+ degree >= n - 1 is the complete graph: n - 1 neighbours, not ``degree``."""
    assert _config(8, 2 ** 26, graph="regular", degree=100).degree == 100         # 8 masks, not 101
    with pytest.raises(ConfigError, match=_refusal(9, 2 ** 26)):
        _config(9, 2 ** 26, graph="regular", degree=100)


def test_a_count_past_fifteen_digits_is_written_in_scientific_notation():
    """A review's finding: a 401-digit count was written whole. Every count a RoundConfig can hold
    (at most 10,000 masks of 2^27 words) is still written whole, as the Java client writes it."""
    with pytest.raises(ConfigError) as refused:
        secagg_config.check_mask_words(3 * 10 ** 200, 41 * 10 ** 199)
    assert str(refused.value) == ("the round asks each member to expand 3.00e+200 masks of 4.10e+200 words "
                                  f"(1.23e+401 words), more than a device expands ({MAX_MASK_WORDS})")
    with pytest.raises(ConfigError, match=r"1 masks of 999999999999999 words \(999999999999999 words\)"):
        secagg_config.check_mask_words(1, 10 ** 15 - 1)
    with pytest.raises(ConfigError, match=r"1 masks of 1.00e\+15 words"):
        secagg_config.check_mask_words(1, 10 ** 15)
    with pytest.raises(ConfigError, match=r"\(1.00e\+6000 words\)"):        # str() of it raised ValueError
        secagg_config.check_mask_words(10 ** 3000, 10 ** 3000)
    with pytest.raises(ConfigError, match=_refusal(10_000, 2 ** 27)):
        secagg_config.check_mask_words(10_000, 2 ** 27)


def _signed_start(n: int, vector_length: int, monkeypatch) -> RoundStart:
    """The aggregator's signed RoundStart of a complete group of n to d00000, built past the budget
    where it must be (as a compromised aggregator would sign it)."""
    with monkeypatch.context() as patched:
        patched.setattr(secagg_config, "MAX_MASK_WORDS", 2 ** 62)
        config = _config(n, vector_length)
    return RoundStart(job_id="j", round_id=1, group_id="g", sender="aggregator", recipient="d00000",
                      config=config).signed(AGGREGATOR)


def test_a_device_refuses_an_over_budget_round_start_before_any_key_or_mask(monkeypatch):
    def no_mask(*_args, **_kwargs):
        raise AssertionError("a mask was expanded")

    monkeypatch.setattr("protocols.secagg.crypto.expand_mask", no_mask)
    monkeypatch.setattr("protocols.secagg.client.apply_masks", no_mask)
    device = DeviceIdentity.generate("d00000")

    def client() -> ClientSecAgg:
        return ClientSecAgg(device, "aggregator", AGGREGATOR.public_key_bytes, job_id="j", round_id=1, group_id="g")

    # 4 members x 2^27 words: the budget itself, taken
    assert [m.TYPE for m in client().handle(from_envelope(to_envelope(_signed_start(4, 2 ** 27, monkeypatch))))] \
        == ["secagg.advertise_keys"]
    # 5 members x 2^27 words: refused as the message is read, the round's client untouched
    over = to_envelope(_signed_start(5, 2 ** 27, monkeypatch))
    refusing = client()
    with pytest.raises(EnvelopeError, match=_refusal(5, 2 ** 27)):
        refusing.handle(from_envelope(over))
    assert refusing.state is ClientState.WAITING_CONFIG and refusing.config is None


def _sync_job(**over) -> Fed3RSyncJob:
    return Fed3RSyncJob(Fed3RSyncConfig(job_id="s", num_classes=10, feature_dim=1280, **over),
                        identity=AGGREGATOR, registry=IdentityRegistry({}))


def test_a_secure_job_whose_largest_round_is_past_the_budget_is_refused_when_built():
    """Fed3R-Sync at the defaults' vector on an explicit complete graph: 641 drawn devices (643 with
    the stragglers that join the last group) are within the budget, 642 are not; the default graph
    ("auto") builds at any group size."""
    assert 643 * FED3R_SYNC_WORDS <= MAX_MASK_WORDS < 644 * FED3R_SYNC_WORDS
    assert _sync_job(graph="complete", clients_per_round=641).vector_length == FED3R_SYNC_WORDS
    with pytest.raises(ValueError, match=r"644 masks of 833932 words.*MAX_MASK_WORDS"):
        _sync_job(graph="complete", clients_per_round=642)
    for members in (128, 642, secagg_config.MAX_GROUP_SIZE):
        _sync_job(clients_per_round=members)


# Secure LADD's vector is [φ | a θ slot per cluster | n | a weight and a count per cluster]
# (protocols/payloads/secagg.py ClusterSlotLayout): here a φ and a θ tensor sized so that 7 clusters'
# vector is exactly what each of a complete group of 128 members (126 drawn and the 2 stragglers
# that may join the last group) may expand, and an 8th cluster's slot goes past it.
LADD_MEMBERS = 128
LADD_SLOT_WORDS = 2 ** 19
LADD_PHI_WORDS = MAX_MASK_WORDS // LADD_MEMBERS - 7 * LADD_SLOT_WORDS - (1 + 2 * 7)


def _ladd_job(**over) -> SecureLaddJob:
    # "head." names are θ (cluster_scope "head"), the rest φ; both trainable
    initial = {"tail.conv.weight": np.zeros(LADD_PHI_WORDS, np.float32),
               "head.classifier.weight": np.zeros(LADD_SLOT_WORDS, np.float32)}
    config = SecureLaddConfig(**{"job_id": "l", "model": {"num_classes": 4, "image_size": 32}, "graph": "complete",
                                 "clients_per_round": LADD_MEMBERS - 2, "k_min": 1, **over})
    return SecureLaddJob(config, initial=(initial, list(initial)), identity=AGGREGATOR,
                         registry=IdentityRegistry({}))


def test_a_secure_ladd_job_whose_most_clusters_are_past_the_budget_is_refused_when_built():
    """Secure LADD checked its vector only when its first training round opened, after the style
    rounds. Now the most clusters the config allows (k_max; one cluster when clustering is "none")
    size the vector checked when the job is built."""
    assert LADD_MEMBERS * (LADD_PHI_WORDS + 7 * LADD_SLOT_WORDS + 1 + 2 * 7) == MAX_MASK_WORDS
    _ladd_job(k_max=7)                                                    # at the budget: built
    eight = LADD_PHI_WORDS + 8 * LADD_SLOT_WORDS + 1 + 2 * 8
    with pytest.raises(ValueError, match=rf"128 masks of {eight} words.*MAX_MASK_WORDS.*k_max"):
        _ladd_job(k_max=8)
    _ladd_job(k_max=64, clustering="none")                                 # one cluster whatever k_max says


def test_a_secure_ladd_vector_longer_than_secagg_sums_is_refused_when_built(monkeypatch):
    """The same with SecAgg's longest vector set to 7 clusters' here (the real 2^27 entries would
    need a model of half a gigabyte) and the default graph, whose masks stay within the budget."""
    import aggregator.jobs.secure_rounds as secure_rounds

    monkeypatch.setattr(secure_rounds, "MAX_VECTOR_LENGTH", LADD_PHI_WORDS + 7 * LADD_SLOT_WORDS + 1 + 2 * 7)
    _ladd_job(k_max=7, graph="auto")
    with pytest.raises(ValueError, match="more than SecAgg's.*k_max"):
        _ladd_job(k_max=8, graph="auto")
