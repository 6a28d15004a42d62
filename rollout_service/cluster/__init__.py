"""The stack on a Ray cluster: vLLM replicas, env servers and the service as Ray actors.

Each piece is a Ray actor (`actors.ServerProcess`) that runs the real server process on the node
Ray placed it on and reports its URL; Ray restarts a dead actor (`max_restarts`) on the same port,
so the service finds it again where it was. `deploy` places, scales, lists and takes down the
pieces and wires envs and replicas into the service through its membership API (POST /envs,
POST /replicas). Needs the `ray` extra: `pip install 'rollout-service[ray]'`.
"""
