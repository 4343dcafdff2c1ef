"""GGUF models: presets of real shapes, a random-weight GGUF writer, and a checked loader.

The architectures and their presets are described in harness/program/arch/ (llama, qwen3), one module
each. Tensor types F32, F16, Q8_0, Q4_0 and the K-quants Q4_K, Q5_K, Q6_K; quantized tensors stay
in their GGUF block bytes ([N, K / 32 * block bytes] uint8, reference.quant's layout; [N, K / 256
* super-block bytes] for the K-quants, reference.kquant's).

File types (`qtype`): f16, q8_0 and q4_0 put every matrix in that type; q4_k_m, q5_k_m and q6_k
are llama.cpp's mixes of those names (`tensor_types`).
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from harness.program.arch import Layer, architectures
from reference import kquant
from reference import formats
from reference.model import YARN
from reference.formats import GGUF_BLOCK_TYPES as QUANTIZED

ARCHITECTURES = architectures()
ARCHS = tuple(ARCHITECTURES)
K_MIXES = {"q4_k_m": "Q4_K", "q5_k_m": "Q5_K", "q6_k": "Q6_K"}  # file type -> its matrices' base type
# every matrix in one type: the unquantized baseline, the GEMVs' own, the legacy and IQ4 blocks
SINGLE_TYPES = ("f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "iq4_xs")
QTYPES = (*SINGLE_TYPES, *K_MIXES)
_SUPPORTED_TENSOR_TYPES = ("F32", "F16", *QUANTIZED)
FILE_TYPES = {"f16": 1, "q8_0": 7, "q4_0": 2, "q4_1": 3, "q5_0": 8, "q5_1": 9, "iq4_nl": 25, "iq4_xs": 30,
              "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}  # general.file_type (llama.cpp's LLAMA_FTYPE)


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
    # What sets real files apart (harness/arch describes which family takes which); the defaults
    # are the plain llama layer's.
    sliding_window: int = 0  # tokens a sliding layer sees (its own included); 0: none
    swa_pattern: int = 0  # every swa_pattern-th layer global, the others sliding; 0: the architecture's
    rope_theta_swa: float = 0.0  # the sliding layers' RoPE base; 0: the architecture's
    rope_scaling: str = "none"  # none, linear or yarn (`<arch>.rope.scaling.type`)
    rope_factor: float = 1.0  # positions are divided by it (linear, yarn)
    rope_orig_ctx: int = 0  # yarn: the context the model was trained at
    rope_attn_factor: float = 1.0  # a factor on RoPE's cos and sin (`rope.scaling.attn_factor`)
    rope_freqs: bool = False  # rope_freqs.weight divides each pair's rotation (Llama 3.1's scaling)
    attn_scale: float = 0.0  # the scale of Q K^T; 0: 1 / sqrt(head_dim)
    final_softcap: float = 0.0  # logits = c * tanh(logits / c); 0: none
    attn_softcap: float = 0.0  # attention scores c * tanh(s / c) before the mask; 0: none
    biases: tuple[str, ...] = ()  # the matrices (attn_q, ...) whose file carries a .bias

    @property
    def architecture(self):
        return ARCHITECTURES[self.arch]

    @property
    def neox(self) -> bool:
        return self.architecture.neox

    @property
    def head_norm(self) -> bool:
        return self.architecture.head_norm

    @property
    def scale(self) -> float:
        """The factor of attention's scores."""
        return self.attn_scale or self.head_dim ** -0.5

    def layer(self, i: int) -> Layer:
        """Layer i's attention window, RoPE base and RoPE position scale (llama.cpp's is_swa,
        get_rope_freq_base and get_rope_freq_scale)."""
        a = self.architecture
        pattern = self.swa_pattern or a.swa_pattern
        sliding = bool(self.sliding_window) and pattern > 0 and i % pattern < pattern - 1
        scale = 1.0 / self.rope_factor if self.rope_scaling in ("linear", "yarn") else 1.0
        # the sliding layers' own base where the file or the family gives one (llama.cpp reads
        # rope.freq_base_swa for every family); unscaled where the family fixes it (Gemma 3)
        theta_swa = self.rope_theta_swa or a.swa_theta
        if sliding and theta_swa:
            return Layer(self.sliding_window, theta_swa, 1.0 if a.swa_theta else scale)
        return Layer(self.sliding_window if sliding else None, self.rope_theta, scale)


