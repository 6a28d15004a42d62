#!/usr/bin/env bash
# End to end under Docker, with no image registry, as a user does it from a clone: build a stand-in base
# image from Debian's packages (when the engine has none), build the project's images, `docker compose up`
# the CPU variant with the keys its keys step generates, and check what a user relies on:
#   - the service answers 401 without the API key, and a POST /groups with it is scored;
#   - vLLM answers 401 to a completion without its key (the service sends it: the groups score);
#   - POST /envs is refused without the admin key (and with the API key), accepted with it;
#   - the load test (`rollout-service loadtest`, in the service's container) runs through the stack;
#   - an env image built like a foreign one (docker/foreign-env.Dockerfile: its own entrypoint and user,
#     no health-check tooling inside) serves a group in place of refenv's;
#   - `docker compose down -v` leaves no container, network or volume of the project behind.
#
#   sudo docker/e2e.sh          (root: it may install docker.io and debootstrap, and start dockerd)
#   sudo docker/e2e.sh --engine (only make sure an engine runs: exit 0 if one does; .ci/run asks this first)
#
# Logs go to results/logs/; the groups it got back to results/e2e-group*.json, the load test's report to
# results/e2e-loadtest.json, and its figures (the record bench/results/docker-e2e-*.json holds) to
# results/e2e-record.json. The engine's build cache is used as it is: a second run rebuilds only the
# layers holding the code.
set -euo pipefail
shopt -s inherit_errexit  # a failed check inside $(...) fails the run
cd "$(dirname "$0")/.."
ROOT=$PWD
LOGS=$ROOT/results/logs
mkdir -p "$LOGS"
COMPOSE="docker-compose -f docker/compose.cpu.yaml"
# On vfs, creating the vLLM container copies its whole image (4.5 GB): on a busy machine that outlasts
# compose's default 60 s wait for the engine's answer.
export COMPOSE_HTTP_TIMEOUT=${COMPOSE_HTTP_TIMEOUT:-600}
PROJECT=docker  # compose's project name: the compose file's folder, as for a user running it there
say() { echo "$(date +%H:%M:%S) [e2e] $*"; }
fail() { echo "e2e: FAILED: $*" >&2; exit 1; }
START=$(date +%s)
since() { echo $(($(date +%s) - $1)); }

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
[ "${1:-}" = --engine ] && { say "engine: Docker $(docker version -f '{{.Server.Version}}'), $(docker-compose version --short)"; exit 0; }

# 2. The base image, made from Debian's packages when no registry can give it (kept by the engine: made once).
BASE_S=0
if ! docker image inspect python:3.11-slim >/dev/null 2>&1; then
  T=$(date +%s)
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
  BASE_S=$(since "$T")
fi

# 3. vLLM's CPU build needs torch 2.13.0+cpu, which is not on the package index: a local wheelhouse, from
# this machine's local wheel folder (no network) where it has one, else through pip's own configuration.
mkdir -p docker/wheelhouse
if ! ls docker/wheelhouse/torch-2.13.0* >/dev/null 2>&1; then
  say "filling docker/wheelhouse with torch 2.13.0+cpu"
  if ls /opt/wheels/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
    cp /opt/wheels/torch-2.13.0+cpu-*.whl docker/wheelhouse/
  else
    python3 -m pip download -q --no-deps -d docker/wheelhouse torch==2.13.0
  fi
fi

cleanup() {
  $COMPOSE logs --no-color >"$LOGS/e2e-compose.log" 2>&1 || true
  say "taking everything down (container logs: $LOGS/e2e-compose.log)"
  $COMPOSE down -v >"$LOGS/e2e-down.log" 2>&1 || true
}
trap cleanup EXIT

