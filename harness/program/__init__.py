"""The decode program: the architectures as data (arch/), the GGUF loader and writer (models),
the file's tokenizer, the plan a decoder replays (plan), the reference variant and the decode
modes (decode), the kernel variants (kernel_decode) and sampling."""
