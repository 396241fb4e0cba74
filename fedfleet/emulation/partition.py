"""Seeded splits of one dataset into per-device index sets for the emulated fleet.

Every splitter takes a seed, builds its own ``numpy.random.Generator`` from it, and
returns one sorted int64 index array per device. The same arguments always give the
same split; no index appears on two devices, except in ``split_long_tailed``, which draws
more device samples than the dataset holds (a cross-device fleet of 100,000 phones).

Empty-device policy: no splitter ever returns an empty device. When the data cannot
give every device at least one sample (``split_iid``), ``min_size`` samples
(``split_dirichlet``), or one sample of each of its classes (``split_k_classes``), the
splitter raises ``ValueError`` instead of silently producing idle devices.

Kinds of heterogeneity:

- ``split_iid``: a random permutation cut into near-equal parts (sizes differ by <= 1).
- ``split_dirichlet``: label skew. For each class c, proportions ``p_c ~ Dir_K(alpha)``
  over the K devices, and class c's samples are cut by those proportions (the per-class
  variant popularised by Hsu et al. 2019 / Yurochkin et al. 2019). Small alpha puts each
  class on few devices; large alpha tends to IID. All samples are assigned.
- ``split_k_classes``: pathological label skew, each device holds exactly k classes
  (k = 1 is the "alpha = 0" setting of the Fed3R paper when K equals the class count).
- ``split_long_tailed``: cross-device fleets: each device draws a long-tailed number of
  samples (a rounded log-normal clipped to [1, max_size], ``mean_size`` on average) with its
  own class mix ``Dir_C(alpha)``, from the whole dataset with replacement across devices (never
  twice on one device), so any number of devices can share one dataset.
"""

from __future__ import annotations

import math

import numpy as np

from edge_client.data.split import train_holdout_split  # noqa: F401  (a device splits its own data; re-exported)

# How often split_dirichlet redraws all proportions before it rebalances instead.
DIRICHLET_MAX_REDRAWS = 100


def _check_n_devices(n_devices: int) -> int:
    if isinstance(n_devices, bool) or not isinstance(n_devices, (int, np.integer)) or n_devices < 1:
        raise ValueError(f"n_devices must be an int >= 1, got {n_devices!r}")
    return int(n_devices)


def _check_labels(labels) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    if labels.size == 0:
        raise ValueError("labels is empty")
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must have an integer dtype, got {labels.dtype}")
    return labels


def _as_device_arrays(parts) -> list[np.ndarray]:
    return [np.sort(np.asarray(part, dtype=np.int64)) for part in parts]


def split_iid(n_samples: int, n_devices: int, seed: int) -> list[np.ndarray]:
    """Random near-equal split of ``range(n_samples)``; every sample used exactly once."""
    n_devices = _check_n_devices(n_devices)
    if isinstance(n_samples, bool) or not isinstance(n_samples, (int, np.integer)) or n_samples < 0:
        raise ValueError(f"n_samples must be a non-negative int, got {n_samples!r}")
    if n_samples < n_devices:
        raise ValueError(f"{n_samples} samples cannot give each of {n_devices} devices at least one")
    permutation = np.random.default_rng(seed).permutation(int(n_samples))
    return _as_device_arrays(np.array_split(permutation, n_devices))


def _dirichlet_counts(class_sizes: np.ndarray, n_devices: int, alpha: float, rng) -> np.ndarray:
    """(n_classes, n_devices) sample counts: class c cut by proportions drawn from Dir_K(alpha)."""
    proportions = rng.dirichlet(np.full(n_devices, alpha), size=len(class_sizes))
    # Cut points from the rounded cumulative proportions, so each row sums to its class size.
    cuts = np.rint(np.cumsum(proportions, axis=1) * class_sizes[:, None]).astype(np.int64)
    cuts[:, -1] = class_sizes
    return np.diff(cuts, axis=1, prepend=0)


def _rebalance(counts: np.ndarray, min_size: int, rng) -> np.ndarray:
    """Move single samples from the largest devices to devices below ``min_size``.

    Each moved sample keeps its class: it comes from a class the donor holds, chosen in
    proportion to the donor's holdings, so the donor's label mix is barely changed.
    """
    counts = counts.copy()
    sizes = counts.sum(axis=0)
    for receiver in np.flatnonzero(sizes < min_size):
        while sizes[receiver] < min_size:
            donor = int(np.argmax(sizes))
            cls = rng.choice(counts.shape[0], p=counts[:, donor] / sizes[donor])
            counts[cls, donor] -= 1
            counts[cls, receiver] += 1
            sizes[donor] -= 1
            sizes[receiver] += 1
    return counts


