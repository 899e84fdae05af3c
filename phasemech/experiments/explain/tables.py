"""The explanation's tables, from the results of its steps (:mod:`phasemech.experiments.
explain.run` runs the steps through the launcher).

Axes: ``prompt``, ``pair``, ``layer``, ``head``, ``phase``, ``replicate`` (bootstrap draws).

Tables under ``OUT`` (tidy parquet, one row per what the name says):

* ``prompts.parquet``: per prompt, the null's and the design's answer (``correct``,
  ``first_correct``, ``margin``);
* ``selection.parquet``: per (prompt, layer, head), the needle block's ``selected``, ``rank``,
  ``margin`` (:func:`~phasemech.interventions.oracle.needle_selection`); ``selection_recall.
  parquet``: its mean per (layer, phase);
* ``oracle.parquet``: per (scope, form, rows, phase), accuracy with the needle's block forced,
  its cluster-bootstrap 95% interval (contents resampled), the unforced accuracy and the
  null's, how many kept picks were changed and displaced (``displaced_sink``: the share of
  displaced picks that were the sink's block) and ``broken`` (prompts the design answered that
  the forcing broke); ``oracle_prompts.parquet``: every copy;
* ``ablation.parquet``: the lab's effects table (:class:`~phasemech.interventions.
  ablation_result.AblationResult`; ``accuracy`` and ``logit_diff`` = the margin at the first
  answer token; ``logprob`` is not computed) and ``ablation_specialization.parquet`` (its
  specialisation index and permutation test, :func:`~phasemech.interventions.specialization.
  specialization`);
* ``attention.parquet``: per (prompt, setting, layer, head), attention from the answer row
  onto the needle under the null and the design; ``head_attention.parquet``: its mean per
  (setting, layer, head, phase);
* ``decomposition.parquet``: per (prompt, layer, head, role, slot), the selection at the answer
  row split into its tokens' terms (roles ``needle``, ``competitor``, ``sink``; exact sums of
  the design's own block score: :mod:`phasemech.interventions.decompose`);
  ``decomposition_phases.parquet``: its summary per (``heads``, phase) over the needle-reading
  heads (the null's attention onto the needle) and over every head;
* ``patching.parquet``: per (site, layer, head), the normalised effect (0 = corrupted, 1 =
  clean; ratio of pair means) with a bootstrap interval over pairs; sites ``head`` (exact),
  ``resid`` (a layer's residual stream), ``selection`` (a selecting layer's kept sets from the
  clean prompt; ``layer = -1``: every selecting layer; ``kept``: blocks then read per query and
  head), ``atp`` (attribution patching's estimate of ``head``);
  ``patching_pairs.parquet``: per pair, clean and corrupted metrics.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from phasemech.core.io import atomic_write
from phasemech.experiments.explain.config import ExplainConfig


def prompts_frame(observed: list[dict]) -> pd.DataFrame:
    rows = []
    for p in observed:
        row = dict(p["prompt"])
        for who in ("null", "design"):
            row |= {f"{who}_{k}": v for k, v in p[who].items()}
        rows.append(row)
    return pd.DataFrame(rows).sort_values("prompt_id", ignore_index=True)


def long_frame(observed: list[dict], key: str) -> pd.DataFrame:
    """One row per item of ``key`` in each result, beside its prompt's fields."""
    rows = [dict(p["prompt"], **r) for p in observed for r in p.get(key, [])]
    return pd.DataFrame(rows)


