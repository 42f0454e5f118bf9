"""match_repeat_kv: HF's ``repeat_kv`` (unsqueeze -> expand -> reshape) -> ``autodeploy::repeat_kv``.

Attention rules then see GQA as one op and drop it: the canonical attention is GQA-native.
"""

from __future__ import annotations

import torch

from autodeploy.graph.matcher import Match
from autodeploy.graph.rewrite import PatternSpec, RewriteRule


def hf_repeat_kv(x):
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, 2, s, d).reshape(b, h * 2, s, d)


class MatchRepeatKV(RewriteRule):
    name = "match_repeat_kv"

    def patterns(self) -> list[PatternSpec]:
        return [PatternSpec(hf_repeat_kv, {"x": torch.randn(1, 2, 3, 4)})]

    def check(self, m: Match, gm) -> str | None:
        heads_in, heads_out = m["x"].meta["val"].shape[1], m.anchor.meta["val"].shape[1]
        if heads_out % heads_in:
            return "output heads are not a multiple of input heads"
        return None

    def replacement_kwargs(self, m: Match, gm) -> dict:
        n_rep = m.anchor.meta["val"].shape[1] // m["x"].meta["val"].shape[1]
        return {"x": m["x"], "n_rep": int(n_rep)}

    def replacement(self, x, n_rep):
        return torch.ops.autodeploy.repeat_kv.default(x, n_rep)
