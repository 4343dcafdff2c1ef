"""The MSL bodies as Metal sees them, without Apple hardware.

`metal_source(job)` writes the Metal source that `mx.fast.metal_kernel` builds for a launch. It
follows the layout of MLX's generator (mlx/backend/common/metal_kernel.cpp, read at 0.30.4;
kernels/msl/NOTES.md has the rules and what is still to re-read at 0.32.4):
- the kernel's header (lathe.h, whose Metal branch includes <metal_stdlib>);
- a template line where the launch has constants;
- the `[[kernel]]` signature, with:
  - each input in the `constant` address space under 8 elements, else `device`, passed by
    reference if 0-d;
  - the `_shape` / `_strides` / `_ndim` arguments of an input whose names the body mentions;
  - the outputs;
  - every thread attribute whose name the body mentions, in MLX's table order;
- the body;
- the explicit instantiation with its host name.

MLX compiles that after its own preamble (metal_stdlib, `using namespace metal`, and the
float16_t / bfloat16_t typedefs), which the front-end check's model of Metal supplies."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

# MLX's dtype -> Metal type names (get_type_string)
TYPE_NAMES = {"float32": "float", "float16": "float16_t", "bfloat16": "bfloat16_t", "bool": "bool",
              "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t",
              "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t",
              "complex64": "complex64_t"}
# The thread attributes MLX adds when the body names them, in its table's order, and their types
ATTRIBUTES = (("dispatch_quadgroups_per_threadgroup", "uint"), ("dispatch_simdgroups_per_threadgroup", "uint"),
              ("dispatch_threads_per_threadgroup", "uint3"), ("grid_origin", "uint3"), ("grid_size", "uint3"),
              ("quadgroup_index_in_threadgroup", "uint"), ("quadgroups_per_threadgroup", "uint"),
              ("simdgroup_index_in_threadgroup", "uint"), ("simdgroups_per_threadgroup", "uint"),
              ("thread_execution_width", "uint"), ("thread_index_in_quadgroup", "uint"),
              ("thread_index_in_simdgroup", "uint"), ("thread_index_in_threadgroup", "uint"),
              ("thread_position_in_grid", "uint3"), ("thread_position_in_threadgroup", "uint3"),
              ("threadgroup_position_in_grid", "uint3"), ("threadgroups_per_grid", "uint3"),
              ("threads_per_grid", "uint3"), ("threads_per_simdgroup", "uint"), ("threads_per_threadgroup", "uint3"))
CONSTANT_BELOW = 8  # elements: a smaller input is bound in the constant address space


def _dtype(d: Any) -> str:
    return str(d).split(".")[-1]


def _template_value(v: Any) -> str:
    if isinstance(v, bool):
        return str(int(v))  # MLX streams bools without boolalpha
    if isinstance(v, int):
        return str(v)
    return TYPE_NAMES[_dtype(v)]


def _template_kind(v: Any) -> str:
    return "bool" if isinstance(v, bool) else "int" if isinstance(v, int) else "typename"


def kernel_name(name: str, constants: dict[str, Any], inputs: list[tuple[str, int, int]],
                outputs: list[str]) -> str:
    """custom_kernel_<name>, then the template values joined by '_' after an extra '_', then each
    input's type (s: 0-d, c: under 8 elements) and each output's type. `inputs`: (type name, ndim,
    size); `outputs`: type names."""
    out = f"custom_kernel_{name}"
    if constants:
        out += "__" + "_".join(_template_value(v) for v in constants.values())
    for t, ndim, size in inputs:
        out += f"_{t}" + ("s" if ndim == 0 else "c" if size < CONSTANT_BELOW else "")
    return out + "".join(f"_{t}" for t in outputs)


def metal_source(name: str, body: str, header: str, inputs: list[tuple[str, str, tuple[int, ...]]],
                 outputs: list[tuple[str, str]], constants: dict[str, Any], atomic_outputs: bool = False) -> str:
    """The source MLX's metal_kernel compiles for one launch (after its preamble). `inputs`:
    (name, dtype, shape) in order; `outputs`: (name, dtype); `constants`: the template arguments
    in order (int, bool or a dtype)."""
    types = [(TYPE_NAMES[_dtype(d)], len(shape), math.prod(shape)) for _, d, shape in inputs]
    k = kernel_name(name, constants, types, [TYPE_NAMES[_dtype(d)] for _, d in outputs])
    params, buffer = [], 0
    for (n, _, shape), (t, ndim, size) in zip(inputs, types):
        space = "constant" if size < CONSTANT_BELOW else "device"
        params.append(f"const {space} {t}{'&' if ndim == 0 else '*'} {n} [[buffer({buffer})]]")
        buffer += 1
        if ndim > 0:  # MLX searches the body for these names (a mention in a comment counts)
            for suffix, decl in (("_shape", "const constant int*"), ("_strides", "const constant int64_t*"),
                                 ("_ndim", "const constant int&")):
                if f"{n}{suffix}" in body:
                    params.append(f"{decl} {n}{suffix} [[buffer({buffer})]]")
                    buffer += 1
    for n, d in outputs:
        t = TYPE_NAMES[_dtype(d)]
        params.append(f"device {'atomic<' + t + '>' if atomic_outputs else t}* {n} [[buffer({buffer})]]")
        buffer += 1
    params += [f"{t} {a} [[{a}]]" for a, t in ATTRIBUTES if a in body]
    lines = [header, ""]
    if constants:
        lines.append("template <" + ", ".join(f"{_template_kind(v)} {c}" for c, v in constants.items()) + ">")
    lines.append(f"[[kernel]] void {k}(\n  " + ",\n  ".join(params) + ") {")
    lines += [body, "}"]
    if constants:
        args = "<" + ", ".join(_template_value(v) for v in constants.values()) + ">"
        lines.append(f'template [[host_name("{k}")]] [[kernel]] decltype({k}{args}) {k}{args};')
    return "\n".join(lines) + "\n"


def launch_source(job) -> str:
    """metal_source of a recorded launch (kernels.runtime.Launch), with the body and header that
    kernels.runtime hands to mx.fast.metal_kernel on Metal."""
    from kernels.runtime import handed_sources

    body, header = handed_sources(job.spec, True, cuda=False)
    return metal_source(job.spec.name, body, header,
                        [(n, a.dtype, tuple(a.shape)) for n, a in zip(job.spec.inputs, job.inputs)],
                        [(n, d) for n, (_, d) in zip(job.spec.outputs, job.outputs)], dict(job.constants))


# ---- the front-end check: clang's C++17 front end over the model of Metal ---------------------------
MODEL_DIR = Path(__file__).resolve().parent.parent / "kernels" / "msl" / "metal_model"
# What MLX's preamble (metal::utils()) gives every custom kernel, as the model spells it
PREAMBLE = "#include <metal_stdlib>\nusing namespace metal;\ntypedef half float16_t;\n"
CLANG_ARGS = ("-x", "c++", "-std=c++17", "-fms-extensions", "-Wall", "-Wno-unknown-attributes",
              "-Wno-unused-variable", "-Wno-unused-but-set-variable", "-Wno-unused-function",
              "-Wno-pragma-once-outside-header")
# A threadgroup variable declared in the body (threadgroup float buf[N];): Metal gives it the
# threadgroup's lifetime; clang's C++ mode refuses an automatic variable in an address space, so
# the check declares it static (the one rewrite of the source it makes).
_THREADGROUP_VAR = re.compile(r"^([ \t]*)(threadgroup\s+[\w:<>, ]+?\s+\w+\s*(\[[^\]]*\])*\s*;)",
                              re.MULTILINE)


# Metal's vector constructor calls with several arguments, which clang's ext vectors (the model's
# vectors) take as braces: half2(a, b) -> half2{a, b}
_VECTOR_TYPE = re.compile(r"\b(?:half|float|u?int|u?short|u?char|ulong)[234]\(")


def _braced_vector_calls(text: str) -> str:
    out, at = [], 0
    for m in _VECTOR_TYPE.finditer(text):
        if m.start() < at:
            continue  # inside a call already rewritten (its arguments are rewritten with it)
        depth, commas, end = 0, 0, None
        for i in range(m.end() - 1, len(text)):
            c = text[i]
            depth += c == "("
            depth -= c == ")"
            commas += c == "," and depth == 1
            if depth == 0:
                end = i
                break
        if end is None or not commas:
            continue  # one argument: a conversion, which the model's vectors take as a cast
        inner = _braced_vector_calls(text[m.end():end])
        out += [text[at:m.end() - 1], "{", inner, "}"]
        at = end + 1
    return "".join(out) + text[at:]


# MLX's explicit instantiation carries Metal's [[host_name]] and [[kernel]], which C++ does not
# allow there
_INSTANTIATION = re.compile(r'^template \[\[host_name\("[^"]*"\)\]\] \[\[kernel\]\] ', re.MULTILINE)


def front_end(source: str, name: str = "kernel.metal") -> tuple[list[str], int]:
    """clang's front end over the model of Metal for `source` (a kernel as metal_source writes
    it): (every error and warning, [] when it passes; the bytes of threadgroup memory it
    declares). Needs the libclang package. The check reads three Metal forms the way C++ can
    (the rewrites above): threadgroup variables as static, vector constructor calls as braces,
    the instantiation without its attributes. Each threadgroup variable is followed by a probe,
    a deprecated template of its size, whose warning names that size in the instantiated kernel
    (the sizes depend on the template constants). A warning, not an error: clang stops
    instantiating a function template's body at a statement that failed in its definition, so
    an error from a probe of a size known there (a scalar) hid the probes after it (seen: decode
    attention's merge weights, caught by the spec's own count, threadgroup_bytes_mismatch)."""
    import clang.cindex as ci

    count = [0]

    def probed(m: re.Match) -> str:
        count[0] += 1
        var = re.search(r"(\w+)\s*(\[[^\]]*\])*\s*;$", m.group(2)).group(1)
        return f"{m.group(1)}static {m.group(2)} {_PROBE}<sizeof({var})> lathe_tg_probe_{count[0]};"

    tu = _parse(_THREADGROUP_VAR.sub(probed, source), name,
                f"template <unsigned long N> struct [[deprecated]] {_PROBE} {{}};\n")
    sizes = [int(n) for d in tu.diagnostics for n in re.findall(rf"{_PROBE}<(\d+)", d.spelling)]
    errors = [f"{d.location.line}:{d.location.column}: {d.spelling}" for d in tu.diagnostics
              if d.severity >= ci.Diagnostic.Warning and _PROBE not in d.spelling]
    return errors + _address_space_casts(tu, name), sum(sizes)


def _parse(source: str, name: str, prelude: str = ""):
    """clang's translation unit of `source` (threadgroup variables already made static) after the
    other two rewrites, over the model of Metal."""
    import clang.cindex as ci

    text = PREAMBLE + prelude + _INSTANTIATION.sub("template ", _braced_vector_calls(source))
    return ci.Index.create().parse(name, args=[*CLANG_ARGS, f"-I{MODEL_DIR}"], unsaved_files=[(name, text)])


def _cursors_of(tu, name: str, kernel_only: bool = False):
    """Every cursor under the declarations of the kernel's own file (lathe.h and the body, not the
    model's headers); `kernel_only`: under the kernel function alone."""
    for top in tu.cursor.get_children():
        if top.location.file is not None and top.location.file.name == name and (
                not kernel_only or top.spelling.startswith("custom_kernel_")):
            yield from top.walk_preorder()


