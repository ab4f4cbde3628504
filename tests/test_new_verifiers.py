"""The multiple-choice, generous-numeric, grounding (IoU) and symbolic-math verifiers, on hand-derived values."""

from __future__ import annotations

import sys
import threading

import pytest

from mmgrpo import registry
from mmgrpo.errors import ConfigError, VerifierError
from mmgrpo.verifier import Episode, Verifier, check_verifier
from mmgrpo.verifiers.choice import choice_index, multiple_choice
from mmgrpo.verifiers.grounding import (
    box_f1,
    box_iou,
    iou_match,
    iou_reward,
    map_box,
    match_boxes,
    parse_boxes,
)
from mmgrpo.verifiers.math_answer import last_boxed, math_equiv
from mmgrpo.verifiers.numeric import number_equiv, parse_numeric


def ep(completion: str, **task: object) -> Episode:
    return Episode(completion=completion, task=dict(task))


def tagged(text: str, **task: object) -> Episode:
    return ep(f"<think>...</think><answer>{text}</answer>", **task)


# == multiple_choice ========================================================================================
CHOICES = ["cats", "dogs", "birds", "fish"]  # A, B, C, D; the right one is B


@pytest.mark.parametrize(
    "answer",
    [
        "B",
        "b",
        "(B)",
        "[B]",
        "B.",
        "B:",
        "B) dogs",
        "(B) dogs",
        "B. Dogs",
        "the answer is B",
        "The answer is b.",
        "Answer: (b)",
        "Option B",
        "I think B is right",
        "dogs",
        "  DOGS ",
        "Dogs.",
    ],
)
def test_multiple_choice_accepts_the_usual_forms(answer):
    assert multiple_choice()(tagged(answer, answer="B", choices=CHOICES)) == 1.0


@pytest.mark.parametrize(
    "answer",
    [
        "A",
        "C",
        "(A) or (B)",
        "A or B",
        "B, not C",
        "A) cats or B) dogs",
        "B) cats",  # ambiguous / contradicts
        "cats",
        "E",
        "",
        "I don't know",
        "A cat",
    ],
)
def test_multiple_choice_rejects(answer):
    assert multiple_choice()(tagged(answer, answer="B", choices=CHOICES)) == 0.0


def test_multiple_choice_target_forms():
    fn = multiple_choice()
    for target in ["B", "(B)", 1, "1", "dogs", "Dogs", ["B", "C"]]:
        assert fn(tagged("B", answer=target, choices=CHOICES)) == 1.0, target
    assert fn(tagged("C", answer=["B", "C"], choices=CHOICES)) == 1.0  # a list of accepted answers
    assert multiple_choice(index_base=1)(tagged("B", answer=2, choices=CHOICES)) == 1.0
    assert multiple_choice(index_base=1)(tagged("A", answer=1, choices=CHOICES)) == 1.0
    assert fn(tagged("B", answer="B")) == 1.0  # no options listed: letters A-Z
    assert fn(tagged("Vitamin C", answer="vitamin c")) == 1.0  # no options: text against text
    assert fn(tagged("C", answer="vitamin c")) == 0.0


def test_multiple_choice_tag_field_and_errors():
    assert multiple_choice()(ep("B", answer="B")) == 0.0  # no <answer> tag, no credit
    assert multiple_choice(tag=None)(ep(" (B) ", answer="B")) == 1.0
    assert (
        multiple_choice(field="label", choices_field="opts")(tagged("dogs", label="B", opts=CHOICES)) == 1.0
    )
    with pytest.raises(VerifierError, match=r"no field 'label'.*\['answer'\]"):
        multiple_choice(field="label")(tagged("B", answer="B"))
    with pytest.raises(VerifierError, match="out of range"):
        multiple_choice()(tagged("B", answer=7, choices=CHOICES))
    with pytest.raises(VerifierError, match="neither an option letter"):
        multiple_choice()(tagged("B", answer="horses", choices=CHOICES))
    with pytest.raises(VerifierError, match="non-empty list"):
        multiple_choice()(tagged("B", answer="B", choices="cats, dogs"))
    with pytest.raises(ConfigError, match="index_base"):
        multiple_choice(index_base=2)


