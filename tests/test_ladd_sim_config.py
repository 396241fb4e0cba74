"""``--ladd-config`` (``LaddSimConfig``) is checked as ``simulate --config`` is, before anything starts:
every field's JSON type and declared limit (a field the LADD job has keeps that job field's limit),
and what fields valid alone refuse together. A review's finding: LaddSimConfig checked none of it,
so a recipe the job refuses (``lr`` -1, ``local_rule`` "adam", ``k_min`` > ``k_max``) was found
minutes later in the aggregator process's log after the benchmark was rendered and written; a
``workers`` of "2" failed there too, and ``image_size`` 1024 with 10^5 source images (each field
within the network's own bounds) asked for ~400 GB of benchmark."""

from __future__ import annotations

import json

import pytest

from fedfleet.ladd.config import QUICK, LaddSimConfig

BAD = [
    ({"lr": -1}, "'lr'"),
    ({"local_rule": "adam"}, "'local_rule'"),
    ({"k_min": 6, "k_max": 3}, "k_min"),
    ({"workers": "2"}, "'workers'"),
    ({"rounds": True}, "'rounds'"),
    ({"pretrain_steps": 10 ** 12}, "'pretrain_steps'"),
    ({"pretrain_lr": 0}, "'pretrain_lr'"),
    ({"image_size": 100_000}, "'image_size'"),
    ({"output_stride": 9}, "output_stride"),
    ({"domains": ["mars"]}, "'domains'"),
    ({"domains": []}, "'domains'"),
    ({"seeds": [1.5]}, "'seeds'"),
    ({"images_per_device": [24, 12]}, "images_per_device"),
    ({"images_per_device": [0, 0]}, "'images_per_device'"),
    ({"image_size": 1024, "n_source": 100_000}, "pixels"),
    ({"devices_per_domain": 10 ** 9}, "'devices_per_domain'"),
    ({"trainable_scope": "everything"}, "'trainable_scope'"),
    ({"dropout_prob": 1.0}, "'dropout_prob'"),
    ({"secure_graph": "star"}, "'secure_graph'"),
    ({"timeout_s": float("nan")}, "'timeout_s'"),
    ({"timeout_s": 10 ** 400}, "'timeout_s'"),
    ({"domains": ["fog", "rain", "fog"]}, "'domains' names 'fog' more than once"),    # a review's finding
    ({"seeds": [0, 1, 0]}, "'seeds' names 0 more than once"),     # a repeated seed reran into the same seed0 folder
    ({"secure": True, "min_cluster_contributors": 1}, "'min_cluster_contributors'"),
]


@pytest.mark.parametrize("fields,words", BAD, ids=[json.dumps(f)[:60] for f, _ in BAD])
def test_a_bad_field_or_combination_is_one_error_naming_it(fields, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[")):
        LaddSimConfig(**{**QUICK, **fields})


def test_the_defaults_and_the_quick_run_are_accepted():
    assert LaddSimConfig().image_size == 64
    quick = LaddSimConfig(**QUICK)
    assert quick.seeds == (0,) and quick.images_per_device == (6, 8)
    assert LaddSimConfig(**{**QUICK, "seeds": [3, 4], "domains": ["fog", "rain"]}).domains == ("fog", "rain")


@pytest.mark.parametrize("fields,words", [({"lr": -1}, "'lr'"), ({"k_min": 6, "k_max": 3}, "k_min"),
                                          ({"image_size": 1024, "n_source": 100_000}, "pixels"),
                                          ({"domains": ["fog", "fog"]}, "'fog' more than once"),
                                          ({"secure": True, "min_cluster_contributors": 1}, "min_cluster_contributors")])
def test_the_command_refuses_a_bad_ladd_config_in_one_line_before_anything_runs(fields, words, tmp_path, capsys,
                                                                                monkeypatch):
    import fedfleet.ladd.run
    from fedfleet.cli import main

    ran = []
    monkeypatch.setattr(fedfleet.ladd.run, "run_ladd", lambda cfg, quiet=False: ran.append(cfg) or {})
    path = tmp_path / "ladd.json"
    path.write_text(json.dumps(fields))
    code = main(["simulate", "--pipeline", "ladd", "--quick", "--ladd-config", str(path), "--out", str(tmp_path / "o")])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and not ran, lines
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in lines[0], lines


def test_the_trainable_scopes_are_the_networks():
    from edge_client.models.segmentation import TRAINABLE_SCOPES

    from fedfleet.ladd import config

    assert config.TRAINABLE_SCOPES == TRAINABLE_SCOPES