# The address space of a pointer or array type as clang spells it (the model's spaces are macros
# that clang prints by name); None for a type that is neither
_SPACES = re.compile(r"\b(device|constant|threadgroup)\b|address_space\((\d+)\)")


def _space_of(spelling: str) -> str | None:
    if "*" in spelling:
        spelling = spelling[:spelling.rindex("*")]  # the pointee's qualifiers
    elif "[" not in spelling:
        return None
    found = _SPACES.search(spelling)
    return "thread" if found is None else found.group(1) or f"address_space({found.group(2)})"


def _address_space_casts(tu, name: str) -> list[str]:
    """C-style casts in the kernel's file (lathe.h and the body) from a pointer of one address
    space to a pointer of another: clang's C++ takes them, as a reinterpretation; Metal rejects
    them (a pointer keeps its address space), so the check does."""
    import clang.cindex as ci

    errors = []
    for c in _cursors_of(tu, name):
        if c.kind != ci.CursorKind.CSTYLE_CAST_EXPR:
            continue
        operand = list(c.get_children())[-1]
        to, src = _space_of(c.type.spelling), _space_of(operand.type.spelling)
        if to is not None and src is not None and to != src and "*" in c.type.spelling:
            errors.append(f"{c.location.line}:{c.location.column}: a cast from '{operand.type.spelling}' to "
                          f"'{c.type.spelling}' changes the address space, which Metal does not allow")
    return errors