def test_choice_index():
    assert choice_index("(C)") == 2
    assert choice_index("D", CHOICES) == 3
    assert choice_index("E", CHOICES) == 4  # a bare label out of range still names it (and scores 0)
    assert choice_index("I pick C.") == 2
    assert choice_index("A is correct") == 0
    assert choice_index("A cat sits here") is None  # an article, not a label
    assert choice_index("the answer is a cat") is None
    assert choice_index("fish", CHOICES) == 3
    assert choice_index("B and D") is None


# == number_equiv / parse_numeric ===========================================================================
@pytest.mark.parametrize(
    "text, value",
    [
        ("3/4", 0.75),
        ("-3/4", -0.75),
        ("1 1/2", 1.5),
        ("-1 1/2", -1.5),
        ("2 1/4", 2.25),
        ("1½", 1.5),
        ("1,000", 1000.0),
        ("1 000", 1000.0),
        ("12 345 678", 12345678.0),
        ("1,234.5", 1234.5),
        ("1\\,000", 1000.0),
        ("1{,}000", 1000.0),
        ("50%", 50.0),
        ("50\\%", 50.0),
        ("12.5 percent", 12.5),
        ("12 cm", 12.0),
        ("3.5kg", 3.5),
        ("$5", 5.0),
        ("-$5", -5.0),
        ("5 dollars", 5.0),
        ("€1,234.50", 1234.5),
        ("USD 20", 20.0),
        ("9.8 m/s^2", 9.8),
        ("12 m²", 12.0),
        ("90°", 90.0),
        ("90^\\circ", 90.0),
        ("\\frac{3}{4}", 0.75),
        ("\\dfrac{3}{4}", 0.75),
        ("\\tfrac{1}{8}", 0.125),
        ("-\\frac{1}{2}", -0.5),
        ("\\frac12", 0.5),
        ("1\\frac{1}{2}", 1.5),
        ("$\\frac{1}{4}$", 0.25),
        ("\\boxed{42}", 42.0),
        ("5\\text{ apples}", 5.0),
        ("x = 7", 7.0),
        ("1.5e-3", 0.0015),
        ("2E3", 2000.0),
        ("1.5 \\times 10^{-3}", 0.0015),
        ("3 x 10^5", 300000.0),
        ("3*10^2", 300.0),
        (".5", 0.5),
        ("5.", 5.0),
        ("1 000/4", 250.0),
    ],
)
def test_parse_numeric_accepts(text, value):
    assert parse_numeric(text) == pytest.approx(value, rel=1e-12)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "five",
        "5 or 6",
        "1 2",
        "12 cm 5 mm",
        "1,5",
        "1,0000",
        "3/0",
        "1 3/2",
        "+-5",
        "2π",
        "3i",
        "5x",
        "5-6",
        "nan",
        "inf",
        "3 apples and 4 pears",
        "\\sqrt{2}",
        "10^3",
        "a b c d e 5",
    ],
)
def test_parse_numeric_rejects(text):
    assert parse_numeric(text) is None


def test_parse_numeric_percent_as_fraction():
    assert parse_numeric("50%", percent_as_fraction=True) == 0.5
    assert parse_numeric("12.5\\%", percent_as_fraction=True) == 0.125
    assert parse_numeric("50", percent_as_fraction=True) == 50.0  # only percentages change


def test_number_equiv_forms_and_targets():
    fn = number_equiv()
    assert fn(tagged("3/4", answer=0.75)) == 1.0
    assert fn(tagged("0.75", answer="3/4")) == 1.0
    assert fn(tagged("\\frac{3}{4}", answer="0.75")) == 1.0
    assert fn(tagged("1 1/2", answer="3/2")) == 1.0
    assert fn(tagged("$1,000", answer=1000)) == 1.0
    assert fn(tagged("12 cm", answer="12")) == 1.0
    assert fn(tagged("0.1 + 0.2", answer=0.3)) == 0.0  # an expression is no number here (use math_equiv)
    assert fn(tagged(str(0.1 + 0.2), answer=0.3)) == 1.0  # float noise is within the default rel_tol
    assert fn(tagged("4", answer=["3", "4"])) == 1.0
    assert fn(tagged("5", answer="4")) == 0.0
    assert fn(ep("3/4", answer=0.75)) == 0.0  # no tag, no credit
    assert number_equiv(tag=None)(ep(" 3/4 ", answer=0.75)) == 1.0


