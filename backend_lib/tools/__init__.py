"""Command-line tools: demo-checkpoint builder, KV-cache quality report."""
