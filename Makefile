# Two commands: `make lab` to work, `make test` to check. Both build .venv from nothing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install lab test demo lint bench gpu-check clean

$(STAMP): pyproject.toml setup.py $(wildcard kernel_ext/rank/*.c) constraints-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# constraints pin torch to the CPU build for development; users get an open range.
	# The examples' data sets (scikit-learn) come with the `examples` extra.
	$(BIN)/pip install -q -c constraints-dev.txt -e '.[dev,examples]'
	touch $(STAMP)

install: $(STAMP)

# JupyterLab on copies of the example notebooks (~/mpilab-notebooks, or DIR=...), so
# running them never changes the checkout
lab: install
	$(BIN)/mpilab lab $(if $(DIR),--dir $(DIR))

test: install
	$(BIN)/ruff check kernel_ext widgets tests benchmarks
	$(BIN)/pytest -q -ra -n 2

demo: install
	$(BIN)/mpilab run notebooks/01_quickstart.ipynb -o build/quickstart.ipynb --html build/quickstart.html

# every figure of the README's benchmark table, with the options it quotes, and the
# further rows of docs/benchmarks.md (the multi-host rows need root: emulated hosts)
bench: install
	$(BIN)/python benchmarks/bench_start.py --reps 5
	$(BIN)/python benchmarks/bench_start.py -n 16 --reps 3
	$(BIN)/python benchmarks/bench_first_cell.py --reps 3
	$(BIN)/python benchmarks/bench_dispatch.py --reps 40
	$(BIN)/python benchmarks/bench_torchrun.py --repeats 7
	$(BIN)/python benchmarks/bench_training.py --steps 20 --repeats 5
	$(BIN)/python benchmarks/bench_training.py --one-job --steps 20 --repeats 9
	$(BIN)/python benchmarks/bench_allreduce.py --repeats 20
	$(BIN)/python benchmarks/bench_pieces.py
	$(BIN)/python benchmarks/bench_allreduce_passes.py
	$(BIN)/python benchmarks/bench_multinode.py --repeats 9 --starts 5
	$(BIN)/python benchmarks/bench_multinode.py --no-start --ops broadcast,allgather --repeats 9
	$(BIN)/python benchmarks/bench_scale.py
	$(BIN)/python benchmarks/bench_redraw.py
	$(BIN)/python benchmarks/bench_overhead.py --reps 3 --phase-cells 12
	$(BIN)/python benchmarks/bench_overhead.py -n 1 --threads 1 --reps 3 --phase-cells 6
	$(BIN)/python benchmarks/bench_browser.py

# the one prepared check for a GPU machine (skips every row without one)
gpu-check: install
	$(BIN)/python benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) build
