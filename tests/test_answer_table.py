"""The answer table of an evaluation (true answer x answer given) and its picture: what tells a policy
that collapsed onto a few answers from one that is off by one here and there."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from PIL import Image

from mmgrpo.errors import DataError
from mmgrpo.rollout.answers import ANSWERS_MAX, answer_coverage, answer_table, answer_table_lines
from mmgrpo.train.plots import CORRECT_COLOUR, PALETTE, _blend, answer_grid


def _episodes(pairs):
    return [SimpleNamespace(task={"answer": a}, completion=c) for a, c in pairs]


def _collapsed():
    """Counts 1-4: a policy that only says 1 and 3 (2 -> "1" twice and "3" once; 4 -> "3")."""
    say = "<think>...</think><answer>{}</answer>".format
    pairs = [(1, say(1)), (2, say(1)), (2, say(3)), (2, say(" 1 ")), (3, say(3)), (4, say(3)), (4, "four")]
    return _episodes(pairs)


def test_rows_are_true_answers_in_numeric_order_and_columns_what_was_given():
    table = answer_table(_collapsed())
    assert list(table) == ["1", "2", "3", "4"]
    assert table["2"] == {"1": 2, "3": 1}  # the tag's content, stripped; most given first
    assert table["4"] == {"3": 1, "(none)": 1}  # no <answer> tag
    assert answer_table_lines(table)[1] == 'true 2 (n=3): "1" 2, "3" 1'
    assert answer_table_lines(table)[3] == 'true 4 (n=2): "3" 1, (none) 1'


def test_coverage_is_the_share_of_true_answers_given_to_any_task():
    assert answer_coverage(answer_table(_collapsed())) == 0.5  # 1 and 3 given; 2 and 4 never
    say = "<answer>{}</answer>".format
    right = _episodes([(1, say(1)), (2, say(1)), (2, say("2.0")), (3, say(1))])
    assert answer_coverage(answer_table(right)) == 2 / 3  # "2.0" is 2; 3 never given
    assert answer_coverage({}) is None


@pytest.mark.parametrize(
    "answers",
    [
        list(range(ANSWERS_MAX + 1)),  # too many distinct answers to tabulate (free-form numbers)
        [[1, 2]],  # several accepted answers
        ["a sentence far longer than a short answer"],
        [True],
    ],
)
def test_tasks_without_a_few_short_answers_have_no_table(answers):
    assert answer_table(_episodes([(a, "<answer>1</answer>") for a in answers])) == {}


def test_the_picture_shades_each_cell_by_its_share_of_the_row_and_frames_the_right_answers(tmp_path):
    table = answer_table(_collapsed())
    path = answer_grid(table, tmp_path / "answers.png")
    image = Image.open(path).convert("RGB")
    # the columns: the true answers 1-4 (4 never given), then "(none)"; 40-pixel cells from (90, 58)
    cell, left, top = 40, 90, 58

    def at(row: int, col: int, dx: int = 4, dy: int = 4) -> tuple[int, int, int]:
        return image.getpixel((left + col * cell + dx, top + row * cell + dy))

    assert at(1, 0) == _blend(PALETTE[0], 2 / 3)  # true 2 -> "1": 2 of 3
    assert at(1, 2) == _blend(PALETTE[0], 1 / 3)  # true 2 -> "3": 1 of 3
    assert at(1, 1) == (255, 255, 255)  # true 2 -> "2": never
    assert at(1, 1, dx=0, dy=0) == CORRECT_COLOUR  # ... but that is the right answer's cell
    assert at(3, 3) == (255, 255, 255) and at(3, 3, dx=0, dy=0) == CORRECT_COLOUR
    assert at(3, 4) == _blend(PALETTE[0], 1 / 2)  # true 4 -> no answer: 1 of 2
    assert image.width >= left + 5 * cell and image.height >= top + 4 * cell
    with pytest.raises(DataError, match="empty answer table"):
        answer_grid({}, tmp_path / "none.png")


def test_a_step_logs_coverage_only_when_most_episodes_answer():
    from mmgrpo.train.metrics import answer_metrics

    assert answer_metrics(_collapsed()) == {"answer_coverage": 0.5}  # 6 of 7 answered
    unformatted = _episodes([(1, "1"), (2, "two"), (3, "<answer>3</answer>")])
    assert answer_metrics(unformatted) == {}  # 1 of 3 answered: the format is what is missing
    assert answer_metrics(_episodes([(a, "x") for a in range(ANSWERS_MAX + 1)])) == {}  # free-form
