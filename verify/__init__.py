"""The trust core: pure functions over bytes and arrays, no I/O, no clocks."""
