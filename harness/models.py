"""GGUF models: presets of real shapes, a random-weight GGUF writer, and a checked loader.

The architectures and their presets are described in harness/arch/ (llama, qwen3), one module
each. Tensor types F32, F16, Q8_0, Q4_0 and the K-quants Q4_K, Q5_K, Q6_K; quantized tensors stay
in their GGUF block bytes ([N, K / 32 * block bytes] uint8, reference.quant's layout; [N, K / 256
* super-block bytes] for the K-quants, reference.kquant's).

File types (`qtype`): f16, q8_0 and q4_0 put every matrix in that type; q4_k_m, q5_k_m and q6_k
are llama.cpp's mixes of those names (`tensor_types`).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from harness.arch import architectures
from reference import kquant
from reference import formats
from reference.formats import GGUF_BLOCK_TYPES as QUANTIZED

ARCHITECTURES = architectures()
ARCHS = tuple(ARCHITECTURES)
K_MIXES = {"q4_k_m": "Q4_K", "q5_k_m": "Q5_K", "q6_k": "Q6_K"}  # file type -> its matrices' base type
QTYPES = ("f16", "q8_0", "q4_0", *K_MIXES)
_SUPPORTED_TENSOR_TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")


class GGUFError(ValueError):
    """A GGUF file that lathe cannot use, with the reason."""


@dataclass(frozen=True)
class Config:
    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ff: int
    vocab: int
    ctx: int
    rope_theta: float
    eps: float
    tied: bool  # output projection shares token_embd

    @property
    def neox(self) -> bool:
        return ARCHITECTURES[self.arch].neox

    @property
    def head_norm(self) -> bool:
        return ARCHITECTURES[self.arch].head_norm


PRESETS = {name: Config(arch.name, **fields) for arch in ARCHITECTURES.values()
           for name, fields in arch.presets.items()}


def tensor_shapes(c: Config) -> dict[str, tuple[int, int] | tuple[int]]:
    """Every tensor of a model as [rows, row length] (GGUF ne reversed), norms as [length]."""
    shapes: dict[str, tuple[int, int] | tuple[int]] = {
        "token_embd.weight": (c.vocab, c.d_model),
        "output_norm.weight": (c.d_model,),
    }
    if not c.tied:
        shapes["output.weight"] = (c.vocab, c.d_model)
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    for i in range(c.n_layers):
        b = f"blk.{i}."
        shapes |= {
            b + "attn_norm.weight": (c.d_model,),
            b + "attn_q.weight": (q, c.d_model),
            b + "attn_k.weight": (kv, c.d_model),
            b + "attn_v.weight": (kv, c.d_model),
            b + "attn_output.weight": (c.d_model, q),
            b + "ffn_norm.weight": (c.d_model,),
            b + "ffn_gate.weight": (c.ff, c.d_model),
            b + "ffn_up.weight": (c.ff, c.d_model),
            b + "ffn_down.weight": (c.d_model, c.ff),
        }
        if c.head_norm:
            shapes |= {b + "attn_q_norm.weight": (c.head_dim,), b + "attn_k_norm.weight": (c.head_dim,)}
    return shapes


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_types(c: Config, qtype: str) -> dict[str, str]:
    """Each tensor's GGUF type in a file of type `qtype`: norms F32; f16, q8_0, q4_0 every matrix
    in that type; the K mixes as llama.cpp's quantizer makes them without an importance matrix
    (llama_tensor_get_type for a dense llama / qwen3): the output matrix (the embedding where tied)
    Q6_K; q4_k_m and q5_k_m give attn_v and ffn_down Q6_K in the layers of _more_bits, Q4_K / Q5_K
    elsewhere, every other matrix Q4_K / Q5_K; q6_k everything Q6_K. A K-quant matrix needs rows
    of a multiple of 256 (llama.cpp would fall back to Q5_0/Q5_1/Q8_0 there, which lathe does not
    read): a clear error."""
    if qtype not in QTYPES:
        raise ValueError(f"qtype must be one of {QTYPES}, got {qtype!r}")
    shapes = tensor_shapes(c)
    if qtype not in K_MIXES:
        return {n: "F32" if len(s) == 1 else qtype.upper() for n, s in shapes.items()}
    base, types = K_MIXES[qtype], {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            types[name] = "F32"
            continue
        if shape[1] % kquant.QK_K:
            raise ValueError(f"{qtype}: {name} has rows of {shape[1]}, not a multiple of {kquant.QK_K}; "
                             f"K-quant files need every matrix's rows in whole super-blocks")
        layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
        if name == "output.weight" or (c.tied and name == "token_embd.weight"):
            types[name] = "Q6_K"
        elif name.endswith(("attn_v.weight", "ffn_down.weight")) and qtype != "q6_k" and _more_bits(layer, c.n_layers):
            types[name] = "Q6_K"
        else:
            types[name] = base
    return types


def write_random_gguf(path: str | Path, preset: str | Config, qtype: str = "q8_0", seed: int = 0) -> Path:
    """A GGUF file of the preset's shapes with random weights (fixed seed). Matrices are scaled by
    1/sqrt(fan-in) and norms are near 1, so that activations stay finite through the layers."""
    import gguf

    c = PRESETS[preset] if isinstance(preset, str) else preset
    types = tensor_types(c, qtype)
    path = Path(path)
    w = gguf.GGUFWriter(str(path), c.arch)
    a = c.arch
    w.add_string("general.name", preset if isinstance(preset, str) else "custom")
    w.add_context_length(c.ctx)
    w.add_embedding_length(c.d_model)
    w.add_block_count(c.n_layers)
    w.add_feed_forward_length(c.ff)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.eps)
    w.add_uint32(f"{a}.vocab_size", c.vocab)
    w.add_tokenizer_model("none")
    shapes = list(tensor_shapes(c).items())
    # Each tensor has its own stream (seed, index), so tensors are made in parallel threads
    # (NumPy releases the GIL) and an 8B model takes seconds per core rather than minutes.
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        made = pool.map(lambda i: _random_tensor(*shapes[i], seed, i, types[shapes[i][0]]), range(len(shapes)))
        for (name, _), data in zip(shapes, made):
            raw = gguf.GGMLQuantizationType[types[name]] if data.dtype == np.uint8 else None
            w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _random_tensor(name: str, shape: tuple[int, ...], seed: int, index: int, kind: str) -> np.ndarray:
    """One tensor of a random model: norms near 1 (float32), matrices N(0, 1/fan-in) (the
    embedding N(0, 1)) in their GGUF type `kind`, made in row chunks to bound the float32
    temporaries."""
    rng = np.random.default_rng([seed, index])
    if len(shape) == 1:
        return (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    rows, k = shape
    scale = np.float32(1.0 if name == "token_embd.weight" else 1 / np.sqrt(k))
    chunk = max(1, (1 << 24) // k)
    parts = []
    for start in range(0, rows, chunk):
        m = rng.standard_normal((min(chunk, rows - start), k), dtype=np.float32) * scale
        parts.append(m.astype(np.float16) if kind == "F16" else formats.quantize(m, kind))
    return np.concatenate(parts)


@dataclass
class Model:
    config: Config
    tensors: dict[str, np.ndarray]  # float32/float16 arrays, or uint8 blocks for Q8_0/Q4_0
    types: dict[str, str] = field(default_factory=dict)  # name -> "F32" | "F16" | "Q8_0" | "Q4_0"


def _field(reader, key: str, required: bool = True):
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise GGUFError(f"missing metadata key {key!r}")
        return None
    value = f.parts[f.data[0]]
    if f.types and f.types[0].name == "STRING":
        return bytes(value).decode()
    return value.item() if hasattr(value, "item") else value


_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value types
_STRING, _ARRAY = 8, 9


def truncation(path: str | Path) -> str | None:
    """Why a GGUF file is cut short (the header, or the first tensor whose bytes run past the
    end, and how many bytes are missing), or None when everything its header names is there.
    A walk of the header alone (GGUF v2/v3 layout), so that it works where the reader fails."""
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with Path(path).open("rb") as fh:
        head = fh.read(1 << 24)  # the metadata and tensor infos come first
        size = fh.seek(0, 2)
    at = 0

    def take(fmt: str):
        nonlocal at
        n = struct.calcsize(fmt)
        if at + n > len(head):
            raise EOFError
        value = struct.unpack_from("<" + fmt, head, at)
        at += n
        return value[0] if len(value) == 1 else value

    def text() -> str:
        nonlocal at
        n = take("Q")
        if at + n > len(head):
            raise EOFError
        at += n
        return head[at - n:at].decode(errors="replace")

    def skip(kind: int) -> None:
        nonlocal at
        if kind == _STRING:
            text()
        elif kind == _ARRAY:
            inner, count = take("I"), take("Q")
            if inner in _SCALAR_BYTES:
                at += _SCALAR_BYTES[inner] * count
            else:
                for _ in range(count):
                    skip(inner)
        else:
            at += _SCALAR_BYTES[kind]

    try:
        take("4sI")  # magic, version
        n_tensors, n_kv = take("Q"), take("Q")
        alignment = 32
        for _ in range(n_kv):
            key, kind = text(), take("I")
            if key == "general.alignment" and kind == 4:
                alignment = take("I")
            else:
                skip(kind)
        infos = []
        for _ in range(n_tensors):
            name, dims = text(), take("I")
            shape = [take("Q") for _ in range(dims)]
            infos.append((name, shape, take("I"), take("Q")))
    except EOFError:
        return f"the header ends early ({size} bytes in all)"
    except (KeyError, struct.error):
        return None  # not a layout this walk knows: leave the verdict to the reader
    start = -(-at // alignment) * alignment
    for name, shape, kind, offset in infos:
        try:
            block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            continue  # a type this walk does not know: the reader (or the type check) says
        elements = 1
        for d in shape:
            elements *= d
        end = start + offset + elements // block * nbytes
        if end > size:
            return (f"tensor {name} ends at byte {end}, past the file's end at {size} "
                    f"({end - size} bytes missing)")
    return None


def load_gguf(path: str | Path) -> Model:
    """Read a GGUF file into a checked Model; anything unusable is a GGUFError saying why."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    with path.open("rb") as fh:
        if fh.read(4) != b"GGUF":
            raise GGUFError(f"{path}: not a GGUF file (wrong magic)")
    short = truncation(path)  # the reader's own error for a cut file names no tensor
    if short:
        raise GGUFError(f"{path}: truncated: {short}")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - corrupt files fail in many ways
        raise GGUFError(f"{path}: unreadable GGUF ({type(exc).__name__}: {exc})") from exc
    arch = _field(reader, "general.architecture")
    if arch not in ARCHS:
        raise GGUFError(f"{path}: architecture {arch!r} is not supported; supported: {ARCHS}")
    n_heads = int(_field(reader, f"{arch}.attention.head_count"))
    d_model = int(_field(reader, f"{arch}.embedding_length"))
    head_dim = _field(reader, f"{arch}.attention.key_length", required=False)
    names = {t.name for t in reader.tensors}
    emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if emb is None:
        raise GGUFError(f"{path}: missing tensor 'token_embd.weight'")
    vocab = _field(reader, f"{arch}.vocab_size", required=False) or int(emb.shape[1])
    config = Config(
        arch=arch,
        n_layers=int(_field(reader, f"{arch}.block_count")),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", required=False) or n_heads),
        head_dim=int(head_dim or d_model // n_heads),
        ff=int(_field(reader, f"{arch}.feed_forward_length")),
        vocab=int(vocab),
        ctx=int(_field(reader, f"{arch}.context_length")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", required=False) or 10000.0),
        eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        tied="output.weight" not in names,
    )
    want = tensor_shapes(config)
    tensors, types = {}, {}
    for t in reader.tensors:
        if t.name not in want:
            continue
        kind = t.tensor_type.name
        if kind not in _SUPPORTED_TENSOR_TYPES:
            raise GGUFError(f"{path}: tensor {t.name} has type {kind}; supported: {_SUPPORTED_TENSOR_TYPES}")
        shape = tuple(int(d) for d in reversed(t.shape))  # ne is fastest-first
        if shape != want[t.name]:
            raise GGUFError(f"{path}: tensor {t.name} is {shape}, expected {want[t.name]}")
        data = np.asarray(t.data)
        if kind in QUANTIZED:
            data = data.reshape(shape[0], formats.row_bytes(kind, shape[1]))
        else:
            data = data.reshape(shape)
        tensors[t.name], types[t.name] = data, kind
    missing = sorted(set(want) - set(tensors))
    if missing:
        raise GGUFError(f"{path}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return Model(config, tensors, types)

