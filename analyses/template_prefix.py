"""Is a design's weak needle phase the grid's or the needle template's? The audit
(:func:`~phasemech.experiments.audit.run_audit`) on SmolLM2 over needle templates
(``RetrievalTask.template``: different lead-in tokens before the code) and extra shift-prefix
tokens (``prefix_extra``: the prefix length moves apart from the phase), then correctness
regressed on phase and prefix length with the content as a fixed effect.

Axes: ``design`` (a setting such as route top-1), ``template``, ``extra`` (``prefix_extra``),
``phase`` (the needle's offset in the stride-``d`` grid), ``prefix`` (the shift prefix's length
in tokens), ``content`` (``group_id``: the same keys, codes and filler rotation at every extra;
the needle's offset in the body depends on the template).

Each (design, template, extra) is one audit folder under ``--runs`` (its jobs cached: a rerun
computes nothing, a killed one resumes). The model: a linear probability model
``correct ~ C(phase) + C(prefix) + C(content)`` per (design, template), standard errors
clustered by content; Wald F tests of the phase given the prefix length and of the prefix
length given the phase (``F(q, G - 1)``, ``G`` contents: no floor on the attainable p). Pooled
over templates: ``+ C(phase):C(template)``, whose Wald test asks whether the phase profile
differs between templates (the template's weak phase) or not (the grid's). Within one
content the phase is a function of the prefix length, but the needle's offset in the body
varies between contents, so the two separate across contents (and across extras).

Usage: ``nice -n 5 python analyses/template_prefix.py --runs DIR [--contents 25]
[--templates ...] [--extras 0,2] [--designs route:1,quest:2] [--num-cpus 2] [--out-stem
analyses/results/template_prefix]``; ``--analyse-only`` reads the folders already done.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd

STEM = Path(__file__).parent / "results" / "template_prefix"
BASE = dict(model="smollm2-135m", regime="decode", contexts=(1024,), stride=4, window=16,
            layers=tuple(range(2, 30)))  # fmt: skip


def audit_of(design: str, top_k: int, template: str, extra: int, contents: int):
    from phasemech.experiments.audit.config import AuditConfig

    return AuditConfig.of(**BASE, designs=(design,), top_k=top_k, template=template,
                          prefix_extra=extra, contents=contents, attention_groups=1,
                          n_boot=200, n_perm=200)  # fmt: skip


def folder(runs: Path, design: str, top_k: int, template: str, extra: int) -> Path:
    return runs / f"{design}_k{top_k}_{template}_e{extra}"


def run_grid(args, grid) -> None:
    """Each (design, template, extra)'s audit into its folder (the cache makes this resume)."""
    from phasemech.experiments.audit.study import run_audit

    for design, top_k, template, extra in grid:
        out = folder(args.runs, design, top_k, template, extra)
        if (out / "targets.parquet").exists():
            continue
        print(f"audit {out.name}", flush=True)
        run_audit(audit_of(design, top_k, template, extra, args.contents), out,
                  num_cpus=args.num_cpus)  # fmt: skip


def targets(out: Path) -> pd.DataFrame | None:
    """An audit's scored rows: its report's table, or (a killed audit) its finished jobs'."""
    if (out / "targets.parquet").exists():
        return pd.read_parquet(out / "targets.parquet").assign(finished=True)
    rows = [r for job in sorted((out / "jobs").glob("*.json"))
            for r in json.loads(job.read_text())["result"]["targets"]]  # fmt: skip
    return pd.DataFrame(rows).assign(finished=False) if rows else None


def load(args, grid) -> pd.DataFrame:
    """The design's rows (and the null's, ``null`` column) of every finished audit."""
    frames = []
    for design, top_k, template, extra in grid:
        t = targets(folder(args.runs, design, top_k, template, extra))
        if t is None:
            continue
        null = t[t.setting == "null"].set_index("prompt_id").correct
        t = t[t.setting != "null"].copy()
        t["null"] = t.prompt_id.map(null).astype(float)
        t["design"] = f"{design} top-{top_k}"
        t["template"], t["extra"] = template, extra
        if "prefix" not in t:  # rows of before the worker kept it: phase order is prefix order
            t["prefix"] = extra + t.groupby("group_id").cumcount()
        frames.append(t)
    df = pd.concat(frames, ignore_index=True)
    df["correct"] = df.correct.astype(float)
    return df


