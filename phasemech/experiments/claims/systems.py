"""The claims report's section on the real systems (NSA, GLM-5.3's DSA indexer, DeepSeek-V4's
CSA/HCA, head-partitioned history) trained from scratch: one row per system.

Read from recorded results only: ``phase_sweep_systems.json`` (``phasemech run phase_sweep
--profile systems``: convergence, pooled per-phase accuracy and debiased gaps of converged
seeds, the dense controls) and ``interventions_systems.json`` (``phasemech run interventions
--profile systems``: what serves each model's weak phase), and where recorded the offset fixes
per system (``fixes_systems_<design>.json``), the systems at T = 128 and the systems' own
variants (:data:`VARIANTS`: csa / hca pooled before or after RoPE in rotary models, nsa with
an MLP gate). The gap rule is the converged
sweeps' (:mod:`phasemech.experiments.claims.converged`): a system *has a gap* when its debiased
gap's CI lies above 0 and above its dense control's, and a system none of whose seeds converged
has no gap at all.

Axes: rows are systems (design x stride x heads x T).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from phasemech.experiments.claims.converged import converged_settings, merge_summaries
from phasemech.experiments.claims.sources import f3

SWEEP_FILE = "phase_sweep_systems.json"
#: the same systems at T = 128 (``phasemech run phase_sweep --profile systems_T128``), merged
#: into the table where recorded
LONG_FILE = "phase_sweep_systems_T128.json"
LONG_COMMAND = "phasemech run phase_sweep --profile systems_T128"
INTERVENTIONS_FILE = "interventions_systems.json"
LONG_INTERVENTIONS_FILE = "interventions_systems_T128.json"
SWEEP_COMMAND = "phasemech run phase_sweep --profile systems"
INTERVENTIONS_COMMAND = "phasemech run interventions --profile systems"

#: what each system's own mechanism is, for the table
MECHANISM = {
    "nsa": "three gated branches (compressed, selected blocks, window)",
    "dsa": "a learned k-pool indexer picks pools read raw",
    "csa": "gated projection series over overlapping windows, RMSNorm",
    "hca": "the same at a large rate, no overlap",
    "partition": "each head reads its own slice of the past",
}


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _steps(summary: dict[str, Any]) -> pd.DataFrame:
    """Steps to 0.95 held-out accuracy per setting: each seed's, in seed order."""
    conv = pd.DataFrame(summary.get("convergence", []))
    if not len(conv):
        return pd.DataFrame(columns=["design", "stride", "heads", "seq_len", "steps"])

    def cell(g: pd.DataFrame) -> str:
        return ", ".join(
            "never" if pd.isna(s) else f"{int(s)}" for s in g.sort_values("seed").steps_to_95
        )

    keys = ["design", "stride", "heads", "seq_len"]
    return conv.groupby(keys).apply(cell, include_groups=False).rename("steps").reset_index()


def _servers(interventions: dict[str, Any] | None) -> pd.DataFrame:
    """Per analysed model: its weak phase and the unit whose ablation costs most there."""
    models = pd.DataFrame((interventions or {}).get("models", []))
    cols = ["design", "stride", "heads", "seq_len", "server"]
    if not len(models) or "weak_phase_server" not in models.columns:
        return pd.DataFrame(columns=cols)
    # a model's context is in its name (``nsa_d4_h2_T64_s0``)
    models["seq_len"] = pd.to_numeric(models["model"].str.extract(r"_T(\d+)_", expand=False))
    models = models.dropna(subset=["seq_len"]).astype({"seq_len": int})

    def cell(r) -> str:
        sig = "phase-dependent" if r.weak_phase_server_p_holm < 0.05 else "not phase-dependent"
        return (
            f"phase {r.weak_phase}: {r.weak_phase_server} ({r.weak_phase_drop_pts:+.0f} pts there, "
            f"{r.weak_phase_server_mean_drop_pts:+.0f} at the other phases; {sig}) [{r.model}]"
        )

    models["server"] = [cell(r) for r in models.itertuples()]
    # every analysed model of a system (the profile analyses one seed each; more are listed)
    keys = cols[:-1]
    return models.groupby(keys)["server"].agg("; ".join).reset_index()[cols]


