"""The head-attention experiment's profiles (one model
for every profile: 2 layers of ``gated`` compression, d = 4, 4 heads; the profiles differ in
training and evaluation sizes only) and the names of the files a run keeps.

Axes: none (sizes only).
"""

from __future__ import annotations

from phasemech.experiments.experiment import Profile

# one model for every profile (the old script's); the profiles differ in training and
# evaluation sizes only. `half` is P, the length of the random sequence that is then repeated.
_MODEL = dict(designs=("gated",), strides=(4,), heads=(4,), d_model=64)
PROFILES = {
    # seconds; the end-to-end test
    "tiny": Profile(
        steps=20, test_sequences=32, checkpoint_every=None,
        extra=(("batch", 16), ("half", 16)), **_MODEL,
    ),
    # 128 s of training on one thread of a shared 2-core machine (146 s in all)
    "default": Profile(
        steps=1200, test_sequences=256, checkpoint_every=400,
        extra=(("batch", 32), ("half", 32)), **_MODEL,
    ),
    "full": Profile(
        steps=4000, test_sequences=2048, checkpoint_every=1000,
        extra=(("batch", 64), ("half", 32)), **_MODEL,
    ),
}  # fmt: skip

VOCAB = 64
MODEL_DIR = "model"  # the trained model (PhaseTransformer.save), read by phasemech's CLI
STATE_FILE = "train_state.pt"  # the latest checkpoint of an unfinished training
LOSS_FILE = "train_loss.json"


__all__ = ["LOSS_FILE", "MODEL_DIR", "PROFILES", "STATE_FILE", "VOCAB"]
