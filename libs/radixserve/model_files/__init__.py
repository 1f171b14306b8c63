"""What every process needs about a model, without torch: where its files are
(`paths.resolve_model_path`: a folder, a GGUF converted once, or the embedded SmolLM2),
its config (`config.ModelConfig`), its tokenizer and chat template (`tokenizer`), the
name the API serves it under (`names`) and the GGUF conversion (`gguf_convert`, which
imports torch only while it converts).

The engine (`radixserve.engine.model`) builds the torch model from these; the tokenizer,
grammar and detokenizer services use them directly.
"""
