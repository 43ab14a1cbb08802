"""The tiny float64 model of the server tests, served by 2 Ray Serve replicas."""

from tests.server.conftest import one_torch_thread, tiny_folder, tiny_model  # noqa: F401