def written_in_place(source: str, name: str = "kernel.metal") -> set[str]:
    """The kernel's parameters that it writes through (`writable(p)`, lathe.h), read from clang's
    AST of `source` (a kernel as metal_source writes it), so only the code that the preprocessor
    keeps counts: a parameter behind a local variable (`auto k_cache = LATHE_K_CACHE(l)`) counts
    as the parameters its initializer names, but not one read for a value (`dims[0]` in a stack's
    layer offset, `k_cache_0 + l * dims[0] * ...`). Needs the libclang package."""
    import clang.cindex as ci

    tu = _parse(_THREADGROUP_VAR.sub(lambda m: f"{m.group(1)}static {m.group(2)}", source), name)

    def parameters(cursor, depth: int = 0) -> set[str]:
        found = set()
        if cursor.kind == ci.CursorKind.ARRAY_SUBSCRIPT_EXPR:  # a value read, not the pointer written
            return found
        ref = cursor.referenced if cursor.kind == ci.CursorKind.DECL_REF_EXPR else None
        if ref is not None and ref.kind == ci.CursorKind.PARM_DECL:
            found.add(ref.spelling)
        elif ref is not None and ref.kind == ci.CursorKind.VAR_DECL and depth < 3:
            found |= parameters(ref, depth + 1)
        for child in cursor.get_children():
            found |= parameters(child, depth)
        return found

    written: set[str] = set()
    for c in _cursors_of(tu, name, kernel_only=True):
        if c.kind == ci.CursorKind.CALL_EXPR and c.spelling == "writable":
            written |= parameters(next(c.get_arguments()))
    return written


_PROBE = "lathe_threadgroup_bytes"


def threadgroup_bytes_mismatch(job, measured: int) -> str | None:
    """Where the threadgroup memory a launch's spec says it declares (KernelSpec.threadgroup_bytes,
    what kernels.runtime.check_launch holds to the budget) is not what its source declares
    (`measured`, by front_end): the difference, else None."""
    formula = job.spec.threadgroup_bytes
    said = 0 if formula is None else formula(job.constants)
    if said == measured:
        return None
    return (f"declares {measured} bytes of threadgroup memory; its spec's threadgroup_bytes says {said} "
            f"(constants {dict(job.constants)})")


def front_end_errors(source: str, name: str = "kernel.metal") -> list[str]:
    """front_end's errors and warnings alone."""
    return front_end(source, name)[0]