def systems_table(sweep: dict[str, Any], interventions: dict[str, Any] | None) -> pd.DataFrame:
    """One row per system and dense control: converged seeds, accuracy, debiased gap with CI,
    the dense control's, ``has_gap``, steps to 0.95 and what serves the weak phase."""
    s = converged_settings(sweep)
    if not len(s):
        return s
    out = s.merge(_steps(sweep), on=["design", "stride", "heads", "seq_len"], how="left")
    out = out.merge(_servers(interventions), on=["design", "stride", "heads", "seq_len"],
                    how="left")  # fmt: skip
    order = {d: i for i, d in enumerate(["none", *MECHANISM])}
    out = out.assign(order=out["design"].map(order)).sort_values(["seq_len", "stride", "order"])
    return out.drop(columns="order").reset_index(drop=True)


def _gap_cell(r: Any, prefix: str = "debiased") -> str:
    """``gap [lo, hi]`` of a table row (``prefix``: ``debiased``, or ``dense`` for its control)."""
    gap, lo, hi = (getattr(r, f"{prefix}_{k}") for k in ("gap", "lo", "hi"))
    return f"{f3(gap)} [{f3(lo)}, {f3(hi)}]"


def _result_cells(r: Any) -> str:
    """A setting's cells from its converged seeds on (shared by the systems' and the variants'
    tables): seeds, accuracy, gap, dense gap, the rule's answer, steps, the weak phase's unit."""
    conv = bool(r.converged)
    return (
        f"| {r.converged} of {r.seeds} | {f3(r.accuracy) if conv else '-'} "
        f"| {_gap_cell(r) if conv else 'none converged: no gap'} | {_gap_cell(r, 'dense')} "
        f"| {'yes' if r.has_gap else 'no'} | {r.steps if isinstance(r.steps, str) else '-'} "
        f"| {r.server if isinstance(r.server, str) else '-'} |"
    )


def _cut(r: dict[str, Any]) -> str:
    """A fix's gap cut with its CI; none where the baseline has no gap to cut (JSON null)."""
    cut = [r.get(k) for k in ("reduction", "reduction_lo", "reduction_hi")]
    if any(c is None or c != c for c in cut):  # None (JSON null) or NaN
        return "n/a (no baseline gap to cut)"
    return f"{100 * cut[0]:.0f}% [{100 * cut[1]:.0f}%, {100 * cut[2]:.0f}%]"


def _fixes_lines(results: Path) -> list[str]:
    """The offset fixes on each system whose fixes run is recorded (``fixes_systems_<design>
    [_T128].json``, ``phasemech run fixes --profile systems_<design>[_T128]``): the gap cut per
    fix, at T = 64 and at T = 128."""
    lines = []
    for design in MECHANISM:
        for suffix, context in (("", "T = 64"), ("_T128", "T = 128")):
            profile = f"systems_{design}{suffix}"
            fx = _load(results / f"fixes_{profile}.json")
            if fx is None:
                continue
            rows = [r for r in fx.get("comparison", []) if r["targets"] == "all"]
            cells = [
                f"{r['fix']}: gap {f3(r['gap_baseline'])} -> {f3(r['gap_other'])}, cut "
                f"{_cut(r)}, accuracy {r['accuracy_diff']:+.3f} "
                f"({'meets the goal' if r['meets_goal'] else 'does not meet the goal'})"
                for r in rows
            ]
            lines.append(
                f"- Offset fixes on `{design}` at {context} (`analyses/results/fixes_{profile}"
                f".json`, `phasemech run fixes --profile {profile}`): " + "; ".join(cells) + "."
            )
    return ["", *lines] if lines else []


#: the systems' own variants, each a sweep profile (its file ``phase_sweep_<profile>.json`` and
#: the ablations ``interventions_<profile>.json``, by the same command) with its own dense
#: control: profile -> (variant, its systems)
VARIANTS = {
    "systems_rotary": ("rotary, pooled pre-RoPE", ("csa", "hca")),
    "systems_rotary_post": ("rotary, pooled post-RoPE", ("csa", "hca")),
    "systems_nsa_mlp_gate": ("an MLP gate (32 SiLU units)", ("nsa",)),
}
#: (variant profile, what it is set against: another variant or None for the main sweep)
CONTRASTS = (("systems_rotary", "systems_rotary_post"), ("systems_nsa_mlp_gate", None))


