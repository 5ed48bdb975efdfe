"""Kits shared by the test packages, one module per thing a test starts or drives, each named
for that thing (imported as ``tests.kits.<name>``):

- processes: ``store`` (``kvstore serve`` per module), ``openai_server`` (vLLM's server),
  ``second_uid`` (code run as another uid), ``tenant_load`` and ``attacks`` (client
  processes of the load and attack tests), ``rl_child`` (one engine of an RL loop);
- clients and cores: ``store_calls`` (objects and RPCs against a ``kvstore serve`` child),
  ``data_channel`` (a raw data-channel client), ``server_core`` (the store process's core in
  process), ``hostile`` (the adversarial tenants' cast), ``redis_tier`` (the Redis tier);
- the connector without vLLM: ``halves`` (the two halves in vLLM's hook order),
  ``worker_stories`` (the worker half under stream semantics), ``vllm_tier`` (vLLM's own
  offloading scheduler over our tier);
- values and checks: ``chain`` (chained keys and sealed objects), ``trace_stages`` (Chrome
  trace files).
"""
