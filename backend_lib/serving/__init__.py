"""Triton glue: the `tritonserver` launcher, request parsing, response building, metrics, the model class."""
