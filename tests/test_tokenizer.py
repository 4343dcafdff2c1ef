"""harness.program.tokenizer: GGUF tokenizer metadata -> encode/decode.

Tiny GGUF files written here hold a SentencePiece-style vocabulary (tokens + scores + types) and
a byte-level BPE one (tokens + merges + pre), small enough that the expected ids follow by hand
from llama.cpp's rules (see each test). The real Gemma 3 file is used only where the env var
LATHE_GEMMA3_GGUF names it; its expected ids are llama.cpp's llama-tokenize output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tokenizers", reason="harness.program.tokenizer needs `tokenizers` (pip install 'lathe[text]')")

from harness.program.tokenizer import TokenizerError, load_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SP = "\u2581"
UNKNOWN, CONTROL, USER_DEFINED, BYTE, NORMAL = 2, 3, 4, 6, 1


def write_gguf(path: Path, **keys) -> Path:
    """A GGUF file with no tensors and the given tokenizer keys (GGUFWriter's add_<key>)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    for name, value in keys.items():
        getattr(w, f"add_{name}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- a SentencePiece-style ("llama") vocabulary -------------------------------------------------
# 0 <unk>, 1 <s>, 2 </s>, 3..258 the byte tokens <0x00>..<0xFF>, then:
SPM_NORMAL = [  # (token, score): llama.cpp merges the adjacent pair making the best-scored token
    (SP, -10.0), ("a", -10.0), ("b", -10.0), ("c", -10.0),   # 259..262
    ("ab", -1.0), ("bc", -0.5), (SP + "a", -2.0), (SP + "ab", -3.0),  # 263..266
]
SPM_SEP, SPM_CTL = 267, 268  # "<sep>" user-defined, "<ctl>" control
SPM_ID = {t: 259 + i for i, (t, _) in enumerate(SPM_NORMAL)}


def spm_file(path: Path, **extra) -> Path:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [t for t, _ in SPM_NORMAL]
    tokens += ["<sep>", "<ctl>"]
    scores = [0.0] * 259 + [s for _, s in SPM_NORMAL] + [0.0, 0.0]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(SPM_NORMAL) + [USER_DEFINED, CONTROL]
    keys = dict(tokenizer_model="llama", token_list=tokens, token_scores=scores, token_types=types,
                bos_token_id=1, eos_token_id=2, unk_token_id=0, add_bos_token=True, add_eos_token=False)
    keys.update(extra)
    return write_gguf(path, **{k: v for k, v in keys.items() if v is not None})


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    return load_tokenizer(spm_file(tmp_path_factory.mktemp("spm") / "spm.gguf"))


def test_spm_metadata(spm):
    assert (spm.model, spm.vocab_size, spm.bos_id, spm.eos_ids, spm.add_bos) == ("llama", 269, 1, (2,), True)


def test_spm_merges_by_score(spm):
    a, b, c, sp = (SPM_ID[t] for t in ("a", "b", "c", SP))
    # "ab" -> "▁ab" (space prefix): pairs ▁a (-2), ab (-1): ab first, then ▁+ab = ▁ab (-3)
    assert spm.encode("ab") == [1, SPM_ID[SP + "ab"]]
    # "▁abc": bc (-0.5) beats ab (-1) although ab is further left; then ▁a (-2); "▁abc" is no token.
    # (Leftmost-first merging would give ▁ab + c.)
    assert spm.encode("abc") == [1, SPM_ID[SP + "a"], SPM_ID["bc"]]
    # "▁a▁b": ▁a merges; "▁b" and "▁a▁" are no tokens
    assert spm.encode("a b", add_bos=False) == [SPM_ID[SP + "a"], sp, b]
    # a leading space is a second ▁ in front, which merges with nothing
    assert spm.encode(" a", add_bos=False) == [sp, SPM_ID[SP + "a"]]
    assert spm.encode("c", add_bos=False) == [sp, c]
    assert a not in spm.encode("ab")


def test_spm_byte_fallback_and_empty(spm):
    # é is not in the vocabulary: its UTF-8 bytes C3 A9, as <0xC3> <0xA9> (ids 3 + byte)
    assert spm.encode("é", add_bos=False) == [SPM_ID[SP], 3 + 0xC3, 3 + 0xA9]
    assert spm.encode("") == [1]
    assert spm.encode("", add_bos=False) == []
    assert spm.encode("ab", add_eos=True) == [1, SPM_ID[SP + "ab"], 2]


def test_spm_special_tokens(spm):
    ab = SPM_ID[SP + "ab"]
    # a user-defined token is matched whole, and the text after it gets its own space prefix
    assert spm.encode("ab<sep>ab", add_bos=False) == [ab, SPM_SEP, ab]
    assert spm.encode("ab<sep>ab", add_bos=False, parse_special=False) == [ab, SPM_SEP, ab]
    # a control token only while special tokens are parsed; otherwise its characters are text
    assert spm.encode("ab<ctl>", add_bos=False) == [ab, SPM_CTL]
    plain = spm.encode("ab<ctl>", add_bos=False, parse_special=False)
    assert SPM_CTL not in plain and plain[0] == ab and len(plain) > 2
    assert spm.decode([1, ab, SPM_CTL, 2]) == "ab"
    assert spm.decode([1, ab, SPM_SEP, 2]) == "ab<sep>"  # user-defined tokens are text
    # with control tokens rendered, the prefix space after <s> is no longer first, so it stays
    assert spm.decode([1, ab, SPM_SEP, 2], skip_special=False) == "<s> ab<sep></s>"


@pytest.mark.parametrize("text", ["ab", "abc", "a b", " a", "  leading and trailing  ", "é ü 東京", "x\ny\n\n",
                                  ""])
def test_spm_round_trip(spm, text):
    assert spm.decode(spm.encode(text)) == text


def test_spm_prefix_after_special_token(spm):
    # As llama.cpp: with add_space_prefix, each stretch of text after a special token gets its own
    # ▁, which decodes as a space (so text after one does not round-trip exactly).
    ids = spm.encode("c<sep>c", add_bos=False)
    assert ids == [SPM_ID[SP], SPM_ID["c"], SPM_SEP, SPM_ID[SP], SPM_ID["c"]]
    assert spm.decode(ids) == "c<sep> c"


def test_spm_without_space_prefix(tmp_path):
    # Gemma-style: add_space_prefix false, so only written spaces become ▁
    tok = load_tokenizer(spm_file(tmp_path / "gemma-like.gguf", add_space_prefix=False))
    assert tok.encode("ab") == [1, SPM_ID["ab"]]
    assert tok.encode(" ab") == [1, SPM_ID[SP + "ab"]]
    assert tok.encode("abc", add_bos=False) == [SPM_ID["a"], SPM_ID["bc"]]
    for text in ("ab", " ab", "a b ", "é"):
        assert tok.decode(tok.encode(text)) == text


def test_spm_reader_accepted(tmp_path):
    import gguf

    path = spm_file(tmp_path / "spm.gguf")
    assert load_tokenizer(gguf.GGUFReader(str(path))).encode("abc") == [1, SPM_ID[SP + "a"], SPM_ID["bc"]]


# --- a byte-level BPE ("gpt2") vocabulary ------------------------------------------------------

def byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode: the character that spells each byte 0..255."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


G = "\u0120"  # Ġ: the space byte
# ids 0..255: the byte tokens in byte order; then these merges' results, in rank order
BPE_MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), (G, "w"), ("o", "r"), (G + "w", "or"), ("l", "d"),
              ("1", "2"), ("12", "3")]