def oracle_summary(df: pd.DataFrame, prompts: pd.DataFrame, n_boot: int, seed: int) -> pd.DataFrame:
    """Accuracy per (scope, form, rows, phase) under forcing, beside the unforced and the null;
    intervals from :func:`~phasemech.measure.stats.intervals.per_phase` (contents resampled)."""
    from phasemech.measure.stats.intervals import per_phase

    base = prompts.set_index("prompt_id")[["design_correct", "null_correct"]]
    df = df.join(base, on="prompt_id").assign(seq_id=lambda x: x.group_id)
    d = int(prompts.phase.max()) + 1
    out = []
    for (scope, form, rows), g in df.groupby(["scope", "form", "rows"], sort=False):
        acc = per_phase(g, d, n_boot=n_boot, seed=seed).set_index("phase")
        by = g.groupby("phase")
        broken = g.design_correct & ~g.correct.astype(bool)
        frame = pd.DataFrame(dict(
            accuracy=acc.accuracy, ci_low=acc.boot_lo, ci_high=acc.boot_hi,
            unforced=by.design_correct.mean(), null=by.null_correct.mean(), n=acc.n,
            forced=by.forced.mean(), displaced=by.displaced.mean(),
            displaced_sink=by.displaced_sink.sum() / by.displaced.sum().replace(0, np.nan),
            broken=broken.groupby(g.phase).sum(),
        ))  # fmt: skip
        out.append(
            frame.rename_axis("phase").reset_index().assign(scope=scope, form=form, rows=rows)
        )
    table = pd.concat(out, ignore_index=True)
    keys = ["scope", "form", "rows", "phase"]
    return table[keys + [c for c in table.columns if c not in keys]]


def margin_metrics(margins: np.ndarray) -> np.ndarray:
    """``[.., target] -> [.., metric, target]`` of the lab's metrics from the answer's margins:
    accuracy is the margin's sign, ``logprob`` is not computed (NaN; the tables drop it)."""
    from phasemech.interventions.ablation_plan import METRICS

    by = {"accuracy": (margins > 0).astype(float), "logit_diff": margins}
    return np.stack([by.get(m, np.full_like(margins, np.nan)) for m in METRICS], -2)


def ablation_tables(
    inter: list[dict],
    cfg: ExplainConfig,
    n_layers: int,
    n_heads: int,
    n_boot: int,
    seed: int,
    n_perm: int | str,
):
    """The lab's effects table and specialisation test from the per-prompt ablations
    (``n_perm``: :func:`~phasemech.interventions.specialization.specialization`'s, ``"auto"``
    or a fixed count)."""
    from phasemech.interventions.ablation_plan import AblationRun

    items = sorted((p for p in inter if "ablation" in p), key=lambda p: p["prompt"]["prompt_id"])
    if not items:
        return None, None
    modes = [m for m in ("zero", "mean") if m in items[0]["ablation"]]
    runs = [
        AblationRun("head", m, i, h) for m in modes for i in range(n_layers) for h in range(n_heads)
    ]
    return margin_tables(items, "ablation", runs, cfg.probe.stride, n_boot, seed, n_perm)


