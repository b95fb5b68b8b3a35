import pytest

from rewards import (
    Problem,
    RewardFn,
    TaskError,
    UnknownTaskError,
    available,
    get_reward_fn,
    register,
    reward,
)


def test_builtins_registered():
    assert {"arithmetic", "countdown", "reverse_text", "code", "gsm8k", "numeric"} <= set(
        available()
    )
    for name in available():
        assert isinstance(get_reward_fn(name), RewardFn)


def test_unknown_task():
    with pytest.raises(UnknownTaskError):
        get_reward_fn("no-such-task")


def test_register_refuses_silent_shadowing_and_checks_range():
    class Bad:
        name = "test-out-of-range"

        def __call__(self, completion, problem):
            return 2.0

    register(Bad())
    with pytest.raises(TaskError):
        register(Bad())
    p = Problem(id="x", task="test-out-of-range", prompt="p", answer="a")
    with pytest.raises(TaskError):
        reward("test-out-of-range", "a", p)


def test_completion_must_be_str():
    p = Problem(id="x", task="arithmetic", prompt="1+1=", answer="2")
    with pytest.raises(TypeError):
        reward("arithmetic", b"2", p)  # type: ignore[arg-type]
