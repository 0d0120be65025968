"""Load a peagle checkpoint with the real speculators 0.9.0 (run by hand in a separate venv).

    python3 -m venv /tmp/specvenv
    /tmp/specvenv/bin/pip install --no-deps speculators-0.9.0-py3-none-any.whl pydantic pydantic-core \
        pydantic-settings loguru annotated-types typing-extensions typing-inspection openai
    echo /work/main/.venv/lib/python3.11/site-packages > /tmp/specvenv/lib/python3.11/site-packages/zz.pth
    /tmp/specvenv/bin/python scripts/check_speculators_compat.py CHECKPOINT_DIR

speculators' training-only imports (datasets, hs_connectors) are stubbed; the project venv lends
torch and transformers. Prints the parsed config and the state-dict differences.
"""
import sys, types
class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})
for _m in ("datasets", "hs_connectors"):
    sys.modules[_m] = _Stub(_m)
import json, sys
from speculators.models.peagle.config import PEagleSpeculatorConfig
cfg = json.load(open(sys.argv[1] + "/config.json"))
c = PEagleSpeculatorConfig(**cfg)
print("loaded", type(c).__name__, c.speculators_model_type, c.draft_vocab_size, c.mask_token_id,
      type(c.transformer_layer_config).__name__, c.speculators_config.proposal_methods[0].speculative_tokens,
      c.speculators_config.verifier.name_or_path)
try:
    import torch
    from speculators.models.peagle.core import PEagleDraftModel as M
except Exception as e:
    import speculators.models.peagle.core as core
    M = [getattr(core, n) for n in dir(core) if n.endswith("Model") or n.endswith("Speculator")]
    print("classes", M); M = None
if M is not None:
    from safetensors.torch import load_file
    m = M(c)
    ours = load_file(sys.argv[1] + "/model.safetensors")
    theirs = m.state_dict()
    print("missing in ours:", sorted(set(theirs) - set(ours)))
    print("unexpected in ours:", sorted(set(ours) - set(theirs)))
    print("shape mismatches:", [k for k in ours if k in theirs and tuple(ours[k].shape) != tuple(theirs[k].shape)])
