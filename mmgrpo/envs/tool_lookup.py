"""A two-tool errand: "What do 23 of item 417 cost?" (registered env name ``tool_lookup``).

The price is not in the question: the model must ``lookup`` the item, a call that goes over HTTP to a price
service on 127.0.0.1 which this env starts (``mmgrpo/envs/price_service.py``; the request goes through
``mmgrpo.toolbox.http``, with its URL checks and time limits), then call ``calculator`` on the price it read
times the quantity, then answer. Two calls in sequence, each feeding the next. Some questions
(``priced_prob``, default 0.3) also state the price ("... cost at 38 each?"); then the lookup is a wasted
call, and with the ``tool_call_cost`` verifier (the example's recipe) the same right answer with one call
scores more than with two. So GRPO has a choice to learn as well as a sequence: look the item up when the
price is missing, and only then.

There are 900 items (100-999) with prices drawn from the catalogue seed (``catalogue_seed``), so a policy
cannot learn the price list instead of the tool.

Demonstrations for the warm start (``warm_start.source: env``) teach the calls' syntax and the copying, not
the choice. Each is, whatever the question:

- an answer at once, with a number unrelated to the task (``demo_answer_prob``, default 0.1);
- a lookup first (``demo_lookup_prob``, default 0.25): ``lookup`` on the question's item, then
  ``calculator`` on the price it returned times the quantity, then the answer it returned (right for every
  question, with two calls);
- otherwise the calculator at once: on the stated price times the quantity, or, when the question states no
  price, on a made-up one (wrong), then the answer it returned.

Copy drills (``demo_copy_prob``, default 0.3, drawn first) are the right path for the question with the name of
its first tool shown, not taught (``Shown``): lookup then calculator when the price is missing, the calculator
alone when it is stated; the arguments and the answer are taught. They are also the warm start's check
(``skill_probe``), measured on held-out tasks.

Metrics (``env/...``): ``lookup_unpriced``, the share of episodes without a price that looked the item up (what
GRPO must raise); ``lookup_priced``, the share of priced ones that looked it up anyway (what the call cost
should lower); ``right_calc``, the share that called the calculator on price times quantity.

Determinism: a task is a pure function of ``(seed, split)`` (``scene_seed``), the catalogue of
``catalogue_seed``.
"""

from __future__ import annotations

import random
from typing import Any

from mmgrpo.env import DemoTurn, Shown, Task, system, user
from mmgrpo.envs.counting import scene_seed
from mmgrpo.envs.price_service import Catalogue, shared_price_service
from mmgrpo.envs.tool_env import ToolEnv
from mmgrpo.errors import ConfigError
from mmgrpo.toolbox.calculator import value_of
from mmgrpo.tools.runner import tool_call_text

DEFAULT_SYSTEM_PROMPT = "Use the tools you need, then answer with the number only, inside <answer></answer>."
DEFAULT_QUESTION = "What do {quantity} of item {item} cost?"
DEFAULT_PRICED_QUESTION = "What do {quantity} of item {item} cost at {price} each?"


SERVICE_NAME = "price-service"
"""How the lookup tool's answers name the price service (in errors: "HTTP 404 Not Found from
price-service/prices/4974"), instead of its local address, whose port the OS picks at every run."""


