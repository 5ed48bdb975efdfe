"""The harness around the engine adapter (above ``connector`` in the layers; the adapter never
imports it): the main job behind ``make run`` (``python -m harness.main``), the engine kit that
runs real vLLM engines in child processes (``harness.kit``), the tiny-model builder
(``harness.tinymodel``) and ``kvstore bench e2e`` (``harness.bench_e2e``)."""
