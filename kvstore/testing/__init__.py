"""Real processes for tests and benchmarks: redis-server (single, TLS, ACL, cluster), a
``kvstore serve`` process, and throwaway TLS files.  Never imported by the product."""
