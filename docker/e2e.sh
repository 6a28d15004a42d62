#!/usr/bin/env bash
# End to end under Docker, with no image registry: build a stand-in base image from Debian's
# packages, build the project's images, bring up the CPU variant (vLLM's CPU build + refenv +
# the service), send a POST /groups through the service and check the group; then swap the env for
# an image built like a foreign one (docker/foreign-env.Dockerfile: its own entrypoint, non-root,
# no health-check tooling inside), recreate the service, and do it again; take everything down.
#
#   sudo docker/e2e.sh          (root: it may install docker.io and debootstrap, and start dockerd)
#
# Logs go to results/logs/; the groups it got back to results/e2e-group.json and e2e-group-foreign.json.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
LOGS=$ROOT/results/logs
mkdir -p "$LOGS"
COMPOSE="docker-compose -f docker/compose.cpu.yaml"
say() { echo "$(date +%H:%M:%S) [e2e] $*"; }

[ "$(id -u)" = 0 ] || { echo "e2e: run as root (it manages the Docker engine)"; exit 2; }

# 1. An engine. overlay is not available on these machines: vfs works (and copies every layer).
if ! docker info >/dev/null 2>&1; then
  command -v dockerd >/dev/null || { say "installing docker.io"; apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null; }
  say "starting dockerd (vfs storage)"
  nohup dockerd --storage-driver=vfs >"$LOGS/dockerd.log" 2>&1 &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { echo "e2e: dockerd did not start; see $LOGS/dockerd.log"; exit 1; }
fi
command -v docker-compose >/dev/null || { apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose >/dev/null; }

# 2. The base image, made from Debian's packages when no registry can give it.
if ! docker image inspect python:3.11-slim >/dev/null 2>&1; then
  command -v debootstrap >/dev/null || { apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; }
  BASE=$(mktemp -d)
  # python3-dev: the official image ships the headers, and the CPU vLLM compiles its sampler with them.
  say "building a stand-in python:3.11-slim with debootstrap (about a minute)"
  debootstrap --variant=minbase --include=python3,python3-dev,python3-pip,python3-venv,ca-certificates bookworm "$BASE" >"$LOGS/debootstrap.log" 2>&1
  chmod 755 "$BASE"  # mktemp -d made it 0700: as the image's /, no other user could enter it
  rm -f "$BASE"/usr/lib/python3.11/EXTERNALLY-MANAGED
  ln -sf python3 "$BASE/usr/bin/python"
  cp /etc/ssl/certs/ca-certificates.crt "$BASE/etc/ssl/certs/ca-certificates.crt"
  tar -C "$BASE" -c . | docker import -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' -c 'CMD ["python3"]' - python:3.11-slim >/dev/null
  rm -rf "$BASE"
fi

# 3. vLLM's CPU build needs torch 2.13.0+cpu, which is not on the package index: a local wheelhouse.
mkdir -p docker/wheelhouse
if ! ls docker/wheelhouse/torch-2.13.0* >/dev/null 2>&1; then
  say "filling docker/wheelhouse with torch 2.13.0+cpu"
  python3 -m pip download -q --no-deps -d docker/wheelhouse torch==2.13.0
fi

cleanup() {
  $COMPOSE logs --no-color >"$LOGS/e2e-compose.log" 2>&1 || true
  say "taking everything down (container logs: $LOGS/e2e-compose.log)"
  $COMPOSE down -v >"$LOGS/e2e-down.log" 2>&1 || true
}
trap cleanup EXIT

say "building images (the vLLM CPU image is large: several minutes)"
$COMPOSE build >"$LOGS/e2e-build.log" 2>&1 || { tail -30 "$LOGS/e2e-build.log"; exit 1; }
wait_for_service() {
  for i in $(seq 180); do
    curl -fs http://127.0.0.1:8080/health >/dev/null 2>&1 && return 0
    for name in env service vllm; do  # a container that exited will not come back: say why now
      if [ "$(docker inspect -f '{{.State.Status}}' "$($COMPOSE ps -q $name)" 2>/dev/null)" = exited ]; then
        echo "e2e: the $name container exited; its log:"; $COMPOSE logs --no-color --tail 20 $name; return 1
      fi
    done
    [ $((i % 6)) = 0 ] && say "waiting for the service ($((i * 5))s): $($COMPOSE ps 2>/dev/null | tail -n +3 | awk '{print $1": "$NF}' | tr '\n' ' ')"
    sleep 5
  done
  echo "e2e: the service never became healthy; see $LOGS/e2e-compose.log"; return 1
}

