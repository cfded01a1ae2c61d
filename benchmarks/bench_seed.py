"""The seed's workload, side by side: see ``dyndepth bench --help``.

python benchmarks/bench_seed.py [--batch 256] [--dim 64] [--max-depth 100] [--layer tanh]
"""

from dyndepth._bench import main

if __name__ == "__main__":
    main()
