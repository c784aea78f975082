"""Flight checks: is this server, GPU or disk fit for a multi-day campaign, with evidence.

`server` holds the tiered health of one OpenAI-compatible endpoint (tcp -> /health -> /v1/models
-> a real completion -> Prometheus progress) and the readers the status command reuses.
"""
