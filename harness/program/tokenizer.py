"""A text tokenizer for a GGUF file, built from the file's own `tokenizer.ggml.*` metadata.

    tok = load_tokenizer("model.gguf")          # or a gguf.GGUFReader already open
    ids = tok.encode("Hello world")             # BOS first where the file says add_bos_token
    text = tok.decode(ids)                      # control tokens (BOS, EOS, ...) left out

Two families, the ones llama.cpp's decoders here need, named by `tokenizer.ggml.model`:

- "llama": SentencePiece BPE (Llama 2, Mistral, Gemma 1-3): tokens + scores + token_type.
  llama.cpp's algorithm (llm_tokenizer_spm): the text becomes UTF-8 characters, with ' ' written
  as U+2581 and, where tokenizer.ggml.add_space_prefix (default true), one U+2581 in front; then
  the adjacent pair whose concatenation is a token of the highest score merges, leftmost first on
  a tie, until none is left; a character outside the vocabulary becomes its <0xXX> byte tokens.
- "gpt2": byte-level BPE (Llama 3, Qwen 2/3, Mistral Nemo, GPT-2, ...): tokens + merges +
  tokenizer.ggml.pre. The text is split by the pre-tokenizer regexes llama.cpp has for that `pre`
  name (each regex in turn splits the pieces the last left, matches and the gaps between them),
  each piece is written in GPT-2's byte alphabet, and merges apply by rank; `ignore_merges`
  (a whole piece that is a token is that token) where llama.cpp sets it (llama3, tekken, glm4).

In both, tokens the file types CONTROL (3) or UNKNOWN (2) are matched whole in the text when
`parse_special` is on (the default, as llama-tokenize's), and USER_DEFINED (4) ones always, before
the model sees the rest, as llama.cpp's tokenizer_st_partition does.

The library: HF `tokenizers` (Rust; one wheel, which requires huggingface-hub), used directly. The algorithms all run in it: models.BPE (merges by rank, byte_fallback, ignore_merges),
the Replace/Prepend normalizers, Split/ByteLevel pre-tokenizers and the decoders. What is built
here is only data from the file: the vocabulary, the merge list and which regexes split the text.
For a "llama" vocabulary the merge list is the one transformers' GGUF converters derive (its
`generate_merges`): every token that splits into two tokens gives the pair (left, right), and the
pairs are ranked by the score of the token they make, best first; BPE by those ranks merges the
same pairs in the same order as llama.cpp's score queue (the one difference: two *different*
pairs of equal score are taken by rank here and leftmost-first there; the scores the vocabularies
checked carry are distinct for the tokens that merge).

Why not the suggested routes:
- transformers' GGUF converter (`transformers.integrations.ggml` in 4.x: GGUFTokenizerSkeleton,
  GGUF_TO_FAST_CONVERTERS; moved in 5.x to `integrations.gguf.gguf_tokenizer_mapping` with other
  names and signatures) is an internal API that was rewritten between major versions, and brings
  transformers plus huggingface-hub, safetensors, typer, pyyaml, regex and tqdm. Checked with
  transformers 5.24.0 and no torch: `get_gguf_tokenizer` imports torch (its GGUF reader does)
  and fails; `convert_gguf_tokenizer` fed from gguf-py works (the Gemma 3 ids checked agreed)
  but took 26 s to build Gemma 3's 262k-token vocabulary (this module: 2 s). It also decides some
  things apart from llama.cpp: Gemma merges ranked by file order rather than score, and `pre`
  regexes for the llama3/qwen2/qwen35/tekken/gpt-4o families only (any other `pre` gets GPT-2's
  split). The pieces of it this needs are small enough to own.
- `sentencepiece` would run the "llama" family's exact reference algorithm, but only from a
  ModelProto (protobuf, a second dependency, or one serialized by hand), and it cannot do the
  "gpt2" family, so `tokenizers` would be needed anyway.

llama.cpp's loader also adjusts a few things by token text or model name, mirrored here: the
end-of-generation tokens it knows by text (<end_of_turn>, <|im_end|>, <|eot_id|>, ...) are control
tokens and join `eos_ids`; phi-3's special tokens take the whitespace after them (rstrip), jina's
and modern-bert's mask tokens the whitespace before; gpt-oss's <|channel|>-style tokens are
user-defined and its <|end|> does not end generation.

Checked against llama.cpp: all 46-50 cases of its test vocabularies (models/ggml-vocab-*.gguf
and their .inp/.out: llama-spm, phi-3, llama-bpe, qwen2, qwen35, gpt-2, starcoder, refact,
command-r, mpt, falcon, deepseek-llm, deepseek-coder) and llama-tokenize on Gemma 3 270M, those
vocabularies and chat-template text; tests/test_tokenizer.py holds what CI can run. Known gaps,
reached by none of those: two special tokens that overlap in the text are taken leftmost-longest
here, longest-first there; FIM tokens are not end-of-generation; a character no byte-level token
spells is dropped here, where llama.cpp would look for it as a one-byte token.

`tokenizers` is an optional dependency (`pip install lathe[text]`), imported when a tokenizer is
built, so the rest of the project imports without it.
"""

