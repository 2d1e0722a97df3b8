"""Numpy models of what the KVStore computes, written from MXNet's definitions: its
2-bit quantization rule and its SGD and Adam updates (float64 here)."""

from __future__ import annotations

import math

import numpy as np


def two_bit_model(gradient: np.ndarray, residual: np.ndarray,
                  threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """MXNet's rule, per element in float32: v = residual + gradient; v >= t sends +t,
    v <= -t sends -t, else 0; the new residual is v minus what was sent."""
    t = np.float32(threshold)
    v = (residual.astype(np.float32) + gradient.astype(np.float32)).astype(np.float32)
    sent = np.where(v >= t, t, np.where(v <= -t, -t, np.float32(0))).astype(np.float32)
    return sent, (v - sent).astype(np.float32)


def two_bit_words(sent: np.ndarray, threshold: float) -> np.ndarray:
    """The uint32 words MXNet packs ``sent`` (+t, -t or 0 per element) into: byte b of a
    word holds elements 4b..4b+3, element 4b+c in bits 7-2c and 6-2c (11: +t, 10: -t)."""
    count = sent.size
    data = np.zeros(((count + 15) // 16) * 4, np.uint8)
    for i, s in enumerate(sent.reshape(-1)):
        code = 3 if s == np.float32(threshold) else 2 if s == -np.float32(threshold) else 0
        data[i // 4] |= code << (6 - 2 * (i % 4))
    return data.view("<u4")


def _gradient(optimizer, weight: np.ndarray, grad: np.ndarray) -> np.ndarray:
    g = grad * optimizer.rescale_grad
    if optimizer.clip_gradient is not None:
        g = np.clip(g, -optimizer.clip_gradient, optimizer.clip_gradient)
    return g + optimizer.wd * weight


def sgd_reference(optimizer, initial: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    """Weights after SGD with momentum on ``grads``, one step each."""
    weight = initial.astype(np.float64)
    momentum = np.zeros_like(weight)
    for grad in grads:
        g = _gradient(optimizer, weight, grad.astype(np.float64))
        momentum = optimizer.momentum * momentum - optimizer.learning_rate * g
        weight = weight + momentum
    return weight


def adam_reference(optimizer, initial: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    """Weights after MXNet's Adam on ``grads``, one step each."""
    weight = initial.astype(np.float64)
    mean = np.zeros_like(weight)
    var = np.zeros_like(weight)
    for t, grad in enumerate(grads, start=1):
        g = _gradient(optimizer, weight, grad.astype(np.float64))
        lr = optimizer.learning_rate * math.sqrt(1 - optimizer.beta2 ** t) / \
            (1 - optimizer.beta1 ** t)
        mean = optimizer.beta1 * mean + (1 - optimizer.beta1) * g
        var = optimizer.beta2 * var + (1 - optimizer.beta2) * g * g
        weight = weight - lr * mean / (np.sqrt(var) + optimizer.epsilon)
    return weight