PRESETS = {name: Config(arch.name, **({"biases": arch.biases} if arch.required_biases else {}), **fields)
           for arch in ARCHITECTURES.values() for name, fields in arch.presets.items()}


def tensor_shapes(c: Config) -> dict[str, tuple[int, int] | tuple[int]]:
    """Every tensor of a model as [rows, row length] (GGUF ne reversed), norms and biases as
    [length]: what its architecture's layer reads (harness/arch), and the optional tensors the
    config says the file has (biases, rope_freqs)."""
    a = c.architecture
    shapes: dict[str, tuple[int, int] | tuple[int]] = {
        "token_embd.weight": (c.vocab, c.d_model),
        "output_norm.weight": (c.d_model,),
    }
    if not c.tied:
        shapes["output.weight"] = (c.vocab, c.d_model)
    if c.rope_freqs:
        shapes["rope_freqs.weight"] = (c.head_dim // 2,)
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    rows = {"attn_q": q, "attn_k": kv, "attn_v": kv, "attn_output": c.d_model}
    for i in range(c.n_layers):
        b = f"blk.{i}."
        shapes[b + "attn_norm.weight"] = (c.d_model,)
        if a.fused_qkv:
            shapes[b + "attn_qkv.weight"] = (q + 2 * kv, c.d_model)
        else:
            shapes |= {b + f"attn_{n}.weight": (rows[f"attn_{n}"], c.d_model) for n in "qkv"}
        shapes[b + "attn_output.weight"] = (c.d_model, q)
        shapes |= {b + f"{part}.bias": (rows[part],) for part in c.biases}
        if c.head_norm:
            shapes |= {b + "attn_q_norm.weight": (c.head_dim,), b + "attn_k_norm.weight": (c.head_dim,)}
        if a.post_norms:
            shapes[b + "post_attention_norm.weight"] = (c.d_model,)
        shapes[b + "ffn_norm.weight"] = (c.d_model,)
        if a.fused_gate_up:
            shapes[b + "ffn_up.weight"] = (2 * c.ff, c.d_model)
        else:
            shapes |= {b + "ffn_gate.weight": (c.ff, c.d_model), b + "ffn_up.weight": (c.ff, c.d_model)}
        shapes[b + "ffn_down.weight"] = (c.d_model, c.ff)
        if a.post_norms:
            shapes[b + "post_ffw_norm.weight"] = (c.d_model,)
    return shapes


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}  # llama.cpp's tensor_type_fallback


def tensor_types(c: Config, qtype: str) -> dict[str, str]:
    """Each tensor's GGUF type in a file of type `qtype`: norms and biases F32; f16, q8_0, q4_0 (and the other SINGLE_TYPES)
    every matrix in that type; the K mixes as llama.cpp's quantizer makes them without an
    importance matrix (llama_tensor_get_type for a dense model): the output matrix (the embedding
    where tied) Q6_K; q4_k_m and q5_k_m give attn_v and ffn_down Q6_K in the layers of
    _more_bits, Q4_K / Q5_K elsewhere, every other matrix Q4_K / Q5_K; q6_k everything Q6_K. A
    matrix whose rows are not whole 256-weight super-blocks falls back as llama.cpp's does (Q4_K
    to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0: Gemma 3 270M's 640-wide rows)."""
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
        layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
        if name == "output.weight" or (c.tied and name == "token_embd.weight"):
            kind = "Q6_K"
        elif name.endswith(("attn_v.weight", "ffn_down.weight")) and qtype != "q6_k" and _more_bits(layer, c.n_layers):
            kind = "Q6_K"
        else:
            kind = base
        if shape[1] % kquant.QK_K:
            kind = _FALLBACK[kind]
            if shape[1] % 32:
                raise ValueError(f"{qtype}: {name} has rows of {shape[1]}, not a multiple of 32")
        types[name] = kind
    return types