def split_dirichlet(
    labels, n_devices: int, alpha: float, seed: int, min_size: int = 1
) -> list[np.ndarray]:
    """Label-skewed split: class proportions over devices drawn from ``Dir(alpha)``.

    Every sample is assigned. Guarantee of ``min_size``: all proportions are redrawn up
    to ``DIRICHLET_MAX_REDRAWS`` times until every device holds >= ``min_size`` samples;
    if that still fails (tiny alpha with many devices), the last draw is rebalanced by
    moving samples one at a time from the largest device to each short device
    (see ``_rebalance``), which perturbs the Dirichlet draw only as much as needed.
    """
    labels = _check_labels(labels)
    n_devices = _check_n_devices(n_devices)
    if not isinstance(alpha, (int, float, np.floating, np.integer)) or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"alpha must be a finite number > 0, got {alpha!r} (use split_k_classes for alpha = 0)")
    if isinstance(min_size, bool) or not isinstance(min_size, (int, np.integer)) or min_size < 1:
        raise ValueError(f"min_size must be an int >= 1, got {min_size!r}")
    if len(labels) < n_devices * min_size:
        raise ValueError(
            f"{len(labels)} samples cannot give each of {n_devices} devices min_size={min_size}"
        )
    rng = np.random.default_rng(seed)
    classes, class_sizes = np.unique(labels, return_counts=True)

    for _ in range(DIRICHLET_MAX_REDRAWS):
        counts = _dirichlet_counts(class_sizes, n_devices, float(alpha), rng)
        if counts.sum(axis=0).min() >= min_size:
            break
    else:
        counts = _rebalance(counts, min_size, rng)

    parts: list[list[np.ndarray]] = [[] for _ in range(n_devices)]
    for cls, row in zip(classes, counts):
        members = rng.permutation(np.flatnonzero(labels == cls))
        for device, chunk in enumerate(np.split(members, np.cumsum(row)[:-1])):
            parts[device].append(chunk)
    return _as_device_arrays(np.concatenate(chunks) for chunks in parts)


def _assign_k_classes(n_classes: int, n_devices: int, k: int, rng) -> np.ndarray:
    """(n_devices, k) class ids: k distinct per device, each class on floor/ceil(K*k/C) devices.

    Greedy: each device takes the k classes with the most unfilled device slots, ties
    broken at random. With uniform row sums and column demands that differ by at most one
    (all <= n_devices), taking the largest remaining demands never gets stuck (Gale-Ryser).
    """
    base, extra = divmod(n_devices * k, n_classes)
    demand = np.full(n_classes, base, dtype=np.int64)
    demand[rng.choice(n_classes, size=extra, replace=False)] += 1
    assignment = np.empty((n_devices, k), dtype=np.int64)
    for device in range(n_devices):
        # Demands are integers, so noise in [0, 0.5) only reorders ties.
        chosen = np.argsort(-(demand + 0.5 * rng.random(n_classes)), kind="stable")[:k]
        assert demand[chosen].min() > 0, "greedy k-class assignment ran out of slots"
        demand[chosen] -= 1
        assignment[device] = chosen
    return assignment


def split_k_classes(labels, n_devices: int, k: int, seed: int) -> list[np.ndarray]:
    """Each device holds exactly ``k`` distinct classes; every sample is used exactly once.

    Class c is placed on m_c devices (m_c = floor or ceil of n_devices*k/n_classes) and its
    shuffled samples are cut into m_c near-equal shards, one per holding device. Raises
    ValueError when some class cannot be covered (n_devices*k < n_classes) or has fewer
    samples than the devices it must be spread over.
    """
    labels = _check_labels(labels)
    n_devices = _check_n_devices(n_devices)
    classes = np.unique(labels)
    n_classes = len(classes)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    if k > n_classes:
        raise ValueError(f"k={k} exceeds the {n_classes} classes present in labels")
    if n_devices * k < n_classes:
        raise ValueError(
            f"{n_devices} devices x {k} classes each cannot cover all {n_classes} classes; "
            f"samples of some classes would be unused"
        )
    rng = np.random.default_rng(seed)
    assignment = _assign_k_classes(n_classes, n_devices, int(k), rng)

    parts: list[list[np.ndarray]] = [[] for _ in range(n_devices)]
    for class_pos, cls in enumerate(classes):
        holders = np.flatnonzero((assignment == class_pos).any(axis=1))
        members = rng.permutation(np.flatnonzero(labels == cls))
        if len(members) < len(holders):
            raise ValueError(
                f"class {cls} has {len(members)} samples but must be spread over {len(holders)} devices"
            )
        for device, shard in zip(holders, np.array_split(members, len(holders))):
            parts[device].append(shard)
    return _as_device_arrays(np.concatenate(chunks) for chunks in parts)


