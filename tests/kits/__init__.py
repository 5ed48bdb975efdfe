"""Kits shared by test packages: real processes the tests start, talk to and always stop."""
