"""The idealized retrieval model (``docs/theory.md``): per-head pooling weights over the slots of a
window, trained by gradient flow, predict which heads specialise on which phases.

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
from dataclasses import dataclass, field, replace

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


#: the reference numbers of the model's original numerical check (docs/theory.md), side by side
THEORY_MD = {
    "plateau": {16: 100, 64: 225, 256: 725, 1024: 2725},
    "capacity_h2_accuracy": 0.57,
    "handicap": {
        "aligned": {"gap": 0.73, "mean": 0.86},
        "staggered": {"gap": 0.00, "mean": 0.99},
        "random": {"gap": 0.04, "mean": 0.65},
    },
}


def _setup(cfg: TheoryConfig, **extra: str) -> str:
    """The parameters of a prediction, as text for the reader (read off the config used)."""
    parts = {"d": cfg.d, "H": cfg.heads, "N": cfg.n_windows, "beta": f"{cfg.beta:g}"}
    parts |= {"alpha": f"{cfg.alpha:g}", "V": cfg.vocab} | extra  # extra overrides
    return ", ".join(f"{k}={v}" for k, v in parts.items())


def predictions(scale: float = 1.0) -> dict:
    """Re-derive every prediction of the model (about 40 s at ``scale=1``; ``scale`` < 1
    shortens the simulations, for tests). alpha 8, V 64 (the model leaves them open). Each
    section carries its ``setup`` (the parameters, read off the configs) and ``checks`` holds
    the model's qualitative predictions as booleans computed from the numbers."""
    steps = max(int(6000 * scale), 50)
    base = TheoryConfig(d=8, heads=8, n_windows=64, beta=8.0)
    out: dict = {"alpha": base.alpha, "vocab": base.vocab, "steps": steps, "dt": 0.5}
    out["theory_md"] = {k: v for k, v in THEORY_MD.items() if k != "plateau"}
    ns = (16, 64, 256, 1024)
    out |= _critical(base, ns)
    out["stability"] = _stability(base, steps)
    out["stability_setup"] = _setup(base, beta="2d, 4d, 6d")
    out |= _plateau(base, ns, steps)
    out["capacity"] = _capacity(base, steps)
    out["capacity_setup"] = _setup(base, H="2..12")
    # the level a covered phase reaches is set by alpha: the reference ~0.57 at H = 2
    low = replace(base, heads=2, alpha=4.5)
    tr = simulate(low, steps=steps)
    out["capacity_low_alpha"] = {
        "setup": _setup(low),
        "covered_level": float(tr.accuracy[-1].max()),
    }
    # shared slot handicap c_l = 0.8^(d-1-l)
    hand = replace(base, beta=16.0, gain=tuple(0.8 ** (base.d - 1 - sl) for sl in range(base.d)))
    out["handicap"] = _handicap(hand, steps)
    out["handicap_setup"] = _setup(hand, c_l="0.8^(d-1-l)")
    out["concentrated"] = _concentrated(base, steps)
    out["ablation"] = _ablation(base, steps)
    out["setup"] = _setup(base)
    out["checks"] = _checks(out, base)
    return out


def _critical(base: TheoryConfig, ns: tuple[int, ...]) -> dict:
    crit = [critical_beta_over_d(n, d=base.d) for n in ns]
    logs = [math.log(n - 1) for n in ns]
    return {
        "critical": [
            {"n_windows": n, "critical_beta_over_d": c, "log_n_minus_1": lg}
            for n, c, lg in zip(ns, crit, logs, strict=True)
        ],
        "critical_slope": float(np.polyfit(logs, crit, 1)[0]),
    }


def _stability(base: TheoryConfig, steps: int) -> list[dict]:
    """The eigenvalue's sign at uniform pooling against what the flow does."""
    rows = []
    for beta_over_d in (2.0, 4.0, 6.0):
        cfg = replace(base, beta=beta_over_d * base.d)
        tr = simulate(cfg, steps=steps, record_every=10)
        top = float(tr.weights[-1].max(-1).mean())
        rows.append(
            {
                "beta_over_d": beta_over_d,
                "eigenvalue": uniform_eigenvalue(cfg),
                "final_mean_max_weight": top,
                # left the uniform point at all (max weight 1/d + 0.05), and sharply (> 0.5)
                "left_uniform": bool(top > 1 / cfg.d + 0.05),
                "sharp": bool(np.isfinite(tr.time_to_specialize())),
            }
        )
    return rows


