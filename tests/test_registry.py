"""Registry: register/make/list, errors that teach, entry-point discovery, a third-party plugin, and a
check over every registered verifier."""

from __future__ import annotations

import warnings
from pathlib import Path

import gymnasium
import pytest

from mmgrpo import registry
from mmgrpo.errors import ConfigError, RegistryError
from mmgrpo.verifier import Episode, Verifier, check_verifier

PLUGIN_DIR = Path(__file__).parent / "fixtures" / "plugin"
BUILTIN_VERIFIERS = {"exact_match", "format", "number_distance", "number_match"}


@pytest.fixture(autouse=True)
def fresh_registry():
    registry._reset_for_tests()
    yield
    registry._reset_for_tests()


@pytest.fixture
def plugin_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGIN_DIR))
    registry._reset_for_tests()
    yield PLUGIN_DIR


class ToyEnv(gymnasium.Env):
    """A one-turn toy env for registry tests."""

    def __init__(self, size: int = 3, colour: str = "red") -> None:
        self.size = size
        self.colour = colour

    def reset(self, seed=None, options=None):
        return [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], {"answer": str(self.size)}

    def step(self, action):
        return [], 0.0, True, False, {}


def shout_reward(word: str = "HI"):
    """1.0 when the completion contains the word in capitals."""
    return lambda episode: float(word in episode.completion)


def sample_episodes() -> list[Episode]:
    prompt = [{"role": "user", "content": [{"type": "text", "text": "How many?"}]}]
    texts = ["<answer>3</answer>", "<answer>4</answer>", "3", "", "<think>hm</think><answer>three</answer>"]
    return [
        Episode(
            completion=t,
            messages=[*prompt, {"role": "assistant", "content": [{"type": "text", "text": t}]}],
            task={"answer": "3"},
        )
        for t in texts
    ]


# -- register / make / list --------------------------------------------------------------------------------
def test_register_make_list():
    registry.register_env("toy", ToyEnv)
    registry.register_verifier("shout", shout_reward)
    assert "toy" in registry.list_envs() and "shout" in registry.list_verifiers()
    assert registry.list_verifiers() == sorted(registry.list_verifiers())
    env = registry.make_env("toy", size=5)
    assert isinstance(env, ToyEnv) and env.size == 5
    v = registry.make_verifier("shout", weight=0.5, word="YO")
    assert isinstance(v, Verifier) and v.name == "shout" and v.weight == 0.5
    assert check_verifier(v, [Episode("YO!"), Episode("yo")]) == [1.0, 0.0]
    assert registry.VERIFIERS.source("shout") == "registered in code"


def test_factory_returning_a_verifier_gets_registry_name_and_weight():
    registry.register_verifier(
        "batchy", lambda: Verifier("inner", lambda eps: [1.0] * len(eps), batched=True)
    )
    v = registry.make_verifier("batchy", weight=3.0)
    assert (v.name, v.weight, v.batched) == ("batchy", 3.0, True)


def test_factory_returning_garbage_is_a_config_error():
    registry.register_verifier("garbage", lambda: 42)
    with pytest.raises(ConfigError, match="returned int"):
        registry.make_verifier("garbage")


def test_unknown_name_lists_names_and_suggests():
    with pytest.raises(RegistryError) as info:
        registry.make_verifier("numbr_match")
    message = str(info.value)
    assert "Did you mean 'number_match'?" in message
    assert "exact_match, format, number_distance, number_match" in message  # sorted list of what exists
    with pytest.raises(RegistryError, match="Unknown env 'nope'"):
        registry.make_env("nope")


def test_duplicate_registration():
    registry.register_env("toy", ToyEnv)
    with pytest.raises(RegistryError, match="already registered.*overwrite=True"):
        registry.register_env("toy", ToyEnv)
    with pytest.raises(RegistryError, match="'format' is already registered \\(builtin\\)"):
        registry.register_verifier("format", shout_reward)
    registry.register_verifier("format", shout_reward, overwrite=True)
    assert registry.make_verifier("format").fn(Episode("HI")) == 1.0


def test_bad_kwargs_are_a_config_error_with_signature():
    registry.register_env("toy", ToyEnv)
    with pytest.raises(ConfigError) as info:
        registry.make_env("toy", sise=4)
    message = str(info.value)
    assert "env 'toy'" in message and "sise" in message and "Did you mean 'size'?" in message
    assert "ToyEnv(size: int = 3, colour: str = 'red')" in message
    with pytest.raises(ConfigError, match="verifier 'number_match'.*tolerence.*tolerance"):
        registry.make_verifier("number_match", tolerence=0.1)


