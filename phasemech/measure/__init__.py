"""Measuring a model: answer read-out, per-phase evaluation, the statistics of a phase gap
(``stats``) and the post-hoc sweep of a pretrained model. Never imports ``training``."""