def wald(fit, pattern: str) -> dict:
    """The Wald F test that every coefficient whose name matches ``pattern`` is 0."""
    names = [n for n in fit.params.index if re.search(pattern, n)]
    r = np.zeros((len(names), len(fit.params)))
    for i, n in enumerate(names):
        r[i, fit.params.index.get_loc(n)] = 1.0
    test = fit.f_test(r)
    return dict(terms=len(names), F=float(np.squeeze(test.fvalue)), p=float(test.pvalue),
                df_denom=float(test.df_denom))  # fmt: skip


def regress(df: pd.DataFrame, formula: str, tests: dict[str, str]) -> dict:
    import statsmodels.formula.api as smf

    model = smf.ols(formula, df)
    fit = model.fit(cov_type="cluster", cov_kwds={"groups": df.group_id.to_numpy()}, use_t=True)
    hc1 = model.fit(cov_type="HC1", use_t=True)  # prompts independent: for few contents only
    groups = int(df.group_id.nunique())
    coef = {n: dict(b=float(fit.params[n]), se=float(fit.bse[n]), p=float(fit.pvalues[n]))
            for n in fit.params.index if "group_id" not in n and n != "Intercept"}  # fmt: skip
    out = {}
    for name, pattern in tests.items():
        t = wald(fit, pattern)
        if groups - 1 < 2 * t["terms"]:  # a clustered covariance of too few contents: no test
            t |= dict(F=float("nan"), p=float("nan"))
        h = wald(hc1, pattern)
        if hc1.df_resid < 2 * h["terms"]:  # (nearly) saturated: residuals of ~0, no test
            h |= dict(F=float("nan"), p=float("nan"))
        out[name] = t | dict(F_hc1=h["F"], p_hc1=h["p"], df_hc1=h["df_denom"])
    return dict(formula=formula, n=int(fit.nobs), clusters=groups, coef=coef, tests=out)


PHASE, PREFIX = r"^C\(phase\)\[", r"^C\(prefix\)\["
TESTS = {"phase given prefix": PHASE, "prefix given phase": PREFIX}
INTERACTION = r"^C\(phase\)\[T\.\d\]:C\(template\)"


def analyse(df: pd.DataFrame) -> dict:
    out: dict = {}
    for design, d in df.groupby("design"):
        per = {}
        for template, t in d.groupby("template"):
            per[template] = regress(t, "correct ~ C(phase) + C(prefix) + C(group_id)", TESTS)
        pooled = None
        if d.template.nunique() > 1:  # content x template: a needle offset of its own
            d = d.assign(cell=d.group_id.astype(str) + "/" + d.template)
            pooled = regress(d, "correct ~ C(phase) + C(prefix) + C(cell)", TESTS)
            # C(template) is collinear with the cells: only the interaction is tested (estimable)
            inter = regress(d, "correct ~ C(phase) * C(template) + C(prefix) + C(cell)",
                            {"phase x template": INTERACTION})  # fmt: skip
            pooled["tests"] |= inter["tests"]
        out[design] = dict(per_template=per, pooled=pooled)
    return out


def tables(df: pd.DataFrame) -> dict:
    acc = lambda g: g.correct.mean()  # noqa: E731
    return {
        "by_phase": df.groupby(["design", "template", "phase"]).apply(acc).unstack(),
        "by_prefix": df.groupby(["design", "template", "prefix"]).apply(acc).unstack(),
        "by_phase_prefix": df.groupby(["design", "template", "prefix", "phase"])
        .apply(acc)
        .unstack(),
        "null_by_phase": df.groupby(["design", "template", "phase"]).null.mean().unstack(),
    }


def _md_table(frame: pd.DataFrame, title: str) -> list[str]:
    cols = list(frame.columns)
    idx = list(frame.index.names)
    lines = [f"### {title}", "", "| " + " | ".join(idx + [str(c) for c in cols]) + " |",
             "|---" * (len(idx) + len(cols)) + "|"]  # fmt: skip
    for key, row in frame.iterrows():
        key = key if isinstance(key, tuple) else (key,)
        vals = ["" if pd.isna(v) else f"{v:.2f}" for v in row]
        lines.append("| " + " | ".join(map(str, key)) + " | " + " | ".join(vals) + " |")
    return lines + [""]


