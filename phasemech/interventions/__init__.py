"""Causal and correlational tools on a model: ablation, phase specialisation, activation
patching, attribution patching, linear probes and head clustering. Never imports ``training``."""