def margin_tables(
    items: list[dict], key: str, runs: list, stride: int, n_boot: int, seed: int, n_perm: int | str
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(effects, specialisation)`` of per-prompt ablated margins: each item's ``[key]`` holds
    the intact margin (``"base"``) and, per mode, the ablated margins in ``runs``' unit order
    (``runs``: mode-major, then unit). The lab's effects table (:func:`~phasemech.
    interventions.ablation_result.phase_effects`, ``logprob`` dropped) and its specialisation
    test on both metrics, each metric's rows one Holm family."""
    from phasemech.interventions.ablation_result import ablation_targets_frame, phase_effects
    from phasemech.interventions.specialization import specialization

    frame = pd.DataFrame([p["prompt"] for p in items]).rename(columns={"prompt_id": "seq_id"})
    frame["target"] = 0
    modes = list(dict.fromkeys(r.mode for r in runs))
    base = margin_metrics(np.array([p[key]["base"] for p in items]))
    got = np.array([[np.ravel(p[key][m]) for p in items] for m in modes])  # [mode, target, unit]
    ablated = margin_metrics(got.transpose(0, 2, 1).reshape(len(runs), len(items)))
    effects = phase_effects(runs, frame, base, ablated, stride, n_boot, seed)
    targets = ablation_targets_frame(runs, frame, base, ablated, stride, 0)
    spec = pd.concat(
        [specialization(targets, metric=m, n_perm=n_perm, seed=seed, stride=stride)
         for m in ("accuracy", "logit_diff")],
        ignore_index=True,
    )  # fmt: skip
    return effects[effects.metric != "logprob"].reset_index(drop=True), spec


def _site_values(pairs: list[dict], site: str) -> np.ndarray:
    """``[pair, layer, head]`` of a site (one head column for the per-layer sites), with a
    last layer row ``{site}_all`` (every layer at once) where the pairs have one."""
    vals = [np.reshape(p[site], (len(p[site]), -1)) for p in pairs]
    if f"{site}_all" in pairs[0]:
        vals = [np.vstack([v, [[p[f"{site}_all"]]]]) for v, p in zip(vals, pairs, strict=True)]
    return np.array(vals, dtype=float)


def patching_table(pairs: list[dict], n_boot: int, seed: int) -> pd.DataFrame:
    """Normalised effect per (site, layer, head) with a bootstrap interval over pairs; the
    ``selection`` site's ``layer = -1`` row is every selecting layer at once. Every row names
    its contrast (``clean_phase``, ``corrupted_phase``), so two contrasts' tables concatenate."""
    contrasts = {(p["clean_prompt"]["phase"], p["corrupted_prompt"]["phase"]) for p in pairs}
    if len(contrasts) != 1:
        raise ValueError(f"patching_table: pairs of {sorted(contrasts)}: expected one contrast")
    ((clean_phase, corrupted_phase),) = contrasts
    clean = np.array([p["clean"] for p in pairs])
    corr = np.array([p["corrupted"] for p in pairs])
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(pairs), (n_boot, len(pairs))) if n_boot else None
    den = (clean - corr).mean()
    # a clean side no better than the corrupted one has no gap to normalise by: the effects
    # are NaN (the report says why), the raw metric changes stay
    den = den if den > 0 else np.nan
    rows = []
    for site in ("heads", "resid", "selection", "atp"):
        if site not in pairs[0]:
            continue
        vals = _site_values(pairs, site)  # [pair, L(+1), H]
        delta = vals - corr[:, None, None] if site != "atp" else vals
        eff = delta.mean(0) / den
        lo = hi = np.full(eff.shape, np.nan)
        if idx is not None and not np.isnan(den):
            boot = delta[idx].mean(1) / (clean - corr)[idx].mean(1)[:, None, None]
            lo, hi = np.quantile(boot, [0.025, 0.975], axis=0)
        kept = _site_values(pairs, "selection_kept").mean(0) if site == "selection" else None
        raw = delta.mean(0)
        for (layer, head), e in np.ndenumerate(eff):
            if np.isnan(raw[layer, head]):  # a layer that selects nothing
                continue
            all_layers = site == "selection" and layer == eff.shape[0] - 1
            rows.append(
                dict(
                    clean_phase=clean_phase,
                    corrupted_phase=corrupted_phase,
                    site={"heads": "head"}.get(site, site),
                    layer=-1 if all_layers else layer,
                    head=head if site in ("heads", "atp") else -1,
                    effect=e,
                    ci_low=lo[layer, head],
                    ci_high=hi[layer, head],
                    raw=raw[layer, head],
                    kept=np.nan if kept is None else kept[layer, head],
                    n_pairs=len(pairs),
                )
            )
    return pd.DataFrame(rows)


def attention_tables(attended: list[dict]) -> dict[str, pd.DataFrame]:
    """``attention`` (per prompt, setting, layer, head) and ``head_attention`` (its mean per
    setting, layer, head and phase: the audit's ``head_phase``)."""
    att = long_frame(attended, "attention")
    head = att.groupby(["setting", "layer", "head", "phase"], as_index=False).mass.mean()
    return {"attention": att, "head_attention": head}


def decomposition_tables(
    decomposed: list[dict], attention: pd.DataFrame | None = None
) -> dict[str, pd.DataFrame | None]:
    """``decomposition`` (per prompt, layer, head, role, slot: the selection's terms,
    :func:`~phasemech.interventions.decompose.decompose`) and ``decomposition_phases`` (per
    ``heads`` and phase, :func:`~phasemech.interventions.decompose.mechanism_table`: over the
    needle-reading heads when ``attention``, the ``attend`` step's table, names them, and
    over every head); none without the step."""
    from phasemech.interventions.decompose import mechanism_table, needle_reading_heads

    if not decomposed:
        return {"decomposition": None, "decomposition_phases": None}
    df = long_frame(decomposed, "decomposition")
    parts = [("every head", df)]
    if attention is not None and len(attention):
        top = needle_reading_heads(attention, sorted(set(df.layer)))
        reading = df[df.set_index(["layer", "head"]).index.isin(top)]
        parts.insert(0, ("needle-reading heads", reading))
    phases = pd.concat(
        [mechanism_table(part).reset_index().assign(heads=name) for name, part in parts],
        ignore_index=True,
    )
    return {"decomposition": df, "decomposition_phases": phases}


def explain_tables(
    cfg, prompts, observed, inter, heads, patch, pair_rows, source
) -> dict[str, pd.DataFrame | None]:
    """Every table of the steps' results (``source``: the model's, for its sizes)."""
    t: dict[str, pd.DataFrame | None] = {"prompts": prompts}
    if "selection" in cfg.analyses:
        sel = long_frame(observed, "selection")
        t["selection"] = sel
        t["selection_recall"] = sel.groupby(["layer", "phase"], as_index=False).agg(
            recall=("selected", "mean"),
            rank=("rank", "median"),
            margin=("margin", "median"),
            n=("selected", "size"),
        )
    if "oracle" in cfg.analyses:
        orc = pd.concat(
            [long_frame(observed, "oracle"), long_frame(heads, "oracle")], ignore_index=True
        )
        t["oracle_prompts"] = orc
        t["oracle"] = oracle_summary(orc, prompts, cfg.n_boot, cfg.probe.seed)
    if "ablation" in cfg.analyses:
        prompts_inter = [p for r in inter for p in r["prompts"]]
        t["ablation"], t["ablation_specialization"] = ablation_tables(
            prompts_inter,
            cfg,
            source.n_layers,
            source.n_heads,
            cfg.n_boot,
            cfg.probe.seed,
            cfg.perm_draws,
        )
    if patch is not None:
        t["patching"] = patch
        t["patching_pairs"] = pd.DataFrame(
            [
                dict(
                    group_id=p["clean_prompt"]["group_id"],
                    depth=p["clean_prompt"]["depth"],
                    clean_phase=p["clean_prompt"]["phase"],
                    corrupted_phase=p["corrupted_prompt"]["phase"],
                    clean_prompt=p["clean_prompt"]["prompt_id"],
                    corrupted_prompt=p["corrupted_prompt"]["prompt_id"],
                    clean=p["clean"],
                    corrupted=p["corrupted"],
                    foil=p["foil"],
                )
                for p in pair_rows
            ]
        )
    return t


def write_tables(out: Path, tables: dict[str, pd.DataFrame | None]) -> None:
    """Each non-empty table as ``OUT/<name>.parquet`` (atomic)."""
    for name, df in tables.items():
        if df is not None and len(df):
            atomic_write(out / f"{name}.parquet", lambda tmp, df=df: df.to_parquet(tmp))


__all__ = [
    "ablation_tables",
    "attention_tables",
    "decomposition_tables",
    "explain_tables",
    "long_frame",
    "margin_metrics",
    "oracle_summary",
    "patching_table",
    "prompts_frame",
    "write_tables",
]
