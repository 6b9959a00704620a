"""Formats: the model config, the quantized array formats, the checkpoint (orbax dense +
TensorStore expert chunks), safe writes and the tokenizer. Imports nothing else of the project."""