# A group through the service, checked; then the env holds no world.
check_group() {
  local out=$1 task=$2
  say "POST /groups through the service ($task)"
  curl -fs http://127.0.0.1:8080/groups -H 'content-type: application/json' -H "Authorization: Bearer $ROLLOUT_API_KEY" \
    -d "{\"task_id\": \"$task\", \"n\": 4, \"sampling\": {\"temperature\": 0.8, \"max_tokens\": 48}}" >"$out"
  python3 - "$out" <<'PY'
import json, sys
g = json.load(open(sys.argv[1]))
c = g["counts"]
assert c["scheduled"] == 4 == c["scored"] + c["failed"], c
turns = [t for a in g["attempts"] for t in a["turns"]]
# Exact mode: a turn's prompt ids are its trajectory segment up to its span (null in the turn itself).
assert turns and all(t["completion_token_ids"] and len(t["logprobs"]) == len(t["completion_token_ids"])
                     for t in turns), "a turn lacks token ids"
assert all(a["trajectory"] and a["trajectory"][0]["prompt_tokens"] > 0 for a in g["attempts"] if a["turns"]), \
    "an attempt lacks its trajectory"
# Every attempt must have reached vLLM and been generated: an inference failure here is the stack broken.
bad = [(a["status"], a.get("failure")) for a in g["attempts"] if a["status"] == "inference_failure"]
assert not bad, bad
assert c["scored"] >= 1, c
print(f"e2e: group {g['group_id']} on {g['task_id']}: rewards {g['rewards']}, scored {c['scored']}/{c['scheduled']}, "
      f"model {g['model']}, env dataset {g['env']['catalog_hash']}")
PY
  curl -fs http://127.0.0.1:8090/health | python3 -c "import json,sys; h=json.load(sys.stdin); assert h['leased']==0, h; print('e2e: env leased 0, max_leased', h['max_leased'])"
}

say "docker compose up (vLLM prepares the model and compiles at first start: a few minutes)"
$COMPOSE up -d >"$LOGS/e2e-up.log" 2>&1 || { tail -5 "$LOGS/e2e-up.log"; exit 1; }
wait_for_service
# The keys compose generated, where the trainer reads them; without one the data plane answers 401.
set -a; . docker/keys/rollout.keys; set +a
[ "$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8080/tasks)" = 401 ] || { echo "e2e: /tasks answered without a key"; exit 1; }
check_group results/e2e-group.json t019

# 2. The same stack with an env image built like a foreign one (GraphJin's): its own entrypoint, not
# python; ENV_COMMAND as its arguments; a non-root user; no python, curl or wget inside for a health
# check to call. The env and the service are recreated (vLLM keeps running): the service must find
# the new env by itself.
FOREIGN=stepenv-foreign:local
say "building $FOREIGN (docker/foreign-env.Dockerfile)"
docker build -q -f docker/foreign-env.Dockerfile -t "$FOREIGN" . >"$LOGS/e2e-foreign-build.log" 2>&1 || { tail -30 "$LOGS/e2e-foreign-build.log"; exit 1; }
for tool in python3 python curl wget; do
  if docker run --rm --entrypoint "$tool" "$FOREIGN" --version >/dev/null 2>&1; then echo "e2e: $FOREIGN has $tool inside"; exit 1; fi
done
[ "$(docker image inspect -f '{{.Config.User}}' "$FOREIGN")" != "" ] || { echo "e2e: $FOREIGN runs as root"; exit 1; }
export ENV_IMAGE=$FOREIGN ENV_COMMAND="serve --step --pool 4 --listen 0.0.0.0:8090"
say "recreating env ($ENV_IMAGE $ENV_COMMAND) and the service"
$COMPOSE up -d --force-recreate --no-build env service >"$LOGS/e2e-up-foreign.log" 2>&1 || { tail -5 "$LOGS/e2e-up-foreign.log"; exit 1; }
wait_for_service
docker inspect -f '{{.Config.Entrypoint}} {{.Config.Cmd}} user={{.Config.User}}' "$($COMPOSE ps -q env)" | sed 's/^/e2e: env container runs /'
check_group results/e2e-group-foreign.json "$(curl -fs http://127.0.0.1:8080/tasks -H "Authorization: Bearer $ROLLOUT_API_KEY" | python3 -c 'import json,sys; print(json.load(sys.stdin)["tasks"][0]["task_id"])')"
say "OK"
