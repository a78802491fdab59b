"""Run every benchmark in sequence (make bench).

In an engine venv (``ORT_EXTRA=ort``: no training build), the benchmarks of the training engine's own
machinery are left out: the engines side by side on the LM (eager, torch.compile, each installed
engine) and the zoo's quick run on the installed engine run there.
"""

from __future__ import annotations

import bench_engines
import bench_zoo
import torch

from ortwrap.engines import is_training_available

if __name__ == "__main__":
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if is_training_available():
        import bench_cpu_fallback
        import bench_lm
        import bench_mlp
        import bench_overhead
        import bench_pythonop
        import bench_threads
        import profile_lm

        bench_mlp.main()
        bench_lm.main()
        profile_lm.main()
        bench_overhead.main()
        bench_pythonop.main()
        bench_threads.main()
        bench_cpu_fallback.main()
    else:
        print("no onnxruntime-training here: the training engine's benchmarks are left out (docs/engines.md)")
    bench_engines.main()
    bench_zoo.main(["--quick"])
