"""The boundary between ortwrap and the framework underneath.

``ortwrap._compat.torch`` owns every private PyTorch name ortwrap touches (and the torch-version
flags); no other module of the package may use one (``tests/test_compat.py`` checks the source).
"""