def _md_regression(res: dict) -> list[str]:
    lines = []
    for design, r in res.items():
        lines += [f"### {design}: Wald tests (LPM, content fixed effects, cluster-robust)", "",
                  "| template | n | contents | test | F (clustered) | df | p | F (HC1) | p (HC1) |",
                  "|---" * 9 + "|"]  # fmt: skip
        fits = list(r["per_template"].items()) + ([("pooled", r["pooled"])] if r["pooled"] else [])
        for template, f in fits:
            for name, t in f["tests"].items():
                df = f"{t['terms']}, {t['df_denom']:.0f}"
                lines.append(f"| {template} | {f['n']} | {f['clusters']} | {name} | "
                             f"{t['F']:.2f} | {df} | {t['p']:.2g} | {t['F_hc1']:.2f} | "
                             f"{t['p_hc1']:.2g} |")  # fmt: skip
        lines += ["", "F tests have no floor on p; across the templates' tests, multiply by "
                  "their number (Bonferroni). The clustered test is left out (nan) where the "
                  "contents are fewer than 2 x its terms + 1, HC1 where the residual df are fewer "
                  "than 2 x its terms; HC1 treats prompts as independent (optimistic: a "
                  "content's prompts share its needle).", "",
                  f"#### {design}: phase and prefix coefficients (vs phase 0 / prefix 0)", "",
                  "| template | term | b | se | p |", "|---" * 5 + "|"]  # fmt: skip
        for template, f in r["per_template"].items():
            for n, c in f["coef"].items():
                lines.append(f"| {template} | {n} | {c['b']:+.3f} | {c['se']:.3f} | {c['p']:.2g} |")
        lines.append("")
    return lines


def write(df: pd.DataFrame, res: dict, stem: Path, command: str, note: str = "") -> None:
    t = tables(df)
    cells = (df.groupby(["design", "template", "extra"])
             .agg(prompts=("correct", "size"), contents=("group_id", "nunique"),
                  finished=("finished", "all")).reset_index())  # fmt: skip
    record = dict(command=command, note=note, cells=cells.to_dict(orient="records"), regression=res,
                  **{k: json.loads(v.reset_index().to_json(orient="records"))
                     for k, v in t.items()})  # fmt: skip
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1))
    md = ["# Weak phase: the grid's or the template's? (SmolLM2-135M, decode, T=1024, d=4, "
          "W=16, layers 2-29)", "", f"Command: `{command}`", "", *([note, ""] if note else []),
          "Audits (prompts per cell): " + ", ".join(
              f"{r.design}/{r.template}/e{r.extra}: {r.prompts} prompts, {r.contents} contents"
              + ("" if r.finished else " (the audit's finished jobs only)")
              for r in cells.itertuples()),
          ""]  # fmt: skip
    md += _md_table(t["by_phase"], "Accuracy by phase (design, template)")
    md += _md_table(t["null_by_phase"], "Dense null accuracy by phase")
    md += _md_table(t["by_prefix"], "Accuracy by prefix length")
    md += _md_table(t["by_phase_prefix"], "Accuracy by (prefix length, phase)")
    md += _md_regression(res)
    stem.with_suffix(".md").write_text("\n".join(md) + "\n")


def main(argv: list[str] | None = None) -> int:
    from phasemech.data.retrieval import TEMPLATES

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=Path, required=True, help="the audits' folder (a cache)")
    p.add_argument("--contents", type=int, default=25)
    p.add_argument("--templates", default=",".join(TEMPLATES))
    p.add_argument("--extras", default="0,2")
    p.add_argument("--designs", default="route:1", help="design:top_k, comma-list")
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--out-stem", type=Path, default=STEM)
    p.add_argument("--analyse-only", action="store_true")
    p.add_argument("--note", default="", help="a line for the record (how the runs were cut)")
    args = p.parse_args(argv)
    designs = [(d, int(k)) for d, k in (s.split(":") for s in args.designs.split(","))]
    extras = [int(e) for e in args.extras.split(",")]
    # extras vary fastest within a template's pass: every template has extra 0 first
    grid = [(d, k, t, e) for (d, k), e, t in
            itertools.product(designs, extras, args.templates.split(","))]  # fmt: skip
    for _, _, t, e in grid:  # every bad value, in one line, before any work
        audit_of("route", 1, t, e, args.contents)
    if not args.analyse_only:
        run_grid(args, grid)
    df = load(args, grid)
    command = "python analyses/template_prefix.py " + " ".join(argv or __import__("sys").argv[1:])
    res = analyse(df)
    write(df, res, args.out_stem, command, args.note)
    print(tables(df)["by_phase"].round(2).to_string())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