def _plateau(base: TheoryConfig, ns: tuple[int, ...], steps: int) -> dict:
    """Plateau vs N; N = 1024 needs a longer horizon. The gap at a fixed budget (the first
    sixth of the horizon) is the prediction "at a fixed budget the gap grows with N"."""
    plateau, curves = [], []
    budget = steps // 6
    for n in ns:
        horizon = steps * (3 if n == 1024 else 1)
        tr = simulate(replace(base, n_windows=n), steps=horizon, record_every=10)
        t = tr.time_to_specialize()
        at = int(np.searchsorted(tr.steps, budget))
        acc = tr.accuracy[at]
        plateau.append(
            {
                "n_windows": n,
                "time": t if np.isfinite(t) else None,  # None: not within the horizon
                "theory_md": THEORY_MD["plateau"][n],
                "gap_at_budget": float(acc.max() - acc.min()),
                "mean_at_budget": float(acc.mean()),
            }
        )
        top = tr.weights.max(-1).mean(-1)
        curves += [
            {"n_windows": n, "time": float(s_ * 0.5), "mean_max_weight": float(v)}
            for s_, v in zip(tr.steps[::5], top[::5], strict=True)
        ]
    fit = [r for r in plateau if r["time"] is not None]
    slope = (
        float(np.polyfit(*(np.log([r[k] for r in fit]) for k in ("n_windows", "time")), 1)[0])
        if len(fit) >= 2
        else None
    )
    return {
        "plateau": plateau,
        "plateau_curves": curves,
        "plateau_setup": _setup(base, N="16..1024", budget_time=f"{budget * 0.5:g}"),
        "plateau_loglog_slope": slope,
    }


def _capacity(base: TheoryConfig, steps: int) -> list[dict]:
    """H heads against d slots."""
    rows = []
    for heads in (2, 4, 8, 12):
        tr = simulate(replace(base, heads=heads), steps=steps)
        rows.append(
            {
                "heads": heads,
                "covered": tr.covered(),
                "served": len(set(tr.weights[-1].argmax(1).tolist())),
                "accuracy": tr.accuracy[-1].round(3).tolist(),
            }
        )
    return rows


def _handicap(hand: TheoryConfig, steps: int) -> list[dict]:
    rows = []
    for off in ("aligned", "staggered", "random"):
        tr = simulate(replace(hand, offsets=off), steps=steps)
        rows.append(
            {
                "offsets": off,
                "gap": tr.gap,
                "mean": float(tr.accuracy[-1].mean()),
                "accuracy": tr.accuracy[-1].round(3).tolist(),
                "theory_md": THEORY_MD["handicap"][off],
            }
        )
    return rows


def _concentrated(base: TheoryConfig, steps: int) -> list[dict]:
    """Training concentrated on one phase (all of it, or 80% with the rest spread)."""
    rows = []
    for share in (1.0, 0.8):
        pi = tuple([share] + [(1 - share) / (base.d - 1)] * (base.d - 1))
        tr = simulate(replace(base, pi=pi), steps=steps)
        rows.append(
            {"share": share, "covered": tr.covered(), "accuracy": tr.accuracy[-1].round(3).tolist()}
        )
    return rows


def _ablation(base: TheoryConfig, steps: int) -> dict:
    """Causal signature: removing a head hurts the phases its weights cover (aligned offsets:
    a head's slot is the phase it serves)."""
    tr = simulate(base, steps=steps)
    drop = head_ablation(tr.theta, base)
    return {
        "drop": drop.round(3).tolist(),
        "matches": int((drop.argmax(1) == softmax(tr.theta).argmax(1)).sum()),
        "heads": base.heads,
    }


