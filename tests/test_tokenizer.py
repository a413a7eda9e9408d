"""Tokenizer, chat template and incremental detokenizer, against transformers on the same file."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest_models import default_gguf, hf_gguf_tokenizer, hf_tokenizer_folder
from conveyor.tokenizer.detokenizer import IncrementalDetokenizer
from conveyor.tokenizer.tokenizer import Tokenizer, _unicode_to_bytes

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Emoji: 🙂🎉👩‍👩‍👧 and flags 🇫🇷",
    "中文分词测试，日本語のテキスト、한국어",
    "Accents: café, naïve, Ångström, über, ñandú",
    "Digits 1234567890 and 3.14159, 1,000,000 and 42nd",
    "Whitespace   runs\t\ttabs\n\n\nnewlines   \n  trailing   ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "don't won't I'm you're we've they'll he'd",
    "",
    " leading space",
    "URL https://example.com/a?b=c&d=e#f and email a.b@c.org",
]
MULTIBYTE = "Café 🙂 中文 🎉👩‍👩‍👧 日本語 ñ — done ✓"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(default_gguf())


@pytest.fixture(scope="module")
def hf_tok():
    return hf_gguf_tokenizer()


def test_gguf_special_ids_and_vocab(tok: Tokenizer, hf_tok) -> None:
    assert tok.vocab_size == len(hf_tok) == 49152
    assert tok.bos_token_id == hf_tok.bos_token_id == 1
    assert tok.eos_token_id == hf_tok.eos_token_id == 2
    assert tok.eos_token_ids == (2,)
    assert [tok.id_to_token(i) for i in (0, 1, 2, 216, 19556)] == \
        hf_tok.convert_ids_to_tokens([0, 1, 2, 216, 19556])
    with pytest.raises(ValueError, match="out of range"):
        tok.id_to_token(10**7)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, hf_tok, text: str) -> None:
    assert tok.encode(text) == hf_tok(text).input_ids
    assert tok.encode(text, add_special_tokens=False) == \
        hf_tok(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(tok: Tokenizer, hf_tok, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


def test_decode_skips_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nHi"


CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok: Tokenizer, hf_tok, messages,
                                            add_generation_prompt: bool) -> None:
    expected = hf_tok.apply_chat_template(messages, tokenize=False,
                                          add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(messages, add_generation_prompt) == expected


def test_transformers_names_answer_as_transformers(tok: Tokenizer, hf_tok) -> None:
    """What scripts call on vLLM's get_tokenizer() (a transformers tokenizer)."""
    ids = tok.encode(TEXTS[8], add_special_tokens=False)
    assert len(tok) == len(hf_tok)
    assert tok.convert_ids_to_tokens(ids) == hf_tok.convert_ids_to_tokens(ids)
    assert tok.convert_tokens_to_ids(tok.convert_ids_to_tokens(ids)) == ids
    assert tok.batch_decode([ids, ids[:3]]) == hf_tok.batch_decode([ids, ids[:3]])


def test_apply_chat_template_tokenizes_when_asked(tok: Tokenizer, hf_tok) -> None:
    """tokenize=True gives the ids, as transformers' (whose default it is), tokenize=False
    the text: neither reaches the template."""
    messages = [{"role": "user", "content": "Hi there"}]
    ids = tok.apply_chat_template(messages, tokenize=True)
    assert ids == hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                             return_dict=False)
    assert tok.apply_chat_template(messages, tokenize=False) == tok.decode(
        ids, skip_special_tokens=False)


@pytest.mark.parametrize("start", ["The answer is", "  Four, since "])
def test_continue_final_message_matches_transformers(tok: Tokenizer, hf_tok, start) -> None:
    """The last message left open, as transformers renders it (spaces around it kept)."""
    messages = [*CONVERSATIONS[0], {"role": "assistant", "content": start}]
    expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                          continue_final_message=True)
    got = tok.apply_chat_template(messages, False, continue_final_message=True)
    assert got == expected and got.endswith(start)
    with pytest.raises(ValueError, match="cannot both be true"):
        tok.apply_chat_template(messages, True, continue_final_message=True)
    with pytest.raises(ValueError, match="final message with text"):
        tok.apply_chat_template([*messages[:1], {"role": "assistant", "content": " "}], False,
                                continue_final_message=True)


