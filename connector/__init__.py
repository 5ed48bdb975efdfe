"""The engine side of kvstore, what runs inside an engine: the vLLM connector
(``connector.vllm``) over its scheduler and worker halves, and the copy engines.  The harness
that drives engines (the main job, the kit, the tiny models, bench e2e) is the ``harness``
package, above this one in the layers."""
