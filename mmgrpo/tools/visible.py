"""Control characters in tool output made visible, not executed: ``visible(text)``.

What a tool returns reaches the model, transcripts, logs and, sooner or later, a person's terminal. Model-
written code (the ``python`` tool) and remote servers (the HTTP tools) choose that text, and a terminal runs
the control sequences inside it: ``ESC ]0;`` retitles the window, ``ESC ]52;`` writes the clipboard,
``ESC ]8;`` hides a link behind other text, ``ESC [2J`` clears the screen, a carriage return overwrites what
was printed before it. ``visible`` writes every such character as its Python escape (``ESC`` becomes the
four characters ``\\x1b``), so that the sequence shows as text: C0 controls other than newline and tab,
DEL, the C1 controls (U+0080 to U+009F, the one-character ``CSI`` and ``OSC`` included) and the Unicode
bidirectional overrides and isolates (U+202A-U+202E, U+2066-U+2069: text that reads differently from what
it holds). Everything else, other scripts and emoji included, is kept as it is.

The tool runner (:mod:`mmgrpo.tools.runner`) passes every tool's text through it, results and failure
messages alike, and the ``python`` tool its own stdout and stderr before it cuts them.
"""

from __future__ import annotations

_CONTROLS = [c for c in range(0x20) if c not in (0x09, 0x0A)] + list(range(0x7F, 0xA0))
_BIDI = list(range(0x202A, 0x202F)) + list(range(0x2066, 0x206A))
_TABLE = {c: f"\\x{c:02x}" for c in _CONTROLS} | {c: f"\\u{c:04x}" for c in _BIDI}


def visible(text: str) -> str:
    """``text`` with its control characters written as escapes (``"\\x1b]52;c;..."`` for ESC ] 52 ...)."""
    return text.translate(_TABLE)