from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

__all__ = ["Tokenizer", "TokenizerError", "load_tokenizer", "SUPPORTED_MODELS", "PRE_TOKENIZERS"]

SUPPORTED_MODELS = ("llama", "gpt2")

# GGUF token types (gguf.TokenType; llama.cpp's LLAMA_TOKEN_TYPE_*)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPIECE_SPACE = "\u2581"

# Tokens that end generation by their text, besides the eos/eot/eom ids the file names: the list
# llama.cpp's vocabulary loader keeps (special_eog_ids), less the FIM ones.
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<|return|>", "<|call|>",
})

# --- the "gpt2" pre-tokenizers: llama.cpp's regexes (src/llama-vocab.cpp, llm_tokenizer_bpe) ---
# Where llama.cpp writes an "adapted" regex for std::regex, the original tokenizer.json one is
# used when the adaptation leans on llama.cpp's own unicode handling (tekken, gpt-4o); the
# contraction alternation is llama.cpp's case-spelled form of `(?i:'s|'t|...)` in all of them.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS + "?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS + "?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
_STARCODER = (r"\p{N}", _GPT2)
_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")
_DEEPSEEK_LLM = (
    '[\r\n]',
    '\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373'
    '\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a'
    '-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b'
    '\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59'
    '\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3'
    '\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d'
    '\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00'
    '-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787'
    '\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f'
    '\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df'
    '\U0001e900-\U0001e943]+',
    '\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+',
    '\\s+$',
    '[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+',
    '\\p{N}+',
)
_DEEPSEEK_CODER = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}")
_DEEPSEEK3 = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!" + '"' + r"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^" + "\r\n" + r"\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[" + "\r\n" + r"]*|\s*[" + "\r\n" + r"]+|\s+(?!\S)|\s+",
)
_BLOOM = (" ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+",)
_VIKING = (_BLOOM[0], r"\p{N}")

