"""Tools reach the model in every family: a template with a tools section renders them itself, one without
gets mmgrpo's tools block (mmgrpo.model.tool_prompt) in the system message or the first user message, and a
template that would hide them wherever they go is a ConfigError, never a silent run."""

from __future__ import annotations

import pytest
from PIL import Image

from mmgrpo.env import assistant, system, text_part, tool, user
from mmgrpo.errors import ConfigError
from mmgrpo.model.policy import Policy
from mmgrpo.model.tool_prompt import find_placement, tools_block, with_tools_block
from mmgrpo.tiny.families import FAMILIES, GEMMA3_CHAT_TEMPLATE, VISION_FAMILIES, build_tiny_family
from mmgrpo.tools.calls import tool_call_text
from mmgrpo.tools.runner import tool_schemas


def count_cells(grid_side: int) -> int:
    """Count the cells of a square grid.

    Args:
        grid_side: cells along one side of the zebracorn grid
    """
    return grid_side * grid_side


TOOLS = tool_schemas([count_cells])
NAME, SCHEMA_WORD = "count_cells", "zebracorn"  # the tool's name, a word only its schema holds

# how each tiny family shows tools: its own template's tools section (Qwen's), or mmgrpo's block
PLACEMENT = {f: "template" if f.startswith("qwen") else "system" for f in FAMILIES}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: build_tiny_family(f, root / f.replace(".", "_")) for f in FAMILIES}


@pytest.fixture(scope="module")
def policies(family_dirs):
    return {f: Policy.from_pretrained(path) for f, path in family_dirs.items()}


def _prompt(family: str, with_system: bool) -> list[dict]:
    image = [Image.new("RGB", (32, 32), "white")] if family in VISION_FAMILIES else []
    head = [system("Use the tool, then answer.")] if with_system else []
    return [*head, user(*image, "How many cells in a 3 x 3 grid?")]


@pytest.mark.parametrize("with_system", [True, False], ids=["system", "no-system"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_shows_the_tools(policies, family, with_system):
    policy = policies[family]
    messages = _prompt(family, with_system)
    text = policy.render(messages, tools=TOOLS)
    assert text.count(NAME) == 1 and text.count(SCHEMA_WORD) == 1  # shown, and only once
    assert text.count("# Tools") == 1 and "<tool_call>" in text  # the call format the parser reads
    if with_system:
        assert "Use the tool, then answer." in text
    ids, mask, _ = policy.encode_prompts([messages], [TOOLS])
    decoded = policy.tokenizer.decode(ids[0][mask[0].bool()])
    assert NAME in decoded and SCHEMA_WORD in decoded
    # without tools nothing is added
    assert NAME not in policy.render(messages) and "# Tools" not in policy.render(messages)
    assert policy.tool_placement == PLACEMENT[family]


@pytest.mark.parametrize("family", [f for f in FAMILIES if PLACEMENT[f] == "template"])
def test_a_template_with_a_tools_section_renders_them_itself(policies, family):
    policy = policies[family]
    messages = _prompt(family, with_system=True)
    if policy.is_vision:
        native = policy.processor.apply_chat_template(
            messages, tools=TOOLS, add_generation_prompt=True, tokenize=False
        )
    else:
        flat = [dict(m, content=m["content"][-1]["text"]) for m in messages]
        native = policy.tokenizer.apply_chat_template(
            flat, tools=TOOLS, add_generation_prompt=True, tokenize=False
        )
    assert policy.render(messages, tools=TOOLS) == native
    assert tools_block(TOOLS) in native  # the same block mmgrpo writes for the others


@pytest.mark.parametrize("family", ["llama", "gemma3", "llava"])
def test_multi_turn_continuation_with_mmgrpo_block(policies, family):
    policy = policies[family]
    prompt = _prompt(family, with_system=family != "llava")
    call = tool_call_text(NAME, {"grid_side": 3})
    history = [*prompt, assistant(call)]
    new = [tool(text_part("9"))]
    assert SCHEMA_WORD in policy.render(history + new, tools=TOOLS)  # only the block has it
    ids, _ = policy.encode_continuation(history, new, TOOLS)  # a prefix extension: does not raise
    continuation = policy.tokenizer.decode(ids)
    assert "9" in continuation and NAME not in continuation  # the block stays in the first message
    if not policy.is_vision:  # the prompt, the sampled turn and the continuation: the whole rendering's ids
        prompt_ids, mask, _ = policy.encode_prompts([prompt], [TOOLS])
        turn = policy.encode_text(call) + [policy.end_of_turn_id]
        whole = policy.encode_text(policy.render(history + new, tools=TOOLS))
        assert prompt_ids[0][mask[0].bool()].tolist() + turn + ids == whole


# Gemma 2's rule: no system role at all
NO_SYSTEM_TEMPLATE = (
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}" + GEMMA3_CHAT_TEMPLATE
)


def test_a_template_without_a_system_role_gets_the_block_in_the_first_user_message(family_dirs):
    loaded = Policy.from_pretrained(family_dirs["gemma3"])
    loaded.processor.chat_template = NO_SYSTEM_TEMPLATE
    loaded.tokenizer.chat_template = NO_SYSTEM_TEMPLATE
    policy = Policy(loaded.model, loaded.processor)
    assert policy.tool_placement == "user"
    prompt = _prompt("gemma3", with_system=False)
    text = policy.render(prompt, tools=TOOLS)
    assert text.count(NAME) == 1 and SCHEMA_WORD in text
    assert text.index(NAME) < text.index("How many cells")  # the block opens the first user turn
    history = [*prompt, assistant(tool_call_text(NAME, {"grid_side": 3}))]
    ids, _ = policy.encode_continuation(history, [tool(text_part("9"))], TOOLS)
    assert NAME not in policy.tokenizer.decode(ids)


def test_a_template_that_hides_every_placement_is_a_config_error():
    def render(messages, tools):  # renders turns but none of their text, and no tools section
        return "".join(f"<{m['role']}>" for m in messages)

    with pytest.raises(ConfigError, match="tiny/blind.*chat_template"):
        find_placement(render, "tiny/blind")

    def no_template(messages, tools):
        raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set")

    with pytest.raises(ConfigError, match="rendering failed: ValueError: Cannot use chat template"):
        find_placement(no_template, "plain-lm")


def test_with_tools_block_keeps_content_shapes_and_the_callers_messages():
    block = tools_block(TOOLS)
    as_parts = [system("Be brief."), user("hi")]
    merged = with_tools_block(as_parts, TOOLS, "system")
    assert merged[0]["content"] == [text_part("Be brief."), text_part("\n\n" + block)]
    assert as_parts[0]["content"] == [text_part("Be brief.")]  # not changed in place
    as_str = [{"role": "user", "content": "hi"}]
    assert with_tools_block(as_str, TOOLS, "system") == [
        {"role": "system", "content": block},
        {"role": "user", "content": "hi"},
    ]
    assert with_tools_block(as_str, TOOLS, "user") == [{"role": "user", "content": block + "\n\nhi"}]
    assert with_tools_block([user("hi")], TOOLS, "system")[0] == {
        "role": "system",
        "content": [text_part(block)],
    }
