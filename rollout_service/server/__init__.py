"""The service: HTTP API (api.py, app.py, middleware.py), the logic behind it (service.py, runner.py,
scheduler.py), its clients of the environments (env_client.py), health probes, metrics, run log."""
