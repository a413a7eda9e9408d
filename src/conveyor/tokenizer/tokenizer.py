"""Text <-> token ids, from a GGUF file's vocabulary or an HF tokenizer.json.

Both are served by the `tokenizers` library (Rust): a GGUF vocabulary is rebuilt as the BPE
model llama.cpp runs, with the pre-tokenizer regex llama.cpp uses for `tokenizer.ggml.pre`.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, Literal, overload

from gguf import GGUFReader
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer
from tokenizers.models import BPE

from conveyor.tokenizer.chat_template import open_final_message, render_chat_template

# llama.cpp token types (tokenizer.ggml.token_type).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
# The GGUF token ids that end generation (llama.cpp's end-of-generation tokens): end of text,
# of turn, of message (Llama 3.1's <|eom_id|>, after a tool call)
GGUF_END_TOKENS = ("eos", "eot", "eom")

# Pre-tokenizer splits, as llama.cpp's llama-vocab.cpp (and the models' own tokenizer.json) do.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Mistral's tekken (Mistral Nemo, Mistral Small 3, Ministral): its tokenizer's own pattern
# (mistral_common's tekken_*.json `config.pattern`, llama.cpp's original of its rewrite)
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_PRES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral")
_TEKKEN_PRES = ("tekken",)
# Whole pre-tokens found in the vocabulary are taken as they are (llama.cpp's ignore_merges)
_IGNORE_MERGES_PRES = (*_LLAMA3_PRES, *_TEKKEN_PRES)
_QWEN2_PRES = ("qwen2", "deepseek-r1-qwen", "megrez")
_DIGIT_PRES = ("smollm", "starcoder", "refact")  # GPT-2 regex after splitting every digit
_GPT2_PRES = (None, "default", "gpt2", "gpt-2")  # GPT-2's regex itself (None: no key)


# A sentencepiece vocabulary's entry for one byte (its byte fallback)
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {char: byte for byte, char in _bytes_to_unicode().items()}


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _LLAMA3_PRES:
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated")
        return pre_tokenizers.Sequence([split, byte_level])
    if pre in _QWEN2_PRES:
        split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated")
        return pre_tokenizers.Sequence([split, byte_level])
    if pre in _TEKKEN_PRES:
        split = pre_tokenizers.Split(Regex(_TEKKEN_SPLIT), behavior="isolated")
        return pre_tokenizers.Sequence([split, byte_level])
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_PRES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre not in _GPT2_PRES:  # another regex (DeepSeek's, ...): GPT-2's would split text
        # otherwise than the model was trained on, silently (llama.cpp refuses)
        known = sorted(p for p in (*_GPT2_PRES, *_LLAMA3_PRES, *_QWEN2_PRES, *_DIGIT_PRES,
                                   *_TEKKEN_PRES) if p)
        raise ValueError(f"tokenizer.ggml.pre {pre!r} is not supported (supported: "
                         f"{', '.join(known)}); pass the model's tokenizer.json folder as "
                         "tokenizer (--tokenizer)")
    return gpt2


def _merge_pairs(merges: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        left, _, right = merge.partition(" ")
        pairs.append((left, right))
    return pairs


def _byte_level_model(tokens: list[str], merges: list[str], pre: str | None,
                      types: list[int]) -> RustTokenizer:
    alphabet = set(_bytes_to_unicode().values())
    spelling = _bytes_to_unicode()
    # A few converters store a token in plain UTF-8 rather than the byte alphabet; respell it.
    # Not a control or user-defined one: those are matched in the text as written (added
    # tokens: DeepSeek-R1's "<｜User｜>"), and respelled here they would be added again under
    # new ids past the vocabulary.
    kept = {i for i, kind in enumerate(types) if kind in (TOKEN_TYPE_CONTROL,
                                                          TOKEN_TYPE_USER_DEFINED)}
    vocab = {tok if set(tok) <= alphabet or i in kept
             else "".join(spelling[b] for b in tok.encode()): i
             for i, tok in enumerate(tokens)}
    pairs = _merge_pairs(merges)
    # llama.cpp (and Llama 3's tokenizer.json) take a whole pre-token that is in the vocab as is.
    model = BPE(vocab=vocab, merges=pairs, ignore_merges=pre in _IGNORE_MERGES_PRES)
    tok = RustTokenizer(model)
    tok.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    if pre in _QWEN2_PRES:
        tok.normalizer = normalizers.NFC()
    return tok


def _sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a sentencepiece vocabulary: best-scored merged piece first."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges: list[tuple[float, str, str]] = []
    for piece, score in zip(tokens, scores, strict=True):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((score, left, right))
    merges.sort(key=lambda m: (-m[0], vocab[m[1]], vocab[m[2]]))
    return [(left, right) for _, left, right in merges]


def _sentencepiece_model(tokens: list[str], scores: list[float], merges: list[str] | None,
                         unk_id: int | None, add_space_prefix: bool) -> RustTokenizer:
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = _merge_pairs(merges) if merges else _sentencepiece_merges(tokens, scores)
    unk = tokens[unk_id] if unk_id is not None else None
    tok = RustTokenizer(BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True,
                            byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _token_content(value: object) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def check_text(text: str, field: str) -> None:
    """ValueError naming `field` unless `text` is valid Unicode.

    The Rust tokenizer takes only text that encodes to UTF-8: a lone surrogate ("\\ud800",
    which a JSON string can carry as an escape) is a TypeError there, not a ValueError.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{field} is not valid Unicode text: character {e.start} is "
                         f"{text[e.start]!r} ({e.reason})") from None