def _checks(out: dict, base: TheoryConfig) -> dict[str, bool]:
    """The model's qualitative predictions, read off the numbers of :func:`predictions`."""
    times = [r["time"] for r in out["plateau"]]
    gaps = [r["gap_at_budget"] for r in out["plateau"]]
    by_off = {r["offsets"]: r for r in out["handicap"]}
    return {
        "uniform unstable iff eigenvalue > 0 (the flow leaves uniform pooling)": all(
            (r["eigenvalue"] > 0) == r["left_uniform"] for r in out["stability"]
        ),
        "plateau grows with N": all(
            (b is None) or (a is not None and b > a) for a, b in zip(times, times[1:], strict=False)
        ),
        "at a fixed budget the gap grows with N": bool(np.all(np.diff(gaps) >= -0.01)),
        "H < d heads cover H phases; H >= d cover all d": all(
            r["covered"] == min(r["heads"], base.d) for r in out["capacity"]
        ),
        "staggered offsets close the slot-handicap gap": by_off["staggered"]["gap"] < 0.05
        and by_off["aligned"]["gap"] > 0.2,
        "random offsets shrink the gap but cost mean accuracy": by_off["random"]["gap"]
        < by_off["aligned"]["gap"]
        and by_off["random"]["mean"] < by_off["aligned"]["mean"] - 0.05,
        "training on one phase leaves the others uncovered": out["concentrated"][0]["covered"] == 1,
        "ablating a head hurts the phase it weighs most": out["ablation"]["matches"] == base.heads,
    }


def fmt_time(t: float | None) -> str:
    """A plateau time, or that the flow did not specialise within the horizon."""
    return "beyond the horizon" if t is None else f"{t:g}"


def fmt_num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def predictions_text(p: dict) -> str:
    """:func:`predictions` as lines of plain text, the reference numbers beside ours."""
    lines = ["critical beta/d vs log(N-1):"]
    for r in p["critical"]:
        lines.append(
            f"  N={r['n_windows']:5d}: {r['critical_beta_over_d']:.2f} vs {r['log_n_minus_1']:.2f}"
        )
    lines.append(f"  slope {p['critical_slope']:.2f}")
    lines.append(f"stability ({p['stability_setup']}): eigenvalue at uniform vs the flow")
    for r in p["stability"]:
        lines.append(
            f"  beta/d={r['beta_over_d']:g}: lambda {r['eigenvalue']:+.4f}, final mean max "
            f"weight {r['final_mean_max_weight']:.2f}, left uniform {r['left_uniform']}, "
            f"sharp {r['sharp']}"
        )
    lines.append(f"plateau (flow time to mean max weight > 0.5; {p['plateau_setup']}):")
    for r in p["plateau"]:
        lines.append(
            f"  N={r['n_windows']:5d}: {fmt_time(r['time'])} (reference {r['theory_md']}); "
            f"at the budget: gap {r['gap_at_budget']:.2f}, mean {r['mean_at_budget']:.2f}"
        )
    lines.append(f"  log-log slope {fmt_num(p['plateau_loglog_slope'])}")
    lines.append(f"capacity ({p['capacity_setup']}):")
    for r in p["capacity"]:
        lines.append(f"  H={r['heads']:2d}: covered {r['covered']}, served {r['served']}")
    low = p["capacity_low_alpha"]
    lines.append(
        f"  covered level {max(p['capacity'][0]['accuracy']):.2f}; at {low['setup']}: "
        f"{low['covered_level']:.2f} (reference {p['theory_md']['capacity_h2_accuracy']})"
    )
    lines.append(f"slot handicap ({p['handicap_setup']}):")
    for r in p["handicap"]:
        md = r["theory_md"]
        lines.append(
            f"  {r['offsets']:9s}: gap {r['gap']:.2f}, mean {r['mean']:.2f} "
            f"(reference {md['gap']:.2f} / {md['mean']:.2f})"
        )
    for r in p["concentrated"]:
        lines.append(f"training {r['share']:.0%} on phase 0: covered {r['covered']}")
    a = p["ablation"]
    lines.append(f"ablation: {a['matches']}/{a['heads']} heads hurt most the phase they weigh most")
    lines.append("The model's qualitative predictions:")
    lines += [f"  [{'x' if ok else ' '}] {name}" for name, ok in p["checks"].items()]
    return "\n".join(lines)


__all__ = [
    "THEORY_MD",
    "TheoryConfig",
    "Trajectory",
    "accuracy",
    "critical_beta_over_d",
    "flow",
    "g",
    "g_prime",
    "g_second",
    "head_ablation",
    "loss",
    "margins",
    "predictions",
    "predictions_text",
    "simulate",
    "softmax",
    "uniform_eigenvalue",
]
