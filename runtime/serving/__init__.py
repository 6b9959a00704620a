"""Serving: the engine loop on its thread, the OpenAI-compatible server, its protocol, metrics and
access control, and the lm-eval model. Imports `engine`."""
