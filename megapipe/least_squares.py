"""Nonlinear least squares for megapipe's fits: Levenberg-Marquardt on a black-box residual.

Marquardt 1963; Nocedal & Wright, *Numerical Optimization*, sec. 10.3. The step is taken in the
SVD basis of the finite-difference Jacobian, truncated to its well-determined directions, so a
parameter combination the data cannot fix stays at its starting value instead of drifting.
Pure: numpy only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["jacobian", "kept_directions", "levenberg_marquardt", "identified"]

_RCOND = 1e-3
"""Singular values below this share of the largest mark parameter combinations the data cannot fix."""

Residual = Callable[[np.ndarray], np.ndarray]


def jacobian(residual: Residual, theta: np.ndarray, base: np.ndarray, *, step: float = 1e-5) -> np.ndarray:
    """Central differences of ``residual`` at ``theta`` (``base`` = residual(theta), for its length)."""
    columns = []
    for index in range(theta.size):
        delta = np.zeros_like(theta)
        delta[index] = step
        columns.append((residual(theta + delta) - residual(theta - delta)) / (2 * step))
    return np.stack(columns, axis=1) if columns else np.zeros((base.size, 0))


def kept_directions(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(U, singular values, V^T) of ``matrix`` without the directions below _RCOND of the largest."""
    u, singular, vt = np.linalg.svd(matrix, full_matrices=False)
    keep = singular > _RCOND * (singular[0] if singular.size else 0.0)
    return u[:, keep], singular[keep], vt[keep]


def levenberg_marquardt(residual: Residual, theta: np.ndarray, *, max_iter: int,
                        step: float = 1e-5, tolerance: float = 1e-12) -> tuple[np.ndarray, int]:
    """Minimise ``|residual(theta)|^2`` from ``theta``; returns (theta, iterations)."""
    damping, current = 1e-3, residual(theta)
    for iteration in range(1, max_iter + 1):
        u, singular, vt = kept_directions(jacobian(residual, theta, current, step=step))
        if not singular.size:
            return theta, iteration
        projected = u.T @ current
        improved, move = False, np.zeros_like(theta)
        while damping < 1e12:
            move = -vt.T @ (singular * projected / (singular**2 + damping * singular[0] ** 2))
            candidate = residual(theta + move)
            if candidate @ candidate < current @ current:
                theta, current, damping, improved = theta + move, candidate, max(damping / 10, 1e-15), True
                break
            damping *= 10
        if not improved or np.max(np.abs(move), initial=0.0) < tolerance:
            return theta, iteration
    return theta, max_iter


def identified(matrix: np.ndarray, names: Sequence[str]) -> list[str]:
    """Names of the parameters mostly inside the well-determined directions of a Jacobian."""
    if matrix.size == 0:
        return []
    _, _, vt = kept_directions(matrix)
    share = np.sum(vt**2, axis=0)
    return [name for name, weight in zip(names, share) if weight > 0.5]
