"""Every prediction of the idealized model (:mod:`phasemech.theory.gradient_flow`;
``docs/theory.md``) re-derived by simulation, the reference numbers of its original numerical
check beside them, the qualitative predictions as booleans, and all of it as plain text.

Axes: ``head`` (H), ``slot`` and ``phase`` (d), ``step`` (Euler steps of the flow, ``dt = 0.5``);
a section's rows run over the setting it varies (``N``, ``beta / d``, ``H``, the offsets, the
training phase share). Each section carries its ``setup``: the parameters, read off the configs.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from phasemech.theory.gradient_flow import (
    TheoryConfig,
    critical_beta_over_d,
    head_ablation,
    simulate,
    softmax,
    uniform_eigenvalue,
)

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