def write_random_gguf(path: str | Path, preset: str | Config, qtype: str = "q8_0", seed: int = 0,
                      processes: int = 0) -> Path:
    """A GGUF file of the preset's shapes with random weights (fixed seed), with the metadata
    keys of its architecture's features (sliding window, RoPE scaling) as llama.cpp's converter
    writes them. Matrices are scaled by 1/sqrt(fan-in) and norms are near 1, so that activations
    stay finite through the layers. processes: make the tensors in that many spawned processes
    instead of threads, the same bytes (the K-quants' quantizer holds the GIL through its many
    small operations: in threads an 8B K mix takes about as long as on one core, past 590 s on the
    H100 machine). The caller's main module must be import-safe (spawn re-imports it)."""
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
    # the keys a family writes only where it has the feature, named and typed as the loader reads them
    for key in ("attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base_swa",
                "final_logit_softcapping", "attn_logit_softcapping"):
        field, kind = _KEYS[key]
        if getattr(c, field):
            (w.add_uint32 if kind is int else w.add_float32)(f"{a}.{key}", getattr(c, field))
    if c.rope_scaling != "none":
        w.add_string(f"{a}.rope.scaling.type", c.rope_scaling)
        w.add_float32(f"{a}.rope.scaling.factor", c.rope_factor)
        if c.rope_orig_ctx:
            w.add_uint32(f"{a}.rope.scaling.original_context_length", c.rope_orig_ctx)
    w.add_uint32("general.file_type", FILE_TYPES[qtype])
    w.add_tokenizer_model("none")
    shapes = list(tensor_shapes(c).items())
    # Each tensor has its own stream (seed, index), so tensors are made in parallel threads
    # (NumPy releases the GIL) and an 8B model takes seconds per core rather than minutes.
    n = len(shapes)
    pool = (ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) if processes
            else ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)))
    with pool:
        made = pool.map(_random_tensor, [name for name, _ in shapes], [shape for _, shape in shapes], [seed] * n,
                        range(n), [types[name] for name, _ in shapes], [c.rope_theta] * n)
        for (name, _), data in zip(shapes, made):
            raw = gguf.GGMLQuantizationType[types[name]] if data.dtype == np.uint8 else None
            w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama3_rope_factors(head_dim: int, theta: float, factor: float = 8.0, low: float = 1.0, high: float = 4.0,
                        original_ctx: int = 8192) -> np.ndarray:
    """Llama 3.1's rope_freqs.weight as llama.cpp's converter computes it from rope_scaling
    (conversion/llama.py; these are its defaults, Llama 3.1's values): 1 for pairs whose
    wavelength is under original_ctx / high, `factor` past original_ctx / low, a smooth blend
    between."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelength = 2 * np.pi / freqs
    smooth = (original_ctx / wavelength - low) / (high - low)
    blend = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelength < original_ctx / high, 1.0,
                    np.where(wavelength > original_ctx / low, factor, blend)).astype(np.float32)


def _random_tensor(name: str, shape: tuple[int, ...], seed: int, index: int, kind: str,
                   theta: float = 10000.0) -> np.ndarray:
    """One tensor of a random model: norms near 1 (float32), matrices N(0, 1/fan-in) (the
    embedding N(0, 1)) in their GGUF type `kind`, made in row chunks to bound the float32
    temporaries."""
    rng = np.random.default_rng([seed, index])
    if name.endswith(".bias"):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    if name == "rope_freqs.weight":
        return llama3_rope_factors(2 * shape[0], theta)
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
    types: dict[str, str] = field(default_factory=dict)  # name -> "F32" | "F16" | "Q8_0" | "Q4_0" | ...
    file_type: int | None = None  # general.file_type (llama.cpp's LLAMA_FTYPE), where the file says


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


# Every `<arch>.` metadata key lathe reads, with the Config field it sets; a key of the file's
# architecture namespace outside this table, or one whose feature its architecture does not take
# (harness/arch), is refused by name: nothing a file says that could change the math is ignored.
_KEYS = {
    "context_length": ("ctx", int), "embedding_length": ("d_model", int), "block_count": ("n_layers", int),
    "feed_forward_length": ("ff", int), "attention.head_count": ("n_heads", int),
    "attention.head_count_kv": ("n_kv_heads", int), "attention.key_length": ("head_dim", int),
    "rope.freq_base": ("rope_theta", float), "attention.layer_norm_rms_epsilon": ("eps", float),
    "vocab_size": ("vocab", int), "attention.sliding_window": ("sliding_window", int),
    "attention.sliding_window_pattern": ("swa_pattern", int), "rope.freq_base_swa": ("rope_theta_swa", float),
    "rope.scaling.type": ("rope_scaling", str), "rope.scaling.factor": ("rope_factor", float),
    "rope.scaling.original_context_length": ("rope_orig_ctx", int),
    "rope.scaling.attn_factor": ("rope_attn_factor", float), "rope.scale_linear": ("rope_factor", float),
    "final_logit_softcapping": ("final_softcap", float), "attn_logit_softcapping": ("attn_softcap", float),
}
# Keys read only to check that they agree with the rest (a value that differs is refused)
_MUST_MATCH = {"attention.value_length": "head_dim", "rope.dimension_count": "head_dim"}
_INFORMATIONAL = {"rope.scaling.finetuned"}  # says how the model was trained, changes no op
# yarn's parameters, which llama.cpp fixes in code for these architectures and does not read from
# the file (reference.model.YARN): accepted where the file agrees, refused where it does not
_YARN_KEYS = {"rope.scaling.yarn_ext_factor": "ext_factor", "rope.scaling.yarn_beta_fast": "beta_fast",
              "rope.scaling.yarn_beta_slow": "beta_slow"}
# Known tensors lathe does not run, named in the refusal (any other unknown tensor is refused too)
_KNOWN_UNSUPPORTED = {
    "rope_factors_long.weight": "LongRoPE scaling", "rope_factors_short.weight": "LongRoPE scaling",
    "ffn_gate_inp.weight": "a mixture of experts' router", "attn_norm.bias": "a LayerNorm's bias",
    "ffn_norm.bias": "a LayerNorm's bias", "output.bias": "a bias of the head",
    "ffn_up.bias": "an FFN bias", "ffn_down.bias": "an FFN bias", "ffn_gate.bias": "an FFN bias",
    "attn_qkv.bias": "a bias of a fused QKV", "post_attention_norm.weight": "a post-attention norm",
    "post_ffw_norm.weight": "a post-FFN norm", "attn_q_norm.weight": "Q head norms",
    "attn_k_norm.weight": "K head norms", "rope_freqs.weight": "llama3 RoPE scaling",
}


def _value(field):
    """A metadata field's value: str, a number, or a list for arrays."""
    kind = field.types[0].name if field.types else ""
    if kind == "STRING":
        return bytes(field.parts[field.data[0]]).decode()
    if kind == "ARRAY":
        return [field.parts[i].tolist() for i in field.data]
    value = field.parts[field.data[0]]
    return value.item() if hasattr(value, "item") and value.size == 1 else value.tolist()


