"""A plain-numpy reference of one softmax-head SGD step (cross-entropy on logits / T, L2 decay on
W and b, the mean over the batch): what the devices' head training is checked against."""

import numpy as np


def softmax_sgd_gradients(W: np.ndarray, b: np.ndarray, Z: np.ndarray, y: np.ndarray, rows: np.ndarray,
                          recipe) -> tuple[np.ndarray, np.ndarray]:
    """(∂loss/∂W, ∂loss/∂b) on the batch ``rows``, written from the formulas; ``recipe`` gives
    temperature and weight_decay."""
    logits = (Z[rows] @ W.T + b) / recipe.temperature
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(rows)), y[rows]] -= 1.0
    g = p / (recipe.temperature * len(rows))        # d loss / d logits (mean over rows)
    return g.T @ Z[rows] + recipe.weight_decay * W, g.sum(axis=0) + recipe.weight_decay * b
