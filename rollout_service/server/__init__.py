"""The service, a folder per feature, each floor importing only the floors below it (tests/test_layout.py):
policy/ (the versions the replicas serve), membership/ (envs, model servers, env worlds, the monitor),
groups/ (admission, the runner, attempts, trajectories, the answers' NDJSON), sampler/ (streams and task
statistics), then service.py (every part made once) and status.py (/health), and http/ (the app, its
routes per feature, the planes' keys, the middlewares) on top."""
