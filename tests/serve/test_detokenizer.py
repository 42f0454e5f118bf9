from autodeploy.serve.detokenizer import IncrementalDetokenizer


def _stream(tokenizer, prompt: str, text: str, **kwargs):
    prompt_ids = tokenizer.encode(prompt)
    ids = tokenizer.encode(prompt + text)[len(prompt_ids):]
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, **kwargs)
    pieces, stop = [], None
    for token in ids:
        stop = detok.add_token(token)
        pieces.append(detok.take_new_text(finished=stop is not None))
        if stop:
            break
    pieces.append(detok.take_new_text(finished=True))
    return "".join(pieces), detok.text, stop, pieces


def test_incremental_text_equals_decoding_everything(tokenizer):
    text = " quick brown fox: 10 100 1000 — naïve café ünïcödé 日本語"
    streamed, full, stop, _ = _stream(tokenizer, "The", text)
    assert stop is None
    assert streamed == full == text


def test_partial_multibyte_characters_are_never_emitted(tokenizer):
    _, _, _, pieces = _stream(tokenizer, "A", " 日本語 café")
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_cuts_the_text_and_nothing_after_it_was_streamed(tokenizer):
    streamed, full, stop, pieces = _stream(tokenizer, "Hello", " world! How are you today?", stop=("are you",))
    assert stop == "are you"
    assert streamed == full == " world! How "
    assert "are" not in "".join(pieces)


def test_include_stop_str_in_output(tokenizer):
    streamed, _, stop, _ = _stream(tokenizer, "Hello", " world! How are you today?", stop=("How",),
                                   include_stop_str_in_output=True)
    assert stop == "How" and streamed == " world! How"


def test_earliest_stop_string_wins(tokenizer):
    streamed, _, stop, _ = _stream(tokenizer, "Hi", " the lazy dog jumps", stop=("dog", "lazy"))
    assert stop == "lazy" and streamed == " the "


def test_a_possible_stop_prefix_is_held_back_then_released(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"), stop=("fox!",))
    for token in tokenizer.encode(" the fo"):
        assert detok.add_token(token) is None
    assert detok.take_new_text(finished=False) == " the "  # "fo" could become "fox!"
    for token in tokenizer.encode("g"):
        detok.add_token(token)
    assert detok.take_new_text(finished=False) == "fog"
