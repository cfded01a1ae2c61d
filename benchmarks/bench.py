"""Side-by-side benchmarks; the same as `dyndepth bench` (see `dyndepth bench --help`).

python benchmarks/bench.py [WORKLOAD ...] [--quick] [--repeats 5] [--json FILE]
"""

from dyndepth_app.bench import main

if __name__ == "__main__":
    main()
