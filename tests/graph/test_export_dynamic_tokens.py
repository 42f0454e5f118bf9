"""The token dimension stays dynamic through export, also for a model whose code holds only for short
steps: MPT builds its ALiBi bias for ``config.max_seq_len`` tokens and slices it to the step's token
count (export with a ranged Dim rejected it: the slice is right only for T <= max_seq_len). Once the
bias is read as slopes, a step of more tokens than that (several sequences) runs and matches HF."""

import torch
from transformers import AutoModelForCausalLM

from autodeploy.compiler import compile as compile_model
from autodeploy.kvcache.allocator import BlockAllocator, blocks_needed
from autodeploy.kvcache.metadata import SequenceChunk
from autodeploy.tiny import make_tiny_checkpoint


def test_mpt_runs_steps_longer_than_its_alibi_table(tmp_path):
    model_dir = make_tiny_checkpoint("mpt", tmp_path / "mpt", max_seq_len=16)
    compiled = compile_model(model_dir, dtype="float32", device="cpu", max_seq_len=16)
    (input_ids,) = [n for n in compiled.gm.graph.find_nodes(op="placeholder") if n.name == "input_ids"]
    assert isinstance(input_ids.meta["val"].shape[0], torch.SymInt)
    assert compiled.report.op_counts.get("paged_attention") == 2

    prompts = torch.randint(0, compiled.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    allocator = BlockAllocator(compiled.num_blocks)
    chunks = [SequenceChunk(tuple(p.tolist()), 0, tuple(allocator.allocate(blocks_needed(12, compiled.block_size))))
              for p in prompts]  # one step of 36 tokens: more than the 16 the bias was built for
    got = compiled(chunks).float()

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.inference_mode():
        want = reference(prompts).logits[:, -1].float()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
