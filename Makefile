# The two commands (see README): `make demo` runs the main job, `make test` runs the tests.
.PHONY: setup demo test bench ext
setup:
	bash scripts/setup.sh
demo:
	bash scripts/demo.sh
test:
	bash scripts/test.sh
bench: setup
	.venv/bin/python benchmarks/throughput.py
ext: setup
	.venv/bin/python -m kernels.build