def _ci_order(a: Any, b: Any, other: str) -> str:
    """How setting ``a``'s debiased-gap CI lies against ``b``'s (called ``other``)."""
    if a.debiased_lo > b.debiased_hi:
        return f"larger than {other} (CIs disjoint)"
    if a.debiased_hi < b.debiased_lo:
        return f"smaller than {other} (CIs disjoint)"
    return f"the same as {other} within the CIs"


def _variant_row(variant: str, r: Any) -> str:
    return f"| {variant} | {r.design} | {r.stride} " + _result_cells(r)


def _contrasts(tables: dict[str, pd.DataFrame], main: pd.DataFrame) -> list[str]:
    """Each recorded contrast, system by system where both sides converged."""
    cells = []
    for mine, other in CONTRASTS:
        theirs = main if other is None else tables.get(other)
        if mine not in tables or theirs is None:
            continue
        name = "the main sweep's" if other is None else f"{VARIANTS[other][0]}'s"
        for key in tables[mine].index.intersection(theirs.index):  # (design, stride)
            a, b = tables[mine].loc[key], theirs.loc[key]
            if a.converged and b.converged:
                cells.append(f"`{key[0]}` {VARIANTS[mine][0]}: gap {_ci_order(a, b, name)}")
    return ["", "Contrasts: " + "; ".join(cells) + "."] if cells else []


def _variant_tables(results: Path) -> tuple[dict[str, pd.DataFrame], list[str]]:
    """The recorded variants (:data:`VARIANTS`): each one's systems by the section's gap rule
    against its own dense control (indexed by design and stride), and where each came from."""
    tables, sources = {}, []
    for profile, (variant, designs) in VARIANTS.items():
        sweep = _load(results / f"phase_sweep_{profile}.json")
        if sweep is None:
            continue
        inter = _load(results / f"interventions_{profile}.json")
        t = systems_table(sweep, inter)
        if not len(t):  # recorded without a finished model
            continue
        t = t[t["design"].isin(designs)]
        tables[profile] = t.set_index(["design", "stride"], drop=False)
        sources.append(
            f"{variant} ({_options(sweep)}): `analyses/results/phase_sweep_{profile}.json` "
            f"(`phasemech run phase_sweep --profile {profile}`)"
            + (f", ablations `interventions_{profile}.json`" if inter else "")
        )
    return tables, sources


