"""The ``kvstore`` command line: one module per sub-command (``main`` builds the parser)."""
