"""Stage: torch.autograd.Function <-> com.microsoft::PythonOp / PythonOpGrad, and ATen ops inside ORT graphs."""
