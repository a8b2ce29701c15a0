"""Clients users run against the Triton server: streaming CLI, load generator, HTTP example."""