def long_tailed_sizes(n_devices: int, mean_size: float, max_size: int, rng) -> np.ndarray:
    """Per-device sample counts: round(LogNormal(μ, 1)) clipped to [1, max_size], μ set so the
    unclipped mean is ``mean_size`` (most devices hold a handful, a few hold dozens)."""
    mu = math.log(mean_size) - 0.5
    return np.clip(np.rint(rng.lognormal(mu, 1.0, n_devices)), 1, max_size).astype(np.int64)


def split_long_tailed(labels, n_devices: int, alpha: float, seed: int, mean_size: float = 5.0,
                      max_size: int = 50) -> list[np.ndarray]:
    """Each device: a long-tailed count of samples, its classes drawn from its own ``Dir_C(alpha)``
    and, within a class, samples drawn without replacement on the device (with replacement
    across devices). A device whose mix names a class it cannot fill takes what the class has."""
    labels = _check_labels(labels)
    n_devices = _check_n_devices(n_devices)
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
    if not (1 <= mean_size <= max_size) or int(max_size) != max_size:
        raise ValueError(f"need 1 <= mean_size <= max_size (an int), got {mean_size!r}, {max_size!r}")
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    pools = [np.flatnonzero(labels == c) for c in classes]
    sizes = long_tailed_sizes(n_devices, float(mean_size), int(max_size), rng)
    mixes = rng.dirichlet(np.full(len(classes), float(alpha)), size=n_devices)
    parts = []
    for size, mix in zip(sizes, mixes):
        per_class = np.bincount(rng.choice(len(classes), size=int(size), p=mix), minlength=len(classes))
        chosen = [rng.choice(pools[c], size=min(k, len(pools[c])), replace=False)
                  for c, k in enumerate(per_class) if k]
        parts.append(np.concatenate(chosen))
    return _as_device_arrays(parts)


_SPLIT_PARAMS = {"iid": set(), "dirichlet": {"alpha", "min_size"}, "classes": {"k"},
                 "long-tailed": {"alpha", "mean_size", "max_size"}}
SPLIT_KINDS = tuple(_SPLIT_PARAMS)
_REQUIRED_PARAMS = {"iid": set(), "dirichlet": {"alpha"}, "classes": {"k"}, "long-tailed": {"alpha"}}


def make_split(kind: str, labels, n_devices: int, seed: int, **params) -> list[np.ndarray]:
    """Dispatch by name: ``"iid"``, ``"dirichlet"`` (alpha, min_size=1), ``"classes"`` (k) or
    ``"long-tailed"`` (alpha, mean_size=5, max_size=50)."""
    if kind not in _SPLIT_PARAMS:
        raise ValueError(f"unknown split kind {kind!r}; use one of {sorted(_SPLIT_PARAMS)}")
    unknown = set(params) - _SPLIT_PARAMS[kind]
    missing = _REQUIRED_PARAMS[kind] - set(params)
    if unknown or missing:
        raise ValueError(
            f"split {kind!r} takes parameters {sorted(_SPLIT_PARAMS[kind])}"
            f" (required {sorted(_REQUIRED_PARAMS[kind])}); unknown {sorted(unknown)}, missing {sorted(missing)}"
        )
    labels = _check_labels(labels)
    if kind == "iid":
        return split_iid(len(labels), n_devices, seed)
    if kind == "dirichlet":
        return split_dirichlet(labels, n_devices, seed=seed, **params)
    if kind == "long-tailed":
        return split_long_tailed(labels, n_devices, seed=seed, **params)
    return split_k_classes(labels, n_devices, seed=seed, **params)


def mean_label_jaccard(labels, parts: list[np.ndarray]) -> float:
    """Heterogeneity of a split, Eq. (9) of the Fed3R paper: (1/K^2) sum_k sum_h J(C_k, C_h).

    C_k is the set of labels on device k; the sum includes k = h. 1 for IID-like splits
    (every device sees every class), 1/K when devices share no class.
    """
    labels = _check_labels(labels)
    classes = np.unique(labels)
    membership = np.stack([np.isin(classes, labels[np.asarray(part, dtype=np.int64)]) for part in parts])
    membership = membership.astype(np.int64)
    intersections = membership @ membership.T
    set_sizes = membership.sum(axis=1)
    unions = set_sizes[:, None] + set_sizes[None, :] - intersections
    jaccard = np.divide(intersections, unions, out=np.zeros(unions.shape), where=unions > 0)
    return float(jaccard.mean())
