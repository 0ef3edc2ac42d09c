"""Test doubles and helpers shared by the test suites (and by benchmarks run from a checkout)."""