def test_number_equiv_percentages():
    assert number_equiv()(tagged("50%", answer=50)) == 1.0
    assert number_equiv()(tagged("50%", answer=0.5)) == 0.0
    assert number_equiv(percent_as_fraction=True)(tagged("50%", answer=0.5)) == 1.0
    assert number_equiv(percent_as_fraction=True)(tagged("50%", answer=50)) == 0.0
    assert number_equiv(percent_as_fraction=True)(tagged("0.5", answer="50%")) == 1.0  # both sides read alike


def test_number_equiv_tolerances():
    # rel_tol: 1% of 100 = 1
    assert number_equiv(rel_tol=0.01)(tagged("101", answer=100)) == 1.0
    assert number_equiv(rel_tol=0.01)(tagged("101.5", answer=100)) == 0.0
    # abs_tol: within 0.5 of 3
    assert number_equiv(abs_tol=0.5)(tagged("3.4", answer=3)) == 1.0
    assert number_equiv(abs_tol=0.5)(tagged("3.6", answer=3)) == 0.0
    # 1/3 vs 0.3333: off by 3.3e-5, which is 1e-4 relative
    assert number_equiv()(tagged("0.3333", answer="1/3")) == 0.0
    assert number_equiv(rel_tol=1e-3)(tagged("0.3333", answer="1/3")) == 1.0
    assert number_equiv(abs_tol=1e-9)(tagged("0", answer=0)) == 1.0


def test_number_equiv_errors():
    with pytest.raises(VerifierError, match=r"no field 'count'.*\['answer'\]"):
        number_equiv(field="count")(tagged("3", answer="3"))
    with pytest.raises(VerifierError, match="not a number"):
        number_equiv()(tagged("3", answer="three"))
    with pytest.raises(ConfigError, match="rel_tol"):
        number_equiv(rel_tol=-1)
    with pytest.raises(ConfigError, match="abs_tol"):
        number_equiv(abs_tol=float("nan"))
    with pytest.raises(ConfigError, match="percent_as_fraction"):
        number_equiv(percent_as_fraction="yes")


# == grounding ==============================================================================================
def test_box_iou_by_hand():
    assert box_iou([0, 0, 10, 10], [5, 5, 15, 15]) == pytest.approx(25 / 175)  # 5x5 overlap, 100+100-25
    assert box_iou([0, 0, 10, 10], [0, 0, 10, 10]) == 1.0
    assert box_iou([0, 0, 10, 10], [0, 0, 5, 10]) == 0.5  # contained: 50 / 100
    assert box_iou([0, 0, 10, 10], [10, 0, 20, 10]) == 0.0  # touching edges
    assert box_iou([0, 0, 10, 10], [20, 20, 30, 30]) == 0.0
    assert box_iou([0, 0, 10, 10], [1, 1, 11, 11]) == pytest.approx(81 / 119)  # 9x9 overlap, 200-81
    assert box_iou([10, 10, 0, 0], [0, 0, 10, 10]) == 0.0  # inverted: no area
    assert box_iou([0, 0, 0, 10], [0, 0, 0, 10]) == 0.0  # degenerate


def test_map_box_by_hand():
    # original 1000x600, the model saw 500x400: x * 2, y * 1.5
    assert map_box([10, 20, 30, 40], "resized", [1000, 600], [500, 400]) == (20.0, 30.0, 60.0, 60.0)
    # 0..1000 grid on a 640x480 image: x * 0.64, y * 0.48
    assert map_box([500, 250, 1000, 750], "normalized_1000", [640, 480]) == (320.0, 120.0, 640.0, 360.0)
    assert map_box([1, 2, 3, 4], "original") == (1.0, 2.0, 3.0, 4.0)
    with pytest.raises(VerifierError, match="model saw"):
        map_box([1, 2, 3, 4], "resized", [100, 100])
    with pytest.raises(VerifierError, match="image_size"):
        map_box([1, 2, 3, 4], "normalized_1000", [0, 100])
    with pytest.raises(ConfigError, match="coords"):
        map_box([1, 2, 3, 4], "pixels", [100, 100])


