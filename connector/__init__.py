"""The engine side of kvstore (vLLM connector); filled in by the connector work."""
