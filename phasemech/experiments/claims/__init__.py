"""The claims report (``analyses/REPORT.md``): each claim of the reproduced paper against
phasemech's measurement of it, one module per claim, in the report's order:

1. ``weak_spots``: periodic weak spots;
2. ``from_scratch``: reproducible from scratch, across designs (at convergence by the rules of
   ``converged``);
3. ``specialisation``: phase specialisation under interventions (trained models, and the real
   model's recorded explanations);
4. ``theory``: the gradient-flow theory;
5. ``evaluation``: the evaluation fix (report per phase);
6. ``fixes``: the untested fixes, trained from scratch;
7. ``real_fixes``: the fixes on a real model, post hoc;
8. ``systems``: the real systems trained from scratch.

``sources`` holds what every section reads (:class:`~phasemech.experiments.claims.sources.
Sources`: the figures run's tables and the recorded results) and ``report`` joins the sections
(``analyses/report.py`` is the command that writes the file). A section reads result files
only, never markdown, and states its verdict by the rule written next to it.

Axes: one section per claim; each module names the axes of the results it reads.
"""
