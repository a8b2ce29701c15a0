"""Test and bench harness: the real tritonserver on free ports, with its log, metrics and processes."""
