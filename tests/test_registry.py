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
            # grounding verifiers read boxes and the image sizes, the others the answer
            task={
                "answer": "3",
                "box": [0, 0, 10, 10],
                "boxes": [[0, 0, 10, 10]],
                "image_size": [20, 20],
                "model_image_size": [28, 28],
            },
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
    listed = message.split("Registered verifiers: ")[1].split(". ")[0].split(", ")
    assert listed == sorted(listed) and {"exact_match", "format", "number_match"} <= set(listed)
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


# -- TRL-style reward functions ----------------------------------------------------------------------------
def short_reward(completions, max_chars=5, **kwargs):
    """TRL-style, standard (string) format: 1.0 for a completion of at most max_chars characters."""
    return [1.0 if len(c) <= max_chars else 0.0 for c in completions]


def test_trl_function_from_a_plugin_is_wrapped_not_called(plugin_on_path):
    v = registry.make_verifier("demo_trl", weight=2.0)
    assert (v.name, v.weight, v.batched) == ("demo_trl", 2.0, True)
    # sample completions that mention the answer "3": the first and the third
    assert check_verifier(v, sample_episodes()) == [1.0, 0.0, 1.0, 0.0, 0.0]
    half = registry.make_verifier("demo_trl", bonus=0.5)  # a config setting, bound with functools.partial
    assert check_verifier(half, sample_episodes()) == [0.5, 0.0, 0.5, 0.0, 0.0]
    assert registry.VERIFIERS.source("demo_trl") == "plugin mmgrpo-demo-plugin"
    with pytest.warns(UserWarning, match="demo_broken"):
        table = registry.describe()
    assert any("demo_trl" in line and "mentions the answer" in line for line in table.splitlines())


def test_trl_function_registered_in_code():
    registry.register_verifier("short", short_reward)
    assert registry.is_trl_reward(short_reward) and not registry.is_trl_reward(shout_reward)
    v = registry.make_verifier("short", max_chars=3, conversational=False)
    assert check_verifier(v, sample_episodes()) == [0.0, 0.0, 1.0, 1.0, 0.0]
    # conversational (the default): each completion is [{"role": "assistant", ...}], a list of length 1
    assert check_verifier(registry.make_verifier("short", max_chars=3), sample_episodes()) == [1.0] * 5


def test_trl_settings_win_over_task_fields():
    def matches(completions, target, **kwargs):
        return [1.0 if c[0]["content"] == str(target) else 0.0 for c in completions]

    registry.register_verifier("matches", matches)
    episodes = [Episode("x", task={"target": "y"}), Episode("y", task={"target": "y"})]
    assert check_verifier(registry.make_verifier("matches", target="x"), episodes) == [1.0, 0.0]


def test_trl_bad_settings_teach():
    def strict(completions, answer, scale: float = 1.0):
        return [scale] * len(completions)

    registry.register_verifier("strict", strict)
    with pytest.raises(
        ConfigError, match=r"verifier 'strict'.*\['scal'\].*strict\(completions.*Did you mean 'scale'\?"
    ):
        registry.make_verifier("strict", scal=2.0)
    with pytest.raises(ConfigError, match="'completions' cannot be set in the config"):
        registry.make_verifier("strict", completions=[])
    with pytest.raises(ConfigError, match="conversational must be true"):
        registry.make_verifier("strict", conversational="no")
    v = registry.make_verifier("strict", scale=0.5)
    assert check_verifier(v, [Episode("a", task={"answer": "1"})]) == [0.5]


def test_a_factory_may_take_a_name_setting():
    registry.register_verifier("named", lambda name="x": lambda episode: float(episode.completion == name))
    assert registry.make_verifier("named", name="hi").fn(Episode("hi")) == 1.0
    registry.register_env("named_env", lambda name="x": ToyEnv(colour=name))
    assert registry.make_env("named_env", name="blue").colour == "blue"


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