BPE_ID = {a + b: 256 + i for i, (a, b) in enumerate(BPE_MERGES)}  # he 256 ... 123 264
EOT, THINK, HELLO = 265, 266, 267  # <|endoftext|> control, <think> user-defined, "hello" (no merge path)


def bpe_file(path: Path, pre="gpt-2", merges=True, **extra) -> Path:
    tokens = byte_alphabet() + [a + b for a, b in BPE_MERGES] + ["<|endoftext|>", "<think>", "hello"]
    types = [NORMAL] * 265 + [CONTROL, USER_DEFINED, NORMAL]
    keys = dict(tokenizer_model="gpt2", tokenizer_pre=pre, token_list=tokens, token_types=types,
                token_merges=[f"{a} {b}" for a, b in BPE_MERGES] if merges else None,
                bos_token_id=EOT, eos_token_id=EOT, add_bos_token=False)
    keys.update(extra)
    return write_gguf(path, **{k: v for k, v in keys.items() if v is not None})


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return load_tokenizer(bpe_file(tmp_path_factory.mktemp("bpe") / "bpe.gguf"))


def test_bpe_metadata(bpe):
    assert (bpe.model, bpe.pre, bpe.vocab_size, bpe.bos_id, bpe.eos_ids, bpe.add_bos) == \
        ("gpt2", "gpt-2", 268, EOT, (EOT,), False)