def _variant_lines(
    tables: dict[str, pd.DataFrame], sources: list[str], main: pd.DataFrame
) -> list[str]:
    """The variants' table and the contrasts between them; empty when none is recorded."""
    if not tables:
        return []
    out = [
        "",
        "The systems' own variants, each at the same recipe against its own dense control "
        "(`pool_rope`: DeepSeek-V4 pools pre-RoPE keys and rotates the entry at its block "
        "start; the lab's default learned positions make the two one): " + "; ".join(sources) + ".",
        "",
        "| variant | system | d | converged seeds | accuracy | debiased gap [95% CI] | its dense "
        "gap [95% CI] | gap beyond dense | steps to 0.95 (by seed) | weak phase and the unit "
        "serving it (ablation) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for profile, t in tables.items():
        out += [_variant_row(VARIANTS[profile][0], r) for r in t.itertuples(index=False)]
    main = main[main["seq_len"] == 64].set_index(["design", "stride"], drop=False)
    return out + _contrasts(tables, main)


def _options(sweep: dict[str, Any]) -> str:
    """What a variant's models were trained with, as its sweep recorded it."""
    prof = sweep.get("profile", {})
    opts = [f"{prof.get('positional', 'standard')} positions"]
    for design, kw in prof.get("design_options", {}).items():
        opts += [f"{design} {k}={v}" for k, v in kw.items()]
    return "; ".join(opts)


def _main_table(results: Path, sweep: dict[str, Any]) -> tuple[pd.DataFrame, str]:
    """The systems' table (T = 64, and T = 128 where recorded, each with its ablations) and
    the sentence naming its sources."""
    long = _load(results / LONG_FILE)
    found = [(f, x) for f in (INTERVENTIONS_FILE, LONG_INTERVENTIONS_FILE)
             if (x := _load(results / f)) is not None]  # fmt: skip
    inter = {"models": [m for _, x in found for m in x.get("models", [])]} if found else None
    t = systems_table(sweep if long is None else merge_summaries([sweep, long]), inter)
    source = f"Source: `analyses/results/{SWEEP_FILE}` (`{SWEEP_COMMAND}`)"
    if long is not None:
        source += f", at T = 128 `analyses/results/{LONG_FILE}` (`{LONG_COMMAND}`)"
    if found:
        command = {INTERVENTIONS_FILE: INTERVENTIONS_COMMAND,
                   LONG_INTERVENTIONS_FILE: f"{INTERVENTIONS_COMMAND}_T128"}  # fmt: skip
        source += "; ablations " + " and ".join(
            f"`analyses/results/{f}` (`{command[f]}`)" for f, _ in found
        )
    else:
        source += f"; the ablations are not recorded (`{INTERVENTIONS_COMMAND}`)"
    return t, source


def claim_systems(results: Path) -> str:
    """The report section: the table, and a verdict per system by the gap rule."""
    out = ["## 8. The real systems, trained from scratch", ""]
    out.append(
        "*Question*: does a token's phase decide retrieval in the compression designs real "
        "systems use, and which of each system's own components serves the weak phase?"
    )
    out.append("")
    sweep = _load(results / SWEEP_FILE)
    if sweep is None:
        missing = f"- Missing `analyses/results/{SWEEP_FILE}` (`{SWEEP_COMMAND}`)."
        return "\n".join(out + [missing, "", "Verdict: not measured."])
    t, source = _main_table(results, sweep)
    out += [
        source + ". Only converged seeds (held-out accuracy >= 0.95) are pooled into a gap.",
        "",
        "| system | its mechanism | d | H | T | converged seeds | accuracy | debiased gap [95% CI] "
        "| dense gap [95% CI] | gap beyond dense | steps to 0.95 (by seed) | the intact model's "
        "weak phase and the unit serving it most specifically (ablation) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in t.itertuples():
        out.append(
            f"| {r.design} | {MECHANISM.get(r.design, 'dense control')} | {r.stride} | {r.heads} "
            f"| {r.seq_len} " + _result_cells(r)
        )
    out += [
        "",
        "Every component of each system ablated, by phase (heads; `nsa`'s branches; `csa`/`hca`'s "
        "entries, raw window and slot biases; `dsa`'s kept pools and indexer bias; a "
        f"`partition` head's slice): `analyses/results/{INTERVENTIONS_FILE[:-5]}.md`.",
    ]
    out += _fixes_lines(results)
    tables, sources = _variant_tables(results)
    out += _variant_lines(tables, sources, t)
    rule = "debiased-gap CI above 0 and above the dense control's CI, converged seeds only"
    out += ["", f"Verdict (rule: {rule}): {_verdict(t, tables)}."]
    return "\n".join(out)


def _verdict(t: pd.DataFrame, variants: dict[str, pd.DataFrame]) -> str:
    """The systems with a gap beyond their dense control, those that never converged, and
    the variants with a gap."""
    systems = t[t["design"] != "none"]
    several = t["seq_len"].nunique() > 1

    def names(rows: pd.DataFrame) -> str:
        if not several:
            return ", ".join(rows.design)
        return ", ".join(f"{r.design} (T = {r.seq_len})" for r in rows.itertuples())

    gapped = systems[systems["has_gap"]]
    never = systems[systems["converged"] == 0]
    verdict = (
        "a phase gap beyond the dense control in " + names(gapped)
        if len(gapped)
        else "no system shows a phase gap beyond its dense control"
    )
    if len(never):
        verdict += "; never converged (no evidence either way): " + names(never)
    if variants:
        gaps = [f"{r.design} ({VARIANTS[p][0]})" for p, v in variants.items()
                for r in v[v["has_gap"]].itertuples(index=False)]  # fmt: skip
        verdict += (
            "; among the variants, a gap beyond the dense control in " + ", ".join(gaps)
            if gaps
            else "; no variant shows one either"
        )
    return verdict


__all__ = ["CONTRASTS", "MECHANISM", "VARIANTS", "claim_systems", "systems_table"]
