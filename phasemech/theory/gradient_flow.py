"""The idealized retrieval model (``docs/theory.md``) and its gradient flow: per-head pooling
weights over the slots of a window, trained by gradient flow, predict which heads specialise on
which phases. The predictions re-derived from it are :mod:`phasemech.theory.derivations`.

Axes: ``head`` (H), ``slot`` (d, the local position in a window), ``phase`` (d, the target's
absolute phase), ``draw`` (offset draws for random offsets), ``step``.

State ``theta[head, slot]``, ``w_h = softmax(theta_h)``. Head ``h`` reads windows with offset
``o_h``: a target at phase ``phi`` sits at slot ``l(h, phi) = (phi - o_h) mod d``. Its window
scores ``beta c_l w`` against ``N - 1`` distractors scoring 0, so head ``h`` adds
``alpha g_l(w_{h,l})`` to the margin, ``g_l(w) = w sigmoid(beta c_l w - log(N-1))``;
``m_phi = alpha sum_h g``; loss ``L = sum_phi pi_phi log(1 + (V-1) exp(-m_phi))``; accuracy proxy
``p_phi = sigmoid(m_phi - log(V-1))``. The replicator flow
``dtheta_{h,l} = w_{h,l} (F_{h,l} - sum_k w_{h,k} F_{h,k})``, ``F_{h,l} = sum_{phi: l(h,phi)=l}
pi_phi (1 - p_phi) alpha g_l'(w_{h,l})`` is exactly ``-dL/dtheta`` (tested by finite
differences). Random offsets (one grid shift per sequence) average the loss over offset draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from jaxtyping import Float
from scipy.optimize import brentq


@dataclass(frozen=True)
class TheoryConfig:
    """One idealized model. ``offsets``: ``"aligned"`` (all 0), ``"staggered"`` (``o_h = h mod
    d``), ``"random"`` (one shift per sequence shared by the heads: every shift once when
    ``draws >= d``, else ``draws`` sampled shifts), or explicit ints per
    head. ``gain``: ``c_l`` per slot (default all 1); ``pi``: training phase distribution
    (default uniform)."""

    d: int = 8
    heads: int = 8
    n_windows: int = 64  # N: the target window competes with N - 1 distractors
    vocab: int = 64
    alpha: float = 8.0
    beta: float = 8.0
    offsets: str | tuple[int, ...] = "aligned"
    gain: tuple[float, ...] | None = None
    pi: tuple[float, ...] | None = None
    draws: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        for name, low in (("d", 2), ("heads", 1), ("n_windows", 2), ("vocab", 2), ("draws", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"TheoryConfig: {name}={v!r} is invalid: expected an int >= {low}")
        for name in ("alpha", "beta"):
            if not getattr(self, name) > 0:
                raise ValueError(f"TheoryConfig: {name}={getattr(self, name)!r} must be > 0")
        if isinstance(self.offsets, str):
            if self.offsets not in ("aligned", "staggered", "random"):
                raise ValueError(
                    f"TheoryConfig: offsets={self.offsets!r} is invalid: expected 'aligned', "
                    "'staggered', 'random' or one int per head"
                )
        elif len(self.offsets) != self.heads:
            raise ValueError(
                f"TheoryConfig: offsets={self.offsets!r} has {len(self.offsets)} values for "
                f"{self.heads} heads"
            )
        for name in ("gain", "pi"):
            v = getattr(self, name)
            if v is not None and (len(v) != self.d or min(v) < 0):
                raise ValueError(
                    f"TheoryConfig: {name}={v!r} is invalid: expected {self.d} values >= 0"
                )
        if self.pi is not None and not math.isclose(sum(self.pi), 1.0, abs_tol=1e-6):
            raise ValueError(f"TheoryConfig: pi={self.pi!r} must sum to 1")

    @property
    def c(self) -> np.ndarray:
        return np.ones(self.d) if self.gain is None else np.asarray(self.gain, float)

    @property
    def phase_weights(self) -> np.ndarray:
        return np.full(self.d, 1.0 / self.d) if self.pi is None else np.asarray(self.pi, float)

    def offset_draws(self) -> np.ndarray:
        """``[draw, head]`` offsets; one row unless ``offsets="random"``."""
        h = np.arange(self.heads)
        if self.offsets == "aligned":
            return np.zeros((1, self.heads), int)
        if self.offsets == "staggered":
            return (h % self.d)[None]
        if self.offsets == "random":
            # one shift per sequence shared by all heads; with draws >= d every shift once (the
            # exact expectation: sampled draws leave some shifts out and fake a phase gap)
            shift = (
                np.arange(self.d)
                if self.draws >= self.d
                else np.random.default_rng(self.seed).integers(self.d, size=self.draws)
            )
            return np.repeat(shift[:, None], self.heads, axis=1)
        return np.asarray(self.offsets, int)[None] % self.d


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def g(w, beta: float, c, n_windows: int):
    """Head contribution per unit alpha: ``w sigmoid(beta c w - log(N-1))``."""
    return w * _sigmoid(beta * c * w - math.log(n_windows - 1))


def g_prime(w, beta: float, c, n_windows: int):
    s = _sigmoid(beta * c * w - math.log(n_windows - 1))
    return s + w * beta * c * s * (1 - s)


def g_second(w, beta: float, c, n_windows: int):
    s = _sigmoid(beta * c * w - math.log(n_windows - 1))
    k = beta * c
    return 2 * k * s * (1 - s) + w * k * k * s * (1 - s) * (1 - 2 * s)


def softmax(theta: Float[np.ndarray, "head slot"]) -> Float[np.ndarray, "head slot"]:
    e = np.exp(theta - theta.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _slots(cfg: TheoryConfig, offsets: np.ndarray) -> np.ndarray:
    """``[draw, head, phase]`` local slot of each phase."""
    phi = np.arange(cfg.d)
    return (phi[None, None, :] - offsets[:, :, None]) % cfg.d


def margins(theta, cfg: TheoryConfig) -> Float[np.ndarray, "draw phase"]:
    w = softmax(theta)
    slots = _slots(cfg, cfg.offset_draws())
    h = np.arange(cfg.heads)[None, :, None]
    wl = w[h, slots]  # [draw, head, phase]
    return cfg.alpha * g(wl, cfg.beta, cfg.c[slots], cfg.n_windows).sum(1)


def loss(theta, cfg: TheoryConfig) -> float:
    m = margins(theta, cfg)
    per = np.logaddexp(0.0, math.log(cfg.vocab - 1) - m)  # log(1 + (V-1) e^-m), stable
    return float((per * cfg.phase_weights[None]).sum(-1).mean())


def accuracy(theta, cfg: TheoryConfig) -> Float[np.ndarray, "phase"]:
    """``p_phi``, averaged over offset draws."""
    return _sigmoid(margins(theta, cfg) - math.log(cfg.vocab - 1)).mean(0)


def flow(theta, cfg: TheoryConfig) -> Float[np.ndarray, "head slot"]:
    """``dtheta/dt`` (the replicator form; equals ``-dL/dtheta``)."""
    w = softmax(theta)
    offsets = cfg.offset_draws()
    slots = _slots(cfg, offsets)  # [draw, head, phase]
    h = np.arange(cfg.heads)[None, :, None]
    wl = w[h, slots]
    m = cfg.alpha * g(wl, cfg.beta, cfg.c[slots], cfg.n_windows).sum(1)  # [draw, phase]
    r = 1.0 - _sigmoid(m - math.log(cfg.vocab - 1))
    push = cfg.phase_weights[None, None] * r[:, None, :] * cfg.alpha
    push = push * g_prime(wl, cfg.beta, cfg.c[slots], cfg.n_windows)  # [draw, head, phase]
    F = np.zeros((len(offsets), cfg.heads, cfg.d))
    np.add.at(F, (np.arange(len(offsets))[:, None, None], h, slots), push)
    F = F.mean(0)  # the expected loss over offset draws
    return w * (F - (w * F).sum(-1, keepdims=True))


@dataclass
class Trajectory:
    """``theta`` at the end, and per recorded step the weights, accuracy per phase and loss."""

    theta: np.ndarray
    steps: np.ndarray
    weights: np.ndarray  # [step, head, slot]
    accuracy: np.ndarray  # [step, phase]
    loss: np.ndarray
    extra: dict = field(default_factory=dict)

    def time_to_specialize(self, threshold: float = 0.5, dt: float = 0.5) -> float:
        """Flow time at which the mean over heads of the max weight first exceeds ``threshold``
        (``inf`` if never)."""
        top = self.weights.max(-1).mean(-1)
        hit = np.flatnonzero(top > threshold)
        return float(self.steps[hit[0]] * dt) if len(hit) else math.inf

    def covered(self, level: float = 0.9) -> int:
        """How many phases end with accuracy proxy >= ``level``."""
        return int((self.accuracy[-1] >= level).sum())

    @property
    def gap(self) -> float:
        return float(self.accuracy[-1].max() - self.accuracy[-1].min())


def simulate(
    cfg: TheoryConfig,
    steps: int = 4000,
    dt: float = 0.5,
    record_every: int = 50,
    init_scale: float = 0.01,
) -> Trajectory:
    """Euler steps ``theta += dt * flow`` from ``theta(0) ~ N(0, init_scale^2)``."""
    rng = np.random.default_rng(cfg.seed)
    theta = rng.normal(0.0, init_scale, size=(cfg.heads, cfg.d))
    rec_s, rec_w, rec_a, rec_l = [], [], [], []
    for t in range(steps + 1):
        if t % record_every == 0 or t == steps:
            rec_s.append(t)
            rec_w.append(softmax(theta))
            rec_a.append(accuracy(theta, cfg))
            rec_l.append(loss(theta, cfg))
        if t < steps:
            theta = theta + dt * flow(theta, cfg)
    return Trajectory(theta, np.array(rec_s), np.array(rec_w), np.array(rec_a), np.array(rec_l))


def uniform_eigenvalue(cfg: TheoryConfig) -> float:
    """``lambda_diff = alpha r* g''(1/d) / d^3`` at uniform pooling (slot gain 1): positive
    means uniform pooling is unstable and heads specialise."""
    d = cfg.d
    w = 1.0 / d
    m = cfg.alpha * cfg.heads * g(w, cfg.beta, 1.0, cfg.n_windows)
    r = 1.0 - _sigmoid(m - math.log(cfg.vocab - 1))
    return float(cfg.alpha * r * g_second(w, cfg.beta, 1.0, cfg.n_windows) / d**3)


def critical_beta_over_d(n_windows: int, d: int = 8) -> float:
    """The ``beta / d`` at which ``g''(1/d)`` changes sign (uniform pooling turns stable above
    it); compare with the rough prediction ``log(N - 1)``."""
    f = lambda b: g_second(1.0 / d, b, 1.0, n_windows)  # noqa: E731
    hi = 1.0
    while f(hi) > 0:
        hi *= 2
    return float(brentq(f, 1e-6, hi) / d)


def head_ablation(theta, cfg: TheoryConfig) -> Float[np.ndarray, "head phase"]:
    """Accuracy-proxy drop per phase when head ``h``'s margin contribution is removed: the
    theory's causal signature (a head should hurt mainly the phases its ``w_h`` covers)."""
    w = softmax(theta)
    offsets = cfg.offset_draws()
    slots = _slots(cfg, offsets)
    h = np.arange(cfg.heads)[None, :, None]
    per_head = cfg.alpha * g(w[h, slots], cfg.beta, cfg.c[slots], cfg.n_windows)  # [draw, h, phi]
    full = per_head.sum(1, keepdims=True)
    log_v = math.log(cfg.vocab - 1)
    return (_sigmoid(full - log_v) - _sigmoid(full - per_head - log_v)).mean(0)
