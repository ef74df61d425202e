# lit-softmoe: `make demo` and `make test` are the only set-up commands a fresh machine needs.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
# torch pinned to the release these machines keep on disk (no multi-GB download); override freely.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
FASHION_MNIST_DIR ?= /usr/share/datasets/fashion-mnist
INSTALLED := $(VENV)/.installed

.PHONY: install fashion-mnist demo demo-fast test lint timm-sdist timm-tests wheel-check clean

$(INSTALLED): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[dev]'
	# Real test images in the standard label spaces (only its data files are read; its own
	# dependencies are not needed, hence --no-deps).
	$(PY) -m pip install -q --no-deps foolbox==3.3.4
	touch $@

install: $(INSTALLED)

# The default real dataset, from Debian's package; elsewhere set LIT_SOFTMOE_DATA or let
# torchvision download it at run time.
fashion-mnist:
	@if [ -d "$(FASHION_MNIST_DIR)" ] || [ -n "$$LIT_SOFTMOE_DATA" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 || \
		{ apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist; }; \
	else echo "note: Fashion-MNIST not installed; run 'sudo apt-get install -y dataset-fashion-mnist'," \
		"set LIT_SOFTMOE_DATA=DIR, or let torchvision download it (needs internet)"; fi

demo: $(INSTALLED) fashion-mnist
	$(VENV)/bin/lit-softmoe demo

demo-fast: $(INSTALLED) fashion-mnist
	$(VENV)/bin/lit-softmoe demo --fast

# The suite on every core: pytest-xdist's workers (TEST_WORKERS, default one per core) share the cores
# (tests/conftest.py gives each cores/workers threads). TEST_WORKERS=0 runs it in this one process.
# worksteal: a worker that runs out of tests takes half of another's queue (xdist's default, load,
# leaves each worker the tests it was sent: on 2 cores one worker ran alone for the last 72 s).
# timm's model tests (below) run in the same session: one start of the workers, one queue to balance.
TEST_WORKERS ?= auto
TIMM_PYTEST = PYTHONPATH="$(CURDIR)/tests/timm_suite$${PYTHONPATH:+:$$PYTHONPATH}" $(PY) -m pytest \
	-p timm_plugin -W ignore::pytest.PytestUnknownMarkWarning
test: $(INSTALLED) fashion-mnist lint timm-sdist
	$(TIMM_PYTEST) -q -n $(TEST_WORKERS) --dist worksteal --rootdir "$(CURDIR)" -c pyproject.toml \
		tests "$$(cat "$(TIMM_TESTS_FILE)")"

# timm's own model tests (tests/test_models.py of the installed timm's sdist, downloaded once into
# TIMM_SDIST_DIR) on our registered towers: tests/timm_suite/timm_plugin.py registers them first and
# keeps the tests that apply (docs/interoperability.md, "timm tests that do not apply"): 112 tests, about
# 1 min on the 2-core machine. `make test` runs them with the suite; `make timm-tests` alone.
TIMM_SDIST_DIR ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/lit-softmoe/timm-sdist
# The path of the installed timm's test_models.py, written by timm-sdist: a copy in a folder of its own, as
# timm's tests/ is a package named `tests` with a conftest, like ours, and one session cannot import both.
TIMM_TESTS_FILE := $(VENV)/.timm-tests
timm-sdist: $(INSTALLED)
	@v=$$($(PY) -c "from importlib.metadata import version; print(version('timm'))") && d="$(TIMM_SDIST_DIR)/timm-$$v" && \
	if [ ! -f "$$d/tests/test_models.py" ]; then \
		mkdir -p "$(TIMM_SDIST_DIR)" && \
		$(PY) -m pip download -q --no-deps --no-binary :all: "timm==$$v" -d "$(TIMM_SDIST_DIR)" && \
		tar -xzf "$(TIMM_SDIST_DIR)/timm-$$v.tar.gz" -C "$(TIMM_SDIST_DIR)" "timm-$$v/tests" "timm-$$v/pyproject.toml"; \
	fi && mkdir -p "$$d/model_tests" && cp "$$d/tests/test_models.py" "$$d/model_tests/" && \
	echo "$$d/model_tests/test_models.py" > "$(TIMM_TESTS_FILE)"

timm-tests: timm-sdist
	$(TIMM_PYTEST) -q -n $(TEST_WORKERS) --rootdir "$(CURDIR)" -c pyproject.toml "$$(cat "$(TIMM_TESTS_FILE)")"

# The layering contract (pyproject's [tool.importlinter]: imports point down the layers only) and ruff.
lint: $(INSTALLED)
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/ruff check lit_softmoe tests scripts

# The wheel as users get it: built, installed into a fresh virtual environment outside the checkout
# (torch from $(TORCH_SPEC)), and `lit-softmoe demo --fast` run there to the end.
WHEEL_CHECK_DIR ?= $(or $(TMPDIR),/tmp)/lit-softmoe-wheel-check
wheel-check: $(INSTALLED) fashion-mnist
	rm -rf "$(WHEEL_CHECK_DIR)" && mkdir -p "$(WHEEL_CHECK_DIR)"
	$(PY) -m build --wheel --outdir "$(WHEEL_CHECK_DIR)/dist" .
	$(PYTHON) -m venv "$(WHEEL_CHECK_DIR)/venv"
	"$(WHEEL_CHECK_DIR)/venv/bin/python" -m pip install -q $(TORCH_SPEC)
	"$(WHEEL_CHECK_DIR)/venv/bin/python" -m pip install -q "$(WHEEL_CHECK_DIR)"/dist/*.whl
	cd "$(WHEEL_CHECK_DIR)" && venv/bin/lit-softmoe demo --fast --data data --runs runs
	cd "$(WHEEL_CHECK_DIR)" && venv/bin/python -c "import lit_softmoe.config as c, sys; \
		sys.exit(0 if not c.__file__.startswith('$(CURDIR)') else 'lit_softmoe was imported from the checkout')"

clean:
	rm -rf runs data .pytest_cache
