"""Safetensors and checkpoint IO shared by every stage (convert, delta, train, the engine's pull).

Modules: header (the format: dtype table, header parser and writer, index layout), reader (torch
tensors mapped from the page cache, raw bytes for delta sync), writer (sequential O_DIRECT,
append-only blobs, positional), checkpoint (the index reader, the file-name check, full
checkpoint directories), hf_dir (HF directories written from a state dict). Every file is
published through rltool.atomic: whole or not at all, with the same mode.
Formats: docs/formats.md.
"""
