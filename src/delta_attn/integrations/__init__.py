"""Integrations of delta-attn with other libraries (import the submodule you need)."""