# Non-ASCII is written as escapes, so that no editor's Unicode normalization changes a range.
# pre name -> (regexes applied in turn, ignore_merges, add_bos when the file does not say)
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool, bool]] = {}
for _names, _spec in (
    (("default",), (_DEFAULT, False, False)),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"),
     ((_LLAMA3,), True, True)),
    (("dbrx", "smaug-bpe", "chatglm-bpe"), ((_LLAMA3,), False, False)),
    (("glm4", "glm5"), ((_LLAMA3,), True, False)),
    (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"),
     ((_QWEN2,), False, False)),
    (("qwen35",), ((_QWEN35,), False, False)),
    (("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
      "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "mpt", "olmo", "jais", "exaone4", "trillion",
      "granite-docling"), ((_GPT2,), False, False)),
    (("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
     (_STARCODER, False, False)),
    (("falcon",), (_FALCON, False, False)),
    (("deepseek-llm",), (_DEEPSEEK_LLM, False, False)),
    (("deepseek-coder",), (_DEEPSEEK_CODER, False, False)),
    (("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), (_DEEPSEEK3, False, False)),
    (("poro-chat", "bloom", "gpt3-finnish"), (_BLOOM, False, False)),
    (("viking",), (_VIKING, False, False)),
    (("tekken",), ((_TEKKEN,), True, True)),
    (("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), ((_GPT4O,), False, False)),
):
    for _name in _names:
        PRE_TOKENIZERS[_name] = _spec
del _names, _spec, _name


class TokenizerError(ValueError):
    """The file's tokenizer metadata is missing, malformed or of an unsupported kind."""


@dataclass(eq=False)
class Tokenizer:
    """Text <-> token ids for one GGUF file (see the module docstring for what it does)."""

    model: str                      # tokenizer.ggml.model: "llama" or "gpt2"
    pre: str | None                 # tokenizer.ggml.pre ("gpt2" vocabularies)
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    eos_ids: tuple[int, ...]        # eos, eot, eom and the end-of-generation tokens by text
    add_bos: bool                   # tokenizer.ggml.add_bos_token (llama.cpp's default without it)
    add_eos: bool
    tokens: list[str] = field(repr=False)
    token_types: list[int] = field(repr=False)
    backend: Any = field(repr=False)  # the tokenizers.Tokenizer doing the work
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def encode(self, text: str, add_bos: bool | None = None, *, add_eos: bool | None = None,
               parse_special: bool = True) -> list[int]:
        """Token ids of `text`, with BOS first if add_bos (None: the file's add_bos_token) and EOS
        last if add_eos (None: the file's add_eos_token). parse_special: control tokens written
        in the text ("<start_of_turn>") are those tokens, as llama-tokenize's default; off, they
        are text like any other. User-defined tokens are matched either way, as in llama.cpp."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, not {type(text).__name__}")
        add_bos = self.add_bos if add_bos is None else add_bos
        add_eos = self.add_eos if add_eos is None else add_eos
        with self._lock:
            self.backend.encode_special_tokens = not parse_special
            ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_id is None:
                raise TokenizerError("add_bos asked for, but the file names no tokenizer.ggml.bos_token_id")
            ids = [self.bos_id, *ids]
        if add_eos:
            if self.eos_id is None:
                raise TokenizerError("add_eos asked for, but the file names no tokenizer.ggml.eos_token_id")
            ids = [*ids, self.eos_id]
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """The text of `ids`; control tokens (BOS, EOS, <end_of_turn>, ...) are left out unless
        skip_special is False. For a "llama" vocabulary with add_space_prefix, the space that
        prefix put before the first word is taken off again, but not the one put after each
        special token ("a<sep>b" decodes as "a<sep> b"; llama.cpp's pieces keep it too), nor the
        one of a piece decoded on its own: to stream text, decode all ids so far and take the
        new end."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(f"token id(s) {bad[:5]} outside the vocabulary (size {self.vocab_size})")
        return self.backend.decode(ids, skip_special_tokens=skip_special)

    def token(self, token_id: int) -> str:
        """The vocabulary entry of an id, as the file spells it."""
        return self.tokens[token_id]

    def __len__(self) -> int:
        return self.vocab_size


def load_tokenizer(path_or_reader) -> Tokenizer:
    """The tokenizer a GGUF file describes (a path, or a gguf.GGUFReader); a TokenizerError saying
    what is missing or unsupported where there is none to build."""
    reader, where = _open(path_or_reader)
    fields = reader.fields

    def get(key, default=None):
        f = fields.get(key)
        return default if f is None else _contents(f, key, where)

    model = get("tokenizer.ggml.model")
    if model is None:
        raise TokenizerError(f"{where}: no tokenizer.ggml.model: the file carries no tokenizer")
    if model in ("none", "no_vocab"):
        raise TokenizerError(f"{where}: tokenizer.ggml.model = {model!r}: the file has no vocabulary "
                             f"(random-weight files have none); supported: {list(SUPPORTED_MODELS)}")
    if model not in SUPPORTED_MODELS:
        raise TokenizerError(f"{where}: tokenizer.ggml.model = {model!r} is not supported; supported: "
                             f"'llama' (SentencePiece BPE), 'gpt2' (byte-level BPE)")
    tokens = get("tokenizer.ggml.tokens")
    if not tokens:
        raise TokenizerError(f"{where}: missing tokenizer.ggml.tokens (the vocabulary)")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise TokenizerError(f"{where}: tokenizer.ggml.tokens is not an array of strings")
    n = len(tokens)
    types = get("tokenizer.ggml.token_type")
    if types is None:
        types = [NORMAL] * n
    elif len(types) < n:
        raise TokenizerError(f"{where}: tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
    types = [int(t) for t in types[:n]]
    # as llama.cpp: an empty token gets a placeholder name
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]

    pre = get("tokenizer.ggml.pre")
    types, strip, eog_texts = _llama_cpp_attributes(tokens, types, pre or "", str(get("general.name", "")).lower(),
                                                    str(get("general.architecture", "")))
    if model == "llama":
        scores = get("tokenizer.ggml.scores")
        if scores is None:
            raise TokenizerError(f"{where}: missing tokenizer.ggml.scores (a SentencePiece vocabulary "
                                 f"merges by them)")
        if len(scores) < n:
            raise TokenizerError(f"{where}: tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")
        add_prefix = bool(get("tokenizer.ggml.add_space_prefix", True))
        backend = _build_spm(tokens, [float(s) for s in scores[:n]], types, strip, add_prefix, where)
        default_bos, default_eos, default_add_bos = 1, 2, True
    else:
        merges = get("tokenizer.ggml.merges")
        if merges is None:
            raise TokenizerError(f"{where}: missing tokenizer.ggml.merges (a byte-level BPE vocabulary "
                                 f"needs its merges)")
        if pre is None:
            warnings.warn(f"{where}: no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer "
                          f"(it warns that quality will be degraded)", stacklevel=2)
        name = pre or "default"
        if name not in PRE_TOKENIZERS:
            raise TokenizerError(f"{where}: tokenizer.ggml.pre = {name!r} is not supported; supported: "
                                 f"{sorted(PRE_TOKENIZERS)}")
        regexes, ignore_merges, default_add_bos = PRE_TOKENIZERS[name]
        backend = _build_bpe(tokens, merges, types, strip, regexes, ignore_merges, where)
        default_bos = default_eos = None

    def special(key, default):
        value = get(key)
        if value is None:
            value = default
        if value is not None and not 0 <= int(value) < n:
            warnings.warn(f"{where}: {key} = {value} is outside the vocabulary ({n}); ignored", stacklevel=3)
            return None
        return None if value is None else int(value)

    bos = special("tokenizer.ggml.bos_token_id", default_bos)
    eos = special("tokenizer.ggml.eos_token_id", default_eos)
    add_bos = bool(get("tokenizer.ggml.add_bos_token", default_add_bos))
    add_eos = bool(get("tokenizer.ggml.add_eos_token", False))
    if add_bos and bos is None:
        raise TokenizerError(f"{where}: tokenizer.ggml.add_bos_token is true but there is no bos_token_id")
    eog = [eos, special("tokenizer.ggml.eot_token_id", None), special("tokenizer.ggml.eom_token_id", None)]
    eog += [i for i, t in enumerate(tokens) if t in eog_texts]
    eos_ids = tuple(dict.fromkeys(i for i in eog if i is not None))
    return Tokenizer(model=model, pre=pre, vocab_size=n, bos_id=bos, eos_id=eos, eos_ids=eos_ids,
                     add_bos=add_bos, add_eos=add_eos, tokens=tokens, token_types=types, backend=backend)


# --- reading the metadata ---------------------------------------------------------------------

def _open(path_or_reader):
    if hasattr(path_or_reader, "fields"):
        return path_or_reader, str(getattr(getattr(path_or_reader, "data", None), "filename", None) or "GGUF")
    if not isinstance(path_or_reader, (str, os.PathLike)):
        raise TypeError(f"load_tokenizer takes a path or a gguf.GGUFReader, not {type(path_or_reader).__name__}")
    path = Path(path_or_reader)
    if not path.is_file():
        raise TokenizerError(f"{path}: no such file")
    import gguf

    try:
        return gguf.GGUFReader(str(path)), str(path)
    except Exception as exc:  # noqa: BLE001 - a corrupt file fails in many ways
        raise TokenizerError(f"{path}: unreadable GGUF ({type(exc).__name__}: {exc})") from exc


def _contents(f, key, where):
    """A metadata field's value: str, int, float, bool or a list of them."""
    kind = f.types[0].name if f.types else ""
    try:
        if kind == "STRING":
            return bytes(f.parts[f.data[0]]).decode("utf-8")
        if kind == "ARRAY":
            if len(f.types) > 1 and f.types[1].name == "STRING":
                return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
            if not f.data:
                return []
            import numpy as np

            return np.concatenate([f.parts[i] for i in f.data]).tolist()
        value = f.parts[f.data[0]]
        return value.item() if hasattr(value, "item") and value.size == 1 else value.tolist()
    except UnicodeDecodeError as exc:
        raise TokenizerError(f"{where}: {key} holds text that is not UTF-8 ({exc})") from exc


# --- building the tokenizers.Tokenizer ----------------------------------------------------------

def _import_tokenizers():
    try:
        import tokenizers
    except ImportError as exc:
        raise TokenizerError("harness.program.tokenizer needs the `tokenizers` package: "
                             "pip install 'lathe[text]' (or pip install tokenizers)") from exc
    return tokenizers


def _llama_cpp_attributes(tokens, types, pre, name, arch):
    """The token types, the (lstrip, rstrip) flags by token text and the end-of-generation texts,
    as llama.cpp's vocabulary loader adjusts them by token text and model name."""
    types = list(types)
    ids = _vocab(tokens)
    eog = set(_EOG_TEXTS)
    if "<|return|>" in ids and "<|call|>" in ids:  # gpt-oss: <|end|> ends a message, not generation
        eog.discard("<|end|>")
        if "<|end|>" in ids:
            types[ids["<|end|>"]] = USER_DEFINED
    for text in eog:  # llama.cpp makes an end-of-generation token a control token
        if text in ids:
            types[ids[text]] = CONTROL
    for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):  # gpt-oss: always rendered
        if text in ids:
            types[ids[text]] = USER_DEFINED
    strip: dict[str, tuple[bool, bool]] = {}
    if pre in ("jina-v2-de", "jina-v2-es", "jina-v2-code") or arch in ("nomic-bert-moe", "jina-bert-v3"):
        strip["<mask>"] = (True, False)
    elif "phi-3" in name or "phi3" in name:
        strip.update((t, (False, True)) for t, k in zip(tokens, types) if k in (CONTROL, USER_DEFINED, UNKNOWN))
        strip["</s>"] = (False, True)
        for text in ("<unk>", "<s>", "<|endoftext|>"):
            strip.pop(text, None)
    elif "modern-bert" in name:
        strip["[MASK]"] = (True, False)
    return types, strip, eog


def _add_special_tokens(tk, tokens, types, strip):
    """Control and unknown tokens: matched whole when special tokens are parsed, dropped by
    decode(skip_special); user-defined: always matched whole, always decoded. `strip`: the
    tokens that take the whitespace before (lstrip) or after (rstrip) them along."""
    from tokenizers import AddedToken

    def added(t, special):
        lstrip, rstrip = strip.get(t, (False, False))
        return AddedToken(t, special=special, normalized=False, lstrip=lstrip, rstrip=rstrip)

    special = [added(t, True) for t, k in zip(tokens, types) if k in (CONTROL, UNKNOWN)]
    user = [added(t, False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    if special:
        tk.add_special_tokens(special)
    if user:
        tk.add_tokens(user)
    return tk


def _vocab(tokens):
    # text -> id, the last id of a repeated text winning, as llama.cpp's token_to_id
    return {t: i for i, t in enumerate(tokens)}


def _spm_merges(tokens, scores, types, vocab):
    """(left, right) for every token that is two tokens joined, best score first (then token id,
    then the shorter left part): the pairs llama.cpp's SPM tokenizer may merge, in its order."""
    ranked = []
    for text, i in vocab.items():
        if types[i] == BYTE or len(text) < 2:
            continue
        score = scores[i]
        for k in range(1, len(text)):
            left, right = text[:k], text[k:]
            if left in vocab and right in vocab:
                ranked.append((-score, i, k, left, right))
    ranked.sort(key=lambda m: m[:3])
    return [(m[3], m[4]) for m in ranked]


def _build_spm(tokens, scores, types, strip, add_prefix, where):
    tokenizers = _import_tokenizers()
    from tokenizers import decoders, models, normalizers

    vocab = _vocab(tokens)
    byte_fallback = all(f"<0x{b:02X}>" in vocab for b in range(256))
    unk = next((t for t, k in zip(tokens, types) if k == UNKNOWN), None)
    try:
        bpe = models.BPE(vocab=vocab, merges=_spm_merges(tokens, scores, types, vocab), unk_token=unk,
                         byte_fallback=byte_fallback, fuse_unk=False)
    except Exception as exc:  # noqa: BLE001
        raise TokenizerError(f"{where}: cannot build the SentencePiece BPE model ({exc})") from exc
    tk = tokenizers.Tokenizer(bpe)
    # llama.cpp escapes only ' ', and prefixes each stretch of text between special tokens
    norm = [normalizers.Replace(" ", SPIECE_SPACE)]
    if add_prefix:
        norm.insert(0, normalizers.Prepend(SPIECE_SPACE))
    tk.normalizer = normalizers.Sequence(norm)
    dec = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tk.decoder = decoders.Sequence(dec)
    return _add_special_tokens(tk, tokens, types, strip)


def _build_bpe(tokens, merges, types, strip, regexes, ignore_merges, where):
    tokenizers = _import_tokenizers()
    from tokenizers import Regex, decoders, models, pre_tokenizers

    pairs = []
    for m in merges:
        pos = m.find(" ", 1)  # as llama.cpp: the first space after the first character
        if pos < 0:
            raise TokenizerError(f"{where}: tokenizer.ggml.merges entry {m!r} is not 'left right'")
        pairs.append((m[:pos], m[pos + 1:]))
    try:
        bpe = models.BPE(vocab=_vocab(tokens), merges=pairs, ignore_merges=ignore_merges)
    except Exception as exc:  # noqa: BLE001 - e.g. a merge whose parts are not tokens
        raise TokenizerError(f"{where}: cannot build the BPE model from tokens and merges ({exc})") from exc
    tk = tokenizers.Tokenizer(bpe)
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False)])
    tk.decoder = decoders.ByteLevel()
    return _add_special_tokens(tk, tokens, types, strip)
