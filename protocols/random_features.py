"""Random Fourier features (Rahimi & Recht) from a seed, reproducible in any language.

Fed3R-RF needs every device and the aggregator to use the *same* projection ω ∈ R^{d×D} and
phases β ∈ R^D; shipping ω would cost d·D floats per device (51 MB for d=1280, D=10k), so the
aggregator announces a 64-bit seed and every party regenerates ω from it. numpy's generators are
not specified outside numpy, so the stream is defined here from first principles:

1. key = SHA-256(b"fedfleet/rff/v1" || seed as 8 bytes little-endian)[:16]
2. stream = AES-128-CTR(key, counter block = 16 zero bytes) keystream, read as uint64 little-endian
3. uniform u_i = (stream_i >> 11) · 2^-53  ∈ [0, 1)
4. ω (row-major d×D): entry j uses u_{2j}, u_{2j+1}:  sqrt(-2·ln(1 − u_{2j})) · cos(2π·u_{2j+1})  (Box–Muller)
5. β_k = 2π · u_{2dD + k}
6. features: φ(z) = sqrt(2/D) · cos(z·ω/σ + β)   (Gaussian kernel exp(-‖z−ζ‖²/(2σ²)))

Golden values for a small seed are pinned in tests so other implementations can check theirs.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

_BLOCK_WORDS = 1 << 20  # generate the stream in 8 MiB pieces to bound memory


def uniform_stream(seed: int, count: int, start: int = 0) -> np.ndarray:
    """``count`` uniforms in [0,1) from word ``start`` of the seed's stream (start must be even)."""
    if not (0 <= seed < 2**64):
        raise ValueError("seed must fit in 64 bits")
    key = hashlib.sha256(b"fedfleet/rff/v1" + seed.to_bytes(8, "little")).digest()[:16]
    # CTR mode over a 128-bit counter: word w lives in block w // 2.
    if start % 2:
        raise ValueError("start must be even (block aligned)")
    counter = (start // 2).to_bytes(16, "big")
    enc = Cipher(algorithms.AES(key), modes.CTR(counter)).encryptor()
    words = np.frombuffer(enc.update(bytes(8 * count)), dtype="<u8")
    return (words >> np.uint64(11)).astype(np.float64) * 2.0**-53


class RandomFourierFeatures:
    """scikit-learn style transformer: ``fit`` only records the input dimension."""

    def __init__(self, n_components: int = 5000, sigma: float = 1000.0, seed: int = 0):
        self.n_components = n_components
        self.sigma = sigma
        self.seed = seed

    def fit(self, X: np.ndarray | None = None, y=None, n_features: int | None = None) -> "RandomFourierFeatures":
        d = n_features if n_features is not None else np.asarray(X).shape[1]
        if self.n_components < 1 or self.sigma <= 0 or d < 1:
            raise ValueError("need n_components >= 1, sigma > 0 and at least one input feature")
        D = self.n_components
        omega = np.empty(d * D, dtype=np.float64)
        step = _BLOCK_WORDS
        for s in range(0, d * D, step // 2):
            m = min(step // 2, d * D - s)
            u = uniform_stream(self.seed, 2 * m, start=2 * s)
            omega[s:s + m] = np.sqrt(-2.0 * np.log1p(-u[0::2])) * np.cos(2.0 * math.pi * u[1::2])
        self.omega_ = omega.reshape(d, D)
        self.phase_ = 2.0 * math.pi * uniform_stream(self.seed, D, start=2 * d * D)
        self.n_features_in_ = d
        return self

    def transform(self, X: np.ndarray) -> np.ndarray:
        X = np.asarray(X, dtype=np.float64)
        if X.ndim != 2 or X.shape[1] != self.n_features_in_:
            raise ValueError(f"expected (n, {self.n_features_in_}) features, got {X.shape}")
        proj = X @ self.omega_
        proj /= self.sigma
        proj += self.phase_
        np.cos(proj, out=proj)
        proj *= math.sqrt(2.0 / self.n_components)
        return proj

    def fit_transform(self, X, y=None):
        return self.fit(X).transform(X)
