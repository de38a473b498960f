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

# every figure of the README's benchmark table, with the options it quotes (~27 min)
bench: install
	$(BIN)/python benchmarks/bench_dispatch.py --reps 40
	$(BIN)/python benchmarks/bench_start.py --reps 3
	$(BIN)/python benchmarks/bench_training.py --steps 20 --repeats 5
	$(BIN)/python benchmarks/bench_allreduce.py --repeats 30
	$(BIN)/python benchmarks/bench_redraw.py
	$(BIN)/python benchmarks/bench_overhead.py --reps 3 --phase-cells 12
	$(BIN)/python benchmarks/bench_overhead.py -n 1 --threads 1 --reps 3 --phase-cells 6
	$(BIN)/python benchmarks/bench_browser.py

clean:
	rm -rf $(VENV) build