T=$(date +%s)
say "building images (the first time, the vLLM CPU image takes several minutes; later only the code's layers)"
$COMPOSE build >"$LOGS/e2e-build.log" 2>&1 || { tail -30 "$LOGS/e2e-build.log"; fail "docker-compose build"; }
BUILD_S=$(since "$T")
# vfs keeps every layer as a full copy of its image (the vLLM image's are 4.5 GB each): the layers an
# earlier run built and this one replaced (untagged, used by no image) go now, or the disk fills up.
docker image prune -f >/dev/null
T=$(date +%s)
say "building the foreign-style env image (docker/foreign-env.Dockerfile)"
FOREIGN=stepenv-foreign:local
docker build -q -f docker/foreign-env.Dockerfile -t "$FOREIGN" . >"$LOGS/e2e-foreign-build.log" 2>&1 || { tail -30 "$LOGS/e2e-foreign-build.log"; fail "building $FOREIGN"; }
FOREIGN_S=$(since "$T")
size() { docker image inspect -f '{{.Size}}' "$1" | awk '{printf "%.0f MB", $1 / 1e6}'; }

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
code() { curl -s -o /dev/null -w '%{http_code}' "$@"; }

# A group through the service, checked; then the env holds no world. Prints the group's summary (JSON).
check_group() {
  local out=$1 task=$2
  say "POST /groups through the service ($task)" >&2
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
# Every attempt must have reached vLLM and been generated: an inference failure here is the stack broken
# (a model server refusing the service's key among them).
bad = [(a["status"], a.get("failure")) for a in g["attempts"] if a["status"] == "inference_failure"]
assert not bad, bad
assert c["scored"] >= 1, c
print(f"e2e: group {g['group_id']} on {g['task_id']}: rewards {g['rewards']}, scored {c['scored']}/{c['scheduled']}, "
      f"model {g['model']}, env dataset {g['env']['catalog_hash']}", file=sys.stderr)
print(json.dumps({"task": g["task_id"], "scored": c["scored"], "scheduled": c["scheduled"], "rewards": g["rewards"]}))
PY
  curl -fs http://127.0.0.1:8090/health | python3 -c "import json,sys; h=json.load(sys.stdin); assert h['leased']==0, h; print('e2e: env leased 0, max_leased', h['max_leased'], file=sys.stderr)"
}

# The ports compose publishes must be free: another server on one of them (a `rollout-service up` left
# running) would stop `up` with "address already in use" after the builds. Waited for a while, then named.
for _ in $(seq 24); do
  BUSY=$(ss -Hltn 2>/dev/null | awk '{print $4}' | grep -E '(^|:)(8000|8080|8090)$' || true)
  [ -z "$BUSY" ] && break
  say "waiting for ports 8000/8080/8090 to be free (in use: $(echo $BUSY | tr '\n' ' '))"; sleep 5
done
[ -z "$BUSY" ] || { ss -Hltnp | grep -E ':(8000|8080|8090) ' >&2 || true; fail "ports in use: $BUSY"; }

T=$(date +%s)
say "docker compose up (vLLM prepares the model at its first start: a few minutes)"
$COMPOSE up -d >"$LOGS/e2e-up.log" 2>&1 || { tail -5 "$LOGS/e2e-up.log"; fail "docker-compose up"; }
wait_for_service || fail "the stack did not come up"
UP_S=$(since "$T")
say "serving after ${UP_S}s"

# The keys compose generated, where the trainer reads them; without one the data plane answers 401.
set -a; . docker/keys/rollout.keys; set +a
[ "$(code http://127.0.0.1:8080/tasks)" = 401 ] || fail "/tasks answered without a key"
# The model server is keyed: a completion without its key is refused (the groups below score, so the
# service sends it).
VLLM_401=$(code http://127.0.0.1:8000/v1/completions -H 'content-type: application/json' \
  -d '{"model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": 1}')
[ "$VLLM_401" = 401 ] || fail "vLLM answered $VLLM_401 to a completion without its key (401 expected)"
[ "$(code http://127.0.0.1:8000/v1/models -H 'Authorization: Bearer wrong')" = 401 ] || fail "vLLM took a wrong key"
GROUP1=$(check_group results/e2e-group.json t019)

