"""``kvstore bench ...``: benchmarks that print every figure beside a limit measured in the
same run, and its ratio.  Rows are ``common.Row``; ``--json FILE`` writes them as a list."""