@pytest.mark.parametrize(
    "text, boxes",
    [
        ("[10, 20, 30, 40]", [(10, 20, 30, 40)]),
        ("The cat is at [10.5, 20, 30, 40.25].", [(10.5, 20, 30, 40.25)]),
        ('{"bbox_2d": [1, 2, 3, 4], "label": "cat"}', [(1, 2, 3, 4)]),
        (
            '```json\n[\n\t{"bbox_2d": [1, 2, 3, 4], "label": "cat"},\n\t{"bbox_2d": [5, 6, 7, 8], "label": "dog"}\n]\n```',
            [(1, 2, 3, 4), (5, 6, 7, 8)],
        ),
        ("[[1, 2, 3, 4], [5, 6, 7, 8]]", [(1, 2, 3, 4), (5, 6, 7, 8)]),
        ("first [1, 2, 3, 4] then [5, 6, 7, 8]", [(1, 2, 3, 4), (5, 6, 7, 8)]),
        ('{"bbox": [1, 2, 3, 4]}', [(1, 2, 3, 4)]),
        ("(10,20),(30,40)", [(10, 20, 30, 40)]),
        ("<|box_start|>(10, 20), (30, 40)<|box_end|>", [(10, 20, 30, 40)]),
        ("(1,2),(3,4) and (5,6),(7,8)", [(1, 2, 3, 4), (5, 6, 7, 8)]),
        ("[]", []),
        ("no box here", []),
        ("[1, 2, 3]", []),
        ("[1, 2, 3, 4", []),
        ('{"label": "cat"}', []),
        ("[true, 2, 3, 4]", []),
        (
            '[{"bbox_2d": [1, 2, 3, 4]}, {"bbox_2d": [5, 6, 7, 8]}, {"bbox_2d": [9',
            [(1, 2, 3, 4), (5, 6, 7, 8)],
        ),
        ("[0, 1, 2, 3, 4]", []),  # five numbers are no box
        ("[-1.5, 2e2, 3, 4]", [(-1.5, 200, 3, 4)]),
    ],
)
def test_parse_boxes(text, boxes):
    assert parse_boxes(text) == [tuple(float(v) for v in b) for b in boxes]


def test_parse_boxes_degenerate_output_is_fast():
    # a generation stuck in a loop: one linear scan, not a JSON decode from every bracket
    assert parse_boxes("[1," * 20000) == [] and parse_boxes("[" * 20000) == []
    assert len(parse_boxes("[1, 2, 3, 4]" * 5000)) == 5000


def test_match_boxes_by_hand():
    predicted = [[0, 0, 10, 10], [100, 100, 110, 110], [50, 50, 60, 60]]
    truth = [[1, 1, 11, 11], [50, 50, 60, 60]]
    matched = match_boxes(predicted, truth)
    assert [(i, j) for i, j, _ in matched] == [(0, 0), (2, 1)]
    assert matched[0][2] == pytest.approx(81 / 119) and matched[1][2] == 1.0
    # two predictions compete for one true box: the better (IoU 1.0) wins, the other (IoU 0.8) stays unmatched
    assert match_boxes([[0, 0, 10, 8], [0, 0, 10, 10]], [[0, 0, 10, 10]]) == [(1, 0, 1.0)]
    # the threshold: IoU 81/119 ~ 0.68 passes 0.5, fails 0.7
    assert match_boxes([[0, 0, 10, 10]], [[1, 1, 11, 11]], threshold=0.7) == []
    assert match_boxes([], truth) == [] and match_boxes(predicted, []) == []


# original 1000x600, the model saw 500x400: a model box (x, y) is (2x, 1.5y) in original pixels
SIZES = {"image_size": [1000, 600], "model_image_size": [500, 400]}


def test_iou_reward_maps_the_resized_box_back():
    fn = iou_reward()
    truth = [20, 30, 60, 60]
    # [10,20,30,40] in the model's pixels is exactly [20,30,60,60] in the original
    assert fn(tagged('[{"bbox_2d": [10, 20, 30, 40], "label": "cat"}]', box=truth, **SIZES)) == 1.0
    # [10,20,20,40] -> [20,30,40,60]: half of the true box, IoU 600 / 1200 = 0.5
    assert fn(tagged("[10, 20, 20, 40]", box=truth, **SIZES)) == 0.5
    # compared unmapped the same answer is [10,20,30,40] vs [20,30,60,60]: 10*10 / (400 + 1200 - 100) = 1/15
    assert iou_reward(coords="original")(tagged("[10, 20, 30, 40]", box=truth)) == pytest.approx(1 / 15)
    # Qwen2-VL's 0..1000 grid: [20,50,60,100] -> x*1, y*0.6 -> [20,30,60,60]
    grid = iou_reward(coords="normalized_1000")
    assert grid(tagged("(20,50),(60,100)", box=truth, image_size=[1000, 600])) == 1.0
    # Qwen2.5-VL's bare fenced JSON, read from the whole completion
    qwen = '```json\n[{"bbox_2d": [10, 20, 30, 40], "label": "cat"}]\n```'
    assert iou_reward(tag=None)(ep(qwen, box=truth, **SIZES)) == 1.0


