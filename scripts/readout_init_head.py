"""Ablation helper: a fresh EAGLE-3 head for the embedded target whose readout (norm + lm_head)
is the target's final norm times SCALE and the target's lm_head rows of the draft vocabulary
(the rest random), saved as a head folder for train.init_from. Measured no better than a random
readout (docs/training.md, "The main job's head"), so it is not a training option.

    python scripts/readout_init_head.py SCALE OUT_DIR CAPTURE_DIR/d2t_t2d_8192.safetensors
"""
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eagle_infer.default_model import resolve_model_path
from eagle_infer.heads import DraftHead, HeadConfig, save_head
from eagle_infer.loader import safetensors_files
from eagle_train.train import load_target_io

scale, out, vocab_file = float(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.manual_seed(0)
tgt = load_target_io(None)
sd = load_file(vocab_file)
d2t, t2d = sd["d2t"].long(), sd["t2d"].bool()
hc = HeadConfig.for_target(tgt.config, "eagle3", d2t.numel(), None, fc_bias=True)
head = DraftHead(hc, tgt.embed_tokens, tgt.lm_head_weight)
head.d2t.copy_(d2t)
head.t2d.copy_(t2d)
norm = None
for f in safetensors_files(resolve_model_path(None)):
    with safe_open(str(f), "pt") as st:
        if "model.norm.weight" in st.keys():
            norm = st.get_tensor("model.norm.weight").float()
with torch.no_grad():
    ids = torch.arange(d2t.numel()) + d2t
    head.lm_head.weight.copy_(tgt.lm_head_weight[ids])
    head.norm.weight.copy_(norm * scale)
save_head(head, out, dtype=torch.float32)
print("saved", out, "aux", hc.aux_hidden_indices)