def _refuse(path, what: str) -> GGUFError:
    return GGUFError(f"{path}: {what} is not supported")


def file_type_name(model: "Model") -> str:
    """What a results row names a file's types by: general.file_type's name (llama.cpp's
    LLAMA_FTYPE_MOSTLY_Q4_K_M -> q4_k_m), else the mix of its matrices' types, most weights
    first (q5_0+q4_k+...), never a command-line default."""
    import gguf

    if model.file_type is not None:
        try:
            return gguf.LlamaFileType(model.file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_").lower()
        except ValueError:
            pass
    weights: dict[str, int] = {}
    for name, kind in model.types.items():
        if not name.endswith("norm.weight") and not name.endswith(".bias") and name != "rope_freqs.weight":
            weights[kind] = weights.get(kind, 0) + int(np.prod(model.tensors[name].shape))
    return "+".join(k.lower() for k, _ in sorted(weights.items(), key=lambda kv: -kv[1]))


def read_config(reader, path) -> tuple[Config, int | None]:
    """A file's Config from its metadata, each key used or refused by name (_KEYS); and its
    general.file_type, or None."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHS:
        raise GGUFError(f"{path}: architecture {arch!r} is not supported; supported: {ARCHS}")
    a = ARCHITECTURES[arch]
    fields: dict = {}
    checks: dict[str, object] = {}
    file_type = None
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key.startswith("tokenizer."):
            continue  # the header's own counts; the tokenizer's (harness.program.tokenizer reads or refuses them)
        if key.startswith("general."):
            if key == "general.file_type":
                file_type = int(_value(f))
            continue  # names, licence, provenance, alignment (the reader's): no part of the math
        suffix = key[len(arch) + 1:] if key.startswith(arch + ".") else None
        value = _value(f)
        if suffix in a.not_applied:
            continue  # read, and not applied, as llama.cpp's graph for this family (the module says why)
        if suffix in _KEYS:
            name, cast = _KEYS[suffix]
            if isinstance(value, list):
                raise _refuse(path, f"{key} = {value} (an array: a per-layer value)")
            fields[name] = cast(value)
        elif suffix in _MUST_MATCH:
            checks[key] = (_MUST_MATCH[suffix], int(value))
        elif suffix in _YARN_KEYS:
            if float(value) != YARN[_YARN_KEYS[suffix]]:
                raise _refuse(path, f"{key} = {value} (llama.cpp runs yarn with {_YARN_KEYS[suffix]} "
                                    f"{YARN[_YARN_KEYS[suffix]]:g} whatever the file says)")
        elif suffix not in _INFORMATIONAL:
            raise _refuse(path, f"metadata key {key} = {value!r}")
    for key in ("embedding_length", "block_count", "feed_forward_length", "attention.head_count",
                "context_length", "attention.layer_norm_rms_epsilon"):
        if _KEYS[key][0] not in fields:
            raise GGUFError(f"{path}: missing metadata key '{arch}.{key}'")
    fields.setdefault("n_kv_heads", fields["n_heads"])
    fields.setdefault("head_dim", fields["d_model"] // fields["n_heads"])
    fields.setdefault("rope_theta", 10000.0)
    for key, (name, value) in checks.items():
        if value != fields[name]:
            raise _refuse(path, f"{key} = {value} (not the head size {fields[name]}: partial rotary or unequal K/V heads)")
    # features: each one the file states, only where its architecture takes it
    if "rope_factor" in fields and "rope_scaling" not in fields:  # llama.cpp's default type is linear
        fields["rope_scaling"] = "linear"
    scaling = fields.get("rope_scaling", "none")
    if scaling == "linear" and fields.get("rope_factor", 1.0) in (0.0, 1.0):  # llama.cpp: freq_scale 1
        scaling = fields["rope_scaling"] = "none"
        fields["rope_factor"] = 1.0
    if scaling not in a.rope_scalings:
        raise _refuse(path, f"{arch}.rope.scaling.type = {scaling!r} (RoPE scaling; {arch} takes {a.rope_scalings})")
    if scaling == "none" and fields.get("rope_factor", 1.0) != 1.0:
        raise _refuse(path, f"{arch}.rope.scaling.factor = {fields['rope_factor']} with scaling type 'none'")
    if fields.get("sliding_window") and not a.swa_pattern:
        raise _refuse(path, f"{arch}.attention.sliding_window = {fields['sliding_window']} (a sliding window; "
                            f"{arch} has none)")
    for name in ("swa_pattern", "rope_theta_swa"):
        if name in fields and not (a.swa_pattern and fields.get("sliding_window")):
            raise _refuse(path, f"{arch}'s {name} (sliding-window layers) without a pattern of them")
    if fields.get("final_softcap") and not a.final_softcap:
        raise _refuse(path, f"{arch}.final_logit_softcapping (a softcap of the logits)")
    if fields.get("attn_softcap") and not a.attn_softcap:
        raise _refuse(path, f"{arch}.attn_logit_softcapping = {fields['attn_softcap']} (a softcap of the attention scores)")
    fields.setdefault("vocab", 0)  # where the file does not say: the embedding's rows (load_gguf)
    return Config(arch=arch, tied=False, **(a.hparams(fields) if a.hparams else fields)), file_type


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
    config, file_type = read_config(reader, path)
    a, names = config.architecture, {t.name for t in reader.tensors}
    emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if emb is None:
        raise GGUFError(f"{path}: missing tensor 'token_embd.weight'")
    if "rope_freqs.weight" in names and not a.rope_freqs:
        raise _refuse(path, f"rope_freqs.weight (RoPE frequency factors) in a {config.arch} file")
    biases = tuple(p for p in a.biases if f"blk.0.{p}.bias" in names)
    if a.required_biases and biases != a.biases:
        raise GGUFError(f"{path}: missing tensor(s) {[f'blk.0.{p}.bias' for p in a.biases if p not in biases]}")
    config = replace(config, vocab=config.vocab or int(emb.shape[1]), tied="output.weight" not in names,
                     rope_freqs="rope_freqs.weight" in names, biases=biases)
    want = tensor_shapes(config)
    for t in reader.tensors:  # every tensor used, or refused by name
        if t.name not in want:
            part = t.name.split(".", 2)[-1] if t.name.startswith("blk.") else t.name
            why = _KNOWN_UNSUPPORTED.get(part, "a tensor this architecture's layer does not read")
            raise _refuse(path, f"{t.name} ({why}) in a {config.arch} file")
    tensors, types = {}, {}
    for t in reader.tensors:
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
    return Model(config, tensors, types, file_type)