class Tokenizer:
    """Encode/decode, special token ids and the chat template of one model."""

    def __init__(self, backend: RustTokenizer, *, bos_token_id: int | None,
                 eos_token_ids: Sequence[int], add_bos_token: bool = False,
                 add_eos_token: bool = False, chat_template: str | None = None) -> None:
        self._tok = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = ()
        self.eos_token_id: int | None = None
        self.add_eos_token_ids(eos_token_ids)
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self.chat_template = chat_template
        # Characters of the longest vocabulary entry: no token stands for more characters of
        # text (a byte-level entry spells one character per byte, a sentencepiece entry its
        # characters or `<0xAB>` for one byte), so a text longer than this times a number of
        # tokens cannot fit in that many; the engine refuses it without tokenizing it.
        self.max_token_chars: int = max(map(len, backend.get_vocab(with_added_tokens=True)),
                                        default=1)

    @classmethod
    def from_gguf(cls, reader_or_path: GGUFReader | str) -> Tokenizer:
        """Rebuild the tokenizer a GGUF file describes (tokenizer.ggml.* metadata)."""
        reader = (reader_or_path if isinstance(reader_or_path, GGUFReader)
                  else GGUFReader(reader_or_path, "r"))
        tokens = list(_field(reader, "tokenizer.ggml.tokens") or [])
        if not tokens:
            raise ValueError("this GGUF file has no tokenizer (tokenizer.ggml.tokens)")
        kind = _field(reader, "tokenizer.ggml.model")
        unk_id = _field(reader, "tokenizer.ggml.unknown_token_id")
        types = list(_field(reader, "tokenizer.ggml.token_type") or [])
        if kind == "gpt2":
            pre = _field(reader, "tokenizer.ggml.pre")
            backend = _byte_level_model(tokens, list(_field(reader, "tokenizer.ggml.merges", [])),
                                        pre, types)
            add_bos_default = pre in _TEKKEN_PRES  # (llama.cpp's defaults)
        elif kind == "llama":
            backend = _sentencepiece_model(
                tokens, list(_field(reader, "tokenizer.ggml.scores", [0.0] * len(tokens))),
                _field(reader, "tokenizer.ggml.merges"), unk_id,
                bool(_field(reader, "tokenizer.ggml.add_space_prefix", True)))
            add_bos_default = True  # llama.cpp's default for sentencepiece vocabularies
        else:
            raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; supported: gpt2, llama")
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, kind_ in zip(tokens, types, strict=False)
                                    if kind_ == TOKEN_TYPE_CONTROL])
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t, kind_ in zip(tokens, types, strict=False)
                            if kind_ == TOKEN_TYPE_USER_DEFINED])
        eos = [_field(reader, f"tokenizer.ggml.{n}_token_id") for n in GGUF_END_TOKENS]
        return cls(backend,
                   bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
                   eos_token_ids=[int(i) for i in eos if i is not None],
                   add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token",
                                             add_bos_default)),
                   add_eos_token=bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
                   chat_template=_field(reader, "tokenizer.chat_template"))

    @classmethod
    def from_hf(cls, folder: str) -> Tokenizer:
        """tokenizer.json + tokenizer_config.json (+ chat_template.jinja) of an HF folder."""
        import json

        backend = RustTokenizer.from_file(os.path.join(folder, "tokenizer.json"))
        config: dict[str, Any] = {}
        config_path = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_path = os.path.join(folder, "chat_template.jinja")
        if os.path.isfile(jinja_path):  # first, as transformers reads it (a fix often lands
            # there while tokenizer_config.json keeps the old template)
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        bos, eos = _token_content(config.get("bos_token")), _token_content(config.get("eos_token"))
        bos_id = backend.token_to_id(bos) if bos else None
        eos_id = backend.token_to_id(eos) if eos else None
        # With a post-processor, tokenizer.json adds BOS itself (Llama 3); otherwise follow the flag.
        add_bos = backend.post_processor is None and bool(config.get("add_bos_token", False))
        add_eos = backend.post_processor is None and bool(config.get("add_eos_token", False))
        return cls(backend, bos_token_id=bos_id,
                   eos_token_ids=[eos_id] if eos_id is not None else [],
                   add_bos_token=add_bos, add_eos_token=add_eos, chat_template=template)

    @property
    def bos_token(self) -> str | None:
        return self._tok.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None

    @property
    def eos_token(self) -> str | None:
        return self._tok.id_to_token(self.eos_token_id) if self.eos_token_id is not None else None

    def add_eos_token_ids(self, ids: Sequence[int]) -> None:
        """Also end generation on ``ids`` (the model config's, generation_config.json's)."""
        self.eos_token_ids = tuple(dict.fromkeys((*self.eos_token_ids, *ids)))
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True, *,
               field: str = "text") -> list[int]:
        """Token ids of `text`; BOS/EOS only when the model asks for them.

        ValueError naming `field` when `text` is not valid Unicode (a lone surrogate).
        """
        check_text(text, field)
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            if self.add_bos_token and self.bos_token_id is not None:
                ids.insert(0, self.bos_token_id)
            if self.add_eos_token and self.eos_token_id is not None:
                ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text as it reads inside a text (a logprob's token): a sentencepiece
        word keeps its leading space, which decoding it alone strips (the decoder drops the
        space a text's first word gets)."""
        anchor = self._strip_anchor
        if anchor is None:
            return self.decode([token_id], skip_special_tokens=False)
        both = self.decode([anchor, token_id], skip_special_tokens=False)
        return both[len(self.decode([anchor], skip_special_tokens=False)):]

    @functools.cached_property
    def _strip_anchor(self) -> int | None:
        """A token to decode before another when the decoder strips a leading space (a
        sentencepiece vocabulary with add_space_prefix); None when it does not."""
        vocab = self._tok.get_vocab(with_added_tokens=False)
        word = next((t for t in sorted(vocab) if t.startswith("▁") and t[1:2].isalnum()),
                    None)  # (a word: "▁▁" decodes to spaces whether or not one is stripped)
        if word is None or self.decode([vocab[word]]).startswith(" "):
            return None
        return next((i for t, i in sorted(vocab.items()) if len(t) == 1 and t.isalpha()), None)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: its text's UTF-8, or for a piece of a character
        (a byte-level entry's spelling, a sentencepiece `<0xAB>`) the raw bytes, which its
        text shows as U+FFFD (OpenAI's logprob `bytes`: pieces join to the text)."""
        text = self.token_text(token_id)
        if "\ufffd" not in text:
            return text.encode()
        piece = self.id_to_token(token_id)
        if (byte := _BYTE_PIECE.fullmatch(piece)) is not None:
            return bytes([int(byte.group(1), 16)])
        table = _unicode_to_bytes()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return text.encode()

    def id_to_token(self, token_id: int) -> str:
        """The raw vocabulary string of one id (byte-level spelling), for logprobs display."""
        token = self._tok.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is out of range [0, {self.vocab_size})")
        return token

    def backend_json(self) -> str:
        """The `tokenizers` serialization of the vocabulary (what grammar engines load)."""
        text: str = self._tok.to_str()
        return text

    def is_special(self, token: str) -> bool:
        """Whether ``token`` is a special (control) token: decoding drops it unless asked
        (skip_special_tokens=False)."""
        return token in self._special_tokens

    @functools.cached_property
    def _special_tokens(self) -> frozenset[str]:
        return frozenset(added.content for added in
                         self._tok.get_added_tokens_decoder().values() if added.special)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    # transformers' names, for scripts written against vLLM's get_tokenizer() (an HF one)
    def __len__(self) -> int:
        return self.vocab_size

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: Sequence[str]) -> list[int | None]:
        return [self.token_to_id(t) for t in tokens]

    def batch_decode(self, sequences: Sequence[Sequence[int]],
                     skip_special_tokens: bool = False) -> list[str]:
        """Each sequence's text (special tokens kept unless asked, as transformers')."""
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def get_vocab(self) -> dict[str, int]:
        """token -> id, added tokens included."""
        vocab: dict[str, int] = self._tok.get_vocab(with_added_tokens=True)
        return vocab

    @overload
    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = ..., continue_final_message: bool = ...,
                            *, tokenize: Literal[False] = ..., **kwargs: Any) -> str: ...

    @overload
    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = ..., continue_final_message: bool = ...,
                            *, tokenize: Literal[True], **kwargs: Any) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            continue_final_message: bool = False, *, tokenize: bool = False,
                            **kwargs: Any) -> str | list[int]:
        """The prompt text for a conversation, rendered with the model's own template (with
        ``tokenize=True`` its token ids, as transformers', whose default that is: here the
        text is, as vLLM's server code asks for it); ``continue_final_message`` (vLLM's and
        transformers' name) leaves the last message open for the model to continue (a
        reply's start written for it)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain completion prompt "
                             "instead")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be "
                             "true")
        text = render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                    **kwargs)
        text = open_final_message(text, messages) if continue_final_message else text
        if not tokenize:
            return text
        return self.encode(text, add_special_tokens=False,
                           field="messages, rendered by the chat template,")

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, **kwargs: Any) -> list[int]:
        """Token ids of a rendered conversation (the template writes the special tokens)."""
        return self.apply_chat_template(messages, add_generation_prompt, continue_final_message,
                                        tokenize=True, **kwargs)
