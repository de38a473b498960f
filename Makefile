# Two commands: `make lab` to work, `make test` to check. Both build .venv from nothing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install lab test demo lint bench clean

$(STAMP): pyproject.toml constraints-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# constraints pin torch to the CPU build for development; users get an open range
	$(BIN)/pip install -q -c constraints-dev.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

lab: install
	$(BIN)/mpilab lab

test: install
	$(BIN)/ruff check kernel_ext widgets tests benchmarks
	$(BIN)/pytest -q -ra

demo: install
	$(BIN)/mpilab run notebooks/01_quickstart.ipynb -o build/quickstart.ipynb --html build/quickstart.html

bench: install
	$(BIN)/python benchmarks/bench_dispatch.py
	$(BIN)/python benchmarks/bench_start.py

clean:
	rm -rf $(VENV) build