def test_bpe_merges_by_rank(bpe):
    # pieces "hello" | " world". hello: he (0), ll (1), he+ll (2) -> hell, o.
    # Ġworld: Ġw (3), or (4), Ġw+or (5), ld (6) -> Ġwor, ld ("Ġworld" is no token)
    assert bpe.encode("hello world") == [BPE_ID["hell"], ord("o"), BPE_ID[G + "wor"], BPE_ID["ld"]]
    # gpt-2's pre-tokenizer keeps digits together: 1 2 -> 12, 12 3 -> 123, then 4 5 bytes
    assert bpe.encode("12345") == [BPE_ID["123"], ord("4"), ord("5")]
    # bytes outside ASCII: é is C3 A9, each its own byte token (id = byte)
    assert bpe.encode("é") == [0xC3, 0xA9]
    assert bpe.encode("") == []
    assert bpe.encode("hello", add_bos=True) == [EOT, BPE_ID["hell"], ord("o")]


def test_bpe_special_tokens(bpe):
    assert bpe.encode("hello<|endoftext|>") == [BPE_ID["hell"], ord("o"), EOT]
    assert bpe.encode("<|endoftext|>", parse_special=False) == list(b"<|endoftext|>")
    assert bpe.encode("<think>hello", parse_special=False) == [THINK, BPE_ID["hell"], ord("o")]
    assert bpe.decode([BPE_ID["hell"], ord("o"), EOT]) == "hello"
    assert bpe.decode([BPE_ID["hell"], ord("o"), EOT], skip_special=False) == "hello<|endoftext|>"
    assert bpe.decode([THINK, 0xC3, 0xA9]) == "<think>é"


@pytest.mark.parametrize("text", ["hello world", "  two  spaces ", "tab\there\nnew line\r\n", "12345 678",
                                  "naïve café — 東京 🦙", "<think>x</think>", ""])
def test_bpe_round_trip(bpe, text):
    assert bpe.decode(bpe.encode(text)) == text


def test_bpe_pre_tokenizer_by_name(tmp_path):
    # llama3's pre-tokenizer: digits in threes, and ignore_merges: a whole piece that is a token
    # is that token ("hello", unreachable by the merges), and llama3 adds BOS without the flag
    llama3 = load_tokenizer(bpe_file(tmp_path / "llama3.gguf", pre="llama-bpe", add_bos_token=None))
    assert llama3.add_bos
    assert llama3.encode("hello 12345", add_bos=False) == [HELLO, ord(" "), BPE_ID["123"], ord("4"), ord("5")]
    # qwen2's: every digit alone
    qwen2 = load_tokenizer(bpe_file(tmp_path / "qwen2.gguf", pre="qwen2"))
    assert qwen2.encode("hello 12345") == [BPE_ID["hell"], ord("o"), ord(" ")] + list(b"12345")


def test_bpe_default_pre_warns(tmp_path):
    with pytest.warns(UserWarning, match="no tokenizer.ggml.pre"):
        tok = load_tokenizer(bpe_file(tmp_path / "nopre.gguf", pre=None))
    assert tok.decode(tok.encode("hello world")) == "hello world"


# --- clear errors -------------------------------------------------------------------------------

