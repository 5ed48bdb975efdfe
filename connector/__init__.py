"""The engine side of kvstore: the vLLM connector (``connector.vllm``) over its scheduler and
worker halves, copy engines, and the main job (``python -m connector.main``)."""
