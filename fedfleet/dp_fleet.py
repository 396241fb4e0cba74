"""Differentially private Fed3R on the emulated fleet: ``fedfleet simulate --dp-epsilon ε``.

What ``bench/dp_fleet_scale.py`` computes from the fleet's sums, run through real devices and a
real broker: every device clips its rows, caps its samples and (with ``--secure``, Fed3R-Sync's
distributed DP) adds its own share of the noise; with a center (``dp_center_devices``) the first
round's devices release the features' mean and the rest centre on it
(``aggregator/strategies/dp_center.py``).

Central DP (``--dp-release end``, the default) holds every round's exact sum and releases them once,
when the job ends: the preset's rounds and retries run as they would without DP, and the model
holds one release's noise (``fedfleet simulate --config fleet-100k --dp-epsilon 1
--dp-center-devices 2000``: 0.807 against 0.8125 without DP, all 100,000 devices in 38 rounds and
their retries). ``--dp-release round`` releases each round's sum with noise of its own,
so the run then asks the whole fleet in one round and nobody twice: a device that drops out is
lost rather than asked again in a release of its own, and ``dp_min_round_devices`` keeps devices
that come online late from opening one. ``fedfleet simulate --config fleet-100k --dp-epsilon 1
--dp-center-devices 2000 --dp-release round`` kept 0.803 against 0.8125 without DP in one release,
where the preset's 10,000 per round and retries, each round released, made 26 releases and 0.762
(docs/algorithms.md, "Rounds are releases").

The job's noise multiplier is the smallest its own accountant allows for one release at (ε, δ) —
PLD for central ``ssp``, RDP for the secure release — so what the run reports is what an operator
asking for that ε gets. The report puts the private model beside the centralized ridge without DP
on the same devices' features (what the DP goals are read against; a plain run's exact match does
not apply: the model carries noise by design).
"""

from __future__ import annotations

from aggregator.compute.privacy import noise_multiplier_for
from aggregator.jobs.registry import kind_of


def dp_job_fields(cfg, kind: str, job: dict) -> dict:
    """The DP fields of the ``kind`` job (fed3r or fed3r-sync) built from ``job`` at the config's
    ε: δ (default 1/devices), the clip F and cap N, the center round and its clip F_c, and z."""
    if cfg.classifier != "fed3r":
        raise ValueError(f"--dp-epsilon: DP Fed3R only (the ridge classifier), not {cfg.classifier!r}")
    delta = cfg.dp_delta or 1.0 / max(cfg.devices, 1)
    fields = {"feature_clip_norm": cfg.dp_clip, "max_samples": cfg.dp_max_samples, "dp_delta": delta,
              "dp_center_devices": cfg.dp_center_devices,
              "dp_center_clip_norm": cfg.dp_center_clip if cfg.dp_center_devices else 0.0}
    if cfg.secure:
        fields["dp_group_threshold"] = cfg.dp_group_threshold
    elif cfg.dp_release == "end":
        fields["dp_release"] = "end"        # the preset's rounds and retries; one release when the job ends
    if one_round(cfg.dp_epsilon, cfg.secure, cfg.dp_release):
        # every round is a release with noise of its own, so k rounds leave k times one release's
        # noise variance in the model: the fleet in one round (after the center's), nobody asked twice
        # (a device that comes online after it is lost rather than opening a release of its own)
        fields.update(clients_per_round=cfg.devices, max_attempts=1,
                      dp_min_round_devices=max(1, (cfg.devices - cfg.dp_center_devices) // 2))
    # the job's own accountant (its config says which): z for exactly one release at (ε, δ)
    accounting = kind_of(kind).config_cls(**{**job, **fields, "dp_noise_multiplier": 1.0}).accounting()
    z = noise_multiplier_for(cfg.dp_epsilon, delta, 1, accounting=accounting)
    return {**fields, "dp_noise_multiplier": z, "dp_target_epsilon": cfg.dp_epsilon}


def one_round(dp_epsilon: float | None, secure: bool | None, dp_release: str | None) -> bool:
    """Whether the run asks each device once, in one round: central DP Fed3R releasing each round
    (with ``dp_release`` "end" the job releases once whatever its rounds; Fed3R-Sync's groups are
    releases each, of κ devices: ``clients_per_round`` decides how many)."""
    return bool(dp_epsilon) and not secure and dp_release == "round"


def dp_report_lines(r: dict) -> list[str]:
    """The report's privacy lines: the guarantee the job accounted and the private model's distance
    from the centralized ridge without DP."""
    privacy = r.get("privacy") or {}
    lines = [f"privacy                 ε = {privacy.get('epsilon', float('nan')):.3f} at δ = "
             f"{privacy.get('delta', float('nan')):.1e} ({privacy.get('accounting', '?')}, noise multiplier "
             f"{privacy.get('noise_multiplier', float('nan')):.3f}, {privacy.get('releases', 0)} release); the model "
             f"holds {privacy.get('noisy_sums', '?')} noisy round sum(s)"]
    if r.get("central_accuracy") is not None and r.get("fed3r_accuracy") is not None:
        lines.append(f"cost of DP              {100 * (r['fed3r_accuracy'] - r['central_accuracy']):+.2f} points "
                     "against the centralized ridge above (no noise, no clip, no cap)")
    return lines