# The admin plane: POST /envs without the admin key (none, or the API key) is 401; with it, an env is
# taken out and added back (201), and a group scores on it again.
ENV_URL=http://env:8090
ENVS_NO_KEY=$(code http://127.0.0.1:8080/envs -H 'content-type: application/json' -d "{\"url\": \"$ENV_URL\"}")
ENVS_API_KEY=$(code http://127.0.0.1:8080/envs -H 'content-type: application/json' -H "Authorization: Bearer $ROLLOUT_API_KEY" -d "{\"url\": \"$ENV_URL\"}")
[ "$ENVS_NO_KEY" = 401 ] && [ "$ENVS_API_KEY" = 401 ] || fail "POST /envs answered $ENVS_NO_KEY without a key, $ENVS_API_KEY with the API key (401 expected)"
ADMIN=(-H 'content-type: application/json' -H "Authorization: Bearer $ROLLOUT_ADMIN_KEY")
REMOVED=$(code http://127.0.0.1:8080/envs/remove "${ADMIN[@]}" -d "{\"url\": \"$ENV_URL\", \"timeout_s\": 60}")
[ "$REMOVED" = 200 ] || fail "POST /envs/remove with the admin key answered $REMOVED"
ADDED=$(code http://127.0.0.1:8080/envs "${ADMIN[@]}" -d "{\"url\": \"$ENV_URL\", \"timeout_s\": 60}")
[ "$ADDED" = 201 ] || fail "POST /envs with the admin key answered $ADDED (201 expected)"
say "POST /envs: 401 without a key and with the API key, 201 with the admin key"
GROUP2=$(check_group results/e2e-group-readded.json t019)

# The load test, through the stack: from the service's container, where the service is on loopback.
T=$(date +%s)
say "rollout-service loadtest (16 groups of 4, 2 trainers) through the stack"
$COMPOSE exec -T -e ROLLOUT_API_KEY="$ROLLOUT_API_KEY" service sh -c \
  'rollout-service loadtest --trainers 2 --batch 2 --n 4 --count 16 --max-tokens 32 --api-key-env ROLLOUT_API_KEY --json /tmp/loadtest.json >&2 && cat /tmp/loadtest.json' \
  >results/e2e-loadtest.json 2>"$LOGS/e2e-loadtest.log" || { tail -20 "$LOGS/e2e-loadtest.log"; fail "the load test"; }
LOAD_S=$(since "$T")
LOAD=$(python3 - <<'PY'
import json
r = json.load(open("results/e2e-loadtest.json"))
assert r["groups"] == 16 and not r["error_count"] and not r["groups_not_accounted"], {k: r[k] for k in ("groups", "errors", "groups_not_accounted")}
assert not r["attempt_status"].get("inference_failure"), r["attempt_status"]
print(f"{r['groups']} groups in {r['wall_s']:.0f} s ({r['groups_per_s']:.2f}/s, {r['completion_tokens_per_s']:.0f} completion tokens/s), "
      f"group latency p50 {r['group_latency_s']['p50']:.1f} s, p90 {r['group_latency_s']['p90']:.1f} s; attempts {r['attempt_status']}")
PY
) || fail "the load test's report"
say "loadtest: $LOAD"

# The same stack with an env image built like a foreign one (GraphJin's): its own entrypoint, not
# python; ENV_COMMAND as its arguments; a non-root user of its own; no python, curl or wget inside for a
# health check to call. The env and the service are recreated (vLLM keeps running): the service must find
# the new env by itself, and the env reads the token the keys step wrote as its own user.
for tool in python3 python curl wget; do
  if docker run --rm --entrypoint "$tool" "$FOREIGN" --version >/dev/null 2>&1; then fail "$FOREIGN has $tool inside"; fi
done
FOREIGN_USER=$(docker image inspect -f '{{.Config.User}}' "$FOREIGN")
[ -n "$FOREIGN_USER" ] && [ "$FOREIGN_USER" != 0 ] && [ "$FOREIGN_USER" != root ] || fail "$FOREIGN runs as root"
export ENV_IMAGE=$FOREIGN ENV_COMMAND="serve --step --pool 4 --listen 0.0.0.0:8090"
say "recreating env ($ENV_IMAGE $ENV_COMMAND) and the service"
$COMPOSE up -d --force-recreate --no-build env service >"$LOGS/e2e-up-foreign.log" 2>&1 || { tail -5 "$LOGS/e2e-up-foreign.log"; fail "compose up with $FOREIGN"; }
wait_for_service || fail "the stack with $FOREIGN did not come up"
docker inspect -f '{{.Config.Entrypoint}} {{.Config.Cmd}} user={{.Config.User}}' "$($COMPOSE ps -q env)" | sed 's/^/e2e: env container runs /'
FOREIGN_TASK=$(curl -fs http://127.0.0.1:8080/tasks -H "Authorization: Bearer $ROLLOUT_API_KEY" | python3 -c 'import json,sys; print(json.load(sys.stdin)["tasks"][0]["task_id"])')
GROUP3=$(check_group results/e2e-group-foreign.json "$FOREIGN_TASK")

# Down: nothing of the project is left.
trap - EXIT
cleanup
LEFT=$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT"; docker network ls -q --filter "label=com.docker.compose.project=$PROJECT"; docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT")
[ -z "$LEFT" ] || { docker ps -a; docker network ls; docker volume ls; fail "docker compose down -v left: $LEFT"; }
say "down: no container, network or volume of project $PROJECT left"
TOTAL_S=$(since "$START")

export BASE_S BUILD_S FOREIGN_S UP_S LOAD_S TOTAL_S GROUP1 GROUP2 GROUP3 LOAD VLLM_401 ENVS_NO_KEY ENVS_API_KEY ADDED
export VLLM_SIZE=$(size rollout-vllm-cpu:local) SERVICE_SIZE=$(size rollout-service:local) FOREIGN_SIZE=$(size "$FOREIGN") FOREIGN_USER
export ENGINE=$(docker version -f '{{.Server.Version}}') COMPOSE_VERSION=$(docker-compose version --short)
export COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
python3 - <<'PY'
import datetime, json, os
e = os.environ
def minutes(s):
    return f"{int(s) / 60:.1f} minutes"
def group(g):
    g = json.loads(g)
    return f"{g['scored']} of {g['scheduled']} scored, rewards {g['rewards']}; 0 worlds held after"
rows = [
    {"step": "whole run", "result": f"passed in {minutes(e['TOTAL_S'])}"},
    {"step": "stand-in base image (debootstrap)", "result": minutes(e["BASE_S"]) if int(e["BASE_S"]) else "kept by the engine from an earlier run"},
    {"step": "image builds (compose build)", "result": f"{minutes(e['BUILD_S'])}: vLLM CPU image {e['VLLM_SIZE']}, service/refenv image {e['SERVICE_SIZE']}"},
    {"step": "foreign-style env image", "result": f"{e['FOREIGN_SIZE']}, built in {minutes(e['FOREIGN_S'])}; its own entrypoint, uid {e['FOREIGN_USER']}, no python/curl/wget on its PATH"},
    {"step": "docker compose up to serving", "result": minutes(e["UP_S"])},
    {"step": "vLLM without its key", "result": f"POST /v1/completions answered {e['VLLM_401']}"},
    {"step": "POST /groups t019, n=4, with the API key", "result": group(e["GROUP1"])},
    {"step": "POST /envs", "result": f"{e['ENVS_NO_KEY']} without a key, {e['ENVS_API_KEY']} with the API key, {e['ADDED']} with the admin key (after /envs/remove)"},
    {"step": "POST /groups t019 on the env added back", "result": group(e["GROUP2"])},
    {"step": "rollout-service loadtest (2 trainers, batches of 2, n=4)", "result": f"{e['LOAD']}, in {minutes(e['LOAD_S'])}"},
    {"step": f"POST /groups {json.loads(e['GROUP3'])['task']}, n=4, on the foreign-style env", "result": group(e["GROUP3"])},
    {"step": "docker compose down -v", "result": "no container, network or volume of the project left"},
]
record = {
    "benchmark": "docker_e2e",
    "title": "docker/e2e.sh: the CPU compose stack with no image registry",
    "command": "docker/e2e.sh",
    "commit": e["COMMIT"],
    "machine": {"description": f"{os.cpu_count()} cores, no GPU, no registry; Docker engine {e['ENGINE']} on vfs, docker-compose {e['COMPOSE_VERSION']}"},
    "date": datetime.date.today().isoformat(),
    "figures": {"rows": rows},
}
json.dump(record, open("results/e2e-record.json", "w"), indent=1)
print("e2e: record in results/e2e-record.json")
PY
say "OK"
