"""The operator's tools: the CLI, the demo, the local stack, the load test, held-out measurement."""
