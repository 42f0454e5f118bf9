import autodeploy
from autodeploy import SamplingParams


def test_llm_facade_generates_through_the_engine(compiled, tokenizer):
    from autodeploy.serve.engine import Engine
    from autodeploy.serve.llm import LLM

    assert autodeploy.LLM is LLM
    llm = autodeploy.LLM(compiled, tokenizer)
    assert isinstance(llm.engine, Engine)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(["Hello world", tokenizer.encode("The quick brown fox")], params)
    assert [o.prompt_token_ids for o in outs] == [tuple(tokenizer.encode("Hello world")),
                                                  tuple(tokenizer.encode("The quick brown fox"))]
    assert all(len(o.outputs[0].token_ids) == 5 and o.finished for o in outs)
    assert outs[0].outputs[0].text == tokenizer.decode(list(outs[0].outputs[0].token_ids))
    assert llm.generate("Hello world", params)[0].outputs == outs[0].outputs
    reply = llm.chat([{"role": "user", "content": "hi"}], params)[0]
    assert len(reply.outputs[0].token_ids) == 5
    assert llm.engine.blocks.num_used == 0


def test_llm_leaves_no_request_behind_on_a_bad_prompt(compiled):
    llm = autodeploy.LLM(compiled, None)
    try:
        llm.generate([[1, 2, 3], [10_000]], SamplingParams(max_tokens=2))
    except ValueError as exc:
        assert "vocabulary" in str(exc)
    else:
        raise AssertionError("an out-of-vocabulary prompt must be rejected")
    assert not llm.engine.has_unfinished_requests() and llm.engine.blocks.num_used == 0


def test_chat_template_override(tiny_dir, tmp_path):
    from autodeploy.serve.tokenizer import load_tokenizer, render_chat

    inline = load_tokenizer(tiny_dir, chat_template="{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    template_file = tmp_path / "t.jinja"
    template_file.write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    from_file = load_tokenizer(tiny_dir, chat_template=str(template_file))
    messages = [{"role": "user", "content": "hi"}]
    assert inline.decode(render_chat(inline, messages)) == "[hi]"
    assert from_file.decode(render_chat(from_file, messages)) == "<hi>"
