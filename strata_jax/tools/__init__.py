"""Tools: offline work on checkpoints: Hugging Face import, quantization (RTN, GPTQ) and its
evaluation, synthetic models (and their training), perplexity. Imports the layers below and
`api`."""
