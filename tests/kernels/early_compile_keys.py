"""Run by test_early_compile.py in a fresh process with TRITON_INTERPRET=0 (real JIT, stand-in sm_90 driver):
prints, as JSON, the JIT cache keys of the attention launches that ``start_early_attention_compiles``
hands to the workers, and those the warm-up records for the same layer on a pool of many pages (argv: the
model type, then the KV cache dtypes to do this for, by default the model's)."""

import json
import sys
import types

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

from autodeploy.config import CompileConfig
from autodeploy.early_compile import guess_compiled_kinds, start_early_attention_compiles
from autodeploy.kernels.attention_warmup import warm_up_launches
from autodeploy.kernels.precompile import recording_compiles
from autodeploy.tiny import tiny_config

driver._active = types.SimpleNamespace(get_current_target=lambda: GPUTarget("cuda", 90, 32),
                                       get_current_device=lambda: 0, get_current_stream=lambda device: 0)
hf_config = tiny_config(sys.argv[1])
dtype, config, max_seq_len, cpu = torch.float16, CompileConfig(max_batch_size=8, max_num_tokens=96), 128, torch.device("cpu")


class Workers:
    specs: list = []

    def prefetch(self, specs):
        self.specs = list(specs)


workers = Workers()
early, warm_up = [], []
for kv_dtype in [getattr(torch, name) for name in sys.argv[2:]] or [dtype]:
    start_early_attention_compiles(hf_config, config, cpu, dtype, max_seq_len, workers, kv_dtype)
    early += [spec.key for spec in workers.specs]
    for kind in guess_compiled_kinds(hf_config, config, dtype, kv_dtype):
        pages = 300  # a pool as the KV sizing step would allocate it: any size
        cache = torch.zeros(pages, 2, config.tokens_per_block, kind.num_kv_heads, kind.head_dim, dtype=kv_dtype)
        with recording_compiles() as specs:
            warm_up_launches(cache, kind.num_heads, dtype, 0.125, kind.sliding_window, kind.logit_softcap, None,
                             config.max_batch_size, config.max_num_tokens, max_seq_len // config.tokens_per_block,
                             kind.rope)
        warm_up += [spec.key for spec in specs]
print(json.dumps({"early": early, "warm_up": warm_up}))
