"""Rewrite rules (``match_*`` canonicalizations, ``fuse_*`` fusions), one per file.

Rules are small, local and semantics-preserving; they need no weights, ranks, devices or caches.
``RULES`` maps a rule name to where it lives; passes look rules up by name, lazily.
"""

from autodeploy.graph.rewrite import RewriteRule
from autodeploy.registry import Registry

RULES: Registry[type[RewriteRule]] = Registry("rewrite rule", entry_point_group="autodeploy.rules")

for _name, _target in {
    "match_repeat_kv": "autodeploy.transforms.match_repeat_kv:MatchRepeatKV",
    "match_sdpa_attention": "autodeploy.transforms.match_attention:MatchSDPAAttention",
    "match_eager_attention": "autodeploy.transforms.match_attention:MatchEagerAttention",
    "match_mla": "autodeploy.transforms.match_mla:MatchMLA",
    "match_sink_attention": "autodeploy.transforms.match_sink_attention:MatchSinkAttention",
    "match_bmm_attention": "autodeploy.transforms.match_bmm_attention:MatchBmmAttention",
    "match_select_attention": "autodeploy.transforms.match_select_attention:MatchSelectAttention",
    "match_query_temperature": "autodeploy.transforms.match_query_temperature:MatchQueryTemperature",
    "match_rope": "autodeploy.transforms.match_rope:MatchRoPE",
    "match_partial_rope": "autodeploy.transforms.match_rope:MatchPartialRoPE",
    "match_rms_norm": "autodeploy.transforms.match_rms_norm:MatchRMSNorm",
    "match_gated_rms_norm": "autodeploy.transforms.match_gated_rms_norm:MatchGatedRMSNorm",
    "match_gated_mlp": "autodeploy.transforms.match_gated_mlp:MatchGatedMLP",
    "match_moe": "autodeploy.transforms.match_moe:MatchMoE",
    "match_causal_conv1d": "autodeploy.transforms.match_causal_conv1d:MatchCausalConv1d",
    "match_mamba2_ssd": "autodeploy.transforms.match_mamba:MatchMamba2SSD",
    "match_lightning_attention": "autodeploy.transforms.match_lightning:MatchLightningAttention",
}.items():
    RULES.register_lazy(_name, _target)