class ToolLookupEnv(ToolEnv):
    """Price ``quantity`` units of an item: look its price up over HTTP (``lookup``), multiply (``calculator``).

    Args (all keyword):
        priced_prob: the share of questions that state the price (the lookup is then a wasted call).
        low, high: quantities are uniform integers in ``[low, high]`` (default 10..99).
        catalogue_seed: the seed of the price list (items 100-999, prices 10-99).
        demo_answer_prob, demo_lookup_prob, demo_copy_prob: the warm-start mix (module docstring).
        system_prompt, question, priced_question: the texts (questions formatted with ``quantity``,
            ``item`` and ``price``).
        timeout_s, max_result_chars, max_calls_per_turn: the tool runner's limits; ``timeout_s`` is also the
            HTTP request's.
    """

    def __init__(
        self,
        *,
        priced_prob: float = 0.3,
        low: int = 10,
        high: int = 99,
        catalogue_seed: int = 0,
        demo_answer_prob: float = 0.1,
        demo_lookup_prob: float = 0.25,
        demo_copy_prob: float = 0.3,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        question: str = DEFAULT_QUESTION,
        priced_question: str = DEFAULT_PRICED_QUESTION,
        timeout_s: float = 5.0,
        max_result_chars: int = 2000,
        max_calls_per_turn: int = 4,
    ) -> None:
        from mmgrpo.toolbox import calculator, make_tool

        for kwarg, p in (
            ("priced_prob", priced_prob),
            ("demo_answer_prob", demo_answer_prob),
            ("demo_lookup_prob", demo_lookup_prob),
            ("demo_copy_prob", demo_copy_prob),
        ):
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
                raise ConfigError(f"ToolLookupEnv({kwarg}={p!r}): expected a probability in [0, 1]")
        if demo_answer_prob + demo_lookup_prob > 1.0:
            raise ConfigError(
                f"ToolLookupEnv: demo_answer_prob + demo_lookup_prob = {demo_answer_prob + demo_lookup_prob} > 1; "
                "the rest is the share of demonstrations that call the calculator at once"
            )
        for kwarg, n in (("low", low), ("high", high), ("catalogue_seed", catalogue_seed)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ConfigError(f"ToolLookupEnv({kwarg}={n!r}): expected an int >= 0")
        if low > high:
            raise ConfigError(f"ToolLookupEnv(low={low}, high={high}): expected low <= high")
        self.catalogue = Catalogue(seed=catalogue_seed)
        self.service = shared_price_service(self.catalogue)
        fetch = make_tool(
            "http_get",
            base_urls=[self.service.url],
            timeout_s=timeout_s,
            max_bytes=2000,
            shown_as=SERVICE_NAME,
        )

        def lookup(item: int) -> str:
            """Look up an item's price in the shop's price list.

            Args:
                item: the item number, e.g. 417
            """
            if isinstance(item, bool) or not isinstance(item, int):
                raise ValueError(f"item must be an item number like 417, got {item!r:.40}")
            return fetch(str(item))

        lookup.timeout_s = fetch.timeout_s  # type: ignore[attr-defined]  # the runner waits this long for it
        super().__init__(
            [lookup, calculator],
            timeout_s=timeout_s,
            max_result_chars=max_result_chars,
            max_calls_per_turn=max_calls_per_turn,
        )
        self.priced_prob, self.low, self.high = priced_prob, low, high
        self.demo_answer_prob, self.demo_lookup_prob = demo_answer_prob, demo_lookup_prob
        self.demo_copy_prob = demo_copy_prob
        self.system_prompt, self.question, self.priced_question = system_prompt, question, priced_question

    def make_task(self, seed: int, split: str) -> Task:
        rng = random.Random(scene_seed(seed, split))
        item = rng.randint(self.catalogue.first, self.catalogue.last)
        quantity = rng.randint(self.low, self.high)
        priced = rng.random() < self.priced_prob
        price = self.service.prices[item]
        text = (self.priced_question if priced else self.question).format(
            quantity=quantity, item=item, price=price
        )
        info = {
            "answer": str(price * quantity),
            "item": item,
            "quantity": quantity,
            "price": price,
            "priced": priced,
        }
        return Task([system(self.system_prompt), user(text)], info)

    skill = "call the right tools in order with the question's item and numbers, and answer with the result"

    def demonstration(self, info: dict[str, Any], rng: random.Random) -> list[DemoTurn]:
        item, quantity, price = info["item"], info["quantity"], info["price"]
        if rng.random() < self.demo_copy_prob:
            return self.skill_probe(info)
        u = rng.random()
        if u < self.demo_answer_prob:  # at once, a number that has nothing to do with the task
            return [f"<answer>{rng.randint(10, 99) * rng.randint(self.low, self.high)}</answer>"]
        if u < self.demo_answer_prob + self.demo_lookup_prob:
            return [
                tool_call_text("lookup", {"item": item}),
                tool_call_text("calculator", {"expression": f"{price} * {quantity}"}),
                f"<answer>{price * quantity}</answer>",
            ]
        guess = price if info["priced"] else rng.randint(10, 99)  # no price stated: a made-up one
        return [
            tool_call_text("calculator", {"expression": f"{guess} * {quantity}"}),
            f"<answer>{guess * quantity}</answer>",
        ]

    def skill_probe(self, info: dict[str, Any]) -> list[DemoTurn]:
        """The question's right path with its first tool's name shown, not taught; the rest taught."""
        item, quantity, price = info["item"], info["quantity"], info["price"]
        calc = tool_call_text("calculator", {"expression": f"{price} * {quantity}"})
        answer = f"<answer>{price * quantity}</answer>"
        if info["priced"]:
            return [_first_name_shown(calc, "calculator"), answer]
        return [_first_name_shown(tool_call_text("lookup", {"item": item}), "lookup"), calc, answer]

    def call_flags(self, info: dict[str, Any], calls: list) -> dict[str, bool]:
        looked = "lookup_priced" if info.get("priced") else "lookup_unpriced"
        asked = info["price"] * info["quantity"]
        return {
            looked: any(c.name == "lookup" and c.arguments.get("item") == info["item"] for c in calls),
            "right_calc": any(
                c.name == "calculator" and value_of(c.arguments.get("expression")) == asked for c in calls
            ),
        }

    @staticmethod
    def reference_completion(info: dict[str, Any]) -> str:
        """A final answer that deserves full reward for the task described by ``info``."""
        return f"<answer>{info['answer']}</answer>"


def _first_name_shown(call: str, name: str) -> tuple[str | Shown, ...]:
    """``call`` in pieces: the tool's name shown (not taught), the rest taught."""
    head, tail = call.split(f'"{name}"', 1)
    return (head + '"', Shown(name), '"' + tail)