def test_errors(tmp_path):
    with pytest.raises(TokenizerError, match=r"tokenizer.ggml.model = 'none': the file has no vocabulary"):
        load_tokenizer(write_gguf(tmp_path / "none.gguf", tokenizer_model="none"))
    with pytest.raises(TokenizerError, match=r"no tokenizer.ggml.model"):
        load_tokenizer(write_gguf(tmp_path / "bare.gguf", block_count=1))
    with pytest.raises(TokenizerError, match=r"tokenizer.ggml.model = 'bert' is not supported; supported: 'llama'"):
        load_tokenizer(write_gguf(tmp_path / "bert.gguf", tokenizer_model="bert", token_list=["a"]))
    with pytest.raises(TokenizerError, match=r"missing tokenizer.ggml.merges"):
        load_tokenizer(bpe_file(tmp_path / "nomerges.gguf", merges=False))
    with pytest.raises(TokenizerError, match=r"tokenizer.ggml.pre = 'mystery' is not supported"):
        load_tokenizer(bpe_file(tmp_path / "mystery.gguf", pre="mystery"))
    with pytest.raises(TokenizerError, match=r"missing tokenizer.ggml.scores"):
        load_tokenizer(spm_file(tmp_path / "noscores.gguf", token_scores=None))
    with pytest.raises(TokenizerError, match=r"missing tokenizer.ggml.tokens"):
        load_tokenizer(write_gguf(tmp_path / "notokens.gguf", tokenizer_model="llama"))
    with pytest.raises(TokenizerError, match=r"no such file"):
        load_tokenizer(tmp_path / "absent.gguf")
    tok = load_tokenizer(spm_file(tmp_path / "ok.gguf"))
    with pytest.raises(TokenizerError, match=r"outside the vocabulary"):
        tok.decode([269])


def test_random_weight_file_refused(tmp_path):
    from dataclasses import replace

    from harness.program.models import PRESETS, write_random_gguf

    small = replace(PRESETS["tiny-llama"], n_layers=1)
    path = write_random_gguf(tmp_path / "random.gguf", small, "f16")
    with pytest.raises(TokenizerError, match=r"'none'.*no vocabulary"):
        load_tokenizer(path)


def test_import_is_lazy():
    # the rest of the project imports harness.program.tokenizer without `tokenizers` being loaded
    code = "import sys, harness.program.tokenizer; assert 'tokenizers' not in sys.modules, 'imported eagerly'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# --- the real Gemma 3 270M file, where there is one ---------------------------------------------

GEMMA = os.environ.get("LATHE_GEMMA3_GGUF")

# llama-tokenize -m gemma-3-270m-q4_k_m.gguf -f FILE --no-escape --ids (llama.cpp, llama-cpp-python 0.3.36's)
GEMMA_CASES = {
    "Hello world": [2, 9259, 1902],
    "naïve café — 東京": [2, 1789, 238527, 560, 33443, 2192, 86459],
    "  leading and trailing  ": [2, 138, 26016, 532, 45330, 138],
    "line one\n\nline two\tTab 12345": [2, 1257, 886, 108, 1257, 1156, 255968, 7874, 236743, 236770, 236778,
                                        236800, 236812, 236810],
    "<start_of_turn>user\nHi<end_of_turn>\n": [2, 105, 2364, 107, 10979, 106, 107],
}


@pytest.fixture(scope="module")
def gemma():
    if not GEMMA:
        pytest.skip("set LATHE_GEMMA3_GGUF to the Gemma 3 270M GGUF (e.g. gemma-3-270m-q4_k_m.gguf) to run this")
    if not Path(GEMMA).is_file():
        pytest.skip(f"LATHE_GEMMA3_GGUF={GEMMA} is not a file")
    return load_tokenizer(GEMMA)


def test_gemma3_metadata(gemma):
    assert (gemma.model, gemma.vocab_size, gemma.bos_id, gemma.add_bos) == ("llama", 262144, 2, True)
    assert 1 in gemma.eos_ids and 106 in gemma.eos_ids  # <eos>, <end_of_turn>


@pytest.mark.parametrize("text", list(GEMMA_CASES))
def test_gemma3_matches_llama_cpp(gemma, text):
    ids = gemma.encode(text)
    assert ids == GEMMA_CASES[text]
    expected = text.replace("<start_of_turn>", "").replace("<end_of_turn>", "")  # control tokens: not rendered
    assert gemma.decode(ids) == expected