def test_iou_reward_zero_cases_and_alternatives():
    fn = iou_reward()
    truth = [20, 30, 60, 60]
    assert fn(ep("[10, 20, 30, 40]", box=truth, **SIZES)) == 0.0  # no tag
    assert fn(tagged("somewhere on the left", box=truth, **SIZES)) == 0.0  # no box
    assert fn(tagged("[10, 20, 30, 40] or [0, 0, 5, 5]", box=truth, **SIZES)) == 0.0  # two boxes: which?
    # a list of accepted true boxes: the best counts
    assert fn(tagged("[10, 20, 30, 40]", box=[[0, 0, 1, 1], truth], **SIZES)) == 1.0


def test_iou_match_threshold():
    truth = [20, 30, 60, 60]
    half = tagged("[10, 20, 20, 40]", box=truth, **SIZES)  # IoU 0.5
    assert iou_match()(half) == 1.0  # >= 0.5
    assert iou_match(threshold=0.6)(half) == 0.0
    assert iou_match()(tagged("[0, 0, 1, 1]", box=truth, **SIZES)) == 0.0
    with pytest.raises(ConfigError, match="threshold"):
        iou_match(threshold=0)
    with pytest.raises(ConfigError, match="coords"):
        iou_match(coords="absolute")


def test_box_f1_by_hand():
    fn = box_f1(coords="original")
    truth = [[1, 1, 11, 11], [50, 50, 60, 60]]
    # 3 predicted, 2 true, 2 matched: P = 2/3, R = 1, F1 = 2*2 / (3+2) = 0.8
    three = "[[0, 0, 10, 10], [100, 100, 110, 110], [50, 50, 60, 60]]"
    assert fn(tagged(three, boxes=truth)) == pytest.approx(0.8)
    # 1 predicted, 2 true, 1 matched: F1 = 2 / 3
    assert fn(tagged("[50, 50, 60, 60]", boxes=truth)) == pytest.approx(2 / 3)
    assert fn(tagged("[[1, 1, 11, 11], [50, 50, 60, 60]]", boxes=truth)) == 1.0
    assert fn(tagged("nothing", boxes=truth)) == 0.0
    assert fn(ep(three, boxes=truth)) == 0.0  # no tag
    # nothing to find: answering no box is right
    assert fn(tagged("[]", boxes=[])) == 1.0
    assert fn(tagged("[1, 2, 3, 4]", boxes=[])) == 0.0
    # a single true box is one object; resized coordinates are mapped as for iou_reward
    assert box_f1()(tagged('[{"bbox_2d": [10, 20, 30, 40]}]', boxes=[20, 30, 60, 60], **SIZES)) == 1.0


def test_grounding_missing_fields_name_them():
    with pytest.raises(VerifierError, match=r"no field 'box'.*\['boxes'"):
        iou_reward()(tagged("[1, 2, 3, 4]", boxes=[[1, 2, 3, 4]], **SIZES))
    with pytest.raises(VerifierError, match="no field 'model_image_size'"):
        iou_reward()(tagged("[1, 2, 3, 4]", box=[1, 2, 3, 4], image_size=[10, 10]))
    with pytest.raises(VerifierError, match="no field 'image_size'"):
        iou_reward(coords="normalized_1000")(tagged("no box", box=[1, 2, 3, 4]))  # even without a box
    assert iou_reward(coords="original")(tagged("[1, 2, 3, 4]", box=[1, 2, 3, 4])) == 1.0  # needs no sizes
    with pytest.raises(VerifierError, match="not a box"):
        iou_reward()(tagged("[1, 2, 3, 4]", box="1,2,3,4", **SIZES))
    # the strict protocol check passes it on (Rewards would count it as a failure and score 0.0)
    with pytest.raises(VerifierError, match="no field 'model_image_size'"):
        check_verifier(
            Verifier("iou", iou_reward()), [tagged("[1, 2, 3, 4]", box=[1, 2, 3, 4], image_size=[1, 1])]
        )


