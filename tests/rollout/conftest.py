from tests.node.conftest import other_model, tiny_model  # noqa: F401  (shared fixtures)
