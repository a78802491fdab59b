"""Run every benchmark in sequence (make bench)."""

from __future__ import annotations

import bench_cpu_fallback
import bench_lm
import bench_mlp
import bench_overhead
import bench_pythonop
import bench_threads
import bench_zoo
import profile_lm
import torch

if __name__ == "__main__":
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    bench_mlp.main()
    bench_lm.main()
    profile_lm.main()
    bench_overhead.main()
    bench_pythonop.main()
    bench_threads.main()
    bench_cpu_fallback.main()
    bench_zoo.main(["--quick"])
