"""kvstore: a multi-tier KV-cache offload and store service for LLM inference engines.

The core package has no engine imports and no backend specifics: keys, object format,
lifecycle, the tiered store and the capacity planner.
"""

__version__ = "0.1.0"