# == math_equiv =============================================================================================
@pytest.fixture(scope="module")
def math_fn():
    return math_equiv()


@pytest.mark.parametrize(
    "prediction, gold",
    [
        ("0.5", "\\frac{1}{2}"),
        ("\\frac{1}{2}", "0.5"),
        ("1/2", 0.5),
        ("(x+1)^2", "x^2+2x+1"),
        ("x^2+2x+1", "(x+1)^2"),
        ("2^{1/2}", "\\sqrt{2}"),
        ("$\\frac{\\pi}{2}$", "\\pi/2"),
        ("\\boxed{3}", 3),
        ("sqrt(2)", "\\sqrt{2}"),  # plain text, read when reading it as LaTeX finds nothing
    ],
)
def test_math_equiv_equivalent(math_fn, prediction, gold):
    assert math_fn(tagged(prediction, answer=gold)) == 1.0


@pytest.mark.parametrize(
    "prediction, gold",
    [
        ("0.6", "\\frac{1}{2}"),
        ("(x+1)^3", "x^2+2x+1"),
        ("x^2+2x", "(x+1)^2"),
        ("", "1"),
        ("\\sqrt{3}", "\\sqrt{2}"),
    ],
)
def test_math_equiv_wrong(math_fn, prediction, gold):
    assert math_fn(tagged(prediction, answer=gold)) == 0.0


def test_math_equiv_boxed_fallback_and_whole_completion(math_fn):
    solution = "Half of the pie is left, so the answer is \\boxed{\\frac{1}{2}}."
    assert math_fn(ep(solution, answer="0.5")) == 1.0  # no <answer> tag: the last \boxed
    assert math_equiv(boxed=False)(ep(solution, answer="0.5")) == 0.0
    assert math_fn(ep("I give up.", answer="0.5")) == 0.0
    assert math_equiv(tag=None)(ep("Expanding, the result is $\\boxed{(x+1)^2}$.", answer="x^2+2x+1")) == 1.0
    assert math_fn(tagged("4", answer=["3", "4"])) == 1.0
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{2}{3}}") == "\\frac{2}{3}"
    assert last_boxed("\\boxed{unclosed") is None


def test_math_equiv_works_outside_the_main_thread(math_fn):
    results: list[object] = []

    def run():
        try:
            results.append(math_fn(tagged("\\frac{1}{2}", answer="0.5")))
        except Exception as exc:  # pragma: no cover - the failure this test guards against
            results.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=30)
    assert results == [1.0]


def test_math_equiv_errors(monkeypatch):
    with pytest.raises(VerifierError, match=r"no field 'solution'"):
        math_equiv(field="solution")(tagged("1", answer="1"))
    with pytest.raises(ConfigError, match="timeout_seconds"):
        math_equiv(timeout_seconds=1.5)
    monkeypatch.setitem(sys.modules, "math_verify", None)  # as if it were not installed
    with pytest.raises(ConfigError, match="pip install math-verify"):
        math_equiv()


def test_math_equiv_missing_package_fails_when_made_from_config(monkeypatch):
    registry._reset_for_tests()
    try:
        registry.register_verifier("math_equiv_test", math_equiv)
        assert registry.make_verifier("math_equiv_test", weight=2.0).weight == 2.0
        monkeypatch.setitem(sys.modules, "math_verify", None)
        with pytest.raises(ConfigError, match="pip install math-verify"):
            registry.make_verifier("math_equiv_test")
    finally:
        registry._reset_for_tests()


def test_new_verifiers_build_through_the_registry():
    registry._reset_for_tests()
    try:
        for name, factory in [
            ("test_mc", multiple_choice),
            ("test_num", number_equiv),
            ("test_iou", iou_reward),
            ("test_f1", box_f1),
        ]:
            registry.register_verifier(name, factory)
        v = registry.make_verifier("test_num", rel_tol=0.01)
        assert v.fn(tagged("101", answer=100)) == 1.0
        with pytest.raises(ConfigError, match="rel_tol"):
            registry.make_verifier(
                "test_num", rel_tolerance=0.01
            )  # a misspelt setting is caught at config time
    finally:
        registry._reset_for_tests()