def test_type_error_inside_factory_is_not_disguised():
    def buggy(n: int = 1):
        return None + n  # a real bug, not bad kwargs

    registry.register_verifier("buggy", buggy)
    with pytest.raises(TypeError, match="unsupported operand"):
        registry.make_verifier("buggy")


def test_make_env_checks_it_got_an_env():
    registry.register_env("notenv", lambda: object())
    with pytest.raises(Exception, match="no reset\\(\\)/step\\(\\)"):
        registry.make_env("notenv")


# -- entry points ------------------------------------------------------------------------------------------
def test_builtins_discovered_from_entry_points():
    assert BUILTIN_VERIFIERS <= set(registry.list_verifiers())
    assert "counting" in registry.list_envs()  # listing reads names only, imports nothing
    assert registry.VERIFIERS.source("number_match") == "builtin"
    assert (
        registry.make_verifier("number_match", tolerance=0.5).fn(
            Episode("<answer>3.2</answer>", task={"answer": 3})
        )
        == 1.0
    )


def test_plugin_fixture_is_discovered(plugin_on_path):
    assert "demo_echo" in registry.list_envs()
    assert {"demo_length", "demo_broken"} <= set(registry.list_verifiers())
    env = registry.make_env("demo_echo", word="hey")
    messages, info = env.reset(seed=0)
    assert info == {"answer": "hey"} and messages[0]["role"] == "user"
    assert env.step("hey")[1:3] == (1.0, True)
    v = registry.make_verifier("demo_length", max_chars=2)
    assert check_verifier(v, [Episode("ab"), Episode("abcd"), Episode("abcdefg")]) == [0.0, -1.0, -1.0]
    assert registry.VERIFIERS.source("demo_length") == "plugin mmgrpo-demo-plugin"


def test_broken_plugin_warns_and_the_rest_works(plugin_on_path):
    with pytest.warns(
        UserWarning, match=r"'demo_broken'.*mmgrpo-demo-plugin.*ImportError.*not_installed_dependency"
    ):
        with pytest.raises(RegistryError, match="demo_broken"):
            registry.make_verifier("demo_broken")
    assert "demo_broken" not in registry.list_verifiers()
    with pytest.raises(RegistryError, match="failed to load"):  # asked again: the same clear reason
        registry.make_verifier("demo_broken")
    assert registry.make_verifier("demo_length").name == "demo_length"
    assert registry.make_env("demo_echo") is not None


def test_describe_lists_everything_and_survives_a_broken_plugin(plugin_on_path):
    registry.register_verifier("shout", shout_reward)
    with pytest.warns(UserWarning, match="demo_broken"):
        table = registry.describe()
    lines = table.splitlines()
    assert lines[0].split() == ["kind", "name", "source", "description"]
    assert any(line.split()[:2] == ["verifier", "number_match"] and "builtin" in line for line in lines)
    assert any("demo_length" in line and "plugin mmgrpo-demo-plugin" in line for line in lines)
    assert any("shout" in line and "registered in code" in line and "capitals" in line for line in lines)
    assert not any("demo_broken" in line for line in lines)


def test_listing_does_not_import_plugins(plugin_on_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # importing demo_broken would warn
        names = registry.list_verifiers()
    assert "demo_broken" in names


# -- every registered verifier keeps the protocol ----------------------------------------------------------
def _registered_verifiers() -> list[str]:
    registry._reset_for_tests()
    names = registry.list_verifiers()
    registry._reset_for_tests()
    return names


@pytest.mark.parametrize("name", _registered_verifiers())
def test_every_registered_verifier(name):
    v = registry.make_verifier(name)
    values = check_verifier(v, sample_episodes())
    assert len(values) == 5 and all(isinstance(x, float) for x in values)


@pytest.mark.parametrize("name", sorted(BUILTIN_VERIFIERS - {"format"}))
def test_answer_verifiers_give_reference_full_marks_and_wrong_zero(name):
    v = registry.make_verifier(name)
    values = check_verifier(v, sample_episodes())
    # number_distance gives partial credit: "4" for "3" is off by one, 1 - 1/2
    assert values == [1.0, 0.5 if name == "number_distance" else 0.0, 0.0, 0.0, 0.0]
