"""The linear head's SGD step in numpy: what a torch-free device (``fedfleet[device]``) trains with.

Same step as the eager ``TemperatureScaledHead`` + SGD of ``head_training._TorchHeadStepper`` and
the exported head training program: ``logits = f W^T + b``, mean cross-entropy on
``logits / T``, then ``param -= lr * (grad + weight_decay * param)``. The gradient is written out
(softmax minus one-hot, divided by ``n T``) since a linear head needs no autograd.
"""

from __future__ import annotations

import numpy as np


class NumpyHeadStepper:
    """One mini-batch SGD step of a temperature-scaled linear softmax head, in float32 numpy."""

    runtime = "numpy"

    def __init__(self, weight: np.ndarray, bias: np.ndarray, recipe):
        self.weight = np.array(weight, dtype=np.float32)
        self.bias = np.array(bias, dtype=np.float32)
        self.temperature = np.float32(recipe.temperature)
        self.lr, self.weight_decay = np.float32(recipe.lr), np.float32(recipe.weight_decay)

    def step(self, features: np.ndarray, labels: np.ndarray) -> float:
        features = np.asarray(features, dtype=np.float32)
        n = len(labels)
        scaled = (features @ self.weight.T + self.bias) / self.temperature
        scaled -= scaled.max(axis=1, keepdims=True)               # log-softmax without overflow
        log_p = scaled - np.log(np.exp(scaled).sum(axis=1, keepdims=True))
        loss = -float(log_p[np.arange(n), labels].mean())
        d_logits = np.exp(log_p)
        d_logits[np.arange(n), labels] -= 1.0
        d_logits /= np.float32(n) * self.temperature               # d mean-loss / d logits
        grads = (d_logits.T @ features, d_logits.sum(axis=0))
        for param, grad in zip((self.weight, self.bias), grads):
            if self.weight_decay:
                grad = grad + self.weight_decay * param
            param -= self.lr * grad.astype(np.float32)
        return loss

    def parameters(self) -> dict[str, np.ndarray]:
        return {"weight": self.weight.copy(), "bias": self.bias.copy()}
