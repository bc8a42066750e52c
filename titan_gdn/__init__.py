"""titan_gdn: Qwen3.5 hybrid models (Gated DeltaNet + gated attention) for torchtitan.

Importing the package registers the `qwen3_5` TrainSpec, so a TOML config can select it with
`[experimental] custom_import = "titan_gdn"` and `[model] name = "qwen3_5"`.
"""

import os

# FLA wraps its kernels' entry points, ours included, in a per-call search for replacement
# backends (FlashQLA, Ascend); our ops are written against FLA's Triton path only, and the
# search costs host time on every launch. Read once, when FLA is first imported: set here,
# before anything of ours imports it. FLA_DISABLE_BACKEND_DISPATCH=0 turns the search back on.
os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")

from torchtitan.protocols.train_spec import _extra_train_specs, register_train_spec  # noqa: E402

from titan_gdn.train_spec import TRAIN_SPEC_NAME, get_train_spec  # noqa: E402

# torchtitan imports custom modules once per process, but tests may import us again after a
# reload; registering twice would raise.
if TRAIN_SPEC_NAME not in _extra_train_specs:
    register_train_spec(TRAIN_SPEC_NAME, get_train_spec())

__all__ = ["TRAIN_SPEC_NAME", "get_train_spec"]
