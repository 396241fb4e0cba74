"""Per-device system heterogeneity for the emulated fleet: speed, uplink, dropout, availability.

A ``DeviceProfile`` is plain data plus the arithmetic the fleet runner needs: how long to
sleep after a measured compute step, how long an upload of n bytes takes, whether the
device is online at time t (seconds since fleet start). ``sample_profiles`` draws a
heterogeneous fleet from one seed; ``to_dict``/``from_dict`` carry profiles through JSON
config files so a run can be repeated with the exact same fleet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


@dataclass(frozen=True)
class DeviceProfile:
    """System behaviour of one emulated device.

    compute_slowdown: >= 1; the device's compute takes this many times the measured host
        time (the runner sleeps ``extra_compute_delay(measured)`` after each step).
    upload_bytes_per_s: uplink cap in bytes/s; None means unlimited.
    dropout_prob: probability that the device drops out in the middle of a task, per task.
    availability: sorted, disjoint half-open ``[start, end)`` windows in seconds since fleet
        start during which the device is online; empty means always online.
    """

    device_id: str
    compute_slowdown: float = 1.0
    upload_bytes_per_s: float | None = None
    dropout_prob: float = 0.0
    availability: tuple[tuple[float, float], ...] = ()

    def __post_init__(self):
        if not isinstance(self.device_id, str) or not self.device_id:
            raise ValueError(f"device_id must be a non-empty string, got {self.device_id!r}")
        if not _is_number(self.compute_slowdown) or not math.isfinite(self.compute_slowdown) or self.compute_slowdown < 1:
            raise ValueError(f"{self.device_id}: compute_slowdown must be a finite number >= 1, got {self.compute_slowdown!r}")
        if self.upload_bytes_per_s is not None and (
            not _is_number(self.upload_bytes_per_s)
            or not math.isfinite(self.upload_bytes_per_s)
            or self.upload_bytes_per_s <= 0
        ):
            raise ValueError(
                f"{self.device_id}: upload_bytes_per_s must be None or a finite number > 0, got {self.upload_bytes_per_s!r}"
            )
        if not _is_number(self.dropout_prob) or not 0 <= self.dropout_prob <= 1:
            raise ValueError(f"{self.device_id}: dropout_prob must be in [0, 1], got {self.dropout_prob!r}")
        # Normalise to floats and tuples (lists arrive from JSON); frozen, hence object.__setattr__.
        object.__setattr__(self, "compute_slowdown", float(self.compute_slowdown))
        if self.upload_bytes_per_s is not None:
            object.__setattr__(self, "upload_bytes_per_s", float(self.upload_bytes_per_s))
        object.__setattr__(self, "dropout_prob", float(self.dropout_prob))
        object.__setattr__(self, "availability", self._checked_windows(self.availability))

    def _checked_windows(self, windows) -> tuple[tuple[float, float], ...]:
        checked = []
        for window in windows:
            if len(window) != 2 or not all(_is_number(x) and math.isfinite(x) for x in window):
                raise ValueError(f"{self.device_id}: availability window must be (start, end) finite numbers, got {window!r}")
            start, end = float(window[0]), float(window[1])
            if not 0 <= start < end:
                raise ValueError(f"{self.device_id}: availability window needs 0 <= start < end, got {window!r}")
            if checked and start < checked[-1][1]:
                raise ValueError(f"{self.device_id}: availability windows must be sorted and disjoint, got {windows!r}")
            checked.append((start, end))
        return tuple(checked)

    def is_available(self, t: float) -> bool:
        """Whether the device is online at ``t`` seconds since fleet start."""
        if not self.availability:
            return True
        return any(start <= t < end for start, end in self.availability)

    def next_online_time(self, t: float) -> float | None:
        """Earliest time >= ``t`` at which the device is online; None if it never is again."""
        if self.is_available(t):
            return float(t)
        return next((start for start, _ in self.availability if start > t), None)

    def upload_delay(self, nbytes: int) -> float:
        """Seconds an upload of ``nbytes`` takes at the capped rate (0 when uncapped)."""
        if not _is_number(nbytes) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative number, got {nbytes!r}")
        if self.upload_bytes_per_s is None:
            return 0.0
        return nbytes / self.upload_bytes_per_s

    def extra_compute_delay(self, measured_compute_s: float) -> float:
        """Seconds to sleep after a compute step that took ``measured_compute_s`` on the host."""
        if not _is_number(measured_compute_s) or not math.isfinite(measured_compute_s) or measured_compute_s < 0:
            raise ValueError(f"measured_compute_s must be a finite number >= 0, got {measured_compute_s!r}")
        return measured_compute_s * (self.compute_slowdown - 1.0)

    def draws_dropout(self, rng: np.random.Generator) -> bool:
        """One Bernoulli(dropout_prob) draw: does the device drop out of this task?"""
        return bool(rng.random() < self.dropout_prob)

    def to_dict(self) -> dict:
        return {
            "device_id": self.device_id,
            "compute_slowdown": self.compute_slowdown,
            "upload_bytes_per_s": self.upload_bytes_per_s,
            "dropout_prob": self.dropout_prob,
            "availability": [list(window) for window in self.availability],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "DeviceProfile":
        if not isinstance(data, dict):
            raise ValueError(f"a device profile must be a JSON object, got {type(data).__name__}")
        known = {"device_id", "compute_slowdown", "upload_bytes_per_s", "dropout_prob", "availability"}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown device profile keys {sorted(unknown)}; known: {sorted(known)}")
        if "device_id" not in data:
            raise ValueError("device profile lacks device_id")
        return cls(**data)


def _checked_range(bounds, name: str, min_low: float) -> tuple[float, float]:
    try:
        low, high = bounds
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a (low, high) pair, got {bounds!r}") from None
    if not (_is_number(low) and _is_number(high) and math.isfinite(high) and min_low <= low <= high):
        raise ValueError(f"{name} must be (low, high) with {min_low} <= low <= high finite, got {bounds!r}")
    return float(low), float(high)


def _log_uniform(rng: np.random.Generator, bounds: tuple[float, float], n: int) -> np.ndarray:
    low, high = bounds
    return np.exp(rng.uniform(math.log(low), math.log(high), size=n))


def sample_profiles(
    n_devices: int,
    seed: int,
    *,
    slowdown: tuple[float, float] = (1.0, 4.0),
    bandwidth_bps: tuple[float, float] | None = (2e6, 50e6),
    dropout_prob: float | tuple[float, float] = 0.05,
    availability_fraction: float = 1.0,
    horizon_s: float = 600.0,
    id_prefix: str = "dev",
) -> list[DeviceProfile]:
    """Draw a heterogeneous fleet of ``n_devices`` profiles, ids ``f"{id_prefix}{i:04d}"``.

    slowdown: log-uniform range of compute slowdowns (low >= 1).
    bandwidth_bps: log-uniform range of uplink rates in **bits** per second (stored as
        bytes/s = bps / 8); None gives unlimited uplinks.
    dropout_prob: one probability for every device, or a (low, high) uniform range.
    availability_fraction: share of ``[0, horizon_s)`` each device is online, as one window
        at a uniformly random offset; 1.0 means always online (empty window list).
    """
    if isinstance(n_devices, bool) or not isinstance(n_devices, (int, np.integer)) or n_devices < 1:
        raise ValueError(f"n_devices must be an int >= 1, got {n_devices!r}")
    slowdown = _checked_range(slowdown, "slowdown", min_low=1.0)
    if bandwidth_bps is not None:
        bandwidth_bps = _checked_range(bandwidth_bps, "bandwidth_bps", min_low=0.0)
        if bandwidth_bps[0] == 0:
            raise ValueError(f"bandwidth_bps low must be > 0 (use None for unlimited), got {bandwidth_bps!r}")
    if not _is_number(dropout_prob):
        dropout_prob = _checked_range(dropout_prob, "dropout_prob", min_low=0.0)
        if dropout_prob[1] > 1:
            raise ValueError(f"dropout_prob range must lie in [0, 1], got {dropout_prob!r}")
    elif not 0 <= dropout_prob <= 1:
        raise ValueError(f"dropout_prob must be in [0, 1], got {dropout_prob!r}")
    if not _is_number(availability_fraction) or not 0 < availability_fraction <= 1:
        raise ValueError(f"availability_fraction must be in (0, 1], got {availability_fraction!r}")
    if not _is_number(horizon_s) or not math.isfinite(horizon_s) or horizon_s <= 0:
        raise ValueError(f"horizon_s must be a finite number > 0, got {horizon_s!r}")
    rng = np.random.default_rng(seed)

    slowdowns = _log_uniform(rng, slowdown, n_devices)
    if bandwidth_bps is None:
        uploads = [None] * n_devices
    else:
        uploads = list(_log_uniform(rng, bandwidth_bps, n_devices) / 8.0)
    if _is_number(dropout_prob):
        dropouts = np.full(n_devices, float(dropout_prob))
    else:
        dropouts = rng.uniform(*dropout_prob, size=n_devices)
    if availability_fraction >= 1:
        windows = [()] * n_devices
    else:
        online_s = availability_fraction * horizon_s
        starts = rng.uniform(0.0, horizon_s - online_s, size=n_devices)
        windows = [((float(s), float(s + online_s)),) for s in starts]

    return [
        DeviceProfile(
            device_id=f"{id_prefix}{i:04d}",
            compute_slowdown=float(slowdowns[i]),
            upload_bytes_per_s=None if uploads[i] is None else float(uploads[i]),
            dropout_prob=float(dropouts[i]),
            availability=windows[i],
        )
        for i in range(n_devices)
    ]
