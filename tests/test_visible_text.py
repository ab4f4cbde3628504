"""Text from tools and envs shown to people has its control sequences made visible (issue 53, point 5): a held-out
transcript saved by ``mmgrpo eval`` and the answer table it prints show an OSC 52 (clipboard write) or a bidi
override as escapes, whatever env produced them (the tool runner escapes tool results; an env's own text, e.g.
a PI verifiers env's tool messages, reaches transcripts without it)."""

from __future__ import annotations

from mmgrpo.rollout.answers import answer_table_lines
from mmgrpo.rollout.evaluation import EvalResult, write_transcripts

OSC52 = "\x1b]52;c;cm0gLXJmIH4=\x07"
BIDI = "\u202etxt.exe"


def test_a_transcript_shows_an_env_messages_escape_sequences_as_text(tmp_path):
    messages = [
        {"role": "user", "content": "count"},
        {"role": "tool", "name": "remote", "content": [{"type": "text", "text": f"result {OSC52} {BIDI}"}]},
        {"role": "assistant", "content": f"<answer>3</answer>{OSC52}"},
    ]
    result = EvalResult(accuracy=0.0, n=1, metric="m", transcripts=[messages])
    folder = write_transcripts(result, tmp_path)
    text = (folder / "episode-0.md").read_text()
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
    assert "result \\x1b]52;c;cm0gLXJmIH4=\\x07 \\u202etxt.exe" in text
    assert "<answer>3</answer>\\x1b]52" in text


def test_the_answer_table_shows_escapes_as_text():
    lines = answer_table_lines({"3": {f"3{OSC52}": 2, "(none)": 1}})
    assert lines == ['true 3 (n=3): "3\\x1b]52;c;cm0gLXJmIH4=\\x07" 2, (none) 1']