def test_generation_blocks_render_as_transformers_renders_them() -> None:
    """Templates written for training mark the assistant's text with {% generation %}
    (transformers' extension): it renders as its body; it failed to compile before."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from conveyor.tokenizer.chat_template import render_chat_template

    template = ("{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}\n"
                "{% generation %}\n{{ m.content }}{% endgeneration %}\n{% else %}"
                "{{ m.content }}{% endif %}</s>{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello there"},
                {"role": "user", "content": "bye"}]
    (expected,), _ = render_jinja_template([messages], chat_template=template,
                                           add_generation_prompt=True)
    assert render_chat_template(template, messages, True) == expected
    assert "hello there</s><user>" in expected


def test_chat_template_errors(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="list"):
        tok.apply_chat_template("hello")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"content": "no role"}])
    strict = Tokenizer(tok._tok, bos_token_id=1, eos_token_ids=[2], chat_template=(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
        "{% endif %}{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}"))
    assert strict.apply_chat_template([{"role": "user", "content": "x"}]) == \
        "<|im_start|>x<|im_end|>"
    with pytest.raises(ValueError, match="first must be user"):
        strict.apply_chat_template([{"role": "system", "content": "x"}])
    bare = Tokenizer(tok._tok, bos_token_id=1, eos_token_ids=[2], chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])


def test_from_hf_folder_matches_gguf(tok: Tokenizer, tmp_path) -> None:
    hf_folder_tok = Tokenizer.from_hf(hf_tokenizer_folder())
    for text in TEXTS:
        assert hf_folder_tok.encode(text) == tok.encode(text)
    assert hf_folder_tok.vocab_size == tok.vocab_size
    assert hf_folder_tok.chat_template == tok.chat_template
    assert hf_folder_tok.eos_token_id == 2
    # chat_template.jinja wins over tokenizer_config.json's template, as in transformers
    shutil.copytree(hf_tokenizer_folder(), tmp_path / "tok")
    config = tmp_path / "tok" / "tokenizer_config.json"
    old = json.loads(config.read_text()) if config.exists() else {}
    config.write_text(json.dumps({**old, "chat_template": "OLD {{ messages[0]['content'] }}"}))
    (tmp_path / "tok" / "chat_template.jinja").write_text("NEW {{ messages[0]['content'] }}")
    assert Tokenizer.from_hf(str(tmp_path / "tok")).apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=False) == "NEW hi"


def test_gguf_control_tokens_outside_the_byte_alphabet_keep_their_ids(tmp_path) -> None:
    """DeepSeek-R1-Distill-Qwen's control tokens ("<｜User｜>", fullwidth bars) are stored as
    written: matched in the text under their own ids, as llama.cpp does, not respelled in
    the byte alphabet and added again past the vocabulary."""
    import gguf

    from conveyor.tokenizer.tokenizer import TOKEN_TYPE_CONTROL, _bytes_to_unicode

    byte_chars = list(_bytes_to_unicode().values())
    specials = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>"]
    path = str(tmp_path / "tok.gguf")
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("deepseek-r1-qwen")
    writer.add_token_list(byte_chars + specials)
    writer.add_token_types([1] * len(byte_chars) + [TOKEN_TYPE_CONTROL] * len(specials))
    writer.add_token_merges([])
    writer.add_bos_token_id(len(byte_chars))
    writer.add_eos_token_id(len(byte_chars) + 1)
    writer.add_eom_token_id(byte_chars.index("!"))  # (end of message ends generation too)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    tok = Tokenizer.from_gguf(path)
    assert tok.vocab_size == len(byte_chars) + len(specials)
    user = len(byte_chars) + 2
    ids = tok.encode("<｜User｜>hi", add_special_tokens=False)
    assert ids == [user, byte_chars.index("h"), byte_chars.index("i")]
    assert tok.bos_token == specials[0] and tok.eos_token_ids == (user - 1, 0)
    assert tok.decode([*ids, user - 1]) == "hi"


def _byte_level_gguf(path: str, pre: str, tokens: list[str], merges: list[str]) -> str:
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_an_unknown_gguf_pre_tokenizer_is_refused(tmp_path) -> None:
    """A pre-tokenizer regex conveyor does not know (DeepSeek LLM's) is refused, naming the
    key and the way out, not replaced by GPT-2's regex (text split otherwise)."""
    path = _byte_level_gguf(str(tmp_path / "tok.gguf"), "deepseek-llm", ["a", "b", "ab"],
                            ["a b"])
    with pytest.raises(ValueError, match=r"tokenizer.ggml.pre 'deepseek-llm' .*--tokenizer"):
        Tokenizer.from_gguf(path)


# Mistral's tekken pattern as its tokenizer file writes it (mistral_common's tekken_240718.json,
# config.pattern), read by Python's `regex` (what tiktoken-style tokenizers run it with)
TEKKEN_PATTERN_JSON = (
    r'"[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*'
    r'[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+|[^\\r\\n\\p{L}\\p{N}]?'
    r'[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|'
    r'\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"')


@pytest.mark.parametrize("text", [*TEXTS, MULTIBYTE, "HelloWorld camelCaseNames XMLHttpRequest",
                                  "2024-11-28 x=42 /path/to\n\nend  "])
def test_tekken_splits_text_as_its_pattern_does(tmp_path, text: str) -> None:
    """tokenizer.ggml.pre "tekken" (Mistral Nemo, Mistral Small 3): the pre-tokens are the
    matches of the tokenizer's own pattern; whole pre-tokens in the vocabulary are kept
    (llama.cpp's ignore_merges), and BOS is added by default (llama.cpp's for tekken)."""
    import regex

    path = _byte_level_gguf(str(tmp_path / "tekken.gguf"), "tekken", ["a", "b", "ab"], ["a b"])
    tekken = Tokenizer.from_gguf(path)
    split = tekken._tok.pre_tokenizer.pre_tokenize_str(text)
    spelled = [piece for piece, _ in split]
    expected = regex.findall(json.loads(TEKKEN_PATTERN_JSON), text)
    table = {b: c for c, b in _unicode_to_bytes().items()}
    assert spelled == ["".join(table[b] for b in piece.encode()) for piece in expected]
    assert tekken.add_bos_token and tekken._tok.model.ignore_merges


def test_tekken_splits_at_case_changes_and_single_digits(tmp_path) -> None:
    path = _byte_level_gguf(str(tmp_path / "tekken.gguf"), "tekken", ["a", "b", "ab"], ["a b"])
    tekken = Tokenizer.from_gguf(path)
    pieces = [p for p, _ in tekken._tok.pre_tokenizer.pre_tokenize_str("HelloWorld 123")]
    assert pieces == ["Hello", "World", "Ġ", "1", "2", "3"]


def _stream(tok: Tokenizer, prompt: list[int], output: list[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    chunks = [detok.update([token_id]) for token_id in output]
    assert "".join(chunks) == detok.text
    return chunks


@pytest.mark.parametrize("text", [MULTIBYTE, TEXTS[3], TEXTS[4], TEXTS[2]])
def test_incremental_detokenizer_never_splits_a_character(tok: Tokenizer, text: str) -> None:
    prompt = tok.encode("Say something:")
    output = tok.encode(text, add_special_tokens=False)
    chunks = _stream(tok, prompt, output)
    assert "".join(chunks) == tok.decode(output)
    assert not any("\ufffd" in chunk for chunk in chunks)
    # Multi-token characters really occur here, so some steps must hold text back.
    if text in (MULTIBYTE, TEXTS[3]):
        assert "" in chunks


def test_incremental_detokenizer_special_tokens_and_batches(tok: Tokenizer) -> None:
    output = tok.encode("Hi 🙂<|im_end|>", add_special_tokens=False)
    assert "".join(_stream(tok, [], output)) == "Hi 🙂"
    assert "".join(_stream(tok, [], output, skip=False)) == "Hi 🙂<|im_end|>"
    detok = IncrementalDetokenizer(tok, tok.encode("x"))
    assert detok.update(output[:2]) + detok.update(output[2:]) == "Hi 🙂"
    assert detok.update([]) == ""


@pytest.mark.parametrize("text", [MULTIBYTE, TEXTS[3], TEXTS[4], TEXTS[5]])
def test_token_bytes_join_to_the_text(tok: Tokenizer, text: str) -> None:
    """OpenAI's logprob `bytes`: each token's own, a piece of a character's raw bytes (its
    text is U+FFFD), so that they join to the text's UTF-8."""
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.token_bytes(i) for i in ids]
    assert b"".join(pieces) == text.encode()
    if text in (MULTIBYTE, TEXTS[3]):  # characters split over tokens really occur here
        assert any("\ufffd" in tok.decode([i]) for i in ids)


def test_sentencepiece_tokens_keep_their_leading_space() -> None:
    """A logprob's token as it reads in the text: "▁b" is " b" (decoding it alone strips
    the space, as the decoder does for a text's first word)."""
    from conveyor.tokenizer.tokenizer import _sentencepiece_model

    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁▁", "▁", "a",
              "b", "▁a", "▁b"]  # ("▁▁" decodes to spaces either way: not the test word)
    backend = _sentencepiece_model(tokens, [0.0] * len(tokens), None, 0, True)
    spm = Tokenizer(backend, bos_token_id=1, eos_token_ids=[2])
    output = spm.encode("a b b🐦", add_special_tokens=False)[1:]  # (after the "▁a")
    assert spm.decode([output[0]]) == "b"  # alone: the space is gone
    assert [spm.token_text(i) for i in output[:2]] == [" b", " b"]
    assert b"".join(spm.token_bytes(i) for i in output) == " b b🐦".encode()


def test_token_bytes_of_a_sentencepiece_byte_fallback() -> None:
    from conveyor.tokenizer.tokenizer import _sentencepiece_model

    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "a"]
    backend = _sentencepiece_model(tokens, [0.0] * len(tokens), None, 0, False)
    spm = Tokenizer(backend, bos_token_id=1, eos_token_ids=[2])
    ids = spm.encode("a🐦", add_special_tokens=False)
    assert [tokens[i] for i in ids] == ["a", "<0xF0>", "<0x9F>", "<0x90>", "<0xA6>"]
    assert b"".join(spm.token_bytes(i) for i in ids) == "a🐦".encode()
