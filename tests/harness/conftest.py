from tests.node.conftest import (  # noqa: F401  (shared fixtures)
    backend,
    build_tiny_model,
    codec,
    make_validator,
    other_model,
    tiny_model,
)
