"""Thin adapters that make kvstore a tier of other serving frameworks (docs/vllm-tier.md).

Each sits beside the engine connector (``connector``), reuses its typed config and the store
core, and never imports the harness.
"""
