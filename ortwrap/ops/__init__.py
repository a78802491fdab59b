"""ortwrap's own ops and kernels: one declaration each (see ``ops/mappers.py``)."""
