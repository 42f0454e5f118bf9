"""A tiny random Llama GGUF file, written with the ``gguf`` package's writer, for tests of GGUF input
that must not need the 93 MB demo wheel: 2 layers, hidden 64, a byte-level BPE tokenizer with a
ChatML template, tied embeddings (no ``output.weight``), as llama.cpp lays them out."""

from __future__ import annotations

from pathlib import Path

import numpy as np

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = ("Ġ t", "h e", "Ġt he")  # a few, so the BPE model has something to merge
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2


def tiny_vocab() -> list[str]:
    from tokenizers.pre_tokenizers import ByteLevel

    merged = ["".join(m.split()) for m in MERGES]
    return [*SPECIAL_TOKENS, *sorted(ByteLevel.alphabet()), *merged]


def make_tiny_gguf(path: Path, quant: str = "Q8_0", seed: int = 0) -> Path:
    """Write the tiny model to ``path``; matrices in ``quant`` (e.g. Q8_0, F16), norms in F32."""
    import gguf

    vocab = tiny_vocab()
    writer = gguf.GGUFWriter(str(path), "llama")
    _write_config(writer, len(vocab))
    _write_tokenizer(writer, vocab)
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[quant]
    for name, shape in _tensor_shapes(len(vocab)):
        if name.endswith("norm.weight"):
            # stored F32 as llama.cpp does, holding 16-bit values as converted checkpoints do
            norm = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float16)
            writer.add_tensor(name, norm.astype(np.float32))
        else:
            values = (0.05 * rng.standard_normal(shape)).astype(np.float32)
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_config(writer, vocab_size: int) -> None:
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab_size)


def _write_tokenizer(writer, vocab: list[str]) -> None:
    import gguf

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab)
    special = gguf.TokenType.CONTROL
    writer.add_token_types([special if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in vocab])
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)


def _tensor_shapes(vocab_size: int) -> list[tuple[str, tuple[int, ...]]]:
    """GGUF tensor names and their (torch-order) shapes."""
    head_dim = HIDDEN // HEADS
    shapes = [("token_embd.weight", (vocab_size, HIDDEN)), ("output_norm.weight", (HIDDEN,))]
    for i in range(LAYERS):
        shapes += [
            (f"blk.{i}.attn_norm.weight", (HIDDEN,)),
            (f"blk.{i}.attn_q.weight", (HIDDEN, HIDDEN)),
            (f"blk.{i}.attn_k.weight", (KV_HEADS * head_dim, HIDDEN)),
            (f"blk.{i}.attn_v.weight", (KV_HEADS * head_dim, HIDDEN)),
            (f"blk.{i}.attn_output.weight", (HIDDEN, HIDDEN)),
            (f"blk.{i}.ffn_norm.weight", (HIDDEN,)),
            (f"blk.{i}.ffn_gate.weight", (FFN, HIDDEN)),
            (f"blk.{i}.ffn_up.weight", (FFN, HIDDEN)),
            (f"blk.{i}.ffn_down.weight", (HIDDEN, FFN)),
        ]
    return shapes
